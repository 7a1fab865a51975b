"""bench/small_train_speed.py runs end to end on CPU at tiny shapes and reports every mode (the H200 figures come
from the same code)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_synthetic_lengths_within_bounds():
    from small_train_speed import synthetic_lengths

    lens = synthetic_lengths(500, 300, seed=1)
    assert all(4 <= p and 1 <= r <= 256 and p + r <= 300 for p, r in lens)
    assert lens == synthetic_lengths(500, 300, seed=1)  # seeded


@pytest.mark.slow
def test_bench_tiny_cpu_reports_all_modes(tmp_path):
    import small_train_speed

    out = tmp_path / "r.json"
    small_train_speed.main(["--tiny", "--device", "cpu", "--samples", "24", "--steps", "legacy8=2,fixed8=2,tokens=2",
                            "--batch-tokens", "400", "--log-every", "1", "--workdir", str(tmp_path / "w"),
                            "--json", str(out)])
    r = json.loads(out.read_text())
    assert [x["mode"] for x in r["results"]] == ["legacy8", "fixed8", "tokens"]
    assert all(x["steps"] == 2 and x["tokens_per_s"] > 0 for x in r["results"])
    assert r["small_train_tokens_per_s"] == r["results"][2]["tokens_per_s"]
