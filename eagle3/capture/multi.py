"""Capture across several patched SGLang servers at once, as one capture backend.

Each server is an :class:`eagle3.capture.sglang.SGLangCapture` with its own capture folder. Stage
02 announces its batches in plan order (:meth:`MultiServerCapture.schedule`); up to ``per_server x
servers`` are captured ahead on a thread pool and handed back in the order asked for, so the shards
equal one server's. :class:`eagle3.regen.endpoints.EndpointPool` picks the live server with the
fewest batches in flight; a failed batch is retried on another server after ``backoff_s x
attempt`` s; ``max_failures`` failures in a row take a server out; every server out, or one batch
failed ``max_failures x servers`` times, stops the run (shards kept, a rerun resumes).
:meth:`MultiServerCapture.info` refuses servers that disagree or do not answer at start.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional, Sequence

import torch

from eagle3.capture.base import BackendInfo
from eagle3.capture.sglang import SGLangCapture
from eagle3.errors import UserError
from eagle3.process_group import require_agreement
from eagle3.regen.endpoints import EndpointPool

log = logging.getLogger(__name__)

WHAT = "extract.sglang_url"


class ServerPool(EndpointPool):
    """The :class:`EndpointPool` of the capture servers; every server out of rotation stops the run, in the
    words of batches and shards, with each server's last error."""

    def all_down_message(self) -> str:
        errs = "; ".join(
            f"{e.url}: {'no error recorded' if e.last_error is None else e.last_error}"
            for e in self.endpoints
        )
        return (
            f"{self.what}: every capture server failed {self.dead_after} batches in a row and is out of rotation "
            f"({errs}); the shards written so far are kept: fix or replace the servers, then re-run the same "
            "command to resume"
        )


class MultiServerCapture:
    """:class:`eagle3.capture.base.CaptureBackend` over several :class:`SGLangCapture` servers.

    Args:
        servers: one per node (distinct URLs, own ``capture_dir``).
        per_server: batches in flight per server. max_failures: failures in a row that take a
            server out. backoff_s: retry ``k`` waits ``backoff_s * k`` s (at most 30).

    Raises:
        UserError: no server, or duplicate URLs (:class:`EndpointPool`).
    """

    def __init__(
        self,
        servers: Sequence[SGLangCapture],
        per_server: int = 2,
        max_failures: int = 3,
        backoff_s: float = 1.0,
    ):
        self.servers = list(servers)
        self._by_url = {s.url: s for s in self.servers}
        # out of rotation for good (no revival): a node that failed max_failures batches in a row is
        # down or broken for this run; give_up_after_s=0: every server out = stop at once
        self.pool = ServerPool(
            [s.url for s in self.servers],
            per_endpoint=per_server,
            dead_after=max_failures,
            revive_after_s=float("inf"),
            give_up_after_s=0.0,
            what=WHAT,
        )
        self.max_failures = int(max_failures)
        self.backoff_s = float(backoff_s)
        self.aux_layers = self.servers[0].aux_layers
        self._batches_done = collections.Counter()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(
            max_workers=self.pool.capacity, thread_name_prefix="sglang-capture"
        )
        self._ahead: collections.deque[tuple[list[list[int]], Future]] = collections.deque()
        self._upcoming: Optional[Iterator[list[list[int]]]] = None
        # bumped by cancel(): look-ahead captures of an older schedule stop retrying
        self._generation = 0

    def info(self) -> BackendInfo:
        """Every server's :meth:`SGLangCapture.info`; they must agree.

        Raises:
            UserError: a server fails its checks, is unreachable, or differs from the first.
        """
        first = self.servers[0].info()
        self.aux_layers = self.servers[0].aux_layers

        def served(s: SGLangCapture) -> tuple[BackendInfo, list[int]]:
            if s.aux_layers is None:  # the others are checked against the first's layers
                s.aux_layers = list(self.aux_layers)
            return s.info(), s.aux_layers

        def refusal(i: int, first: tuple, got: tuple) -> str:
            return (
                f"{WHAT} {self.servers[i].url}: serves {dict(got[0], aux_layers=got[1])} but "
                f"{self.servers[0].url} serves {dict(first[0], aux_layers=first[1])}; every capture "
                "server must run the same verifier with the same flags"
            )

        # one server after the other: the first that differs stops the check
        require_agreement((served(s) for s in self.servers), refusal)
        return first

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        """Per sample ``[aux1, aux2, aux3, last]`` bf16 CPU ``[L_i, H]``, from the look-ahead when
        ``batch`` is the next scheduled one, else captured now.

        Raises:
            UserError: the batch failed on every server tried, or every server is out.
            RuntimeError: ``batch`` is not the next scheduled one.
        """
        if not self._ahead:
            return self._capture_anywhere(batch)
        ids, fut = self._ahead.popleft()
        if ids != batch:
            raise RuntimeError(
                "MultiServerCapture.capture: batches must be asked for in the scheduled order"
            )
        self._fill()
        return fut.result()

    def schedule(self, batches: Sequence[list[list[int]]]) -> None:
        """Announce the batches :meth:`capture` will be asked for, in that order; capturing starts now."""
        self.cancel()
        self._upcoming = iter(list(batches))
        self._fill()

    def cancel(self) -> None:
        """Forget the schedule; batches not started are dropped (ones in flight finish and are discarded)."""
        self._generation += 1
        for _, fut in self._ahead:
            fut.cancel()
        self._ahead.clear()
        self._upcoming = None

    def _fill(self) -> None:
        while self._upcoming is not None and len(self._ahead) < self.pool.capacity:
            nxt = next(self._upcoming, None)
            if nxt is None:
                self._upcoming = None
                return
            self._ahead.append(
                (nxt, self._executor.submit(self._capture_anywhere, nxt, self._generation))
            )

    def _capture_anywhere(
        self, batch: list[list[int]], generation: Optional[int] = None
    ) -> list[list[torch.Tensor]]:
        """Capture ``batch`` on some live server, retrying on others; ``generation``: the schedule a
        look-ahead capture belongs to (once cancelled, it makes no further attempt)."""
        max_attempts = self.max_failures * len(self.servers)
        last = None
        for attempt in range(1, max_attempts + 1):
            if generation is not None and generation != self._generation:
                raise RuntimeError("look-ahead capture cancelled (stage 02 stopped)")
            # every server out of rotation: AllEndpointsDown (ServerPool.all_down_message), here or after a failure
            ep = self.pool.acquire(avoid=last)
            try:
                out = self._by_url[ep.url].capture(batch)
            except UserError as e:
                self.pool.release(ep, ok=False, error=str(e))
                self.pool.check_up()
                if attempt == max_attempts:
                    raise UserError(
                        f"{WHAT}: a batch of {len(batch)} samples failed {attempt} times; the last "
                        f"error: {e}"
                    ) from e
                log.warning(
                    "capture batch failed on %s (attempt %d/%d), retrying on another server: %s",
                    ep.url,
                    attempt,
                    max_attempts,
                    e,
                )
                last = ep
                time.sleep(min(30.0, self.backoff_s * attempt))
                continue
            self.pool.release(ep, ok=True)
            with self._lock:
                self._batches_done[ep.url] += 1
            return out
        raise AssertionError("unreachable")

    def server_summary(self) -> list[dict]:
        """Per server: URL, batches captured, requests, failed attempts, times taken out of rotation."""
        with self._lock:
            done = dict(self._batches_done)
        return [{**e, "batches": done.get(e["url"], 0)} for e in self.pool.summary()]


