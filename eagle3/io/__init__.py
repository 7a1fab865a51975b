"""Atomic file writes, output folders and disk-full errors.

Every output is written to a temporary name in its folder and renamed into place (``os.replace``):
a kill leaves the old file, the new one or an ignorable ``*.tmp-*`` file. A full disk or quota
(``ENOSPC``/``EDQUOT``) removes the temporary file and raises one-line :class:`UserError`
(:func:`disk_full_error`). Reading inputs: :mod:`eagle3.io.read`; the lock: :mod:`eagle3.io.lock`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from eagle3.errors import UserError
from eagle3.io.lock import exclusive_lock
from eagle3.io.read import file_not_found as file_not_found  # re-exported (eagle3.verifier.head)
from eagle3.io.read import not_utf8_error, parse_json, require_file

TMP_MARK = ".tmp-"
#: errno values that mean "no room to write": disk full, quota exceeded.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How writers that do not raise OSError report the same condition (safetensors' SafetensorError: "... I/O error:
# No space left on device (os error 28)"); torch.save's errno-less RuntimeError is handled by atomic_torch_save.
_DISK_FULL_TEXT = (
    "No space left on device",
    "Disk quota exceeded",
    "StorageFull",
    "QuotaExceeded",
    f"(os error {errno.ENOSPC})",
    f"(os error {errno.EDQUOT})",
)


def is_disk_full(exc: BaseException) -> bool:
    """True when ``exc`` reports ``ENOSPC``/``EDQUOT`` (an ``OSError`` with that errno, or a
    writer's own exception type whose message carries the OS error, as safetensors' does)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in DISK_FULL_ERRNOS
    if isinstance(exc, Exception):
        text = str(exc)
        return any(t in text for t in _DISK_FULL_TEXT)
    return False


def format_bytes(n: int) -> str:
    """``n`` bytes in decimal units with the exact count: ``'1.50 GB (1500000000 bytes)'``."""
    n = int(n)
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def free_bytes(path: str | os.PathLike) -> tuple[int, Path]:
    """``(bytes free to this user, folder measured)`` for ``path`` (nearest existing folder)."""
    p = Path(path).absolute()
    if not p.is_dir():
        p = p.parent  # name the folder the file goes into
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free), p


#: What a disk-full line tells to do after freeing space (:func:`rerun_hint` sets it per stage; default: 01, 02).
RESUME_HINT = "re-run the same command to resume"
_rerun_hint = RESUME_HINT


@contextlib.contextmanager
def rerun_hint(text: str) -> Iterator[None]:
    """Word the disk-full line of the block's stage: ``... then {text}`` (03 and 05 start over, 04
    resumes with ``--resume``); the earlier wording is restored at the end.

    Raises:
        UserError: :func:`disk_full_error` for a disk-full exception of the block.
    """
    global _rerun_hint
    before, _rerun_hint = _rerun_hint, text
    try:
        with disk_full_guard(None):
            yield
    finally:
        _rerun_hint = before


def disk_full_error(
    path: str | os.PathLike, exc: BaseException, needed: int | None = None
) -> "UserError":
    """The one-line :class:`UserError` for a write to ``path`` that failed with ``exc`` (disk full):
    ``{path}: disk full (...) writing {needed}; {free} free on the filesystem of {folder}; free space or
    move the output folder, then {rerun_hint}``.
    """
    err = getattr(exc, "errno", None)
    reason = (
        os.strerror(err) if err in DISK_FULL_ERRNOS else "No space left on device or quota exceeded"
    )
    try:
        free, where = free_bytes(path)
        free_s = f"{format_bytes(free)} free on the filesystem of {where}"
    except OSError:
        free_s = "free space unknown"
    need_s = f" writing {format_bytes(needed)}" if needed is not None else ""
    return UserError(
        f"{path}: disk full ({reason}){need_s}; {free_s}; free space or move the output folder, "
        f"then {_rerun_hint}"
    )


