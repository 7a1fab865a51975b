"""Resume: a run's position (:class:`Progress`), the checkpoint it writes, and the continuation from its newest
checkpoint, bit-identical on CPU (weights, optimizer, schedule, data position, RNG), also on another process count
(the rest of the epoch is dealt to the new ranks and the LR horizon follows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.errors import UserError
from eagle3.process_group import Dist
from eagle3.train import checkpoint as ckpt
from eagle3.train import resume_checks
from eagle3.train.order import TrainData
from eagle3.train.ranks import same_checkpoint
from eagle3.train.report import (
    earlier_segments,
    peak_gpu_mem_gib,
    segment_record,
    state_source_switch,
)
from eagle3.train.schedule import WarmupCosine, warmup_steps_for

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """One rank's position: optimizer ``step``, data position (``epoch``, ``step_in_epoch``), the schedule's
    ``total_steps``, ``stop_at`` (--stop-at), the newest checkpoint, this call's counts and the run's earlier segments.
    """

    total_steps: int
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    stop_at: Optional[int] = None
    last_ckpt: Optional[Path] = None
    steps_this_call: int = 0
    stopped: bool = False
    tok_total: float = 0.0
    t_total: float = 0.0
    earlier_segments: list = field(default_factory=list)
    segment_start: int = 0

    @property
    def end_step(self) -> int:
        """``stop_at`` when set, else ``total_steps``."""
        return self.total_steps if self.stop_at is None else self.stop_at


@dataclass
class RunRecord:
    """What a checkpoint records besides position and tensors: ``current`` (compared by
    :func:`eagle3.train.resume_checks.check_resume`), ``fingerprint``, ``train.*`` values of the same names,
    ``extract_backend`` and this call's warnings.
    """

    train_dir: Path
    data_dir: Path
    current: dict
    fingerprint: str
    seed: int
    epochs: float
    warmup_ratio: float
    keep_checkpoints: int
    hidden_states: Optional[str]
    extract_backend: Optional[str]
    warnings: list


def horizon_after_resume(state: dict, d: Dist, rec: RunRecord, total_steps: int, data, opt) -> int:
    """The step horizon after a resume on another process count (the rest of the epoch of ``data.order`` dealt to the
    new ranks, capped at ``data.horizon``; ``opt.scheduler`` re-stretched on every rank); the same process count:
    ``total_steps``.
    """
    if int(state.get("world_size", d.world)) == d.world:
        return total_steps
    new = data.order.resumed_total_steps(rec.epochs, int(state["step"]))
    if data.horizon is not None:
        new = min(new, data.horizon)
    # every rank re-stretches it (DDP replicas step with one lr); rank 0 says so
    if new != total_steps:
        if d.is_main:
            log.info(
                "resumed on %d processes (checkpoint: %s): %d optimizer steps in all",
                d.world,
                state.get("world_size"),
                new,
            )
        opt.scheduler.lr_lambdas[0].__dict__.update(
            WarmupCosine(warmup_steps_for(new, rec.warmup_ratio), new).__dict__
        )
    return new


def set_stop_at(pos: Any, stop_at: Optional[int], data: Any, epochs: float) -> None:
    """Check and set ``--stop-at`` on ``pos`` once ``total_steps`` is known. UserError: not before the schedule's end, or
    before the resumed step.
    """
    if stop_at is None:
        return
    if stop_at >= pos.total_steps:
        why = (
            f"the schedule has {pos.total_steps} optimizer steps; a stop at or after its end is the whole run "
            f"(leave --stop-at out, or {_longer_schedule(data, epochs)})"
        )
    elif stop_at < pos.step:
        why = f"the checkpoint resumed from is at step {pos.step}, past it (`--export-only` exports it)"
    else:
        pos.stop_at = stop_at
        return
    raise UserError(f"--stop-at {stop_at}: {why}")


def _longer_schedule(data: Any, epochs: float) -> str:
    """How to get a longer schedule, for the --stop-at refusal."""
    epochs_steps = data.order.total_steps
    if data.horizon is not None and data.horizon < epochs_steps:
        name = data.horizon_from.split(" ")[0]
        return (
            f"raise {name} (up to the {epochs_steps} steps of train.epochs {epochs:g}; beyond that, raise "
            f"train.epochs too)"
        )
    return f"raise train.epochs (now {epochs:g}) for a longer schedule"


def restore(
    pos: Any,
    rec: RunRecord,
    d: Dist,
    data: Any,
    opt: Any,
    inputs: Any,
    stop_at: Optional[int] = None,
) -> None:
    """Continue ``pos`` from the newest checkpoint (weights, optimizer, schedule, data position, RNG), after every check:
    :func:`eagle3.train.resume_checks.check_resume`, the horizon, ``stop_at``.

    Raises:
        UserError: a refused change, a checkpoint past the run's end, a refused ``stop_at``, a model state that does
        not fit.
    """
    found = ckpt.find_latest_checkpoint(rec.train_dir, warn=d.is_main)  # every rank loads it
    same_checkpoint(rec.train_dir, found, d)
    if found is None:  # no checkpoint file at all (files that all fail to load: UserError)
        set_stop_at(pos, stop_at, data, rec.epochs)
        if d.is_main:
            log.warning(
                "--resume: no checkpoint in %s; starting from step 0", ckpt.ckpt_dir(rec.train_dir)
            )
        return
    path, state = found
    changes = resume_checks.check_resume(path, state, rec.current, rec.data_dir)
    unchecked = resume_checks.data_inputs_unchecked(
        path, state.get("data_inputs"), rec.current["data_inputs"], "--resume"
    )
    pos.step, pos.epoch = int(state["step"]), int(state["epoch"])
    pos.step_in_epoch = data.order.step_from_checkpoint(state)
    pos.total_steps = horizon_after_resume(state, d, rec, pos.total_steps, data, opt)
    if pos.step > pos.total_steps:  # nothing to train, and the end step would be behind the weights
        raise UserError(
            f"{data.horizon_from}: the run ends after {pos.total_steps} optimizer steps, but the "
            f"checkpoint resumed from ({path}) is at step {pos.step} already; ask for more steps, or "
            f"export that checkpoint with --export-only"
        )
    set_stop_at(pos, stop_at, data, rec.epochs)
    if d.is_main:
        _resume_warnings(path, state, changes, unchecked, opt.fingerprint)
    _load_state(path, state, d, opt, inputs, rec)
    _restore_rng(path, state["rng"], d, rec.seed + 1000 * pos.step + d.rank)
    pos.last_ckpt = path
    pos.earlier_segments, pos.segment_start = earlier_segments(state), pos.step
    switch = state_source_switch(path, pos.earlier_segments, current_segment(pos, rec, d))
    if switch and d.is_main:
        log.warning("%s", switch)


def _restore_rng(path: Path, rngs: list, d: Dist, reseed: int) -> None:
    """This rank's RNG states; on another process count every rank is reseeded with ``reseed``."""
    if len(rngs) == d.world:
        ckpt.restore_rng(rngs[d.rank])
        return
    if d.is_main:
        log.warning(
            "%s: saved with %d processes, now %d; RNG states reseeded", path, len(rngs), d.world
        )
    torch.manual_seed(reseed)


