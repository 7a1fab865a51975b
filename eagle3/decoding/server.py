"""Benchmark a running SGLang server started with ``--speculative-algorithm EAGLE3`` (HTTP, stdlib only).

Each prompt is chat-rendered locally (:func:`eagle3.chat.template.prompt_ids`, same template and kwargs as training) and sent
as ``input_ids`` to ``POST {url}/generate`` with ``sampling_params {temperature: 0, max_new_tokens}``.

Response shape (SGLang 0.5.23, ``srt/managers/tokenizer_manager.py`` ``_handle_batch_output`` and
``_calculate_spec_decoding_metrics``; non-streaming)::

    {"text": str, "output_ids": [int], "meta_info": {
        "id", "finish_reason": {"type": "length"|"stop", ...}, "prompt_tokens", "completion_tokens",
        "cached_tokens", "reasoning_tokens", "e2e_latency",
        # only with speculative decoding and at least one verify step:
        "spec_verify_ct",                  # verify forwards of this request
        "spec_accept_length",              # completion_tokens / spec_verify_ct (incl. bonus token)
        "spec_accept_rate",                # spec_num_correct_drafts / spec_num_proposed_drafts
        "spec_num_correct_drafts", "spec_num_proposed_drafts",
        "spec_correct_drafts_histogram"}}  # [a] = verify steps that accepted exactly a drafts

SGLang counts ``spec_correct_drafts_histogram`` (and ``spec_num_correct_drafts``) per verify step
BEFORE the output is cut at EOS / ``max_new_tokens`` (``_resolve_spec_overlap_token_ids`` adds the
accepted count, ``check_finished`` then trims ``output_ids``), while ``completion_tokens`` counts
only what was emitted. Counted as reported, a drafter proposing the verifier's own tokens at 3
steps with ``max_new_tokens`` 10 gives histogram ``[0, 0, 0, 3]`` (12 tokens) for 9 tokens emitted
by the verify steps. :func:`emitted_histogram` moves each request's last step down to what it
emitted, so every metric here counts emitted tokens only, exactly as the offline benchmark does.

Metrics (pooled over requests, same definitions as :func:`eagle3.decoding.metrics.acceptance_stats`):
``tau`` = tokens emitted by verify steps (``completion_tokens - 1`` per request: the first token
comes from the prefill) / ``spec_verify_ct`` = 1 + sum of the unconditional per-position rates of the
emitted histogram; ``sglang_accept_length`` = sum(completion_tokens) / sum(spec_verify_ct), SGLang's
own figure (prefill token included); output tokens/s = sum(completion_tokens) / wall seconds
of the whole set (client clock, ``concurrency`` requests in flight). With two URLs the second is the
baseline server (no speculation): speedup = tokens/s ratio, and the greedy outputs are compared.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from eagle3.decoding.metrics import rates_from_hist, speedup_warning
from eagle3.decoding.report import write_server_reports
from eagle3.errors import UserError
from eagle3.io import json_error_detail, read_json

log = logging.getLogger(__name__)


SPEC_KEYS = (
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
)


INFO_KEYS = (
    "model_path",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "dtype",
    "tp_size",
)


def _http(url: str, payload: Optional[dict] = None, timeout: float = 600.0) -> dict:
    """GET (payload None) or POST JSON to ``url``; return the decoded JSON object.

    Raises:
        UserError: connection failure, HTTP error status (with the body's first 200 chars), non-JSON body.
    """
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method="GET" if data is None else "POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        snippet = " ".join(e.read().decode("utf-8", "replace").split())[:200]
        raise UserError(f"server {url}: HTTP {e.code}: {snippet}") from e
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"server {url}: cannot connect: {getattr(e, 'reason', e)}") from e
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise UserError(f"server {url}: response is not JSON: {json_error_detail(e)}") from e


def server_info(url: str, timeout: float = 30.0) -> dict:
    """Selected fields of ``GET {url}/server_info`` (``{}`` when the endpoint is unavailable)."""
    try:
        info = _http(url.rstrip("/") + "/server_info", timeout=timeout)
    except UserError:
        return {}
    return {k: info[k] for k in INFO_KEYS if isinstance(info, dict) and k in info}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy ``/generate`` request; returns ``{output_ids, text, meta_info, seconds}``.

    Raises:
        UserError: transport errors (see :func:`_http`) or a response without ``meta_info.completion_tokens``.
    """
    payload = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
    }
    t0 = time.perf_counter()
    out = _http(url.rstrip("/") + "/generate", payload, timeout)
    seconds = time.perf_counter() - t0
    if isinstance(out, list):  # a batched answer for a single prompt: take the first
        out = out[0] if out else {}
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("completion_tokens"), int):
        raise UserError(
            f"server {url}: /generate response has no meta_info.completion_tokens (is this SGLang?)"
        )
    return {
        "output_ids": out.get("output_ids"),
        "text": out.get("text"),
        "meta_info": meta,
        "seconds": seconds,
    }


