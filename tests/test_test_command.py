"""README: `bash scripts/test.sh -m "not slow"` runs the suite without the slow tests and
`bash scripts/test.sh tests/train` runs one stage's tests. scripts/test.sh ends in `exec python -m pytest ... "$@"`;
these run that pytest line (not the set-up before it) with --collect-only."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _test_sh_pytest_args() -> list[str]:
    line = next(
        ln
        for ln in (ROOT / "scripts" / "test.sh").read_text().splitlines()
        if ln.startswith("exec ")
    )
    m = re.fullmatch(r'exec python -m pytest (.*) "\$@"', line.strip())
    assert m, line
    return [
        a for a in shlex.split(m.group(1)) if a != "-q"
    ]  # _collected's own -q gives the one-line count


def _collected(*args: str) -> int:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    m = re.match(r"(\d+) tests? collected", last)
    assert m, last
    return int(m.group(1))


def test_test_sh_with_a_folder_runs_that_folder_only():
    """`bash scripts/test.sh tests/train` gave pytest `tests tests/train`: the whole suite (1,474 tests
    collected, not tests/train's 202)."""
    one = _collected(*_test_sh_pytest_args(), "tests/export")
    assert one == _collected("tests/export")
    assert 0 < one < _collected("tests")


def test_test_sh_without_a_folder_runs_the_whole_suite():
    assert _collected(*_test_sh_pytest_args()) == _collected("tests")
