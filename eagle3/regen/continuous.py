"""Continuous-batching greedy decoders for stage 01's in-process regeneration.

Both engines share one contract (:class:`Engine`): :meth:`Engine.submit` queues a prompt (token ids)
under a key with a priority (and, optionally, ``retain`` / ``parent`` for cross-turn prefix reuse: hints the
slot engine uses and :class:`HFContinuousEngine` ignores), :meth:`Engine.results` decodes and yields ``(key, answer_ids, stop)``
as answers finish; the caller may submit more prompts while iterating (stage 01 submits turn k+1 of a
conversation when turn k's answer arrives), and the iteration ends when nothing is queued or running.
Answers are greedy: the new tokens up to (excluding) the first stop token, ``stop`` that token's id (``int``), None
when the ``max_new_tokens`` budget ran out first, as :func:`eagle3.regen.regenerate.generate_greedy` returns them.

* :class:`SlotEngine` (``prompts.regen_engine: slots``): a fixed number of decode slots over a
  preallocated KV cache ``[slots, kv_heads, max_len, head_dim]`` per layer. A finished row's slot is
  refilled by the next waiting prompt at the next check (every ``check_every`` steps: the only host
  syncs; rows that finish in between idle until then); new prompts are prefilled in right-padded
  batches straight into their slots, the lowest free slot first. Attention runs through a function
  registered in transformers' ``AttentionInterface`` (the verifier's own modules, weights and RoPE do the
  rest). Decode attention (``attention``, ``prompts.regen_attention``):

  - ``flex``: PyTorch FlexAttention (``torch.nn.attention.flex_attention``, compiled on CUDA, eager on
    CPU) with a ``BlockMask`` built on device each step from the per-slot lengths: a live row reads only
    its ``ceil((length + 1) / block)`` KV blocks (a mask for the partial last block), a finished or empty
    slot one block. The whole cache is one group. Grouped-query heads are folded into the query
    length, as on the SDPA path (:func:`flex_decode` says why).
  - ``sdpa_groups``: slots form groups by width class (column caps, e.g. answer budget + 128 / + 512 /
    + 1024 / the full cache): a prompt takes a slot of the narrowest class holding it and its answer, and a
    group's SDPA reads only its cap's columns under a length mask. Grouped-query heads are folded into the
    query length (``[S, kv_heads, group, D]`` against ``[S, kv_heads, cap, D]``), so K/V are never repeated.
  - ``auto``: ``flex`` on CUDA when it compiles and captures in a CUDA graph (probed at construction),
    else ``sdpa_groups`` with a one-line warning; ``sdpa_groups`` on CPU.

  Every decode window runs over a slot prefix ``[:n]``, ``n`` the smallest of ``S, S/2, S/4, ... (>=
  min_prefix)`` holding every live slot (state tensors and caches are sliced views, so a step over
  ``[:n]`` touches only those rows): the long multi-turn tail, with a handful of rows live, costs a
  small step instead of a full one. On CUDA each prefix's decode step is captured once as a CUDA graph
  (``cuda_graphs``), so a step costs its kernels, not ~30 layers of Python.

  Cross-turn prefix reuse (``prefix_reuse``, ``prompts.regen_prefix_reuse``): turn k+1 of a conversation begins
  with turn k's prompt and answer, whose K/V were in a slot a moment ago. A request submitted with ``retain=True``
  keeps its slot when it finishes, holding the K/V of its prompt and of its answer less the last generated token
  (a token's K/V are written when it is fed back, and the last one never is), until the check after its answer
  is yielded. A request submitted by then with ``parent=<that key>`` takes the slot (no free slot needed, ahead of
  the priority order); the engine compares the cached ids with the new prompt's (a re-rendered template can
  tokenise the boundary differently: ids, not assumptions) and prefills only the suffix after the longest common
  prefix, at RoPE positions and cache columns offset by its length, attending the cached columns and causally
  within the suffix (:func:`offset_prefill_attention`, an explicit mask per row; rows at offset 0 share the masked
  forward, a forward without offsets takes the causal path). A common prefix under ``reuse_min_tokens``, a slot
  of too narrow a width class or a parent no longer held means a full prefill. Unclaimed retained slots are
  freed at that check, so a retained slot idles for at most one decode window more than a freed one.

  Prefill graphs (``prefill_graphs``, ``prompts.regen_prefill_graphs``): an eager prefill forward is bound by the
  host dispatch of the HF forward (H200, SmolLM2: 35-48 ms whatever it carries), so prefill forwards can run at
  bucketed shapes (:func:`prefill_bucket`: rows, padded width and the offset path's attended columns rounded up to
  powers of two), each bucket captured once as a CUDA graph over static buffers (ids, slots, offsets, last-token
  index in; the first answer token per row out) and replayed after. Padded rows point at one scratch cache row after
  the slots (never read: decode runs over prefixes ``[:n]``, ``n <= slots``); a real row's padded positions land past
  its length, as before. On the CPU, without ``cuda_graphs`` or after a failed capture the same bucketed forwards
  run eagerly.
* :class:`HFContinuousEngine` (``prompts.regen_engine: hf_continuous``): transformers'
  ``ContinuousBatchingManager`` (``model.init_continuous_batching``; paged KV cache, its own scheduler
  thread). Without the flash-attn package its attention is ``paged|sdpa``, which packs every request of
  a step into one sequence with a ``[1, 1, queries, all cached keys]`` mask: a decode step of B rows
  scores B x (all rows' keys), B times the work of per-row attention (transformers 5.17 and 5.24,
  ``integrations/sdpa_paged.py``; its fused decode path needs ``flash_attn_with_kvcache``). Kept as the
  library baseline that ``bench/regen_speed.py`` measures beside the slot engine.

Greedy tokens equal plain transformers greedy decoding in float32 (tests/test_continuous.py: a tiny
random Llama and the real SmolLM2 GGUF, varied batch compositions); in bf16 other batch compositions
round differently, which ``bench/regen_speed.py`` counts with the logit gap at the first difference.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from eagle3.errors import UserError
from eagle3.regen.flex_compat import (
    block_mask_from_kv_blocks,
    kv_blocks_params,
    raise_recompile_limit,
)
from eagle3.regen.packed_prefill import (
    PackedBuffers,
    compiled_packed_flex,
    eager_packed_flex,
    packed_layout,
    packed_prefill_attention,
)
from eagle3.sdpa import no_cudnn_sdpa

log = logging.getLogger(__name__)

ATTN_NAME = "eagle3_slots"
ATTENTIONS = ("auto", "flex", "sdpa_groups")  # SlotEngine(attention=...), prompts.regen_attention
# Fed tokens per packed prefill forward off CUDA (eager FlexAttention builds the dense [H, Tq, Tq + Tp] scores of a
# layer: SmolLM2's 9 heads at 2,048 + 4,096 positions, fp32, are ~0.3 GB), whatever prompts.regen_prefill_tokens says.
PACK_EAGER_TOKENS = 2048


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, L, D] -> [B, Hkv * groups, L, D]`` (query head h reads KV head h // groups, as HF's repeat_kv)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


@dataclass
class SlotCache:
    """Preallocated KV cache of :class:`SlotEngine` and the per-forward routing its attention reads.

    Attributes:
        k, v: per layer ``[S, Hkv, L, D]`` in the verifier's dtype (``L``: ``max_len``, rounded up to whole
            flex blocks on the flex path).
        rows: prefill mode: slot index of each prefill row, int64 ``[P]``; None = decode mode.
        lengths: decode mode: cached tokens per slot of the step's prefix (= the column the step's key is
            written to), int64 ``[n]``.
        groups: decode, ``sdpa_groups``: per slot group clipped to the prefix ``(first slot, end slot, mask
            [S_g, 1, 1, cap])``, mask True where a slot's cached column is attended (the group reads its cap's columns).
        flex: decode, ``flex``: ``fn(query, key, value, attn_len, kv_indices, scale, kv_num_blocks=)``
            (:func:`flex_decode` with the block size bound); None on the sdpa_groups path.
        attn_len: decode, ``flex``: last attended column per row of the prefix, int64 ``[n]`` (0 for finished
            and empty slots: they read one block).
        kv_indices: decode, ``flex``: static block indices ``[S, 1, 1, L / block]`` int32 (``arange`` per row).
        prefill_cols, prefill_mask: prefill of rows at column offsets (cross-turn prefix reuse; None: every row from
            column 0, causal): :func:`offset_prefill_layout`.
        packed: packed prefill mode (``prefill_pack``): the forward's
            :class:`eagle3.regen.packed_prefill.PackedRouting`; None otherwise.
    """

    k: list
    v: list
    rows: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None
    groups: Optional[list] = None
    flex: Optional[object] = None
    attn_len: Optional[torch.Tensor] = None
    kv_indices: Optional[torch.Tensor] = None
    kv_blocks: Optional[torch.Tensor] = (
        None  # decode, flex: blocks per row, int32 [n, 1, 1] (once per step, not per layer)
    )
    prefill_cols: Optional[torch.Tensor] = (
        None  # prefill at offsets: cache column of each query, int64 [P, Wp]
    )
    prefill_mask: Optional[torch.Tensor] = (
        None  # prefill at offsets: attended columns, bool [P, 1, Wp, Kw]
    )
    packed: Optional[object] = (
        None  # packed prefill: eagle3.regen.packed_prefill.PackedRouting (None otherwise)
    )


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
    """FlexAttention ``BlockMask`` of a decode step: row b attends columns ``[0, attn_len[b]]``.

    Args:
        attn_len: int64 ``[n]``, last attended column per row (``< kv_len``).
        kv_indices: int32 ``[n, 1, 1, kv_len / block]``, block ``j`` of every row at position ``j`` (``arange``).
        block: KV block size (columns); ``kv_len`` must be a multiple of it.
        kv_len: KV columns of the cache.
        num_blocks: :func:`kv_num_blocks` of ``attn_len`` when already computed (the engine: once per step).
        q_len: query positions (``<= block``: one query block); every position of a row sees the same columns
            (:func:`flex_decode` puts a KV head's grouped query heads there).

    Returns:
        ``BlockMask`` of shape ``[n, 1, q_len, kv_len]``: ``ceil((attn_len + 1) / block)`` blocks per row, a
        ``mask_mod`` ``kv_idx <= attn_len[b]`` for the partial last block. Device ops only (no host sync), so
        it is built inside the captured step.
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

    Args:
        query: ``[n, H, 1, D]``; key, value: ``[n, Hkv, L, D]`` (``H`` a multiple of ``Hkv``). The ``G = H // Hkv``
            query heads of a KV head become its ``G`` query positions (``[n, Hkv, G, D]``, head ``h = kv * G + g``
            as HF's ``repeat_kv``), not ``enable_gqa``: Inductor's split-KV decode kernel takes GQA only for a
            power-of-two ``G`` (torch ``_inductor/kernel/flex/flex_decoding.py`` ``_use_flex_decoding``) and
            SmolLM2's is 3, so with ``enable_gqa`` the main kernel ran one query row per 128-row tile (the H200
            lease of 2026-12-02: 0.66 ms per layer for 1024 rows x ~400 columns, ~8x the bandwidth time).
        attn_len: int64 ``[n]``, row b attends columns ``[0, attn_len[b]]``.
        kv_indices: int32 ``[n, 1, 1, L / block]`` (see :func:`decode_block_mask`).
        scale: softmax scale (None: ``1 / sqrt(D)``).
        block: KV block size.
        num_blocks: int32 ``[n, 1, 1]``, :func:`kv_num_blocks` of ``attn_len`` if already computed.

    Returns:
        ``[n, H, 1, D]``, the query's dtype.
    """
    from torch.nn.attention.flex_attention import flex_attention

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


def synced_seconds(dev: torch.device, fn) -> float:
    """Host seconds of ``fn()`` between two device syncs (CUDA; elsewhere plain host seconds): a compile or a CUDA
    graph capture timed whole, queued work included."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences (ids compared one by one: a re-tokenised
    chat template may split the previous answer's last tokens differently, so nothing is assumed)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def offset_prefill_layout(
    offsets: torch.Tensor, width: int, cols: int, kw: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the queries of a prefill at column offsets go, and what they attend.

    Row r's ``width`` query positions (its suffix, right-padded) are tokens ``offsets[r] + j`` of its sequence;
    columns ``[0, offsets[r])`` of its slot already hold the K/V of the tokens before them (the parent turn's
    prompt and answer).

    Args:
        offsets: int64 ``[P]``, cached columns per row (0 for a row prefilled from scratch).
        width: padded suffix width ``Wp``.
        cols: cache columns per slot (``L``); every real token's column ``offsets[r] + j`` is ``< L - 1``.
        kw: attended columns ``Kw`` of the mask when given (a bucketed prefill: a static shape, no host sync; it must
            cover every real query, ``Kw >= offsets[r] + suffix length`` for each row); None: ``min(L, max(offsets) +
            Wp)``, read from ``offsets`` (one host sync on CUDA).

    Returns:
        ``(cols_idx, mask)``: ``cols_idx`` int64 ``[P, Wp]``, the column each query's K/V is written to,
        ``offsets[r] + j`` clamped to ``L - 1`` (only padding positions reach the clamp: their K/V land beyond the
        row's length, where decode writes before it reads); ``mask`` bool ``[P, 1, Wp, Kw]``, ``Kw = min(L,
        max(offsets) + Wp)``: query j of row r attends column c iff ``c <= offsets[r] + j`` (the cached prefix,
        then causal within the suffix). A padding query at or past ``Kw`` attends all ``Kw`` columns (never none:
        column 0 is always attended, so no row of the softmax is empty).
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
    """Prefill attention of suffixes that continue cached prefixes (one layer).

    Args:
        query: ``[P, H, Wp, D]``; key, value: ``[P, Hkv, Wp, D]`` of the right-padded suffixes.
        kc, vc: the layer's cache ``[S, Hkv, L, D]``; the suffix K/V are written at ``cols_idx``.
        rows: int64 ``[P]``, the rows' slots.
        cols_idx, mask: :func:`offset_prefill_layout` (``[P, Wp]`` int64, ``[P, 1, Wp, Kw]`` bool).
        scaling: softmax scale (None: ``1 / sqrt(D)``).

    Returns:
        ``[P, H, Wp, D]``: each suffix query over its row's cached columns and the suffix up to itself.
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
        query, _repeat_kv(k, h // hkv), _repeat_kv(v, h // hkv), attn_mask=mask, scale=scaling
    )  # [P, H, Wp, D]


def _pow2_ceil(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def prefill_bucket(
    rows: int, width: int, kv: int, max_rows: int, cols: int, min_width: int = 16
) -> tuple[int, int, int]:
    """The static shape a bucketed prefill forward (``SlotEngine(prefill_graphs=True)``) runs at.

    Each dimension is rounded up to a power of two, then capped: a forward of ``rows`` prompts right-padded to
    ``width`` tokens runs as ``Pb`` rows of ``Wb`` tokens (the ``Pb - rows`` padded rows write only the engine's
    scratch cache row), and a prefill at column offsets attends ``Kwb`` cache columns. Few distinct shapes, so each
    is captured once as a CUDA graph; the padding costs at most 2x per dimension.

    Args:
        rows: prompts in the forward, ``1 <= rows <= max_rows``.
        width: the longest suffix fed (tokens), ``1 <= width <= cols``.
        kv: cache columns the offset path must attend, the longest prompt of the forward (cached prefix + suffix,
            ``<= cols``); 0 for a forward without offsets (the causal path, which reads no cache columns).
        max_rows: the engine's slots (``Pb`` cap).
        cols: cache columns per slot (``Wb`` and ``Kwb`` cap).
        min_width: smallest ``Wb`` (tokens).

    Returns:
        ``(Pb, Wb, Kwb)``: ``min(max_rows, 2^ceil(log2 rows))``, ``min(cols, max(min_width, 2^ceil(log2 width)))``
        and ``min(cols, 2^ceil(log2 kv))`` (0 when ``kv`` is 0). E.g. ``prefill_bucket(5, 40, 0, 1024, 2560) == (8, 64,
        0)``, ``prefill_bucket(3, 300, 1100, 1024, 2560) == (4, 512, 2048)``.

    Raises:
        ValueError: an argument out of range.
    """
    if not (1 <= rows <= max_rows and 1 <= width <= cols and 0 <= kv <= cols and min_width >= 1):
        raise ValueError(
            f"prefill_bucket: 1 <= rows ({rows}) <= max_rows ({max_rows}), 1 <= width ({width}) <= cols "
            f"({cols}), 0 <= kv ({kv}) <= cols, min_width ({min_width}) >= 1"
        )
    return (
        min(max_rows, _pow2_ceil(rows)),
        min(cols, max(min_width, _pow2_ceil(width))),
        min(cols, _pow2_ceil(kv)) if kv else 0,
    )


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
    """Attention of :class:`SlotEngine`, registered as ``AttentionInterface[ATTN_NAME]`` (same signature as
    transformers' ``sdpa_attention_forward``).

    Packed prefill (``slot_cache.packed`` set): query ``[1, H, Tq, D]`` of rows back to back
    (:func:`eagle3.regen.packed_prefill.packed_prefill_attention`). Prefill (``slot_cache.rows`` set): query
    ``[P, H, Wp, D]``, key/value ``[P, Hkv, Wp, D]`` of right-padded prompts; K/V are written to columns ``[0, Wp)``
    of the rows' slots and the output is causal attention over the prompt itself (a real token never sees the padding after it). With ``slot_cache.prefill_mask`` set the rows
    are suffixes at column offsets (:func:`offset_prefill_attention`: written at ``offsets[r] + j``, attending the
    slot's cached prefix and the suffix causally). Decode over the slot prefix ``[:n]``:
    query ``[n, H, 1, D]``, key/value ``[n, Hkv, 1, D]`` written at column ``lengths[s]`` of slot s, then either
    FlexAttention over each row's live blocks (``slot_cache.flex``) or per slot group SDPA over the group's
    first ``cap`` columns under its mask, with the ``H // Hkv`` query heads of a KV head as its query
    positions. Returns ``(out [B, q_len, H, D], None)``.
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
    b, h, q_len, d = query.shape
    hkv = key.shape[1]
    if (
        c.rows is not None and c.prefill_mask is not None
    ):  # prefill of suffixes after cached prefixes
        out = offset_prefill_attention(
            query, key, value, kc, vc, c.rows, c.prefill_cols, c.prefill_mask, scaling
        )
        return out.transpose(1, 2), None
    if c.rows is not None:  # prefill
        kc[c.rows, :, :q_len] = key
        vc[c.rows, :, :q_len] = value
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            _repeat_kv(key, h // hkv),
            _repeat_kv(value, h // hkv),
            is_causal=True,
            scale=scaling,
        )  # [P, H, Wp, D]
        return out.transpose(1, 2), None
    ar = torch.arange(b, device=query.device)
    kc[ar, :, c.lengths] = key[:, :, 0]  # [n, Hkv, D] at column lengths[s]
    vc[ar, :, c.lengths] = value[:, :, 0]
    if c.flex is not None:
        out = c.flex(
            query, kc[:b], vc[:b], c.attn_len, c.kv_indices[:b], scaling, num_blocks=c.kv_blocks
        )  # [n, H, 1, D]
        return out.transpose(1, 2), None
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
    return out.reshape(b, 1, h, vc.shape[-1]), None  # value width: D except MLA (kv_head_dims)


def prefix_sizes(slots: int, min_prefix: int = 8) -> list[int]:
    """Slot prefixes a decode window may run over, ascending: ``slots``, ``ceil(slots / 2)``, ... while >= ``min_prefix``
    (``slots`` alone when ``slots <= min_prefix``). E.g. ``prefix_sizes(1024) == [8, 16, ..., 512, 1024]``."""
    if slots < 1 or min_prefix < 1:
        raise ValueError("prefix_sizes: slots and min_prefix >= 1")
    sizes = [slots]
    while -(-sizes[-1] // 2) >= min_prefix and sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2))
    return sorted(set(sizes))


def choose_prefix(sizes: Sequence[int], live: Sequence[int]) -> int:
    """The smallest prefix of ``sizes`` (ascending, as :func:`prefix_sizes`) holding every slot index in ``live``
    (the smallest prefix when nothing is live). ValueError when a live slot lies beyond the largest prefix."""
    top = max(live, default=-1)
    for n in sizes:
        if n > top:
            return n
    raise ValueError(f"choose_prefix: live slot {top} beyond the largest prefix {sizes[-1]}")


def defer_refill(n_free: int, slots: int, queued: int, refill_free: float) -> bool:
    """Whether :class:`SlotEngine` leaves its free slots empty at this check instead of prefilling queued prompts.

    A prefill forward costs about the same whatever it carries (H200, lease 2026-12-04d: 35-39 ms per forward of
    3-6K prompt tokens, bound by the eager forward's dispatch), so while the engine is busy it refills in bulk:
    it defers while fewer than ``refill_free * slots`` slots are free, at least half the slots are busy, and more
    prompts are queued than slots are free (so the next check will fill them all). Deferring leaves those rows idle
    for ``check_every`` decode steps; a decode step costs about the same with or without them.

    Args:
        n_free: free slots (a successor's retained slot counts as free for it).
        slots: slots of the engine.
        queued: prompts waiting, successors included.
        refill_free: share of the slots that must be free before a refill (``prompts.regen_refill_free``; 1/32:
            the setting every measured run used).
    """
    return n_free < refill_free * slots and 2 * (slots - n_free) >= slots and queued > n_free


class AttentionSwap:
    """Context manager: inside, ``model`` runs the attention function ``fn`` registered in transformers'
    ``AttentionInterface`` as ``name`` (default: this engine's :func:`slot_attention`); its former attention
    implementation after. Also used by 05's batch-1 static decoder (:mod:`eagle3.benchmark.static_decode`)."""

    def __init__(self, model, name: str = ATTN_NAME, fn=None):
        self.model, self.name, self.fn = model, name, slot_attention if fn is None else fn

    def __enter__(self):
        from transformers import AttentionInterface

        AttentionInterface.register(self.name, self.fn)
        self.old = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.name)
        return self

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.old)


@dataclass(order=True)
class _Waiting:
    priority: tuple
    key: object = field(compare=False)
    ids: list = field(compare=False)
    parent: object = field(
        compare=False, default=None
    )  # key of the retained request this prompt continues
    retain: bool = field(
        compare=False, default=False
    )  # keep the slot's K/V for a successor when it finishes


@dataclass
class _Held:
    """A finished request's slot kept for its successor: ``ids`` are the tokens whose K/V fill columns
    ``[0, len(ids))`` (prompt + answer less its last token, whose K/V were never written); ``delivered``: its answer
    has been yielded, so the caller has had its chance to submit the successor."""

    key: object
    ids: list
    delivered: bool = False


def capture_graph(fn, pool, after_warmup=None):
    """``fn`` (device work on the current CUDA stream, static shapes, no host sync) captured as a CUDA graph.

    As torch requires, ``fn`` runs once on a side stream first (allocator warm-up, lazy initialisation, a compile),
    then ``after_warmup()`` (e.g. restoring state the warm-up advanced), then the capture into a graph allocating from
    ``pool`` (``torch.cuda.graph_pool_handle()``; graphs sharing a pool must replay one at a time).

    Returns:
        the ``torch.cuda.CUDAGraph``; replaying it repeats ``fn``'s device work on the captured tensors.

    Raises:
        whatever the warm-up or the capture raises (the caller falls back to eager).
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    if after_warmup is not None:
        after_warmup()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    return g


@dataclass
class _PrefillBuffers:
    """Static tensors of one prefill bucket ``key = (Pb, Wb, Kwb)`` (:func:`prefill_bucket`; ``Kwb`` 0: the causal
    path): what its forward reads (filled by ``copy_`` before each forward) and writes, and its CUDA graph (None:
    not captured, run eagerly)."""

    key: tuple
    ids: torch.Tensor  # int64 [Pb, Wb] token ids, right-padded with 0
    meta: torch.Tensor  # int64 [4, Pb]: slot (padded rows: the scratch row S), offset, last prompt index, prompt length
    tok: torch.Tensor  # int64 [Pb] output: first answer token of each row
    graph: Optional[object] = None

    @classmethod
    def make(cls, key: tuple, dev) -> "_PrefillBuffers":
        pb, wb, _ = key
        z = dict(dtype=torch.long, device=dev)
        return cls(key, torch.zeros(pb, wb, **z), torch.zeros(4, pb, **z), torch.zeros(pb, **z))


# ---------------------------------------------------------------- prompts.regen_compile: auto
# What a compiled decode step costs and saves, measured on one H200 with SmolLM2-135M-Instruct in bf16, 1,024 slots,
# flex attention, CUDA graphs, 512 new tokens (the committed 17K / 127K configs). Other verifiers, slot counts or GPUs
# differ; `auto` uses these figures as they are, so its decision is an estimate for anything else.
# Seconds of the first full-prefix step with the whole step compiled from a COLD Inductor cache (compile + CUDA graph
# capture): bench/results/h200-20261204/regen_speed_cold.json, main.engine_stats.first_step_s["1024"] = 41.36 s (the
# 100K run of the same lease: 35.6 s, h200-20261204/prompts_report.json; a warm cache: 10.2 s, regen_speed_warm.json).
# The cold figure, because a fresh machine is the usual case and a warm cache cannot be told apart before compiling.
COMPILE_COLD_S = 41.4
# Milliseconds of one eager full-prefix decode step: bench/results/h200-20261203/prompts_report.json (lease 03, 100K
# conversations uncompiled), regeneration.engine_stats[0]: decode_s 203.68 s / 26,928 decode steps = 7.56 ms.
EAGER_STEP_MS = 7.56
# Milliseconds of one compiled full-prefix decode step in steady state: bench/results/h200-20261204/
# regen_speed_{cold,warm}.json, (decode_s - sum(first_step_s)) / decode_steps = 5.64 / 5.67 ms (the 100K run: 5.10 ms).
COMPILED_STEP_MS = 5.65


def estimate_decode_steps(answers: int, max_new_tokens: int, slots: int) -> int:
    """Decode steps a slot engine is expected to run for ``answers`` turns: the answer-token budget over the rows,
    ``ceil(answers * max_new_tokens / slots)``.

    An ESTIMATE on the high side, not a bound: it takes every answer to use its whole ``max_new_tokens`` and every
    row to stay busy. Measured runs used about half the budget (the H200 17K config: 18,081 answers, estimate 9,041
    steps, ran 5,440; 100K conversations of the 127K config: 106,041 answers, estimate 53,021, ran 26,928;
    bench/results/h200-20261204), while rows idling until the next check and a long multi-turn tail can add steps.
    ``answers`` counts every user turn still to answer, so later turns a context cap will drop are in it.
    """
    if answers < 0 or max_new_tokens < 1 or slots < 1:
        raise ValueError("estimate_decode_steps: answers >= 0, max_new_tokens >= 1 and slots >= 1")
    return -(-answers * max_new_tokens // slots)


def compile_decision(
    setting,
    device_type: str,
    attention: str,
    answers: Optional[int],
    max_new_tokens: int,
    slots: int,
) -> dict:
    """Whether the slot engine compiles its decode step (``prompts.regen_compile``), and why: recorded as
    ``SlotEngine.stats["compile_decision"]`` (``prompts_report.json``: ``regeneration.engine_stats``).

    ``True`` / ``False`` are taken as they are (``True`` compiles on any device, as before ``auto`` existed).
    ``"auto"`` compiles only on CUDA with the flex decode path (where the constants above were measured; on the CPU
    it never compiles), and there only when the estimated saving beats the cold compile::

        estimate_decode_steps(answers, max_new_tokens, slots) * (EAGER_STEP_MS - COMPILED_STEP_MS) / 1000 > COMPILE_COLD_S

    i.e. above 41.4 s / 1.91 ms = 21,675 estimated steps (43,351 answers or more at 512 new tokens over 1,024 slots).

    Args:
        setting: ``True``, ``False`` or ``"auto"``.
        device_type: the verifier's device type (``"cuda"``, ``"cpu"``, ...).
        attention: the decode attention the engine took (``"flex"`` or ``"sdpa_groups"``).
        answers: turns the engine will answer (None: not known, and ``auto`` does not compile).
        max_new_tokens: answer budget per turn (tokens).
        slots: decode rows.

    Returns:
        ``{"setting", "compile", "reason"}``; for ``auto`` also the inputs (``device``, ``attention``, ``answers``,
        ``max_new_tokens``, ``slots``) and, where it got that far, ``estimated_steps``, ``saving_ms_per_step``,
        ``estimated_saving_s`` and ``compile_cost_s``.

    Raises:
        ValueError: ``setting`` is not ``True``, ``False`` or ``"auto"``.
    """
    if setting is True or setting is False:
        return {
            "setting": setting,
            "compile": setting,
            "reason": f"prompts.regen_compile: {str(setting).lower()}",
        }
    if setting != "auto":
        raise ValueError(f"compile_step: one of true, false, 'auto', not {setting!r}")
    out = {
        "setting": "auto",
        "compile": False,
        "device": device_type,
        "attention": attention,
        "answers": answers,
        "max_new_tokens": max_new_tokens,
        "slots": slots,
    }
    if device_type != "cuda":
        return {
            **out,
            "reason": f"auto: the verifier is on {device_type}, not CUDA (never compiled there)",
        }
    if attention != "flex":
        return {
            **out,
            "reason": f"auto: {attention} decode attention (the step saving was measured with flex only)",
        }
    if answers is None:
        return {**out, "reason": "auto: the number of answers is not known"}
    steps = estimate_decode_steps(answers, max_new_tokens, slots)
    saving_ms = EAGER_STEP_MS - COMPILED_STEP_MS
    saving_s = steps * saving_ms / 1000.0
    on = saving_s > COMPILE_COLD_S
    reason = (
        f"auto: ~{steps} decode steps x {saving_ms:.2f} ms saved = {saving_s:.1f} s "
        f"{'>' if on else '<='} {COMPILE_COLD_S} s cold compile"
    )
    return {
        **out,
        "compile": on,
        "reason": reason,
        "estimated_steps": steps,
        "saving_ms_per_step": round(saving_ms, 3),
        "estimated_saving_s": round(saving_s, 2),
        "compile_cost_s": COMPILE_COLD_S,
    }


class Engine:
    """Shared submit/results contract (see the module docstring).

    ``submit(key, ids, priority, parent=None, retain=False)``: ``key`` names the request (not None; unique among the
    requests queued, running or retained, except that a successor may reuse its parent's key, as stage 01 does);
    ``retain=True`` asks the engine to keep the request's K/V when it finishes, for a successor; ``parent=<key>``
    says the prompt continues that retained request (its prompt + answer, then new tokens). Both are hints: an
    engine may ignore them (:class:`HFContinuousEngine` does), and answers are the same either way.
    """

    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        raise NotImplementedError

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine's resources (cache, threads, attention switch)."""


class KVCacheTooLarge(UserError):
    """The slot engine's KV cache would not fit in the GPU memory that is free (raised before it is allocated)."""


KV_FREE_SHARE = 0.9  # of the free GPU memory the KV cache may take; the rest: logits [rows, V], activations, graphs


def kv_head_dims(cfg) -> tuple[int, int]:
    """Per-head widths ``(key, value)`` of the K/V tensors a verifier's attention modules hand to the attention
    function. Standard attention: ``head_dim`` (else ``hidden_size // heads``) for both. MLA (DeepSeek-V3, Kimi-K2.5:
    ``kv_lora_rank`` set) expands its latent into keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of
    ``v_head_dim`` (Kimi: 192 and 128), while its config's ``head_dim`` is the rope part alone (64)."""
    if (
        getattr(cfg, "kv_lora_rank", None) is not None
        and getattr(cfg, "qk_rope_head_dim", None) is not None
    ):
        dk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        return dk, int(getattr(cfg, "v_head_dim", None) or dk)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return d, d


def check_kv_fits(
    rows: int,
    cols: int,
    n_layers: int,
    kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    free_bytes: int,
    where: str = "the GPU has free",
    v_head_dim: Optional[int] = None,
) -> int:
    """Bytes of a slot KV cache (K and V, ``n_layers`` x ``[rows, kv_heads, cols, head_dim]`` each (V ``v_head_dim``
    wide when given: MLA), ``elem_bytes`` a value); raises :class:`KVCacheTooLarge` when they exceed :data:`KV_FREE_SHARE` of ``free_bytes`` (the GPU's free
    memory, ``torch.cuda.mem_get_info``, or on the CPU the host's available memory: ``where`` says which), naming the
    settings that size it, instead of a CUDA out-of-memory traceback at the allocation (on the CPU: the kernel's OOM
    killer, a bare ``Killed`` and no line at all: fresh-user trial 2026-12-05f). SmolLM2-135M (30 layers, 3 KV heads
    of 64, bf16) at 1,024 rows x 2,560 columns: 56.2 GiB; at 2,048 rows: 112.5 GiB.

    Raises:
        KVCacheTooLarge: the cache would not fit (a :class:`eagle3.errors.UserError`: one line, exit 2 in 01).
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    need = n_layers * rows * kv_heads * cols * (head_dim + dv) * elem_bytes
    if need > KV_FREE_SHARE * free_bytes:
        gib = 2**30
        raise KVCacheTooLarge(
            f"prompts.gen_batch_size: the regeneration KV cache of {rows} rows x {cols} columns ({n_layers} layers, "
            f"{kv_heads} KV heads of {head_dim if dv == head_dim else f'{head_dim}/{dv}'}) needs {need / gib:.1f} GiB, more than {KV_FREE_SHARE:.0%} of the "
            f"{free_bytes / gib:.1f} GiB {where}; lower prompts.gen_batch_size (rows) or "
            f"prompts.max_context_tokens / prompts.max_new_tokens (columns)"
        )
    return need


def host_available_bytes() -> Optional[int]:
    """The host memory available to a new allocation (``psutil.virtual_memory().available``: Linux's ``MemAvailable``),
    or None where psutil cannot tell: the slot cache on the CPU is checked against it as against the GPU's free
    memory."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None


class SlotEngine(Engine):
    """Continuous batching over ``slots`` decode rows with a preallocated KV cache (module docstring).

    Args:
        model: HF causal LM (eval mode) whose attention layers carry ``layer_idx`` and call the attention
            interface (Llama-family: Llama, SmolLM2, Qwen2/3, Mistral without sliding window).
        slots: decode rows (``prompts.gen_batch_size``).
        max_len: cache columns per slot: longest prompt + ``max_new_tokens``; a longer prompt raises ValueError.
        max_new_tokens: answer budget.
        stop_ids: token ids that end an answer.
        check_every: decode steps between host checks (finished rows harvested, free slots refilled).
        prefill_tokens: padded tokens per prefill forward (``rows x width``).
        width_classes: ``sdpa_groups`` only: column caps of the slot groups (ascending; ``max_len`` is always the
            last). Slots are split into one contiguous group per cap, in proportion to the first waiting prompts'
            classes (a prompt's class: the smallest cap >= its length + ``max_new_tokens``; the widest group keeps
            >= 1/16 of the slots); a prompt takes a free slot of its class or a wider one, and each group's
            attention reads its cap's columns. Default: ``max_new_tokens`` + 128, + 512, + 1024 (those below
            ``max_len``). The flex path has one group of the full cache.
        cuda_graphs: capture decode steps as CUDA graphs, one per slot prefix (CUDA only; falls back to eager if
            capture fails).
        attention: ``auto`` | ``flex`` | ``sdpa_groups`` (module docstring). ``flex`` raises when FlexAttention
            fails to compile or capture on CUDA; ``auto`` falls back to ``sdpa_groups`` with a warning.
        flex_block: KV block size of the flex path (columns; the cache is rounded up to whole blocks).
        min_prefix: smallest slot prefix a decode window runs over (:func:`prefix_sizes`).
        compile_step: ``torch.compile`` the whole decode step (verifier forward, attention, argmax, state update;
            static shapes, one compile per slot prefix from ``compile_min_prefix`` up, before its CUDA graph is
            captured). A SmolLM2 step at 1,024 rows is ~2,600 small kernels around the attention (H200 lease
            2026-12-02c: 7.6 ms, 3.4 ms of it attention), which Inductor fuses. A failed compile logs one warning and the engine goes on uncompiled.
            ``"auto"``: compile only where :func:`compile_decision` expects the saving to beat the cold compile
            (CUDA, flex attention, enough decode steps for ``planned_answers``); ``True`` / ``False`` as they are.
        compile_min_prefix: smallest slot prefix the compiled step runs over (default ``slots``: only the full
            prefix, where nearly every step of a long run falls: the H200 17K run stepped 5,424 times, all at 1,024);
            smaller prefixes (a run's tail, small test batches) step eagerly with flex compiled alone. Each prefix
            compiled costs one cold Inductor compile (tens of seconds on the H200).
        planned_answers: turns the caller will submit over the engine's life (``compile_step="auto"`` sizes the
            work with it: :func:`estimate_decode_steps`); None = unknown (``auto`` then does not compile).
        prefix_reuse: honour :meth:`submit`'s ``retain`` / ``parent`` (cross-turn KV prefix reuse, module docstring);
            False: every prompt is prefilled in full.
        reuse_min_tokens: shortest common prefix worth reusing (tokens); a shorter one means a full prefill into the
            parent's slot.
        refill_free: while at least half the slots are busy, queued prompts wait until this share of the slots is
            free (:func:`defer_refill`): fewer, fuller prefill forwards against rows idle until then.
        prefill_graphs: run each prefill forward at a bucketed shape (:func:`prefill_bucket`: rows, padded width
            and, at column offsets, the attended columns rounded up to powers of two; :meth:`_admit` keeps the
            bucketed rows x width within ``prefill_tokens`` where a single row allows it), its padded rows writing
            one scratch cache row after the slots, and (CUDA with ``cuda_graphs``) capture each bucket as a CUDA graph
            at its first use, replayed after: an eager prefill forward is bound by host dispatch (SmolLM2: ~1,700
            ops, 35-48 ms whatever it carries). A failed capture logs one warning and the same bucketed forwards run
            eagerly (as always on the CPU). Greedy tokens are the same (fp32: equal).
        prefill_pack: feed each prefill forward's prompts back to back as one sequence (no padding between rows, a
            stream rounded up to a power of two; :mod:`eagle3.regen.packed_prefill`), within ``prefill_tokens``
            fed tokens (a single longer prompt alone; off CUDA at most ``PACK_EAGER_TOKENS``, as eager FlexAttention
            builds dense scores); FlexAttention keeps the rows apart (compiled on CUDA: automatic dynamic shapes,
            static ones after a failure; eager on the CPU). On CUDA with ``cuda_graphs`` each stream shape ``(Tq,
            Tp)`` is captured as a CUDA graph at its second use and replayed after (a shape seen once costs no
            capture). A failed capture logs one warning and packed forwards run eagerly; a failed packed forward on
            CUDA logs one and the engine prefills padded from then on. Exclusive with ``prefill_graphs``. Greedy
            tokens are the same (fp32: equal).

    Memory: ``2 * layers * slots * max_len * kv_heads * head_dim`` elements of the model dtype (``slots + 1`` rows with
    ``prefill_graphs``: the scratch row), plus ``slots x max_new_tokens`` int64 answer buffer; with prefill graphs
    on CUDA, their shared memory pool (the activations of the largest bucket captured, about). Priorities: lower tuples are admitted first.
    Stats (``stats``): ``decode_steps``, ``prefill_calls``, ``prefill_tokens`` / ``prefill_padded_tokens`` (prompt
    tokens prefilled, and rows x padded width summed over the prefill forwards: their ratio is the prefill's padding
    overhead), ``graph_captures``, ``kv_bytes_per_token``,
    ``kv_bytes_read`` (flex: the blocks the steps read, counted on device and read at each check;
    sdpa_groups: every prefix row up to its group's cap), ``kv_tokens_needed`` (the live rows' attended
    columns), ``prefix_steps`` (decode steps per prefix size, keys as strings), ``attention`` (the path taken),
    ``prefill_s`` / ``decode_s`` (device seconds of the prefill forwards / decode windows between CUDA events,
    read at each check; host seconds on the CPU), ``first_step_s`` (host seconds of each prefix's first step, keys
    as strings: its compile and graph capture, timed between two syncs, within ``decode_s``), ``compiled_step``
    (whether the compiled step is in use; False after a failed compile), ``compile_decision`` (:func:`compile_decision`:
    the setting, the choice, its reason and inputs), ``prefix_reuse`` (the switch), ``reused_tokens`` (prompt tokens
    whose K/V a retained parent left: not prefilled; ``prefill_tokens`` counts only the tokens fed, so their sum is
    every admitted prompt's length), ``reuse_rows`` (prompts prefilled after a cached prefix),
    ``reuse_full_prefills`` (successors of a held parent prefilled in full: prefix under ``reuse_min_tokens`` or a
    too narrow slot), ``prefill_graphs`` (the switch), ``prefill_graph_captures`` (prefill buckets captured as CUDA
    graphs), ``prefill_capture_s`` (host seconds of those captures, warm-up forward included; within ``prefill_s``'s
    span), ``prefill_buckets`` (prefill forwards per bucket, keys ``"PbxWb"`` on the causal path and ``"PbxWbxKwb"``
    at offsets; packed forwards ``"q<Tq>"`` / ``"q<Tq>+p<Tp>"``); with ``prefill_graphs``, ``prefill_padded_tokens``
    counts the bucketed ``Pb x Wb``, with ``prefill_pack`` the streams' ``Tq``; ``prefill_pack`` (the switch; False
    after a failed packed forward on CUDA), ``prefill_first_s`` (host seconds of each packed shape's first forward,
    between two syncs: on CUDA its attention's compile; keys as ``prefill_buckets``).
    """

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        max_new_tokens: int,
        stop_ids: set[int],
        check_every: int = 16,
        prefill_tokens: int = 65536,
        width_classes: Optional[Sequence[int]] = None,
        cuda_graphs: bool = True,
        attention: str = "auto",
        flex_block: int = 128,
        min_prefix: int = 8,
        compile_step=False,
        compile_min_prefix: Optional[int] = None,
        planned_answers: Optional[int] = None,
        prefix_reuse: bool = True,
        reuse_min_tokens: int = 16,
        refill_free: float = 1 / 32,
        prefill_graphs: bool = False,
        prefill_pack: bool = False,
    ):
        if slots < 1 or max_new_tokens < 1 or check_every < 1 or max_len <= max_new_tokens:
            raise ValueError(
                "SlotEngine: slots, max_new_tokens, check_every >= 1 and max_len > max_new_tokens"
            )
        self.model, self.S, self.max_len, self.max_new = model, slots, max_len, max_new_tokens
        if attention not in ATTENTIONS:
            raise ValueError(f"SlotEngine: attention one of {ATTENTIONS}, not {attention!r}")
        if flex_block < 1:
            raise ValueError("SlotEngine: flex_block >= 1")
        self.check_every, self.prefill_tokens = check_every, prefill_tokens
        self.prefix_reuse, self.reuse_min_tokens = bool(prefix_reuse), max(1, int(reuse_min_tokens))
        if not 0 < refill_free <= 1:
            raise ValueError(f"SlotEngine: refill_free in (0, 1], not {refill_free!r}")
        self.refill_free = float(refill_free)
        p = next(model.parameters())
        self.dev, dtype = p.device, p.dtype
        self.use_graphs = cuda_graphs and self.dev.type == "cuda"
        self._init_prefill_layout(prefill_graphs, prefill_pack, flex_block)
        cfg = model.config.get_text_config()
        n_layers, hkv = (
            cfg.num_hidden_layers,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        )
        h = cfg.num_attention_heads
        d, dv = kv_head_dims(cfg)  # MLA: keys and values of different widths
        self.block, self.attention_mode, self._tried = (
            flex_block,
            attention,
            set(),
        )  # _tried: prefixes stepped once
        self.flex = self._pick_attention(
            attention, slots, h, hkv, d, dtype, -(-max_len // flex_block) * flex_block, dv
        )
        self._flex_alone = self.flex  # the flex call to go back to if the compiled step is dropped
        self._compile_min = slots if compile_min_prefix is None else max(1, int(compile_min_prefix))
        self._setup_compile(compile_step, planned_answers)
        self._flex_inline = (
            self.flex
        )  # the flex call the compiled step traces (== _flex_alone uncompiled)
        if self.flex is not None:
            width_classes = []
        elif width_classes is None:
            width_classes = [max_new_tokens + extra for extra in (128, 512, 1024)]
        self.caps = sorted({c for c in width_classes if max_new_tokens < c < max_len} | {max_len})
        self.groups: Optional[list[tuple[int, int, int]]] = (
            None  # (first slot, end slot, cap), set at the first admission
        )
        cols = -(-max_len // flex_block) * flex_block if self.flex is not None else max_len
        # prefill_graphs: one scratch row after the slots, where a bucketed prefill's padded rows write (decode runs over
        # slot prefixes [:n], n <= slots, so it never reads it)
        rows = slots + int(self.prefill_graphs)
        on_gpu = self.dev.type == "cuda"
        free = torch.cuda.mem_get_info(self.dev)[0] if on_gpu else host_available_bytes()
        if free is not None:
            check_kv_fits(
                rows,
                cols,
                n_layers,
                hkv,
                d,
                torch.empty((), dtype=dtype).element_size(),
                free,
                "the GPU has free" if on_gpu else "this machine has available (MemAvailable)",
                v_head_dim=dv,
            )
        self.cache = SlotCache(
            k=[
                torch.zeros(rows, hkv, cols, d, dtype=dtype, device=self.dev)
                for _ in range(n_layers)
            ],
            v=[
                torch.zeros(rows, hkv, cols, dv, dtype=dtype, device=self.dev)
                for _ in range(n_layers)
            ],
        )
        if self.flex is not None:
            self.cache.flex = self.flex
            nb = cols // flex_block
            self.cache.kv_indices = (
                torch.arange(nb, dtype=torch.int32, device=self.dev)
                .expand(slots, 1, 1, nb)
                .contiguous()
            )  # [S, 1, 1, L / block]
        self.prefixes = prefix_sizes(slots, min_prefix)
        self.kv_cols = torch.zeros(
            (), dtype=torch.long, device=self.dev
        )  # flex: KV columns read by the steps so far
        self.kv_bytes_per_token = n_layers * hkv * (d + dv) * p.element_size()
        self._init_slots(slots, max_len, max_new_tokens, stop_ids)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per slot prefix
        self._pool = None  # one memory pool shared by the prefix graphs (replayed one at a time)
        self._prefill_bufs: dict[
            tuple, _PrefillBuffers
        ] = {}  # prefill_graphs: per bucket (Pb, Wb, Kwb)
        self._packed_bufs: dict[
            tuple, PackedBuffers
        ] = {}  # prefill_pack: per stream shape (Tq, Tp)
        self._prefill_pool = (
            None  # one memory pool shared by the prefill graphs (replayed one at a time)
        )
        # kv_tokens_needed: sum over decode steps of the live rows' attended columns (the roofline's KV reads);
        # kv_bytes_read: what the attention reads (flex: the blocks; sdpa_groups: every prefix slot up to its cap)
        self.stats = {
            "decode_steps": 0,
            "prefill_calls": 0,
            "prefill_tokens": 0,
            "prefill_padded_tokens": 0,
            "kv_bytes_read": 0,
            "kv_tokens_needed": 0,
            "graph_captures": 0,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefix_steps": {},
            "attention": "flex" if self.flex is not None else "sdpa_groups",
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "compiled_step": self._compiled is not None,
            "compile_min_prefix": self._compile_min,
            "first_step_s": {},
            "compile_decision": self.compile_decision,
            "prefix_reuse": self.prefix_reuse,
            "reused_tokens": 0,
            "reuse_rows": 0,
            "reuse_full_prefills": 0,
            "prefill_graphs": self.prefill_graphs,
            "prefill_graph_captures": 0,
            "prefill_capture_s": 0.0,
            "prefill_buckets": {},
            "prefill_pack": self.prefill_pack,
            "prefill_first_s": {},
        }
        self._timed: list[
            tuple[str, object, object]
        ] = []  # (stat, start, end): CUDA events read at the next sync
        self._swap = AttentionSwap(model).__enter__()

    def _init_prefill_layout(
        self, prefill_graphs: bool, prefill_pack: bool, flex_block: int
    ) -> None:
        """The prefill layout switches (padded, bucketed ``prefill_graphs`` or packed ``prefill_pack``; ValueError for
        both, or packing with a block size that is not a power of two), whether prefill forwards are captured, and
        the packed path's attention function."""
        self.prefill_graphs, self.prefill_pack = bool(prefill_graphs), bool(prefill_pack)
        if self.prefill_graphs and self.prefill_pack:
            raise ValueError(
                "SlotEngine: prefill_graphs and prefill_pack are exclusive (choose one prefill layout)"
            )
        if self.prefill_pack and (flex_block < 1 or flex_block & (flex_block - 1)):
            raise ValueError(
                f"SlotEngine: prefill_pack needs flex_block a power of two, not {flex_block}"
            )
        # bucketed / packed prefill forwards captured as CUDA graphs (else, and after a failed capture, run eagerly)
        self._prefill_capture = (self.prefill_graphs or self.prefill_pack) and self.use_graphs
        # packed prefill attention: compiled FlexAttention on CUDA (eager flex would build dense scores), eager on CPU
        cuda = self.dev.type == "cuda"
        # on CUDA: automatic dynamic shapes first (two compiles), static shapes (one compile per shape) if that fails
        self._packed_flexes = (
            (
                [compiled_packed_flex(None), compiled_packed_flex(False)]
                if cuda
                else [eager_packed_flex]
            )
            if self.prefill_pack
            else []
        )
        self._packed_flex = self._packed_flexes.pop(0) if self._packed_flexes else None
        self._pack_fallback = cuda  # a failed packed forward: warn and prefill padded (CPU: raise)
        # eager flex (off CUDA) materialises [H, Tq, Tq + Tp] scores per layer: its streams are kept short there
        self._pack_budget = (
            self.prefill_tokens if cuda else min(self.prefill_tokens, PACK_EAGER_TOKENS)
        )

    def _init_slots(
        self, slots: int, max_len: int, max_new_tokens: int, stop_ids: set[int]
    ) -> None:
        """The per-slot decode state on the device (``[S]`` tensors, the ``[S, T]`` answer buffer) and its host
        mirror (request key, prompt, retention per slot), all slots empty; the waiting queue."""
        z = dict(device=self.dev, dtype=torch.long)
        self.last = torch.zeros(slots, **z)  # [S] token fed to the next step
        self.lengths = torch.zeros(slots, **z)  # [S] cached tokens
        self.n_gen = torch.zeros(slots, **z)  # [S] answer tokens so far (stop token included)
        self.done = torch.ones(slots, dtype=torch.bool, device=self.dev)  # [S] finished or empty
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=self.dev)  # [S]
        self.out = torch.zeros(slots, max_new_tokens, **z)  # [S, T] answer tokens
        self.stop_t = torch.tensor(sorted(stop_ids), **z)
        self.col = torch.arange(max_len, **z)
        self.ar = torch.arange(slots, **z)
        self.key: list = [None] * slots  # host: request key per slot (None = free)
        self.host_len = [0] * slots  # host: prompt length of the slot's request
        self.host_ids: list = [None] * slots  # host: prompt ids of the slot's request
        self.retain = [
            False
        ] * slots  # host: keep the slot's K/V for a successor when its request finishes
        self.hold: list[Optional[_Held]] = [
            None
        ] * slots  # host: a finished request's K/V kept for its successor
        self.retained: dict = {}  # key of a finished request -> its held slot
        self.successors: dict = {}  # parent key -> the waiting request that continues it
        self.waiting: list[_Waiting] = []
        self._seq = 0

    def _setup_compile(self, compile_step, planned_answers: Optional[int]) -> None:
        """Decide (:func:`compile_decision`, once the attention path is known) and, if so, wrap the decode step in
        ``torch.compile`` (compiled lazily at its first call); the decision goes to ``self.compile_decision``."""
        self._compiled = None
        self.compile_decision = compile_decision(
            compile_step,
            self.dev.type,
            "flex" if self.flex is not None else "sdpa_groups",
            planned_answers,
            self.max_new,
            self.S,
        )
        if compile_step == "auto":
            from eagle3.process_group import rank_tag

            log.info(
                "%sprompts.regen_compile: %s (%s)",
                rank_tag(suffix=": "),
                "compiling the decode step"
                if self.compile_decision["compile"]
                else "decode step not compiled",
                self.compile_decision["reason"],
            )
        if self.compile_decision["compile"]:
            import functools

            kv_blocks_params()
            raise_recompile_limit()
            if self.flex is not None:  # traced inside the compiled step (no nested compile)
                self.flex = functools.partial(flex_decode, block=self.block)
            self._compiled = torch.compile(self._step_eager, dynamic=False)

    # ------------------------------------------------------------------ contract
    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        """Queue prompt ``ids`` (non-empty, ``len < max_len - max_new_tokens + 1``) under ``key`` (not None).

        Cross-turn prefix reuse (``prefix_reuse``; ignored without it): ``retain=True`` keeps the request's slot and
        K/V when it finishes (the prompt and the answer tokens whose K/V were written: all but the last generated
        token) until the check after its answer is yielded; a prompt submitted by then with ``parent=key`` (stage
        01: the next turn, submitted while handling the answer) takes that slot at the next admission, without a
        free slot and ahead of the priority order, and only its tokens after the longest common prefix with the
        cached ids are prefilled (:meth:`_prefill`). Otherwise the slot is freed at that check. A ``parent`` that is
        not retained (not asked, released, or ``prefix_reuse`` off) queues the prompt as any other (full prefill).
        """
        if not 0 < len(ids) <= self.max_len - self.max_new:
            raise ValueError(
                f"SlotEngine: prompt of {len(ids)} tokens (cache holds prompts of 1..{self.max_len - self.max_new})"
            )
        if key is None:
            raise ValueError("SlotEngine: a request key cannot be None (None marks a free slot)")
        w = _Waiting((*priority, self._seq), key, list(ids), retain=self.prefix_reuse and retain)
        self._seq += 1
        if (
            self.prefix_reuse
            and parent is not None
            and parent in self.retained
            and parent not in self.successors
        ):
            w.parent = parent
            self.successors[parent] = w  # admitted into the parent's slot (not through the heap)
        else:
            heapq.heappush(self.waiting, w)

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        """Decode until nothing is waiting or live; yields answers as they are harvested.

        The next window's decode steps are launched before the previous window's answers are yielded, so
        the caller's host work on them (detokenising, rendering the next turn, the resume log) overlaps the
        GPU; prompts submitted meanwhile are admitted at the next check.
        """
        ready: list = []
        # no cuDNN SDPA: its per-shape plans cost ~40 ms of host time per new prefill shape (eagle3.sdpa)
        with torch.inference_mode(), no_cudnn_sdpa():
            while True:
                self._admit()
                live = any(k is not None for k in self.key)
                if live:
                    self._decode_window()  # asynchronous on CUDA (graph replays)
                yield from ready
                for (
                    key,
                    _,
                    _,
                ) in (
                    ready
                ):  # their successors had their chance: unclaimed slots are freed at the next check
                    if key in self.retained:
                        self.hold[self.retained[key]].delivered = True
                if not live and not self.waiting and not self.successors:
                    return
                ready = self._harvest() if live else []

    def close(self) -> None:
        if self._swap is not None:
            self._swap.__exit__(None, None, None)
            self._swap = None
        self.graphs.clear()
        self._prefill_bufs.clear()
        self._packed_bufs.clear()
        self.cache.k.clear()
        self.cache.v.clear()

    # ------------------------------------------------------------------ steps
    def _class_of(self, n_prompt: int) -> int:
        """Index of the narrowest width class holding a prompt of ``n_prompt`` tokens and its answer."""
        return next(c for c, cap in enumerate(self.caps) if cap >= n_prompt + self.max_new)

    def _partition(self) -> None:
        """Slot groups per width class, sized by the waiting prompts' classes (the widest keeps >= S/16, >= 1)."""
        need = [0] * len(self.caps)
        for w in self.waiting:
            need[self._class_of(len(w.ids))] += 1
        total = max(1, sum(need))
        share = [int(self.S * n / total) for n in need]
        share[-1] = max(share[-1], max(1, self.S // 16))
        while sum(share) > self.S:  # take the excess from the largest group
            share[share.index(max(share))] -= 1
        share[share.index(max(share))] += self.S - sum(share)
        self.groups, start = [], 0
        for n, cap in zip(share, self.caps):
            if n:
                self.groups.append((start, start + n, cap))
                start += n

    def _free_slot(self, s: int) -> bool:
        """Slot ``s`` holds no request, running or retained."""
        return self.key[s] is None and self.hold[s] is None

    def _release_delivered(self) -> None:
        """Free the retained slots whose answer was yielded and whose successor did not come (stage 01: the next turn
        is over the context cap, or the conversation is done)."""
        for key in [
            k
            for k, s in self.retained.items()
            if self.hold[s].delivered and k not in self.successors
        ]:
            self.hold[self.retained.pop(key)] = None

    def _claim(self, w: _Waiting) -> Optional[tuple[_Waiting, int, int]]:
        """Successor ``w`` takes its parent's retained slot: ``(w, slot, offset)``, ``offset`` the cached columns it
        keeps (the longest common prefix of the cached ids and its prompt, at most ``len - 1``: the last prompt token
        is always prefilled, for the first answer token's logits; 0 below ``reuse_min_tokens``: a full prefill into
        the slot). None when the slot's width class is too narrow for it (the slot is freed, ``w`` queued)."""
        s = self.retained.pop(w.parent)
        held, self.hold[s] = self.hold[s], None
        cap = next(cap for a, b, cap in self.groups if a <= s < b)
        if cap < len(w.ids) + self.max_new:
            heapq.heappush(self.waiting, w)
            self.stats["reuse_full_prefills"] += 1
            return None
        off = min(common_prefix(held.ids, w.ids), len(w.ids) - 1)
        if off < self.reuse_min_tokens:
            off = 0
            self.stats["reuse_full_prefills"] += 1
        return w, s, off

    def _admit(self) -> None:
        """Prefill waiting prompts into free slots of their class or a wider one, and successors into their parents'
        retained slots (right-padded batches of <= ``prefill_tokens`` tokens of prompt suffixes)."""
        if self.groups is None:
            self._partition()
        self._release_delivered()
        free = [
            [s for s in range(a, b) if self._free_slot(s)] for a, b, _ in self.groups
        ]  # per group
        n_free = sum(map(len, free)) + len(self.successors)  # a successor's slot is ready for it
        # refill in bulk: a prefill forward costs a launch-bound pass however few rows it has
        if (
            not n_free
            or not (self.waiting or self.successors)
            or defer_refill(
                n_free, self.S, len(self.waiting) + len(self.successors), self.refill_free
            )
        ):
            return
        claimed = [self._claim(w) for w in self.successors.values()]
        self.successors.clear()
        placed = [c for c in claimed if c is not None]  # (request, slot, cached columns kept)
        taken = {s for _, s, _ in placed}
        free = [
            [s for s in range(a, b) if self._free_slot(s) and s not in taken]
            for a, b, _ in self.groups
        ]  # with the slots of successors _claim queued
        n_heap = sum(map(len, free))
        from_heap, deferred = 0, []
        for _ in range(min(len(self.waiting), 4 * n_heap)):
            if from_heap == n_heap:
                break
            w = heapq.heappop(self.waiting)
            need = self.caps[self._class_of(len(w.ids))]
            g = next(
                (g for g, (_, _, cap) in enumerate(self.groups) if cap >= need and free[g]), None
            )
            if g is None:
                deferred.append(w)  # only narrower slots are free: it waits for one of its class
            else:
                placed.append(
                    (w, free[g].pop(0), 0)
                )  # lowest free slot first: the live rows stay in a short prefix
                from_heap += 1
        for w in deferred:
            heapq.heappush(self.waiting, w)
        placed.sort(
            key=lambda x: len(x[0].ids) - x[2]
        )  # by suffix length: the width a forward pads to
        suffix = [len(w.ids) - o for w, _, o in placed]  # tokens each row feeds
        i = 0
        while i < len(placed):
            j, width, total = i, 0, 0
            while j < len(placed) and self._fits(
                j - i + 1, max(width, suffix[j]), suffix[j], total + suffix[j]
            ):
                width, total = max(width, suffix[j]), total + suffix[j]
                j += 1
            self._prefill(
                [w for w, _, _ in placed[i:j]],
                [s for _, s, _ in placed[i:j]],
                width,
                [o for _, _, o in placed[i:j]],
            )
            i = j

    def _fits(self, rows: int, width: int, last: int, total: int) -> bool:
        """Whether a prefill forward of ``rows`` prompts padded to ``width`` tokens stays within ``prefill_tokens``
        (a single prompt of ``last`` tokens always fits); with ``prefill_graphs`` at its bucketed shape
        (:func:`prefill_bucket`); with ``prefill_pack`` its ``total`` fed tokens (the rows' suffixes back to back)."""
        if self.prefill_pack:
            return total <= max(self._pack_budget, last)
        if not self.prefill_graphs:
            return width * rows <= max(self.prefill_tokens, last)
        cols = self.cache.k[0].shape[2]
        pb, wb, _ = prefill_bucket(rows, width, 0, self.S, cols)
        return pb * wb <= max(self.prefill_tokens, prefill_bucket(1, last, 0, self.S, cols)[1])

    def _prefill(
        self,
        reqs: list[_Waiting],
        slots: list[int],
        width: int,
        offsets: Optional[list[int]] = None,
    ) -> None:
        """One right-padded prefill forward; each row's first answer token goes to its slot.

        ``offsets[r]``: columns of slot ``slots[r]`` that already hold the K/V of ``reqs[r].ids[:offsets[r]]`` (a
        retained parent's prompt + answer); only the suffix ``ids[offsets[r]:]`` is fed, at positions ``offsets[r] +
        j`` (RoPE) and columns ``offsets[r] + j``, attending the cached prefix (:func:`offset_prefill_attention`).
        A forward whose offsets are all 0 (or None) takes the causal path of a fresh prompt. ``width``: the longest
        suffix. With ``prefill_graphs`` the forward runs at its bucketed shape (:meth:`_prefill_bucketed`)."""
        p = len(reqs)
        offsets = offsets if offsets is not None else [0] * p
        if self.prefill_pack and self._prefill_packed(reqs, slots, offsets):
            return
        if self.prefill_graphs:
            t0 = self._mark()
            rows, lens, tok = self._prefill_bucketed(
                reqs, slots, width, offsets
            )  # [P] each, on device
            self._prefill_state(rows, lens, tok)
            self._timed.append(("prefill_s", t0, self._mark()))
            self._prefill_host(reqs, slots, offsets)
            return
        ids = torch.zeros(p, width, dtype=torch.long)  # [P, Wp]
        for r, (w, o) in enumerate(zip(reqs, offsets)):
            ids[r, : len(w.ids) - o] = torch.tensor(w.ids[o:], dtype=torch.long)
        lens = torch.tensor(
            [len(w.ids) for w in reqs], device=self.dev
        )  # [P] prompt lengths (cached + fed)
        off = torch.tensor(offsets, device=self.dev)  # [P]
        rows = torch.tensor(slots, device=self.dev)  # [P]
        self.cache.rows = rows
        if any(offsets):
            self.cache.prefill_cols, self.cache.prefill_mask = offset_prefill_layout(
                off, width, self.cache.k[0].shape[2]
            )  # [P, Wp], [P, 1, Wp, Kw]
        t0 = self._mark()
        pos = off[:, None] + torch.arange(
            width, device=self.dev
        )  # [P, Wp] RoPE positions after the cached prefix
        hid = self.model.base_model(
            input_ids=ids.to(self.dev), position_ids=pos, slot_cache=self.cache, use_cache=False
        ).last_hidden_state  # [P, Wp, hidden]
        self.cache.rows = self.cache.prefill_cols = self.cache.prefill_mask = None
        last = hid[
            torch.arange(p, device=self.dev), lens - off - 1
        ]  # [P, hidden] the last prompt token of each row
        tok = self.model.get_output_embeddings()(last).argmax(-1)  # [P]
        self._prefill_state(rows, lens, tok)
        self._timed.append(("prefill_s", t0, self._mark()))
        self._prefill_host(reqs, slots, offsets)
        self.stats["prefill_padded_tokens"] += p * width

    def _prefill_state(self, rows: torch.Tensor, lens: torch.Tensor, tok: torch.Tensor) -> None:
        """Decode state of freshly prefilled slots (device ops): ``rows`` int64 ``[P]`` the slots, ``lens`` int64 ``[P]``
        their prompt lengths (cached + fed), ``tok`` int64 ``[P]`` the first answer token of each."""
        self.last[rows] = tok
        self.out[rows, 0] = tok
        self.n_gen[rows] = 1
        self.lengths[rows] = lens
        self.stopped[rows] = torch.isin(tok, self.stop_t)
        self.done[rows] = self.stopped[rows] | (self.max_new <= 1)

    def _prefill_host(self, reqs: list[_Waiting], slots: list[int], offsets: list[int]) -> None:
        """Host bookkeeping of a prefill forward: the slots' requests and the prefill counters."""
        for s, w in zip(slots, reqs):
            self.key[s], self.host_len[s], self.host_ids[s], self.retain[s] = (
                w.key,
                len(w.ids),
                w.ids,
                w.retain,
            )
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(len(w.ids) - o for w, o in zip(reqs, offsets))
        self.stats["reused_tokens"] += sum(offsets)
        self.stats["reuse_rows"] += sum(o > 0 for o in offsets)

    # ------------------------------------------------------------------ bucketed prefill (prefill_graphs)
    def _prefill_bucketed(
        self, reqs: list[_Waiting], slots: list[int], width: int, offsets: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prefill forward at its bucketed shape (:func:`prefill_bucket`): replayed from a CUDA graph captured at
        the bucket's first use (``prefill_graphs`` on CUDA with graphs), else run eagerly over the same buffers.

        The ``P`` real rows fill rows ``[0, P)`` of the bucket's static buffers (ids right-padded with 0 to ``Wb``);
        rows ``[P, Pb)`` are padding: slot ``S`` (the scratch cache row), offset 0, token ids 0, last index 0. A
        forward with any offset runs the masked path over ``Kwb`` columns (all rows, offset 0 ones included),
        else the causal path. Inputs reach the device in two copies (pinned and asynchronous on CUDA: no host
        sync); the graph writes the first answer token of every row to the bucket's ``tok``.

        Args:
            reqs, slots, width, offsets: as :meth:`_prefill` (``offsets`` a list, 0 = from scratch).

        Returns:
            ``(rows, lens, tok)``: int64 ``[P]`` device views of the bucket's buffers (the real rows' slots, prompt
            lengths and first answer tokens), valid until the bucket's next forward.
        """
        p, cols = len(reqs), self.cache.k[0].shape[2]
        kv = max(len(w.ids) for w in reqs) if any(offsets) else 0
        key = prefill_bucket(p, width, kv, self.S, cols)
        pb, wb, _ = key
        ids = torch.zeros(pb, wb, dtype=torch.long)  # [Pb, Wb] host
        for r, (w, o) in enumerate(zip(reqs, offsets)):
            ids[r, : len(w.ids) - o] = torch.tensor(w.ids[o:], dtype=torch.long)
        pad = [0] * (pb - p)
        meta = torch.tensor(
            [
                list(slots) + [self.S] * (pb - p),  # padded rows: the scratch cache row
                list(offsets) + pad,
                [len(w.ids) - o - 1 for w, o in zip(reqs, offsets)] + pad,
                [len(w.ids) for w in reqs] + pad,
            ],
            dtype=torch.long,
        )  # [4, Pb] host
        buf = self._prefill_bufs.get(key)
        if buf is None:
            buf = self._prefill_bufs[key] = _PrefillBuffers.make(key, self.dev)
        cuda = self.dev.type == "cuda"
        buf.ids.copy_(ids.pin_memory() if cuda else ids, non_blocking=cuda)
        buf.meta.copy_(meta.pin_memory() if cuda else meta, non_blocking=cuda)
        if self._prefill_capture and buf.graph is None:
            self._prefill_graph(buf)
        if buf.graph is not None:
            buf.graph.replay()
        else:
            self._prefill_forward(buf)
        nb = self.stats["prefill_buckets"]
        name = "x".join(map(str, key if key[2] else key[:2]))
        nb[name] = nb.get(name, 0) + 1
        self.stats["prefill_padded_tokens"] += pb * wb
        return buf.meta[0, :p], buf.meta[3, :p], buf.tok[:p]

    def _prefill_forward(self, buf: "_PrefillBuffers") -> None:
        """The forward of a bucketed prefill over ``buf``'s static tensors (the function a prefill graph captures;
        device ops only, static shapes): K/V of every row written to the cache (padded rows to the scratch row),
        ``buf.tok`` [Pb] = the greedy token after each row's last prompt token."""
        pb, wb, kw = buf.key
        c = self.cache
        rows, off, last = buf.meta[0], buf.meta[1], buf.meta[2]  # [Pb] each
        c.rows = rows
        if kw:
            c.prefill_cols, c.prefill_mask = offset_prefill_layout(
                off, wb, c.k[0].shape[2], kw=kw
            )  # [Pb, Wb], [Pb, 1, Wb, Kwb]
        try:
            pos = off[:, None] + torch.arange(
                wb, device=self.dev
            )  # [Pb, Wb] RoPE positions after the cached prefix
            hid = self.model.base_model(
                input_ids=buf.ids, position_ids=pos, slot_cache=c, use_cache=False
            ).last_hidden_state  # [Pb, Wb, hidden]
        finally:
            c.rows = c.prefill_cols = c.prefill_mask = None
        h = hid[
            torch.arange(pb, device=self.dev), last
        ]  # [Pb, hidden] the last prompt token of each row
        buf.tok.copy_(self.model.get_output_embeddings()(h).argmax(-1))  # [Pb]

    def _prefill_graph(self, buf, fn=None) -> None:
        """Capture ``fn`` (default :meth:`_prefill_forward` over ``buf``; a packed forward passes its own) as a CUDA
        graph (warm-up on a side stream first, as torch requires; the K/V the warm-up writes are rewritten
        identically by the replay that follows). All prefill graphs share one memory pool (they replay one at a
        time, and each one's output is read before the next replays). On a failure: one warning, and every prefill
        runs eagerly from then on (same shapes, same tokens). Host seconds go to ``stats["prefill_capture_s"]``."""
        t0 = time.perf_counter()
        try:
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            g = capture_graph(fn or (lambda: self._prefill_forward(buf)), self._prefill_pool)
        except Exception as e:  # noqa: BLE001 - any capture failure: prefill eagerly (same results)
            log.warning(
                "prefill CUDA graph capture failed at bucket %s (%s: %s); prefill forwards run eagerly",
                buf.key,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            self._prefill_capture = False
            for b in [*self._prefill_bufs.values(), *self._packed_bufs.values()]:
                b.graph = None
            return
        finally:
            self.stats["prefill_capture_s"] += time.perf_counter() - t0
        buf.graph = g
        self.stats["prefill_graph_captures"] += 1

    # ------------------------------------------------------------------ packed prefill (prefill_pack)
    def _prefill_packed(self, reqs: list[_Waiting], slots: list[int], offsets: list[int]) -> bool:
        """One packed prefill forward (:mod:`eagle3.regen.packed_prefill`): the rows' suffixes back to back in one
        stream of the shape's static buffers, each row's first answer token to its slot. The shape's CUDA graph is
        captured at its second use (``cuda_graphs`` on CUDA) and replayed after; else the forward runs eagerly.

        Args:
            reqs, slots, offsets: as :meth:`_prefill` (``offsets`` a list, 0 = from scratch).

        Returns:
            True when done; False when the packed forward failed on CUDA (the compiled attention or a replay): one
            warning, the engine leaves the packed path for good and the caller prefills these rows padded.
        """
        lay = packed_layout(
            [w.ids[o:] for w, o in zip(reqs, offsets)],
            offsets,
            slots,
            self.S,
            self.cache.k[0].shape[2],
            self.block,
        )
        key = (lay.q.shape[1], lay.prefix.shape[1])  # (Tq, Tp)
        buf = self._packed_bufs.get(key)
        if buf is None:
            buf = self._packed_bufs[key] = PackedBuffers.like(lay, self.dev)
        t0 = self._mark()
        buf.fill(lay)
        buf.uses += 1
        try:
            if (
                buf.uses == 1
            ):  # a new shape: its first forward (compile on CUDA) timed between two syncs
                self._first_packed(buf)
            elif self._prefill_capture and buf.graph is None:
                self._prefill_graph(buf, lambda: self._packed_forward(buf))
            if buf.graph is not None:
                buf.graph.replay()
            elif buf.uses > 1:
                self._packed_forward(buf)
        except Exception as e:  # noqa: BLE001 - on CUDA: leave the packed path (padded prefill gives the same tokens)
            if not self._pack_fallback:
                raise
            if (
                self._packed_flexes
            ):  # the next compile setting (static shapes); the forward rewrites the same K/V
                log.warning(
                    "packed prefill attention failed at stream shape %s (%s: %s); retrying with static-shape "
                    "compiles",
                    key,
                    type(e).__name__,
                    str(e).splitlines()[0][:200] if str(e) else "",
                )
                self._packed_flex = self._packed_flexes.pop(0)
                for b in self._packed_bufs.values():
                    b.graph, b.uses = None, 0
                return self._prefill_packed(reqs, slots, offsets)
            log.warning(
                "packed prefill failed at stream shape %s (%s: %s); prefill forwards go on padded",
                key,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            self.prefill_pack = self.stats["prefill_pack"] = False
            self._packed_bufs.clear()
            return False
        p = len(reqs)
        self._prefill_state(
            buf.t.rows[0, :p], buf.t.rows[2, :p], buf.tok[:p]
        )  # [P] slots, prompt lengths, tokens
        self._timed.append(("prefill_s", t0, self._mark()))
        self._prefill_host(reqs, slots, offsets)
        nb, name = self.stats["prefill_buckets"], f"q{key[0]}" + (f"+p{key[1]}" if key[1] else "")
        nb[name] = nb.get(name, 0) + 1
        self.stats["prefill_padded_tokens"] += key[0]
        return True

    def _first_packed(self, buf: PackedBuffers) -> None:
        """The first forward at a packed shape (on CUDA its attention's compile), its host seconds between two syncs
        added to ``stats["prefill_first_s"]`` (keys ``"q<Tq>"`` / ``"q<Tq>+p<Tp>"``)."""
        tq, tp = buf.key
        self.stats["prefill_first_s"][f"q{tq}" + (f"+p{tp}" if tp else "")] = synced_seconds(
            self.dev, lambda: self._packed_forward(buf)
        )

    def _packed_forward(self, buf: PackedBuffers) -> None:
        """The forward of a packed prefill over ``buf``'s static tensors (device ops only, static shapes: what a
        graph captures): K/V of every fed token written to its slot (padding to column ``L - 1`` of slot 0),
        ``buf.tok`` [S] = the greedy token after each row's last prompt token (padding rows: unused)."""
        c = self.cache
        c.packed = buf.routing(self._packed_flex, self.block)
        try:
            hid = self.model.base_model(
                input_ids=buf.t.ids, position_ids=buf.t.q[1:2], slot_cache=c, use_cache=False
            ).last_hidden_state  # [1, Tq, hidden]
        finally:
            c.packed = None
        h = hid[0, buf.t.rows[1]]  # [S, hidden] the last fed token of each row
        buf.tok.copy_(self.model.get_output_embeddings()(h).argmax(-1))  # [S]

    def _pick_attention(
        self,
        attention: str,
        slots: int,
        h: int,
        hkv: int,
        d: int,
        dtype,
        cols: int,
        dv: Optional[int] = None,
    ):
        """The flex decode function, or None for sdpa_groups. On CUDA the compiled kernel is probed (compiled,
        run and, with ``cuda_graphs``, captured in a throwaway graph at the full slot count): ``flex`` raises on a
        failure, ``auto`` logs one line and takes sdpa_groups. On CPU ``flex`` is eager FlexAttention (it
        materialises the scores: for tests) and ``auto`` is sdpa_groups."""
        if attention == "sdpa_groups" or (attention == "auto" and self.dev.type != "cuda"):
            return None
        if self.dev.type != "cuda":
            import functools
            import warnings

            # eager FlexAttention is the point here (tests); its advice to compile is noise
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return functools.partial(flex_decode, block=self.block)
        fn = compiled_flex_decode()

        def call(q, k, v, attn_len, kv_indices, scale, num_blocks=None):
            return fn(q, k, v, attn_len, kv_indices, scale, self.block, num_blocks)

        try:
            self._probe_flex(call, slots, h, hkv, d, dtype, cols, dv)
        except Exception as e:  # noqa: BLE001 - any compile/capture failure: the SDPA path gives the same tokens
            if attention == "flex":
                raise RuntimeError(
                    f"SlotEngine: FlexAttention decode failed on {self.dev} "
                    f"({type(e).__name__}: {str(e)[:300]})"
                ) from e
            log.warning(
                "FlexAttention decode unavailable (%s: %s); regen attention falls back to sdpa_groups",
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            return None
        return call

    def _probe_flex(
        self, call, slots: int, h: int, hkv: int, d: int, dtype, cols: int, dv: Optional[int] = None
    ) -> None:
        """Compile and run the flex decode at ``[slots, h, 1, d]`` (values ``dv`` wide, default ``d``: MLA's differ,
        :func:`kv_head_dims`) against a ``cols``-column cache (and capture it
        in a CUDA graph when graphs are on); raises on any failure or a wrong result."""
        nb, dv = cols // self.block, d if dv is None else dv
        # K/V and block indices made as the cache is (the constructor's grad mode), the rest as a step makes them
        # (inference mode), so the compiled graph's guards match the engine's calls
        g = torch.Generator(device=self.dev).manual_seed(0)
        k = torch.randn(
            slots, hkv, cols, d, generator=g, device=self.dev, dtype=dtype
        )  # [S, Hkv, L, D]
        v = torch.randn(slots, hkv, cols, dv, generator=g, device=self.dev, dtype=dtype)
        idx = (
            torch.arange(nb, dtype=torch.int32, device=self.dev)
            .expand(slots, 1, 1, nb)
            .contiguous()
        )
        with torch.inference_mode():
            q = torch.randn(
                slots, h, 1, d, generator=g, device=self.dev, dtype=dtype
            )  # [S, H, 1, D]
            attn_len = torch.arange(slots, device=self.dev) % cols  # [S]
            nbk = kv_num_blocks(attn_len, self.block)  # [S, 1, 1], as _step passes it
            scale = (
                d**-0.5
            )  # as the Llama-family modules pass it (the same compiled graph serves the engine)
            out = call(q, k, v, attn_len, idx, scale, num_blocks=nbk)  # [S, H, 1, D]
            if self.use_graphs:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call(q, k, v, attn_len, idx, scale, num_blocks=nbk)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = call(q, k, v, attn_len, idx, scale, num_blocks=nbk)
                graph.replay()
            for r in sorted(
                {0, min(3, slots - 1), slots - 1}
            ):  # rows of 1, 4 and the most columns against SDPA
                n = int(attn_len[r]) + 1
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[r : r + 1].float(),
                    _repeat_kv(k[r : r + 1, :, :n].float(), h // hkv),
                    _repeat_kv(v[r : r + 1, :, :n].float(), h // hkv),
                    scale=scale,
                )  # [1, H, 1, D]
                err = float(
                    (out[r : r + 1].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-3)
                )
                if not err < (1e-4 if dtype == torch.float32 else 3e-2):
                    raise RuntimeError(
                        f"flex decode differs from SDPA by {err:.3g} (relative) at row {r}"
                    )

    def _decode_window(self) -> None:
        """``check_every`` decode steps over the smallest slot prefix holding every live slot (graph replays on CUDA)."""
        n = choose_prefix(self.prefixes, [s for s, k in enumerate(self.key) if k is not None])
        t0 = self._mark()
        for i in range(self.check_every):
            if i == 0 and n not in self._tried:
                self._first_step(n)
            elif self.use_graphs:
                self._graph_step(n)
            else:
                self._step(n)
        self._timed.append(("decode_s", t0, self._mark()))
        self.stats["decode_steps"] += self.check_every
        ps = self.stats["prefix_steps"]
        ps[str(n)] = ps.get(str(n), 0) + self.check_every
        if self.flex is None:
            self.stats["kv_bytes_read"] += (
                self.check_every
                * sum((min(b, n) - a) * cap for a, b, cap in self.groups if a < n)
                * self.kv_bytes_per_token
            )

    def _compiled_at(self, n: int) -> bool:
        """Whether a step over prefix ``n`` runs the compiled step (``compile_step`` held and ``n >= compile_min_prefix``)."""
        return self._compiled is not None and n >= self._compile_min

    def _step(self, n: Optional[int] = None) -> None:
        """One decode step of the slots ``[:n]``: the compiled step where :meth:`_compiled_at`, else :meth:`_step_eager`
        (the cache's flex call is set to match: traced inline when compiled, compiled alone when eager)."""
        n = self.S if n is None else n
        if self._compiled_at(n):
            self.cache.flex = (
                self._flex_inline if self.flex is not None else None
            )  # None: flex dropped (sdpa_groups)
            self._compiled(n)
        else:
            if self.flex is not None:
                self.cache.flex = self._flex_alone
            self._step_eager(n)

    def _step_eager(self, n: int) -> None:
        """One decode step of the slots ``[:n]`` (device-only: no host sync; finished and empty slots of the prefix
        compute, unchanged)."""
        c = self.cache
        lengths, done, n_gen = (
            self.lengths[:n],
            self.done[:n],
            self.n_gen[:n],
        )  # [n] views: in-place ops write the state
        c.lengths = lengths
        if self.flex is not None:
            c.attn_len = torch.where(
                done, torch.zeros_like(lengths), lengths
            )  # [n] finished/empty: column 0 only
            c.kv_blocks = kv_num_blocks(c.attn_len, self.block)  # [n, 1, 1]
            self.kv_cols += c.kv_blocks.sum() * self.block
        else:
            c.groups = [
                (
                    a,
                    min(b, n),
                    (self.col[:cap] <= lengths[a : min(b, n), None]).view(min(b, n) - a, 1, 1, cap),
                )
                for a, b, cap in self.groups
                if a < n
            ]  # [S_g, 1, 1, cap] per group in the prefix
        logits = self.model(
            input_ids=self.last[:n, None],
            position_ids=lengths[:, None],
            slot_cache=c,
            use_cache=False,
        ).logits  # [n, 1, V]
        tok = logits[:, -1].argmax(-1)  # [n]
        active = ~done  # [n]
        ar, out = self.ar[:n], self.out[:n]
        idx = n_gen.clamp(max=self.max_new - 1)  # [n]
        out[ar, idx] = torch.where(active, tok, out[ar, idx])
        n_gen += active
        hit = torch.isin(tok, self.stop_t) & active
        self.stopped[:n] |= hit
        done |= hit | (n_gen >= self.max_new)
        lengths += active
        self.last[:n].copy_(torch.where(active, tok, self.last[:n]))

    def _first_step(self, n: int) -> None:
        """The first step over prefix ``n`` (where flex compiles and is captured for that shape): a flex failure
        raises for ``attention="flex"``; for ``auto`` the engine logs it, switches to sdpa_groups and redoes the step.
        Its host seconds (compile + capture; one sync before and after) go to ``stats["first_step_s"][str(n)]``."""
        fs = self.stats["first_step_s"]  # a prefix retried after a dropped path adds up
        fs[str(n)] = fs.get(str(n), 0.0) + synced_seconds(
            self.dev, lambda: self._first_step_tries(n)
        )
        self._tried.add(n)

    def _first_step_tries(self, n: int) -> None:
        """:meth:`_first_step`'s step: retried uncompiled after a failed compile, then on sdpa_groups after a failed
        flex (``auto``), the decode state restored before each retry; any other failure raises."""
        while True:
            state = (
                [t.clone() for t in self._state()]
                if self.flex is not None or self._compiled_at(n)
                else None
            )
            try:
                self._graph_step(n) if self.use_graphs else self._step(n)
                return
            except Exception as e:  # noqa: BLE001 - re-raised below unless the compiled step or flex can be dropped
                if state is None:
                    raise
                for t, v in zip(self._state(), state):
                    t.copy_(v)
                if self._compiled_at(n):
                    self._drop_compile(
                        n, e
                    )  # then the step is retried uncompiled (a flex failure next drops flex)
                else:
                    self._drop_flex(n, e)

    def _drop_compile(self, n: int, e: Exception) -> None:
        """Leave the compiled step after a failure at prefix ``n``: one warning, then eager steps (and graphs)."""
        log.warning(
            "compiled decode step failed at slot prefix %d (%s: %s); regeneration goes on uncompiled",
            n,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        self._compiled = None
        self.flex = self.cache.flex = self._flex_alone
        self.graphs.clear()
        self._tried.clear()
        self.stats["compiled_step"] = False

    def _drop_flex(self, n: int, e: Exception) -> None:
        """Leave the flex path after a failure at prefix ``n`` (``auto``), or raise (``flex``)."""
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if self.attention_mode == "flex":
            raise RuntimeError(
                f"SlotEngine: FlexAttention decode failed at slot prefix {n} ({msg})"
            ) from e
        log.warning(
            "FlexAttention decode failed at slot prefix %d (%s); regen attention falls back to sdpa_groups",
            n,
            msg,
        )
        self.stats["kv_bytes_read"] = (
            int(self.kv_cols) * self.kv_bytes_per_token
        )  # flex's reads so far (one sync)
        self.flex = self.cache.flex = None
        self.graphs.clear()  # recaptured on the SDPA path (self.groups: one group over the whole cache)
        self.stats["attention"] = "sdpa_groups"

    def _graph_step(self, n: Optional[int] = None) -> None:
        n = self.S if n is None else n
        if n not in self.graphs and self._capture(n) is None:
            self._step(n)
            return
        self.graphs[n].replay()

    def _state(self) -> tuple:
        return self.last, self.lengths, self.n_gen, self.done, self.stopped, self.out, self.kv_cols

    def _capture(self, n: int):
        """Capture ``_step(n)`` as a CUDA graph (state is restored after the warm-up run); None on failure."""
        state = [t.clone() for t in self._state()]
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # the warm-up (allocator, lazy init, flex compile) advances the state: restored before the capture; the
            # K/V it writes are rewritten identically
            g = capture_graph(
                lambda: self._step(n),
                self._pool,
                after_warmup=lambda: [t.copy_(v) for t, v in zip(self._state(), state)],
            )
        except Exception as e:  # noqa: BLE001 - any capture failure: decode eagerly (same results)
            for t, v in zip(self._state(), state):
                t.copy_(v)
            if self.flex is not None or self._compiled_at(n):
                raise  # _first_step leaves the compiled step, then the flex path (auto), first
            log.warning(
                "CUDA graph capture failed (%s: %s); decoding without graphs", type(e).__name__, e
            )
            self.use_graphs = False
            return None
        self.graphs[n] = g
        self.stats["graph_captures"] += 1
        return g

    def _mark(self):
        """A timestamp of the work queued so far: a recorded CUDA event on CUDA (no sync), else the host clock."""
        if self.dev.type != "cuda":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _read_timers(self) -> None:
        """Add the device time of the prefills and decode windows recorded so far to ``stats`` (``prefill_s``,
        ``decode_s``; on the CPU host seconds); after a sync, so every event has completed."""
        for key, a, b in self._timed:
            self.stats[key] += (b - a) if isinstance(a, float) else a.elapsed_time(b) / 1000.0
        self._timed.clear()

    def _harvest(self) -> list[tuple[object, list[int], Optional[int]]]:
        """One host sync: finished slots' answers come back and the slots are freed."""
        flags = torch.cat(
            [
                torch.stack([self.done.long(), self.stopped.long(), self.n_gen]).flatten(),
                self.kv_cols.view(1),
            ]
        ).cpu()  # [3 S + 1]
        self._read_timers()
        done, stopped, n_gen = flags[:-1].view(3, self.S).tolist()
        if self.flex is not None:
            self.stats["kv_bytes_read"] = int(flags[-1]) * self.kv_bytes_per_token
        fin = [s for s in range(self.S) if self.key[s] is not None and done[s]]
        if not fin:
            return []
        rows = self.out[torch.tensor(fin, device=self.dev)].cpu().tolist()  # [F, T]
        out = []
        for s, row in zip(fin, rows):
            steps = (
                n_gen[s] - 1
            )  # decode steps after the prefill's token; step j attends prompt + j columns
            self.stats["kv_tokens_needed"] += steps * self.host_len[s] + steps * (steps + 1) // 2
            stop = (
                row[n_gen[s] - 1] if stopped[s] else None
            )  # the stop token is the last generated one
            out.append((self.key[s], row[: n_gen[s] - int(bool(stopped[s]))], stop))
            if self.retain[
                s
            ]:  # K/V of the prompt and of every answer token but the last (fed back, never computed)
                if (
                    self.key[s] in self.retained
                ):  # the key's earlier retained slot was never claimed: free it
                    self.hold[self.retained[self.key[s]]] = None
                self.hold[s] = _Held(self.key[s], self.host_ids[s] + row[: n_gen[s] - 1])
                self.retained[self.key[s]] = s
            self.key[s], self.host_ids[s], self.retain[s] = None, None, False
        return out


class HFContinuousEngine(Engine):
    """transformers' continuous batching (``model.init_continuous_batching``) behind the :class:`Engine` contract.

    Its scheduler thread batches queued requests under ``max_requests_per_batch = slots`` (and its token
    budget); priorities are honoured only as submission order (the manager is FIFO). ``generated_tokens``
    ends with the stop token when one was produced; it is cut off here, as everywhere in stage 01.

    Args:
        model: HF causal LM; its attention implementation is switched to ``paged|<impl>`` while the engine
            lives (transformers does this) and restored by :meth:`close`.
        slots: ``max_requests_per_batch``.
        max_new_tokens, stop_ids: answer budget and stop set.
        max_len: longest prompt + answer; sizes the paged cache to ``slots x max_len`` tokens (None: transformers'
            sizing from free memory).
        use_cuda_graph: transformers' switch (None = its own choice).
        max_memory_percent: share of free accelerator memory for the paged cache (None = transformers' 0.9).
    """

    def __init__(
        self,
        model,
        slots: int,
        max_new_tokens: int,
        stop_ids: set[int],
        max_len: Optional[int] = None,
        use_cuda_graph: Optional[bool] = None,
        max_memory_percent: Optional[float] = None,
    ):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.stop_ids, self.max_new = set(stop_ids), max_new_tokens
        pad = model.config.get_text_config().pad_token_id
        gcfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=sorted(stop_ids),
            pad_token_id=pad if pad is not None else sorted(stop_ids)[0],
        )
        # a cache of slots x max_len tokens in transformers' default 256-token blocks (as the slot engine's), else
        # its own sizing (``max_memory_percent`` of free memory)
        blocks = -(-slots * max_len // 256) if max_len and max_memory_percent is None else None
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=slots,
            use_cuda_graph=use_cuda_graph,
            max_memory_percent=max_memory_percent,
            num_blocks=blocks,
        )
        self.mgr = model.init_continuous_batching(
            generation_config=gcfg, continuous_batching_config=cb
        )
        self.mgr.start()
        self.keys: dict[str, object] = {}
        self._n = 0
        self.stats = {"decode_steps": 0, "prefill_calls": 0}

    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        """Queue ``ids`` under ``key``; ``priority``, ``parent`` and ``retain`` are ignored (transformers' manager is
        FIFO and prefills every request in full: no cross-turn prefix reuse here)."""
        rid = f"r{self._n}"
        self._n += 1
        self.keys[rid] = key
        self.mgr.add_request(
            list(ids),
            request_id=rid,
            max_new_tokens=self.max_new,
            eos_token_id=sorted(self.stop_ids),
        )

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        while self.keys:
            r = self.mgr.get_result(timeout=1.0)
            if r is None:
                if not self.mgr.is_running():
                    raise RuntimeError(
                        "transformers' continuous batching manager stopped with requests in flight"
                    )
                continue
            if not r.is_finished() or r.request_id not in self.keys:
                continue
            key = self.keys.pop(r.request_id)
            toks = list(r.generated_tokens)
            stopped = bool(toks) and toks[-1] in self.stop_ids
            yield key, toks[:-1] if stopped else toks, (toks[-1] if stopped else None)
        self.stats["decode_steps"] = int(getattr(self.mgr, "current_batch", 0))

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.stop(block=True)
            self.mgr = None
