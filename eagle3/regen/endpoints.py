"""A pool of HTTP serving endpoints: load spread, dead ones out of rotation, retries with backoff.

* Load spread: a request goes to the live endpoint with the fewest in flight (ties: least
  recently used), at most ``per_endpoint`` each.
* Retries: timeouts, connection errors, HTTP 5xx/408/429 and unparsable bodies are retried up to
  ``max_attempts`` in all after ``backoff_s * 2**(attempt-1)`` s (capped, +-25% jitter), on another
  endpoint when one is free; other 4xx are not.
* Dead endpoints: ``dead_after`` consecutive failures take one out for ``revive_after_s``, then
  one probe request; every endpoint failing for ``give_up_after_s`` raises :class:`AllEndpointsDown`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import requests

from eagle3.errors import UserError
from eagle3.io.http import HTTPFailure, request_json, root_error

log = logging.getLogger(__name__)


class AllEndpointsDown(UserError):
    """Every endpoint has been out of rotation for longer than the pool's ``give_up_after_s``."""


class RequestFailed(Exception):
    """One request failed for good (not retryable, or out of attempts). ``attempts``: attempts made."""

    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


@dataclass
class Endpoint:
    """One server base URL and its health bookkeeping (guarded by the pool's lock)."""

    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    dead_until: float = 0.0  # monotonic time before which the endpoint is out of rotation
    probing: bool = False  # a probe request after a dead spell is in flight
    last_used: float = 0.0
    requests: int = 0
    failures: int = 0
    taken_out: int = 0  # how many times it left the rotation
    last_error: Optional[str] = None  # the error of its last failed attempt

    def summary(self) -> dict:
        return {
            "url": self.url,
            "requests": self.requests,
            "failed_attempts": self.failures,
            "taken_out_of_rotation": self.taken_out,
        }