@contextlib.contextmanager
def prefetching(backend, batches: Sequence[list[list[int]]]):
    """While the block runs, ``backend`` captures ``batches`` (token-id lists per batch, in the order
    the block will ask for them) ahead, when it can (:meth:`MultiServerCapture.schedule`); other
    backends are left as they are. The schedule is cancelled on the way out."""
    schedule = getattr(backend, "schedule", None)
    if schedule is None:
        yield
        return
    schedule(batches)
    try:
        yield
    finally:
        backend.cancel()


def sglang_backend(
    urls: str | Sequence[str],
    capture_dirs: str | Sequence[str],
    aux_layers: Optional[list[int]],
    *,
    timeout: float,
    max_length: Optional[int],
    max_requests: Optional[int],
    per_server: int = 2,
    max_failures: int = 3,
):
    """An :class:`SGLangCapture` for one URL, or a :class:`MultiServerCapture` for several
    (``capture_dirs``: one folder per URL, same order).

    Raises:
        UserError: no URL, duplicate URLs, a folder count that does not match, a missing folder.
    """
    urls = [urls] if isinstance(urls, str) else list(urls)
    dirs = [capture_dirs] if isinstance(capture_dirs, str) else list(capture_dirs)
    if len({str(d) for d in dirs}) != len(urls):
        raise UserError(
            f"extract.capture_dir: {len(urls)} servers in {WHAT} need {len(urls)} capture folders (a list, "
            f"one per server, in the same order; each server's --capture-dir as this host sees it; each "
            f"server needs its own capture folder), got {dirs}"
        )
    servers = [
        SGLangCapture(u, d, aux_layers, timeout, max_length, max_requests)
        for u, d in zip(urls, dirs)
    ]
    if len(servers) == 1:
        return servers[0]
    return MultiServerCapture(servers, per_server=per_server, max_failures=max_failures)
