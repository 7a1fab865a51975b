"""The benchmark's report files: ``bench.json`` / ``bench.md`` / ``acceptance.png`` of the offline benchmark and
``server_bench.json`` / ``.md`` / ``server_acceptance.png`` of a server benchmark, each set written atomically
(:func:`eagle3.io.atomic_write_files`), and the lines 05 prints at its end. The JSON is the report dict with NaN / inf
as null (strict JSON; NaN marks an undefined rate)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Optional, Sequence

from eagle3.io import atomic_write_files


def _f(x: Optional[float], nd: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def json_safe(obj):
    """``obj`` with NaN/inf floats replaced by None (strict JSON; NaN marks an undefined rate)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def md_cell(value) -> str:
    """``value`` as one Markdown table cell: ``|`` escaped and line breaks made spaces (a prompt file named ``my|set``
    or a prompt id with a ``|`` split its row into extra columns)."""
    return " ".join(str(value).splitlines()).replace("|", "\\|")


def render_markdown(report: dict) -> str:
    """The Markdown tables of ``bench.md`` from a ``bench.json`` report dict."""
    steps = report["steps"]
    lines = [
        f"# EAGLE-3 offline benchmark: {report['verifier']}",
        "",
        f"drafter `{report['drafter']}`, chain of {steps} draft tokens, {_sampling(report)}, "
        f"max_new_tokens {report['max_new_tokens']}, {report['device']} {report['dtype']}, "
        f"aux layers (HF hidden_states indices) {report['aux_layers']}",
        "",
    ]
    if report.get("temperature"):
        lines += [SAMPLED_NOTE, ""]
    if report.get("prompt_pick"):
        lines += [
            f"prompts picked: {report['prompt_pick']} (benchmark.prompt_pick; ids per set in bench.json, "
            f"datasets[].prompt_ids)",
            "",
        ]
    lines += [
        "| dataset | prompts | batch | tau | greedy tok/s | EAGLE-3 tok/s | speedup | drafter share | wall s | lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in report["datasets"]:
        lines.append(
            f"| {md_cell(d['dataset'])} | {d['num_prompts']} | {d.get('batch_size', 1)} | {_f(d['tau'])} | "
            f"{_f(d['greedy_tokens_per_s'], 1)} | {_f(d['spec_tokens_per_s'], 1)} | {_f(d['speedup'])}x | "
            f"{_f(d.get('drafter_share'))} | {_f(d.get('wall_seconds'), 1)} | {_lossless_cell(d)} |"
        )
    head = " | ".join(f"pos {k + 1}" for k in range(steps))
    lines += [
        "",
        "Per-position acceptance: conditional P(k accepted | 1..k-1 accepted) / unconditional P(1..k accepted)",
        "",
        f"| dataset | verify steps | {head} |",
        "|---|---:|" + "---:|" * steps,
    ]
    for d in report["datasets"]:
        cells = " | ".join(
            f"{_f(c)} / {_f(u)}" for c, u in zip(d["conditional"], d["unconditional"])
        )
        lines.append(f"| {md_cell(d['dataset'])} | {d['verify_steps']} | {cells} |")
    lines += context_lines(report)
    mism = [(d["dataset"], m) for d in report["datasets"] for m in d["mismatches"]]
    if mism:
        lines += [
            "",
            f"Differences from greedy (first differing token per prompt; gap = verify top-1 logit minus "
            f"the logit of greedy's token; near-tie tolerance {report['datasets'][0].get('tie_tolerance')}):",
            "",
            "| dataset | prompt | token index | logit gap | near-tie |",
            "|---|---|---:|---:|---|",
        ]
        for name, m in mism:
            lines.append(
                f"| {md_cell(name)} | {md_cell(m['id'])} | {m['index']} | {_f(m.get('gap'), 4)} | {'yes' if m.get('near_tie') else 'no'} |"
            )
    for w in report.get("warnings", []):
        lines += ["", f"**warning**: {w}"]
    return "\n".join(lines) + "\n"


def context_lines(report: dict) -> list[str]:
    """``bench.md``'s table of tau per context-length bucket (``datasets[].context_buckets``, present with
    ``benchmark.context_lengths``): one row per set and bucket holding a prompt; [] without buckets."""
    if not report.get("context_edges"):
        return []
    lines = [
        "",
        "tau per context length (chat-rendered prompt tokens; benchmark.context_lengths):",
        "",
        "| dataset | prompt tokens | prompts | verify steps | tau |",
        "|---|---|---:|---:|---:|",
    ]
    for d in report["datasets"]:
        for b in d.get("context_buckets", []):
            if b["prompts"]:
                lines.append(
                    f"| {md_cell(d['dataset'])} | {b['bucket']} | {b['prompts']} | {b['verify_steps']} | "
                    f"{_f(b['tau'])} |"
                )
    return lines


def headline(report: dict, out_dir: str | Path) -> str:
    """The lines stage 05 prints at its end: per dataset tau, tokens/s greedy vs with the drafter (both
    measured in this run), the speedup and the lossless verdict (as in ``bench.md``), then the report path."""
    lines = []
    for d in report["datasets"]:
        lines.append(
            f"{d['dataset']}: tau {_f(d['tau'])}, greedy {_f(d['greedy_tokens_per_s'], 1)} tok/s vs "
            f"EAGLE-3 {_f(d['spec_tokens_per_s'], 1)} tok/s = {_f(d['speedup'])}x, "
            f"lossless {_lossless_cell(d)} ({d['num_prompts']} prompt{'s' if d['num_prompts'] != 1 else ''}, "
            f"{report['device']} {report['dtype']})"
        )
    lines.append(f"report: {Path(out_dir) / 'bench.md'}")
    return "\n".join(lines)


#: bench.md's note at temperature > 0, where the lossless column says n/a
SAMPLED_NOTE = (
    "Sampled decoding: the baseline samples from the verifier, EAGLE-3 samples its drafts and decides them by "
    "speculative rejection sampling; its output equals plain sampling in distribution, not token by token, so no "
    "per-prompt lossless verdict is made (lossless n/a; the distribution is checked by "
    "tests/benchmark/test_sampling.py). tau = emitted tokens per verify step; the speedup is against plain sampling."
)


def _sampling(report: dict) -> str:
    """``temperature 0`` or ``temperature T, top-p P`` of a report (0 when it records none)."""
    t = report.get("temperature") or 0
    if not t:
        return "temperature 0"
    block = ", block verification" if report.get("rejection_sample_method") == "block" else ""
    return f"temperature {t:g}, top-p {report.get('top_p', 1.0):g}{block}"


def _lossless_cell(d: dict) -> str:
    """``yes``, ``yes (n near-ties)``, ``NO (n prompts)`` or, sampled (temperature > 0), ``n/a`` for one dataset row."""
    if d.get("temperature"):
        return "n/a"
    fails = d.get("failures", len(d["mismatches"]))
    near = d.get("near_ties", 0)
    if fails:
        return f"NO ({fails} prompts)" + (f" + {near} near-ties" if near else "")
    return "yes" if not near else f"yes ({near} near-ties)"


def plot_context(ax, datasets: Sequence[dict]) -> None:
    """tau per context-length bucket (``context_buckets``) on ``ax``: one line per dataset over its buckets that
    hold a prompt, x = the bucket's position among the edges, labelled ``<=1024``, ``1025-2048``, ..."""
    labels: list[str] = []
    for d in datasets:
        for b in d.get("context_buckets", []):
            if b["bucket"] not in labels:
                labels.append(b["bucket"])
    for d in datasets:
        pts = [
            (labels.index(b["bucket"]), b["tau"])
            for b in d.get("context_buckets", [])
            if b["prompts"]
        ]
        if pts:
            ax.plot(*zip(*pts), "o-", label=str(d["dataset"]))
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tau")
    ax.set_title("tau per context length")
    ax.legend(fontsize=8)


def plot_acceptance(datasets: Sequence[dict], steps: int, title: str = "") -> bytes:
    """PNG bytes: grouped bars of conditional and unconditional acceptance per draft position per dataset, and
    with context-length buckets (``benchmark.context_lengths``) a third panel of tau per bucket (:func:`plot_context`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any(d.get("context_buckets") for d in datasets):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        axes[1].sharey(axes[0])
        plot_context(axes[2], datasets)
    else:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    width = 0.8 / max(1, len(datasets))
    for ax, key in zip(axes, ("conditional", "unconditional")):
        for j, d in enumerate(datasets):
            xs = [k + 1 + (j - (len(datasets) - 1) / 2) * width for k in range(steps)]
            vals = [0.0 if v is None or v != v else v for v in d[key]]
            ax.bar(xs, vals, width=width, label=f"{d['dataset']} (tau {_f(d['tau'])})")
        ax.set_xticks(range(1, steps + 1))
        ax.set_xlabel("draft position")
        ax.set_title(f"{key} acceptance")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("rate")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_reports(
    out_dir: str | Path, report: dict, stem: str = "bench", plot_name: str = "acceptance.png"
) -> list[Path]:
    """Write ``{stem}.json``, ``{stem}.md`` and the acceptance plot into ``out_dir`` as one set
    (:func:`eagle3.io.atomic_write_files`: a full disk leaves the earlier run's three files, never a mix)."""
    out = Path(out_dir)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / plot_name]
    png = plot_acceptance(report["datasets"], report["steps"], str(report.get("verifier", "")))
    md = render_markdown(report).encode("utf-8")
    atomic_write_files(list(zip(paths, [_json_bytes(report), md, png])))
    return paths


def _json_bytes(report: dict) -> bytes:
    """``report`` as :func:`eagle3.io.atomic_write_json` writes it (strict JSON, indented, one trailing newline)."""
    return (json.dumps(json_safe(report), indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def render_server_markdown(report: dict) -> str:
    """Markdown table of a server benchmark report (``server_bench.json``)."""
    vllm = report.get("engine") == "vllm"
    lines = [
        f"# {'vLLM' if vllm else 'SGLang'} server benchmark ({report['dataset']}, {report['num_prompts']} prompts, "
        f"temperature 0, max_new_tokens {report['max_new_tokens']}, concurrency {report['concurrency']})",
        "",
        "tau: 1 + accepted drafts / drafts, vLLM's spec-decode counters at /metrics over the run."
        if vllm
        else "tau: tokens emitted by verify steps / verify steps (the last step of a request counted up to "
        "the cut at EOS / max_new_tokens); SGLang's spec_accept_length also counts the prefill token.",
        "",
    ]
    if report.get("prompt_pick"):
        lines += [f"prompts picked: {report['prompt_pick']}", ""]
    if report.get("warnings"):
        lines += [f"Warning: {w}" for w in report["warnings"]] + [""]
    lines += [
        "| server | speculative | tau | SGLang accept length | output tok/s | mean request tok/s | completion tokens | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report["servers"]:
        lines.append(
            f"| {s['url']} | {'yes' if s['speculative'] else 'no'} | {_f(s.get('tau'))} | "
            f"{_f(s.get('sglang_accept_length'))} | "
            f"{_f(s['output_tokens_per_s'], 1)} | {_f(s['mean_request_tokens_per_s'], 1)} | "
            f"{s['completion_tokens']} | {_f(s['wall_seconds'], 1)} |"
        )
    spec = report["servers"][0]
    if spec.get("speculative"):
        steps = spec["steps"]
        lines += [
            "",
            "| draft position | " + " | ".join(str(k + 1) for k in range(steps)) + " |",
            "|---|" + "---:|" * steps,
            "| conditional | " + " | ".join(_f(x) for x in spec["conditional"]) + " |",
            "| unconditional | " + " | ".join(_f(x) for x in spec["unconditional"]) + " |",
        ]
    if "speedup" in report:
        lines += [
            "",
            f"speedup (server 1 vs server 2 tokens/s): **{_f(report['speedup'])}x**; "
            f"identical outputs: {report['identical_outputs']}/{report['num_prompts']}",
        ]
    return "\n".join(lines) + "\n"


def write_server_reports(out: Path, report: dict, url: str) -> None:
    """``server_bench.{json,md}`` and, for a speculative server, ``server_acceptance.png``, as one set
    (:func:`eagle3.io.atomic_write_files`): a full disk leaves the earlier run's files, and a plot an earlier run left
    is removed when this one has none (a server without EAGLE-3 statistics)."""
    spec = report["servers"][0]
    files = [
        (out / "server_bench.json", _json_bytes(report)),
        (out / "server_bench.md", render_server_markdown(report).encode("utf-8")),
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
