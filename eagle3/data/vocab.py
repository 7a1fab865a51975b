"""Draft vocabulary (FIELD-NOTES section 3): the ``draft_vocab_size`` target ids most frequent at loss-masked
positions (ties: lower id), sorted ascending; ``d2t`` int64 ``[dV]`` offsets (``target = draft + d2t[draft]``),
``t2d`` bool ``[V]``; identity when ``V <= draft_vocab_size``. ``vocab_map.pt`` = ``{"d2t", "t2d",
"target_vocab_size", "draft_vocab_size"}``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from eagle3.errors import UserError, validated
from eagle3.io import atomic_torch_save
from eagle3.io.read import safe_torch_load

VOCAB_MAP = "vocab_map.pt"
TOKEN_FREQ = "token_freq.pt"
_FLUSH_TOKENS = 1 << 22  # bincount once per ~4M buffered ids instead of once per sample


def count_token_freq(
    samples: Iterable[Mapping[str, torch.Tensor] | Sequence[torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """int64 ``[V]`` counts of target ids at loss-masked positions of ``samples`` (shard dicts with ``input_ids`` /
    ``loss_mask`` ``[L]``, or ``(input_ids, loss_mask)`` pairs), bincounted every few million ids.

    Raises:
        ValueError: an id outside ``0..V-1``, or ids and mask of different lengths.
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
            raise ValueError(
                f"count_token_freq: token id {hi if hi >= vocab_size else lo} outside 0..{vocab_size - 1}"
            )
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
    """``(d2t, t2d)`` of the top ``draft_vocab_size`` ids of ``freq`` (int ``[V]``), per the module convention.

    Raises:
        ValueError: ``freq`` not 1-D or ``draft_vocab_size < 1``.
    """
    if freq.dim() != 1 or draft_vocab_size < 1:
        raise ValueError(
            f"build_vocab_map: freq shape {tuple(freq.shape)}, draft_vocab_size {draft_vocab_size}"
        )
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


