"""Training checkpoints: atomic write, newest-complete lookup with fallback, pruning, RNG state.

Layout: ``{train_dir}/checkpoints/step_{N:08d}.pt`` (N = optimizer steps taken), one
``torch.save`` dict written by rank 0 through :func:`eagle3.io.atomic_torch_save` (temp name +
rename), so a file with the final name is complete; a kill mid-write leaves an ignorable
``step_*.pt.tmp-*`` file. The dict holds only tensors, numbers, strings, lists and dicts, so it
loads with ``torch.load(weights_only=True)`` (:func:`eagle3.io.read.safe_torch_load`).

Keys (:data:`REQUIRED_KEYS`): ``format``, ``step``, ``epoch``, ``samples_in_epoch`` (global
samples of the current epoch already consumed), ``model`` (trainable parameters only: the frozen
embedding and the d2t/t2d buffers come from the verifier and the vocab map), ``optimizer``,
``scheduler``, ``rng`` (one entry per rank: torch/cuda/python/numpy states), ``drafter_args``,
``config_fingerprint``, ``world_size``. Optional (a checkpoint without one skips that check on resume):
``steps_in_epoch``, ``data_order``, ``init_from``, ``recipe`` (the values in use: :data:`eagle3.train.resume_checks.KEPT_FIELDS` from the optimizer,
not the config), ``data_inputs`` (sha256 of the split and vocab map trained on; :func:`eagle3.train.resume_checks.check_resume`) and
``data_config`` (what ``--export-only`` reads of the shards' data_config.json: :func:`eagle3.train.resume_checks.data_config_record`) and
``segments`` (one part per 04 call that trained: steps, state source, processes, tokens/s;
:func:`eagle3.train.report.segment_record`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import UserError
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
_NAME_RE = re.compile(r"^step_(\d{8})\.pt$")


def ckpt_dir(train_dir: str | os.PathLike) -> Path:
    """``{train_dir}/checkpoints``."""
    return Path(train_dir) / "checkpoints"


def ckpt_path(train_dir: str | os.PathLike, step: int) -> Path:
    """``{train_dir}/checkpoints/step_{step:08d}.pt``."""
    return ckpt_dir(train_dir) / f"step_{step:08d}.pt"


def list_checkpoints(train_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Finished checkpoints as ``(step, path)``, oldest first; temp files (``*.tmp-*``) are ignored."""
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
    """Delete temp files of interrupted writes: checkpoints (``checkpoints/``) and the files 04 writes directly in
    ``train_dir`` (``best_drafter.pt``, ``sim_accept.json``, ``train_report.json``, ...: a hard kill during one left
    a ``<name>.tmp-*`` file, as large as the drafter for the best weights, that no later run removed; not recursive
    there). Call on rank 0 under 04's lock, before training. Returns the count."""
    n = len(_remove_tmp(ckpt_dir(train_dir)))
    root = Path(train_dir)
    for p in root.glob(f"*{TMP_MARK}*") if root.is_dir() else ():
        if p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


def save_checkpoint(train_dir: str | os.PathLike, state: dict, keep: int) -> Path:
    """Write ``state`` (must contain :data:`REQUIRED_KEYS` except ``format``) atomically, then keep the newest ``keep``.

    Returns:
        The checkpoint path.

    Raises:
        ValueError: a required key is missing (a caller bug).
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
    """Delete all but the newest ``keep >= 1`` finished checkpoints. Returns the deleted paths."""
    ckpts = list_checkpoints(train_dir)
    removed = []
    for _step, p in ckpts[: max(0, len(ckpts) - max(1, keep))]:
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load and validate one checkpoint (weights-only).

    Raises:
        UserError: truncated/corrupt/unsafe file, wrong format, or a missing key (named).
    """
    path = Path(path)
    state = safe_torch_load(path)
    if not isinstance(state, dict):
        raise UserError(f"{path}: not a training checkpoint (top level is {type(state).__name__})")
    if state.get("format") != FORMAT:
        raise UserError(f"{path}: key 'format' is {state.get('format')!r}, expected {FORMAT!r}")
    for k in REQUIRED_KEYS:
        if k not in state:
            raise UserError(f"{path}: missing key '{k}'")
    return state


def find_latest_checkpoint(
    train_dir: str | os.PathLike, fallback: bool = True, warn: bool = True
) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint that loads and validates, falling back to older ones with a warning.

    Every caller that needs "the newest checkpoint" goes through here (``04 --resume``: ``_Training.restore``;
    ``04 --export-only``: ``eagle3.stages.export.export_from_checkpoint``). A file that does not load is
    skipped with a warning naming it and why; a folder whose checkpoint files ALL fail is an error, never "no
    checkpoint": ``--resume`` would otherwise start again from step 0 and overwrite the run's export.

    Args:
        fallback: False = the newest file must load: when it does not but an older one does, a UserError names the
            broken file and the older one's step (``--export-only`` is asked for the newest weights, not older
            ones; ``--resume`` falls back, training goes on from the older step).
        warn: log the skipped files (False: the other torchrun ranks of a ``--resume``, which load the same files;
            rank 0 says it once).

    Returns:
        ``(path, state)``, or None when the folder holds no checkpoint file (``step_*.pt``) at all.

    Raises:
        UserError: checkpoint files exist but none loads; one line naming the folder, the count, the newest
            file and why it did not load. With ``fallback=False``: the newest file does not load (one line: it, why,
            the older step that loads, and the ways on).
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


def config_fingerprint(obj: Any) -> str:
    """sha256 (hex, 16 chars) of a JSON-serialisable object (sorted keys): identifies the training setup."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode("utf-8")).hexdigest()[
        :16
    ]


# ---- RNG ----------------------------------------------------------------------------------------
def capture_rng() -> dict:
    """This process's RNG states (torch CPU, all CUDA devices, Python ``random``, NumPy) as weights-only-safe values."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _py_state_to_list(random.getstate()),
    }
    state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:  # pragma: no cover - numpy is a torch/matplotlib dependency
        state["numpy"] = None
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng` (CUDA states restored only when the device count matches)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_py_state_from_list(state["python"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    np_state = state.get("numpy")
    if np_state is not None:
        import numpy as np

        np.random.set_state(
            (
                np_state["name"],
                np_state["keys"].numpy().astype("uint32"),
                np_state["pos"],
                np_state["has_gauss"],
                np_state["cached_gaussian"],
            )
        )


def _py_state_to_list(s: tuple) -> list:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _py_state_from_list(s: list) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
