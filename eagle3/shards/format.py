"""Hidden-state shards in the vLLM speculators v1 layout (FIELD-NOTES section 5): format names, paths, listing.

``{shards_dir}/rows_{start}-{end}/data_{idx}.pt`` (``start = idx // rows_per_dir * rows_per_dir``; readers also
take the flat ``{dir}/data_{idx}.pt``), one ``torch.save`` dict per sample: ``input_ids`` int64 ``[L]``,
``hidden_states`` 4 x bf16 ``[L, H]`` (aux1, aux2, aux3 by HF index, last), ``loss_mask`` int64 ``[L]``. fp8
(``eagle3-fp8-v1``, :mod:`eagle3.shards.fp8`): float8_e4m3fn states plus ``hidden_scales`` 4 x float32 ``[L, nb]``.
Token-only (``eagle3-tokens-v1``, online training): ``input_ids`` and ``loss_mask`` only. Shards are written
atomically; names holding ``.tmp-`` are unfinished writes and ignored.
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
FORMAT_TOKENS = "eagle3-tokens-v1"  # input_ids + loss_mask only (online training)
# token-only samples from which 02 writes and 03 validates in processes (the unpickler holds the GIL)
TOKEN_PROCESS_MIN = 2048
TOKEN_SHARD_KEYS = ("input_ids", "loss_mask")
TOKEN_BYTES_PER_TOKEN = 16  # int64 input_ids + int64 loss_mask
DATA_CONFIG = "data_config.json"
EXTRACT_LOCK = ".extract.lock"  # 02's flock while it writes; 03 stops while held
SHARD_KEYS = ("input_ids", "hidden_states", "loss_mask")
NUM_HIDDEN_STATES = 4  # three aux states + last
LAYER_INDEX_CONVENTION = (
    "HF hidden_states index: 0 = embeddings, i = output of decoder layer i-1 = residual stream "
    "entering decoder layer i; hidden_states[3] is HF hidden_states[-1]"
)
_NAME_RE = re.compile(r"^data_(\d+)\.pt$")
_ROWS_RE = re.compile(r"^rows_(\d+)-(\d+)$")


def shard_path(root: str | os.PathLike, idx: int, rows_per_dir: int) -> Path:
    """``{root}/rows_{start}-{start+rows_per_dir}/data_{idx}.pt``; ValueError for ``idx < 0`` or ``rows_per_dir < 1``."""
    if idx < 0 or rows_per_dir < 1:
        raise ValueError(f"shard_path: idx={idx} rows_per_dir={rows_per_dir}")
    start = idx // rows_per_dir * rows_per_dir
    return Path(root) / f"rows_{start}-{start + rows_per_dir}" / f"data_{idx}.pt"


def list_samples(root: str | os.PathLike, at_least_one: bool = False) -> list[tuple[int, Path]]:
    """Finished samples under ``root`` (nested, flat or mixed layout) as ``(idx, path)`` sorted by idx.

    Args:
        at_least_one: a shard set with no sample is refused (a stage that reads or converts every sample).

    Raises:
        UserError: ``<root>: shards folder not found`` (not a folder), ``<root>: no shards found`` (none while
            ``at_least_one``), or an idx stored twice.
    """
    root = Path(root)
    is_dir = root.is_dir()
    found, twice = _samples_in(root) if is_dir else ({}, None)
    why = twice or (f"{root}: no shards found" if at_least_one and not found else None)
    if not is_dir or why is not None:
        raise UserError(why if is_dir else f"{root}: shards folder not found")
    return sorted(found.items())


def _samples_in(root: Path) -> tuple[dict[int, Path], Optional[str]]:
    """``({idx: path}, twice)``: the finished samples in the folder ``root`` and its ``rows_*`` folders
    (:func:`list_samples`), and ``<path>: sample <idx> also stored as <path>`` for the first idx found twice (else
    None)."""
    found: dict[int, Path] = {}
    twice: list[str] = []

    def visit(folder: Path) -> None:
        for entry in os.scandir(folder):
            name = entry.name
            if TMP_MARK in name:
                continue
            m = _NAME_RE.match(name)
            if m and entry.is_file():
                idx = int(m.group(1))
                if idx in found:
                    twice.append(f"{entry.path}: sample {idx} also stored as {found[idx]}")
                found.setdefault(idx, Path(entry.path))

    visit(root)
    for entry in os.scandir(root):
        if entry.is_dir() and _ROWS_RE.match(entry.name):
            visit(Path(entry.path))
    return found, (twice[0] if twice else None)


def all_finite(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite: a finite float32 sum proves it (one reduction), else the exact check."""
    if bool(torch.isfinite(t.float().sum())):  # [L, H] -> scalar
        return True
    return bool(torch.isfinite(t).all())


NONFINITE_FIX = (
    "the verifier overflows in this dtype (float16 is the usual cause): run it in bfloat16 or float32 "
    "(verifier.dtype) and re-run"
)


def hf_layer_name(k: int, aux_layers: Optional[Sequence[int]]) -> str:
    """Which verifier state stored hidden state ``k`` is, for messages (DESIGN.md "Aux layers")."""
    if aux_layers is not None and k < len(aux_layers):
        return f"HF hidden_states[{int(aux_layers[k])}]"
    return "the last hidden state" if aux_layers is not None else f"hidden state {k}"
