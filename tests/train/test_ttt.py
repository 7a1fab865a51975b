"""TTT mask, verifier targets and loss against brute-force float64 references; a tiny drafter overfits."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.attention import ttt_attention_mask
from eagle3.drafter.model import Eagle3Drafter
from eagle3.losses.ttt import TTTTargets, compute_targets, ttt_loss

TV, DV, HT = 40, 16, 24  # target vocab, draft vocab, verifier hidden


def tiny_args(**kw) -> DrafterArgs:
    base = dict(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        draft_vocab_size=DV,
        target_vocab_size=TV,
        target_hidden_size=HT,
    )
    base.update(kw)
    return DrafterArgs(**base)


def vocab_map(seed: int = 0):
    """A random draft vocab of DV target ids (sorted), as d2t offsets and t2d flags."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(TV, generator=g)[:DV].sort().values  # [DV] target ids
    d2t = ids - torch.arange(DV)
    t2d = torch.zeros(TV, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d, ids


# ---------------------------------------------------------------------------------------------
def test_ttt_attention_mask_matches_definition():
    for L in (1, 5, 9):
        for step in range(4):
            m = ttt_attention_mask(L, step)
            assert m.shape == (L, (step + 1) * L) and m.dtype == torch.bool
            for t in range(L):
                for col in range((step + 1) * L):
                    j, s = divmod(col, L)
                    want = (j == 0 and s <= t) or (1 <= j <= step and s == t)
                    assert bool(m[t, col]) == want, (L, step, t, j, s)


def test_ttt_attention_mask_hand_example():
    expect = torch.tensor(
        [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(ttt_attention_mask(3, 2), expect)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre_norm", [False, True])
@pytest.mark.parametrize("chunk", [1024, 7])
def test_compute_targets_brute_force(pre_norm, chunk):
    torch.manual_seed(1)
    B, L = 2, 11
    last = torch.randn(B, L, HT) * 3
    W = torch.randn(TV, HT)
    nw = torch.rand(HT) + 0.5 if pre_norm else None
    d2t, t2d, ids = vocab_map()
    out = compute_targets(last, W, d2t, t2d, norm_weight=nw, norm_eps=1e-5, chunk=chunk)
    assert isinstance(out, TTTTargets)
    assert out.logp_draft.shape == (B, L, DV) and out.logp_draft.dtype == torch.float32
    h = last.double()
    if pre_norm:
        h = h / torch.sqrt((h**2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    for b in range(B):
        for t in range(L):
            z = [float(h[b, t] @ W[v].double()) for v in range(TV)]
            am = max(range(TV), key=lambda v: z[v])
            zd = [z[v] for v in ids.tolist()]
            lse = math.log(sum(math.exp(x - max(zd)) for x in zd)) + max(zd)
            ref = torch.tensor([x - lse for x in zd], dtype=torch.float64)
            assert torch.allclose(out.logp_draft[b, t].double(), ref, atol=1e-4)
            assert int(out.argmax[b, t]) == am
            assert bool(out.in_draft[b, t]) == (am in ids.tolist())


# ---------------------------------------------------------------------------------------------
def _random_case(seed=0, B=2, L=10, K=4):
    torch.manual_seed(seed)
    d = Eagle3Drafter(tiny_args())
    d2t, t2d, ids = vocab_map(seed)
    d.set_vocab_map(d2t, t2d)
    with torch.no_grad():
        d.norm.weight.uniform_(0.5, 1.5)
    hs = [torch.randn(B, L, 24, requires_grad=True) for _ in range(K)]
    last = torch.randn(B, L, HT) * 2
    W = torch.randn(TV, HT)
    tg = compute_targets(last, W, d2t, t2d)
    loss_mask = (torch.rand(B, L) > 0.3).long()
    return d, hs, tg, loss_mask, last, W, ids


def test_ttt_loss_matches_float64_reference():
    d, hs, tg, loss_mask, last, W, ids = _random_case()
    B, L = loss_mask.shape
    loss, m = ttt_loss(d, hs, tg, loss_mask, step_weight=0.8)

    # independent float64 reference from the definition (DESIGN.md "TTT indexing")
    z = last.double() @ W.double().t()  # [B, L, TV] verifier logits (last state is post-norm here)
    p = torch.softmax(z[..., ids], dim=-1)  # [B, L, DV]
    Wd = d.lm_head.weight.detach().double()
    nw = d.norm.weight.detach().double()
    total, ids_l = 0.0, ids.tolist()
    for i, h in enumerate(hs):
        hh = h.detach().double()
        num, cnt, correct = 0.0, 0, 0
        for b in range(B):
            for t in range(L):
                if not (t + 2 + i <= L - 1):
                    continue
                full_argmax = int(z[b, t + 1 + i].argmax())
                if loss_mask[b, t + 2 + i] != 1 or full_argmax not in ids_l:
                    continue
                x = hh[b, t]
                x = x / torch.sqrt((x**2).mean() + 1e-6) * nw
                logq = torch.log_softmax(Wd @ x, dim=-1)
                num += float(-(p[b, t + 1 + i] * logq).sum())
                cnt += 1
                correct += int(ids_l[int(logq.argmax())] == full_argmax)
        step = num / max(cnt, 1)
        total += 0.8**i * step
        assert math.isclose(float(m["loss"][i]), step, rel_tol=1e-5, abs_tol=1e-6)
        assert int(m["count"][i]) == cnt and int(m["correct"][i]) == correct
        assert math.isclose(float(m["acc"][i]), correct / max(cnt, 1), rel_tol=1e-6)
    assert math.isclose(float(loss.detach()), total, rel_tol=1e-5)
    assert int(m["count"][0]) > 0 and int(m["count"][-1]) < int(m["count"][0])


def test_ttt_loss_steps_beyond_sequence_are_zero():
    d, hs, tg, loss_mask, *_ = _random_case(L=4, K=4)
    loss, m = ttt_loss(d, hs, tg, torch.ones_like(loss_mask))
    # L = 4: step i has L-2-i = 2-i candidate positions -> steps 2, 3 have none
    assert m["count"][2:].tolist() == [0, 0] and m["loss"][2:].tolist() == [0.0, 0.0]
    assert torch.isfinite(loss)


def test_ttt_loss_checkpoint_same_loss_and_grads():
    d, hs, tg, loss_mask, *_ = _random_case(seed=3)
    loss1, _ = ttt_loss(d, hs, tg, loss_mask)
    g1 = torch.autograd.grad(loss1, [*hs, d.lm_head.weight, d.norm.weight])
    loss2, _ = ttt_loss(d, hs, tg, loss_mask, checkpoint=True)
    g2 = torch.autograd.grad(loss2, [*hs, d.lm_head.weight, d.norm.weight])
    assert torch.allclose(loss1, loss2)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_ttt_loss_compact_equals_dense(checkpoint):
    """Logits only at valid positions (CPU default) give the dense path's loss, metrics and grads."""
    d, hs, tg, loss_mask, *_ = _random_case(seed=5)
    params = [*hs, d.lm_head.weight, d.norm.weight]
    loss1, m1 = ttt_loss(d, hs, tg, loss_mask, compact=False, checkpoint=checkpoint)
    g1 = torch.autograd.grad(loss1, params)
    loss2, m2 = ttt_loss(d, hs, tg, loss_mask, compact=True, checkpoint=checkpoint)
    g2 = torch.autograd.grad(loss2, params)
    assert torch.allclose(loss1, loss2, rtol=1e-6)
    for k in ("count", "correct"):
        assert torch.equal(m1[k], m2[k])
    assert int(m1["count"].sum()) > 0
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-6)


# ---------------------------------------------------------------------------------------------
def test_tiny_drafter_overfits_fixed_batch():
    """A drafter fitted to one batch drives the loss down and step-0 accuracy to ~1."""
    torch.manual_seed(0)
    B, L, K = 2, 12, 3
    d = Eagle3Drafter(
        tiny_args(hidden_size=32, target_hidden_size=32, num_attention_heads=4, head_dim=8)
    )
    d2t, t2d, ids = vocab_map(1)
    d.set_vocab_map(d2t, t2d)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
    input_ids = torch.randint(0, TV, (B, L))
    aux = torch.randn(B, L, 3 * 32)
    # a sharp verifier whose argmax is always in the draft vocab
    W = torch.randn(TV, 32)
    W[~t2d] = 0
    tg = compute_targets(torch.randn(B, L, 32) * 4, W, d2t, t2d)
    assert bool(tg.in_draft.all())
    mask = torch.ones(B, L, dtype=torch.long)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(150):
        loss, m = ttt_loss(d, d.ttt_forward(input_ids, aux, K), tg, mask)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        loss, m = ttt_loss(d, d.ttt_forward(input_ids, aux, K), tg, mask)
    # the floor is the targets' own entropy (soft labels), so compare against it
    ent = sum(
        0.8**i
        * float(
            -(tg.logp_draft[:, 1 + i : L - 1].exp() * tg.logp_draft[:, 1 + i : L - 1])
            .sum(-1)
            .mean()
        )
        for i in range(K)
    )
    assert float(m["acc"][0]) >= 0.95
    assert first - float(loss) > 0.8 * (first - ent)
    assert d.embed_tokens.weight.grad is None
