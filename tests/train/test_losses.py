"""Losses that target acceptance (``train.loss``): each against a hand-computed value, the hand-written
backwards of the training path against autograd on the reference form, the loss-row path against the
dense one for every loss, and the optimizer-step gradient independent of the micro-batch split
(DESIGN.md "Loss normalisation") for every loss."""

from __future__ import annotations

import math

import pytest
import torch
from _ddp_worker import single_thread  # noqa: F401  (autouse fixture)
from test_batching import _drafter, _items
from test_loss_norm import _assert_same_grads, _first_grads, _first_row, _run_split

from eagle3.data.dataset import collate
from eagle3.losses.rows import row_targets, ttt_loss_rows
from eagle3.losses.token import LOSSES, row_loss, token_loss
from eagle3.losses.ttt import compute_targets, draft_index, ttt_loss

P = [0.5, 0.3, 0.2]  # verifier distribution over a 3-token draft vocab
Q = [0.2, 0.5, 0.3]  # drafter distribution


def _hand(loss: str) -> float:
    """The loss of P vs Q written out with math.log (argmax of P is token 0)."""
    ce = -sum(p * math.log(q) for p, q in zip(P, Q))
    alpha = sum(min(p, q) for p, q in zip(P, Q))  # 0.2 + 0.3 + 0.2 = 0.7
    kl = sum(p * math.log(p / q) for p, q in zip(P, Q))
    lam = math.exp(-3.0 * alpha)
    return {
        "soft_ce": ce,
        "hard_ce": -math.log(Q[0]),
        "tv": 1 - alpha,
        "lk_hybrid": lam * kl + (1 - lam) * (1 - alpha),
    }[loss]


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_equals_hand_computed_value(loss):
    logits = torch.log(torch.tensor([Q])) + 1.7  # any shift: softmax(logits) = Q
    tgt_logp = torch.log(torch.tensor([P]))
    y = torch.tensor([0])
    want = _hand(loss)
    assert float(token_loss(logits, tgt_logp, y, loss)[0]) == pytest.approx(want, rel=1e-6)
    got, pred = row_loss(logits, tgt_logp, y, loss)
    assert float(got[0]) == pytest.approx(want, rel=1e-6) and int(pred[0]) == 1
    assert (1 - 0.7) == pytest.approx(_hand("tv"))  # alpha of this pair, by hand: 0.7


def test_hand_values_of_the_example():
    """The numbers themselves, so that a wrong formula in _hand cannot pass silently."""
    assert _hand("soft_ce") == pytest.approx(1.2534577, abs=1e-6)
    assert _hand("tv") == pytest.approx(0.3, abs=1e-12)
    assert _hand("lk_hybrid") == pytest.approx(0.1224564 * 0.2238047 + 0.8775436 * 0.3, abs=1e-6)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_written_backward_equals_autograd_of_the_reference(loss, dtype):
    g = torch.Generator().manual_seed(0)
    M, V = 37, 11
    logits = (torch.randn(M, V, generator=g) * 2).to(dtype)
    tgt_logp = torch.log_softmax(torch.randn(M, V, generator=g) * 2, -1)
    y = tgt_logp.argmax(-1)
    w = torch.rand(M, generator=g)  # the incoming gradient of each row (loss weights, masks)
    a = logits.clone().requires_grad_(True)
    ref = token_loss(a, tgt_logp, y, loss)
    (ref * w).sum().backward()
    b = logits.clone().requires_grad_(True)
    got, pred = row_loss(b, tgt_logp, y, loss)
    (got * w).sum().backward()
    assert got.dtype == torch.float32 and torch.equal(pred, logits.float().argmax(-1))
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    assert b.grad.dtype == dtype
    torch.testing.assert_close(b.grad.float(), a.grad.float(), **tol)
    assert float(a.grad.abs().max()) > 1e-3