@contextlib.contextmanager
def disk_full_guard(path: Optional[str | os.PathLike], needed: int | None = None) -> Iterator[None]:
    """Turn a disk-full error raised in the block into :func:`disk_full_error` for ``path`` (None: the
    file the error names, else ``output``); other exceptions pass unchanged.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a disk-full error
        if is_disk_full(e):
            where = path if path is not None else (getattr(e, "filename", None) or "output")
            raise disk_full_error(where, e, needed) from e
        raise


def make_dirs(path: str | os.PathLike, field: Optional[str] = None) -> list[Path]:
    """``mkdir -p path``; returns the folders made, deepest first.

    Args:
        field: the config field or flag behind ``path`` (None: the path alone names it).

    Raises:
        UserError: ``<field>: cannot create the output folder <path>: <why>`` (without ``field``:
            ``<path>: cannot create the folder: <why>``); disk full: :func:`disk_full_error`.
    """
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    with _folder_refusal(path, field, "create"):
        path.mkdir(parents=True, exist_ok=True)
    return missing


@contextlib.contextmanager
def _folder_refusal(path: Path, field: Optional[str], action: str) -> Iterator[None]:
    """An ``OSError`` in the block, which makes the folder ``path`` (``action`` "create") or a file in it ("write
    to"), as one line: disk full (:func:`disk_full_error`), else ``<field>: cannot <action> the output folder <path>:
    <why>`` (without ``field``: ``<path>: cannot <action> the folder: <why>``); ``why`` names a file standing where
    ``path`` or a parent folder should be, else it is the OS's reason."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(path, e) from e
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        why = (
            f"{blocker} is a file, not a folder" if blocker is not None else (e.strerror or str(e))
        )
        raise UserError(
            f"{field}: cannot {action} the output folder {path}: {why}"
            if field
            else f"{path}: cannot {action} the folder: {why}"
        ) from e


def probe_dirs(path: str | os.PathLike, field: Optional[str] = None) -> None:
    """Check at a stage's start that ``path`` can be made and takes a file; leaves nothing behind.

    Raises:
        UserError: as :func:`make_dirs`; ``<field>: cannot write to the output folder <path>: <why>``.
    """
    made = make_dirs(path, field)
    try:
        _probe_write(Path(path), field)
    finally:
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()  # only when still empty


def _probe_write(path: Path, field: Optional[str]) -> None:
    """Create and remove an empty file in the folder ``path`` (:func:`probe_dirs`); its name carries ``TMP_MARK``,
    so a run killed in between leaves a file :func:`remove_stale_tmp` recognises."""
    with _folder_refusal(path, field, "write to"):
        fd, tmp = tempfile.mkstemp(prefix=".write-probe" + TMP_MARK, dir=path)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _write_all(f, data: bytes) -> None:
    """Write all of ``data`` to the binary file ``f`` (short writes retried); every writer here
    goes through it, so a test can inject ``ENOSPC`` by replacing it.
    """
    view = memoryview(data)
    while view:
        n = f.write(view)
        if n is None or n <= 0:  # non-blocking file with nothing written: not used here
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def file_mode(directory: bool = False) -> int:
    """The permission bits a plain ``open()`` / ``mkdir()`` would give under the process umask: ``0o666 & ~umask``
    (``0o777`` for a folder). ``tempfile.mkstemp`` / ``mkdtemp`` create ``0o600`` / ``0o700`` whatever the umask,
    so a file renamed into place from one of them would stay readable by its owner alone (a serving engine running as
    another user could not read an exported drafter)."""
    return (0o777 if directory else 0o666) & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it (Linux: ``/proc/self/status``). ``os.umask`` can only be read by
    setting it, which would leave a window where a file made by another thread (stage 02's shard writers) gets
    umask 0; that round trip is the fallback where ``/proc`` has no ``Umask:`` line."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, needed: int | None = None, tmp_prefix: str | None = None
) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync and rename it to ``path`` (mode as
    ``open()`` under the umask). On an exception the temporary file is removed, ``path`` untouched.

    Args:
        needed: bytes the write takes, for the disk-full message (None: unknown).
        tmp_prefix: the temporary name's stem (default ``path``'s name).

    Raises:
        UserError: disk full / quota exhausted (:func:`disk_full_error`).
    """
    path = Path(path)
    with disk_full_guard(path, needed):
        make_dirs(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=(tmp_prefix or path.name) + TMP_MARK, dir=path.parent)
        os.close(fd)
        tmp = Path(tmp)
        try:
            yield tmp
            # mkstemp's 0o600 (or a writer's own: safetensors' save_file makes 0o600 files too) -> open()'s mode
            os.chmod(tmp, file_mode())
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise


def atomic_save_png(fig, path: str | os.PathLike, dpi: float | None = None) -> None:
    """Save matplotlib ``fig`` as PNG at ``path`` atomically and close it (``dpi`` None: matplotlib's).

    Raises:
        UserError: disk full / quota exceeded (nothing left behind).
    """
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", **({} if dpi is None else {"dpi": dpi}))
    finally:
        plt.close(fig)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically.

    Raises:
        UserError: disk full / quota exceeded (nothing left behind).
    """
    with atomic_path(path, needed=len(data)) as tmp:
        with open(tmp, "wb") as f:
            _write_all(f, data)


def atomic_write_files(
    files: Sequence[tuple[str | os.PathLike, bytes]], remove: Sequence[str | os.PathLike] = ()
) -> None:
    """Write ``files`` all or nothing: every temporary file is written before any rename, then the
    stale files ``remove`` names are deleted.

    Raises:
        UserError: disk full / quota exceeded (no file replaced; names the file that did not fit).
    """
    with contextlib.ExitStack() as stack:
        for path, data in files:
            tmp = stack.enter_context(atomic_path(path, needed=len(data)))
            with open(tmp, "wb") as f:
                _write_all(f, data)
    for path in remove:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def open_append(path: str | os.PathLike):
    """Open ``path`` for :func:`append_bytes` (unbuffered binary append; parents created).

    Raises:
        UserError: disk full / quota exceeded.
    """
    path = Path(path)
    with disk_full_guard(path):
        make_dirs(path.parent)
        return open(path, "ab", buffering=0)


def append_bytes(f, data: bytes, path: str | os.PathLike | None = None, fsync: bool = True) -> None:
    """Append ``data`` to ``f`` (from :func:`open_append`) all or nothing, then fsync; a failed
    append is truncated back to the previous end.

    Raises:
        UserError: disk full / quota exceeded (file rolled back).
    """
    path = Path(path if path is not None else f.name)
    end = os.fstat(f.fileno()).st_size
    with disk_full_guard(path, len(data)):
        try:
            _write_all(f, data)
            if fsync:
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(f.fileno(), end)
            raise


def cut_torn_tail(path: str | os.PathLike, block: int = 1 << 16) -> int:
    """Cut an append-only line log back to its last complete line (a torn tail a kill left), reading
    back ``block`` bytes at a time; a missing file is left alone. Returns the bytes cut.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, "rb") as r:
        size = end = os.fstat(r.fileno()).st_size
        while end > 0:  # back to the last newline, a block at a time (the log may be large)
            start = max(0, end - block)
            r.seek(start)
            cut = r.read(end - start).rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
    if end == size:
        return 0
    with open_append(path) as f:
        os.ftruncate(f.fileno(), end)
        os.fsync(f.fileno())
    return size - end


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Write one JSON object per line to ``path`` atomically."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


class _Sink:
    """Write-only file object for ``torch.save``: every chunk goes to ``f`` through :func:`_write_all`
    (so the disk-full handling applies) and, when given, into ``hasher``."""

    def __init__(self, f, hasher=None):
        self.f, self.hasher = f, hasher
        self.error: BaseException | None = None  # the first write error (torch.save masks it)

    def write(self, data) -> int:
        if self.hasher is not None:
            self.hasher.update(data)  # hashlib releases the GIL on large chunks
        try:
            _write_all(self.f, data)
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists, tuples walked): the size of a ``torch.save``
    archive up to its small pickle and zip headers."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # a torch.Tensor
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


#: ``atomic_torch_save(..., via_path=True)`` names its temporary file ``archive.tmp-*``: torch names the
#: archive's inner folder after the file name's stem, so the bytes equal a ``torch.save`` into a file
#: object (folder ``archive``), whatever the destination's name.
ARCHIVE_STEM = "archive"


def _save_archive(obj: Any, tmp: Path) -> None:
    """``torch.save(obj, tmp)`` by path: the one place path-mode archives are written, so a test can
    inject a full disk here (torch's C++ writer reports it as an errno-less RuntimeError)."""
    import torch  # on use: the CLI and the config import eagle3.io before a stage's heavy imports

    torch.save(obj, str(tmp))


def _hash_file(f, hasher, block: int = 1 << 22) -> None:
    """Update ``hasher`` with the bytes of the open binary file ``f`` from its start (read back from
    the page cache; ``readinto`` and the hashers release the GIL)."""
    buf = bytearray(block)
    view = memoryview(buf)
    f.seek(0)
    while True:
        n = f.readinto(buf)
        if not n:
            return
        hasher.update(view[:n])


def atomic_torch_save(
    obj: Any, path: str | os.PathLike, hasher=None, via_path: bool = False
) -> None:
    """``torch.save(obj)`` to ``path`` atomically; ``hasher`` (e.g. ``xxh3_128``) sees every byte.

    ``via_path=False`` streams through a Python file object; ``via_path=True`` lets torch's C++ zip
    writer write the temporary file (no GIL per record; 02's writer threads) and hashes it read back.
    torch reports a full disk without errno: a RuntimeError with less free space than the tensors
    need is taken as disk full.

    Raises:
        UserError: disk full / quota exceeded (nothing left behind).
    """
    import torch  # on use (see _save_archive)

    needed = _tensor_bytes(obj)
    if not via_path:
        with atomic_path(path, needed=needed) as tmp:
            with open(tmp, "wb") as f:
                sink = _Sink(f, hasher)
                try:
                    torch.save(obj, sink)
                except BaseException:
                    # torch.save's zip writer turns a failed write into its own RuntimeError on close:
                    # re-raise the write's error (e.g. ENOSPC) so it is reported as such
                    if sink.error is not None:
                        raise sink.error  # noqa: B904 - chained to torch's error
                    raise
        return
    with atomic_path(path, needed=needed, tmp_prefix=ARCHIVE_STEM) as tmp:
        try:
            _save_archive(obj, tmp)
        except RuntimeError as e:
            if free_bytes(tmp.parent)[0] < needed:  # measured before the partial file is removed
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from e
            raise
        if hasher is not None:
            with open(tmp, "rb") as f:
                _hash_file(f, hasher)


def write_json_and_markdown(path: str | os.PathLike, obj: Any, markdown: str) -> None:
    """A result as ``path`` (JSON, :func:`atomic_write_json`) and the same table for people beside it (``path`` with
    the suffix ``.md``, :func:`atomic_write_text`): the bench scripts' JSON + Markdown pair."""
    atomic_write_json(path, obj)
    atomic_write_text(Path(path).with_suffix(".md"), markdown)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file; raise :class:`UserError` naming the file and line on bad JSON or bytes that are not UTF-8
    (:func:`not_utf8_error`)."""
    path = require_file(path)
    try:
        return parse_json(path.read_text(encoding="utf-8"), path)
    except UnicodeDecodeError as e:
        raise not_utf8_error(path, e) from e


@contextlib.contextmanager
def output_folder_lock(
    folder: str | os.PathLike, lock_name: str, holder: str, field: Optional[str] = None
) -> Iterator[None]:
    """One writer per output folder for the block: :func:`probe_dirs` ``folder``, then hold
    ``folder/lock_name`` (:func:`exclusive_lock`); on failure the folders made are removed if empty.

    Raises:
        UserError: as :func:`make_dirs` / :func:`probe_dirs`; another process holds the lock.
    """
    folder = Path(folder)
    made = make_dirs(folder, field)
    try:
        _probe_write(folder, field)
        with exclusive_lock(folder / lock_name, holder):
            yield
    except BaseException:
        for p in made:  # deepest first; the lock file is gone already
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


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
