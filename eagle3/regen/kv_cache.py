"""The slot engine's KV cache: per-layer ``[rows, kv_heads, cols, head_dim]`` tensors, their size check
against free memory, and the key / value widths of a verifier (MLA included)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from eagle3.errors import UserError

log = logging.getLogger(__name__)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, L, D] -> [B, Hkv * groups, L, D]`` (query head h reads KV head h // groups, as HF's repeat_kv)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


@dataclass
class SlotCache:
    """Preallocated KV cache of :class:`SlotEngine` and the per-forward routing its attention reads.

    Attributes:
        k, v: per layer ``[S, Hkv, L, D]`` in the verifier's dtype.
        rows: prefill: slot of each row, int64 ``[P]``; None = decode.
        lengths: decode: cached tokens per slot of the prefix, int64 ``[n]``.
        groups: decode, ``sdpa_groups``: ``(first slot, end slot, mask [S_g, 1, 1, cap])`` per group.
        flex: decode, ``flex``: the bound :func:`flex_decode`; None otherwise.
        attn_len: decode, ``flex``: last attended column per row, int64 ``[n]``.
        kv_indices: decode, ``flex``: int32 ``[S, 1, 1, L / block]`` (``arange`` per row).
        prefill_cols, prefill_mask: prefill at column offsets (:func:`offset_prefill_layout`).
        packed: packed prefill: the forward's :class:`PackedRouting`; None otherwise.
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


class KVCacheTooLarge(UserError):
    """The slot engine's KV cache would not fit in the GPU memory that is free (raised before it is allocated)."""


KV_FREE_SHARE = 0.9  # of the free GPU memory the KV cache may take; the rest: logits [rows, V], activations, graphs


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
    """Bytes of a slot KV cache (``n_layers`` x K and V ``[rows, kv_heads, cols, head_dim]``, V
    ``v_head_dim`` wide when given), checked against :data:`KV_FREE_SHARE` of ``free_bytes`` (``where``
    names GPU or host memory).

    Raises:
        KVCacheTooLarge: the cache would not fit (a one-line :class:`UserError` naming the settings).
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
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None
