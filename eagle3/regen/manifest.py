"""Stage 01's manifest: ``prompts_report.json``'s settings (every input that decides ``prompts.jsonl``), the
up-to-date check, the reasons to remake, and 02's comparison of its config with them (:func:`report_changes`).

Equal settings = nothing to do: :func:`settings` holds the config fields that change the output, each source
file's size + SHA-256, the verifier and, regenerating in-process, its weights' fingerprint; with
``prompts.self_instruct`` its settings and its file's size + SHA-256. A forced run's marker (:data:`FORCED_NAME`,
beside ``prompts.jsonl`` from a ``--force`` run's start until its outputs are written) makes the old outputs not up
to date, for 01 and for 02.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from eagle3.chat.template import ANSWER_FIELDS
from eagle3.config import RunConfig
from eagle3.io import atomic_write_json
from eagle3.io.read import file_sha256
from eagle3.regen.report import REPORT_NAME
from eagle3.regen.resume_log import comparable_settings
from eagle3.verifier.load import weights_record

log = logging.getLogger(__name__)


FORCED_NAME = "prompts.forced-run.json"  # beside prompts.jsonl from a --force run's start until its outputs are written


def _had_failures(report: dict) -> bool:
    """Whether the regeneration recorded in a read ``prompts_report.json`` (:func:`read_report`) had failures."""
    return bool((report.get("regeneration") or {}).get("failed"))


def report_path(cfg: RunConfig) -> Path:
    """``prompts_report.json`` next to ``cfg.prompts_path``."""
    return cfg.prompts_path.parent / REPORT_NAME


SOURCE_STATS = (
    "source_stats"  # prompts_report.json key: {resolved source path: {bytes, mtime_ns, sha256}}
)


def _source_fingerprint(
    source: str, known: Optional[dict] = None, seen: Optional[dict] = None
) -> dict:
    """``{"source", "bytes", "sha256"}`` of a source file or a local HF dataset folder (:func:`_hf_folder_fingerprint`;
    ``{"source"}`` for a named set or a missing file).

    Args:
        known: the report's :data:`SOURCE_STATS` (``{resolved path: {"bytes", "mtime_ns", "sha256"}}``): a recorded
            hash is reused when the file's size (bytes) and ``st_mtime_ns`` (nanoseconds) equal the recorded ones,
            else the file is hashed (all of it: slow for a large source).
        seen: filled with this file's entry of :data:`SOURCE_STATS` (the size and mtime taken before hashing, so
            a file written during the hash is hashed again next time).
    """
    p = Path(source)
    if source.startswith("hf:") and Path(source[3:]).is_dir():
        return _hf_folder_fingerprint(source, Path(source[3:]), known, seen)
    if source.startswith("hf:") or source == "humaneval" or not p.is_file():
        return {"source": source}
    st, key = p.stat(), str(p.resolve())
    rec = known.get(key) if isinstance(known, dict) else None
    if (
        isinstance(rec, dict)
        and isinstance(rec.get("sha256"), str)
        and (rec.get("bytes"), rec.get("mtime_ns")) == (st.st_size, st.st_mtime_ns)
    ):
        sha = rec["sha256"]
    else:
        sha = file_sha256(p)
    if seen is not None:
        seen[key] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    return {"source": source, "bytes": st.st_size, "sha256": sha}


def _hf_folder_fingerprint(
    source: str, folder: Path, known: Optional[dict], seen: Optional[dict]
) -> dict:
    """``{"source", "bytes", "sha256"}`` of a local Hugging Face dataset folder (``hf:<path>``, ``save_to_disk`` or data
    files): the sha256 over each file's path in the folder and its content hash (entries starting with ``.`` left
    out), each file's hash reused while its size and mtime hold (``known`` / ``seen``, as for a source file). Before,
    such a source was recorded by its name alone: a dataset saved there again left ``prompts.jsonl`` "up to date" and
    02 accepted it."""
    h, total = hashlib.sha256(), 0
    files = sorted(
        f
        for f in folder.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    )
    for f in files:
        fp = _source_fingerprint(str(f), known, seen)
        h.update(f"{f.relative_to(folder).as_posix()}\0{fp['sha256']}\n".encode())
        total += fp["bytes"]
    return {"source": source, "bytes": total, "sha256": h.hexdigest()}


def settings(
    cfg: RunConfig, limit: Optional[int], known: Optional[dict] = None, seen: Optional[dict] = None
) -> dict:
    """The inputs that determine the outputs (stored in the report; equal settings = nothing to do).

    ``known`` / ``seen``: a source file's recorded size, mtime and hash, reused / recorded
    (:func:`_source_fingerprint`); the settings are the same either way.

    Only settings that change the output count (``eagle3.regen.resume_log.CONDITIONAL_KEYS``): ``seed`` with
    ``prompts.sample_size`` or ``prompts.self_instruct`` (it seeds both samplings; nothing else is random), ``hf_split`` with an ``hf:`` source, ``top_p`` with a server
    ``temperature`` above 0, ``verifier_dtype`` with the in-process regeneration, which also records the verifier's
    weights (``verifier_weights``, :func:`eagle3.verifier.load.weights_fingerprint`, when its folder holds weight files):
    ``verifier.path`` pointed at other weights under the same ``verifier.name`` remakes the answers.
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
            _source_fingerprint(pc.source, known, seen)
            if isinstance(pc.source, str)
            else {"sources": [_source_fingerprint(x, known, seen) for x in pc.source]}
        ),
    }
    if (
        pc.sample_size is not None or pc.self_instruct is not None
    ):  # the sample's and the self-instruct sampling's
        s["seed"] = pc.seed  # seed; without either it picks nothing
    if any(x.startswith("hf:") for x in sources):  # the split read from a Hugging Face dataset
        s["hf_split"] = pc.hf_split
    if pc.regenerate:
        s.update(
            max_new_tokens=pc.max_new_tokens,
            max_context_tokens=max_context_tokens(cfg),
            verifier=cfg.verifier.display_name(),
            chat_template=cfg.verifier.chat_template,
        )
        if (
            pc.regenerate_via == "local"
        ):  # the weights and dtype that answer (endpoints answer with their own model)
            s.update(verifier_dtype=cfg.verifier.dtype, **weights_record(cfg.verifier))
        # template arguments and reply start shape the prompts the verifier answers (recorded only when set,
        # so reports written before these settings existed stay up to date)
        for key in ("chat_template_kwargs", "reply_start"):
            if getattr(cfg.verifier, key):
                s[key] = getattr(cfg.verifier, key)
        if (
            pc.regenerate_via != "local"
        ):  # endpoints, concurrency and timeouts may change between runs
            s.update(
                regenerate_via=pc.regenerate_via,
                temperature=pc.temperature,
                model=pc.server.model,
                extra_body=pc.server.extra_body,
            )
            if pc.temperature > 0:  # greedy (temperature 0) takes the top token whatever top_p is
                s["top_p"] = pc.top_p
    if tuple(cfg.verifier.think_tags) != ("<think>", "</think>"):
        s["think_tags"] = list(cfg.verifier.think_tags)
    if (
        pc.self_instruct is not None
    ):  # its settings, and its file (remade when its own report's settings change)
        # batch_size is left out: the file's sha256 covers it, and reports made before it was a key stay up to date
        s["self_instruct"] = {
            **pc.self_instruct.model_dump(exclude={"batch_size"}),
            "file": _source_fingerprint(str(cfg.self_instruct_path), known, seen),
        }
    return s


