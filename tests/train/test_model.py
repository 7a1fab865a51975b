"""Eagle3Drafter: SGLang parameter names, norms/rotary vs transformers' Llama, eager == fast TTT
attention (outputs and grads), TTT causality, and KV-cached decoding == ttt_forward."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.caches import DrafterCache
from eagle3.drafter.model import Eagle3Drafter, RMSNorm
from eagle3.errors import UserError
from eagle3.export.sglang import KEYS as SGLANG_KEYS


def tiny_args(**kw) -> DrafterArgs:
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        draft_vocab_size=20,
        target_vocab_size=50,
        target_hidden_size=24,
    )
    base.update(kw)
    return DrafterArgs(**base)


def scramble(d: Eagle3Drafter) -> Eagle3Drafter:
    """Non-trivial weights in place: embeddings N(0, 1), every RMSNorm's weight U(0.5, 1.5) (each its own), trainable
    matrices x10 (std 0.2: non-trivial attention patterns at this tiny width)."""
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        for m in d.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
        for p in d.parameters():
            if p.dim() == 2 and p.requires_grad:
                p.mul_(10)
    return d


def make(seed=0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return scramble(Eagle3Drafter(tiny_args(**kw)))


# ---------------------------------------------------------------------------------------------
def test_parameter_names_are_the_sglang_keys():
    d = make()
    assert set(d.state_dict()) == set(SGLANG_KEYS) | {"embed_tokens.weight"}
    assert len(SGLANG_KEYS) == 15
    a = d.args
    sd = d.state_dict()
    assert sd["fc.weight"].shape == (a.hidden_size, 3 * a.target_hidden_size)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 32)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * 32)
    assert sd["lm_head.weight"].shape == (20, 32)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (20,)
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 20
    assert not d.embed_tokens.weight.requires_grad
    trainable = {n for n, p in d.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "fc.weight" in trainable


def test_rmsnorm_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    ours, ref = RMSNorm(16, 1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 2)
        ref.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 16) * 4
    assert torch.allclose(ours(x), ref(x), atol=1e-6)
    # hand value: x = [3, 4] -> rms = sqrt(12.5)
    n = RMSNorm(2, 0.0)
    assert torch.allclose(n(torch.tensor([3.0, 4.0])), torch.tensor([3.0, 4.0]) / 12.5**0.5)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_transformers_llama(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from eagle3.drafter.attention import rope_inv_freq, rotary_cos_sin

    params = {"rope_type": "default", "rope_theta": 5000.0}
    if rope:
        params.update(rope)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters=params,
    )
    ref = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 100, 511]])
    cos_r, sin_r = ref(torch.zeros(1, 5, 16), pos)  # [1, 5, 16]
    cos, sin = rotary_cos_sin(pos, rope_inv_freq(16, 5000.0, rope))  # [1, 1, 5, 16]
    assert torch.allclose(cos[:, 0], cos_r, atol=1e-5) and torch.allclose(
        sin[:, 0], sin_r, atol=1e-5
    )


def test_unsupported_rope_scaling_is_a_user_error():
    with pytest.raises(UserError, match="yarn"):
        tiny_args(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def _close_to_scale(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """``max |a - b| <= rel * max |b|`` (rounding relative to the tensor's scale; an elementwise rtol fails on the
    small entries of a tensor whose large ones set its rounding)."""
    return bool((a - b).abs().max() <= rel * b.abs().max())


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,num_layers", [((4, 2), 1), ((4, 4), 1), ((4, 2), 2)])
def test_eager_and_sdpa_ttt_identical_outputs_and_grads(heads, num_layers):
    d = make(num_attention_heads=heads[0], num_key_value_heads=heads[1], num_layers=num_layers)
    B, L, K = 2, 13, 5
    ids = torch.randint(0, 50, (B, L))
    aux = torch.randn(B, L, 72)
    res = {}
    for impl in ("eager", "sdpa"):
        d.zero_grad()
        aux_ = aux.clone().requires_grad_(True)
        outs = d.ttt_forward(ids, aux_, K, attn_impl=impl)
        w = torch.linspace(0.5, 1.5, 20)
        loss = sum(((d.compute_logits(o) * w) ** 2).mean() * (k + 1) for k, o in enumerate(outs))
        loss.backward()
        res[impl] = (
            [o.detach() for o in outs],
            aux_.grad,
            {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad},
        )
    (oe, ge, pe), (os_, gs, ps) = res["eager"], res["sdpa"]
    assert len(oe) == K and oe[0].shape == (B, L, 32)
    # float32 rounding, eager and SDPA reducing in other orders, grows with depth and TTT step (two layers, step 5:
    # 1.9e-5 at outputs of |x| <= 45, 4.2e-7 of the scale; gradients up to 2.8e-6 of theirs): each tensor is compared
    # at 2e-6 (outputs) / 2e-5 (gradients) of its largest magnitude; a wrong mask or feedback differs by O(1)
    for a, b in zip(oe, os_):
        assert _close_to_scale(a, b, 2e-6)
    assert _close_to_scale(ge, gs, 2e-5)
    for n in pe:
        assert _close_to_scale(pe[n], ps[n], 2e-5), n
    # the steps really differ (the hidden feedback and the diagonal keys matter)
    assert (oe[1] - oe[0]).abs().max() > 1e-2


def test_sdpa_bf16_error_comparable_to_eager_bf16():
    """The sink trick keeps bf16 accuracy: its error vs float64 is close to the eager path's."""
    d = make(seed=1)
    ids = torch.randint(0, 50, (1, 16))
    aux = torch.randn(1, 16, 72)
    ref = d.double().ttt_forward(ids, aux.double(), 4, attn_impl="eager")
    d.bfloat16()
    errs = {}
    for impl in ("eager", "sdpa"):
        outs = d.ttt_forward(ids, aux.bfloat16(), 4, attn_impl=impl)
        errs[impl] = max(
            float(((o.detach().double() - r.detach()).norm() / r.detach().norm()))
            for o, r in zip(outs, ref)
        )
    assert errs["sdpa"] < 0.05
    assert errs["sdpa"] < 2 * errs["eager"] + 1e-3


