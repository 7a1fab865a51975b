"""A running vLLM EAGLE-3 server over HTTP (vLLM 0.32's OpenAI server): its settings, its spec-decode counters at
``GET {url}/metrics`` (``v1/spec_decode/metrics.py``: drafts, draft tokens, accepted tokens, accepted per position)
and greedy ``/v1/completions`` requests, for :func:`eagle3.decoding.server.bench_server`.

tau = 1 + accepted / drafts (vLLM's mean acceptance length); the counters cover every request the server ran, so a
delta around a run counts another client's requests too (:func:`vllm_figures` warns when the counts say so).
"""

from __future__ import annotations

import re
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from eagle3.decoding.metrics import rates_from_hist
from eagle3.errors import UserError
from eagle3.io.http import request_json, request_text


def http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    """:func:`eagle3.io.http.request_json` with errors named ``server {url}``."""
    return request_json(url, payload, timeout, where=f"server {url}", unreachable="cannot connect")


class _Counts(BaseModel):
    """The token count an engine's completion answer carries (its other keys kept as sent)."""

    model_config = ConfigDict(extra="allow")
    completion_tokens: StrictInt


class SGLangAnswer(BaseModel):
    """SGLang's ``/generate`` answer, as far as the benchmark reads it: ``meta_info.completion_tokens``."""

    model_config = ConfigDict(extra="allow")
    meta_info: _Counts


class VLLMAnswer(BaseModel):
    """vLLM's ``/v1/completions`` answer, as far as the benchmark reads it: ``usage.completion_tokens`` and at least
    one choice."""

    model_config = ConfigDict(extra="allow")
    usage: _Counts
    choices: list[dict[str, Any]] = Field(min_length=1)


def require_answer(out: Any, model: type[BaseModel], where: str, needs: str, engine: str) -> None:
    """The one refusal of a completion answer ``out`` that is not a ``model`` (:class:`SGLangAnswer`,
    :class:`VLLMAnswer`).

    Raises:
        UserError: ``<where> response has no <needs> (is this <engine>?)``; ``where``: ``server <url>: <endpoint>``.
    """
    try:
        model.model_validate(out)
    except ValidationError:
        raise UserError(f"{where} response has no {needs} (is this {engine}?)") from None


#: vLLM's spec-decode counters as ``/metrics`` names them (vLLM 0.32 ``v1/spec_decode/metrics.py``; a Prometheus
#: counter ``x`` is exposed as ``x_total``), and the key :func:`vllm_counters` gives each.
VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
#: one series per draft position (label ``position``, 0 .. num_speculative_tokens - 1)
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


#: a vLLM request's own counts (:func:`_counted`, one request in flight): ``per_request`` keys
VLLM_REQUEST_KEYS = ("verify_steps", "accepted_drafts", "accepted_per_pos")


def vllm_server_info(url: str, timeout: float = 30.0) -> dict:
    """A vLLM server's settings: ``engine`` ``"vllm"``, ``model_path`` (``/v1/models`` ``root``), ``version``
    (``/version``); ``speculative_algorithm``, ``speculative_draft_model_path``, ``speculative_num_steps`` from its
    ``speculative_config`` (``method``, ``model``, ``num_speculative_tokens``) when ``GET
    {url}/server_info?config_format=json`` answers (vLLM serves it only with ``VLLM_SERVER_DEV_MODE=1``;
    ``server_info`` True then), else ``speculative_num_steps`` from the number of per-position counters at
    ``/metrics`` (``steps_from`` names the endpoint; absent when neither says)."""
    base = url.rstrip("/")
    info: dict = {"engine": "vllm", "server_info": False}
    try:
        cards = http_json(base + "/v1/models", timeout=timeout).get("data") or [{}]
        info["model_path"] = cards[0].get("root") or cards[0].get("id")
    except (UserError, AttributeError, IndexError):
        pass
    try:
        info["version"] = http_json(base + "/version", timeout=timeout).get("version")
    except (UserError, AttributeError):
        pass
    try:
        full = http_json(base + "/server_info?config_format=json", timeout=timeout)
        spec = full["vllm_config"].get("speculative_config") or {}
    except (UserError, KeyError, TypeError, AttributeError):
        spec = None
    if isinstance(spec, dict):
        info.update(
            server_info=True,
            speculative_algorithm=spec.get("method"),
            speculative_draft_model_path=spec.get("model"),
            speculative_num_steps=spec.get("num_speculative_tokens"),
            steps_from="/server_info",
        )
        return info
    try:
        steps = len(vllm_counters(url, timeout)["accepted_per_pos"])
    except UserError:  # /metrics closed: the steps stay unknown
        steps = 0
    if steps:
        info.update(speculative_num_steps=steps, steps_from="/metrics")
    return info


