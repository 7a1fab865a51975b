"""The MLA draft layer (``drafter.attention: mla``) against transformers' DeepseekV3Attention, and its TTT / decode
paths against each other."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.attention import rope_inv_freq, rotary_cos_sin, ttt_attention
from eagle3.drafter.caches import DrafterCache
from eagle3.drafter.model import Eagle3Drafter, Eagle3MLAAttention
from eagle3.errors import UserError

H, HEADS = 48, 4
YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def _args(q_lora=24, interleave=True, rope_scaling=None, **kw) -> DrafterArgs:
    mla = dict(
        q_lora_rank=q_lora,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        rope_interleave=interleave,
    )
    base = dict(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=20,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        draft_vocab_size=50,
        target_vocab_size=80,
        target_hidden_size=H,
        rope_scaling=rope_scaling,
        attention="mla",
        mla=mla,
    )
    base.update(kw)
    return DrafterArgs(**base)


def _hf_attention(a: DrafterArgs) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding]:
    m = a.mla
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling:
        rope = {**a.rope_scaling, "rope_theta": a.rope_theta}
    cfg = DeepseekV3Config(
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_attention_heads,
        q_lora_rank=m["q_lora_rank"],
        kv_lora_rank=m["kv_lora_rank"],
        qk_nope_head_dim=m["qk_nope_head_dim"],
        qk_rope_head_dim=m["qk_rope_head_dim"],
        v_head_dim=m["v_head_dim"],
        rope_interleave=m["rope_interleave"],
        rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings,
        rope_parameters=rope,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    return DeepseekV3Attention(cfg, layer_idx=0).eval(), DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize(
    "q_lora,interleave,rope_scaling",
    [(24, True, None), (None, True, None), (24, False, None), (24, True, YARN)],
)
def test_mla_matches_transformers_deepseek_v3_attention(q_lora, interleave, rope_scaling):
    """Same weights, same causal sequence: our non-absorbed MLA (+ TTT attention, step 0) equals HF's."""
    torch.manual_seed(0)
    a = _args(q_lora, interleave, rope_scaling)
    ours = Eagle3MLAAttention(a, in_mult=1).eval()
    hf, rotary = _hf_attention(a)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.3)
    hf.load_state_dict(ours.state_dict(), strict=True)  # the same parameter names and shapes
    B, T = 2, 40  # beyond original_max_position_embeddings 16: YaRN's interpolated band matters
    x = torch.randn(B, T, H)
    pos = torch.arange(3, 3 + T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive causal
    with torch.no_grad():
        ref, _ = hf(x, rotary(x, pos[None].expand(B, T)), mask)
        cos, sin = rotary_cos_sin(
            pos, rope_inv_freq(8, a.rope_theta, a.rope_scaling, allow_yarn=True)
        )
        q, k, v = ours.qkv(x, cos, sin)
        assert q.shape == k.shape == (B, HEADS, T, 20) and v.shape == (B, HEADS, T, 10)
        got = ours.out(ttt_attention(q, [k], [v], ours.scale, "eager"))
        got_sdpa = ours.out(ttt_attention(q, [k], [v], ours.scale, "sdpa"))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sdpa, ref, rtol=1e-5, atol=1e-5)
    if (
        rope_scaling
    ):  # the YaRN mscale enters the softmax scale (mscale_all_dim = 1: (0.1 ln 8 + 1)^2 / sqrt(20))
        assert ours.scale == pytest.approx(
            (0.1 * torch.log(torch.tensor(8.0)).item() + 1) ** 2 / 20**0.5
        )


def test_mla_ttt_sdpa_equals_eager_and_decode_reproduces_ttt():
    """The MLA drafter's TTT forward is the same with the reference and fast attention (v_head_dim != qk head dim),
    and KV-cached decoding of step 0 then step 1 reproduces TTT step 1 at the last position."""
    torch.manual_seed(1)
    a = _args()
    d = Eagle3Drafter(a, embed_weight=torch.randn(80, H)).eval()
    ids = torch.randint(0, 80, (2, 12))
    aux = torch.randn(2, 12, 3 * H)
    with torch.no_grad():
        eager = d.ttt_forward(ids, aux, 3, "eager")
        sdpa = d.ttt_forward(ids, aux, 3, "sdpa")
        for e, s in zip(eager, sdpa):
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-5)
        cache = DrafterCache()
        pos = torch.arange(12)[None].expand(2, 12)
        nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        h0 = d.decode(nxt, d.project(aux), pos, cache)  # step 0 over the whole sequence
        torch.testing.assert_close(h0, eager[0], rtol=1e-5, atol=1e-5)
        t = 6  # step 1 at position t: token x_{t+2}, hidden = step-0 output at t, rotary position t+1
        cache.crop(t + 1)
        h1 = d.decode(ids[:, t + 2 : t + 3], h0[:, t : t + 1], torch.full((2, 1), t + 1), cache)
    torch.testing.assert_close(h1[:, 0], eager[1][:, t], rtol=1e-5, atol=1e-5)