def emitted_histogram(
    hist: Sequence[int], completion_tokens: int, verify_ct: int
) -> tuple[list[int], str]:
    """One request's accepted-drafts histogram restricted to the tokens it emitted.

    SGLang records each verify step's accepted drafts before the cut at EOS / ``max_new_tokens``,
    so the last step of a request may be counted with ``a`` accepted drafts although only
    ``e < a + 1`` of its tokens were emitted. The tokens emitted by verify steps are
    ``completion_tokens - 1`` (the first comes from the prefill); the histogram implies
    ``sum((a + 1) * hist[a])``; the excess ``x`` belongs to the last step, which is moved from bucket
    ``a`` to ``a - x``. ``a >= x`` is all the histogram says about ``a``: when several populated
    buckets qualify, the most populated one is taken (largest ``a`` on a tie); this changes which
    draft position loses one count, never the emitted total or tau.

    Args:
        hist: ``spec_correct_drafts_histogram`` of one request (``hist[a]`` = steps with ``a`` accepted drafts).
        completion_tokens: the request's ``completion_tokens`` (emitted, incl. the prefill token).
        verify_ct: the request's ``spec_verify_ct``.

    Returns:
        ``(hist, status)``: the emitted histogram (same length as ``hist``) and ``"exact"`` (nothing
        to move, or one possible bucket), ``"ambiguous"`` (several buckets qualified) or
        ``"inconsistent"`` (the histogram implies fewer tokens than emitted, or no bucket can hold
        the excess; returned unchanged).
    """
    h = [int(c) for c in hist]
    emitted = max(0, completion_tokens - 1) if verify_ct > 0 else 0
    excess = sum((a + 1) * c for a, c in enumerate(h)) - emitted
    if excess == 0:
        return h, "exact"
    cands = [a for a, c in enumerate(h) if c > 0 and a >= excess]
    if excess < 0 or not cands:
        return h, "inconsistent"
    a = max(cands, key=lambda b: (h[b], b))
    h[a] -= 1
    h[a - excess] += 1
    return h, "exact" if len(cands) == 1 else "ambiguous"


def bench_server(
    url: str,
    prompts_ids: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    concurrency: int = 1,
    timeout: float = 600.0,
    label: str = "",
    progress: bool = True,
) -> dict:
    """Send every prompt to one server (``concurrency`` in flight) after one untimed warm-up request.

    Returns:
        dict: ``url``, ``server_info``, ``num_prompts``, ``completion_tokens``, ``wall_seconds``,
        ``output_tokens_per_s``, ``mean_request_tokens_per_s``, ``speculative`` (bool), and when
        speculative: ``verify_steps``, ``tau`` (emitted tokens only, see the module docstring),
        ``sglang_accept_length`` (SGLang's pooled completion_tokens / verify steps),
        ``mean_spec_accept_length`` (mean of per-request meta_info values), ``accepted_hist`` (emitted,
        :func:`emitted_histogram`), ``reported_accepted_hist`` (as SGLang counted it),
        ``histogram_trims`` (requests per :func:`emitted_histogram` status), ``conditional``,
        ``unconditional``; ``per_request``.

    Raises:
        UserError: the server cannot be reached or answers malformed responses.
    """
    if concurrency < 1:
        raise UserError(f"--concurrency: must be >= 1, got {concurrency}")
    info = server_info(url)
    generate(url, prompts_ids[0][1], min(8, max_new_tokens), timeout)  # warm-up
    results, wall = _send_all(
        url, prompts_ids, max_new_tokens, concurrency, timeout, label, progress
    )
    t = _tally_requests(prompts_ids, results)
    tokens, verify, per_req = t["tokens"], t["verify"], t["per_req"]
    if t["trims"]["inconsistent"]:
        log.warning(
            "%s: %d requests report a draft histogram that does not match completion_tokens - 1; "
            "used as reported",
            url,
            t["trims"]["inconsistent"],
        )
    res = {
        "url": url,
        "dataset": label,
        "server_info": info,
        "num_prompts": len(prompts_ids),
        "concurrency": concurrency,
        "completion_tokens": tokens,
        "wall_seconds": wall,
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "mean_request_tokens_per_s": sum(
            p["completion_tokens"] / p["seconds"] for p in per_req if p["seconds"] > 0
        )
        / len(per_req),
        "speculative": verify > 0,
    }
    if verify > 0:
        res.update(_spec_figures(info, t))
    res["per_request"] = per_req
    return res


