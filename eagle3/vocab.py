"""Draft vocabulary: token frequencies on loss-masked positions and the d2t / t2d maps.

Convention (FIELD-NOTES section 3; SGLang ``hot_token_id = d2t + arange``, vLLM drops ``t2d``):

- keep the ``draft_vocab_size`` target ids that occur most often at loss-masked positions
  (ties broken by the lower id), sorted by target id ascending;
- ``d2t``: int64 ``[draft_V]`` offsets, ``target_id = draft_id + d2t[draft_id]``;
- ``t2d``: bool ``[target_V]``, True where the target id is in the draft vocab;
- identity map when ``target_V <= draft_vocab_size``: ``draft_V = target_V``, ``d2t`` all zero,
  ``t2d`` all True.

``vocab_map.pt`` = ``{"d2t", "t2d", "target_vocab_size", "draft_vocab_size"}``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from eagle3.errors import UserError
from eagle3.io import atomic_torch_save, safe_torch_load

VOCAB_MAP = "vocab_map.pt"
TOKEN_FREQ = "token_freq.pt"
_FLUSH_TOKENS = 1 << 22  # bincount once per ~4M buffered ids instead of once per sample


def count_token_freq(
    samples: Iterable[Mapping[str, torch.Tensor] | Sequence[torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """Count target token ids at loss-masked positions.

    Args:
        samples: iterable of shard dicts (``input_ids`` int ``[L]``, ``loss_mask`` 0/1 ``[L]``)
            or ``(input_ids, loss_mask)`` pairs.
        vocab_size: target vocab ``V``.

    Returns:
        int64 ``[V]`` counts. Vectorised: masked ids are buffered and counted with
        ``torch.bincount`` every few million tokens (no per-token Python work).

    Raises:
        ValueError: a masked id is outside ``0..V-1`` or ids/mask lengths differ.
    """
    freq = torch.zeros(vocab_size, dtype=torch.int64)  # [V]
    buf: list[torch.Tensor] = []
    n_buf = 0

    def flush() -> None:
        nonlocal buf, n_buf
        if not buf:
            return
        ids = torch.cat(buf)  # [n]
        buf, n_buf = [], 0
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"count_token_freq: token id {hi if hi >= vocab_size else lo} outside 0..{vocab_size - 1}")
        freq.add_(torch.bincount(ids, minlength=vocab_size))

    for s in samples:
        ids, mask = (s["input_ids"], s["loss_mask"]) if isinstance(s, Mapping) else s
        ids = torch.as_tensor(ids).reshape(-1)  # [L]
        mask = torch.as_tensor(mask).reshape(-1)  # [L]
        if ids.numel() != mask.numel():
            raise ValueError(f"count_token_freq: {ids.numel()} ids but {mask.numel()} mask entries")
        sel = ids[mask.bool()].to(torch.int64)  # [n_masked]
        buf.append(sel)
        n_buf += sel.numel()
        if n_buf >= _FLUSH_TOKENS:
            flush()
    flush()
    return freq


def build_vocab_map(freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the draft vocab from target-token counts.

    Args:
        freq: int ``[target_V]`` counts (see :func:`count_token_freq`).
        draft_vocab_size: wanted ``draft_V`` (>= 1).

    Returns:
        ``(d2t, t2d)``: int64 ``[draft_V]`` offsets (``target = draft + d2t[draft]``) and bool
        ``[target_V]``. Top ``draft_V`` ids by count, ties broken by lower id, sorted ascending.
        If ``target_V <= draft_vocab_size``: identity, ``draft_V = target_V``.

    Raises:
        ValueError: ``freq`` is not 1-D or ``draft_vocab_size < 1``.
    """
    if freq.dim() != 1 or draft_vocab_size < 1:
        raise ValueError(f"build_vocab_map: freq shape {tuple(freq.shape)}, draft_vocab_size {draft_vocab_size}")
    V = freq.numel()
    if V <= draft_vocab_size:
        return torch.zeros(V, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    # Stable descending sort keeps equal counts in ascending-id order -> lower id wins ties.
    order = torch.sort(freq.to(torch.int64), descending=True, stable=True).indices  # [V]
    keep = torch.sort(order[:draft_vocab_size]).values  # [draft_V] target ids, ascending
    d2t = keep - torch.arange(draft_vocab_size, dtype=torch.int64)  # [draft_V]
    t2d = torch.zeros(V, dtype=torch.bool)  # [V]
    t2d[keep] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """int64 ``[draft_V]`` target id of each draft id: ``arange(draft_V) + d2t`` (SGLang ``hot_token_id``)."""
    return torch.arange(d2t.numel(), dtype=torch.int64) + d2t  # [draft_V]


def coverage(freq: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of counted (loss-masked) target tokens that fall in the draft vocab, in [0, 1].

    Raises:
        ValueError: shapes differ or no token was counted.
    """
    if freq.shape != t2d.shape:
        raise ValueError(f"coverage: freq {tuple(freq.shape)} vs t2d {tuple(t2d.shape)}")
    total = int(freq.sum())
    if total == 0:
        raise ValueError("coverage: no tokens counted")
    return int(freq[t2d].sum()) / total


def save_vocab_map(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Atomically write ``vocab_map.pt`` (``d2t``, ``t2d``, ``target_vocab_size``, ``draft_vocab_size``)."""
    path = Path(path)
    atomic_torch_save(
        {"d2t": d2t.to(torch.int64).clone(), "t2d": t2d.to(torch.bool).clone(),
         "target_vocab_size": int(t2d.numel()), "draft_vocab_size": int(d2t.numel())},
        path,
    )
    return path


def load_vocab_map(
    path: str | os.PathLike, target_vocab_size: int | None = None, draft_vocab_size: int | None = None
) -> dict:
    """Load and check ``vocab_map.pt``.

    Args:
        target_vocab_size / draft_vocab_size: if given, the sizes the map must have been built for.

    Returns:
        ``{"d2t": int64 [draft_V], "t2d": bool [target_V], "target_vocab_size", "draft_vocab_size"}``.

    Raises:
        UserError (naming the file and key): unreadable/unsafe file, missing key, wrong dtype or
        length, inconsistent d2t/t2d, or a map built for another vocab size.
    """
    path = Path(path)
    obj = safe_torch_load(path)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not a vocab map (top level is {type(obj).__name__})")
    for key in ("d2t", "t2d", "target_vocab_size", "draft_vocab_size"):
        if key not in obj:
            raise UserError(f"{path}: key '{key}': missing")
    d2t, t2d = obj["d2t"], obj["t2d"]
    tv, dv = int(obj["target_vocab_size"]), int(obj["draft_vocab_size"])
    if not isinstance(d2t, torch.Tensor) or d2t.dtype != torch.int64 or d2t.shape != (dv,):
        raise UserError(f"{path}: key 'd2t': expected int64 [{dv}]")
    if not isinstance(t2d, torch.Tensor) or t2d.dtype != torch.bool or t2d.shape != (tv,):
        raise UserError(f"{path}: key 't2d': expected bool [{tv}]")
    if target_vocab_size is not None and tv != target_vocab_size:
        raise UserError(
            f"{path}: key 'target_vocab_size': map built for a target vocab of {tv}, this verifier has {target_vocab_size}"
        )
    if draft_vocab_size is not None and dv != draft_vocab_size:
        raise UserError(f"{path}: key 'draft_vocab_size': map has {dv} draft tokens, expected {draft_vocab_size}")
    tgt = draft_to_target_ids(d2t)  # [draft_V]
    if dv and (int(tgt.min()) < 0 or int(tgt.max()) >= tv or bool((tgt[1:] <= tgt[:-1]).any())):
        raise UserError(f"{path}: key 'd2t': draft->target ids must be strictly increasing within 0..{tv - 1}")
    if int(t2d.sum()) != dv or not bool(t2d[tgt].all()):
        raise UserError(f"{path}: key 't2d': does not mark exactly the {dv} target ids of d2t")
    return {"d2t": d2t, "t2d": t2d, "target_vocab_size": tv, "draft_vocab_size": dv}