def _resume_warnings(path: Path, state: dict, changes: list, unchecked, fingerprint: str) -> None:
    """Rank 0's warnings of a resume: allowed setting changes or a differing fingerprint, unchecked inputs."""
    if changes:
        log.warning(
            "%s: resumed from %s with other training settings: %s",
            path,
            path.name,
            "; ".join(changes),
        )
    elif state.get("recipe") is None and state["config_fingerprint"] != fingerprint:  # unknown
        log.warning(
            "%s: training settings differ from the checkpoint's (fingerprint %s != %s)",
            path,
            state["config_fingerprint"],
            fingerprint,
        )
    if unchecked:
        log.warning("%s", unchecked)


def _load_state(path: Path, state: dict, d: Dist, opt: Any, inputs: Any, rec: RunRecord) -> None:
    """Load weights, optimizer and scheduler (keeping this run's horizon) and ``init_from``; UserError when ``model``
    misses trainable tensors or has unexpected ones.
    """
    drafter = inputs.drafter
    missing, unexpected = drafter.load_state_dict(state["model"], strict=False)
    want = {n for n, p in drafter.named_parameters() if p.requires_grad}
    lost = sorted(want & set(missing))
    if lost or unexpected:
        raise UserError(
            f"{path}: key 'model': missing {lost[:3]} unexpected {list(unexpected)[:3]}"
        )
    opt.optimizer.load_state_dict(state["optimizer"])
    horizon_now = opt.scheduler.lr_lambdas[0].__dict__.copy()  # this run's warmup/total steps
    opt.scheduler.load_state_dict(state["scheduler"])
    if opt.scheduler.lr_lambdas[0].__dict__ != horizon_now:
        if d.is_main:  # every rank re-stretches it; rank 0 says so once
            log.warning(
                "%s: LR schedule %s in the checkpoint, now %s (%s); continuing with the new one",
                path,
                opt.scheduler.lr_lambdas[0].__dict__,
                horizon_now,
                _horizon_reason(state, rec, d),
            )
        opt.scheduler.lr_lambdas[0].__dict__.update(horizon_now)
    inputs.init_from = state.get("init_from")  # the run's warm start, recorded by its first call