def _spec_figures(info: dict, t: dict) -> dict:
    """The EAGLE-3 figures of :func:`bench_server` from the pooled tally ``t`` (:func:`_tally_requests`) of a server
    that ran verify steps; the chain length is ``info``'s ``speculative_num_steps`` (an integer >= 1), else the
    histogram's length."""
    tokens, verify, hist = t["tokens"], t["verify"], t["hist"]
    steps = info.get("speculative_num_steps")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        steps = max(1, len(hist) - 1)
    accept_lengths = t["accept_lengths"]
    return {
        "steps": steps,
        "verify_steps": verify,
        "tau": t["verify_tokens"] / verify,
        "sglang_accept_length": tokens / verify,
        "mean_spec_accept_length": sum(accept_lengths) / len(accept_lengths)
        if accept_lengths
        else float("nan"),
        "accepted_hist": hist,
        "reported_accepted_hist": t["raw_hist"],
        "histogram_trims": t["trims"],
        **rates_from_hist(hist, steps),
    }


def _send_all(
    url: str,
    prompts_ids: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    concurrency: int,
    timeout: float,
    label: str,
    progress: bool,
) -> tuple[list[dict], float]:
    """Every prompt through :func:`generate`, ``concurrency`` in flight; ``(responses in prompt order, wall seconds)``."""
    results: list[Optional[dict]] = [None] * len(prompts_ids)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futs = {
            pool.submit(generate, url, ids, max_new_tokens, timeout): i
            for i, (_, ids) in enumerate(prompts_ids)
        }
        bar = tqdm(total=len(futs), desc=f"server {label or url}", unit="req", disable=not progress)
        for fut, i in futs.items():
            results[i] = fut.result()
            bar.update(1)
        bar.close()
    return results, time.perf_counter() - t0


def _tally_requests(prompts_ids: Sequence[tuple[str, list[int]]], results: list[dict]) -> dict:
    """Per-request rows and the pooled figures of the responses' ``meta_info``.

    Returns:
        dict: ``per_req`` (rows), ``tokens`` (completion tokens), ``verify`` (verify steps), ``verify_tokens``
        (completion tokens of speculative requests minus their prefill token), ``accept_lengths``
        (``spec_accept_length`` values), ``hist`` (emitted, :func:`emitted_histogram`), ``raw_hist`` (as
        reported), ``trims`` (requests per :func:`emitted_histogram` status).
    """
    per_req, hist, raw_hist = [], [], []
    tokens = verify = verify_tokens = 0
    accept_lengths = []
    trims = {"exact": 0, "ambiguous": 0, "inconsistent": 0}

    def add(into: list, h):
        for a, c in enumerate(h):
            into += [0] * (a + 1 - len(into))
            into[a] += c

    for (pid, ids), r in zip(prompts_ids, results):
        m = r["meta_info"]
        tokens += m["completion_tokens"]
        row = {
            "id": pid,
            "prompt_tokens": len(ids),
            "completion_tokens": m["completion_tokens"],
            "seconds": r["seconds"],
            "output_ids": r["output_ids"],
        }
        row.update({k: m[k] for k in SPEC_KEYS if k in m})
        vct = int(m.get("spec_verify_ct") or 0)
        if vct > 0:
            verify += vct
            verify_tokens += m["completion_tokens"] - 1  # the first token comes from the prefill
        if "spec_accept_length" in m:
            accept_lengths.append(m["spec_accept_length"])
        raw = m.get("spec_correct_drafts_histogram") or []
        if raw:
            emitted, status = emitted_histogram(raw, m["completion_tokens"], vct)
            trims[status] += 1
            row["emitted_histogram"] = emitted
            add(raw_hist, raw)
            add(hist, emitted)
        per_req.append(row)
    return {
        "per_req": per_req,
        "tokens": tokens,
        "verify": verify,
        "verify_tokens": verify_tokens,
        "accept_lengths": accept_lengths,
        "hist": hist,
        "raw_hist": raw_hist,
        "trims": trims,
    }


