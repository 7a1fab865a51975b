"""04's train folder: the lock one 04 holds on it, the refusal of existing checkpoints without ``--resume``, and the
undoing of what a refused start created.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from eagle3.errors import UserError
from eagle3.io import exclusive_lock, make_dirs
from eagle3.process_group import Dist
from eagle3.train import checkpoint as ckpt
from eagle3.train import resume_checks
from eagle3.train.ranks import any_rank
from eagle3.verifier.head import FILENAME as TARGET_HEAD_FILE

TRAIN_LOCK = ".train.lock"  # held while a 04 trains or exports in train_dir
# 04's disk-full advice (eagle3.io.rerun_hint)
REDO_HINT = "re-run the same command with --resume (04 continues from the newest checkpoint)"


def train_lock_holder(train_dir: Path) -> str:
    """The text after ``<lock>: `` when a second 04 finds ``.train.lock`` held."""
    return f"another 04_train run is training or exporting in {train_dir}; wait for it to end (or stop it) before this one"


@contextlib.contextmanager
def train_lock(train_dir: Path, d: Dist, field: str = "train.output_dir"):
    """Hold ``{train_dir}/.train.lock`` (rank 0) for the whole of 04: a second 04 on the folder stops at once with one line
    on every rank. Folders this call created are removed when the block fails and leaves them empty.
    """
    created = [p for p in (train_dir, *train_dir.parents) if not p.exists()]  # deepest first
    holder = train_lock_holder(train_dir)
    with contextlib.ExitStack() as stack:
        failed = None
        if d.is_main:
            try:
                make_dirs(train_dir, field)
                stack.enter_context(exclusive_lock(train_dir / TRAIN_LOCK, holder))
            except UserError as e:
                failed = e
        if any_rank(failed is not None, d):
            raise failed or UserError(f"{train_dir / TRAIN_LOCK}: {holder}")
        try:
            yield
        except BaseException:
            stack.close()  # the lock file goes first, then the folders this call made, if empty
            with contextlib.suppress(OSError):
                for folder in created if d.is_main else ():
                    folder.rmdir()
            raise


@contextlib.contextmanager
def undo_on_refusal(train_dir: Path, enabled: bool):
    """Around 04's setup: on a UserError or KeyboardInterrupt, rank 0 (``enabled``) removes what this call created
    (``target_head.safetensors``, an empty ``train_dir``), then re-raises; an earlier run's files are kept.
    """
    head = Path(train_dir) / TARGET_HEAD_FILE
    had_dir, had_head = Path(train_dir).exists(), head.exists()
    try:
        yield
    except (UserError, KeyboardInterrupt):
        if enabled:
            if not had_head:
                with contextlib.suppress(OSError):
                    head.unlink(missing_ok=True)
            if not had_dir:
                with contextlib.suppress(OSError):  # not empty: something else is in it, keep it
                    Path(train_dir).rmdir()
        raise


def check_train_dir(
    train_dir: Path, data_dir: Path, d: Dist, resume: bool, current: Callable[[], dict]
) -> None:
    """Refuse existing checkpoints without ``resume`` (:func:`without_resume_refusal`, judged against ``current()``, called
    only then); drop stale temp files (rank 0).
    """
    if ckpt.list_checkpoints(train_dir) and not resume:
        raise UserError(without_resume_refusal(train_dir, data_dir, current()))
    if d.is_main and train_dir.is_dir():
        ckpt.remove_stale_tmp(train_dir)


def without_resume_refusal(train_dir: Path, data_dir: Path, current: dict) -> str:
    """The one line refusing a 04 without ``--resume`` in a folder with checkpoints: ``pass --resume`` when the resume's
    checks against ``current`` (:func:`eagle3.train.inputs.resume_current`) pass (naming the step
    taken when the newest file does not load), else why not and the alternatives (a new ``train.output_dir``, or
    deleting the checkpoints).
    """
    where = ckpt.ckpt_dir(train_dir)
    existing = ckpt.list_checkpoints(train_dir)
    head = f"{where}: holds checkpoints (newest step {existing[-1][0]})"
    try:
        path, state = ckpt.find_latest_checkpoint(train_dir, warn=False)
        resume_checks.check_resume(path, state, current, data_dir)
    except UserError as e:
        return (
            f"{head}, and --resume would refuse them: {e}; so train into a new folder (--set "
            f"train.output_dir=...), or delete {where} to start this one over (04 has no --overwrite)"
        )
    older = f" from step {state['step']}, the newest that loads"
    older = "" if int(state["step"]) == existing[-1][0] else older
    return f"{head}; pass --resume to continue{older}, or set train.output_dir to a new folder"
