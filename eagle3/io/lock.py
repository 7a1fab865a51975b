"""One writer per output: an exclusive ``flock`` held for a block (:func:`exclusive_lock`) and the probe a reader
uses to see whether a writer holds one now (:func:`lock_held`).

filelock's ``FileLock`` takes the same flock, but keeps the lock file on release (this one removes it, a finished
run leaves nothing behind), has no probe of another process's lock, and falls back to a soft lock file where
flock is missing (a killed holder's soft lock would block the next run).
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
    """Hold an exclusive, non-blocking ``flock`` on ``lock_path`` for the block (the OS releases it
    even on SIGKILL, so a killed run never leaves a stale lock); the file is deleted again at the end
    of the block, so a finished run leaves no empty lock file behind.

    Deleting a lock file is safe only this way (the usual flock pattern): the holder unlinks it while
    still holding the lock, and a process that obtains the lock checks that the file it locked is still
    the one at ``lock_path`` (same device and inode); if the holder removed it in between, it opens the
    new file and tries again. So two processes never both hold a lock on ``lock_path``.

    Args:
        lock_path: the lock file (created if absent, removed when the block ends).
        holder: what writes there, for the error, e.g. ``"another 02_extract_hidden run is writing to X"``.

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
    """Whether a running process holds the :func:`exclusive_lock` on ``lock_path`` now, for a reader that must not
    read what that process is writing (03 over 02's shards). The staleness rule is :func:`exclusive_lock`'s: the lock
    is the ``flock``, not the file, and the OS releases it when its process ends, even on SIGKILL; so a lock file a
    dead process left behind is not held (False), nor is a missing or unreadable one. The probe takes a shared lock
    for an instant and releases it; nothing is created or removed.
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
