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
    """Bytes of a slot KV cache (K and V, ``n_layers`` x ``[rows, kv_heads, cols, head_dim]`` each (V ``v_head_dim``
    wide when given: MLA), ``elem_bytes`` a value); raises :class:`KVCacheTooLarge` when they exceed :data:`KV_FREE_SHARE` of ``free_bytes`` (the GPU's free
    memory, ``torch.cuda.mem_get_info``, or on the CPU the host's available memory: ``where`` says which), naming the
    settings that size it, instead of a CUDA out-of-memory traceback at the allocation (on the CPU: the kernel's OOM
    killer, a bare ``Killed`` and no line at all). SmolLM2-135M (30 layers, 3 KV heads
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
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None
