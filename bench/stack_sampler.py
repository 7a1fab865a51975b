"""Where a multi-threaded Python run spends its time: every thread's stack sampled at a fixed interval.

A daemon thread reads ``sys._current_frames()`` every ``interval`` seconds and counts, per thread
group (``main``, or a thread name up to its ``_<n>`` suffix: ``shard-writer``), the innermost
``depth`` frames. A thread blocked in C code (a file write, a CUDA event wait, a lock) shows at the
Python line that called it, so the shares say which calls the threads sit in, GIL held or not.
The sampler needs the GIL for each sample, so its interval bounds its own cost (~1% at 5 ms).

    with StackSampler(interval=0.005) as s:
        run()
    print(json.dumps(s.table(top=10)))
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
from typing import Optional


def _group(name: str, ident: int, main: int) -> str:
    if ident == main:
        return "main"
    return re.sub(r"_\d+$", "", name)


class StackSampler:
    """Context manager sampling all other threads' stacks; :meth:`table` summarises them.

    Args:
        interval: seconds between samples.
        depth: innermost frames kept per sample (``file:function:line``, innermost first).
    """

    def __init__(self, interval: float = 0.005, depth: int = 4):
        self.interval, self.depth = float(interval), int(depth)
        self.stacks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "StackSampler":
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        me, main = threading.get_ident(), threading.main_thread().ident
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = _group(names.get(ident, "?"), ident, main)
                parts, f = [], frame
                while f is not None and len(parts) < self.depth:
                    parts.append(
                        f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}:{f.f_lineno}"
                    )
                    f = f.f_back
                self.stacks[group][" < ".join(parts)] += 1
                self.samples[group] += 1

    def table(self, top: int = 10) -> dict:
        """``{group: {"samples": n, "top": [[stack, share of the group's samples], ...]}}``, largest first."""
        return {
            g: {
                "samples": self.samples[g],
                "top": [
                    [s, round(c / self.samples[g], 3)] for s, c in self.stacks[g].most_common(top)
                ],
            }
            for g in sorted(self.stacks)
        }