def vllm_counters(url: str, timeout: float = 30.0) -> dict:
    """vLLM's spec-decode counters now (``GET {url}/metrics``), summed over engines and models: ``present`` (the server
    exposes them: it speculates and logs stats), ``drafts``, ``draft_tokens``, ``accepted`` (ints) and
    ``accepted_per_pos`` (one int per draft position).

    Raises:
        UserError: ``/metrics`` cannot be read.
    """
    text = request_text(
        url.rstrip("/") + "/metrics", timeout, where=f"server {url}", unreachable="cannot connect"
    )
    out: dict = {"present": False, **{k: 0 for k in VLLM_COUNTERS.values()}}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name in VLLM_COUNTERS:
            out["present"] = True
            out[VLLM_COUNTERS[name]] += int(float(value))
        elif name == VLLM_PER_POS:
            pos = _POSITION.search(labels or "")
            if pos is not None:
                k = int(pos.group(1))
                per_pos[k] = per_pos.get(k, 0) + int(float(value))
    out["accepted_per_pos"] = (
        [per_pos.get(k, 0) for k in range(max(per_pos) + 1)] if per_pos else []
    )
    return out


def counters_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two :func:`vllm_counters` readings (``present`` from ``after``)."""
    out = {k: after[k] - before[k] for k in VLLM_COUNTERS.values()}
    prior = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prior)]
    return {"present": after["present"], **out}


def vllm_generate(
    url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0
) -> dict:
    """One greedy ``/v1/completions`` request to vLLM (the prompt as token ids); the shape of :func:`generate`:
    ``{output_ids, text, meta_info: {completion_tokens, finish_reason}, seconds}``.

    Raises:
        UserError: transport errors or no ``usage.completion_tokens`` in the response.
    """
    payload = {
        "prompt": list(input_ids),
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    out = http_json(url.rstrip("/") + "/v1/completions", payload, timeout)
    seconds = time.perf_counter() - t0
    where = f"server {url}: /v1/completions"
    require_answer(out, VLLMAnswer, where, "usage.completion_tokens or choices", "vLLM")
    choice = out["choices"][0]
    meta = {
        "completion_tokens": out["usage"]["completion_tokens"],
        "finish_reason": choice.get("finish_reason"),
    }
    return {
        "output_ids": choice.get("token_ids"),
        "text": choice.get("text"),
        "meta_info": meta,
        "seconds": seconds,
    }


def counted(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
    """:func:`vllm_generate` with the request's own counts in its ``meta_info`` (:data:`VLLM_REQUEST_KEYS`): the
    counter deltas around it, exact while it is the only request in flight (vLLM 0.32's ``AsyncLLM`` records a
    step's stats before the HTTP answer can go out)."""
    before = vllm_counters(url)
    out = vllm_generate(url, input_ids, max_new_tokens, timeout)
    d = counters_delta(before, vllm_counters(url))
    if d["present"]:
        out["meta_info"].update(
            verify_steps=d["drafts"],
            accepted_drafts=d["accepted"],
            accepted_per_pos=d["accepted_per_pos"],
        )
    return out


def vllm_figures(delta: dict) -> dict:
    """The EAGLE-3 figures of :func:`bench_server` from vLLM's counter deltas (:func:`counters_delta`) of a run that
    drafted: ``steps`` = its draft positions (``num_speculative_tokens``), ``verify_steps`` = drafts, ``tau`` = 1 +
    accepted / drafts, ``accepted_hist`` from the per-position counts (chain drafting: a step that accepted position
    k accepted every position before it)."""
    drafts, per_pos = delta["drafts"], delta["accepted_per_pos"]
    steps = len(per_pos)
    reach = [drafts, *per_pos, 0]  # reach[a]: verify steps that accepted >= a drafts
    hist = [reach[a] - reach[a + 1] for a in range(steps + 1)]
    return {
        "steps": steps,
        "verify_steps": drafts,
        "tau": 1 + delta["accepted"] / drafts,
        "accepted_drafts": delta["accepted"],
        "draft_tokens": delta["draft_tokens"],
        "accepted_per_pos": per_pos,
        "accepted_hist": hist,
        **rates_from_hist(hist, steps),
    }


def vllm_run_figures(url: str, before: dict, emitted: int) -> tuple[dict, list[str]]:
    """The EAGLE-3 figures of a run from the counters now against ``before`` (:func:`vllm_counters` after the
    warm-up): :func:`vllm_figures`, or ``{}`` when the server drafted nothing; a warning when it counted more verify
    steps than the run's requests ``emitted`` tokens after their first (each verify step emits >= 1 token)."""
    delta = counters_delta(before, vllm_counters(url))
    if not (delta["present"] and delta["drafts"] > 0):
        return {}, []
    warnings = []
    if delta["drafts"] > emitted:
        warnings.append(
            f"{url}/metrics counted {delta['drafts']} verify steps while this run's requests emitted {emitted} "
            f"tokens after their first: another client's requests ran on the server meanwhile and their drafts "
            f"are in tau; benchmark a server no one else uses"
        )
    return vllm_figures(delta), warnings
