"""The TTT loss is normalised over the counted tokens of a whole optimizer step (issue 11 item 1).

Two samples whose replies differ ~10x in length: the first optimizer step's gradient must be the same
for batch 2 x accumulation 1, batch 1 x accumulation 2 and 2 gloo ranks x batch 1 (DESIGN.md "Loss
normalisation"). The gradient is read from the step-1 checkpoint: AdamW's first moment after one step
is exactly ``(1 - beta1) * grad`` (clipping is disabled with a huge ``grad_clip``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]  # tests/ (the _ddp_worker.py helper)
sys.path.insert(0, str(HERE))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env
from test_ttt import _random_case  # noqa: E402

from eagle3.config import load_config  # noqa: E402
from eagle3.losses.ttt import TTTTargets, step_denominators, ttt_loss, ttt_token_counts  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

# two samples: 40 and 6 tokens, loss mask from position 2 on (replies of 38 and 4 tokens); draft
# vocab = every 2nd target id, so the verifier-argmax filter drops some positions as well
TWO_SAMPLES = dict(n_train=2, n_val=0, lengths=(40, 6))
ONE_STEP = {"epochs": 1, "grad_clip": 1.0e9, "warmup_ratio": 0.0, "ckpt_every": 1}


def _first_grads(train_dir: Path) -> list[torch.Tensor]:
    path = dict(ckpt.list_checkpoints(train_dir))[1]
    opt = ckpt.load_checkpoint(path)["optimizer"]
    return [opt["state"][i]["exp_avg"] / 0.1 for i in sorted(opt["state"])]  # (1 - beta1) = 0.1


def _first_row(train_dir: Path) -> dict:
    rows = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "train" and r["step"] == 1)


def _assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(got, want)) ** 0.5
    den = sum(float(b.pow(2).sum()) for b in want) ** 0.5
    assert den > 0 and num / den < 1e-5, f"relative gradient difference {num / den:.3g}"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _run_split(root: Path, batch_size: int, grad_accum: int) -> Path:
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            root,
            train={**ONE_STEP, "batch_size": batch_size, "grad_accum": grad_accum},
            **TWO_SAMPLES,
        )
    )
    r = run(cfg, device="cpu")
    assert r["step"] == r["total_steps"] == 1
    return cfg.train_dir


def test_step_gradient_independent_of_micro_batch_split(tmp_path):
    whole = _run_split(tmp_path / "b2a1", batch_size=2, grad_accum=1)
    split = _run_split(tmp_path / "b1a2", batch_size=1, grad_accum=2)
    _assert_same_grads(_first_grads(split), _first_grads(whole))
    # the logged figures are the step's token-weighted ones, whatever the split
    rw, rs = _first_row(whole), _first_row(split)
    for k in ("loss", "step_loss_0", "step_loss_2", "acc_0", "acc_2", "loss_tokens"):
        assert rs[k] == pytest.approx(rw[k], rel=1e-5), k


@pytest.mark.slow
def test_step_gradient_same_on_two_gloo_ranks(tmp_path):
    whole = _run_split(tmp_path / "b2a1", batch_size=2, grad_accum=1)
    yaml_path = make_tiny_run(
        tmp_path / "ddp", train={**ONE_STEP, "batch_size": 1, "grad_accum": 1}, **TWO_SAMPLES
    )
    env = child_env(HERE.parent)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_ddp_worker.py"),
        "--config",
        str(yaml_path),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ddp_dir = load_config(yaml_path).train_dir
    assert ckpt.load_checkpoint(dict(ckpt.list_checkpoints(ddp_dir))[1])["world_size"] == 2
    _assert_same_grads(_first_grads(ddp_dir), _first_grads(whole))
    rw, rd = _first_row(whole), _first_row(ddp_dir)
    for k in ("loss", "acc_0", "loss_tokens"):
        assert rd[k] == pytest.approx(rw[k], rel=1e-5), k


def test_token_counts_and_micro_batch_losses_add_up():
    """Unit level: counts match ttt_loss's; per-micro-batch losses with the step denominators sum to
    the whole-batch loss, and so do their gradients."""
    d, hs, tg, loss_mask, *_ = _random_case(seed=7, B=2, L=10, K=4)
    loss_mask[1, 5:] = 0  # sample 1 has a much shorter reply
    loss, m = ttt_loss(d, hs, tg, loss_mask)
    counts = ttt_token_counts(loss_mask, tg.in_draft, 4)
    assert torch.equal(counts, m["count"]) and counts.dtype == torch.int64
    g_whole = torch.autograd.grad(loss, [*hs, d.lm_head.weight])

    parts = [TTTTargets(*(x[b : b + 1] for x in tg)) for b in range(2)]
    masks = [loss_mask[b : b + 1] for b in range(2)]
    denom = step_denominators([ttt_token_counts(mk, p.in_draft, 4) for mk, p in zip(masks, parts)])
    assert torch.equal(denom, counts.clamp(min=1).float())
    total = 0
    for b in range(2):
        lb, mb = ttt_loss(d, [h[b : b + 1] for h in hs], parts[b], masks[b], denom=denom)
        total = total + lb
        assert torch.allclose(mb["ce_sum"] / mb["count"].clamp(min=1), mb["loss"])
    assert torch.allclose(total, loss, rtol=1e-6)
    g_split = torch.autograd.grad(total, [*hs, d.lm_head.weight])
    for a, b in zip(g_split, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