def test_ttt_forward_is_causal_in_aux_and_tokens():
    d = make()
    B, L, K = 1, 10, 3
    ids = torch.randint(0, 50, (B, L))
    aux = torch.randn(B, L, 72)
    base = d.ttt_forward(ids, aux, K)
    u = 6
    aux2 = aux.clone()
    aux2[:, u] += 1.0
    pert = d.ttt_forward(ids, aux2, K)
    ids2 = ids.clone()
    ids2[:, u] = (ids[:, u] + 1) % 50
    pert_tok = d.ttt_forward(ids2, aux, K)
    for i in range(K):
        # aux f_u reaches positions t >= u only
        assert torch.allclose(base[i][:, :u], pert[i][:, :u], atol=1e-6)
        assert (base[i][:, u] - pert[i][:, u]).abs().max() > 1e-4
        # token x_u is the input of step i at t = u-1-i and reaches t >= u-1-i only
        first = u - 1 - i
        assert torch.allclose(base[i][:, :first], pert_tok[i][:, :first], atol=1e-6)
        assert (base[i][:, first] - pert_tok[i][:, first]).abs().max() > 1e-4


def test_bad_attn_impl_and_ttt_length():
    d = make()
    with pytest.raises(UserError, match="attn_impl"):
        d.ttt_forward(
            torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 72), 2, attn_impl="flash9"
        )
    with pytest.raises(UserError, match="ttt_length"):
        d.ttt_forward(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 72), 0)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers", [1, 2])
def test_kv_cached_decode_matches_ttt_every_step_and_position(num_layers):
    d = make(seed=2, num_layers=num_layers)
    B, L, K = 2, 9, 4
    ids = torch.randint(0, 50, (B, L))
    aux = torch.randn(B, L, 72)
    with torch.no_grad():
        ref = [
            d.compute_logits(o) for o in d.ttt_forward(ids, aux, K, attn_impl="eager")
        ]  # K x [B, L, V]
        ids_pad = torch.cat(
            [ids, torch.zeros(B, K + 1, dtype=torch.long)], dim=1
        )  # x_s = 0 beyond the end
        proj = d.project(aux)  # [B, L, H]
        pos = torch.arange(L).expand(B, L)
        for t in range(L):
            cache = DrafterCache()
            h0 = d.decode(
                ids_pad[:, 1 : L + 1], proj, pos, cache
            )  # prefill step 0 for all positions
            assert cache.length == L
            assert torch.allclose(d.compute_logits(h0), ref[0], atol=1e-5)
            cache.crop(t + 1)  # keep the verified prefix 0..t
            h = h0[:, t : t + 1]
            for i in range(1, K):
                h = d.decode(ids_pad[:, t + 1 + i : t + 2 + i], h, torch.full((B, 1), t + i), cache)
                assert cache.length == t + 1 + i
                assert torch.allclose(d.compute_logits(h)[:, 0], ref[i][:, t], atol=1e-5), (t, i)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_chunked_prefill_equals_single_prefill(num_layers):
    d = make(seed=3, num_layers=num_layers)
    B, L = 2, 11
    ids = torch.randint(0, 50, (B, L))
    with torch.no_grad():
        h = d.project(torch.randn(B, L, 72))
        pos = torch.arange(L).expand(B, L)
        one = d.decode(ids, h, pos, DrafterCache())
        c = DrafterCache()
        a = d.decode(ids[:, :4], h[:, :4], pos[:, :4], c)
        b = d.decode(ids[:, 4:], h[:, 4:], pos[:, 4:], c)
    assert torch.allclose(torch.cat([a, b], 1), one, atol=1e-5)


