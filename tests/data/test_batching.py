"""Token-budget batching (eagle3/data/batching.py) and the host-indexed TTT loss (eagle3/losses/rows.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env

from eagle3.config import load_config  # noqa: E402
from eagle3.data.batching import TokenBudgetBatchSampler, eval_batches  # noqa: E402
from eagle3.data.dataset import (
    collate,  # noqa: E402
    loss_positions,  # noqa: E402
)
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter  # noqa: E402  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.losses.rows import row_targets, ttt_loss_rows, ttt_row_counts  # noqa: E402
from eagle3.losses.ttt import compute_targets, step_denominators, ttt_loss  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

LENGTHS = [int(x) for x in torch.randint(3, 60, (97,), generator=torch.Generator().manual_seed(5))]


# ---- the batch plan ------------------------------------------------------------------------------
def test_every_sample_once_per_epoch_within_budget_deterministic():
    s = TokenBudgetBatchSampler(LENGTHS, batch_tokens=128, seed=3, window=32)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        batches = list(s)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(LENGTHS)))  # every sample exactly once
        for b in batches:
            assert len(b) * max(LENGTHS[i] for i in b) <= 128  # padded tokens within the budget
        assert len(s) == len(batches)
    again = TokenBudgetBatchSampler(LENGTHS, batch_tokens=128, seed=3, window=32)
    assert again.epoch_batches(1) == s.epoch_batches(1)  # a pure function of (seed, epoch, ...)
    assert s.epoch_batches(0) != s.epoch_batches(1)  # reshuffled per epoch
    assert TokenBudgetBatchSampler(LENGTHS, 128, seed=4, window=32).epoch_batches(
        1
    ) != s.epoch_batches(1)


def test_bucketing_cuts_padding_against_random_batches():
    s = TokenBudgetBatchSampler(LENGTHS, batch_tokens=256, seed=0, window=0)
    batches = s.epoch_batches(0)
    padded = sum(len(b) * max(LENGTHS[i] for i in b) for b in batches)
    assert padded < 1.1 * sum(LENGTHS)  # sorted within the window: under 10% padding here
    # the batches are not in length order (the batch order is shuffled)
    firsts = [max(LENGTHS[i] for i in b) for b in batches]
    assert firsts != sorted(firsts)


def test_sample_longer_than_budget_is_its_own_batch():
    s = TokenBudgetBatchSampler([5, 50, 6, 7], batch_tokens=20, shuffle=False, window=0)
    assert s.epoch_batches(0) == [[0, 2], [3], [1]]  # 2*6 <= 20, 3*7 > 20; 50 alone


def test_resume_mid_epoch_gives_the_rest_of_the_uninterrupted_order():
    full = TokenBudgetBatchSampler(LENGTHS, 100, seed=1, window=16, grad_accum=2)
    full.set_epoch(2)
    order = list(full)
    resumed = TokenBudgetBatchSampler(LENGTHS, 100, seed=1, window=16, grad_accum=2)
    resumed.set_epoch(2)
    resumed.set_start(3)  # 3 optimizer steps done = 6 micro-batches
    assert list(resumed) == order[6:]
    assert len(resumed) == len(order) - 6


def test_ranks_disjoint_equal_steps_and_step_layout():
    W, A = 2, 3
    samplers = [
        TokenBudgetBatchSampler(
            LENGTHS, 90, num_replicas=W, rank=r, grad_accum=A, seed=7, window=20
        )
        for r in range(W)
    ]
    for s in samplers:
        s.set_epoch(1)
    per_rank = [list(s) for s in samplers]
    plan = samplers[0].epoch_batches(1)
    assert len(plan) % (W * A) == 0
    assert len(per_rank[0]) == len(per_rank[1]) == len(plan) // W
    seen = [i for b in per_rank[0] + per_rank[1] for i in b]
    assert len(seen) == len(set(seen))  # disjoint
    # the uncut plan has fewer than W*A batches more; the union is the cut plan
    uncut = TokenBudgetBatchSampler(LENGTHS, 90, seed=7, window=20).epoch_batches(1)
    assert len(uncut) - len(plan) < W * A and plan == uncut[: len(plan)]
    # rank r, step s, micro m = global batch s*W*A + m*W + r
    assert per_rank[1][A + 2] == plan[1 * W * A + 2 * W + 1]
    assert all(s.steps_in_epoch(1) == len(plan) // (W * A) for s in samplers)


def test_total_steps_sums_epoch_plans_and_rounds_fraction_up():
    s = TokenBudgetBatchSampler(LENGTHS, 100, seed=0, window=16)
    e0, e1 = s.steps_in_epoch(0), s.steps_in_epoch(1)
    assert s.total_steps(2) == e0 + e1
    assert s.total_steps(1.5) == e0 + -(-e1 // 2)
    with pytest.raises(UserError, match="train.batch_tokens"):
        TokenBudgetBatchSampler([5, 6], 100, num_replicas=4).total_steps(1)


def test_eval_batches_cover_all_samples_once_across_ranks():
    got = eval_batches(LENGTHS, 120, 2, 0) + eval_batches(LENGTHS, 120, 2, 1)
    assert sorted(i for b in got for i in b) == list(range(len(LENGTHS)))


# ---- the host-indexed loss equals the dense loss -------------------------------------------------
def _drafter(seed=0):
    torch.manual_seed(seed)
    a = DrafterArgs(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=24,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        draft_vocab_size=10,
        target_vocab_size=20,
        target_hidden_size=12,
    )
    d = Eagle3Drafter(a).double()
    d2t = torch.arange(0, 20, 2)[:10] - torch.arange(10)  # draft ids = even target ids
    t2d = torch.zeros(20, dtype=torch.bool)
    t2d[::2] = True
    d.set_vocab_map(d2t, t2d)
    return d


def _items(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths:
        mask = (torch.rand(L, generator=g) > 0.3).long()  # [L] prompt/reply mix
        out.append(
            {
                "input_ids": torch.randint(0, 20, (L,), generator=g),
                "aux": torch.randn(L, 36, generator=g).double(),
                "last": torch.randn(L, 12, generator=g).double(),
                "loss_mask": mask,
            }
        )
    return out


def test_loss_positions_hand_computed():
    mask = torch.tensor([[1, 1, 1, 0, 1], [0, 0, 0, 1, 0]])
    assert loss_positions(mask).tolist() == [2, 4, 8]  # p >= 2 only; flat b*L + p


def test_row_loss_equals_dense_loss_values_metrics_and_gradients():
    drafter = _drafter()
    lm = torch.randn(20, 12, generator=torch.Generator().manual_seed(2)).double()
    batch = collate(_items([9, 4, 13]))
    dense_t = compute_targets(batch["last"], lm, drafter.d2t, drafter.t2d)
    rows_t = row_targets(batch["last"], batch["loss_pos"], lm, drafter.d2t, drafter.t2d)

    def run(rows: bool):
        drafter.zero_grad()
        hs = drafter.ttt_forward(batch["input_ids"], batch["aux"], 4, attn_impl="eager")
        if rows:
            loss, m = ttt_loss_rows(drafter, hs, rows_t, batch["loss_pos"])
        else:
            loss, m = ttt_loss(drafter, hs, dense_t, batch["loss_mask"], compact=False)
        loss.backward()
        return (
            loss.detach(),
            m,
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
        )

    l1, m1, g1 = run(False)
    l2, m2, g2 = run(True)
    assert int(m1["count"][0]) > 5  # the case has counted positions in every step
    # the CE math runs in float32 in both paths (targets are float32 log-probs): float32 tolerances
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    for k in ("loss", "acc", "correct", "count") + (("ce_sum",) if "ce_sum" in m1 else ()):
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-6, atol=1e-6)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-6, msg=k)


def test_bucketed_batch_equals_per_sample_sum_with_shared_normaliser():
    """A padded (bucketed) batch gives the same summed loss and gradient as its samples one by one, when
    every piece divides by the same normaliser (the step's counted tokens)."""
    drafter = _drafter(1)
    lm = torch.randn(20, 12, generator=torch.Generator().manual_seed(3)).double()
    items = _items([7, 11, 10, 3], seed=4)
    K = 3

    def piece(its, denom):
        b = collate(its)
        t = row_targets(b["last"], b["loss_pos"], lm, drafter.d2t, drafter.t2d)
        hs = drafter.ttt_forward(b["input_ids"], b["aux"], K, attn_impl="eager")
        return ttt_loss_rows(drafter, hs, t, b["loss_pos"], denom=denom)

    with torch.no_grad():
        per_sample = []
        for it in items:
            one = collate([it])
            t = row_targets(one["last"], one["loss_pos"], lm, drafter.d2t, drafter.t2d)
            per_sample.append(
                ttt_row_counts(one["loss_pos"], one["input_ids"].shape[1], t.in_draft, K)
            )
        counts = step_denominators(
            per_sample
        )  # [K] the step's counted tokens (eagle3.losses.ttt, issue 11 item 1)
        assert (
            counts.tolist()
            == sum(piece([it], None)[1]["count"] for it in items).clamp(min=1).float().tolist()
        )
    drafter.zero_grad()
    loss_b, _ = piece(items, counts)
    loss_b.backward()
    gb = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    total = sum(piece([it], counts)[0] for it in items)
    total.backward()
    torch.testing.assert_close(loss_b.detach(), total.detach(), rtol=1e-6, atol=1e-6)
    for n, p in drafter.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(gb[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


# ---- the training loop with token budgets --------------------------------------------------------
TRAIN = {
    "epochs": 2,
    "batch_tokens": 30,
    "ckpt_every": 2,
    "keep_checkpoints": 3,
    "log_every": 1,
    "eval_every": 100,
}


def test_train_token_budget_resume_matches_uninterrupted(tmp_path):
    from eagle3.stages.train import run

    ref_cfg = load_config(make_tiny_run(tmp_path / "ref", n_train=10, train=TRAIN))
    ref = run(ref_cfg, device="cpu")
    assert not ref["stopped"] and ref["step"] == ref["total_steps"] >= 6
    cfg = load_config(make_tiny_run(tmp_path / "cut", n_train=10, train=TRAIN))
    first = run(
        cfg, device="cpu", stop_after=3
    )  # stops mid-epoch 0 or in epoch 1, with a checkpoint
    assert first["stopped"] and first["step"] == 3
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(cfg.train_dir)[-1][1])
    lengths = [(12, 9, 16, 7)[i % 4] for i in range(10)]  # make_tiny_run's samples
    s0 = TokenBudgetBatchSampler(lengths, 30, seed=0).steps_in_epoch(0)
    assert (state["epoch"], state["steps_in_epoch"]) == ((0, 3) if s0 > 3 else (1, 3 - s0))
    second = run(cfg, device="cpu", resume=True)
    assert second["step"] == ref["step"]
    a = ckpt.load_checkpoint(ckpt.list_checkpoints(ref_cfg.train_dir)[-1][1])["model"]
    b = ckpt.load_checkpoint(ckpt.list_checkpoints(cfg.train_dir)[-1][1])["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=k)


def test_default_validation_with_token_budgets_is_at_each_epoch_end(tmp_path, monkeypatch):
    """train.batch_tokens re-plans each epoch's batches, so epochs differ in steps (7, 8, 8 here, with sorting windows
    of 4 samples; 640, 639, 639, 640 for 6,000 real samples). Without train.eval_every, 04 validated every
    `steps of epoch 0` steps (7, 14, 21), drifting off the epoch ends; now it validates at each epoch's last step."""
    from eagle3.data import batching
    from eagle3.stages.train import run

    monkeypatch.setattr(batching, "DEFAULT_WINDOW", 4)
    train = {"epochs": 3, "batch_tokens": 30, "ckpt_every": 100, "log_every": 1, "eval_every": None}
    cfg = load_config(make_tiny_run(tmp_path, n_train=12, n_val=2, train=train))
    lengths = [(12, 9, 16, 7)[i % 4] for i in range(12)]  # make_tiny_run's training samples
    per_epoch = [
        TokenBudgetBatchSampler(lengths, 30, seed=0, window=4).steps_in_epoch(e) for e in range(3)
    ]
    assert per_epoch == [7, 8, 8]  # (the test needs epochs of different lengths)
    r = run(cfg, device="cpu")
    rows = [json.loads(x) for x in (cfg.train_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(v["step"], v["epoch"]) for v in rows if v["kind"] == "val"]
    assert r["step"] == 23 and val == [(7, 0), (15, 1), (23, 2)]


def test_all_finite_fast_path_agrees_with_isfinite():
    from eagle3.shards.format import all_finite

    h = torch.randn(30, 8).bfloat16()  # [L, H]
    assert all_finite(h)
    big = torch.full(
        (4, 4), 3e38
    ).bfloat16()  # finite values whose float32 sum overflows: the exact check decides
    assert all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = h.clone()
        x[3, 5] = bad
        assert not all_finite(x)


@pytest.mark.slow
def test_token_budget_two_ranks_equal_one_process_accumulating(tmp_path):
    """Token-budget batches of different sizes and token counts: 2 gloo ranks x grad_accum 1 see the same
    global batches per optimizer step as 1 process x grad_accum 2 (batch s*W*A + m*W + r), and with the
    step-normalised loss the weights agree."""
    import subprocess

    from eagle3.stages.train import run

    train = {"batch_tokens": 32, "epochs": 2, "ckpt_every": 100, "eval_every": 100}
    one = load_config(make_tiny_run(tmp_path / "one", n_train=12, train=dict(train, grad_accum=2)))
    two_yaml = make_tiny_run(tmp_path / "two", n_train=12, train=dict(train, grad_accum=1))
    r = run(one, device="cpu")
    here = Path(__file__).resolve().parents[1]  # tests/ (the _ddp_worker.py helper)
    env = child_env(here.parent)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(here / "_ddp_worker.py"),
        "--config",
        str(two_yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s1 = ckpt.load_checkpoint(ckpt.list_checkpoints(one.train_dir)[-1][1])
    s2 = ckpt.load_checkpoint(ckpt.list_checkpoints(load_config(two_yaml).train_dir)[-1][1])
    assert s1["step"] == s2["step"] == r["step"] >= 4 and s2["world_size"] == 2
    for k, v in s1["model"].items():
        torch.testing.assert_close(s2["model"][k], v, atol=1e-5, rtol=1e-5, msg=k)


def test_eval_batches_give_every_rank_samples():
    assert eval_batches([9, 12], 32, 2, 0) == [[0]] and eval_batches([9, 12], 32, 2, 1) == [[1]]


def test_token_budget_step_gradient_equals_per_sample_accumulation(tmp_path):
    """One bucketed micro-batch of two samples of very different lengths (40 and 6 tokens, budget 80) gives
    the same first-step gradient as the samples one by one (batch 1 x grad_accum 2): the loss is a mean over
    the optimizer step's counted tokens (issue 11 item 1), not over micro-batches."""
    from test_loss_norm import ONE_STEP, TWO_SAMPLES, _assert_same_grads, _first_grads, _run_split

    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path / "tok", train={**ONE_STEP, "batch_tokens": 80}, **TWO_SAMPLES)
    )
    r = run(cfg, device="cpu")
    assert r["step"] == r["total_steps"] == 1
    split = _run_split(tmp_path / "b1a2", batch_size=1, grad_accum=2)
    _assert_same_grads(_first_grads(cfg.train_dir), _first_grads(split))
