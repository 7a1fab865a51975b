"""JSON (and text) over HTTP (``requests``): one call, one connection, every failure one :class:`HTTPFailure`."""

from __future__ import annotations

from typing import Any, Optional

import requests

from eagle3.errors import UserError


class HTTPFailure(UserError):
    """A failed request; ``retryable``: a transport error, HTTP 5xx/408/429 or a non-JSON body."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def root_error(e: BaseException) -> BaseException:
    """The innermost cause of ``e`` (e.g. ``ConnectionRefusedError`` under requests' wrappers)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    return e


def request_json(
    url: str,
    payload: Optional[dict] = None,
    timeout: float = 600.0,
    where: Optional[str] = None,
    unreachable: str = "server not reachable",
    headers: Optional[dict] = None,
) -> Any:
    """GET (``payload`` None) or POST ``payload`` as JSON to ``url``; the decoded JSON body.

    Raises:
        HTTPFailure: ``"{where}: HTTP {status}: {body's first line}"``, ``"{where}: {unreachable}:
            {root error type}: {reason}"`` (``unreachable`` empty: no such word) or ``"{where}: response is not JSON: {body start}"``;
            ``where`` defaults to ``url``.
    """
    where = where or url
    r = _request(url, payload, timeout, where, unreachable, headers)
    try:
        return r.json()
    except ValueError as e:
        raise HTTPFailure(f"{where}: response is not JSON: {r.content[:120]!r}", True) from e


def request_text(
    url: str,
    timeout: float = 600.0,
    where: Optional[str] = None,
    unreachable: str = "server not reachable",
) -> str:
    """GET ``url``; the body as text (e.g. a Prometheus ``/metrics`` page).

    Raises:
        HTTPFailure: as :func:`request_json`, bar the JSON line.
    """
    return _request(url, None, timeout, where or url, unreachable, None).text


def _request(url, payload, timeout, where, unreachable, headers) -> requests.Response:
    """GET (``payload`` None) or POST JSON; the response of status < 400, else :class:`HTTPFailure`."""
    lead = f"{where}: {unreachable}: " if unreachable else f"{where}: "
    method = "GET" if payload is None else "POST"
    try:
        r = requests.request(method, url, json=payload, timeout=timeout, headers=headers)
    except requests.RequestException as e:
        root = root_error(e)
        raise HTTPFailure(f"{lead}{type(root).__name__}: {root}", True) from e
    if r.status_code >= 400:
        lines = r.text.strip().splitlines()
        raise HTTPFailure(
            f"{where}: HTTP {r.status_code}: {lines[0][:300] if lines else r.reason}",
            r.status_code >= 500 or r.status_code in (408, 429),
        )
    return r
