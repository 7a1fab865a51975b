"""Benchmark a running SGLang server started with ``--speculative-algorithm EAGLE3`` (HTTP).

Each prompt is chat-rendered locally (:func:`eagle3.chat.template.prompt_ids`, as in training)
and sent as ``input_ids`` to ``POST {url}/generate`` (temperature 0). The response's
``meta_info`` (SGLang 0.5.23) carries ``completion_tokens`` and, with speculation,
``spec_verify_ct``, ``spec_accept_length`` and ``spec_correct_drafts_histogram`` (``[a]`` = verify
steps that accepted ``a`` drafts, counted before the cut at EOS / ``max_new_tokens``;
:func:`emitted_histogram` moves each request's last step down to what it emitted).

Metrics (pooled, as :func:`eagle3.decoding.metrics.acceptance_stats`): ``tau`` = tokens emitted by
verify steps (``completion_tokens - 1`` per request) / ``spec_verify_ct``; ``sglang_accept_length``
= sum(completion_tokens) / sum(spec_verify_ct) (SGLang's own); output tokens/s over the whole set.
With two URLs the second is the baseline: speedup = tokens/s ratio, greedy outputs compared.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from eagle3.decoding.metrics import rates_from_hist, speedup_warning
from eagle3.decoding.report import write_server_reports
from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.io.http import request_json

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
    """:func:`eagle3.io.http.request_json` with errors named ``server {url}``."""
    return request_json(url, payload, timeout, where=f"server {url}", unreachable="cannot connect")


def server_info(url: str, timeout: float = 30.0) -> dict:
    """Selected fields of ``GET {url}/server_info`` (``{}`` when the endpoint is unavailable)."""
    try:
        info = _http(url.rstrip("/") + "/server_info", timeout=timeout)
    except UserError:
        return {}
    return {k: info[k] for k in INFO_KEYS if isinstance(info, dict) and k in info}


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy ``/generate`` request; ``{output_ids, text, meta_info, seconds}``.

    Raises:
        UserError: transport errors or no ``meta_info.completion_tokens`` in the response.
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

    Verify steps emitted ``completion_tokens - 1`` tokens; the histogram implies
    ``sum((a + 1) * hist[a])``; the excess ``x`` is moved from the last step's bucket ``a`` to
    ``a - x`` (``a >= x``; several candidates: the most populated, largest ``a`` on a tie).

    Args:
        hist: ``spec_correct_drafts_histogram``; completion_tokens, verify_ct: the request's.

    Returns:
        ``(hist, status)``: status ``"exact"``, ``"ambiguous"`` (several buckets qualified) or
        ``"inconsistent"`` (returned unchanged).
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
    """Send every prompt to one server (``concurrency`` in flight) after one untimed warm-up.

    Returns:
        ``url``, ``server_info``, ``num_prompts``, ``completion_tokens``, ``wall_seconds``,
        ``output_tokens_per_s``, ``mean_request_tokens_per_s``, ``speculative``; when speculative
        also ``verify_steps``, ``tau``, ``sglang_accept_length``, ``mean_spec_accept_length``,
        ``accepted_hist`` (emitted), ``reported_accepted_hist``, ``histogram_trims``,
        ``conditional``, ``unconditional``; ``per_request``.

    Raises:
        UserError: the server cannot be reached or answers malformed responses.
    """
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
    """Per-request rows and pooled figures of the responses' ``meta_info``: ``per_req``, ``tokens``,
    ``verify``, ``verify_tokens``, ``accept_lengths``, ``hist`` (emitted), ``raw_hist``, ``trims``.
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
    """Benchmark a speculative server (``urls[0]``) and optionally a baseline (``urls[1]``); write
    ``server_bench.json``, ``.md`` and ``server_acceptance.png`` into ``out_dir`` (``extra`` keys as given).

    Returns:
        the report: ``servers`` (:func:`bench_server` results) and, with two URLs, ``speedup`` and
        ``identical_outputs``; a speedup above tau adds a line to ``warnings``.

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