def test_lk_hybrid_blend_weight_is_a_constant():
    """lam = exp(-eta * sg(alpha)): the gradient is lam * dKL + (1 - lam) * dTV, not d(lam) terms."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 7, generator=g)
    tgt_logp = torch.log_softmax(torch.randn(5, 7, generator=g), -1)
    x = logits.clone().requires_grad_(True)
    row_loss(x, tgt_logp, None, "lk_hybrid", lk_eta=2.0)[0].sum().backward()
    kl_x, tv_x = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    (
        token_loss(kl_x, tgt_logp, None, "soft_ce")
    ).sum().backward()  # d KL = d soft CE (entropy of p is constant)
    token_loss(tv_x, tgt_logp, None, "tv").sum().backward()
    alpha = 1 - token_loss(logits, tgt_logp, None, "tv")  # [5]
    lam = torch.exp(-2.0 * alpha)[:, None]
    torch.testing.assert_close(
        x.grad, lam * kl_x.grad + (1 - lam) * tv_x.grad, rtol=1e-5, atol=1e-6
    )


def test_draft_index_maps_verifier_ids_to_draft_ids():
    d2t = torch.tensor([0, 1, 1, 4])  # draft ids 0..3 = verifier ids 0, 2, 3, 7
    assert draft_index(torch.tensor([[0, 7], [3, 2]]), d2t).tolist() == [[0, 3], [2, 1]]
    with pytest.raises(ValueError, match="hard_ce needs"):
        row_loss(torch.zeros(2, 4), torch.zeros(2, 4), None, "hard_ce")
    with pytest.raises(ValueError, match="unknown loss 'kl'"):
        token_loss(torch.zeros(2, 4), torch.zeros(2, 4), None, "kl")


@pytest.mark.parametrize("loss", ["hard_ce", "tv", "lk_hybrid"])
def test_row_path_equals_dense_path_for_each_loss(loss):
    """The training path (loss rows, hand backward) == the reference path (every position, autograd)."""
    drafter = _drafter()
    lm = torch.randn(20, 12, generator=torch.Generator().manual_seed(2)).double()
    batch = collate(_items([9, 4, 13]))
    dense_t = compute_targets(batch["last"], lm, drafter.d2t, drafter.t2d)
    rows_t = row_targets(batch["last"], batch["loss_pos"], lm, drafter.d2t, drafter.t2d)

    def run(rows: bool):
        drafter.zero_grad()
        hs = drafter.ttt_forward(batch["input_ids"], batch["aux"], 4, attn_impl="eager")
        if rows:
            total, m = ttt_loss_rows(drafter, hs, rows_t, batch["loss_pos"], loss=loss, lk_eta=2.5)
        else:
            total, m = ttt_loss(
                drafter, hs, dense_t, batch["loss_mask"], compact=False, loss=loss, lk_eta=2.5
            )
        total.backward()
        return (
            total.detach(),
            m,
            {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None},
        )

    l1, m1, g1 = run(False)
    l2, m2, g2 = run(True)
    assert int(m1["count"][0]) > 5
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    for k in ("loss", "ce_sum", "acc", "count"):
        torch.testing.assert_close(m2[k], m1[k], rtol=1e-6, atol=1e-6)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7, msg=k)
    # and the loss is the selected one, not soft CE
    hs = drafter.ttt_forward(batch["input_ids"], batch["aux"], 4, attn_impl="eager")
    soft, _ = ttt_loss_rows(drafter, hs, rows_t, batch["loss_pos"])
    assert abs(float(soft.detach()) - float(l2)) > 1e-3


@pytest.mark.parametrize("loss", ["hard_ce", "tv", "lk_hybrid"])
def test_step_gradient_independent_of_micro_batch_split_for_each_loss(tmp_path, loss, monkeypatch):
    """batch 2 x accumulation 1 == batch 1 x accumulation 2 (the token mean is over the whole step)."""
    import test_loss_norm

    monkeypatch.setattr(test_loss_norm, "ONE_STEP", {**test_loss_norm.ONE_STEP, "loss": loss})
    whole = _run_split(tmp_path / "b2a1", batch_size=2, grad_accum=1)
    split = _run_split(tmp_path / "b1a2", batch_size=1, grad_accum=2)
    _assert_same_grads(_first_grads(split), _first_grads(whole))
    rw, rs = _first_row(whole), _first_row(split)
    for k in ("loss", "step_loss_0", "step_loss_2", "acc_0", "loss_tokens"):
        assert rs[k] == pytest.approx(rw[k], rel=1e-5), k
    if loss == "tv":  # 1 - alpha is in [0, 1]: the logged step losses are TV, not cross-entropies
        assert 0.0 <= rw["step_loss_0"] <= 1.0