def coverage(freq: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of counted target tokens inside the draft vocab; ValueError on a shape mismatch or no count."""
    if freq.shape != t2d.shape:
        raise ValueError(f"coverage: freq {tuple(freq.shape)} vs t2d {tuple(t2d.shape)}")
    total = int(freq.sum())
    if total == 0:
        raise ValueError("coverage: no tokens counted")
    return int(freq[t2d].sum()) / total


def save_vocab_map(path: str | os.PathLike, d2t: torch.Tensor, t2d: torch.Tensor) -> Path:
    """Atomically write ``vocab_map.pt`` (:func:`vocab_map_record`; UserError before writing a bad map)."""
    path = Path(path)
    atomic_torch_save(vocab_map_record(d2t, t2d, str(path)), path)
    return path


def vocab_map_record(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> dict:
    """``vocab_map.pt``'s dict, after :func:`check_vocab_map` (``where`` names the file)."""
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    check_vocab_map(d2t, t2d, where)
    return _map_dict(d2t.clone(), t2d.clone())


def _map_dict(d2t: torch.Tensor, t2d: torch.Tensor) -> dict:
    """``{"d2t", "t2d", "target_vocab_size", "draft_vocab_size"}`` of the two tensors."""
    return {
        "d2t": d2t,
        "t2d": t2d,
        "target_vocab_size": int(t2d.numel()),
        "draft_vocab_size": int(d2t.numel()),
    }


DRAFT_KEY = "data.draft_vocab_size"  # the config key of the draft vocab size (stage 03)


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


class VocabMapFault(NamedTuple):
    """What is wrong with a draft vocab map: the ``key`` at fault (``d2t``, ``t2d``, ``target_vocab_size``,
    ``draft_vocab_size``) and ``what`` is wrong with it."""

    key: str
    what: str


def check_vocab_map(
    d2t: object,
    t2d: object,
    where: str = "vocab map",
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
    draft_key: str = DRAFT_KEY,
    target_source: str = "this verifier",
) -> None:
    """The one check of every draft vocab map read (``vocab_map.pt``, an export's ``d2t``/``t2d``, the drafter's
    ``set_vocab_map``): ``d2t`` int64 ``[dV]`` offsets whose target ids ``arange(dV) + d2t`` lie in ``0..V-1``, are
    distinct and increasing; ``t2d`` bool ``[V]`` True exactly there; sizes equal ``target_vocab_size`` /
    ``draft_vocab_size`` when given (``draft_key`` and ``target_source`` name them in messages).

    Raises:
        UserError: ``{where}: key 'd2t'|'t2d'|'draft_vocab_size'|'target_vocab_size': ...``, the first
        :func:`vocab_map_fault` (absolute ids instead of offsets are named as such).
    """
    fault = vocab_map_fault(d2t, t2d, target_vocab_size, draft_vocab_size, draft_key, target_source)
    if fault is not None:
        raise UserError(f"{where}: key '{fault.key}': {fault.what}")


def vocab_map_fault(
    d2t: object,
    t2d: object,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
    draft_key: str = DRAFT_KEY,
    target_source: str = "this verifier",
) -> Optional[VocabMapFault]:
    """The first fault of the pair ``(d2t, t2d)`` under :func:`check_vocab_map`'s contract, in order: types and
    ranks, the sizes asked for, then the offsets (:func:`_offset_fault`); None for a valid map."""
    for key, x, dtype, what in (
        ("d2t", d2t, torch.int64, "int64 tensor of offsets"),
        ("t2d", t2d, torch.bool, "bool tensor"),
    ):
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != 1:
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            return VocabMapFault(key, f"expected a 1-D {what}, got {got}")
    d2t, t2d = d2t.detach().cpu(), t2d.detach().cpu()
    dv, tv = int(d2t.numel()), int(t2d.numel())
    if target_vocab_size is not None and tv != int(target_vocab_size):
        return VocabMapFault(
            "target_vocab_size",
            f"map built for a target vocab of {tv}, {target_source} has {target_vocab_size}",
        )
    if draft_vocab_size is not None and dv != int(draft_vocab_size):
        return VocabMapFault(
            "draft_vocab_size",
            f"the map has {dv} draft tokens but {draft_key} is {draft_vocab_size} (re-run "
            f"03_prepare_data.py with {draft_key}: {draft_vocab_size}, or set {draft_key} back to {dv})",
        )
    return _offset_fault(d2t, t2d)


def _offset_fault(d2t: torch.Tensor, t2d: torch.Tensor) -> Optional[VocabMapFault]:
    """The first inconsistency of the CPU tensors ``d2t`` int64 ``[dV]`` and ``t2d`` bool ``[V]``, else None."""
    dv, tv = int(d2t.numel()), int(t2d.numel())
    if dv < 1 or dv > tv:
        return VocabMapFault("d2t", f"{dv} draft ids for a target vocab of {tv}")
    tgt = torch.arange(dv, dtype=torch.int64) + d2t  # [draft_V] target id of each draft id
    marked = t2d.nonzero().flatten()  # [n] target ids t2d marks, ascending
    if dv > 1 and bool(d2t.any()) and marked.numel() == dv and torch.equal(d2t, marked):
        return VocabMapFault(
            "d2t", "holds absolute target ids; the format stores offsets (d2t[i] = target_id - i)"
        )
    bad = (tgt < 0) | (tgt >= tv)  # [draft_V]
    if bool(bad.any()):
        i = _first(bad)
        return VocabMapFault(
            "d2t", f"draft id {i} maps to target id {int(tgt[i])}, outside 0..{tv - 1}"
        )
    down = tgt[1:] <= tgt[:-1]  # [draft_V - 1]: target ids must strictly increase
    if bool(down.any()):
        i = _first(down)
        a, b = int(tgt[i]), int(tgt[i + 1])
        return VocabMapFault(
            "d2t",
            f"draft ids {i} and {i + 1} both map to target id {a}"
            if a == b
            else f"draft ids must be sorted by target id, but draft id {i} maps to {a} and draft id "
            f"{i + 1} to {b}",
        )
    want = torch.zeros(tv, dtype=torch.bool)  # [target_V]
    want[tgt] = True
    if not torch.equal(want, t2d):
        k = _first(want != t2d)
        return VocabMapFault(
            "t2d",
            f"marks {int(t2d.sum())} target ids, d2t describes {dv}; "
            f"they differ first at target id {k} (t2d {bool(t2d[k])}, d2t {bool(want[k])})",
        )
    return None


class VocabMapFile(BaseModel):
    """``vocab_map.pt`` as :func:`save_vocab_map` writes it: the two tensors and the sizes recorded beside them,
    which must be the tensors' (``target_vocab_size`` = ``t2d.numel()``, ``draft_vocab_size`` = ``d2t.numel()``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    d2t: torch.Tensor
    t2d: torch.Tensor
    target_vocab_size: StrictInt
    draft_vocab_size: StrictInt

    @field_validator("target_vocab_size", "draft_vocab_size")
    @classmethod
    def _as_the_tensors(cls, v: int, info: ValidationInfo) -> int:
        t = info.data.get("t2d" if info.field_name == "target_vocab_size" else "d2t")
        if t is not None and v != t.numel():
            raise ValueError(f"records {v} but the tensors have {t.numel()}")
        return v


def load_vocab_map(
    path: str | os.PathLike,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
    draft_key: str = DRAFT_KEY,
) -> dict:
    """``vocab_map.pt`` as ``{"d2t", "t2d", "target_vocab_size", "draft_vocab_size"}``, checked (:func:`check_vocab_map`
    with the given sizes; ``draft_key`` names the setting).

    Raises:
        UserError (file and key): unreadable file, missing key, recorded sizes unlike the tensors', a bad map.
    """
    path = Path(path)
    obj = validated(VocabMapFile, safe_torch_load(path), str(path), "re-run 03_prepare_data.py")
    check_vocab_map(obj.d2t, obj.t2d, str(path), target_vocab_size, draft_vocab_size, draft_key)
    return _map_dict(obj.d2t, obj.t2d)


def load_run_vocab_map(
    data_dir: str | os.PathLike, draft_vocab_size: int, target_vocab_size: int
) -> dict:
    """Stage 03's ``{data_dir}/vocab_map.pt`` with ``draft_vocab_size`` (``data.draft_vocab_size``) draft ids and
    ``target_vocab_size`` (the shards' verifier vocab) target ids; UserError as :func:`load_vocab_map`.
    """
    return load_vocab_map(
        Path(data_dir) / VOCAB_MAP,
        target_vocab_size=int(target_vocab_size),
        draft_vocab_size=int(draft_vocab_size),
    )
