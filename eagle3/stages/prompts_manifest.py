"""Stage 01's manifest from the run config: ``prompts_report.json``'s settings (every input that decides
``prompts.jsonl``), its path and the forced-run marker's, the report's content, and 02's comparison of its config
with them (:func:`require_current`, through :class:`eagle3.manifest.PromptsManifest`).

Equal settings = nothing to do: :func:`settings` holds the config fields that change the output, each source
file's size + SHA-256, the verifier and, regenerating in-process, its weights' fingerprint; with
``prompts.self_instruct`` its settings and its file's size + SHA-256.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from eagle3.chat.template import ANSWER_FIELDS
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import atomic_write_json
from eagle3.manifest import PromptsManifest, require
from eagle3.regen.manifest import (
    FORCED_NAME,
    SOURCE_STATS,
    left_out_by_regeneration,
    source_fingerprint,
)
from eagle3.regen.report import REPORT_NAME
from eagle3.verifier.load import weights_record


def report_path(cfg: RunConfig) -> Path:
    """``prompts_report.json`` next to ``cfg.prompts_path``."""
    return cfg.prompts_path.parent / REPORT_NAME


def forced_path(cfg: RunConfig) -> Path:
    """The marker of a ``--force`` run that has not finished (:data:`FORCED_NAME`, next to ``cfg.prompts_path``):
    while it exists the outputs there are not up to date, whatever their report says."""
    return cfg.prompts_path.parent / FORCED_NAME


def max_context_tokens(cfg: RunConfig) -> int:
    """Regeneration's context cap in tokens: ``prompts.max_context_tokens``, else ``extract.max_length``
    (02 cuts every sample there, so an answer that starts past it is never trained on)."""
    return cfg.prompts.max_context_tokens or cfg.extract.max_length


def settings(
    cfg: RunConfig, limit: Optional[int], known: Optional[dict] = None, seen: Optional[dict] = None
) -> dict:
    """The inputs that determine the outputs (stored in the report; equal settings = nothing to do).

    ``known`` / ``seen``: a source file's recorded size, mtime and hash, reused / recorded
    (:func:`source_fingerprint`); the settings are the same either way.

    Only settings that change the output count (``eagle3.manifest.PromptsManifest.CONDITIONAL``): ``seed`` with
    ``prompts.sample_size``, ``prompts.chain_conversations`` above 1 or ``prompts.self_instruct`` (it seeds the
    three; nothing else is random), ``chain_conversations`` itself only above 1, ``hf_split`` with an ``hf:`` source,
    ``top_p`` with a server ``temperature`` above 0, ``verifier_dtype`` with the in-process regeneration, which also
    records the verifier's weights (``verifier_weights``, :func:`eagle3.verifier.load.weights_fingerprint`, when its
    folder holds weight files): ``verifier.path`` pointed at other weights under the same ``verifier.name`` remakes
    the answers.
    """
    pc = cfg.prompts
    sources = [pc.source] if isinstance(pc.source, str) else list(pc.source)
    s = {
        "format": pc.format,
        "sample_size": pc.sample_size,
        "dedupe": pc.dedupe,
        "system_prompt": pc.system_prompt,
        "regenerate": pc.regenerate,
        "limit": limit,
        **(
            source_fingerprint(pc.source, known, seen)
            if isinstance(pc.source, str)
            else {"sources": [source_fingerprint(x, known, seen) for x in pc.source]}
        ),
    }
    # recorded only when on: reports made before the key stay up to date
    if pc.chain_conversations > 1:
        s["chain_conversations"] = pc.chain_conversations
    # the sample's, the chains' and the self-instruct sampling's seed; without any it picks nothing
    if pc.sample_size is not None or pc.self_instruct is not None or pc.chain_conversations > 1:
        s["seed"] = pc.seed
    if any(x.startswith("hf:") for x in sources):  # the split read from a Hugging Face dataset
        s["hf_split"] = pc.hf_split
    if pc.regenerate:
        s.update(_regenerate_settings(cfg))
    if tuple(cfg.verifier.think_tags) != ("<think>", "</think>"):
        s["think_tags"] = list(cfg.verifier.think_tags)
    # its settings, and its file (remade when its own report's settings change)
    if pc.self_instruct is not None:
        # batch_size is left out: the file's sha256 covers it, and reports made before it was a key stay up to date
        s["self_instruct"] = {
            **pc.self_instruct.model_dump(exclude={"batch_size"}),
            "file": source_fingerprint(str(cfg.self_instruct_path), known, seen),
        }
    return s


def _regenerate_settings(cfg: RunConfig) -> dict:
    """The settings of ``prompts.regenerate``: budget, context cap, verifier and template; the weights and dtype
    in-process, the endpoints' sampling otherwise."""
    pc = cfg.prompts
    s = dict(
        max_new_tokens=pc.max_new_tokens,
        max_context_tokens=max_context_tokens(cfg),
        verifier=cfg.verifier.display_name(),
        chat_template=cfg.verifier.chat_template,
    )
    # the weights and dtype that answer (endpoints answer with their own model)
    if pc.regenerate_via == "local":
        s.update(verifier_dtype=cfg.verifier.dtype, **weights_record(cfg.verifier))
    # template arguments and reply start shape the prompts the verifier answers (recorded only when set,
    # so reports written before these settings existed stay up to date)
    for key in ("chat_template_kwargs", "reply_start"):
        if getattr(cfg.verifier, key):
            s[key] = getattr(cfg.verifier, key)
    if pc.regenerate_via != "local":  # endpoints, concurrency and timeouts may change between runs
        s.update(
            regenerate_via=pc.regenerate_via,
            temperature=pc.temperature,
            model=pc.server.model,
            extra_body=pc.server.extra_body,
        )
        if pc.temperature > 0:  # greedy (temperature 0) takes the top token whatever top_p is
            s["top_p"] = pc.top_p
    return s


