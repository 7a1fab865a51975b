"""Writing an export folder: into a temporary sibling, renamed over the destination while holding the folder's
lock; and the refusal to replace a folder that is not this project's export for the same engine."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import safetensors.torch

from eagle3.errors import UserError
from eagle3.export.common import META_FILE, WEIGHTS_FILE
from eagle3.io import atomic_write_json, disk_full_guard, exclusive_lock, file_mode, make_dirs

log = logging.getLogger(__name__)

EXPORT_LOCK_SUFFIX = ".lock"
"""``.{export folder name}.lock`` beside the export folder while an export writes it."""


def export_lock_path(out: Path) -> Path:
    """The lock file of the export folder ``out``: ``{out.parent}/.{out.name}.lock``. Beside the folder, not in it: the
    folder itself is renamed away and replaced, so a lock file inside it would not be one file for two writers."""
    return out.parent / f".{out.name}{EXPORT_LOCK_SUFFIX}"


def write_export_folder(
    out: Path, engine: str, tensors: dict, config: dict, meta: dict, provenance: Optional[dict]
) -> Path:
    """Write ``model.safetensors``, ``config.json`` and ``eagle3_train.json`` into a temporary folder beside ``out``,
    then rename it over ``out``, holding :func:`export_lock_path` (:func:`eagle3.io.exclusive_lock`) from the replace
    check to the rename: a second export into the same folder stops at once with one line, the first one's whole.

    Raises:
        UserError: ``<lock>: another 04_train run is exporting to <out>; ...``; :func:`check_replaceable`'s refusals;
            disk full (the temporary folder removed, ``out`` untouched).
    """
    make_dirs(out.parent)
    holder = (
        f"another 04_train run is exporting to {out}; wait for it to end, or set export.output_dir for a "
        f"second export folder"
    )
    with exclusive_lock(export_lock_path(out), holder):
        check_replaceable(out, engine)
        warn_other_run(out, provenance)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        # mkdtemp's 0o700 -> readable by a server of another user
        os.chmod(tmp, file_mode(directory=True))
        try:
            _write_files(tmp, out, tensors, config, meta)
            old = None
            if out.exists():
                old = out.parent / f"{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out


def _write_files(tmp: Path, out: Path, tensors: dict, config: dict, meta: dict) -> None:
    """The three files of an export into ``tmp`` (``out``: the folder named in a disk-full message)."""
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with disk_full_guard(out / WEIGHTS_FILE, size):
        # looked up at call time: tests replace it to fill the disk
        safetensors.torch.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    os.chmod(tmp / WEIGHTS_FILE, file_mode())  # safetensors writes 0o600 whatever the umask
    atomic_write_json(tmp / "config.json", config)
    atomic_write_json(tmp / META_FILE, meta)


def recorded_meta(folder: Path) -> dict:
    """The ``eagle3_train.json`` object of an export ``folder``; ``{}`` when absent, unreadable or not an object."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def warn_other_run(out: Path, provenance: Optional[dict]) -> None:
    """Log a warning when ``out`` holds an export recorded from another training folder than ``provenance``'s: a
    second run's default export folder is the first run's (``{output_root}/drafter-{engine}``), and replacing it is
    kept (re-exporting is on purpose), but not silently. Nothing is said when either side records no ``train_dir``."""
    if provenance is None or not provenance.get("train_dir"):
        return
    old = recorded_meta(out).get("trained_from") or {}
    if old.get("train_dir") and old["train_dir"] != provenance["train_dir"]:
        log.warning(
            "%s: replacing the export of another training run (%s, step %s) with this one's (%s, step %s); "
            "set export.output_dir to keep both",
            out,
            old["train_dir"],
            old.get("selected_step", "?"),
            provenance["train_dir"],
            provenance.get("selected_step", "?"),
        )


def check_replaceable(out: Path, engine: str, field: Optional[str] = None) -> None:
    """Refuse to replace a folder that is not an export of this project for the same engine, and (with ``field``, the
    config field that puts ``out`` there: 04's start-up check) a path under a file.

    Raises:
        UserError: ``<out>: <why>``: ``out`` is a file; a non-empty folder without ``eagle3_train.json``; an export
            for the other engine; or (``field``) a parent of ``out`` that is a file.
    """
    problem = _replace_problem(out, engine) if out.exists() else _under_a_file(out, field)
    if problem:
        raise UserError(f"{out}: {problem}")


def _under_a_file(out: Path, field: Optional[str]) -> Optional[str]:
    """Why ``out`` (not there) cannot be made: its nearest existing parent is a file (named with ``field``), or None."""
    parent = next((p for p in out.parents if p.exists()), None)
    if field is None or parent is None or parent.is_dir():
        return None
    return f"{field} is under {parent}, which is a file, not a folder"


def _replace_problem(out: Path, engine: str) -> Optional[str]:
    """Why the existing ``out`` is not this project's export for ``engine``, or None."""
    meta_path = out / META_FILE
    if not out.is_dir() or (not meta_path.is_file() and any(out.iterdir())):
        what = "holds files that are not an eagle3-train export" if out.is_dir() else "is a file"
        return f"export.output_dir {what}; choose an empty or new folder"
    old_engine = recorded_meta(out).get("engine")
    if old_engine is not None and old_engine != engine:
        return (
            f"holds the {old_engine} export; exporting for {engine} there would replace it "
            f"(set export.output_dir to another folder, e.g. drafter-{engine})"
        )
    return None
