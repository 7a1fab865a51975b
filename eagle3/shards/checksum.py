"""Shard checksums recorded in ``manifest.jsonl``: which hash, how a row names it, how a file is checked.

02 (and ``shard_convert``) hash every shard's bytes as they stream to the file and record the digest
in the shard's manifest row under the algorithm's name; 03 re-hashes the file and compares, so silent
corruption between the stages (bit rot, a partial copy, an edit) is an error.

- ``xxh3_128`` (new shards, the default): XXH3 128-bit from the ``xxhash`` package (a dependency of
  ``datasets``), ~30 GB/s per core. The checksum guards against accidents, not an adversary
  (shards are loaded ``weights_only``), and sha256 was the largest single CPU cost of 02's shard
  writer: ~1.5 GB/s per core, a third of the writer thread's time, on the path that holds HF
  capture below the bare forward (``bench/extract_throughput.py``).
- ``sha256``: what runs before this change recorded; still verified where a row carries it.

A row carries one of the keys (``{"idx", "id", "num_tokens", "num_loss_tokens", "xxh3_128"}``) or
none (flat vLLM-speculators folders have no manifest at all).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import xxhash

DEFAULT_ALGO = "xxh3_128"
ALGOS = ("xxh3_128", "sha256")
HEX_LEN = {"xxh3_128": 32, "sha256": 64}
_BLOCK = 1 << 20


def new_hasher(algo: str = DEFAULT_ALGO):
    """A fresh hasher (``update(bytes)``, ``hexdigest()``) for ``algo``.

    Raises:
        ValueError: ``algo`` not in :data:`ALGOS`.
    """
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown shard checksum '{algo}' (known: {', '.join(ALGOS)})")


def file_checksum(path: str | os.PathLike, algo: str = DEFAULT_ALGO) -> str:
    """Hex digest of a file's bytes under ``algo``, streamed in 1 MiB blocks.

    Raises:
        OSError: the file cannot be read; ValueError: unknown ``algo``.
    """
    h = new_hasher(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def row_checksum(row: dict) -> Optional[tuple[str, str]]:
    """``(algo, hex)`` recorded in a manifest row, or None when it carries no checksum.

    A row with both keys (none is written so) is checked with the default algorithm.
    """
    for algo in ALGOS:
        if isinstance(row.get(algo), str):
            return algo, row[algo]
    return None
