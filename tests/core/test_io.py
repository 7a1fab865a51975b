"""eagle3.io.exclusive_lock: one writer per folder (stage 02, the shard converter)."""

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
        pass
    assert lock.exists()