def forced_path(cfg: RunConfig) -> Path:
    """The marker of a ``--force`` run that has not finished (:data:`FORCED_NAME`, next to ``cfg.prompts_path``):
    while it exists the outputs there are not up to date, whatever their report says."""
    return cfg.prompts_path.parent / FORCED_NAME


def max_context_tokens(cfg: RunConfig) -> int:
    """Regeneration's context cap in tokens: ``prompts.max_context_tokens``, else ``extract.max_length``
    (02 cuts every sample there, so an answer that starts past it is never trained on)."""
    return cfg.prompts.max_context_tokens or cfg.extract.max_length


def _brief(value, limit: Optional[int] = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a source hash, a chat template) for one log line (None: whole)."""
    text = repr(value)
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _change_lines(key: str, old, want, limit: Optional[int] = 200) -> list[str]:
    """``key: old -> new`` (each cut to ``limit``), or for two mappings (``self_instruct``) one line per changed
    sub-key (:func:`_sub_changes`)."""
    if isinstance(old, dict) and isinstance(want, dict):
        return _sub_changes(key, old, want)
    return [f"{_SETTING_LABELS.get(key, key)}: {_brief(old, limit)} -> {_brief(want, limit)}"]


# settings keys that are no config key of their own: named with where they come from, so a user who changed
# extract.max_length (not prompts.max_context_tokens, which a config rarely sets) finds the edit in the message
_SETTING_LABELS = {
    "max_context_tokens": "max_context_tokens (prompts.max_context_tokens, else extract.max_length)",
    "verifier_weights": "verifier_weights (the weight files at verifier.path)",
}


def redo_reason(out: Path, rep: Path, report: Optional[dict], want: dict) -> Optional[str]:
    """Why an existing ``prompts.jsonl`` is made again: the settings that differ from the ones in
    ``prompts_report.json`` (``rep``, its content ``report`` as :func:`read_report` gives it; ``key: old -> new``,
    every key of :func:`settings`), a missing or unreadable report, or regeneration failures last time. None when
    there is no ``prompts.jsonl`` yet (nothing is replaced) or it is up to date."""
    if not out.is_file():
        return None
    if not rep.is_file():
        return f"no {rep.name} beside it"
    old = report.get("settings") if report is not None else None
    if not isinstance(old, dict):
        return f"{rep.name} has no readable settings"
    old = comparable_settings(old, want)
    keys = [k for k in sorted(set(old) | set(want)) if old.get(k) != want.get(k)]
    if keys:
        parts = source_changes(old, want)  # a file's size and hash follow its name
        for k in (k for k in keys if k not in _SOURCE_KEYS):
            parts += _change_lines(k, old.get(k, "unset"), want.get(k, "unset"))
        return "settings changed: " + "; ".join(parts)
    if _had_failures(report):
        return "conversations failed to regenerate last time: retrying them"
    return None


def _source_files(fp: dict) -> list[dict]:
    """The source fingerprints of a settings mapping: ``[{source, bytes?, sha256?}]`` of one ``source`` or the
    ``sources`` list."""
    if "sources" in fp and isinstance(fp["sources"], list):
        return [x if isinstance(x, dict) else {"source": x} for x in fp["sources"]]
    return [{k: fp[k] for k in ("source", "bytes", "sha256") if k in fp}] if "source" in fp else []


def source_changes(old: dict, want: dict) -> list[str]:
    """How the source files of two settings mappings differ, in the config's words: ``source: 'a.jsonl' -> 'b.jsonl'``
    (a list when either names several) when the names differ, else ``the content of <file> changed`` for each file
    whose size or sha256 differs; [] when they agree. Before, 01's ``remaking`` line and 02's refusal printed the
    whole fingerprints (``bytes: 223 -> 311; sha256: '05e8...' -> 'e310...'``, about 600 characters for two files)."""
    o, w = _source_files(old), _source_files(want)
    if o == w:
        return []
    names_o, names_w = [x.get("source") for x in o], [x.get("source") for x in w]
    if names_o != names_w:

        def one(names):
            return _brief(names[0] if len(names) == 1 else names if names else "unset")

        return [f"source: {one(names_o)} -> {one(names_w)}"]
    return [f"the content of {b.get('source')} changed" for a, b in zip(o, w) if a != b]


def _sub_changes(key: str, old: dict, want: dict) -> list[str]:
    """``key.sub: old -> new`` for each differing sub-key of a mapping setting (``self_instruct``); a file
    fingerprint (``{"source", "bytes", "sha256"}``) whose name is unchanged reads ``the content of <file> changed``."""
    out = []
    for sub in sorted(set(old) | set(want)):
        o, w = old.get(sub, "unset"), want.get(sub, "unset")
        if o == w:
            continue
        if (
            isinstance(o, dict)
            and isinstance(w, dict)
            and "source" in w
            and o.get("source") == w["source"]
        ):
            out.append(f"the content of {w['source']} changed")
        else:
            out.append(f"{key}.{sub}: {_brief(o)} -> {_brief(w)}")
    return out


def up_to_date(report: Optional[dict], want: dict) -> bool:
    """Both outputs exist (``report``: :func:`read_report`'s content, None without ``prompts.jsonl`` or a readable
    report), the report's settings equal ``want`` and no regeneration failed last time."""
    old = report.get("settings") if isinstance(report, dict) else None
    return (
        isinstance(old, dict)
        and comparable_settings(old, want) == want
        and not _had_failures(report)
    )


