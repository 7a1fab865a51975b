"""bench/prepare_reuse.py on hand-made shards: a full 03 pass then a reused one, identical outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_validation_record import _cfg, _shards

from eagle3.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_reuse_bench(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "prepare_reuse", ROOT / "bench" / "prepare_reuse.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _shards(tmp_path)
    cfg_path = _cfg(tmp_path, "a")
    out = tmp_path / "r.json"
    assert mod.main(["--config", str(cfg_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["validation"] == ["full", "reused"] and res["outputs_identical"] is True
    assert (
        res["shards"] == 5 and res["num_tokens"] == 18 and res["full_s"] > 0 and res["reused_s"] > 0
    )
    assert not load_config(cfg_path).data_dir.exists()  # the run's own data folder is left alone
