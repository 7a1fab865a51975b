"""Test helper: start a stage as a real subprocess, send it SIGTERM once it has made progress, collect its stderr."""

import signal
import subprocess
import time
from typing import Callable


def sigterm_when(
    cmd: list[str],
    ready: Callable[[], bool],
    *,
    env: dict,
    cwd,
    wait_s: float = 300,
    exit_s: float = 60,
) -> tuple[int, str]:
    """Run ``cmd``; when ``ready()`` holds (polled every 10 ms; or the process ended, or ``wait_s`` passed) send it
    SIGTERM and wait up to ``exit_s`` for it to exit. Returns ``(returncode, stderr)``; a process still alive after
    that is killed (the test then fails on its return code)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + wait_s
        while proc.poll() is None and time.monotonic() < deadline and not ready():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=exit_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def lines_settled(path, n: int, settle_s: float = 0.05) -> Callable[[], bool]:
    """A ``ready`` for :func:`sigterm_when`: ``path`` holds at least ``n`` complete lines and its line count has not
    changed for ``settle_s`` seconds.

    A stage appends a resume record all-or-nothing and rolls the append back if a signal lands before its fsync
    returns (:func:`eagle3.io.append_bytes`), so a line seen the instant it is written may not survive the SIGTERM
    the test sends; a count that has held for a while belongs to appends that finished (a CI flake of 2026-12-04:
    2 lines seen, 1 kept)."""
    state = {"count": -1, "since": 0.0}

    def ready() -> bool:
        try:
            count = open(path, "rb").read().count(b"\n")
        except FileNotFoundError:
            count = 0
        now = time.monotonic()
        if count != state["count"]:
            state.update(count=count, since=now)
        return count >= n and now - state["since"] >= settle_s

    return ready
