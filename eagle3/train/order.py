"""Data order: which micro-batches a rank trains in which optimizer step, fixed by ``train.seed``, the batching and the
data position ``(epoch, step_in_epoch)``, whatever the process count (a resumed epoch's rest is dealt to the current
ranks, each sample at most once per epoch). A checkpoint stores the position as ``epoch``, ``steps_in_epoch`` and
``samples_in_epoch`` (global samples).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import DataLoader

from eagle3.data import batching
from eagle3.data.dataset import ResumableSampler, ShardDataset, collate
from eagle3.errors import UserError
from eagle3.process_group import Dist
from eagle3.train import resume_checks

log = logging.getLogger(__name__)


def loader_kwargs(num_workers: Optional[int], device: torch.device, world: int) -> dict:
    """DataLoader settings: ``train.num_workers`` (auto: up to 8 per rank on GPU, 0 on CPU), pinned memory and 4 batches
    of read-ahead per worker on GPU; workers live per epoch (stopped when the loop drops its iterator).
    """
    workers = num_workers
    if workers is None:
        cpus = (os.cpu_count() or 2) // max(1, world)
        workers = min(8, max(1, cpus - 1)) if device.type == "cuda" else 0
    kw = {"num_workers": workers, "pin_memory": device.type == "cuda", "collate_fn": collate}
    if workers > 0:
        kw.update(prefetch_factor=4)
    return kw


class TrainData:
    """One rank's training order: fixed-size batches (:class:`eagle3.data.dataset.ResumableSampler`) or token-budget
    batches (:class:`eagle3.data.batching.TokenBudgetBatchSampler`) behind one interface. Arguments: the ``train.*``
    values of the same names; ``shards_dir`` (sample lengths), ``split_file`` (named in the refusal).

    Raises:
        UserError: fewer training samples than one optimizer step needs.
    """

    def __init__(
        self,
        train_ds: ShardDataset,
        d: Dist,
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
        self.world, self.accum = d.world, grad_accum
        self.is_main = d.is_main  # says the resume once
        kw = loader_kwargs(num_workers, d.device, d.world)
        self.token_budget = batch_tokens is not None
        if self.token_budget:
            lengths = batching.sample_lengths(shards_dir, train_ds, train_ds.max_length)
            self.sampler = batching.TokenBudgetBatchSampler(  # the window read now: tests lower it
                lengths, batch_tokens, d.world, d.rank, grad_accum, seed, batching.DEFAULT_WINDOW
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
            # global samples per optimizer step
            self.samples_per_step = batch_size * grad_accum * d.world
            self._steps = (len(train_ds) // d.world) // (batch_size * grad_accum)
            if self._steps < 1:
                raise UserError(
                    f"{split_file}: key 'train': {len(train_ds)} samples, fewer than one "
                    f"optimizer step needs (batch_size {batch_size} x grad_accum {grad_accum} x "
                    f"{d.world} processes)"
                )
            self.total_steps = math.ceil(epochs * self._steps)

    # a resumed epoch: (epoch, steps done, global units used: samples or plan batches); its rest is dealt
    # to the current ranks
    _origin: Optional[tuple[int, int, int]] = None

    def _units_per_step(self) -> int:
        return self.world * self.accum if self.token_budget else self.samples_per_step

    def _units_before(self, epoch: int, step_in_epoch: int) -> int:
        """Global samples (fixed batches) or plan batches (token budget) used by ``step_in_epoch`` steps."""
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
        """Global samples used by the first ``step_in_epoch`` steps of ``epoch`` (``samples_in_epoch``)."""
        g = self._units_before(epoch, step_in_epoch)
        if not self.token_budget:
            return g
        return sum(len(b) for b in self.sampler.epoch_plan(epoch)[:g])

    def step_from_checkpoint(self, state: dict) -> int:
        """A checkpoint's ``steps_in_epoch`` (derived from ``samples_in_epoch`` when absent); fixes where the epoch's data
        resumes, on any process count. UserError when a token-budget run meets a checkpoint without it.
        """
        if "steps_in_epoch" in state:
            k = int(state["steps_in_epoch"])
        elif self.token_budget:
            raise UserError(
                "checkpoint: key 'steps_in_epoch' missing; it was written by a run without "
                "train.batch_tokens, so its data position cannot be mapped to token-budget batches"
            )
        else:
            k = int(state["samples_in_epoch"]) // self.samples_per_step
        # samples_in_epoch: one of checkpoint.REQUIRED_KEYS
        epoch, samples = int(state["epoch"]), int(state["samples_in_epoch"])
        g = self.sampler.batches_for_samples(epoch, samples) if self.token_budget else samples
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
        """Optimizer steps of ``epochs`` for a run resumed at ``step``: the steps before the resumed epoch, its rest on this
        process count, then whole epochs (a fractional last one rounded up as the uninterrupted run counts it).
        """
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
        """The log line naming the training samples an epoch leaves out (fixed batches: the permutation's tail; token
        budget: the cut batches, counted for epoch 0), or None.
        """
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
    """The settings that fix the batch order (checkpoint key ``data_order``); ``batch_size`` None under ``batch_tokens``."""
    return {
        "train.seed": seed,
        "train.batch_tokens": batch_tokens,
        "train.batch_size": None if batch_tokens is not None else batch_size,
        "train.grad_accum": grad_accum,
    }


def data_inputs(split: dict, vocab: dict, data_config: dict) -> dict:
    """Checkpoint key ``data_inputs``: the sha256 of 03's split and vocab map, the shards' aux layers and verifier
    weights fingerprint (compared on ``--resume``).
    """
    return {
        resume_checks.SPLIT_FILE: resume_checks.split_sha256(split),
        resume_checks.VOCAB_FILE: resume_checks.vocab_sha256(vocab),
        resume_checks.AUX_LAYERS: [int(i) for i in data_config["aux_layers"]],
        resume_checks.VERIFIER_WEIGHTS: data_config.get(resume_checks.VERIFIER_WEIGHTS),
    }