def run_server_bench(
    urls: Sequence[str],
    prompts_ids: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    concurrency: int = 1,
    dataset: str = "mtbench",
    timeout: float = 600.0,
    out_dir: Optional[str | Path] = None,
    progress: bool = True,
    extra: Optional[dict] = None,
) -> dict:
    """Benchmark one speculative server (``urls[0]``) and optionally a baseline server (``urls[1]``).

    Writes ``server_bench.json``, ``server_bench.md`` and (when speculative) ``server_acceptance.png``
    into ``out_dir`` atomically. ``extra`` keys go into the report as they are (05: ``prompt_pick``, ``prompt_ids``,
    ``warnings``: the subset's, shown in the Markdown too).

    Returns:
        the report: ``servers`` (list of :func:`bench_server` results) and, with two URLs,
        ``speedup`` (tokens/s of server 1 / server 2) and ``identical_outputs`` (prompts whose
        ``output_ids`` agree); a speedup above tau (:func:`eagle3.decoding.metrics.speedup_warning`) adds a line to
        ``warnings`` (logged too).

    Raises:
        UserError: no URL or more than two, no prompts, server errors.
    """
    if not 1 <= len(urls) <= 2:
        raise UserError(
            f"--server / benchmark.server_urls: expected 1 or 2 URLs (speculative, then baseline), got {len(urls)}"
        )
    if not prompts_ids:
        raise UserError(f"dataset {dataset}: no prompts")
    servers = [
        bench_server(
            u, prompts_ids, max_new_tokens, concurrency, timeout, f"{dataset} @ {u}", progress
        )
        for u in urls
    ]
    report = {
        "dataset": dataset,
        "num_prompts": len(prompts_ids),
        "max_new_tokens": max_new_tokens,
        "concurrency": concurrency,
        **(extra or {}),
        "servers": servers,
    }
    if not servers[0]["speculative"]:
        log.warning(
            "server %s reported no spec_verify_ct: was it started with --speculative-algorithm EAGLE3?",
            urls[0],
        )
    if len(servers) == 2:
        _compare_servers(report, *servers)
    if out_dir is not None:
        write_server_reports(Path(out_dir), report, urls[0])
    return report


def _compare_servers(report: dict, a: dict, b: dict) -> None:
    """Add ``speedup`` (tokens/s of server ``a`` / server ``b``) and ``identical_outputs`` to ``report``; a speedup
    tau cannot give (the baseline server was slowed or runs on other hardware) adds a logged warning line."""
    report["speedup"] = (
        a["output_tokens_per_s"] / b["output_tokens_per_s"]
        if b["output_tokens_per_s"]
        else float("nan")
    )
    report["identical_outputs"] = sum(
        x["output_ids"] == y["output_ids"] for x, y in zip(a["per_request"], b["per_request"])
    )
    dataset = report["dataset"]
    above = speedup_warning(
        dataset, report["speedup"], a.get("tau"), baseline="the baseline server"
    )
    if above:
        log.warning("%s", above)
        report["warnings"] = [*report.get("warnings", []), above]


def report_dirs(bench_dir: Path, labels: Sequence[str]) -> list[Path]:
    """Where :func:`run` writes each set's ``server_bench.json``: ``bench_dir`` for one set, else
    ``bench_dir/server-{label}`` ("/" in a label as "_")."""
    if len(labels) == 1:
        return [bench_dir]
    return [bench_dir / f"server-{label.replace('/', '_')}" for label in labels]


def stale_server_reports(bench_dir: Path, labels: Sequence[str]) -> list[str]:
    """Warnings for the server reports in ``bench_dir`` that a run on ``labels`` will not rewrite: a one-set run
    writes ``bench_dir/server_bench.json`` and leaves earlier ``server-*/`` folders, a several-set run writes
    ``server-{label}/`` and leaves an earlier top-level report (and other sets' folders). Each warning names the file
    and its set, so a reader does not take an earlier run's figures for this one's."""
    fresh = {d / "server_bench.json" for d in report_dirs(bench_dir, labels)}
    found = [bench_dir / "server_bench.json", *sorted(bench_dir.glob("server-*/server_bench.json"))]
    out = []
    for f in found:
        if f in fresh or not f.is_file():
            continue
        try:
            name = read_json(f).get("dataset", "?")
        except (UserError, AttributeError, ValueError, OSError):  # unreadable: still stale
            name = "?"
        out.append(
            f"{f}: a server report of an earlier run (set {name}), not rewritten by this one; this run writes "
            + ", ".join(str(p) for p in sorted(fresh))
        )
    return out


def served_model_path(url: str, timeout: float = 30.0) -> tuple[Optional[str], Optional[str]]:
    """The model an SGLang server serves: ``(model_path, endpoint)`` from ``GET {url}/server_info`` (its
    ``--model-path``), else ``GET {url}/model_info`` (SGLang 0.5.x), else ``/get_model_info`` (older);
    ``(None, None)`` when none names one (not SGLang, or the endpoints are closed)."""
    mp = server_info(url, timeout).get("model_path")
    if isinstance(mp, str) and mp:
        return mp, "/server_info"
    for endpoint in ("/model_info", "/get_model_info"):
        try:
            mi = _http(url.rstrip("/") + endpoint, timeout=timeout)
        except UserError:
            continue
        mp = mi.get("model_path") if isinstance(mi, dict) else None
        if isinstance(mp, str) and mp:
            return mp, endpoint
    return None, None
