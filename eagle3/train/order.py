"""Data order and resume: which micro-batches a rank trains in which optimizer step, and how a run continues from
its newest checkpoint bit-identically (weights, optimizer, schedule, data position, RNG), also on another number of
processes (the rest of the resumed epoch is dealt out to the new ranks, each sample at most once per epoch).

A position in the data is ``(epoch, step_in_epoch)`` (optimizer steps done in that epoch); a checkpoint stores it as
``epoch``, ``steps_in_epoch`` and ``samples_in_epoch`` (global samples: the position whatever the process count).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from eagle3.data import batching
from eagle3.data.dataset import ResumableSampler, ShardDataset, collate
from eagle3.errors import UserError
from eagle3.train import checkpoint as ckpt
from eagle3.train.ranks import DistInfo, barrier, same_checkpoint
from eagle3.train.report import (
    earlier_segments,
    peak_gpu_mem_gib,
    segment_record,
    state_source_switch,
)
from eagle3.train.schedule import WarmupCosine, warmup_steps_for

log = logging.getLogger(__name__)


def loader_kwargs(num_workers: Optional[int], device: torch.device, world: int) -> dict:
    """DataLoader settings: worker processes (``train.num_workers``; auto = up to 8 per rank on GPU by CPU
    count, 0 on CPU), pinned host memory and 4 batches of read-ahead per worker on GPU. Workers are
    started per epoch (not persistent) and stopped when the loop drops its iterator, so none outlive
    the run."""
    workers = num_workers
    if workers is None:
        workers = (
            min(8, max(1, (os.cpu_count() or 2) // max(1, world) - 1))
            if device.type == "cuda"
            else 0
        )
    kw = {"num_workers": workers, "pin_memory": device.type == "cuda", "collate_fn": collate}
    if workers > 0:
        kw.update(prefetch_factor=4)
    return kw


class TrainData:
    """The training data order of one rank: fixed-size batches (``ResumableSampler``) or token-budget
    batches (:class:`eagle3.data.batching.TokenBudgetBatchSampler`), behind one interface.

    A position in the data is ``(epoch, step_in_epoch)`` (optimizer steps done in that epoch); the
    checkpoint stores it as ``epoch``, ``steps_in_epoch`` and ``samples_in_epoch`` (global samples).
    """

    def __init__(
        self,
        train_ds: ShardDataset,
        d: DistInfo,
        *,
        batch_size: int,
        grad_accum: int,
        batch_tokens: Optional[int],
        seed: int,
        epochs: float,
        num_workers: Optional[int],
        shards_dir: Path,
        split_file: Path,
    ):
        """Args: the ``train.*`` values of the same names; ``shards_dir`` (sample lengths of token-budget batches),
        ``split_file`` (named in the refusal).

        Raises:
            UserError: fewer training samples than one optimizer step needs.
        """
        self.world, self.accum, self.is_main = (
            d.world,
            grad_accum,
            d.is_main,
        )  # is_main: says the resume once
        kw = loader_kwargs(num_workers, d.device, d.world)
        self.token_budget = batch_tokens is not None
        if self.token_budget:
            lengths = batching.sample_lengths(shards_dir, train_ds, train_ds.max_length)
            self.sampler = batching.TokenBudgetBatchSampler(
                lengths,
                batch_tokens,
                d.world,
                d.rank,
                grad_accum,
                seed,
                window=batching.DEFAULT_WINDOW,
            )
            self.loader = DataLoader(train_ds, batch_sampler=self.sampler, **kw)
            self.total_steps = self.sampler.total_steps(epochs)
        else:
            self.sampler = ResumableSampler(
                train_ds, num_replicas=d.world, rank=d.rank, shuffle=True, seed=seed
            )
            self.loader = DataLoader(
                train_ds, batch_size=batch_size, sampler=self.sampler, drop_last=True, **kw
            )
            self.samples_per_step = (
                batch_size * grad_accum * d.world
            )  # global samples per optimizer step
            self._steps = (len(train_ds) // d.world) // (batch_size * grad_accum)
            if self._steps < 1:
                raise UserError(
                    f"{split_file}: key 'train': {len(train_ds)} samples, fewer than one "
                    f"optimizer step needs (batch_size {batch_size} x grad_accum {grad_accum} x "
                    f"{d.world} processes)"
                )
            self.total_steps = math.ceil(epochs * self._steps)

    # A resumed epoch may have been started on another number of processes: it is then described by
    # its origin (epoch, steps done, global units consumed: samples, or batches of the token-budget
    # plan), and the rest of its data is dealt out to the current ranks (each sample at most once per epoch).
    _origin: Optional[tuple[int, int, int]] = None

    def _units_per_step(self) -> int:
        return self.world * self.accum if self.token_budget else self.samples_per_step

    def _units_before(self, epoch: int, step_in_epoch: int) -> int:
        """Global samples (fixed batches) or plan batches (token budget) consumed by ``step_in_epoch`` steps."""
        if self._origin is not None and self._origin[0] == epoch:
            _, k0, g0 = self._origin
            return g0 + (step_in_epoch - k0) * self._units_per_step()
        return step_in_epoch * self._units_per_step()

    def steps_in_epoch(self, epoch: int) -> int:
        if self._origin is not None and self._origin[0] == epoch:
            _, k0, g0 = self._origin
            if self.token_budget:
                return k0 + self.sampler.steps_after(epoch, g0)
            return k0 + (max(0, len(self.sampler.dataset) - g0) // self.world) // (
                self.samples_per_step // self.world
            )
        return self.sampler.steps_in_epoch(epoch) if self.token_budget else self._steps

    def samples_before(self, epoch: int, step_in_epoch: int) -> int:
        """Global samples consumed by the first ``step_in_epoch`` optimizer steps of ``epoch`` (checkpoint key
        ``samples_in_epoch``: the data position, whatever number of processes took those steps)."""
        g = self._units_before(epoch, step_in_epoch)
        if not self.token_budget:
            return g
        return sum(len(b) for b in self.sampler.epoch_plan(epoch)[:g])

    def step_from_checkpoint(self, state: dict) -> int:
        """``steps_in_epoch`` of a checkpoint (derived from ``samples_in_epoch`` for checkpoints that predate it);
        its ``samples_in_epoch`` fixes where the epoch's data resumes, on any number of processes."""
        if "steps_in_epoch" in state:
            k = int(state["steps_in_epoch"])
        elif self.token_budget:
            raise UserError(
                "checkpoint: key 'steps_in_epoch' missing; it was written by a run without "
                "train.batch_tokens, so its data position cannot be mapped to token-budget batches"
            )
        else:
            k = int(state["samples_in_epoch"]) // self.samples_per_step
        epoch = int(state["epoch"])
        if "samples_in_epoch" in state:
            samples = int(state["samples_in_epoch"])
            g = self.sampler.batches_for_samples(epoch, samples) if self.token_budget else samples
        else:  # predates the key: taken on this process count
            g = k * self._units_per_step()
            samples = self.samples_before(epoch, k) if self.token_budget else g
        self._origin = (epoch, k, g)
        if int(state.get("world_size", self.world)) != self.world and self.is_main:
            log.info(
                "checkpoint written on %s processes, now %d: epoch %d resumes after its first %d samples, "
                "the rest dealt out to %d ranks",
                state.get("world_size"),
                self.world,
                epoch,
                samples,
                self.world,
            )
        return k

    def resumed_total_steps(self, epochs: float, step: int) -> int:
        """Optimizer steps of ``epochs`` epochs for a run resumed (:meth:`step_from_checkpoint`) at global
        optimizer step ``step``: the steps taken before the resumed epoch, that epoch's steps on this
        process count from its recorded data position, then whole epochs (a fractional last epoch
        rounded up, counted in samples/batches as the uninterrupted run counts it)."""
        e0, k0, g0 = self._origin
        full, frac = int(math.floor(epochs)), epochs - math.floor(epochs)
        total = step - k0
        total += sum(self.steps_in_epoch(e) for e in range(e0, full))
        if frac > 0 and e0 <= full:
            std = self.sampler.steps_in_epoch(full) if self.token_budget else self._steps
            want = math.ceil(frac * std)
            if e0 < full:
                total += want
            else:
                left = max(0, want * self._units_per_step() - g0)
                total += min(self.steps_in_epoch(e0), k0 + math.ceil(left / self._units_per_step()))
        return max(total, step)

    def left_out_note(self, n_samples: int) -> Optional[str]:
        """The log line naming the training samples an epoch leaves out (None when every sample is trained).

        Fixed batches: each epoch trains ``steps x batch_size x grad_accum x processes`` samples of its
        permutation (reshuffled per epoch), so the same count, but other samples, are left out every epoch.
        Token budget: every sample is in a batch, but the batch count is cut to a multiple of ``processes x
        grad_accum``; the samples of the cut batches differ per epoch, counted here for the first epoch."""
        if self.token_budget:
            kept = sum(len(b) for b in self.sampler.epoch_batches(0))
            left = n_samples - kept
            if left <= 0:
                return None
            return (
                f"train.batch_tokens: {left} of {n_samples} training samples are left out of the first epoch "
                f"(their batches do not fill a last optimizer step: processes x grad_accum = {self.world * self.accum} "
                f"batches); the count and which samples differ per epoch (the batches are re-planned)"
            )
        left = n_samples - self._steps * self.samples_per_step
        if left <= 0:
            return None
        return (
            f"{left} of {n_samples} training samples per epoch do not fill a last optimizer step (batch_size x "
            f"grad_accum x processes = {self.samples_per_step} samples) and are left out of that epoch; the order "
            f"is reshuffled each epoch, so other samples are left out each time"
        )

    def iterate(self, epoch: int, step_in_epoch: int):
        """Micro-batches of this rank from optimizer step ``step_in_epoch`` of ``epoch`` on."""
        self.sampler.set_epoch(epoch)
        g = self._units_before(epoch, step_in_epoch)
        self.sampler.set_start_batch(g) if self.token_budget else self.sampler.set_start(g)
        return iter(self.loader)


