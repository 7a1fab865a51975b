"""Packed prefill for the slot engine (``prompts.regen_prefill_pack``): no padding between prompts.

A packed forward feeds the prompts' tokens back to back as one sequence ``[1, Tq]`` (``Tq``: the
token count rounded up to a power of two, :func:`packed_bucket`). Query token ``j`` of row ``r``
(RoPE position and cache column ``offsets[r] + j``) attends row ``r``'s keys at columns up to its
own: its fed tokens and the ``offsets[r]`` cached columns of its slot, gathered into a prefix stream
of ``Tp`` entries after the fed ones. Fed K/V are written into the slot first (padding into column
``L - 1`` of slot 0, which no request writes or reads). FlexAttention runs over
``[fed | prefix]`` with a ``BlockMask`` from host-computed block ranges (:func:`packed_layout`).
Greedy tokens equal the padded forward's (float32, tests/prompts/test_packed_prefill.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
from torch.nn.attention.flex_attention import flex_attention

from eagle3.regen.flex_compat import (
    block_mask_from_kv_blocks,
    kv_blocks_params,
    raise_recompile_limit,
)


def packed_bucket(n: int, block: int) -> int:
    """Stream length for ``n`` tokens: 0 for 0, else the smallest power of two ``>= max(n, block)``.

    Raises:
        ValueError: ``n < 0`` or ``block`` not a positive power of two.
    """
    if n < 0 or block < 1 or block & (block - 1):
        raise ValueError(f"packed_bucket: n >= 0 ({n}) and block a positive power of two ({block})")
    return 0 if n == 0 else max(block, 1 << (n - 1).bit_length())


@dataclass
class PackedLayout:
    """Host tensors of one packed forward: ``R`` rows, ``Tq`` fed positions, ``Tp`` prefix entries,
    ``nQ = Tq / block``, ``nK = (Tq + Tp) / block``.

    Attributes:
        ids: int64 ``[1, Tq]`` token ids, padding 0.
        q: int64 ``[4, Tq]``: document (row; ``R`` for padding), RoPE position, slot and column
            written (padding: slot 0, column ``L - 1``).
        kv: int64 ``[2, Tq + Tp]``: document and column of every key (prefix padding: -1, 0).
        prefix: int64 ``[2, Tp]``: slot and column each prefix entry is gathered from.
        rows: int64 ``[3, S]``: per row its slot, last fed token's index, prompt length.
        kv_num_blocks: int32 ``[1, 1, nQ]``; kv_indices: int32 ``[1, 1, nQ, nK]``.
    """

    ids: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    prefix: torch.Tensor
    rows: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``[n] -> [n + 1]``: 0, x0, x0 + x1, ... (int64)."""
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(x, 0)])