def test_mla_param_names_and_json_round_trip():
    a = _args()
    names = set(Eagle3Drafter(a).state_dict())
    for k in (
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
    ):
        assert f"midlayer.self_attn.{k}.weight" in names
    assert "midlayer.self_attn.q_proj.weight" not in names
    assert "midlayer.self_attn.q_proj.weight" in set(Eagle3Drafter(_args(q_lora=None)).state_dict())
    assert DrafterArgs.from_json(a.to_json()) == a
    llama = DrafterArgs(**{**a.to_json(), "attention": "llama", "mla": None})
    assert "attention" not in llama.to_json() and "mla" not in llama.to_json()


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(num_layers=2),
            "drafter: field 'mla' is for one layer, but num_layers is 2 with attention mla",
        ),
        (
            dict(mla=None),
            r"drafter: field 'mla' is required for attention mla; set drafter.mla \(q_lora_rank,",
        ),
        (dict(attention="gqa"), "drafter: field 'attention' should be 'llama' or 'mla', got 'gqa'"),
    ],
)
def test_mla_refusals(change, message):
    a = _args().to_json()
    a.update(change)
    with pytest.raises(UserError, match=message):
        DrafterArgs(**a)


def test_mla_size_refusal_names_the_key():
    a = _args().to_json()
    a["mla"] = {**a["mla"], "kv_lora_rank": 0}
    with pytest.raises(
        UserError,
        match=r"drafter: field 'mla.kv_lora_rank' should be greater than 0, got 0; set drafter.mla",
    ):
        DrafterArgs(**a)


def test_param_count_helper_sizes_smollm2(capsys):
    """The sizes given for the SmolLM2 comparison: the MLA attention is within 0.04% of the GQA one (hand counts:
    GQA q 1152*576 + k, v 2*1152*192 + o 576*576 = 1,437,696; MLA q_a 1152*384 + q_b 384*9*96 + kv_a 1152*160 +
    kv_b 128*9*128 + o 576*576 + norms 384 + 128 = 1,438,208)."""
    from eagle3.drafter.mla import main

    argv = "--hidden 576 --heads 9 --kv-heads 3 --head-dim 64 --intermediate 1536 --mla".split()
    sizes = "q_lora_rank=384,kv_lora_rank=128,qk_nope_head_dim=64,qk_rope_head_dim=32,v_head_dim=64"
    assert main(argv + [sizes, "--max-diff", "0.03"]) == 0
    out = capsys.readouterr().out
    assert "llama attention 1,437,696" in out and "mla   attention 1,438,208" in out
    small = sizes.replace("kv_lora_rank=128", "kv_lora_rank=32")
    assert main(argv + [small, "--max-diff", "0.03"]) == 1


def test_llama_verifier_needs_the_mla_sizes_set():
    from eagle3.drafter.args import MLA_FIELDS
    from eagle3.drafter.mla import mla_drafter_fields

    llama = {"hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(
        UserError, match=r"drafter.mla.kv_lora_rank is null and the verifier is not an MLA model"
    ):
        mla_drafter_fields(dict.fromkeys(MLA_FIELDS), 4, llama)
    given = dict(
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        rope_interleave=None,
    )
    f = mla_drafter_fields(given, 4, llama)
    assert (
        f["mla"]["q_lora_rank"] is None and f["mla"]["rope_interleave"] is True
    )  # plain q_proj, DeepSeek layout
    assert (f["num_key_value_heads"], f["head_dim"]) == (4, 12) and "rope_scaling" not in f


def test_mla_static_cache_decode_equals_batched_cache_decode():
    """The batch-1 static decoder's cache (value head dim != key head dim) gives the batched cache's outputs."""
    from eagle3.drafter.caches import StaticKVCache

    torch.manual_seed(2)
    d = Eagle3Drafter(_args(rope_scaling=YARN), embed_weight=torch.randn(80, H)).eval()
    ids, aux = torch.randint(0, 80, (1, 10)), torch.randn(1, 10, 3 * H)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        h = d.project(aux)
        want = d.decode(ids, h, pos, DrafterCache())
        cache = StaticKVCache(16, 1)
        got = d.decode_static(ids[:, :6], h[:, :6], pos[:, :6], cache)
        got = torch.cat([got, d.decode_static(ids[:, 6:], h[:, 6:], pos[:, 6:], cache)], dim=1)
    assert cache.k[0].shape == (1, HEADS, 16, 20) and cache.v[0].shape == (1, HEADS, 16, 10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_from_json_refuses_an_unknown_or_missing_field():
    a = _args().to_json()
    with pytest.raises(UserError, match=r"^c.json: field 'rope_typo' is not a known field$"):
        DrafterArgs.from_json({**a, "rope_typo": 1}, source="c.json")
    with pytest.raises(
        UserError, match=r"^c.json: field 'head_dim' is missing; set drafter.head_dim$"
    ):
        DrafterArgs.from_json({k: v for k, v in a.items() if k != "head_dim"}, source="c.json")
    assert DrafterArgs.from_json(a) == _args()


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(variant="eagle4"),
            r"drafter: field 'variant' should be 'eagle3' or 'eagle3.1', got 'eagle4'; set drafter.variant",
        ),
        (
            dict(num_layers=1.5),
            r"drafter: field 'num_layers' should be a valid integer, got 1.5; set drafter.num_layers",
        ),
        (
            dict(num_layers=True),
            r"drafter: field 'num_layers' should be a valid integer, got True; set drafter.num_layers",
        ),
        (
            dict(rms_norm_eps=0.0),
            r"drafter: field 'rms_norm_eps' must be a positive number, got 0.0; set drafter.rms_norm_eps",
        ),
        (
            dict(hidden_size="64"),
            r"drafter: field 'hidden_size' should be a valid integer, got '64'; set drafter.hidden_size",
        ),
    ],
)
def test_field_refusals_name_the_field(change, message):
    with pytest.raises(UserError, match=f"^{message}$"):
        DrafterArgs(**{**_args().to_json(), **change})
