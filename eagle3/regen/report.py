"""Stage 01's report: the counts and regeneration figures of ``prompts_report.json`` as Markdown, and its
one-line messages (what reading found, answers an older 01 wrote)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

from eagle3.chat.template import ANSWER_FIELDS
from eagle3.errors import UserError
from eagle3.io import atomic_write_json, atomic_write_jsonl, atomic_write_text

REPORT_NAME = "prompts_report.json"


def report_markdown(report: dict) -> str:
    """The report's counts (and regeneration figures) as a Markdown table."""
    c = report["counts"]
    rows = [("read", c["read"])]
    rows += [(f"skipped: {k}", v) for k, v in c["skipped"].items()]
    rows += [
        (_COUNT_LABELS.get(k, k), c[k])
        for k in (
            "dropped_leading_assistant",
            "normalised",
            "deduped",
            "sampled_out",
            "chained_into",
            "self_instruct",
            "self_instruct_deduped",
            "limited_out",
            "self_instruct_limited_out",
            "dropped_over_context",
            "failed",
            "kept",
            "regenerated",
            "inline_reasoning_split",
        )
        if k in c
    ]
    rows += _regeneration_rows(report.get("regeneration"))
    st = report["settings"]
    src = st["source"] if "source" in st else ", ".join(x["source"] for x in st["sources"])
    lines = ["# Stage 01: prompts", "", f"source: `{src}`", "", "| item | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def _regeneration_rows(reg: Optional[dict]) -> list[tuple]:
    """The Markdown rows of the report's ``regeneration`` figures (none without a regeneration)."""
    if not reg:
        return []
    rows: list[tuple] = []
    if "via" in reg:
        rows.append(("regeneration: via", reg["via"]))
    if "failed" in reg:
        rows += [
            ("regeneration: failed conversations", reg["failed"]),
            ("regeneration: retried requests", reg["retries"]),
        ]
    # a resumed run: its figures below cover the conversations it answered
    if "failed" in reg or reg.get("resumed"):
        rows.append((_RESUMED_LABEL, reg.get("resumed", 0)))
    if "sampling" in reg:
        rows += [
            (f"sampling: {k}", json.dumps(v) if isinstance(v, dict) else v)
            for k, v in reg["sampling"].items()
        ]
    es = reg.get("engine_stats") or []
    es = [
        e for e in ([es] if isinstance(es, dict) else es) if e and "reused_tokens" in e
    ]  # slot engines, per replica
    if es:
        reused, fed = sum(e["reused_tokens"] for e in es), sum(e["prefill_tokens"] for e in es)
        share = f"{fed} / {reused} ({100.0 * reused / max(1, reused + fed):.1f}% reused)"
        rows.append(
            ("regeneration: prompt tokens prefilled / reused from the previous turn", share)
        )
    for k, label in (
        ("turns_over_context", "user turns not answered (context cap)"),
        ("kept_with_tools", "conversations with tool results kept as they are"),
    ):
        if reg.get(k):
            rows.append((f"regeneration: {label}", reg[k]))
    rows += [
        ("regeneration: new tokens", reg["new_tokens"]),
        ("regeneration: truncated answers", reg["truncated"]),
        ("regeneration: seconds", f"{reg['seconds']:.1f}"),
        ("regeneration: tokens/s", f"{reg['tokens_per_s']:.1f}" if reg["tokens_per_s"] else "n/a"),
    ]
    return rows


_RESUMED_LABEL = (
    "regeneration: conversations resumed from the log (answered by an earlier run; the regeneration "
    "figures below count this run's only)"
)
# Markdown labels of counts whose key alone would not say what they count
_COUNT_LABELS = {
    "chained_into": "chained_into (conversations after prompts.chain_conversations)",
    "dropped_over_context": "dropped_over_context (first prompt at the context cap)",
    "failed": "failed (regeneration)",
    "regenerated": "regenerated (conversations)",
}


def read_counts_text(counts: Counter) -> str:
    """What reading the sources found, for messages: ``no records`` or ``read 3 records, skipped 3 (no
    assistant: 2, empty content: 1)`` (the ``skipped_<reason>`` counters of :mod:`eagle3.data.readers`, nonzero only)."""
    read = counts.get("read", 0)
    if not read:
        return "no records"
    reasons = [
        (k[len("skipped_") :].replace("_", " "), v)
        for k, v in sorted(counts.items())
        if k.startswith("skipped_") and v
    ]
    text = f"read {read} record{'s' if read != 1 else ''}"
    if reasons:
        text += (
            f", skipped {sum(v for _, v in reasons)} ("
            + ", ".join(f"{r}: {v}" for r, v in reasons)
            + ")"
        )
    return text


def limit_drops_self_instruct(
    flag: str, limit: int, n_self_instruct: int, dropped: int, total: int
) -> str:
    """The one-line warning of a ``limit`` (``flag``: 01's or 02's ``--limit``) that leaves out ``dropped`` of the
    ``n_self_instruct`` ``prompts.self_instruct`` prompts, which come after the sampled sources (``total``
    conversations in all before the limit)."""
    return (
        f"{flag} {limit}: leaves out {dropped} of the {n_self_instruct} prompts.self_instruct prompts (they come "
        f"after the {total - n_self_instruct} sampled source conversations); {flag} {total} keeps them all"
    )


def older_answers_warning(out: Path, report: Optional[dict]) -> Optional[str]:
    """One warning line for an up-to-date ``prompts.jsonl`` whose answers lack some of
    :data:`eagle3.chat.template.ANSWER_FIELDS` (02 then trains the template's end-of-turn token after
    a cut or other-stop answer); None when not regenerated or complete.
    """
    st = report.get("settings") if isinstance(report, dict) else None
    if (
        not isinstance(st, dict)
        or not st.get("regenerate")
        or report.get("answer_fields") == list(ANSWER_FIELDS)
    ):
        return None
    have = report.get("answer_fields")
    missing = [
        f for f in ANSWER_FIELDS if f != "tokens" and not (isinstance(have, list) and f in have)
    ]
    regen = report.get("regeneration")
    cut = regen.get("truncated") if isinstance(regen, dict) else None
    return (
        f"{out}: regenerated by an older 01 that did not record {' / '.join(missing)} on each answer "
        f"({REPORT_NAME} has {'no answer_fields' if have is None else 'answer_fields ' + json.dumps(have)}"
        f"{f'; {cut} answers were cut at prompts.max_new_tokens' if isinstance(cut, int) and cut else ''}): 02 "
        "trains the template's end-of-turn token after an answer cut at prompts.max_new_tokens or stopped on "
        "another stop id as if the verifier had emitted it; re-run 01 with --force to record them"
    )


def nothing_regenerated_error(stats: dict, max_context: int, regenerate_via: str) -> UserError:
    """The error for a regeneration that answered no conversation, naming the cause: every conversation's first
    prompt over the context cap ``max_context`` (``dropped_over_context``), failed conversations (endpoint path,
    ``regenerate_via`` not ``local``), or both."""
    dropped, failed = stats.get("dropped_over_context", 0), stats.get("failed", 0)
    cap = (
        f"{dropped} conversations left out because their first prompt has >= {max_context} tokens "
        f"(prompts.max_context_tokens, else extract.max_length: raise it)"
    )
    if dropped and not failed:
        return UserError(
            f"prompts.max_context_tokens: no conversation to regenerate: {cap}; nothing written"
        )
    where = "prompts.server.urls" if regenerate_via != "local" else "prompts.regenerate"
    return UserError(
        f"{where}: every conversation failed to regenerate ({failed} failed; see the error lines above"
        + (f"; {cap}" if dropped else "")
        + "); nothing written"
    )


def write_outputs(out: Path, rep: Path, convs: list[dict], report: dict) -> None:
    """Write ``prompts.jsonl`` (``out``), the report ``rep`` and its Markdown twin, each atomically."""
    atomic_write_jsonl(out, convs)
    atomic_write_json(rep, report)
    atomic_write_text(rep.with_suffix(".md"), report_markdown(report))


def print_outputs(out: Path, rep: Path, report: dict, failed: int) -> None:
    """Print the failed conversations' line (``failed`` > 0), the counts' summary and where the outputs are."""
    if failed:
        print(
            f"regeneration: {failed} conversation(s) failed (ids in {rep.name}); they are not in {out.name}. "
            f"Rerun the same command to retry only those."
        )
    c = report["counts"]
    si = report["settings"].get("self_instruct")
    si_text = (
        f", self-instruct {si['num']} sampled / {c['self_instruct'] - c.get('self_instruct_limited_out', 0)} "
        f"kept"
        if isinstance(si, dict) and "self_instruct" in c
        else ""
    )
    # regenerated counts them too: say how many came from the earlier file
    reused = report.get("reused_answers")
    reused_text = (
        f", {reused['conversations']} of them reused from {reused['file']}" if reused else ""
    )
    dropped = c.get("dropped_over_context", 0)
    cap_text = (
        f", {dropped} left out by the context cap (prompts.max_context_tokens)" if dropped else ""
    )
    print(
        f"prompts: {out} ({c['kept']} conversations; read {c['read']}, skipped {sum(c['skipped'].values())}, "
        f"deduped {c['deduped']}{cap_text}, regenerated {c['regenerated']}{reused_text}{si_text})"
    )
    print(f"report:  {rep}")
