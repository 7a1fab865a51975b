"""bench/lease_preflight.py: a recipe's config and its warm start's shape checked without the verifier or shards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import lease_preflight as lp  # noqa: E402

from eagle3.errors import UserError  # noqa: E402

CONFIG = str(ROOT / "configs" / "tiny-llama.yaml")


def _export(folder: Path, **drafter_args) -> Path:
    """A folder with an export's files (only their presence is checked here) and its recorded drafter_args."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "eagle3_train.json").write_text(json.dumps({"drafter_args": drafter_args}))
    return folder


def test_a_warm_start_of_another_depth_is_refused_by_name(tmp_path):
    src = _export(
        tmp_path / "d", variant="eagle3.1", num_layers=1, intermediate_size=1536, hidden_size=64
    )
    common = [f"train.init_from={src}", "drafter.variant=eagle3.1"]
    assert lp.check_recipes(
        CONFIG,
        [
            ("one", common + ["drafter.num_layers=1", "drafter.intermediate_size=1536"]),
            ("plain", []),
        ],
    ) == [f"preflight one: ok, warm start from {src}", "preflight plain: ok"]
    with pytest.raises(UserError) as e:
        lp.check_recipes(CONFIG, [("deep", common + ["drafter.num_layers=2"])])
    assert str(e.value) == (
        f"recipe deep: train.init_from: '{src}' holds a drafter with num_layers 1, this run "
        f"trains 2 (drafter.num_layers)"
    )
    with pytest.raises(
        UserError,
        match=r"^recipe wide: .* intermediate_size 1536, this run trains 6144 "
        r"\(drafter.intermediate_size\)$",
    ):
        lp.check_recipes(CONFIG, [("wide", common + ["drafter.intermediate_size=6144"])])
    # an export written before `variant` was recorded is an eagle3 (3.0) drafter
    old = _export(tmp_path / "old", num_layers=1)
    with pytest.raises(
        UserError, match=r"holds a drafter with variant 'eagle3', this run trains 'eagle3.1'"
    ):
        lp.check_recipes(CONFIG, [("v31", [f"train.init_from={old}", "drafter.variant=eagle3.1"])])


def test_cli_one_line_per_recipe_and_one_error_line(tmp_path):
    missing = tmp_path / "nowhere"
    cmd = [sys.executable, str(ROOT / "bench" / "lease_preflight.py"), "--config", CONFIG]
    r = subprocess.run(
        cmd + ["--recipe", "a", "--set", "train.epochs=2", "--recipe", "b"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (r.returncode, r.stdout) == (0, "preflight a: ok\npreflight b: ok\n"), r.stderr
    r = subprocess.run(
        cmd + ["--recipe", "a", "--recipe", "w", "--set", f"train.init_from={missing}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and r.stdout == "preflight a: ok\n"
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: recipe w: train.init_from: folder '{missing}' not found "
        f"(an exported drafter folder: 04's drafter-sglang)"
    )
