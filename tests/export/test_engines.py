"""The engine list has one source (``eagle3.engines``): the config's ``export.engine``, 04's ``--engine``, the export
formats and the messages all read it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import get_args

import pytest

from eagle3.config import ExportConfig
from eagle3.engines import ENGINES, LABELS, others, spelled
from eagle3.errors import UserError
from eagle3.export.formats import FORMATS, VARIANT_ENGINES

ROOT = Path(__file__).resolve().parents[2]
FORMAT_NAMES = (
    "ENGINE ARCH KEYS UPPER_NORM SERVES IDS_KEY LAYER0 VOCAB_MAP_REFUSAL writes_vocab_map warn_dtype build_config "
    "is_format layer_source layer_ids"
).split()


def test_every_place_reads_the_one_list():
    assert ENGINES == ("sglang", "vllm")
    assert get_args(ExportConfig.model_fields["engine"].annotation) == ENGINES
    assert set(LABELS) == set(FORMATS) == set(ENGINES)
    assert {e for serving in VARIANT_ENGINES.values() for e in serving} <= set(ENGINES)
    assert others("sglang") == ("vllm",) and spelled() == "sglang or vllm"
    assert spelled(quote=True) == "'sglang' or 'vllm'"


@pytest.mark.parametrize("engine", ENGINES)
def test_each_format_module_states_the_same_names(engine):
    fmt = FORMATS[engine]
    assert fmt.ENGINE == engine
    missing = [n for n in FORMAT_NAMES if not hasattr(fmt, n)]
    assert missing == []


def test_04_engine_choices_are_the_list(tmp_path):
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "04_train.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(UserError, match=r"invalid choice: 'x' \(choose from 'sglang', 'vllm'\)"):
        cli.main(["--config", str(tmp_path / "c.yaml"), "--engine", "x"])