@dataclass
class RetryPolicy:
    """Attempts per request and the exponential backoff between them (seconds)."""

    max_attempts: int = 5
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): ``backoff_s * 2**(attempt-1)``, capped, +-25%."""
        base = min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1)))
        return base * (0.75 + 0.5 * self.rng.random())


class EndpointPool:
    """Thread-safe choice of an endpoint for each request (module docstring).

    Args:
        urls: server base URLs, at least one, each ``http(s)://host[:port]`` (the config's ``check_http_url``, 02's
            ``--server`` type ``http_url``, 01's refusal of empty ``prompts.server.urls``), no duplicates.
        per_endpoint: requests in flight per endpoint (>= 1).
        dead_after: consecutive failed attempts that take an endpoint out (>= 1).
        revive_after_s, give_up_after_s: seconds out before a probe; seconds all out before giving up.
        headers: extra HTTP headers (e.g. ``Authorization``). what: config key named in errors.

    Raises:
        UserError: a duplicate URL.
    """

    def __init__(
        self,
        urls: list[str],
        per_endpoint: int = 8,
        dead_after: int = 3,
        revive_after_s: float = 30.0,
        give_up_after_s: float = 300.0,
        headers: Optional[dict] = None,
        what: str = "prompts.server.urls",
    ):
        clean = [u.rstrip("/") for u in urls]
        if len(set(clean)) != len(clean):
            raise UserError(f"{what}: duplicate URL in {clean}")
        self.endpoints = [Endpoint(u) for u in clean]
        self.per_endpoint = per_endpoint
        self.dead_after = dead_after
        self.revive_after_s = revive_after_s
        self.give_up_after_s = give_up_after_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.what = what
        self._cv = threading.Condition()
        self._all_dead_since: Optional[float] = None

    @property
    def capacity(self) -> int:
        """Requests in flight over all endpoints at most."""
        return self.per_endpoint * len(self.endpoints)

    def _usable(self, ep: Endpoint, now: float) -> bool:
        revived = ep.consecutive_failures >= self.dead_after  # one probe at a time
        return (
            ep.in_flight < self.per_endpoint
            and ep.dead_until <= now
            and not (revived and ep.probing)
        )

    def acquire(self, avoid: Optional[Endpoint] = None) -> Endpoint:
        """Block until an endpoint has a free slot (preferring one other than ``avoid``); slot taken.

        Raises:
            AllEndpointsDown: every endpoint out of rotation for ``give_up_after_s`` (:meth:`check_up`).
        """
        with self._cv:
            while True:
                now = time.monotonic()
                self._check_up(now)
                usable = [e for e in self.endpoints if self._usable(e, now)]
                if avoid is not None and len(usable) > 1:
                    usable = [e for e in usable if e is not avoid] or usable
                if usable:
                    ep = min(usable, key=lambda e: (e.in_flight, e.last_used))
                    ep.in_flight += 1
                    ep.requests += 1
                    ep.last_used = now
                    if ep.consecutive_failures >= self.dead_after:
                        ep.probing = True
                    return ep
                wake = [e.dead_until - now for e in self.endpoints if e.dead_until > now]
                self._cv.wait(timeout=min(wake + [1.0]))

    def check_up(self) -> None:
        """Raise :class:`AllEndpointsDown` (:meth:`all_down_message`) when every endpoint has been out of rotation
        for ``give_up_after_s`` (0: as soon as the last one goes out)."""
        with self._cv:
            self._check_up(time.monotonic())

    def _check_up(self, now: float) -> None:
        # a revived endpoint whose probe fails again has not been back: only a success resets the clock
        if any(e.consecutive_failures < self.dead_after for e in self.endpoints):
            self._all_dead_since = None
            return
        if self._all_dead_since is None:
            self._all_dead_since = now
        if now - self._all_dead_since >= self.give_up_after_s:
            raise AllEndpointsDown(self.all_down_message())

    def all_down_message(self) -> str:
        """The one line :class:`AllEndpointsDown` says: the endpoints, how long they were out, what is kept."""
        return (
            f"{self.what}: every endpoint failed {self.dead_after} requests in a row and stayed "
            f"unreachable for {self.give_up_after_s:.0f} s ({', '.join(e.url for e in self.endpoints)}); "
            "finished answers are kept, rerun the same command to resume"
        )

    def release(self, ep: Endpoint, ok: bool, error: str = "") -> None:
        """Give back ``ep``'s slot and record whether the attempt succeeded."""
        with self._cv:
            ep.in_flight -= 1
            ep.probing = False
            if ok:
                if ep.consecutive_failures >= self.dead_after:
                    log.warning("endpoint %s is back in rotation", ep.url)
                ep.consecutive_failures = 0
            else:
                ep.failures += 1
                ep.consecutive_failures += 1
                ep.last_error = error
                if ep.consecutive_failures == self.dead_after:
                    ep.taken_out += 1
                    spell = (
                        "for the rest of the run"
                        if self.revive_after_s == float("inf")
                        else f"for {self.revive_after_s:.0f} s"
                    )
                    log.warning(
                        "endpoint %s taken out of rotation %s after %d failures in a row: %s",
                        ep.url,
                        spell,
                        ep.consecutive_failures,
                        error,
                    )
                if ep.consecutive_failures >= self.dead_after:  # (again, after a failed probe)
                    ep.dead_until = time.monotonic() + self.revive_after_s
            self._cv.notify_all()

    def preflight(self, timeout: float = 10.0, path: str = "/health") -> list[str]:
        """GET ``path`` on every endpoint once (any HTTP answer counts as reachable); unreachable
        ones start out of rotation. Returns their URLs.

        Raises:
            UserError: no endpoint answers (each URL and its error).
        """
        bad: dict[str, str] = {}
        for ep in self.endpoints:
            try:
                requests.get(ep.url + path, timeout=timeout, headers=self.headers)
            except requests.RequestException as e:
                root = root_error(e)
                bad[ep.url] = f"{type(root).__name__}: {root}"
        if len(bad) == len(self.endpoints):
            raise UserError(
                f"{self.what}: no endpoint answers ("
                + "; ".join(f"{u}: {m}" for u, m in bad.items())
                + ")"
            )
        with self._cv:
            for ep in self.endpoints:
                if ep.url in bad:
                    log.warning(
                        "endpoint %s does not answer (%s); out of rotation for %.0f s",
                        ep.url,
                        bad[ep.url],
                        self.revive_after_s,
                    )
                    ep.consecutive_failures = self.dead_after
                    ep.taken_out += 1
                    ep.dead_until = time.monotonic() + self.revive_after_s
        return list(bad)

    def post(
        self, path: str, payload: dict, timeout: float, policy: RetryPolicy, check=None
    ) -> tuple[Any, int]:
        """POST ``payload`` as JSON to ``path`` on some endpoint, retrying per ``policy``.

        Args:
            timeout: seconds per attempt. check: optional ``check(response) -> parsed``; a
                ``ValueError`` from it is a retryable failed attempt.

        Returns:
            ``(check(response) or response, attempts used)``.

        Raises:
            RequestFailed: out of attempts, or a non-retryable status. AllEndpointsDown: see :meth:`acquire`.
        """
        last: Optional[Endpoint] = None
        for attempt in range(1, policy.max_attempts + 1):
            ep = self.acquire(avoid=last)
            try:
                out = request_json(
                    ep.url + path, payload, timeout, unreachable="", headers=self.headers
                )
                if check is not None:
                    try:
                        out = check(out)
                    except ValueError as e:
                        raise HTTPFailure(f"{ep.url}{path}: {e}", retryable=True) from e
            except HTTPFailure as e:
                # a 4xx other than 408/429 says the request is bad, not the endpoint
                self.release(ep, ok=not e.retryable, error=str(e))
                if not e.retryable or attempt == policy.max_attempts:
                    raise RequestFailed(str(e), attempt) from e
                log.info("attempt %d/%d failed (%s); retrying", attempt, policy.max_attempts, e)
                last = ep
                time.sleep(policy.delay(attempt))
                continue
            self.release(ep, ok=True)
            return out, attempt
        raise AssertionError("unreachable")

    def summary(self) -> list[dict]:
        """Per endpoint: URL, requests sent, failed attempts, times taken out of rotation."""
        with self._cv:
            return [e.summary() for e in self.endpoints]
