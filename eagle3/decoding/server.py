"""Benchmark a running EAGLE-3 server over HTTP: SGLang (``--speculative-algorithm EAGLE3``) or vLLM
(``--speculative-config '{"method": "eagle3", ...}'``), told apart by :func:`detect_engine`.

Each prompt is chat-rendered locally (:func:`eagle3.chat.template.prompt_ids`, as in training) and sent as token ids,
greedy (temperature 0). SGLang: ``POST {url}/generate``; the response's ``meta_info`` (SGLang 0.5.23) carries
``completion_tokens`` and, with speculation, ``spec_verify_ct``, ``spec_accept_length`` and
``spec_correct_drafts_histogram`` (``[a]`` = verify steps that accepted ``a`` drafts, counted before the cut at EOS /
``max_new_tokens``; :func:`emitted_histogram` moves each request's last step down to what it emitted). vLLM:
``POST {url}/v1/completions`` (``prompt`` = ids, ``return_token_ids``); the figures are the server's own spec-decode
counters at ``GET {url}/metrics`` (vLLM 0.32 ``v1/spec_decode/metrics.py``: drafts, draft tokens, accepted tokens,
accepted per position), read after the warm-up and after the last request: the delta covers every request the server
ran meanwhile, so another client's requests count too (:func:`bench_server` warns when the counts say so).

Metrics (pooled, as :func:`eagle3.decoding.metrics.acceptance_stats`): ``tau`` = tokens emitted by verify steps /
verify steps (SGLang: ``completion_tokens - 1`` per request / ``spec_verify_ct``; vLLM: 1 + accepted / drafts, as
vLLM's docs define its mean acceptance length); ``sglang_accept_length`` = sum(completion_tokens) /
sum(spec_verify_ct) (SGLang's own); output tokens/s over the whole set. With two URLs the second is the baseline:
speedup = tokens/s ratio, greedy outputs compared.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

from tqdm import tqdm

from eagle3.decoding.metrics import rates_from_hist, speedup_warning
from eagle3.decoding.report import write_server_reports
from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.io.http import request_json, request_text

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

#: the line 05 --server logs when the first server ran no verify step, per engine
NOT_SPECULATIVE = {
    "sglang": "server {url} reported no spec_verify_ct: was it started with --speculative-algorithm EAGLE3?",
    "vllm": (
        "server {url} counted no drafts at /metrics (vllm:spec_decode_num_drafts): was it started with "
        '--speculative-config \'{{"method": "eagle3", ...}}\' and without --disable-log-stats?'
    ),
}


def _http(url: str, payload: Optional[dict] = None, timeout: float = 600.0) -> dict:
    """:func:`eagle3.io.http.request_json` with errors named ``server {url}``."""
    return request_json(url, payload, timeout, where=f"server {url}", unreachable="cannot connect")


def detect_engine(url: str, timeout: float = 30.0) -> str:
    """The engine behind ``url``: ``"vllm"`` when ``GET {url}/v1/models`` lists a model ``owned_by: "vllm"`` (vLLM's
    OpenAI server; SGLang's cards say ``"sglang"``), else ``"sglang"`` (a server without that endpoint included:
    SGLang's ``/generate`` then says whether it is one)."""
    try:
        cards = _http(url.rstrip("/") + "/v1/models", timeout=timeout)
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
        info = _http(url.rstrip("/") + "/server_info", timeout=timeout)
    except UserError:
        return {}
    return {k: info[k] for k in INFO_KEYS if isinstance(info, dict) and k in info}


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
        cards = _http(base + "/v1/models", timeout=timeout).get("data") or [{}]
        info["model_path"] = cards[0].get("root") or cards[0].get("id")
    except (UserError, AttributeError, IndexError):
        pass
    try:
        info["version"] = _http(base + "/version", timeout=timeout).get("version")
    except (UserError, AttributeError):
        pass
    try:
        full = _http(base + "/server_info?config_format=json", timeout=timeout)
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
    out = _http(url.rstrip("/") + "/v1/completions", payload, timeout)
    seconds = time.perf_counter() - t0
    usage = out.get("usage") if isinstance(out, dict) else None
    choices = out.get("choices") if isinstance(out, dict) else None
    if (
        not isinstance(usage, dict)
        or not isinstance(usage.get("completion_tokens"), int)
        or not choices
    ):
        raise UserError(
            f"server {url}: /v1/completions response has no usage.completion_tokens or choices (is this vLLM?)"
        )
    choice = choices[0]
    meta = {
        "completion_tokens": usage["completion_tokens"],
        "finish_reason": choice.get("finish_reason"),
    }
    return {
        "output_ids": choice.get("token_ids"),
        "text": choice.get("text"),
        "meta_info": meta,
        "seconds": seconds,
    }


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
        ``url``, ``engine``, ``server_info``, ``num_prompts``, ``completion_tokens``, ``wall_seconds``,
        ``output_tokens_per_s``, ``mean_request_tokens_per_s``, ``speculative``, ``warnings``; when speculative also
        ``steps``, ``verify_steps``, ``tau``, ``accepted_hist``, ``conditional``, ``unconditional`` and, SGLang,
        ``sglang_accept_length``, ``mean_spec_accept_length``, ``reported_accepted_hist`` (as reported),
        ``histogram_trims`` (``accepted_hist`` is the emitted one), vLLM, ``accepted_drafts``, ``draft_tokens``,
        ``accepted_per_pos`` (:func:`_vllm_figures`); ``per_request`` (vLLM at concurrency 1: each request's own
        :data:`VLLM_REQUEST_KEYS`).

    Raises:
        UserError: the server cannot be reached or answers malformed responses.
    """
    engine = detect_engine(url)
    info = server_info(url, engine=engine)
    send = vllm_generate if engine == "vllm" else generate
    if engine == "vllm" and concurrency == 1:
        send = _counted
    send(url, prompts_ids[0][1], min(8, max_new_tokens), timeout)  # warm-up
    before = vllm_counters(url) if engine == "vllm" else None
    results, wall = _send_all(
        url, send, prompts_ids, max_new_tokens, concurrency, timeout, label, progress
    )
    t = _tally_requests(prompts_ids, results)
    if before is not None:
        delta = counters_delta(before, vllm_counters(url))
        t["verify"] = delta["drafts"] if delta["present"] else 0
        t["verify_tokens"] = sum(max(0, p["completion_tokens"] - 1) for p in t["per_req"])
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
        "engine": engine,
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
        "warnings": [],
    }
    if verify > 0 and before is not None:
        res.update(_vllm_figures(delta))
        if verify > t["verify_tokens"]:  # each verify step emits >= 1 token of some request
            res["warnings"].append(
                f"{url}/metrics counted {verify} verify steps while this run's requests emitted "
                f"{t['verify_tokens']} tokens after their first: another client's requests ran on the server "
                f"meanwhile and their drafts are in tau; benchmark a server no one else uses"
            )
    elif verify > 0:
        res.update(_spec_figures(info, t))
    for w in res["warnings"]:
        log.warning("%s", w)
    res["per_request"] = per_req
    return res


def _counted(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 600.0) -> dict:
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


def _vllm_figures(delta: dict) -> dict:
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
            mi = _http(url.rstrip("/") + endpoint, timeout=timeout)
        except UserError:
            continue
        mp = mi.get("model_path") if isinstance(mi, dict) else None
        if isinstance(mp, str) and mp:
            return mp, endpoint
    return None, None
