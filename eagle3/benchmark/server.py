"""Benchmark a running SGLang server started with ``--speculative-algorithm EAGLE3`` (HTTP, stdlib only).

Each prompt is chat-rendered locally (:func:`eagle3.prompts.chat.prompt_ids`, same template and kwargs as training) and sent
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

Metrics (pooled over requests, same definitions as :func:`eagle3.benchmark.offline.acceptance_stats`):
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

from eagle3.benchmark.offline import (
    holds_bench_lock,
    json_safe,
    plot_acceptance,
    rates_from_hist,
    speedup_warning,
    template_check,
    template_kwargs_check,
)
from eagle3.errors import UserError
from eagle3.io import probe_dirs, read_json
from eagle3.io.read import json_error_detail

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
    tokens, verify, hist, per_req = t["tokens"], t["verify"], t["hist"], t["per_req"]
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
        steps = info.get(
            "speculative_num_steps"
        )  # an integer >= 1, else (absent, odd) the histogram's length
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            steps = max(1, len(hist) - 1)
        accept_lengths = t["accept_lengths"]
        res.update(
            {
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
        )
    res["per_request"] = per_req
    return res


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


def render_markdown(report: dict) -> str:
    """Markdown table of a server benchmark report (``server_bench.json``)."""

    def f(x, nd=2):
        return "n/a" if x is None or x != x else f"{x:.{nd}f}"

    lines = [
        f"# SGLang server benchmark ({report['dataset']}, {report['num_prompts']} prompts, temperature 0, "
        f"max_new_tokens {report['max_new_tokens']}, concurrency {report['concurrency']})",
        "",
        "tau: tokens emitted by verify steps / verify steps (the last step of a request counted up to "
        "the cut at EOS / max_new_tokens); SGLang's spec_accept_length also counts the prefill token.",
        "",
    ]
    if report.get("prompt_pick"):
        lines += [f"prompts picked: {report['prompt_pick']}", ""]
    lines += [f"Warning: {w}" for w in report.get("warnings") or []] + (
        [""] if report.get("warnings") else []
    )
    lines += [
        "| server | speculative | tau | SGLang accept length | output tok/s | mean request tok/s | completion tokens | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["servers"]:
        lines.append(
            f"| {s['url']} | {'yes' if s['speculative'] else 'no'} | {f(s.get('tau'))} | "
            f"{f(s.get('sglang_accept_length'))} | "
            f"{f(s['output_tokens_per_s'], 1)} | {f(s['mean_request_tokens_per_s'], 1)} | "
            f"{s['completion_tokens']} | {f(s['wall_seconds'], 1)} |"
        )
    spec = report["servers"][0]
    if spec.get("speculative"):
        steps = spec["steps"]
        lines += [
            "",
            "| draft position | " + " | ".join(str(k + 1) for k in range(steps)) + " |",
            "|---|" + "---:|" * steps,
            "| conditional | " + " | ".join(f(x) for x in spec["conditional"]) + " |",
            "| unconditional | " + " | ".join(f(x) for x in spec["unconditional"]) + " |",
        ]
    if "speedup" in report:
        lines += [
            "",
            f"speedup (server 1 vs server 2 tokens/s): **{f(report['speedup'])}x**; "
            f"identical outputs: {report['identical_outputs']}/{report['num_prompts']}",
        ]
    return "\n".join(lines) + "\n"


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
        ``output_ids`` agree); a speedup above tau (:func:`eagle3.benchmark.offline.speedup_warning`) adds a line to
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
        a, b = servers
        report["speedup"] = (
            a["output_tokens_per_s"] / b["output_tokens_per_s"]
            if b["output_tokens_per_s"]
            else float("nan")
        )
        report["identical_outputs"] = sum(
            x["output_ids"] == y["output_ids"] for x, y in zip(a["per_request"], b["per_request"])
        )
        above = speedup_warning(
            dataset, report["speedup"], a.get("tau"), baseline="the baseline server"
        )
        if (
            above
        ):  # a ratio tau cannot give: the baseline server was slowed or runs on other hardware
            log.warning("%s", above)
            report["warnings"] = [*report.get("warnings", []), above]
    if out_dir is not None:
        _write_server_reports(Path(out_dir), report, urls[0])
    return report


def _write_server_reports(out: Path, report: dict, url: str) -> None:
    """``server_bench.{json,md}`` and, for a speculative server, ``server_acceptance.png``, as one set
    (:func:`eagle3.io.atomic_write_files`): a full disk leaves the earlier run's files, and a plot an earlier run left
    is removed when this one has none (a server without EAGLE-3 statistics)."""
    from eagle3.io import atomic_write_files

    spec = report["servers"][0]
    files = [
        (
            out / "server_bench.json",
            (json.dumps(json_safe(report), indent=2, ensure_ascii=False) + "\n").encode(),
        ),
        (out / "server_bench.md", render_markdown(report).encode("utf-8")),
    ]
    png = out / "server_acceptance.png"
    if spec["speculative"]:
        d = {
            "dataset": report["dataset"],
            "tau": spec["tau"],
            "conditional": spec["conditional"],
            "unconditional": spec["unconditional"],
        }
        files.append((png, plot_acceptance([d], spec["steps"], url)))
    atomic_write_files(files, remove=() if spec["speculative"] else (png,))


@holds_bench_lock
def run(
    cfg,
    urls: Sequence[str],
    datasets: Optional[Sequence[str]] = None,
    num_prompts: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    concurrency: int = 1,
    timeout: float = 600.0,
) -> int:
    """Stage 05 ``--server`` mode: render the prompts with the verifier's tokenizer and benchmark the server(s).

    One report per dataset (default: the config's ``benchmark.datasets`` when it sets them, else ``mtbench``):
    ``server_bench.json``/``.md`` in ``cfg.bench_dir``
    (in ``{bench_dir}/server-{label}/`` when several datasets are given; :func:`dataset_labels`, "/" as "_"). Each
    records ``draft_folder`` (:func:`draft_folder_warnings`: the server's draft folder, whether it could be read here
    and what was not checked), ``served_model`` (:func:`served_model_warnings`: each server's ``model_path`` against
    ``verifier.path``), ``warnings`` (those checks', the chat template's against the shards'
    (:func:`eagle3.benchmark.offline.template_check`), the prompt subset's, a speedup above tau) and ``not_checked``
    (every line of those saying a check could not be made, as offline ``bench.json``).

    Returns:
        0 on success.

    Raises:
        UserError: tokenizer, prompt set or server problems (see :func:`run_server_bench`).
    """
    from eagle3.benchmark.eval_prompts import check_dataset_names, dataset_labels, load_eval_subset
    from eagle3.prompts.chat import ChatOptions, prompt_ids
    from eagle3.verifier import load_tokenizer

    if datasets:
        check_dataset_names(datasets, "--datasets", indexed=False)
    elif (
        "datasets" in cfg.benchmark.model_fields_set
    ):  # the config's sets when it names them (configs/kimi-k2.5.yaml)
        datasets = cfg.benchmark.datasets
        check_dataset_names(datasets, "benchmark.datasets")
    else:  # else MT-bench
        datasets = ["mtbench"]
    datasets = list(datasets)
    probe_dirs(
        Path(cfg.bench_dir), cfg.output_field("bench")
    )  # the reports come after the measurement
    max_new_tokens = max_new_tokens or cfg.benchmark.max_new_tokens
    num_prompts = num_prompts or cfg.benchmark.num_prompts
    tok = load_tokenizer(cfg.verifier)
    folder_notes, folder = draft_folder_warnings(cfg, urls[0])  # also in each report's warnings
    model_notes, served = served_model_warnings(cfg, urls)
    other_template, template_unchecked = template_check(cfg, tok, say_missing=True)
    other_kwargs, kwargs_unchecked = template_kwargs_check(cfg)
    folder_notes += model_notes + [
        w for w in (other_template, template_unchecked, other_kwargs, kwargs_unchecked) if w
    ]
    unchecked = (
        folder["not_checked"]
        + [w for r in served for w in r["not_checked"]]
        + [w for w in (template_unchecked, kwargs_unchecked) if w]
    )
    for w in folder_notes:
        log.warning("%s", w)
    labels = dataset_labels(datasets)
    for w in stale_server_reports(Path(cfg.bench_dir), labels):
        log.warning("%s", w)
    for name, label, out in zip(datasets, labels, report_dirs(Path(cfg.bench_dir), labels)):
        prompts, notes = load_eval_subset(name, num_prompts, cfg.benchmark.prompt_pick)
        for w in notes:
            log.warning("%s", w)
        ids = [(p.id, prompt_ids(tok, p.messages, ChatOptions.from_config(cfg))) for p in prompts]
        report = run_server_bench(
            urls,
            ids,
            max_new_tokens,
            concurrency,
            label,
            timeout,
            out,
            extra={
                "prompt_pick": cfg.benchmark.prompt_pick,
                "prompt_ids": [i for i, _ in ids],
                "warnings": folder_notes + notes,
                "not_checked": unchecked,
                "draft_folder": folder,
                "served_model": served,
            },
        )
        s = report["servers"][0]
        log.info(
            "%s: tau %s, %.1f output tok/s%s",
            label,
            f"{s['tau']:.2f}" if s.get("tau") else "n/a",
            s["output_tokens_per_s"],
            f", speedup {report['speedup']:.2f}x" if "speedup" in report else "",
        )
        print(
            f"report: {Path(out) / 'server_bench.md'}"
        )  # as the offline benchmark's headline ends
    return 0


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


def draft_folder_warnings(cfg, url: str, timeout: float = 30.0) -> tuple[list[str], dict]:
    """Check the draft folder an SGLang server was started with, when it is readable here; say so when it is not.

    ``GET {url}/server_info`` names ``speculative_draft_model_path``; if that folder exists on this
    machine, :func:`eagle3.export.serving.check_export_folder` refuses a folder exported for vLLM (SGLang
    would read its HF-index layer ids with its own +1 rule) and warns when the layers SGLang
    captures differ from the HF layers of the run's shards (``data_config.json``). It also warns when the server
    drafts more tokens a step (``speculative_num_steps`` in its ``server_info``, its ``--speculative-num-steps``) than
    the folder's ``eagle3_train.json`` says the drafter was trained for (``ttt_length``;
    :func:`eagle3.benchmark.offline.ttt_length_warning`), as the offline benchmark does.

    The server may run on another host, so the folder may not be readable here (or ``/server_info`` may not answer,
    or name no folder): then none of these checks runs, and one warning line says which were not made and how to
    make them (run 05 where the folder is readable, or compare by hand). Checks that could not run for want of a
    file (the folder's ``eagle3_train.json`` ``ttt_length`` / ``config.json``, the shards' ``data_config.json``) are
    each said in one warning line, also listed in the record's ``not_checked``.

    Returns:
        ``(warnings, record)``: the warning lines, and ``record`` = ``{"url", "path"`` (the folder the server names,
        or None)``, "speculative_num_steps"`` (or None)``, "readable"`` (the folder was read here)``, "not_checked"``:
        [what was not checked and why]``}`` (``server_bench.json`` key ``draft_folder``).

    Raises:
        UserError: the folder is for the other engine or its layer ids contradict its metadata.
    """
    from eagle3.benchmark.offline import ttt_length_unchecked, ttt_length_warning
    from eagle3.export.serving import check_export_folder
    from eagle3.shards.format import DATA_CONFIG, read_data_config

    info = server_info(url, timeout)
    path, steps = info.get("speculative_draft_model_path"), info.get("speculative_num_steps")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    rec = {
        "url": url,
        "path": path,
        "speculative_num_steps": steps,
        "readable": False,
        "not_checked": [],
    }
    unread = _unreadable_draft_folder(url, info, path, steps)
    if unread is not None:
        if unread:
            rec["not_checked"].append(unread)
        return [unread] if unread else [], rec
    rec["readable"] = True
    out = _drafter_verifier_lines(cfg, Path(path), rec)
    if steps is not None:
        field = f"the server's speculative_num_steps (--speculative-num-steps, {url}/server_info)"
        out += [
            w
            for w in [
                ttt_length_warning(
                    Path(path),
                    steps,
                    field,
                    fix="restart the server with --speculative-num-steps {k}",
                )
            ]
            if w
        ]
        unchecked = ttt_length_unchecked(Path(path), steps, "the server's --speculative-num-steps")
        rec["not_checked"] += [unchecked] if unchecked else []
    else:
        rec["not_checked"].append(
            f"{url}/server_info names no integer speculative_num_steps: 05 did not check the "
            f"drafter's trained ttt_length ({Path(path) / 'eagle3_train.json'}) against the "
            f"draft tokens the server drafts a step; check that its --speculative-num-steps is "
            f"at most that ttt_length"
        )
    if not (Path(path) / "config.json").is_file():
        rec["not_checked"].append(
            f"{Path(path) / 'config.json'} not found: 05 did not check the folder's engine and "
            f"aux layers; check that the server loads a folder with one"
        )
        return out + rec["not_checked"], rec
    shards_aux = arch = None
    if (Path(cfg.shards_dir) / DATA_CONFIG).is_file():
        dc = read_data_config(cfg.shards_dir)
        shards_aux, arch = dc.get("aux_layers"), dc.get("architecture")
    else:
        rec["not_checked"].append(
            f"{Path(cfg.shards_dir) / DATA_CONFIG} not found: 05 checked the layers SGLang "
            f"captures against the folder's own record only, not against the shards'; compare "
            f"its eagle3_train.json aux_layers_hf with the shards' data_config.json aux_layers"
        )
    out += check_export_folder(
        path, serving_engine="sglang", shards_aux_hf=shards_aux, verifier_architecture=arch
    )["warnings"]
    return out + rec["not_checked"], rec


def _drafter_verifier_lines(cfg, folder: Path, rec: dict) -> list[str]:
    """For :func:`draft_folder_warnings`: the readable draft folder's recorded verifier against the configured one, as
    offline 05 checks it (:func:`eagle3.benchmark.offline.verifier_warnings`: name, weights fingerprint; the
    dimensions need the loaded verifier, which ``--server`` does not load). Before, ``--server`` never compared them.
    A check that cannot be made (:func:`eagle3.benchmark.offline.verifier_unchecked`) goes to ``rec["not_checked"]``.

    Returns:
        the mismatch line (or none).
    """
    from eagle3.benchmark.offline import verifier_unchecked, verifier_warnings
    from eagle3.verifier import weights_fingerprint

    name, fp = cfg.verifier.display_name(), weights_fingerprint(cfg.verifier)
    mismatch = verifier_warnings(folder, name, None, fp)
    unchecked = None if mismatch else verifier_unchecked(folder, name, fp, dims_checked=False)
    rec["not_checked"] += [unchecked] if unchecked else []
    return mismatch


def _unreadable_draft_folder(url: str, info: dict, path, steps: Optional[int]) -> Optional[str]:
    """For :func:`draft_folder_warnings`: None when the server's draft folder is readable here; ``""`` for a server
    that says it does not speculate (``run_server_bench`` warns about that); else the warning line naming what was not
    checked and how to check it."""
    if not info:
        why = f"{url}/server_info did not answer (not SGLang, or an older one), so the server's draft folder is unknown"
    elif not path:
        if info.get("speculative_algorithm") in (None, "", "NONE"):
            return ""
        why = f"{url}/server_info names no speculative_draft_model_path"
    elif not isinstance(path, str):  # a proxy's or hand-made server_info: Path() raised TypeError
        why = f"{url}/server_info speculative_draft_model_path is {path!r}, not a folder path"
    elif not Path(path).is_dir():
        why = (
            f"the server's draft folder {path} ({url}/server_info speculative_draft_model_path) is not readable on "
            f"this machine (the server runs elsewhere, or it is a hub id)"
        )
    else:
        return None
    k = f" {steps}" if steps is not None else ""
    return (
        f"{why}: 05 did not check it against the server (its eagle3_train.json ttt_length against "
        f"--speculative-num-steps{k}, its config.json's engine (sglang) and aux layers against the shards'); run 05 "
        f"where that folder is readable (e.g. on shared storage), or check there that its eagle3_train.json has "
        f"engine sglang and ttt_length >= the server's --speculative-num-steps"
    )


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


def _verifier_where(vcfg) -> tuple[Optional[Path], str]:
    """The configured verifier's weights on this machine (its folder, or its GGUF file) and how to name it."""
    try:
        folder = vcfg.resolved_path()
    except UserError:  # a package: path whose package is not installed here
        return None, vcfg.path
    where = folder / vcfg.gguf_file if vcfg.gguf_file else folder
    return where, str(where)


def compare_served_model(vcfg, served: str) -> tuple[Optional[str], str]:
    """Whether ``served`` (a server's ``model_path``: a local path or a hub id) is the configured verifier ``vcfg``.

    Readable here: the same folder/file (``"same folder"``), else the same weights fingerprint
    (:func:`eagle3.verifier.weights_fingerprint`; a copy: ``"same weights"``) or other weights (``"differs"``).
    Otherwise (another host, a hub id, no weight file to fingerprint) only names can be compared: the last path
    component of ``served`` against ``verifier.path``'s, its ``gguf_file`` and ``verifier.name``'s, case-insensitive
    (``"same name"``; None when they differ: it may still be the same model under another name).

    Returns:
        ``(verdict, detail)``: ``"same folder"`` | ``"same weights"`` | ``"same name"`` | ``"differs"`` | None, and
        what the verdict rests on (for the warning line).
    """
    from eagle3.verifier import weights_fingerprint

    mine, _ = _verifier_where(vcfg)
    sp = Path(served)
    if mine is not None and sp.exists():
        if sp.resolve() == mine.resolve():
            return "same folder", "the same path"
        folder, gguf = (sp.parent, sp.name) if sp.is_file() else (sp, None)
        theirs = weights_fingerprint(
            vcfg.model_copy(update={"path": str(folder), "gguf_file": gguf})
        )
        ours = weights_fingerprint(vcfg)
        if theirs and ours:
            return (
                ("same weights", "a copy of its weight files")
                if theirs == ours
                else (
                    "differs",
                    "its weight files are not those at verifier.path (verifier_weights fingerprints differ)",
                )
            )
    names = {
        n.lower()
        for n in (
            mine.name if mine is not None else None,
            vcfg.gguf_file,
            Path(vcfg.name).name if vcfg.name else None,
        )
        if n
    }
    name = sp.name.lower() or served.lower()
    if name in names:
        return "same name", f"the same name {sp.name!r}"
    where = (
        "its weights could not be fingerprinted here"
        if sp.exists()
        else "it is not readable on this machine"
    )
    return (
        None,
        f"{where} and its name {sp.name!r} is not verifier.path's ({', '.join(sorted(names))})",
    )


def served_model_warnings(
    cfg, urls: Sequence[str], timeout: float = 30.0
) -> tuple[list[str], list[dict]]:
    """Check that each server runs the configured verifier (05 renders the prompts with ``verifier.path``'s tokenizer
    and chat template, so a server of another model gets the wrong tokens and its tau says nothing of the drafter).

    Before, 05 never compared the server's ``model_path`` with the config. Now each URL's ``model_path``
    (:func:`served_model_path`) is compared by :func:`compare_served_model`: other weights give one warning line; a
    ``model_path`` that cannot be confirmed (unreadable here and named otherwise) or that no endpoint names gives one
    line saying the check was not made and how to make it. Warnings only: a name says little for certain.

    Returns:
        ``(warnings, records)``: one record per URL, ``{"url", "model_path"`` (or None)``, "endpoint"`` (where it was
        read, or None)``, "verifier"`` (the config's ``display_name()``)``, "match"`` (the verdict, or None)``,
        "not_checked": [line]}`` (``server_bench.json`` key ``served_model``).
    """
    out, recs = [], []
    _, where = _verifier_where(cfg.verifier)
    name = cfg.verifier.display_name()
    tail = f"05 renders the prompts with the tokenizer and chat template of verifier '{name}' ({where})"
    for url in urls:
        served, endpoint = served_model_path(url, timeout)
        rec = {
            "url": url,
            "model_path": served,
            "endpoint": endpoint,
            "verifier": name,
            "match": None,
            "not_checked": [],
        }
        if served is None:
            rec["not_checked"].append(
                f"{url}: none of /server_info, /model_info, /get_model_info names the served model_path (not "
                f"SGLang?): 05 did not check that the server runs the configured verifier; {tail}: check that the "
                f"server was started with --model-path {where}"
            )
        else:
            rec["match"], detail = compare_served_model(cfg.verifier, served)
            if rec["match"] == "differs":
                out.append(
                    f"{url}{endpoint} model_path {served} is not the configured verifier: {detail}; {tail}, so "
                    f"tau measures a server of another model: benchmark a server started with --model-path "
                    f"{where}, or set verifier.path to the served model"
                )
            elif rec["match"] is None:
                rec["not_checked"].append(
                    f"{url}{endpoint} model_path {served}: {detail}, so 05 could not "
                    f"check that the server runs the configured verifier; {tail}: check that the server's "
                    f"--model-path holds the model at {where}"
                )
        out += rec["not_checked"]
        recs.append(rec)
    return out, recs