def read_report(cfg: RunConfig) -> tuple[Path, Optional[dict]]:
    """``(prompts_report.json's path, its content)``; the content is None when there is no ``prompts.jsonl`` (a prompts
    file written by hand), no report, or one that cannot be read or is not a JSON object (nothing to compare)."""
    out, rep = cfg.prompts_path, report_path(cfg)
    if not (out.is_file() and rep.is_file()):
        return rep, None
    try:
        report = json.loads(rep.read_text(encoding="utf-8"))
    except (
        OSError,
        ValueError,
    ):  # malformed JSON, or bytes that are not UTF-8 (UnicodeDecodeError)
        return rep, None
    return rep, report if isinstance(report, dict) else None


# 01 settings that come from other sections than ``prompts:`` (a verifier used only to regenerate may differ from the
# one 02 captures with) or from the command line only (``--limit``): not compared by 02. ``max_context_tokens`` is
# compared: it decides which conversations 01 keeps (``prompts.max_context_tokens``, else ``extract.max_length``).
_NOT_PROMPTS_SECTION = {
    "limit",
    "verifier",
    "verifier_dtype",
    "verifier_weights",
    "chat_template",
    "chat_template_kwargs",
    "reply_start",
    "think_tags",
}
_REGEN_KEYS = {"max_new_tokens", "regenerate_via", "temperature", "top_p", "model", "extra_body"}


def require_current(cfg: RunConfig) -> None:
    """Refuse a ``prompts.jsonl`` that an unfinished ``01 --force`` was remaking (:func:`forced_path`) or that 01 made
    under other ``prompts:`` settings than ``cfg``'s (:func:`eagle3.manifest.require` on its report's
    :class:`eagle3.manifest.PromptsManifest`; the report read once). Not compared: :data:`_NOT_PROMPTS_SECTION`,
    the settings 01's command line set (the report's ``cli_overrides``; a report without them: source, format and
    regenerate), a source file's size / SHA-256 when the file is no longer there. A source file is hashed only when
    its size or mtime differs from the report's :data:`SOURCE_STATS`. Nothing to compare without a report.

    Raises:
        UserError: ``<prompts_report.json>: prompts.dedupe False -> True; re-run 01_prepare_prompts.py with this
            config first`` (+ the command-line flags to give again), or the marker's line.
    """
    forced = forced_path(cfg)
    # its report still matches, but 01 was told to remake it and did not finish
    if forced.is_file():
        raise UserError(
            f"{forced}: a 01_prepare_prompts.py --force run did not finish, so {cfg.prompts_path} is the "
            f"one from before it; re-run 01 (the same command without --force resumes it) first"
        )
    rep, report = read_report(cfg)
    if report is None or not isinstance(report.get("settings"), dict):
        return
    found = PromptsManifest.of_record(report["settings"], rep)
    now = PromptsManifest.make(**settings(cfg, found.limit, known=report.get(SOURCE_STATS)))
    found = _present_files(found, now)
    cli = report.get("cli_overrides", ["source", "format", "regenerate"])
    skip = _NOT_PROMPTS_SECTION | set(cli if isinstance(cli, list) else [])
    if "regenerate" in skip and found.regenerate != now.regenerate:
        skip |= _REGEN_KEYS
    needed = {k: getattr(now, k) for k in found.changed(now) if k not in skip}
    given = report.get("cli_overrides", [])  # settings 01 took from its command line: needed again
    given = (
        [k for k in given if k in ("source", "format", "regenerate")]
        if isinstance(given, list)
        else []
    )
    them = "them" if len(given) > 1 else "it"
    again = (
        f" (it was run with {', '.join('--' + k for k in given)} on its command line: give {them} again, or "
        f"put {them} in the config)"
        if given
        else ""
    )
    require(found, needed, f"01_prepare_prompts.py with this config first{again}")


