"""Atomic file writes and safe loading.

Every output of the pipeline is written to a temporary name in the destination folder and
renamed into place (``os.replace`` is atomic on POSIX), so a kill at any moment leaves either the
old file, the new file, or an ignorable ``*.tmp-*`` file, never a truncated output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from eagle3.errors import UserError

TMP_MARK = ".tmp-"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync and rename it to ``path``.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + TMP_MARK, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write one JSON object per line to ``path`` atomically."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` atomically (temp name in the same folder, then rename)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def safe_torch_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with one-line errors.

    Raises:
        UserError: the file is missing, truncated/corrupt, or holds objects that the
            weights-only unpickler refuses (e.g. a pickle crafted to run code).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive since torch 1.6
        raise UserError(f"{path}: truncated or corrupt torch file (not a complete zip archive, or not a torch file at all)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: refused by the weights-only loader (unsafe or foreign pickle): {first}") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: truncated or corrupt torch file: {first[:160]}") from e


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, record)`` for each non-blank line of a JSONL file (``.gz`` read as gzip).

    Raises:
        UserError: ``file:line: malformed JSON: ...`` on the first bad line.
    """
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: malformed JSON: {e.msg}") from e


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; raise :class:`UserError` naming the file and line on bad JSON."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from e


def remove_stale_tmp(root: str | os.PathLike) -> list[Path]:
    """Delete leftover ``*.tmp-*`` files of interrupted atomic writes under ``root`` (recursive).

    Only call this when no writer is running on ``root``. Returns the removed paths.
    """
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if TMP_MARK in name:
                p = Path(dirpath) / name
                try:
                    p.unlink()
                    removed.append(p)
                except FileNotFoundError:
                    pass
    return removed
