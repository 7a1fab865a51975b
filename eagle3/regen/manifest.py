"""Stage 01's manifest, the part that takes plain settings mappings: a source's size + SHA-256 fingerprint
(:func:`source_fingerprint`), and, through :class:`eagle3.manifest.PromptsManifest`, the up-to-date check
(:func:`up_to_date`) and the reason to remake (:func:`redo_reason`). The mapping itself is made from the run config
by :mod:`eagle3.stages.prompts_manifest`.

A forced run's marker (:data:`FORCED_NAME`, beside ``prompts.jsonl`` from a ``--force`` run's start until its outputs
are written) makes the old outputs not up to date, for 01 and for 02.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from eagle3.errors import UserError
from eagle3.io.read import file_sha256
from eagle3.manifest import PromptsManifest
from eagle3.regen.report import REPORT_NAME

FORCED_NAME = "prompts.forced-run.json"  # beside prompts.jsonl from a --force run's start until its outputs are written


def _had_failures(report: dict) -> bool:
    """Whether the regeneration recorded in a read ``prompts_report.json`` had failures."""
    return bool((report.get("regeneration") or {}).get("failed"))


# prompts_report.json key: {resolved source path: {bytes, mtime_ns, sha256}}
SOURCE_STATS = "source_stats"


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


def recorded(report: Optional[dict], rep: Path) -> PromptsManifest | str:
    """A read ``prompts_report.json``'s (``rep``) settings as a manifest, or why there are none to compare."""
    old = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(old, dict):
        return f"{rep.name} has no readable settings"
    try:
        return PromptsManifest.of_record(old, rep)
    except UserError as e:
        return str(e)


def redo_reason(out: Path, rep: Path, report: Optional[dict], want: dict) -> Optional[str]:
    """Why an existing ``prompts.jsonl`` is made again: the settings that differ from ``prompts_report.json``'s
    (``rep``, its content ``report`` as :func:`eagle3.stages.prompts_manifest.read_report` gives it;
    :meth:`PromptsManifest.change` lines), a missing or unreadable report, or regeneration failures last time.
    None when there is no ``prompts.jsonl`` yet (nothing is replaced) or it is up to date."""
    if not out.is_file():
        return None
    if not rep.is_file():
        return f"no {rep.name} beside it"
    old = recorded(report, rep)
    if isinstance(old, str):
        return old
    now = PromptsManifest.make(**want)
    if keys := old.changed(now):
        return "settings changed: " + "; ".join(old.change(k, getattr(now, k)) for k in keys)
    if _had_failures(report):
        return "conversations failed to regenerate last time: retrying them"
    return None


def up_to_date(report: Optional[dict], want: dict) -> bool:
    """Both outputs exist (``report``: :func:`eagle3.stages.prompts_manifest.read_report`'s content, None without
    ``prompts.jsonl`` or a readable report), the report's settings equal ``want`` and no regeneration failed."""
    old = recorded(report, Path(REPORT_NAME))
    return (
        not isinstance(old, str)
        and not old.changed(PromptsManifest.make(**want))
        and not _had_failures(report)
    )


def left_out_by_regeneration(regen_stats: dict) -> dict:
    """The conversations the regeneration left out, so that the report's counts add up (``kept`` = ``normalised`` -
    ``deduped`` - ``sampled_out`` [+ ``self_instruct`` - ``self_instruct_deduped``] - ``limited_out`` - these):
    ``dropped_over_context`` (first prompt at or over the context cap) and, through endpoints, ``failed``."""
    out = {"dropped_over_context": regen_stats.get("dropped_over_context", 0)}
    if "failed" in regen_stats:
        out["failed"] = regen_stats["failed"]
    return out