def packed_blocks(
    doc_q: torch.Tensor, starts: torch.Tensor, pstarts: torch.Tensor, tq: int, tp: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kv blocks each query block of a packed forward reads.

    Args:
        doc_q: int64 ``[Tq]`` row of each fed token, non-decreasing (padding ``R``).
        starts: int64 ``[R + 1]`` first stream index of each row (``starts[R]``: fed count).
        pstarts: int64 ``[R + 2]`` first prefix entry of each row, then the prefix total twice.
        tq, tp: stream lengths (multiples of ``block``).
        block: FlexAttention block size.

    Returns:
        ``(kv_num_blocks int32 [1, 1, nQ], kv_indices int32 [1, 1, nQ, nK])``: query block ``i``
        (rows ``d0 .. d1``) reads fed blocks ``starts[d0] // block .. i`` and the prefix blocks of
        its rows; unused index slots clamped into range.
    """
    nq, nk = tq // block, (tq + tp) // block
    i = torch.arange(nq)
    d0, d1 = (
        doc_q[i * block],
        doc_q[(i + 1) * block - 1],
    )  # [nQ] first and last row of each query block
    lo1 = starts[d0] // block
    n1 = i + 1 - lo1  # [nQ] fed-token blocks: lo1 .. i
    plo, phi = tq + pstarts[d0], tq + pstarts[d1 + 1]  # [nQ] prefix-stream range of rows d0 .. d1
    lo2 = plo // block
    n2 = torch.where(phi > plo, -(-phi // block) - lo2, torch.zeros_like(lo2))
    j = torch.arange(nk)[None]  # [1, nK]
    idx = torch.where(j < n1[:, None], lo1[:, None] + j, lo2[:, None] + j - n1[:, None]).clamp(
        0, nk - 1
    )
    return (n1 + n2).to(torch.int32).view(1, 1, nq), idx.to(torch.int32).view(1, 1, nq, nk)


def packed_layout(
    ids: Sequence[Sequence[int]],
    offsets: Sequence[int],
    slots: Sequence[int],
    n_slots: int,
    cols: int,
    block: int,
) -> PackedLayout:
    """Host layout of one packed prefill forward.

    Args:
        ids: per row, the prompt ids fed (after its cached prefix; non-empty).
        offsets: per row, cached columns before the fed tokens.
        slots: per row, its slot (distinct, ``< n_slots``).
        n_slots: the engine's slots ``S``.
        cols: cache columns per slot ``L``.
        block: FlexAttention block size (a power of two).

    Returns:
        :class:`PackedLayout`.

    Raises:
        ValueError: rows of different counts, an empty row, more rows than slots, or a token past
            column ``L - 2``.
    """
    r = len(ids)
    fed, off = _check_layout(ids, offsets, slots, n_slots, cols)
    n, n_pre = int(fed.sum()), int(off.sum())
    tq, tp = packed_bucket(n, block), packed_bucket(n_pre, block)
    starts, pstarts = _exclusive_cumsum(fed), _exclusive_cumsum(off)  # [R + 1] each
    row = torch.arange(r)
    doc = torch.full((tq,), r, dtype=torch.long)
    doc[:n] = torch.repeat_interleave(row, fed)
    pos = torch.zeros(tq, dtype=torch.long)
    pos[:n] = torch.arange(n) - starts[:-1].repeat_interleave(fed) + off.repeat_interleave(fed)
    slot_t = torch.tensor(list(slots), dtype=torch.long)  # [R]
    wslot = torch.zeros(tq, dtype=torch.long)
    wslot[:n] = slot_t.repeat_interleave(fed)
    wcol = torch.full((tq,), cols - 1, dtype=torch.long)
    wcol[:n] = pos[:n]
    pdoc, pcol, pslot, psrc = _prefix_layout(off, pstarts, slot_t, tp, cols)
    flat = torch.zeros(1, tq, dtype=torch.long)
    flat[0, :n] = torch.tensor([t for x in ids for t in x], dtype=torch.long)
    rows = torch.zeros(3, n_slots, dtype=torch.long)
    rows[0, :r], rows[1, :r], rows[2, :r] = slot_t, starts[1:] - 1, off + fed
    nb, idx = packed_blocks(doc, starts, torch.cat([pstarts, pstarts[-1:]]), tq, tp, block)
    return PackedLayout(
        ids=flat,
        q=torch.stack([doc, pos, wslot, wcol]),
        kv=torch.stack([torch.cat([doc, pdoc]), torch.cat([pos, pcol])]),
        prefix=torch.stack([pslot, psrc]),
        rows=rows,
        kv_num_blocks=nb,
        kv_indices=idx,
    )


def _check_layout(
    ids: Sequence[Sequence[int]],
    offsets: Sequence[int],
    slots: Sequence[int],
    n_slots: int,
    cols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fed, off)``: per row the fed tokens and cached columns (``[R]`` int64 each), after :func:`packed_layout`'s
    argument checks (ValueError)."""
    r = len(ids)
    if (
        not (r == len(offsets) == len(slots))
        or not 1 <= r <= n_slots
        or any(len(x) == 0 for x in ids)
    ):
        raise ValueError(
            f"packed_layout: {len(ids)} rows, {len(offsets)} offsets, {len(slots)} slots "
            f"(1..{n_slots} non-empty rows)"
        )
    fed = torch.tensor([len(x) for x in ids], dtype=torch.long)  # [R]
    off = torch.tensor(list(offsets), dtype=torch.long)  # [R]
    if int((off + fed).max()) > cols - 1:
        raise ValueError(
            f"packed_layout: a prompt reaches column {int((off + fed).max()) - 1}; the cache keeps "
            f"column {cols - 1} free"
        )
    return fed, off


def _prefix_layout(
    off: torch.Tensor, pstarts: torch.Tensor, slot_t: torch.Tensor, tp: int, cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cached-prefix keys' ``(doc, column, slot, source column)``, each ``[Tp]`` int64: ``off[r]`` columns of
    row ``r``'s slot back to back; padding has doc -1 and reads column ``cols - 1``."""
    n_pre = int(off.sum())
    pdoc = torch.full((tp,), -1, dtype=torch.long)
    pcol = torch.zeros(tp, dtype=torch.long)
    pslot = torch.zeros(tp, dtype=torch.long)
    psrc = torch.full((tp,), cols - 1, dtype=torch.long)
    if n_pre:
        pdoc[:n_pre] = torch.repeat_interleave(torch.arange(len(off)), off)
        pcol[:n_pre] = torch.arange(n_pre) - pstarts[:-1].repeat_interleave(off)
        pslot[:n_pre] = slot_t.repeat_interleave(off)
        psrc[:n_pre] = pcol[:n_pre]
    return pdoc, pcol, pslot, psrc


def packed_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_meta: torch.Tensor,
    kv_meta: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: Optional[float],
    block: int,
) -> torch.Tensor:
    """FlexAttention of a packed prefill: query ``t`` attends key ``k`` iff same document and
    ``kv_meta[1, k] <= q_meta[1, t]``, over :func:`packed_blocks`' blocks (device ops only).

    Args:
        query: ``[1, H, Tq, D]``; key, value: ``[1, Hkv, Tq + Tp, D]``.
        q_meta: int64 ``[>= 2, Tq]`` (document, column); kv_meta: int64 ``[2, Tq + Tp]``.
        kv_num_blocks, kv_indices: :class:`PackedLayout`'s.
        scale: softmax scale (None: ``1 / sqrt(D)``); block: the layout's block size.

    Returns:
        ``[1, H, Tq, D]`` in the query's dtype.
    """
    doc_q, col_q, doc_kv, col_kv = q_meta[0], q_meta[1], kv_meta[0], kv_meta[1]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_kv[kv_idx] == doc_q[q_idx]) & (col_kv[kv_idx] <= col_q[q_idx])

    bm = block_mask_from_kv_blocks(
        kv_num_blocks, kv_indices, block, mask_mod, query.shape[2], key.shape[2]
    )
    return flex_attention(
        query, key, value, block_mask=bm, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


def eager_packed_flex(*args, **kwargs) -> torch.Tensor:
    """:func:`packed_flex` run eagerly (the CPU's packed prefill) without PyTorch's 15-line ``flex_attention called
    without torch.compile()`` UserWarning: eager is this path's documented choice off CUDA (its streams are kept
    short, ``continuous.PACK_EAGER_TOKENS``), so the warning only alarmed the user of every CPU run."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="flex_attention called without torch.compile", category=UserWarning
        )
        return packed_flex(*args, **kwargs)


_COMPILED: dict = {}


def compiled_packed_flex(dynamic: Optional[bool] = False):
    """``torch.compile(packed_flex, dynamic=dynamic)``, one per process and setting. ``None``:
    automatic dynamic shapes (two compiles); ``False``: one per ``(Tq, Tp)`` (the CPU fallback,
    where Inductor cannot build the dynamic kernel).
    """
    if dynamic not in _COMPILED:
        kv_blocks_params()  # inspect.signature eagerly: the traced function only reads the result
        raise_recompile_limit()
        _COMPILED[dynamic] = torch.compile(packed_flex, dynamic=dynamic, fullgraph=True)
    return _COMPILED[dynamic]


def packed_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    routing: "PackedRouting",
    scaling: Optional[float],
) -> torch.Tensor:
    """One layer's attention of a packed prefill forward.

    Args:
        query: ``[1, H, Tq, D]``; key, value: ``[1, Hkv, Tq, D]``.
        kc, vc: the layer's cache ``[S, Hkv, L, D]``; fed K/V written at ``routing.q`` rows 2-3,
            then the prefix stream gathered from ``routing.prefix``.
        routing: the forward's :class:`PackedRouting`; scaling: softmax scale.

    Returns:
        ``[1, H, Tq, D]``.
    """
    kc[routing.q[2], :, routing.q[3]] = key[0].transpose(
        0, 1
    )  # [Tq, Hkv, D] at (slot, column) of each fed token
    vc[routing.q[2], :, routing.q[3]] = value[0].transpose(0, 1)
    if routing.prefix.shape[1]:
        kp = kc[routing.prefix[0], :, routing.prefix[1]].transpose(0, 1)[
            None
        ]  # [1, Hkv, Tp, D] cached prefixes
        vp = vc[routing.prefix[0], :, routing.prefix[1]].transpose(0, 1)[None]
        key, value = torch.cat([key, kp], 2), torch.cat([value, vp], 2)  # [1, Hkv, Tq + Tp, D]
    return routing.flex(
        query,
        key,
        value,
        routing.q,
        routing.kv,
        routing.kv_num_blocks,
        routing.kv_indices,
        scaling,
        routing.block,
    )


@dataclass
class PackedRouting:
    """What :func:`packed_prefill_attention` reads during a packed forward (set on ``SlotCache.packed``): the device
    tensors of :class:`PackedLayout` (``q``, ``kv``, ``prefix``, ``kv_num_blocks``, ``kv_indices``), the flex
    function (:func:`packed_flex` or its compiled form) and the block size."""

    q: torch.Tensor
    kv: torch.Tensor
    prefix: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    flex: object
    block: int


@dataclass
class PackedBuffers:
    """Static device tensors of one packed shape ``(Tq, Tp)``: ``t`` (a device :class:`PackedLayout`),
    ``tok`` int64 ``[S]`` first answer token per row, the captured graph and its ``uses``.
    """

    key: tuple
    t: PackedLayout
    tok: torch.Tensor
    graph: Optional[object] = None
    uses: int = 0

    @classmethod
    def like(cls, lay: PackedLayout, dev) -> "PackedBuffers":
        """Device buffers shaped as ``lay``."""
        t = PackedLayout(
            **{
                f.name: torch.empty_like(getattr(lay, f.name), device=dev)
                for f in fields(PackedLayout)
            }
        )
        return cls(
            key=(lay.q.shape[1], lay.prefix.shape[1]),
            t=t,
            tok=torch.zeros(lay.rows.shape[1], dtype=torch.long, device=dev),
        )

    def fill(self, lay: PackedLayout) -> None:
        """Copy ``lay`` in (pinned, asynchronous on CUDA: no host sync)."""
        cuda = self.tok.device.type == "cuda"
        for f in fields(PackedLayout):
            src = getattr(lay, f.name)
            getattr(self.t, f.name).copy_(src.pin_memory() if cuda else src, non_blocking=cuda)

    def routing(self, flex, block: int) -> PackedRouting:
        t = self.t
        return PackedRouting(t.q, t.kv, t.prefix, t.kv_num_blocks, t.kv_indices, flex, block)
