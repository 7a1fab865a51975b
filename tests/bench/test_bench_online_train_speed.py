"""bench/online_train_speed.py runs end to end on CPU at a tiny size (a random Llama verifier with SmolLM2's
tokenizer) and reports both modes from the same code the H200 run uses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_online_train_speed_tiny_cpu(tmp_path):
    import online_train_speed

    out, md = tmp_path / "r.json", tmp_path / "r.md"
    online_train_speed.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--steps",
            "4",
            "--log-every",
            "2",
            "--batch-tokens",
            "512",
            "--verifier-batches",
            "3",
            "--workdir",
            str(tmp_path / "w"),
            "--json",
            str(out),
            "--md",
            str(md),
        ]
    )
    r = json.loads(out.read_text())
    by = {x["mode"]: x for x in r["results"]}
    assert list(by) == ["offline", "online"]
    assert all(
        x["steps"] == 4 and x["tokens_per_s"] > 0 and x["steady_tokens"] > 0 for x in by.values()
    )
    assert r["online_vs_offline"] == by["online"]["tokens_per_s"] / by["offline"]["tokens_per_s"]
    st = r["data_stats"]
    assert st["online"]["hidden_state_bytes"] == 0 and st["online"]["format"] == "eagle3-tokens-v1"
    assert (
        st["offline"]["hidden_state_bytes"] == st["offline"]["tokens"] * 4 * 64 * 2
    )  # bf16, H = 64
    assert st["online"]["tokens"] == st["offline"]["tokens"] and st["online"]["samples"] == 48
    assert st["online"]["sample_file_bytes"] < st["offline"]["sample_file_bytes"] / 5
    # the same data order and (up to 02's batching) the same states: the first logged losses agree
    assert by["online"]["first_loss"] == pytest.approx(by["offline"]["first_loss"], rel=1e-3)
    assert r["prefill_tokens_per_s"] > 0 and r["prefill_batches"] == 3
    text = md.read_text()
    assert (
        f"**{r['online_vs_offline']:.3f}**" in text
        and "| online |" in text
        and "| offline |" in text
    )