# 01 settings that come from other sections than ``prompts:`` (a verifier used only to regenerate may differ
# from the one 02 captures with) or from the command line only (``--limit``): not compared by prompts_changes.
# ``max_context_tokens`` is compared: it decides which conversations 01 keeps (``prompts.max_context_tokens``, or
# ``extract.max_length`` when unset)
_NOT_PROMPTS_SECTION = (
    "limit",
    "verifier",
    "verifier_dtype",
    "verifier_weights",
    "chat_template",
    "chat_template_kwargs",
    "reply_start",
    "think_tags",
)


_SOURCE_KEYS = ("source", "sources", "bytes", "sha256")


_REGEN_KEYS = ("max_new_tokens", "regenerate_via", "temperature", "top_p", "model", "extra_body")


def prompts_changes(cfg: RunConfig) -> tuple[Path, list[str]]:
    """The ``prompts:`` settings of ``cfg`` that differ from the ones ``prompts.jsonl`` was made under.

    Compares :func:`settings` of ``cfg`` with ``prompts_report.json``'s (``--limit`` taken from the report).
    Not compared: settings of other sections (:data:`_NOT_PROMPTS_SECTION`), settings 01's command line set
    (the report's ``cli_overrides``; a report written before they were recorded: source, format and
    regenerate) and a source file's size/SHA-256 when the file is no longer there.

    Returns:
        ``(report path, ["key: old -> new", ...])``; the list is empty when nothing differs, or when there
        is no report or no ``prompts.jsonl`` (a prompts file written by hand) or the report has no settings.
    """
    rep, report = read_report(cfg)
    return rep, report_changes(cfg, report)


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


