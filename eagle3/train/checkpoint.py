"""Training checkpoints: ``{train_dir}/checkpoints/step_{N:08d}.pt`` (N optimizer steps), one weights-only-loadable
dict written by rank 0 atomically (a file with the final name is complete), newest-loadable lookup, pruning, RNG.

Keys: :data:`REQUIRED_KEYS` (``samples_in_epoch``: global samples of the epoch consumed; ``model``: trainable
parameters only; ``rng``: one entry per rank); optional, a resume skips the check of an absent one:
``steps_in_epoch``, ``data_order``, ``init_from``, ``recipe``, ``data_inputs``, ``data_config``, ``segments``
(:mod:`eagle3.train.resume_checks`, :func:`eagle3.train.report.segment_record`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
from pydantic import ConfigDict, create_model

from eagle3.errors import UserError, validated
from eagle3.io import TMP_MARK, atomic_torch_save
from eagle3.io import remove_stale_tmp as _remove_tmp
from eagle3.io.read import safe_torch_load

log = logging.getLogger(__name__)

FORMAT = "eagle3-train-ckpt-v1"
REQUIRED_KEYS = (
    "format",
    "step",
    "epoch",
    "samples_in_epoch",
    "model",
    "optimizer",
    "scheduler",
    "rng",
    "drafter_args",
    "config_fingerprint",
    "world_size",
)
_Head = create_model(
    "CheckpointHead",
    __config__=ConfigDict(extra="allow"),
    format=(Literal[FORMAT], ...),
    **{k: (Any, ...) for k in REQUIRED_KEYS if k != "format"},
)
"""What :func:`load_checkpoint` requires of a checkpoint: every :data:`REQUIRED_KEYS` key, ``format`` = :data:`FORMAT`."""
_NAME_RE = re.compile(r"^step_(\d{8})\.pt$")


def ckpt_dir(train_dir: str | os.PathLike) -> Path:
    """``{train_dir}/checkpoints``."""
    return Path(train_dir) / "checkpoints"


def ckpt_path(train_dir: str | os.PathLike, step: int) -> Path:
    """``{train_dir}/checkpoints/step_{step:08d}.pt``."""
    return ckpt_dir(train_dir) / f"step_{step:08d}.pt"


def list_checkpoints(train_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Finished checkpoints as ``(step, path)``, oldest first (temp files ignored)."""
    d = ckpt_dir(train_dir)
    if not d.is_dir():
        return []
    out = []
    for entry in os.scandir(d):
        m = _NAME_RE.match(entry.name)
        if m and entry.is_file():
            out.append((int(m.group(1)), Path(entry.path)))
    return sorted(out)


def remove_stale_tmp(train_dir: str | os.PathLike) -> int:
    """Delete the temp files of interrupted writes in ``checkpoints/`` and directly in ``train_dir`` (rank 0, under 04's
    lock, before training); returns the count.
    """
    n = len(_remove_tmp(ckpt_dir(train_dir)))
    root = Path(train_dir)
    for p in root.glob(f"*{TMP_MARK}*") if root.is_dir() else ():
        if p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


def save_checkpoint(train_dir: str | os.PathLike, state: dict, keep: int) -> Path:
    """Write ``state`` (:data:`REQUIRED_KEYS` but ``format``) atomically, keep the newest ``keep``; returns the path.
    ValueError on a missing key.
    """
    state = dict(state, format=FORMAT)
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"save_checkpoint: missing keys {missing}")
    path = ckpt_path(train_dir, int(state["step"]))
    atomic_torch_save(state, path)
    prune_checkpoints(train_dir, keep)
    return path


def prune_checkpoints(train_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep >= 1`` finished checkpoints; returns the deleted paths."""
    ckpts = list_checkpoints(train_dir)
    removed = []
    for _step, p in ckpts[: max(0, len(ckpts) - max(1, keep))]:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load (weights-only) and validate one checkpoint; UserError: unreadable, wrong format, missing key."""
    path = Path(path)
    state = safe_torch_load(path)
    validated(_Head, state, str(path))
    return state


def find_latest_checkpoint(
    train_dir: str | os.PathLike, fallback: bool = True, warn: bool = True
) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that loads, ``(path, state)``; None when there is no ``step_*.pt`` at all. Unloadable files
    are skipped with a warning (``warn``: rank 0 only), but all failing is an error, never "no checkpoint".

    Args:
        fallback: False: the newest file must load (``--export-only``), else a UserError names it and the older step.

    Raises:
        UserError: files exist but none loads, or (``fallback=False``) the newest does not.
    """
    found = list_checkpoints(train_dir)
    newest_error: Optional[UserError] = None
    for _step, path in reversed(found):
        try:
            state = load_checkpoint(path)
        except UserError as e:
            newest_error = newest_error or e
            if fallback and warn:
                log.warning("skipping unusable checkpoint: %s (trying the next older one)", e)
            continue
        if newest_error is not None:
            step = int(state["step"])
            if not fallback:
                raise UserError(
                    f"the newest checkpoint does not load: {newest_error}; the newest that loads is "
                    f"{path.name} (step {step}): delete {found[-1][1].name} to use step {step}, or "
                    f"04_train.py --resume to train on from it"
                )
            if warn:
                log.warning(
                    "using %s (step %d), not the newest checkpoint file %s, which does not load",
                    path.name,
                    step,
                    found[-1][1].name,
                )
        return path, state
    if found:
        raise UserError(
            f"{ckpt_dir(train_dir)}: none of its {len(found)} checkpoint file(s) loads; the newest: "
            f"{newest_error} (replace or delete the broken files, or train into a new train.output_dir)"
        )
    return None


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``requires_grad`` parameters, detached on CPU, by name."""
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters() if p.requires_grad}


def config_fingerprint(obj: Any) -> str:
    """sha256 (hex, 16 chars) of a JSON-serialisable object with sorted keys."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def capture_rng() -> dict:
    """This process's RNG states (torch CPU, CUDA, Python, NumPy) as weights-only-safe values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng` (CUDA only when the device count matches)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    s = state.get("numpy")
    if s is not None:
        keys = s["keys"].numpy().astype("uint32")
        np.random.set_state((s["name"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"]))
