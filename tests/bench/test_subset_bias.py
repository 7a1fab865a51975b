"""bench/subset_bias.py: subset taus and the batch-1 speedup projection, from hand-made per-prompt rows."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import subset_bias as sb  # noqa: E402

from eagle3.errors import UserError  # noqa: E402

# 4 prompts in set order: [emitted, verify steps]
PP = {"per_prompt": {"mtbench": {"1": [10, 10], "2": [30, 10], "3": [20, 10], "4": [40, 10]}}}


def test_subset_taus_by_hand():
    t = sb.subset_taus(PP, [2])["mtbench"]
    # whole 100/40; first 2 = prompts 1, 2: 40/20; spread 2 = prompts 1, 3 (i * 4 // 2): 30/20
    assert t == {"n": 4, "all": 2.5, "first_2": 2.0, "spread_2": 1.5}


def test_projection_scales_the_measured_speedup_by_the_tau_ratio():
    speed = {
        "dataset": "mtbench",
        "rows": [
            {"batch_size": 1, "num_prompts": 2, "speedup": 1.6, "tau": 1.9, "decoder": "static"}
        ],
    }
    p = sb.projection(speed, PP)  # no prompt_pick recorded: the first 2 (tau 2.0); whole set 2.5
    assert (p["prompt_pick"], p["subset_tau_fp32"], p["set_tau_fp32"]) == ("first", 2.0, 2.5)
    assert p["projected_speedup"] == pytest.approx(1.6 * 2.5 / 2.0)
    assert sb.projection({**speed, "prompt_pick": "spread"}, PP)[
        "projected_speedup"
    ] == pytest.approx(1.6 * 2.5 / 1.5, abs=1e-4)
    with pytest.raises(UserError, match="no successful batch-1 row"):
        sb.projection({"dataset": "mtbench", "rows": [{"batch_size": 1, "error": "x"}]}, PP)
    with pytest.raises(UserError, match="only \\['mtbench'\\]"):
        sb.projection({**speed, "dataset": "gsm8k"}, PP)


def test_cli_writes_json_and_markdown(tmp_path):
    (tmp_path / "pp.json").write_text(json.dumps(PP))
    (tmp_path / "s.json").write_text(
        json.dumps(
            {
                "dataset": "mtbench",
                "rows": [{"batch_size": 1, "num_prompts": 2, "speedup": 1.6, "tau": 1.9}],
            }
        )
    )
    out = tmp_path / "o.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "subset_bias.py"),
            "--run",
            f"a={tmp_path / 'pp.json'}",
            "--speed",
            f"a={tmp_path / 's.json'}",
            "--num",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["projections"][0][1]["projected_speedup"] == 2.0
    assert "| a | mtbench | 4 | 2.50 | 2.00 | 1.50 |" in out.with_suffix(".md").read_text()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "subset_bias.py"),
            "--run",
            f"a={tmp_path / 'pp.json'}",
            "--speed",
            f"b={tmp_path / 's.json'}",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "no --run named 'b'" in r.stderr
