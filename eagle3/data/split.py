"""Stage 03's sample split: seeded train/val, a nested training subset, and ids excluded by prefix."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Optional

from eagle3.errors import UserError
from eagle3.shards.manifest import MANIFEST, read_manifest

log = logging.getLogger(__name__)


def split_indices(indices: list[int], val_fraction: float, seed: int) -> dict[str, list[int]]:
    """Seeded train/val split ``{"train": sorted ids, "val": sorted ids}``: ``round(val_fraction * n)`` val ids, at least 1
    when ``val_fraction > 0`` and ``n >= 2``, never all; ``random.Random(seed)`` shuffles the sorted ids.
    """
    ids = sorted(int(i) for i in indices)
    n = len(ids)
    n_val = round(val_fraction * n)
    if val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    n_val = min(n_val, max(n - 1, 0))
    perm = list(ids)
    random.Random(seed).shuffle(perm)
    return {"train": sorted(perm[n_val:]), "val": sorted(perm[:n_val])}


def subset_train(train: list[int], n: Optional[int], seed: int) -> list[int]:
    """``data.train_samples``: ``n`` training ids (sorted) of one seeded permutation, so subsets of a seed are nested; all
    when ``n`` is None or not smaller (``n`` above ``len(train)`` is warned).
    """
    if n is not None and n > len(train):
        log.warning(
            "data.train_samples: %d asked, the training split holds %d (after the validation split and "
            "data.exclude_id_prefixes): all of them are used",
            n,
            len(train),
        )
    if n is None or n >= len(train):
        return list(train)
    perm = sorted(train)
    random.Random(seed + 1).shuffle(perm)
    return sorted(perm[:n])


def exclude_by_id(
    train: list[int], shards: Path, prefixes: list[str]
) -> tuple[list[int], dict[str, int]]:
    """``data.exclude_id_prefixes``: ``(kept ids in order, {prefix: dropped})``, dropping training samples whose
    ``manifest.jsonl`` id (02's) starts with a prefix; a prefix matching nothing is warned.

    Raises:
        UserError: the manifest is missing or lacks a sample's row, or every training sample is dropped.
    """
    if not prefixes:
        return list(train), {}
    path = shards / MANIFEST
    rows = read_manifest(path).rows  # a missing file: no rows
    lost = next((i for i in train if i not in rows), None)
    if lost is not None:
        what = f"has no row for sample {lost}" if rows else "is missing or empty (02 writes it)"
        raise UserError(
            f"data.exclude_id_prefixes: {path} {what}, and the setting needs every sample's id; re-run "
            "02_extract_hidden.py to complete it"
        )
    kept, dropped = [], {p: 0 for p in prefixes}
    for i in train:
        hit = next((p for p in prefixes if rows[i]["id"].startswith(p)), None)
        if hit is None:
            kept.append(i)
        else:
            dropped[hit] += 1
    if not kept:
        raise UserError(
            f"data.exclude_id_prefixes: {prefixes} drops all {len(train)} training samples of {shards}"
        )
    unmatched = [p for p, n in dropped.items() if n == 0]  # a typo would otherwise be silent
    stems = (
        sorted({rows[i]["id"].split("/")[0] + "/" for i in train if "/" in rows[i]["id"]})
        if unmatched
        else []
    )
    for p in unmatched:
        log.warning(
            "data.exclude_id_prefixes: %r matches no training sample (ids are case-sensitive; their "
            "prefixes here: %s)",
            p,
            ", ".join(stems[:12]) + (", ..." if len(stems) > 12 else "") or "none",
        )
    return kept, dropped
