"""The stage-02 shards folder: file names, the lock, the per-rank manifests, what ``--overwrite``
deletes.

Crash safety (any kill recovers by re-running): shards are written atomically; after each lands,
``manifest.jsonl`` (``manifest.rank{r}.jsonl`` under torchrun) gets its row (fsynced), and an idx is
finished when row and shard both exist (:func:`eagle3.capture.resume.resume_state`);
``extract_state.json`` (settings) is written first, ``data_config.json`` last; leftover rank
manifests are merged at the next start (:func:`merge_rank_manifests`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from eagle3.io import TMP_MARK, exclusive_lock
from eagle3.shards.format import DATA_CONFIG, EXTRACT_LOCK
from eagle3.shards.manifest import MANIFEST, read_manifest, rewrite_manifest

STATE = "extract_state.json"
LOCK = EXTRACT_LOCK  # shards/.extract.lock (03 checks it: eagle3.stages.prepare_data)
REPORT_JSON = "extract_report.json"
REPORT_MD = "extract_report.md"
RANK_MANIFEST_PREFIX = "manifest.rank"


def is_stage_file(p: Path) -> bool:
    name = p.name
    return (
        name in (MANIFEST, DATA_CONFIG, STATE, REPORT_JSON, REPORT_MD)
        or is_rank_manifest(name)
        or TMP_MARK in name
        or (name.startswith("data_") and name.endswith(".pt"))
    )


def rank_manifest_name(rank: int) -> str:
    """File name of rank ``rank``'s manifest under torchrun: ``manifest.rank{rank}.jsonl``."""
    return f"{RANK_MANIFEST_PREFIX}{int(rank)}.jsonl"


def is_rank_manifest(name: str) -> bool:
    """True for ``manifest.rank{r}.jsonl`` names (``r`` a non-negative integer)."""
    mid = name[len(RANK_MANIFEST_PREFIX) : -len(".jsonl")]
    return name.startswith(RANK_MANIFEST_PREFIX) and name.endswith(".jsonl") and mid.isdigit()


def merge_rank_manifests(root: Path) -> int:
    """Fold every ``manifest.rank*.jsonl`` in ``root`` into ``manifest.jsonl`` (written atomically
    first, last row per idx wins, torn last lines dropped), then delete them. Returns the files merged.

    Raises:
        UserError: a rank manifest is corrupt other than in its last line.
    """
    if not root.is_dir():
        return 0
    parts = sorted(p for p in root.iterdir() if p.is_file() and is_rank_manifest(p.name))
    if not parts:
        return 0
    rows = dict(read_manifest(root / MANIFEST).rows)
    for p in parts:
        rows.update(read_manifest(p).rows)
    rewrite_manifest(root / MANIFEST, rows)
    for p in parts:
        p.unlink()
    return len(parts)


def _wipe_targets(root: Path) -> tuple[list[Path], list[Path]]:
    """``(files, rows_* folders)`` that :func:`wipe_shards_dir` deletes under ``root``."""
    files: list[Path] = []
    dirs: list[Path] = []
    if not root.is_dir():
        return files, dirs
    for entry in list(root.iterdir()):
        if entry.is_dir() and entry.name.startswith("rows_"):
            files += [f for f in entry.iterdir() if f.is_file() and is_stage_file(f)]
            dirs.append(entry)
        elif entry.is_file() and is_stage_file(entry):
            files.append(entry)
    return files, dirs


def wipe_frees_bytes(root: Path) -> int:
    """Bytes the filesystem gets back when :func:`wipe_shards_dir` runs on ``root`` (allocated blocks
    of the files it deletes, ``st_blocks x 512``): what ``--overwrite`` may count as free in the disk
    plan, which runs before anything is deleted."""
    files, _ = _wipe_targets(root)
    return sum(f.stat().st_blocks * 512 for f in files)


def wipe_shards_dir(root: Path) -> int:
    """Delete this stage's files under ``root`` (never others); returns the number removed."""
    files, dirs = _wipe_targets(root)
    for f in files:
        f.unlink()
    for entry in dirs:
        try:
            entry.rmdir()
        except OSError:
            pass  # the user put something else there: keep it
    return len(files)


def iter_stage_files(root: Path):
    for entry in root.iterdir():
        rows_dir = entry.is_dir() and entry.name.startswith("rows_")
        if entry.name != STATE and (rows_dir or (entry.is_file() and is_stage_file(entry))):
            yield entry


def remove_fresh_folder(created: list[Path]) -> None:
    """Undo what a refused run did to the folders it created (``created``: the shards folder and the
    missing parents, deepest first): its state file, lock and the folders, only while they hold nothing
    else (captured shards are never removed here)."""
    root = created[0]
    if root.is_dir() and {p.name for p in root.iterdir()} <= {STATE, LOCK}:
        for name in (STATE, LOCK):
            (root / name).unlink(missing_ok=True)
    for folder in created:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty


def exclusive(root: Path):
    """Exclusive ``flock`` on ``{root}/.extract.lock`` (:func:`eagle3.io.exclusive_lock`).

    Raises:
        UserError: another stage-02 process is writing to ``root``.
    """
    return exclusive_lock(root / LOCK, f"another 02_extract_hidden run is writing to {root}")


def finished_rows(root: Path) -> int:
    """Finished shards recorded in ``root``'s ``manifest.jsonl`` and the torchrun ranks' ``manifest.rank*.jsonl``
    (read by :func:`eagle3.shards.manifest.read_manifest`, a torn last line not counted)."""
    return sum(
        len(read_manifest(p).rows)
        for p in [root / MANIFEST, *root.glob(RANK_MANIFEST_PREFIX + "*.jsonl")]
    )
