"""The slot engine's attention, registered in transformers' ``AttentionInterface`` under :data:`ATTN_NAME`:
FlexAttention decode over per-slot KV blocks, grouped SDPA decode, and prefill at column offsets (prefix reuse)."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from eagle3.regen.flex_compat import (
    block_mask_from_kv_blocks,
    kv_blocks_params,
    raise_recompile_limit,
)
from eagle3.regen.kv_cache import SlotCache, repeat_kv
from eagle3.regen.packed_prefill import (
    packed_prefill_attention,
)

log = logging.getLogger(__name__)


ATTN_NAME = "eagle3_slots"


ATTENTIONS = ("auto", "flex", "sdpa_groups")  # SlotEngine(attention=...), prompts.regen_attention


def kv_num_blocks(attn_len: torch.Tensor, block: int) -> torch.Tensor:
    """KV blocks a decode row reads: ``ceil((attn_len + 1) / block)``, int32 ``[n, 1, 1]`` from int64 ``[n]``."""
    return torch.div(attn_len + block, block, rounding_mode="floor").to(torch.int32).view(-1, 1, 1)


def decode_block_mask(
    attn_len: torch.Tensor,
    kv_indices: torch.Tensor,
    block: int,
    kv_len: int,
    num_blocks: Optional[torch.Tensor] = None,
    q_len: int = 1,
):
    """FlexAttention ``BlockMask`` ``[n, 1, q_len, kv_len]`` of a decode step: row b attends
    columns ``[0, attn_len[b]]`` (``ceil((attn_len + 1) / block)`` blocks, a mask for the last).

    Args:
        attn_len: int64 ``[n]`` last attended column (``< kv_len``).
        kv_indices: int32 ``[n, 1, 1, kv_len / block]`` (``arange``).
        block: KV block size; kv_len: cache columns (a multiple of it).
        num_blocks: :func:`kv_num_blocks` of ``attn_len`` if computed. q_len: query positions (<= block).

    Device ops only (built inside the captured step).
    """
    nb = kv_num_blocks(attn_len, block) if num_blocks is None else num_blocks  # [n, 1, 1]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= attn_len[b]

    return block_mask_from_kv_blocks(nb, kv_indices, block, mask_mod, q_len, kv_len)


def flex_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_len: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: Optional[float],
    block: int,
    num_blocks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decode attention with per-row KV lengths through FlexAttention.

    The ``G = H // Hkv`` query heads of a KV head become its ``G`` query positions (head
    ``kv * G + g``, as HF's ``repeat_kv``) instead of ``enable_gqa``, whose split-KV kernel needs a
    power-of-two ``G``.

    Args:
        query: ``[n, H, 1, D]``; key, value: ``[n, Hkv, L, D]``.
        attn_len: int64 ``[n]``; kv_indices: int32 ``[n, 1, 1, L / block]``.
        scale: softmax scale (None: ``1 / sqrt(D)``); block: KV block size.
        num_blocks: int32 ``[n, 1, 1]`` if computed.

    Returns:
        ``[n, H, 1, D]`` in the query's dtype.
    """
    n, h, _, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(n, hkv, h // hkv, d)  # [n, Hkv, G, D]
    bm = decode_block_mask(attn_len, kv_indices, block, key.shape[2], num_blocks, q_len=h // hkv)
    out = flex_attention(q, key, value, block_mask=bm, scale=scale)  # [n, Hkv, G, Dv]
    return out.reshape(n, h, 1, value.shape[-1])  # Dv = D except MLA (kv_head_dims)


_COMPILED_FLEX = None


def compiled_flex_decode():
    """:func:`flex_decode` under ``torch.compile`` (one per process; a recompile per slot prefix, so the
    recompile limit is raised to 64)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        kv_blocks_params()  # inspect.signature runs here, eagerly: the traced function only reads the result
        raise_recompile_limit()
        _COMPILED_FLEX = torch.compile(flex_decode, dynamic=False, fullgraph=True)
    return _COMPILED_FLEX


def offset_prefill_layout(
    offsets: torch.Tensor, width: int, cols: int, kw: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the queries of a prefill at column offsets go and what they attend.

    Args:
        offsets: int64 ``[P]`` cached columns per row. width: padded suffix width ``Wp``.
        cols: cache columns per slot ``L``.
        kw: attended columns ``Kw`` (static, no host sync; must cover every real query); None:
            ``min(L, max(offsets) + Wp)``.

    Returns:
        ``(cols_idx int64 [P, Wp], mask bool [P, 1, Wp, Kw])``: query j of row r writes column
        ``offsets[r] + j`` (clamped to ``L - 1``; only padding reaches it) and attends columns
        ``c <= offsets[r] + j``; column 0 is always attended.
    """
    j = torch.arange(width, device=offsets.device)  # [Wp]
    pos = offsets[:, None] + j  # [P, Wp] absolute position of each query
    kw = min(cols, int(offsets.max()) + width) if kw is None else kw
    mask = torch.arange(kw, device=offsets.device) <= pos[:, :, None]  # [P, Wp, Kw]
    return pos.clamp(max=cols - 1), mask[:, None]


def offset_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    rows: torch.Tensor,
    cols_idx: torch.Tensor,
    mask: torch.Tensor,
    scaling: Optional[float],
) -> torch.Tensor:
    """Prefill attention of suffixes continuing cached prefixes (one layer).

    Args:
        query: ``[P, H, Wp, D]``; key, value: ``[P, Hkv, Wp, D]``.
        kc, vc: the layer's cache ``[S, Hkv, L, D]``; rows: int64 ``[P]`` slots.
        cols_idx, mask: :func:`offset_prefill_layout`'s. scaling: softmax scale.

    Returns:
        ``[P, H, Wp, D]``.
    """
    h, hkv = query.shape[1], key.shape[1]
    kc[rows[:, None], :, cols_idx] = key.transpose(
        1, 2
    )  # [P, Wp, Hkv, D] at columns offsets[r] + j
    vc[rows[:, None], :, cols_idx] = value.transpose(1, 2)
    kw = mask.shape[-1]
    k, v = (
        kc[rows, :, :kw],
        vc[rows, :, :kw],
    )  # [P, Hkv, Kw, D]: cached prefix + the suffix just written
    return torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(k, h // hkv), repeat_kv(v, h // hkv), attn_mask=mask, scale=scaling
    )  # [P, H, Wp, D]


def slot_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    slot_cache: Optional[SlotCache] = None,
    **kwargs,
):
    """:class:`SlotEngine`'s attention, registered as ``AttentionInterface[ATTN_NAME]`` (the
    signature of transformers' ``sdpa_attention_forward``).

    Modes by ``slot_cache``: ``packed`` (packed prefill), ``rows`` (right-padded prefill into the
    rows' slots, causal; with ``prefill_mask`` at column offsets), else decode over the slot prefix
    ``[:n]``: K/V written at ``lengths[s]``, then FlexAttention (``flex``) or per-group SDPA.
    Returns ``(out [B, q_len, H, D], None)``.
    """
    c = slot_cache
    if c is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' needs the slot_cache keyword (only SlotEngine calls it)"
        )
    kc, vc = c.k[module.layer_idx], c.v[module.layer_idx]
    if (
        c.packed is not None
    ):  # packed prefill: rows back to back in one sequence (eagle3.regen.packed_prefill)
        return packed_prefill_attention(query, key, value, kc, vc, c.packed, scaling).transpose(
            1, 2
        ), None
    if c.rows is not None:
        return _prefill(c, kc, vc, query, key, value, scaling), None
    return _decode(c, kc, vc, query, key, value, scaling), None


