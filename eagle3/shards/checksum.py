"""Shard checksums in ``manifest.jsonl``: 02 hashes each shard as it streams to the file and records the digest under
the algorithm's name; 03 re-hashes and compares. ``xxh3_128`` (default, ~30 GB/s per core; it guards against
accidents, shards load ``weights_only``) or ``sha256`` (older rows, still verified). A row carries one key or none
(flat speculators folders have no manifest).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import xxhash

from eagle3.errors import UserError

DEFAULT_ALGO = "xxh3_128"
ALGOS = ("xxh3_128", "sha256")
HEX_LEN = {"xxh3_128": 32, "sha256": 64}
_BLOCK = 1 << 20


def new_hasher(algo: str = DEFAULT_ALGO):
    """A fresh hasher (``update``, ``hexdigest``) for ``algo``; ValueError outside :data:`ALGOS`."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown shard checksum '{algo}' (known: {', '.join(ALGOS)})")


def file_checksum(path: str | os.PathLike, algo: str = DEFAULT_ALGO) -> str:
    """Hex digest of a file under ``algo``, streamed in 1 MiB blocks (OSError, ValueError)."""
    h = new_hasher(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def row_checksum(row: dict) -> Optional[tuple[str, str]]:
    """``(algo, hex)`` recorded in a manifest row (the first of :data:`ALGOS`), or None."""
    for algo in ALGOS:
        if isinstance(row.get(algo), str):
            return algo, row[algo]
    return None


def verify_file(path: str | os.PathLike, want: Optional[tuple[str, str]], manifest: str) -> None:
    """Refuse a shard whose bytes no longer hash to ``want`` = ``(algo, hex)`` as recorded in ``manifest`` (None:
    nothing recorded, nothing checked).

    Raises:
        UserError: ``<path>: contents changed since extraction (<algo> differs from <manifest>); <fix>``.
    """
    if want is not None and file_checksum(path, want[0]) != want[1]:
        raise UserError(
            f"{path}: contents changed since extraction ({want[0]} differs from {manifest}); "
            "delete the file and re-run 02_extract_hidden.py to recapture it"
        )
