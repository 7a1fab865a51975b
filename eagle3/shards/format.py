"""Hidden-state shards in the vLLM speculators v1 layout: format names, file paths, listing.

One ``torch.save`` dict per sample (FIELD-NOTES section 5, speculators v1)::

    {shards_dir}/rows_{start}-{end}/data_{idx}.pt     start = idx // rows_per_dir * rows_per_dir
    {
      "input_ids":     int64 [L]            verifier token ids
      "hidden_states": [4 x bf16 [L, H]]    aux1, aux2, aux3 (HF hidden_states indices), last
      "loss_mask":     int64 [L]            1 on assistant-reply tokens
    }

Readers also accept the flat speculators folder ``{dir}/data_{idx}.pt``. Files whose name
contains ``.tmp-`` are unfinished atomic writes (``eagle3.io``) and are ignored. Every shard is
written atomically, so a shard file that exists is complete.

fp8 storage (``extract.storage_dtype: float8_e4m3fn``, format ``eagle3-fp8-v1``; :mod:`eagle3.shards.fp8`)
keeps the same dict, with ``hidden_states`` as 4 x float8_e4m3fn ``[L, H]`` and one more key
``hidden_scales``: 4 x float32 ``[L, nb]`` (``nb`` = 1 per token, or ``H / block_size``), so that
``h = hidden_states[k].float() * scale`` per block.

Token-only samples (format ``eagle3-tokens-v1``, ``train.hidden_states: online``): the same file
names and layout, each dict only ``{"input_ids": int64 [L], "loss_mask": int64 [L]}`` (16 bytes per
token): stage 04 computes the hidden states itself (:mod:`eagle3.train.online`).

Writing: :mod:`eagle3.shards.write`; reading: :mod:`eagle3.shards.read`; the folder's
``data_config.json``: :mod:`eagle3.shards.data_config`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle3.errors import UserError
from eagle3.io import TMP_MARK

FORMAT = "speculators-v1"
FORMAT_FP8 = "eagle3-fp8-v1"  # speculators-v1 layout + fp8 hidden states + "hidden_scales"
FP8_FORMAT_VERSION = 1
FORMAT_TOKENS = (
    "eagle3-tokens-v1"  # input_ids + loss_mask only: stage 04 computes the states (online training)
)
#: token-only samples from which 02 writes and 03 validates them in worker processes: a token-only file costs its
#: (un)pickler, which holds the GIL, so threads do not scale on it
TOKEN_PROCESS_MIN = 2048
TOKEN_SHARD_KEYS = ("input_ids", "loss_mask")
TOKEN_BYTES_PER_TOKEN = 16  # int64 input_ids + int64 loss_mask
DATA_CONFIG = "data_config.json"
#: 02's lock file in the shards folder, held (``flock``) while 02 writes there; 03 stops while it is held.
EXTRACT_LOCK = ".extract.lock"
SHARD_KEYS = ("input_ids", "hidden_states", "loss_mask")
NUM_HIDDEN_STATES = 4  # three aux states + last
LAYER_INDEX_CONVENTION = (
    "HF hidden_states index: 0 = embeddings, i = output of decoder layer i-1 = residual stream "
    "entering decoder layer i; hidden_states[3] is HF hidden_states[-1]"
)
_NAME_RE = re.compile(r"^data_(\d+)\.pt$")
_ROWS_RE = re.compile(r"^rows_(\d+)-(\d+)$")


def shard_path(root: str | os.PathLike, idx: int, rows_per_dir: int) -> Path:
    """Path of sample ``idx``: ``{root}/rows_{start}-{start+rows_per_dir}/data_{idx}.pt``.

    ``start = idx // rows_per_dir * rows_per_dir`` (SpecForge/speculators folder sharding, which
    keeps directories small enough for network file systems).

    Raises:
        ValueError: ``idx < 0`` or ``rows_per_dir < 1`` (a caller bug).
    """
    if idx < 0 or rows_per_dir < 1:
        raise ValueError(f"shard_path: idx={idx} rows_per_dir={rows_per_dir}")
    start = idx // rows_per_dir * rows_per_dir
    return Path(root) / f"rows_{start}-{start + rows_per_dir}" / f"data_{idx}.pt"


def list_samples(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """All finished samples under ``root`` as ``(idx, path)`` sorted by idx.

    Accepts the nested layout (``rows_*/data_{idx}.pt``) and the flat speculators layout
    (``data_{idx}.pt``), even mixed. Unfinished atomic writes (``*.tmp-*``) are ignored.

    Raises:
        UserError: ``root`` is not a folder, or the same idx appears twice.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root}: shards folder not found")
    found: dict[int, Path] = {}

    def visit(folder: Path) -> None:
        for entry in os.scandir(folder):
            name = entry.name
            if TMP_MARK in name:
                continue
            m = _NAME_RE.match(name)
            if m and entry.is_file():
                idx = int(m.group(1))
                if idx in found:
                    raise UserError(f"{entry.path}: sample {idx} also stored as {found[idx]}")
                found[idx] = Path(entry.path)

    visit(root)
    for entry in os.scandir(root):
        if entry.is_dir() and _ROWS_RE.match(entry.name):
            visit(Path(entry.path))
    return sorted(found.items())


def all_finite(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite.

    Fast path: a float32 sum of finite values can only be non-finite by overflow, and any NaN or
    +-Inf makes the sum NaN or Inf; so a finite sum proves every element finite (one reduction, ~10x
    faster than ``isfinite(t).all()`` on bf16). A non-finite sum falls back to the exact check.
    """
    if bool(torch.isfinite(t.float().sum())):  # [L, H] -> scalar
        return True
    return bool(torch.isfinite(t).all())


NONFINITE_FIX = (
    "the verifier overflows in this dtype (float16 is the usual cause): run it in bfloat16 or float32 "
    "(verifier.dtype) and re-run"
)


def hf_layer_name(k: int, aux_layers: Optional[Sequence[int]]) -> str:
    """Which verifier state stored hidden state ``k`` is: ``HF hidden_states[i]`` for an aux layer
    (the capture convention, DESIGN.md "Aux layers"), ``the last hidden state`` for ``k == len(aux)``."""
    if aux_layers is not None and k < len(aux_layers):
        return f"HF hidden_states[{int(aux_layers[k])}]"
    return "the last hidden state" if aux_layers is not None else f"hidden state {k}"