def _prefill(c: SlotCache, kc, vc, query, key, value, scaling) -> torch.Tensor:
    """Prefill of ``c.rows``' slots (query ``[P, H, Wp, D]``, key/value ``[P, Hkv, Wp, D]``): K/V written at columns
    ``[0, Wp)`` and causal attention over the prompt, or with ``c.prefill_mask`` suffixes after cached prefixes
    (:func:`offset_prefill_attention`). Returns ``[P, Wp, H, D]``."""
    if c.prefill_mask is not None:  # suffixes after cached prefixes
        out = offset_prefill_attention(
            query, key, value, kc, vc, c.rows, c.prefill_cols, c.prefill_mask, scaling
        )
        return out.transpose(1, 2)
    h, q_len = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    kc[c.rows, :, :q_len] = key
    vc[c.rows, :, :q_len] = value
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        repeat_kv(key, h // hkv),
        repeat_kv(value, h // hkv),
        is_causal=True,
        scale=scaling,
    )  # [P, H, Wp, D]
    return out.transpose(1, 2)


def _decode(c: SlotCache, kc, vc, query, key, value, scaling) -> torch.Tensor:
    """One decode step over the slot prefix ``[:n]`` (query ``[n, H, 1, D]``, key/value ``[n, Hkv, 1, D]`` written at
    column ``c.lengths[s]``): FlexAttention over live blocks, or per slot group SDPA under its mask. Returns
    ``[n, 1, H, Dv]``."""
    b, h, _, d = query.shape
    hkv = key.shape[1]
    ar = torch.arange(b, device=query.device)
    kc[ar, :, c.lengths] = key[:, :, 0]  # [n, Hkv, D] at column lengths[s]
    vc[ar, :, c.lengths] = value[:, :, 0]
    if c.flex is not None:
        out = c.flex(
            query, kc[:b], vc[:b], c.attn_len, c.kv_indices[:b], scaling, num_blocks=c.kv_blocks
        )  # [n, H, 1, D]
        return out.transpose(1, 2)
    q = query.reshape(b, hkv, h // hkv, d)  # [n, Hkv, G, D]: head h = kv * G + g
    outs = []
    for s0, s1, mask in c.groups:  # each slot group reads its cap's columns
        w = mask.shape[-1]
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[s0:s1], kc[s0:s1, :, :w], vc[s0:s1, :, :w], attn_mask=mask, scale=scaling
            )
        )  # [S_g, Hkv, G, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [n, Hkv, G, D]
    return out.reshape(b, 1, h, vc.shape[-1])  # value width: D except MLA (kv_head_dims)


class AttentionSwap:
    """Context manager: inside, ``model`` runs the attention function ``fn`` registered in transformers'
    ``AttentionInterface`` as ``name`` (default: this engine's :func:`slot_attention`); its former attention
    implementation after. Also used by 05's batch-1 static decoder (:mod:`eagle3.decoding.static_decode`)."""

    def __init__(self, model, name: str = ATTN_NAME, fn=None):
        self.model, self.name, self.fn = model, name, slot_attention if fn is None else fn

    def __enter__(self):
        AttentionInterface.register(self.name, self.fn)
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)