def test_cache_crop_and_clone():
    c = DrafterCache()
    assert c.length == 0
    k = torch.arange(2 * 1 * 5 * 3, dtype=torch.float32).view(2, 1, 5, 3)
    c.append(0, k, -k)
    snap = c.clone()
    c.crop(2)
    assert (
        c.length == 2
        and torch.equal(c.keys[0], k[:, :, :2])
        and torch.equal(c.values[0], -k[:, :, :2])
    )
    assert snap.length == 5
    c.append(0, k[:, :, :1], k[:, :, :1])
    assert c.length == 3 and torch.equal(c.keys[0][:, :, 2], k[:, :, 0])
    with pytest.raises(ValueError):
        c.crop(4)


# ---------------------------------------------------------------------------------------------
def test_args_json_round_trip_and_errors():
    a = tiny_args(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert DrafterArgs.from_json(a.to_json()) == a
    import json

    assert DrafterArgs.from_json(json.dumps(a.to_json())) == a
    bad = a.to_json()
    del bad["head_dim"]
    with pytest.raises(UserError, match="head_dim"):
        DrafterArgs.from_json(bad, source="x.json")
    with pytest.raises(UserError, match="num_key_value_heads"):
        tiny_args(num_key_value_heads=3)
    with pytest.raises(UserError, match="draft_vocab_size"):
        tiny_args(draft_vocab_size=51)


def test_args_from_hf_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=99,
        rms_norm_eps=1e-5,
        max_position_embeddings=300,
        rope_parameters={"rope_type": "default", "rope_theta": 7000.0},
    )
    a = DrafterArgs.from_hf_config(cfg, draft_vocab_size=32, intermediate_size=128)
    assert (a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert (a.intermediate_size, a.rms_norm_eps, a.rope_theta, a.target_vocab_size) == (
        128,
        1e-5,
        7000.0,
        99,
    )
    assert (a.draft_vocab_size, a.target_hidden_size, a.rope_scaling) == (32, 64, None)


def test_vocab_map_validation_and_mapping():
    d = make()
    ids = torch.tensor(sorted(torch.randperm(50)[:20].tolist()))
    d2t = ids - torch.arange(20)
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(d2t, t2d)
    assert torch.equal(d.draft_to_target(torch.arange(20)), ids)
    t2d_bad = t2d.clone()
    t2d_bad[ids[0]] = False
    t2d_bad[[i for i in range(50) if not t2d[i]][0]] = True
    with pytest.raises(UserError, match="d2t"):
        d.set_vocab_map(d2t, t2d_bad)
    with pytest.raises(UserError, match="int64"):
        d.set_vocab_map(d2t.int(), t2d)


def test_bf16_autocast_training_path_close_to_fp32():
    """The trainer's GPU path (fp32 weights, bf16 autocast, bf16 aux states) runs and tracks fp32."""
    from eagle3.losses.ttt import compute_targets, ttt_loss

    d = make(seed=4)
    B, L, K = 2, 12, 3
    ids = torch.randint(0, 50, (B, L))
    aux = torch.randn(B, L, 72).bfloat16()
    tg = compute_targets(torch.randn(B, L, 24), torch.randn(50, 24), d.d2t, d.t2d)
    mask = torch.ones(B, L, dtype=torch.long)
    ref = d.ttt_forward(ids, aux.float(), K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = d.ttt_forward(ids, aux, K)
        loss, m = ttt_loss(d, outs, tg, mask)
    assert outs[0].dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert d.fc.weight.grad is not None and torch.isfinite(d.fc.weight.grad).all()
    for o, r in zip(outs, ref):
        assert float((o.detach().float() - r.detach()).norm() / r.detach().norm()) < 0.05


@pytest.mark.parametrize("num_layers", [1, 2])
def test_decode_with_invalid_slots_equals_decode_without_them(num_layers):
    """Batched drafter cache with holes (padding, rejected drafts): each row's outputs at its valid
    slots equal an unbatched run over that row's valid slots only, at the same rotary positions."""
    d = make(seed=4, num_layers=num_layers)
    B, T1, T2 = 2, 6, 4
    ids = torch.randint(0, 50, (B, T1 + T2))
    h = torch.randn(B, T1 + T2, d.args.hidden_size)
    valid = torch.tensor(
        [[0, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool
    )
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # positions continue across holes
    with torch.no_grad():
        c = DrafterCache()
        a = d.decode(ids[:, :T1], h[:, :T1], pos[:, :T1], c, valid=valid[:, :T1])
        b = d.decode(ids[:, T1:], h[:, T1:], pos[:, T1:], c, valid=valid[:, T1:])
        assert c.length == T1 + T2 and torch.equal(c.valid, valid)
        out = torch.cat([a, b], 1)  # [B, T1+T2, H]
        for r in range(B):
            keep = valid[r]
            ref = d.decode(
                ids[r : r + 1, keep], h[r : r + 1, keep], pos[r : r + 1, keep], DrafterCache()
            )
            assert torch.allclose(out[r, keep], ref[0], atol=1e-5)
        c.crop(7)
        assert c.valid.shape == (B, 7) and c.length == 7
