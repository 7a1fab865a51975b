"""Rotary embeddings and the attention kernels of the EAGLE-3 drafter (TTT and KV-cached decode).

Shapes: ``B`` batch, ``L`` sequence, ``nh`` query heads, ``kvh`` key/value heads (GQA, ``nh % kvh == 0``),
``hd`` head dim of queries and keys, ``vd`` of values (``hd`` for the Llama-style layer; MLA's may differ), ``i`` the
0-based TTT step.

TTT attention (DESIGN.md "TTT indexing"; EAGLE-3 paper arXiv 2503.01840 section 3.3; SpecForge
``llama3_eagle.py``): the query of (step ``i``, position ``t``) sees the step-0 keys at positions
``s <= t`` and the key of every later step ``1 <= j <= i`` at the same position ``t`` (the diagonal).

Two implementations with identical results:

- ``eager``: the reference. Concatenate the keys of steps ``0..i`` into ``[(i+1)L]`` keys, build the
  explicit boolean mask of :func:`eagle3.drafter.attention.ttt_attention_mask` and softmax explicit scores.
- ``sdpa``: the fast path. One causal ``scaled_dot_product_attention`` call (flash / memory-efficient
  kernels on GPU) computes the step-0 block. The ``i`` diagonal terms enter the *same* softmax as
  ``i`` "sink" keys placed before the sequence: the query gets ``2i`` extra channels holding the
  diagonal scores (split into a high and a low part so bf16 keeps ~16 bits of the score), each sink
  key is a one-hot selector of its two channels, and each sink value is a one-hot weight column.
  The output's extra columns are then exactly the softmax weights of the diagonal keys, which
  multiply the per-position diagonal values outside the kernel. ``i`` dummy queries are prepended
  so that a plain square causal mask lets every real query see all sinks. Nothing of size
  ``[L, (i+1)L]`` is ever materialised, there are no host syncs, and every op is functional
  (torch.compile friendly). Head dim grows by ``round_up(2i, 8)``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from eagle3.errors import UserError
from eagle3.sdpa import resolve_attn_impl


# ---------------------------------------------------------------------------------------------
# rotary position embedding (Llama convention: rotate_half on two halves of the head dim)
# ---------------------------------------------------------------------------------------------
def rope_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Optional[dict],
    device=None,
    allow_yarn: bool = False,
) -> torch.Tensor:
    """Inverse frequencies of the Llama rotary embedding, float32 ``[hd/2]``.

    ``inv_freq[k] = rope_theta ** (-2k / hd)``. ``rope_scaling`` (HF ``rope_scaling`` /
    ``rope_parameters`` dict, key ``rope_type`` or ``type``) may be ``None``/``default``,
    ``linear`` (positions divided by ``factor``) or ``llama3`` (Llama-3.1 frequency-dependent
    scaling, HF ``_compute_llama3_parameters``); with ``allow_yarn`` (the MLA layer) also ``yarn``
    (:func:`yarn_inv_freq`). Other types are not implemented.

    Raises:
        UserError: unsupported ``rope_type``.
    """
    inv = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )  # [hd/2]
    if not rope_scaling:
        return inv
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rope_scaling["factor"])
    if kind == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_ctx = float(rope_scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv  # [hd/2]
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)  # [hd/2]
        smooth = (old_ctx / wavelen - low) / (high - low)  # [hd/2]
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    if kind == "yarn" and allow_yarn:
        return yarn_inv_freq(inv, head_dim, rope_theta, rope_scaling)
    raise UserError(
        f"drafter rope_scaling.rope_type '{kind}' is not supported (use default, linear or llama3)"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek-V3 / HF ``get_mscale``: ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    inv: torch.Tensor, head_dim: int, rope_theta: float, rope_scaling: dict
) -> torch.Tensor:
    """YaRN inverse frequencies ``[hd/2]`` (arXiv 2309.00071; DeepSeek-V3 ``yarn_find_correction_range`` /
    HF ``_compute_yarn_parameters``, truncated correction range): dims rotating fewer than ``beta_slow`` times
    over ``original_max_position_embeddings`` are interpolated (``inv / factor``), those rotating more than
    ``beta_fast`` times kept (``inv``), a linear ramp between. ``inv``: the unscaled ``theta ** (-2k / hd)``."""
    factor = float(rope_scaling["factor"])
    fast = float(rope_scaling.get("beta_fast", 32.0))
    slow = float(rope_scaling.get("beta_slow", 1.0))
    old_ctx = float(rope_scaling["original_max_position_embeddings"])

    def corr_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low = max(math.floor(corr_dim(fast)), 0)
    high = min(math.ceil(corr_dim(slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device=inv.device) - low) / (high - low)
    ).clamp(0, 1)  # [hd/2]: 0 = keep, 1 = interpolate
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(rope_scaling: Optional[dict]) -> float:
    """The factor YaRN multiplies cos/sin by (HF ``attention_factor``; DeepSeek-V3 ``_mscale``):
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (1 for Kimi-K2, whose two are equal); 1 without
    YaRN."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    factor = float(rope_scaling["factor"])
    if "attention_factor" in rope_scaling and rope_scaling["attention_factor"] is not None:
        return float(rope_scaling["attention_factor"])
    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return _yarn_mscale(factor, float(m)) / _yarn_mscale(factor, float(m_all))
    return _yarn_mscale(factor)


