"""eagle3.io.exclusive_lock: one writer per folder (stage 02, the shard converter); the lock file is removed at the end."""

import pytest

from eagle3.errors import UserError
from eagle3.io import exclusive_lock


def test_exclusive_lock_refuses_second_holder_and_releases(tmp_path):
    lock = tmp_path / ".lock"
    with exclusive_lock(lock, "another run is writing here"):
        with pytest.raises(UserError, match=r"\.lock: another run is writing here$"):
            with exclusive_lock(lock, "another run is writing here"):
                pass
    with exclusive_lock(lock, "x"):  # released when the first block ended
        assert lock.exists()
    assert not lock.exists()  # a finished run leaves no empty lock file behind


def test_lock_file_removed_by_the_previous_holder_is_not_the_one_held(tmp_path, monkeypatch):
    """The race of deleting a lock file: we open it, the holder unlinks it and exits, another process creates a
    new one. The lock we then obtain on the old (unlinked) file must not count: we must hold the file at the path."""
    import fcntl

    lock = tmp_path / ".lock"
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:  # first attempt: the holder removed the file we opened, a new one appeared
            lock.unlink()
            lock.write_text("")
        calls.append(fd)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with exclusive_lock(lock, "held"):
        assert len(calls) == 2  # the stale file was dropped and the new one locked
        with open(lock, "a+") as other:
            with pytest.raises(BlockingIOError):
                real_flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not lock.exists()