def data_order(seed: int, batch_tokens: Optional[int], batch_size: int, grad_accum: int) -> dict:
    """The settings that fix the batch order and the optimizer-step count of an epoch (checkpoint key
    ``data_order``; :func:`eagle3.train.checkpoint.check_data_order`). ``batch_size`` is recorded as None when
    ``batch_tokens`` is set (it is ignored then)."""
    return {
        "train.seed": seed,
        "train.batch_tokens": batch_tokens,
        "train.batch_size": None if batch_tokens is not None else batch_size,
        "train.grad_accum": grad_accum,
    }


def data_inputs(split: dict, vocab: dict, data_config: dict) -> dict:
    """What a checkpoint records of the data it was trained on (key ``data_inputs``; compared on ``--resume`` by
    :func:`eagle3.train.checkpoint.data_inputs_problem`): the content sha256 of 03's ``split`` and ``vocab`` map, and
    the aux layers and verifier weights fingerprint (``verifier_weights``; None when 02 recorded none) of the shards'
    ``data_config``."""
    return {
        ckpt.SPLIT_FILE: ckpt.split_sha256(split),
        ckpt.VOCAB_FILE: ckpt.vocab_sha256(vocab),
        ckpt.AUX_LAYERS: [int(i) for i in data_config["aux_layers"]],
        ckpt.VERIFIER_WEIGHTS: data_config.get(ckpt.VERIFIER_WEIGHTS),
    }


