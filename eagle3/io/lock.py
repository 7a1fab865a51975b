"""One writer per output: an exclusive ``flock`` held for a block, and a probe of another's.

Not filelock: its ``FileLock`` keeps the lock file on release, has no probe, and falls back to a
soft lock file that a killed holder leaves blocking.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from eagle3.errors import UserError


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike, holder: str) -> Iterator[None]:
    """Hold an exclusive non-blocking ``flock`` on ``lock_path`` for the block (released by the OS even
    on SIGKILL); the file is removed at the end while still held, and a process that gets the lock
    checks that the file is still the one at ``lock_path`` (device, inode), else retries.

    Args:
        lock_path: the lock file (created if absent).
        holder: what writes there, for the error.

    Raises:
        UserError: ``{lock_path}: {holder}`` when another process holds the lock.
    """
    lock_path = Path(lock_path)
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            f.close()
            raise UserError(f"{lock_path}: {holder}") from e
        except BaseException:
            f.close()
            raise
        mine = os.fstat(f.fileno())
        try:
            now = os.stat(lock_path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        f.close()  # the previous holder removed the file after we opened it: lock the new one
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock_path.unlink()  # still holding the lock (see above)
        f.close()


def lock_held(lock_path: str | os.PathLike) -> bool:
    """Whether a live process holds :func:`exclusive_lock` on ``lock_path`` now (a stale, missing or
    unreadable file: False). Takes a shared lock for an instant; creates nothing.
    """
    try:
        f = open(lock_path, "rb")
    except OSError:  # absent (no writer), or not readable: nothing to go by
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False
