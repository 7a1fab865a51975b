"""bench/verifier_confidence.py: the verifier's confidence in its own greedy answers (values checked by hand and
against an independent step-by-step greedy decode)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import verifier_confidence as vc  # noqa: E402


def test_step_confidence_by_hand():
    scores = torch.tensor(
        [[math.log(0.7), math.log(0.2), math.log(0.1)], [0.0, 0.0, 0.0]]
    )  # [2, 3]: softmax (0.7, 0.2, 0.1) and uniform
    c = vc.step_confidence(scores)
    assert torch.allclose(c["p1"], torch.tensor([0.7, 1 / 3]), atol=1e-6)
    assert torch.allclose(c["margin"], torch.tensor([math.log(0.7 / 0.2), 0.0]), atol=1e-6)
    h0 = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert torch.allclose(c["entropy"], torch.tensor([h0, math.log(3)]), atol=1e-6)


def test_summarize_token_weighted():
    rows = [
        {"p1": [0.9, 0.4], "margin": [2.0, 0.5], "entropy": [0.1, 1.0], "argmax_differs": 0},
        {"p1": [0.2], "margin": [3.0], "entropy": [2.0], "argmax_differs": 1},
    ]
    assert vc.summarize(rows) == {
        "prompts": 2,
        "answer_tokens": 3,
        "argmax_differs": 1,
        "mean_p1": 0.5,
        "share_p1_below_0.5": round(2 / 3, 4),
        "share_margin_below_1nat": round(1 / 3, 4),
        "mean_entropy_nats": round(3.1 / 3, 4),
    }


@torch.no_grad()
def test_confidence_matches_a_step_by_step_greedy_decode(tiny_llama_dir):
    """Each answer token is the argmax of the logits its p1 is read from (no off-by-one), and the figures equal those
    of a plain step-by-step decode without a KV cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [
        [1, 5, 9, 33, 7],
        [4, 8],
    ]  # different lengths: the batch is left-padded inside the decoder
    rows = vc.greedy_confidence(model, prompts, max_new_tokens=6, eos=set())
    for prompt, row in zip(prompts, rows):
        seq, p1 = list(prompt), []
        for _ in range(6):  # reference: the full sequence re-run every step
            logp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1], -1)
            seq.append(int(logp.argmax()))
            p1.append(float(logp.max().exp()))
        assert row["tokens"] == seq[len(prompt) :]
        assert row["p1"] == pytest.approx(p1, abs=1e-5)
        assert row["argmax_differs"] == 0 and len(row["margin"]) == len(row["entropy"]) == 6


def test_cli_writes_json_and_table(tmp_path, tiny_llama_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"Say {w}"}]}) + "\n"
            for i, w in enumerate(["hi", "hello there", "ok"])
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\nverifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "verifier_confidence.py"),
            "--config",
            str(cfg),
            "--datasets",
            str(prompts),
            "--max-new-tokens",
            "4",
            "--batch-size",
            "2",
            "--num-prompts",
            "5",
            "--out",
            str(tmp_path / "c.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    # more prompts asked than the set has: all of them, with one warning (was silent)
    assert "p: 5 prompts asked (--num-prompts) but the set has 3: all 3 measured" in r.stderr, (
        r.stderr[-2000:]
    )
    rep = json.loads((tmp_path / "c.json").read_text())
    ((name, s),) = rep["sets"].items()
    assert s["prompts"] == 3 and 3 <= s["answer_tokens"] <= 12 and 0 < s["mean_p1"] <= 1
    assert (
        (tmp_path / "c.md")
        .read_text()
        .splitlines()[2]
        .startswith(f"| {name} | 3 | {s['answer_tokens']} |")
    )