def trainable_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes (``requires_grad``), detached on CPU, by name."""
    return {
        n: p.detach().to("cpu").clone() for n, p in drafter.named_parameters() if p.requires_grad
    }


@dataclass
class RunRecord:
    """What a checkpoint records of the run besides its position and tensors, and what a resume compares.

    ``current``: the run now as :func:`eagle3.train.checkpoint.check_resume` compares it (``drafter_args``,
    ``data_order``, ``recipe`` (dotted ``train.*`` keys), ``data_inputs``, ``world_size``); ``fingerprint``:
    :func:`eagle3.train.checkpoint.config_fingerprint` of the settings; the rest are ``train.*`` values of the same
    names, ``extract_backend`` (online's state source) and this call's warning lines (filled while it runs)."""

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


def horizon_after_resume(
    order: TrainData,
    state: dict,
    d: DistInfo,
    rec: RunRecord,
    total_steps: int,
    horizon: Optional[int],
    scheduler,
) -> int:
    """The step horizon of a run resumed on another number of processes than the checkpoint's: the rest of the
    resumed epoch is dealt out to the new ranks (:class:`TrainData`), so ``train.epochs`` ends after a different
    step count than either process count alone gives; the LR schedule's horizon follows. Unchanged process count:
    ``total_steps`` as computed."""
    if int(state.get("world_size", d.world)) == d.world:
        return total_steps
    new = order.resumed_total_steps(rec.epochs, int(state["step"]))
    if horizon is not None:
        new = min(new, horizon)
    if (
        new != total_steps
    ):  # every rank re-stretches it (DDP replicas step with one lr); rank 0 says so
        if d.is_main:
            log.info(
                "resumed on %d processes (checkpoint: %s): %d optimizer steps in all",
                d.world,
                state.get("world_size"),
                new,
            )
        scheduler.lr_lambdas[0].__dict__.update(
            WarmupCosine(warmup_steps_for(new, rec.warmup_ratio), new).__dict__
        )
    return new


def set_stop_at(pos: Any, stop_at: Optional[int], data: Any, epochs: float) -> None:
    """Check and set ``--stop-at`` on ``pos`` (:class:`eagle3.train.loop.Progress`), once ``total_steps`` is known
    and before anything is loaded or logged about the schedule.

    Raises:
        UserError: ``stop_at`` not before the schedule's last step, or before the resumed checkpoint's step (at it:
            a run stopped by a signal on its stop step, resumed with the same command, trains nothing and ends
            there: final validation, export, report).
    """
    if stop_at is None:
        return
    if stop_at >= pos.total_steps:
        raise UserError(
            f"--stop-at {stop_at}: the schedule has {pos.total_steps} optimizer steps; a stop at or "
            f"after its end is the whole run (leave --stop-at out, or {_longer_schedule(data, epochs)})"
        )
    if stop_at < pos.step:
        raise UserError(
            f"--stop-at {stop_at}: the checkpoint resumed from is at step {pos.step}, past it "
            f"(`--export-only` exports it)"
        )
    pos.stop_at = stop_at


def _longer_schedule(data: Any, epochs: float) -> str:
    """How to get a longer lr schedule, for the --stop-at refusal: raise what sets its end (``train.epochs``, or a
    ``--max-steps`` / ``train.max_steps`` cap below the epochs' steps; ``train.max_steps`` cannot go past them)."""
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
    d: DistInfo,
    data: Any,
    opt: Any,
    inputs: Any,
    stop_at: Optional[int] = None,
) -> None:
    """Continue ``pos`` from the newest complete checkpoint: weights, optimizer, schedule, data position, RNG.

    Every check comes before anything is loaded or logged about the schedule: the checkpoint against the run
    (:func:`eagle3.train.checkpoint.check_resume`: all refused fields in one line), then the step horizon, then
    ``stop_at`` (:func:`set_stop_at`).

    Raises:
        UserError: a refused change (drafter shape, data order, loss definition, split or vocab map), a checkpoint
            already past the run's end, a refused ``stop_at``, or a model state that does not fit.
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
    changes = ckpt.check_resume(path, state, rec.current, rec.data_dir)
    unchecked = ckpt.data_inputs_unchecked(
        path, state.get("data_inputs"), rec.current["data_inputs"], "--resume"
    )
    pos.step, pos.epoch = int(state["step"]), int(state["epoch"])
    pos.step_in_epoch = data.order.step_from_checkpoint(state)
    pos.total_steps = horizon_after_resume(
        data.order, state, d, rec, pos.total_steps, data.horizon, opt.scheduler
    )
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
    rngs = state["rng"]
    if len(rngs) == d.world:
        ckpt.restore_rng(rngs[d.rank])
    else:
        if d.is_main:
            log.warning(
                "%s: saved with %d processes, now %d; RNG states reseeded", path, len(rngs), d.world
            )
        torch.manual_seed(rec.seed + 1000 * pos.step + d.rank)
    pos.last_ckpt = path
    pos.earlier_segments, pos.segment_start = earlier_segments(state), pos.step
    switch = state_source_switch(path, pos.earlier_segments, current_segment(pos, rec, d))
    if switch and d.is_main:
        log.warning("%s", switch)


def _resume_warnings(path: Path, state: dict, changes: list, unchecked, fingerprint: str) -> None:
    """Rank 0's warnings of a resume: the allowed setting changes, or (a checkpoint without ``recipe``) a differing
    fingerprint, and data inputs that could not be compared (train_report's warnings too)."""
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


def _load_state(
    path: Path, state: dict, d: DistInfo, opt: Any, inputs: Any, rec: RunRecord
) -> None:
    """Load a checked checkpoint's weights, optimizer and scheduler (keeping this run's schedule horizon, set by
    :func:`restore`) and its warm-start record (``inputs.init_from``).

    Raises:
        UserError: the checkpoint's ``model`` misses trainable tensors or has unexpected ones.
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


def _horizon_reason(state: dict, rec: RunRecord, d: DistInfo) -> str:
    """Why a resumed run's lr schedule differs from its checkpoint's, for the warning: the schedule keys changed in
    the config (``train.epochs`` / ``train.max_steps`` / ``--max-steps``, ``train.warmup_ratio``) and/or another
    process count (the steps of ``train.epochs`` follow the new split)."""
    saved, now = state.get("recipe") or {}, rec.current["recipe"]
    keys = [
        k
        for k in ("train.epochs", "train.max_steps", "train.warmup_ratio")
        if k in saved and saved[k] != now[k]
    ]
    why = [f"{k} {ckpt.as_written(k, saved[k])} -> {ckpt.as_written(k, now[k])}" for k in keys]
    then = state.get("world_size")
    if then is not None and int(then) != d.world:
        why.append(
            f"{then} processes then, {d.world} now: the steps of train.epochs follow the new split"
        )
    return "; ".join(why) or "--max-steps, train.max_steps or train.epochs changed"


def announce_resume(pos: Any, d: DistInfo, order: TrainData) -> None:
    """Log where a resumed run stands (rank 0), once every setup check (``--stop-at`` included) has passed:
    ``step 2, at the end of epoch 1`` or ``step 3, epoch 2, 1 step into it`` (epochs counted from 0)."""
    if pos.last_ckpt is None or not d.is_main:
        return
    k = pos.step_in_epoch
    if k >= order.steps_in_epoch(pos.epoch):
        where = f"step {pos.step}, at the end of epoch {pos.epoch}"
    else:
        where = f"step {pos.step}, epoch {pos.epoch}, {k} step{'' if k == 1 else 's'} into it"
    log.info("resumed from %s (%s)", pos.last_ckpt, where)


def optimizer_values(opt: Any) -> dict:
    """``lr`` and ``weight_decay`` as the optimizer holds them: a resumed checkpoint's, not the config's
    (:data:`eagle3.train.checkpoint.KEPT_FIELDS`)."""
    return {
        "lr": float(opt.scheduler.base_lrs[0]),
        "weight_decay": float(opt.optimizer.param_groups[0]["weight_decay"]),
    }


def current_segment(pos: Any, rec: RunRecord, d: DistInfo) -> dict:
    """This call's part of the run (:func:`eagle3.train.report.segment_record`): from the step it started at to
    the current step."""
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


def segments(pos: Any, rec: RunRecord, d: DistInfo) -> list[dict]:
    """The run's parts, one per 04 call that trained (a resumed checkpoint's earlier ones, then this call's; parts
    without a step left out): checkpoint and ``train_report.json`` key ``segments``."""
    return [
        g
        for g in [*pos.earlier_segments, current_segment(pos, rec, d)]
        if g["end_step"] > g["start_step"]
    ]


def save(pos: Any, rec: RunRecord, d: DistInfo, order: TrainData, opt: Any, inputs: Any) -> Path:
    """Checkpoint at ``pos.step`` (every rank's RNG gathered; rank 0 writes). The recipe recorded is the config's
    except the fields a resumed checkpoint's optimizer state keeps (:func:`optimizer_values`), so a later
    ``--resume`` with the run's original config warns about nothing."""
    rng = ckpt.capture_rng()
    rngs = [None] * d.world
    if d.distributed:
        dist.all_gather_object(rngs, rng, group=d.ctrl_group)
    else:
        rngs = [rng]
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
            "model": trainable_state(inputs.drafter),
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
            ckpt.DATA_CONFIG_RECORD: ckpt.data_config_record(
                inputs.data_config
            ),  # --export-only sans shards
        }
        path = ckpt.save_checkpoint(rec.train_dir, state, keep=rec.keep_checkpoints)
    barrier(d)
    return path
