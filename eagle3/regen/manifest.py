"""Stage 01's manifest, the part that takes plain settings mappings: a source's size + SHA-256 fingerprint
(:func:`source_fingerprint`), the up-to-date check (:func:`up_to_date`), the reason to remake (:func:`redo_reason`)
and the ``prompts:``-section differences that 02 refuses on (:func:`settings_changes`). The mapping itself is made
from the run config by :mod:`eagle3.stages.prompts_manifest`.

A forced run's marker (:data:`FORCED_NAME`, beside ``prompts.jsonl`` from a ``--force`` run's start until its outputs
are written) makes the old outputs not up to date, for 01 and for 02.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional

from eagle3.io.read import file_sha256
from eagle3.regen.resume_log import comparable_settings

log = logging.getLogger(__name__)


FORCED_NAME = "prompts.forced-run.json"  # beside prompts.jsonl from a --force run's start until its outputs are written


def _had_failures(report: dict) -> bool:
    """Whether the regeneration recorded in a read ``prompts_report.json`` had failures."""
    return bool((report.get("regeneration") or {}).get("failed"))


SOURCE_STATS = (
    "source_stats"  # prompts_report.json key: {resolved source path: {bytes, mtime_ns, sha256}}
)


def source_fingerprint(
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
    out), each file's hash reused while its size and mtime hold (``known`` / ``seen``, as for a source file), so a
    dataset saved there again makes ``prompts.jsonl`` not up to date."""
    h, total = hashlib.sha256(), 0
    files = sorted(
        f
        for f in folder.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    )
    for f in files:
        fp = source_fingerprint(str(f), known, seen)
        h.update(f"{f.relative_to(folder).as_posix()}\0{fp['sha256']}\n".encode())
        total += fp["bytes"]
    return {"source": source, "bytes": total, "sha256": h.hexdigest()}


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
    ``prompts_report.json`` (``rep``, its content ``report`` as :func:`eagle3.stages.prompts_manifest.read_report` gives it; ``key: old -> new``,
    every key of :func:`eagle3.stages.prompts_manifest.settings`), a missing or unreadable report, or regeneration failures last time. None when
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
    whose size or sha256 differs; [] when they agree (never the whole fingerprints: one short line a file)."""
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
    """Both outputs exist (``report``: :func:`eagle3.stages.prompts_manifest.read_report`'s content, None without ``prompts.jsonl`` or a readable
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


def left_out_by_regeneration(regen_stats: dict) -> dict:
    """The conversations the regeneration left out, so that the report's counts add up (``kept`` = ``normalised`` -
    ``deduped`` - ``sampled_out`` [+ ``self_instruct`` - ``self_instruct_deduped``] - ``limited_out`` - these):
    ``dropped_over_context`` (first prompt at or over the context cap) and, through endpoints, ``failed``."""
    out = {"dropped_over_context": regen_stats.get("dropped_over_context", 0)}
    if "failed" in regen_stats:
        out["failed"] = regen_stats["failed"]
    return out


def settings_changes(report: dict, old: dict, want: dict) -> list[str]:
    """``["key: old -> new", ...]`` between a read report's settings ``old`` and ``want``, in the ``prompts:``
    section's words: keys of other sections (:data:`_NOT_PROMPTS_SECTION`) and the report's ``cli_overrides``
    (default: source, format and regenerate) are skipped, a source file no longer there is compared by name."""
    old = comparable_settings(old, want)
    skip = set(_NOT_PROMPTS_SECTION)
    cli = report.get("cli_overrides", ["source", "format", "regenerate"])
    for key in cli if isinstance(cli, list) else []:
        skip.update(_SOURCE_KEYS if key == "source" else (key,))
        if key == "regenerate" and old.get("regenerate") != want.get("regenerate"):
            skip.update(_REGEN_KEYS)
    _compare_present_files(old, want)
    changes = [] if skip & set(_SOURCE_KEYS) else source_changes(old, want)
    for k in sorted((set(old) | set(want)) - skip - set(_SOURCE_KEYS)):
        o, w = old.get(k, "unset"), want.get(k, "unset")
        if o == w:
            continue
        # self_instruct: the changed sub-keys, not both whole mappings with the file's sha256; a mapping against
        # no mapping cut to 120 characters
        changes += _change_lines(
            k, o, w, 120 if isinstance(o, dict) or isinstance(w, dict) else None
        )
    return changes


def _compare_present_files(old: dict, want: dict) -> None:
    """Drop from ``old`` (in place) the size / sha256 of every source file that ``want`` no longer fingerprints
    (the file is gone, or never was one), so that only its name is compared."""
    if "sha256" not in want:
        old.pop("sha256", None), old.pop("bytes", None)
    si_old, si_want = old.get("self_instruct"), want.get("self_instruct")
    if (
        isinstance(si_old, dict)
        and isinstance(si_want, dict)
        and "sha256" not in si_want.get("file", {})
    ):
        old["self_instruct"] = {**si_old, "file": si_want["file"]}
    if isinstance(old.get("sources"), list) and isinstance(want.get("sources"), list):
        old["sources"] = [
            {k: v for k, v in o.items() if k in w or k not in ("sha256", "bytes")}
            if isinstance(o, dict)
            else o
            for o, w in zip(old["sources"], want["sources"])
        ] + old["sources"][len(want["sources"]) :]