def report_changes(cfg: RunConfig, report: Optional[dict]) -> list[str]:
    """:func:`prompts_changes` against an already read ``prompts_report.json`` content (:func:`read_report`):
    ``["key: old -> new", ...]``, empty when nothing differs or ``report`` is None / has no settings. A source file
    is hashed only when its size or mtime differs from the report's :data:`SOURCE_STATS` (else its hash is reused)."""
    old = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(old, dict):
        return []
    want = settings(
        cfg, old.get("limit"), known=report.get(SOURCE_STATS)
    )  # only a change to detect: a recorded
    # hash is reused while the source's size and mtime are unchanged
    old = comparable_settings(old, want)
    skip = set(_NOT_PROMPTS_SECTION)
    cli = report.get("cli_overrides", ["source", "format", "regenerate"])
    for key in cli if isinstance(cli, list) else []:
        skip.update(_SOURCE_KEYS if key == "source" else (key,))
        if key == "regenerate" and old.get("regenerate") != want.get("regenerate"):
            skip.update(_REGEN_KEYS)
    if "sha256" not in want:  # the source file is gone (or never was one): compare its name only
        old.pop("sha256", None), old.pop("bytes", None)
    si_old, si_want = old.get("self_instruct"), want.get("self_instruct")
    if (
        isinstance(si_old, dict)
        and isinstance(si_want, dict)
        and "sha256" not in si_want.get("file", {})
    ):
        old["self_instruct"] = {
            **si_old,
            "file": si_want["file"],
        }  # the self-instruct file is gone: its settings only
    if isinstance(old.get("sources"), list) and isinstance(want.get("sources"), list):
        old["sources"] = [
            {k: v for k, v in o.items() if k in w or k not in ("sha256", "bytes")}
            if isinstance(o, dict)
            else o
            for o, w in zip(old["sources"], want["sources"])
        ] + old["sources"][len(want["sources"]) :]
    changes = [] if skip & set(_SOURCE_KEYS) else source_changes(old, want)
    for k in sorted((set(old) | set(want)) - skip - set(_SOURCE_KEYS)):
        o, w = old.get(k, "unset"), want.get(k, "unset")
        if o == w:
            continue
        # self_instruct: the changed sub-keys, not both whole mappings with the file's sha256 (02's refusal was ~700
        # characters for self_instruct.num: 8 -> 9); a mapping against no mapping cut to 120 characters
        changes += _change_lines(
            k, o, w, 120 if isinstance(o, dict) or isinstance(w, dict) else None
        )
    return changes


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
            **steps,  # normalised, deduped, sampled_out, [self_instruct, self_instruct_deduped,] limited_out,
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
    if (
        pc.regenerate
    ):  # what every answer records (an up-to-date check names a file written without them)
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


def left_out_by_regeneration(regen_stats: dict) -> dict:
    """The conversations the regeneration left out, so that the report's counts add up (``kept`` = ``normalised`` -
    ``deduped`` - ``sampled_out`` [+ ``self_instruct`` - ``self_instruct_deduped``] - ``limited_out`` - these):
    ``dropped_over_context`` (first prompt at or over the context cap) and, through endpoints, ``failed``. Before,
    they were only in ``regeneration``: the counts, the Markdown table and the closing line said 12 read, none
    skipped, deduplicated or limited out, and 10 kept."""
    out = {"dropped_over_context": regen_stats.get("dropped_over_context", 0)}
    if "failed" in regen_stats:
        out["failed"] = regen_stats["failed"]
    return out


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
