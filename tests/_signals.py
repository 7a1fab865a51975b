"""Test helper: start a stage as a real subprocess, send it SIGTERM once it has made progress, collect its stderr."""

import signal
import subprocess
import time
from typing import Callable


def sigterm_when(cmd: list[str], ready: Callable[[], bool], *, env: dict, cwd, wait_s: float = 300,
                 exit_s: float = 60) -> tuple[int, str]:
    """Run ``cmd``; when ``ready()`` holds (polled every 10 ms; or the process ended, or ``wait_s`` passed) send it
    SIGTERM and wait up to ``exit_s`` for it to exit. Returns ``(returncode, stderr)``; a process still alive after
    that is killed (the test then fails on its return code)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