def _present_files(found: PromptsManifest, now: PromptsManifest) -> PromptsManifest:
    """``found`` with the size / SHA-256 left out of every source file (and ``prompts.self_instruct``'s file) that
    ``now`` no longer fingerprints (the file is gone, or never was one): only its name is compared."""

    def trim(old: dict, new: dict) -> dict:
        return {k: v for k, v in old.items() if k in new or k not in ("sha256", "bytes")}

    files = [trim(o, w) for o, w in zip(found.source, now.source)] + found.source[len(now.source) :]
    si_old, si_now = found.self_instruct, now.self_instruct
    if (
        isinstance(si_old, dict)
        and isinstance(si_now, dict)
        and "sha256" not in si_now.get("file", {})
    ):
        si_old = {**si_old, "file": si_now.get("file")}
    return found.model_copy(update={"source": files, "self_instruct": si_old})


def build_report(
    cfg: RunConfig,
    want: dict,
    counts: Counter,
    steps: dict,
    convs: list[dict],
    regen_stats: dict,
    answer_fields: Sequence[str] = ANSWER_FIELDS,
) -> dict:
    """``prompts_report.json``'s content: the settings, the counts of every step and the regeneration figures."""
    pc = cfg.prompts
    report = {
        "settings": want,
        "counts": {
            "read": counts["read"],
            "skipped": {
                k[len("skipped_") :]: v
                for k, v in sorted(counts.items())
                if k.startswith("skipped_")
            },
            "dropped_leading_assistant": counts["dropped_leading_assistant"],
            **steps,  # normalised, deduped, sampled_out, [chained_into,] [self_instruct, self_instruct_deduped,] limited_out,
            # [self_instruct_limited_out] (this order)
            **(left_out_by_regeneration(regen_stats) if pc.regenerate else {}),
            "kept": len(convs),
            # answered by the verifier (this run, an earlier one's resume log or prompts.reuse_answers); conversations
            # with tool results are kept as they are, not regenerated
            "regenerated": len(convs) - regen_stats.get("kept_with_tools", 0)
            if pc.regenerate
            else 0,
            # assistant replies whose inline <think> block became reasoning_content
            **(
                {"inline_reasoning_split": counts["inline_reasoning_split"]}
                if counts["inline_reasoning_split"]
                else {}
            ),
        },
    }
    # what every answer records (an up-to-date check names a file written without them)
    if pc.regenerate:
        report["answer_fields"] = list(answer_fields)
    if regen_stats:
        secs = regen_stats["seconds"]
        report["regeneration"] = {
            **regen_stats,
            "via": pc.regenerate_via,
            "tokens_per_s": regen_stats["new_tokens"] / secs if secs > 0 else None,
        }
        if pc.regenerate_via != "local":
            report["regeneration"]["sampling"] = {
                "max_new_tokens": pc.max_new_tokens,
                "temperature": pc.temperature,
                "top_p": pc.top_p,
                "chat_template_kwargs": dict(cfg.verifier.chat_template_kwargs),
                "extra_body": pc.server.extra_body,
            }
    return report


def mark_forced(cfg: RunConfig) -> None:
    """Write :func:`forced_path` (atomically; rank 0, under the writer lock) before a ``--force`` run changes
    anything, so that a forced run stopped half-way leaves its old outputs marked as not up to date. Nothing to
    mark without a ``prompts.jsonl`` (no old output to take for current)."""
    if not cfg.prompts_path.is_file():
        return
    atomic_write_json(
        forced_path(cfg),
        {
            "started_at": time.time(),
            "outputs": str(cfg.prompts_path),
            "note": "a 01_prepare_prompts.py --force run has not finished; re-run it",
        },
    )
