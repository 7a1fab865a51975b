"""Benchmark a running EAGLE-3 server over HTTP: SGLang (``--speculative-algorithm EAGLE3``) or vLLM
(``--speculative-config '{"method": "eagle3", ...}'``), told apart by :func:`detect_engine`.

Each prompt is chat-rendered locally (:func:`eagle3.chat.template.prompt_ids`, as in training) and sent as token ids,
greedy (temperature 0). SGLang: ``POST {url}/generate``; the response's ``meta_info`` (SGLang 0.5.23) carries
``completion_tokens`` and, with speculation, ``spec_verify_ct``, ``spec_accept_length`` and
``spec_correct_drafts_histogram`` (``[a]`` = verify steps that accepted ``a`` drafts, counted before the cut at EOS /
``max_new_tokens``; :func:`emitted_histogram` moves each request's last step down to what it emitted). vLLM:
``POST {url}/v1/completions`` (``prompt`` = ids, ``return_token_ids``); the figures are the deltas of its spec-decode
counters at ``GET {url}/metrics`` between the warm-up and the last request (:mod:`eagle3.decoding.server_vllm`).

Metrics (pooled, as :func:`eagle3.decoding.metrics.acceptance_stats`): ``tau`` = tokens emitted by verify steps /
verify steps (SGLang: ``completion_tokens - 1`` per request / ``spec_verify_ct``; vLLM: 1 + accepted / drafts, as
vLLM's docs define its mean acceptance length); ``sglang_accept_length`` = sum(completion_tokens) /
sum(spec_verify_ct) (SGLang's own); output tokens/s over the whole set. With two URLs the second is the baseline:
speedup = tokens/s ratio, greedy outputs compared.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from eagle3.decoding.metrics import rates_from_hist, speedup_warning
from eagle3.decoding.report import write_server_reports
from eagle3.decoding.server_vllm import (
    VLLM_REQUEST_KEYS,
    SGLangAnswer,
    counted,
    http_json,
    require_answer,
    vllm_counters,
    vllm_generate,
    vllm_run_figures,
    vllm_server_info,
)
from eagle3.errors import UserError
from eagle3.io import read_json

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


#: the line 05 --server logs when the first server ran no verify step, per engine
NOT_SPECULATIVE = {
    "sglang": "server {url} reported no spec_verify_ct: was it started with --speculative-algorithm EAGLE3?",
    "vllm": (
        "server {url} counted no drafts at /metrics (vllm:spec_decode_num_drafts): was it started with "
        '--speculative-config \'{{"method": "eagle3", ...}}\' and without --disable-log-stats?'
    ),
}


def detect_engine(url: str, timeout: float = 30.0) -> str:
    """The engine behind ``url``: ``"vllm"`` when ``GET {url}/v1/models`` lists a model ``owned_by: "vllm"`` (vLLM's
    OpenAI server; SGLang's cards say ``"sglang"``), else ``"sglang"`` (a server without that endpoint included:
    SGLang's ``/generate`` then says whether it is one)."""
    try:
        cards = http_json(url.rstrip("/") + "/v1/models", timeout=timeout)
    except UserError:
        return "sglang"
    data = cards.get("data") if isinstance(cards, dict) else None
    if isinstance(data, list) and any(
        isinstance(c, dict) and c.get("owned_by") == "vllm" for c in data
    ):
        return "vllm"
    return "sglang"


def server_info(url: str, timeout: float = 30.0, engine: Optional[str] = None) -> dict:
    """The server's settings under SGLang's ``/server_info`` names (:data:`INFO_KEYS`) and ``engine``.

    SGLang: the selected fields of ``GET {url}/server_info`` (``{}`` when the endpoint is unavailable). vLLM: as
    :func:`vllm_server_info`. ``engine``: the :func:`detect_engine` answer when known (asked for otherwise).
    """
    if (engine or detect_engine(url, timeout)) == "vllm":
        return vllm_server_info(url, timeout)
    try:
        info = http_json(url.rstrip("/") + "/server_info", timeout=timeout)
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
    out = http_json(url.rstrip("/") + "/generate", payload, timeout)
    seconds = time.perf_counter() - t0
    if isinstance(out, list):  # a batched answer for a single prompt: take the first
        out = out[0] if out else {}
    require_answer(
        out, SGLangAnswer, f"server {url}: /generate", "meta_info.completion_tokens", "SGLang"
    )
    return {
        "output_ids": out.get("output_ids"),
        "text": out.get("text"),
        "meta_info": out["meta_info"],
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
        ``url``, ``engine``, ``server_info``, ``num_prompts``, ``completion_tokens``, ``wall_seconds``, tokens/s,
        ``speculative``, ``warnings``, ``per_request``; when speculative, the figures of :func:`_spec_figures`
        (SGLang) or :func:`eagle3.decoding.server_vllm.vllm_figures` (vLLM; per request at concurrency 1).

    Raises:
        UserError: the server cannot be reached or answers malformed responses.
    """
    engine = detect_engine(url)
    info = server_info(url, engine=engine)
    vllm = engine == "vllm"
    send = (counted if concurrency == 1 else vllm_generate) if vllm else generate
    send(url, prompts_ids[0][1], min(8, max_new_tokens), timeout)  # warm-up
    before = vllm_counters(url) if vllm else None
    results, wall = _send_all(
        url, send, prompts_ids, max_new_tokens, concurrency, timeout, label, progress
    )
    t = _tally_requests(prompts_ids, results)
    tokens, per_req = t["tokens"], t["per_req"]
    if t["trims"]["inconsistent"]:
        log.warning(
            "%s: %d requests report a draft histogram that does not match completion_tokens - 1; "
            "used as reported",
            url,
            t["trims"]["inconsistent"],
        )
    res = {
        "url": url,
        "engine": engine,
        "dataset": label,
        "server_info": info,
        "num_prompts": len(prompts_ids),
        "concurrency": concurrency,
        "completion_tokens": tokens,
        "wall_seconds": wall,
        **_rates(tokens, wall, per_req),
        "warnings": [],
    }
    if vllm:
        emitted = sum(max(0, p["completion_tokens"] - 1) for p in per_req)
        figures, res["warnings"] = vllm_run_figures(url, before, emitted)
    else:
        figures = _spec_figures(info, t) if t["verify"] > 0 else {}
    res.update(figures, speculative=bool(figures))
    for w in res["warnings"]:
        log.warning("%s", w)
    res["per_request"] = per_req
    return res


def _rates(tokens: int, wall: float, per_req: list[dict]) -> dict:
    """``output_tokens_per_s`` (``tokens`` over the run's ``wall`` seconds) and ``mean_request_tokens_per_s``."""
    each = [p["completion_tokens"] / p["seconds"] for p in per_req if p["seconds"] > 0]
    return {
        "output_tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "mean_request_tokens_per_s": sum(each) / len(per_req),
    }


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
    send: Callable[..., dict],
    prompts_ids: Sequence[tuple[str, list[int]]],
    max_new_tokens: int,
    concurrency: int,
    timeout: float,
    label: str,
    progress: bool,
) -> tuple[list[dict], float]:
    """Every prompt through ``send`` (:func:`generate` or :func:`vllm_generate`), ``concurrency`` in flight;
    ``(responses in prompt order, wall seconds)``."""
    results: list[Optional[dict]] = [None] * len(prompts_ids)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futs = {
            pool.submit(send, url, ids, max_new_tokens, timeout): i
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
        row.update({k: m[k] for k in (*SPEC_KEYS, *VLLM_REQUEST_KEYS) if k in m})
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
    report["engine"] = servers[0]["engine"]
    more = [w for s in servers for w in s["warnings"]]
    if more:
        report["warnings"] = [*report.get("warnings", []), *more]
    if not servers[0]["speculative"]:
        log.warning("%s", NOT_SPECULATIVE[servers[0]["engine"]].format(url=urls[0]))
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
    """The model a server serves: ``(model_path, endpoint)``. vLLM: ``GET {url}/v1/models`` ``root`` (the model ``vllm
    serve`` was given). SGLang: ``GET {url}/server_info`` (its ``--model-path``), else ``GET {url}/model_info``
    (SGLang 0.5.x), else ``/get_model_info`` (older); ``(None, None)`` when none names one (not SGLang, or the
    endpoints are closed)."""
    info = server_info(url, timeout)
    mp = info.get("model_path")
    if isinstance(mp, str) and mp:
        return mp, "/v1/models" if info.get("engine") == "vllm" else "/server_info"
    for endpoint in ("/model_info", "/get_model_info"):
        try:
            mi = http_json(url.rstrip("/") + endpoint, timeout=timeout)
        except UserError:
            continue
        mp = mi.get("model_path") if isinstance(mi, dict) else None
        if isinstance(mp, str) and mp:
            return mp, endpoint
    return None, None
