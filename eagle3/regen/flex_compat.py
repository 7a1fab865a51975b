"""FlexAttention across the torch versions this project runs on (torch 2.11 on the GPU machine, 2.13 here), for the
slot engine's decode (:mod:`eagle3.regen.slots`) and packed prefill (:mod:`eagle3.regen.packed_prefill`):
``BlockMask.from_kv_blocks``'s keyword set and Dynamo's recompile limit."""

from __future__ import annotations

from typing import Optional

import torch

_FKB_PARAMS: Optional[frozenset] = None


def kv_blocks_params() -> frozenset:
    """Keyword names of ``BlockMask.from_kv_blocks`` in this torch (read once with ``inspect.signature``; call it
    eagerly before tracing, so a compiled function only reads the cached result)."""
    global _FKB_PARAMS
    if _FKB_PARAMS is None:
        import inspect

        from torch.nn.attention.flex_attention import BlockMask

        _FKB_PARAMS = frozenset(inspect.signature(BlockMask.from_kv_blocks).parameters)
    return _FKB_PARAMS


def block_mask_from_kv_blocks(
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    block: int,
    mask_mod,
    q_len: int,
    kv_len: int,
):
    """``BlockMask`` of ``[.., q_len, kv_len]`` from per-query-block kv block lists (device ops only).

    Args:
        kv_num_blocks: int32 ``[B, H, nQ]``; kv_indices: int32 ``[B, H, nQ, nK]``.
        block: block size. mask_mod: applied inside the listed blocks. q_len, kv_len: lengths.
    """
    from torch.nn.attention.flex_attention import BlockMask

    params, kw = kv_blocks_params(), {}
    if "seq_lengths" in params:
        kw["seq_lengths"] = (q_len, kv_len)
    if "compute_q_blocks" in params:
        kw["compute_q_blocks"] = False  # the transposed (backward) index is not needed
    bm = BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=block, mask_mod=mask_mod, **kw
    )
    # older torch: lengths of whole blocks
    return bm if "seq_lengths" in params else bm._adjust(q_len, kv_len)


def raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo's per-function recompile limit to at least ``limit``: the engine's compiled functions recompile once per
    static shape (slot prefix, packed stream shape)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