def _horizon_reason(state: dict, rec: RunRecord, d: Dist) -> str:
    """Why the resumed LR schedule differs from the checkpoint's (changed keys, process count)."""
    saved, now = state.get("recipe") or {}, rec.current["recipe"]
    keys = [
        k
        for k in ("train.epochs", "train.max_steps", "train.warmup_ratio")
        if k in saved and saved[k] != now[k]
    ]
    why = [
        f"{k} {resume_checks.as_written(k, saved[k])} -> {resume_checks.as_written(k, now[k])}"
        for k in keys
    ]
    then = state.get("world_size")
    if then is not None and int(then) != d.world:
        why.append(
            f"{then} processes then, {d.world} now: the steps of train.epochs follow the new split"
        )
    return "; ".join(why) or "--max-steps, train.max_steps or train.epochs changed"


def announce_resume(pos: Any, d: Dist, order: TrainData) -> None:
    """Rank 0's line of where a resumed run stands (epochs from 0)."""
    if pos.last_ckpt is None or not d.is_main:
        return
    k = pos.step_in_epoch
    if k >= order.steps_in_epoch(pos.epoch):
        where = f"step {pos.step}, at the end of epoch {pos.epoch}"
    else:
        where = f"step {pos.step}, epoch {pos.epoch}, {k} step{'' if k == 1 else 's'} into it"
    log.info("resumed from %s (%s)", pos.last_ckpt, where)


def optimizer_values(opt: Any) -> dict:
    """``lr`` and ``weight_decay`` as the optimizer holds them (a resumed checkpoint's)."""
    return {
        "lr": float(opt.scheduler.base_lrs[0]),
        "weight_decay": float(opt.optimizer.param_groups[0]["weight_decay"]),
    }


def current_segment(pos: Any, rec: RunRecord, d: Dist) -> dict:
    """This call's part of the run (:func:`eagle3.train.report.segment_record`)."""
    return segment_record(
        pos.segment_start,
        pos.step,
        rec.hidden_states,
        rec.extract_backend,
        d.world,
        (pos.tok_total / pos.t_total) if pos.t_total > 0 else None,
        peak_gpu_mem_gib(d.device),
        rec.warnings,
    )


def segments(pos: Any, rec: RunRecord, d: Dist) -> list[dict]:
    """The run's parts with at least one step: earlier ones, then this call's."""
    return [
        g
        for g in [*pos.earlier_segments, current_segment(pos, rec, d)]
        if g["end_step"] > g["start_step"]
    ]


def save(pos: Any, rec: RunRecord, d: Dist, order: TrainData, opt: Any, inputs: Any) -> Path:
    """Checkpoint at ``pos.step`` (every rank's RNG gathered, rank 0 writes, all wait); the recipe is the config's but for
    the optimizer-held values (:func:`optimizer_values`).
    """
    rng = ckpt.capture_rng()
    rngs = d.all_gather(rng)
    path = ckpt.ckpt_path(rec.train_dir, pos.step)
    recipe = {
        **rec.current["recipe"],
        **{f"train.{k}": v for k, v in optimizer_values(opt).items()},
    }
    if d.is_main:
        state = {
            "step": pos.step,
            "epoch": pos.epoch,
            "steps_in_epoch": pos.step_in_epoch,
            "samples_in_epoch": order.samples_before(pos.epoch, pos.step_in_epoch),
            "model": ckpt.trainable_state(inputs.drafter),
            "optimizer": opt.optimizer.state_dict(),
            "scheduler": opt.scheduler.state_dict(),
            "rng": rngs,
            "drafter_args": inputs.args.to_json(),
            "config_fingerprint": opt.fingerprint,
            "world_size": d.world,
            "data_order": rec.current["data_order"],
            "init_from": inputs.init_from,
            "recipe": recipe,
            "data_inputs": rec.current["data_inputs"],
            "segments": segments(pos, rec, d),
            # what --export-only reads without the shards
            resume_checks.DATA_CONFIG_RECORD: resume_checks.data_config_record(inputs.data_config),
        }
        path = ckpt.save_checkpoint(rec.train_dir, state, keep=rec.keep_checkpoints)
    d.barrier()
    return path