def mla_softmax_scale(qk_head_dim: int, rope_scaling: Optional[dict]) -> float:
    """Softmax scale of an MLA layer: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under
    YaRN with ``mscale_all_dim`` set (DeepSeek-V3 ``DeepseekV3Attention``, SGLang ``compute_mla_mscale_scaling``,
    vLLM ``DeepseekV2MLAAttention``: ``scaling * mscale * mscale``)."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
        m_all = rope_scaling.get("mscale_all_dim")
        if m_all:
            m = _yarn_mscale(float(rope_scaling["factor"]), float(m_all))
            scale = scale * m * m
    return scale


def rotary_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions.

    Args:
        position_ids: int64 ``[B, T]`` or ``[T]``.
        inv_freq: float32 ``[hd/2]`` from :func:`rope_inv_freq`.
    Returns:
        float32 ``(cos, sin)`` each ``[B, 1, T, hd]`` (or ``[1, 1, T, hd]``), broadcastable over
        heads; :func:`apply_rotary` casts them to the activation dtype (as HF Llama does).
    """
    pos = position_ids if position_ids.dim() == 2 else position_ids[None]  # [B, T]
    freqs = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
    return emb.cos()[:, None], emb.sin()[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, hd]`` by cos/sin ``[B, 1, T, hd]`` (HF Llama ``apply_rotary_pos_emb``)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------------------------------------
# TTT attention
# ---------------------------------------------------------------------------------------------
def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, kvh, S, hd]`` -> ``[B, kvh*rep, S, hd]`` (each kv head serves ``rep`` consecutive q heads)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    is_causal: bool = False,
    attn_mask=None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with GQA: native ``enable_gqa`` where the flash kernel can take it
    (fp16/bf16, no mask, head dim <= 256), else K/V expanded to all query heads so the memory-efficient kernel (fp32,
    masks; no GQA support) is used instead of the math fallback that materialises the scores."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and (
        q.dtype not in (torch.float16, torch.bfloat16) or attn_mask is not None or q.shape[-1] > 256
    ):
        k, v, rep = repeat_kv(k, rep), repeat_kv(v, rep), 1
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=rep > 1
    )


def ttt_attention_mask(L: int, step: int) -> torch.Tensor:
    """Which keys the queries of TTT step ``step`` see (reference mask, CPU).

    Keys are the concatenation of steps ``0..step``, each a block of ``L`` positions: key column
    ``j*L + s`` is (step ``j``, position ``s``). Query (step, ``t``) sees (0, ``s``) for ``s <= t``
    and (``j``, ``t``) for ``1 <= j <= step``.

    Returns:
        bool ``[L, (step+1)*L]``.
    """
    blocks = [torch.ones(L, L, dtype=torch.bool).tril()]  # step-0 block: causal
    blocks += [torch.eye(L, dtype=torch.bool)] * step  # later steps: diagonal
    return torch.cat(blocks, dim=1)  # [L, (step+1)L]


