"""``manifest.jsonl``: the durable log of finished shards that makes stage 02 resumable.

After each shard file has been atomically renamed into place, stage 02 appends one line
``{"idx": int, "id": str, "num_tokens": int}`` and flushes + fsyncs it. A kill can therefore
leave (a) a shard without its manifest line (the kill fell between rename and append) or (b) a
last line cut mid-write. :func:`read_manifest` tolerates (b) (an unterminated or unparsable
*last* line is dropped, reported via ``dropped_tail``); the resume logic in
``eagle3.capture.resume`` handles (a). A malformed line elsewhere is corruption -> UserError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, NamedTuple

from eagle3.errors import UserError
from eagle3.io import append_bytes, atomic_write_jsonl, open_append

MANIFEST = "manifest.jsonl"


class Manifest(NamedTuple):
    """Parsed manifest: rows keyed by idx (last row wins) and whether a torn tail was dropped."""

    rows: dict[int, dict]
    dropped_tail: bool


def _valid_row(row) -> bool:
    return (
        isinstance(row, dict)
        and isinstance(row.get("idx"), int)
        and not isinstance(row.get("idx"), bool)
        and row["idx"] >= 0
        and isinstance(row.get("id"), str)
        and isinstance(row.get("num_tokens"), int)
    )


def read_append_log(
    path: str | os.PathLike, valid: Callable[[object], bool], malformed: str
) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Rows of an append-only JSONL log written one whole, fsynced line at a time (``manifest.jsonl``,
    01's regeneration resume log).

    An interrupted append can leave only the LAST line torn (no final newline, or not a valid row):
    it is dropped and reported. Blank lines are skipped.

    Args:
        path: the log (must exist).
        valid: accepts a parsed row.
        malformed: what a bad line is called in the error (``"{path}:{line}: {malformed}"``).

    Returns:
        ``([(line number from 1, row, raw line bytes)], torn)``.

    Raises:
        UserError: a line other than the last is not valid JSON or not ``valid``.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    terminated = data.endswith(b"\n")
    if terminated:
        lines = lines[:-1]
    rows: list[tuple[int, dict, bytes]] = []
    torn = False
    for n, raw in enumerate(lines, 1):
        last = n == len(lines)
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            ok = valid(row)
        except (UnicodeDecodeError, json.JSONDecodeError):
            row, ok = None, False
        if not ok or (last and not terminated):
            if last:  # torn tail of an interrupted append
                torn = True
                continue
            raise UserError(f"{path}:{n}: {malformed}")
        rows.append((n, row, raw))
    return rows, torn


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read ``manifest.jsonl``; a missing file is an empty manifest.

    Raises:
        UserError: a line other than the last is not a valid ``{idx, id, num_tokens}`` object
            (message names the file and line number).
    """
    path = Path(path)
    if not path.is_file():
        return Manifest({}, False)
    rows, dropped = read_append_log(
        path, _valid_row, "malformed manifest line (expected {idx, id, num_tokens})"
    )
    return Manifest({row["idx"]: row for _, row, _ in rows}, dropped)


def rewrite_manifest(path: str | os.PathLike, rows: dict[int, dict]) -> None:
    """Atomically replace the manifest with ``rows`` sorted by idx (used to repair a torn tail)."""
    atomic_write_jsonl(path, [rows[k] for k in sorted(rows)])


class ManifestWriter:
    """Append-only writer: each :meth:`append` is one line, written whole and fsynced before returning.

    A disk-full error mid-append rolls the file back to its previous end (no torn line) and raises
    :class:`UserError` (:func:`eagle3.io.append_bytes`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._f = open_append(self.path)

    def append(self, idx: int, sample_id: str, num_tokens: int, **extra) -> dict:
        """Record that shard ``idx`` (prompt ``sample_id``, ``num_tokens`` tokens) is on disk.

        ``extra`` JSON-serialisable fields (e.g. ``num_loss_tokens``) are stored on the same line.
        Returns the row written.
        """
        row = {"idx": idx, "id": sample_id, "num_tokens": num_tokens, **extra}
        return self.append_many([row])[0]

    def append_many(self, rows: list[dict]) -> list[dict]:
        """Append ``rows`` (each ``{idx, id, num_tokens, **extra}``) all-or-nothing with one fsync.

        The bytes are those of :meth:`append` called row by row. Returns the rows written.
        """
        out = [
            {
                "idx": int(r["idx"]),
                "id": str(r["id"]),
                "num_tokens": int(r["num_tokens"]),
                **{k: v for k, v in r.items() if k not in ("idx", "id", "num_tokens")},
            }
            for r in rows
        ]
        append_bytes(self._f, "".join(json.dumps(r) + "\n" for r in out).encode("utf-8"), self.path)
        return out

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ManifestWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