def ttt_attention_eager(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """Reference TTT attention with explicit scores and the explicit mask.

    Args:
        q: ``[B, nh, L, hd]`` queries of step ``i = len(keys) - 1`` (rotary applied).
        keys, values: ``i + 1`` tensors ``[B, kvh, L, hd]``, those of steps ``0..i``.
        scale: softmax scale (``1/sqrt(hd)``).

    Returns:
        ``[B, nh, L, hd]`` in ``q.dtype`` (softmax in float32).
    """
    from eagle3.drafter.attention import ttt_attention_mask

    L = q.shape[2]
    rep = q.shape[1] // keys[0].shape[1]
    k = repeat_kv(torch.cat(list(keys), dim=2), rep)  # [B, nh, (i+1)L, hd]
    v = repeat_kv(torch.cat(list(values), dim=2), rep)  # [B, nh, (i+1)L, hd]
    mask = ttt_attention_mask(L, len(keys) - 1).to(q.device)  # [L, (i+1)L]
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, nh, L, (i+1)L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [B, nh, L, (i+1)L]
    return torch.matmul(probs, v)  # [B, nh, L, hd]


def ttt_attention_sdpa(
    q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """Fast TTT attention: causal SDPA for step 0 with the diagonal terms folded in as sink keys.

    Same arguments, result and dtype as :func:`ttt_attention_eager` (see the module docstring for
    the construction). No host syncs; memory ``O(B nh L hd)``.
    """
    B, nh, L, hd = q.shape
    vd = values[0].shape[-1]  # value head dim (MLA: may differ from hd)
    kvh = keys[0].shape[1]
    rep = nh // kvh
    i = len(keys) - 1
    k0, v0 = keys[0], values[0]
    if i == 0:
        return _sdpa(q, k0, v0, scale, is_causal=True)
    dt = q.dtype
    # diagonal scores of (step i, t) against the keys of steps 1..i at t, in float32
    qg = q.reshape(B, kvh, rep, L, hd).float()  # [B, kvh, rep, L, hd]
    diag = torch.stack(
        [(qg * keys[j][:, :, None].float()).sum(-1) for j in range(1, i + 1)], dim=-1
    )  # [B, kvh, rep, L, i]
    diag = diag.reshape(B, nh, L, i)  # [B, nh, L, i] raw dot products (unscaled)
    hi = diag.to(dt)
    lo = (diag - hi.float()).to(
        dt
    )  # residual so that hi + lo carries the score to ~2x the dtype's bits
    extra = torch.stack([hi, lo], dim=-1).reshape(B, nh, L, 2 * i)  # [B, nh, L, 2i]
    pad = -(-2 * i // 8) * 8  # head-dim padding, multiple of 8 for flash kernels
    q_real = F.pad(torch.cat([q, extra], dim=-1), (0, pad - 2 * i))  # [B, nh, L, hd+pad]
    q_aug = F.pad(q_real, (0, 0, i, 0))  # [B, nh, i+L, hd+pad], i dummy zero queries first
    eye = torch.eye(i, device=q.device, dtype=dt)  # [i, i]
    sink_k = F.pad(
        eye.repeat_interleave(2, dim=1), (hd, pad - 2 * i)
    )  # [i, hd+pad]: sink j selects channels hd+2j, hd+2j+1
    sink_v = F.pad(eye, (vd, pad - i))  # [i, vd+pad]: sink j writes its weight to column vd+j
    k_aug = torch.cat(
        [sink_k.expand(B, kvh, i, hd + pad), F.pad(k0, (0, pad))], dim=2
    )  # [B, kvh, i+L, hd+pad]
    v_aug = torch.cat(
        [sink_v.expand(B, kvh, i, vd + pad), F.pad(v0, (0, pad))], dim=2
    )  # [B, kvh, i+L, vd+pad]
    o = _sdpa(q_aug, k_aug, v_aug, scale, is_causal=True)
    o = o[:, :, i:]  # [B, nh, L, vd+pad]
    w = o[..., vd : vd + i]  # [B, nh, L, i] softmax weights of the diagonal keys
    out = o[..., :vd]  # [B, nh, L, vd] step-0 part, already normalised by the full denominator
    wg = w.reshape(B, kvh, rep, L, i)
    for j in range(1, i + 1):
        out = out + (wg[..., j - 1 : j] * values[j][:, :, None]).reshape(
            B, nh, L, vd
        )  # [B, nh, L, vd]
    return out


def ttt_attention(q, keys, values, scale: float, attn_impl: str = "auto") -> torch.Tensor:
    """Dispatch to :func:`ttt_attention_eager` or :func:`ttt_attention_sdpa` (``auto`` = ``sdpa``)."""
    impl = resolve_attn_impl(attn_impl)
    if impl == "eager":
        return ttt_attention_eager(q, keys, values, scale)
    return ttt_attention_sdpa(q, keys, values, scale)


# ---------------------------------------------------------------------------------------------
# KV-cached attention (inference)
# ---------------------------------------------------------------------------------------------
def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: int,
    scale: float,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of ``T`` new queries over ``past`` cached keys plus the ``T`` new ones (causal among the new).

    Args:
        q: ``[B, nh, T, hd]``; k, v: ``[B, kvh, past + T, hd]`` (cache already extended).
        past: number of cached keys before this call (a Python int: the cache length).
        mask: optional bool ``[B, 1, T, past + T]`` (True = attend), replacing the causal rule
            (:meth:`eagle3.drafter.model.DrafterCache.attention_mask`: per-row holes in a batched cache).

    Returns:
        ``[B, nh, T, hd]``.
    """
    T = q.shape[2]
    if mask is not None:
        return _sdpa(q, k, v, scale, attn_mask=mask)
    if past == 0:
        return _sdpa(q, k, v, scale, is_causal=T > 1)
    if T == 1:
        return _sdpa(q, k, v, scale)
    mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(
        diagonal=past
    )  # [T, past+T]
    return _sdpa(q, k, v, scale, attn_mask=mask)
