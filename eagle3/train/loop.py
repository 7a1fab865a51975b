"""The TTT training core: one optimizer step over micro-batches with the step-normalised loss, and validation.

Loss normalisation (DESIGN.md "Loss normalisation"): TTT step ``i``'s loss is its summed token loss over the counted
positions of the whole optimizer step (all micro-batches, all ranks) divided by their number, so the gradient does
not depend on the micro-batch / rank split. Counts are taken before any backward and summed over ranks by one
all-reduce per step (:func:`eagle3.losses.ttt.step_denominators`). No host sync except at log steps.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from eagle3.data.batching import eval_batches
from eagle3.data.dataset import collate
from eagle3.losses.rows import row_targets, ttt_loss_rows, ttt_row_counts
from eagle3.losses.ttt import (
    TTTTargets,
    compute_targets,
    step_denominators,
    ttt_loss,
    ttt_token_counts,
)
from eagle3.process_group import Dist
from eagle3.shards.fp8 import dequantize_batch, is_fp8
from eagle3.train.metrics import Accum, reduce_totals
from eagle3.train.order import loader_kwargs
from eagle3.train.ranks import StopFlag, any_rank, sum_ranks
from eagle3.train.resume import Progress

log = logging.getLogger(__name__)

TARGET_CHUNK = 2048  # positions per lm_head chunk in compute_targets (bounds the [chunk, V] logits)


class TTTObjective(nn.Module):
    """The drafter + TTT loss as one ``forward`` (so DDP sees every trainable use): ``forward(input_ids [B, L], aux
    [B, L, 3Ht], *targets, loss_mask [B, L] | None, denom [K] | None, loss_pos [M] | None) -> (loss, metrics [K] each)``.
    With ``loss_pos``: row targets and :func:`eagle3.losses.rows.ttt_loss_rows` (training); else ``[B, L]`` targets and
    :func:`eagle3.losses.ttt.ttt_loss` (same sums). ``checkpoint_logits``: recompute each step's logits in backward.
    """

    def __init__(
        self,
        drafter: nn.Module,
        ttt_length: int,
        step_weight: float,
        checkpoint_logits: bool = False,
        loss: str = "soft_ce",
        lk_eta: float = 3.0,
    ):
        super().__init__()
        self.drafter = drafter
        self.ttt_length = ttt_length
        self.step_weight = step_weight
        self.checkpoint_logits = checkpoint_logits
        self.loss = loss
        self.lk_eta = lk_eta

    def forward(
        self,
        input_ids,
        aux,
        target_logp,
        in_draft,
        target_argmax,
        loss_mask=None,
        denom=None,
        loss_pos=None,
    ):
        step_hiddens = self.drafter.ttt_forward(input_ids, aux, self.ttt_length)  # K x [B, L, H]
        fn, where = (ttt_loss_rows, loss_pos) if loss_pos is not None else (ttt_loss, loss_mask)
        return fn(
            self.drafter,
            step_hiddens,
            TTTTargets(target_logp, in_draft, target_argmax),
            where,
            step_weight=self.step_weight,
            checkpoint=self.checkpoint_logits,
            denom=denom,
            loss=self.loss,
            lk_eta=self.lk_eta,
        )


def _autocast(d: Dist, amp: Optional[torch.dtype]):
    return (
        torch.autocast(device_type=d.device.type, dtype=amp)
        if amp is not None
        else contextlib.nullcontext()
    )


def _call(model: nn.Module, b: dict, tg, denom=None):
    """``model`` on batch ``b`` with targets ``tg`` (the loss-row path when ``b`` has ``loss_pos``)."""
    if "loss_pos" in b:
        return model(b["input_ids"], b["aux"], *tg, None, denom, loss_pos=b["loss_pos"])
    return model(b["input_ids"], b["aux"], *tg, b["loss_mask"], denom)


def backward_step(
    model: nn.Module,
    batches: list[dict],
    targets: list,
    ttt_length: int,
    d: Dist,
    amp: Optional[torch.dtype] = None,
) -> list[dict]:
    """Forward + backward of every micro-batch of ONE optimizer step: the counts ``N_i`` of all micro-batches and ranks
    first (one all-reduce, no host sync), then each micro-batch backpropagates ``sum_i step_weight**i * S_i / N_i``
    (DDP ``no_sync`` on all but the last). Every rank calls it once per step; the caller clips, steps and zeroes.

    Args:
        model: :class:`TTTObjective`, maybe wrapped in DDP and/or ``torch.compile``.
        batches: this rank's device micro-batches (``input_ids``, ``aux``, ``loss_pos`` or ``loss_mask``).
        targets: each batch's :class:`eagle3.losses.ttt.TTTTargets`.
        amp: autocast dtype, or None.

    Returns:
        Each micro-batch's detached per-TTT-step metrics.
    """
    counts = [
        ttt_row_counts(b["loss_pos"], b["input_ids"].shape[1], tg.in_draft, ttt_length)
        if "loss_pos" in b
        else ttt_token_counts(b["loss_mask"], tg.in_draft, ttt_length)
        for b, tg in zip(batches, targets)
    ]  # [K] each
    denom = step_denominators(counts, d.world)  # [K] float32: max(N_i, 1) / world
    stats = []
    for m, (b, tg) in enumerate(zip(batches, targets)):
        last = m == len(batches) - 1
        sync_ctx = model.no_sync() if (d.distributed and not last) else contextlib.nullcontext()
        with sync_ctx:
            with _autocast(d, amp):
                loss, st = _call(model, b, tg, denom)
            loss.backward()
        stats.append(st)
    return stats


def move_batch(batch: dict, device: torch.device, float_dtype: torch.dtype) -> dict:
    """A collated batch on ``device`` (floats in ``float_dtype``); fp8 features dequantised after the copy."""
    nb = device.type == "cuda"
    out = {}
    for k, v in batch.items():
        v = v.to(device, non_blocking=nb)
        if v.is_floating_point() and not is_fp8(v) and not k.endswith("_scale"):
            v = v.to(float_dtype)
        out[k] = v
    return dequantize_batch(out, float_dtype)


def close_iter(it) -> None:
    """Stop a batch iterator now (loader workers, online capture threads); returns None."""
    close = getattr(it, "close", None)
    if callable(close):
        close()
    return None


@dataclass(frozen=True)
class LoopSettings:
    """The ``train.*`` values the loop reads (same names)."""

    ttt_length: int
    step_weight: float
    grad_accum: int
    grad_clip: float
    log_every: int
    ckpt_every: int
    batch_size: int
    batch_tokens: Optional[int] = None
    num_workers: Optional[int] = None


@dataclass(eq=False)
class TrainLoop:
    """One rank's optimizer steps after setup.

    Args:
        s: :class:`LoopSettings`; d: this process.
        inputs: drafter, verifier head (``head_lm`` ``[V, Ht]``, ``head_norm``, ``head_eps``, ``d2t``, ``t2d``),
            ``amp``, ``feat_dtype``, hidden-state source ``states``.
        data: ``order`` (:class:`eagle3.train.order.TrainData`), ``val_ds``, ``val_lengths``, ``eval_every``.
        opt: ``objective``, ``model`` (wrapped), ``params``, ``optimizer``, ``scheduler``.
        pos: :class:`Progress`; save: checkpoint at ``pos.step`` (every rank), returns its path.
        before_first_step: called before this call's first step (a stop signal at start-up).
        metrics, tracker: set before :meth:`run`: :class:`eagle3.train.metrics.Metrics`,
            :class:`eagle3.train.sim_accept.BestTracker`.
    """

    s: LoopSettings
    d: Dist
    inputs: Any
    data: Any
    opt: Any
    pos: Progress
    save: Callable[[], Path]
    before_first_step: Callable[[], None] = lambda: None
    metrics: Any = None
    tracker: Any = None

    def run(self, stop: StopFlag, stop_after: Optional[int]) -> Progress:
        """Optimizer steps until ``pos.end_step``, a stop signal or ``stop_after`` steps of this call."""
        p, order = self.pos, self.data.order
        self.inputs.drafter.train()
        self._new_window()
        self.bar = tqdm(
            total=p.total_steps,
            initial=p.step,
            disable=not self.d.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
        )
        it = None
        try:
            while p.step < p.end_step and not p.stopped:
                if p.step_in_epoch >= order.steps_in_epoch(p.epoch):
                    p.epoch, p.step_in_epoch = p.epoch + 1, 0
                it = self.inputs.states.wrap(order.iterate(p.epoch, p.step_in_epoch))
                for _ in range(p.step_in_epoch, order.steps_in_epoch(p.epoch)):
                    if p.step >= p.end_step:
                        break
                    if p.steps_this_call == 0:  # a signal while the loaders started
                        self.before_first_step()
                    grad_norm, lr_used = self.train_step(it)
                    if p.step % self.s.log_every == 0 or p.step == p.end_step:
                        self.log_step(grad_norm, lr_used)
                    if self.after_step(stop, stop_after):
                        break
                it = close_iter(it)
        finally:
            close_iter(it)  # stops this epoch's loader workers / capture threads now
            self.bar.close()
        return p

    def _new_window(self) -> None:
        self.window = Accum(self.s.ttt_length)
        self.tok_window = 0  # real (non-pad) tokens of this rank since the last log (CPU lengths)
        self.t_window = time.perf_counter()
        self.paused = 0.0  # seconds of validation / checkpoints inside the window (not counted)

    def train_step(self, it) -> tuple[torch.Tensor, float]:
        """One optimizer step: ``grad_accum`` micro-batches, :func:`backward_step`, clipping, AdamW, schedule. Returns
        ``(grad norm (device), LR used)``.
        """
        s, o, p = self.s, self.opt, self.pos
        batches = []
        for _micro in range(s.grad_accum):
            batch = next(it)
            self.tok_window += int(batch["lengths"].sum())
            batches.append(self.device_batch(batch))
        targets = [self.targets(b) for b in batches]
        for stats in backward_step(
            o.model, batches, targets, s.ttt_length, self.d, self.inputs.amp
        ):
            self.window.add(stats)
        del batches
        grad_norm = torch.nn.utils.clip_grad_norm_(o.params, s.grad_clip)
        o.optimizer.step()
        o.optimizer.zero_grad(set_to_none=True)
        lr_used = o.scheduler.get_last_lr()[0]
        o.scheduler.step()
        p.step += 1
        p.steps_this_call += 1
        p.step_in_epoch += 1
        self.bar.update(1)
        return grad_norm, lr_used

    def log_step(self, grad_norm: torch.Tensor, lr_used: float) -> None:
        """The window's metrics over all ranks, LR, grad norm, tokens/s (the one host sync); online, the NaN check."""
        p = self.pos
        self.check_states()
        means = Accum.summarize(reduce_totals(self.window.totals(), self.d), self.s.step_weight)
        elapsed = time.perf_counter() - self.t_window - self.paused  # includes this log step's sync
        toks = sum_ranks([float(self.tok_window)], self.d)[0]
        p.tok_total, p.t_total = p.tok_total + toks, p.t_total + elapsed
        row = {
            "kind": "train",
            "step": p.step,
            "epoch": p.epoch,
            "lr": lr_used,
            "grad_norm": float(grad_norm),
            "tokens_per_s": toks / max(elapsed, 1e-9),
            "window_tokens": toks,
            "window_s": elapsed,
            **means,
        }
        self.metrics.write(row)
        self.bar.set_postfix(loss=f"{means.get('loss', float('nan')):.4f}", lr=f"{lr_used:.2e}")
        self._new_window()

    def check_states(self) -> None:
        """UserError on every rank when some rank's online states were NaN/Inf since the last check."""
        if any_rank(not self.inputs.states.states_finite(), self.d):
            raise self.inputs.states.nonfinite_error(self.pos.step)

    def after_step(self, stop: StopFlag, stop_after: Optional[int]) -> bool:
        """Between steps (not timed): periodic validation, the stop decision (all ranks agree), checkpoints. True: stop here."""
        p = self.pos
        t_pause = time.perf_counter()
        if self.eval_due() and p.step != p.end_step:  # the end step: the stage validates
            self.log_validation(self.validate())
        want_stop = stop.requested or (stop_after is not None and p.steps_this_call >= stop_after)
        p.stopped = any_rank(want_stop, self.d)
        if p.step % self.s.ckpt_every == 0 or p.stopped or p.step == p.end_step:
            p.last_ckpt = self.save()
        self.paused += time.perf_counter() - t_pause
        if p.stopped and self.d.is_main:
            why = f"signal {stop.signum}" if stop.signum else f"stop_after={stop_after}"
            log.info("stopped at step %d (%s); checkpoint %s", p.step, why, p.last_ckpt)
        return p.stopped

    def eval_due(self) -> bool:
        """Validate now? Every ``eval_every`` steps when set, else at each epoch's end."""
        if self.data.eval_every is not None:
            return self.pos.step % self.data.eval_every == 0
        return self.pos.step_in_epoch >= self.data.order.steps_in_epoch(self.pos.epoch)

    def log_validation(self, val: dict) -> None:
        """A validation's metrics to the best-weights tracker (on disk first), then to the metrics."""
        p = self.pos
        if val:
            self.tracker.update(p.step, p.epoch, val, self.inputs.drafter)
            self.metrics.write({"kind": "val", "step": p.step, "epoch": p.epoch, **val})

    def device_batch(self, batch: dict) -> dict:
        """A loader batch on the device with its hidden states (shards, or computed online)."""
        return self.inputs.states.fill(move_batch(batch, self.d.device, self.inputs.feat_dtype))

    def targets(self, batch: dict):
        """Verifier targets at the loss rows (``[M, dV]``, ``[M]``, ``[M]``), else at every position (``[B, L, ...]``)."""
        i = self.inputs
        head = (i.head_lm, i.d2t, i.t2d)
        kw = dict(norm_weight=i.head_norm, norm_eps=i.head_eps, chunk=TARGET_CHUNK)
        with torch.no_grad():
            if "loss_pos" in batch:
                return row_targets(batch["last"], batch["loss_pos"], *head, **kw)
            return compute_targets(batch["last"], *head, **kw)

    def validate(self) -> dict:
        """Loss and accuracy on the val split, token-weighted, each sample once (rank r takes r, r+W, ...); nothing is a
        collective until the reduce.
        """
        data, s, d, drafter = self.data, self.s, self.d, self.inputs.drafter
        if data.val_ds is None:
            return {}
        if data.val_lengths is not None:  # token budget: this rank's samples, length-sorted batches
            vl = DataLoader(
                data.val_ds,
                batch_sampler=eval_batches(data.val_lengths, s.batch_tokens, d.world, d.rank),
                **loader_kwargs(s.num_workers, d.device, d.world),
            )
        else:  # no DistributedSampler padding, which would count some samples twice
            vl = DataLoader(
                data.val_ds,
                batch_size=s.batch_size,
                collate_fn=collate,
                sampler=list(range(d.rank, len(data.val_ds), d.world)),
            )
        acc = Accum(s.ttt_length)
        meter = self.tracker.meter(s.ttt_length) if self.tracker is not None else None  # T > 0
        drafter.eval()
        with torch.no_grad():
            for batch in self.inputs.states.wrap(iter(vl)):
                batch = self.device_batch(batch)
                with _autocast(d, self.inputs.amp):  # no DDP wrapper: no gradient sync in eval
                    _loss, stats = _call(self.opt.objective, batch, self.targets(batch))
                    if meter is not None:
                        i = self.inputs
                        meter.add(drafter, batch, i.head_lm, i.head_norm, i.head_eps)
                acc.add(stats)
        drafter.train()
        out = Accum.summarize(reduce_totals(acc.totals(), d), s.step_weight)
        return (
            out if meter is None else {**out, **meter.summarize(reduce_totals(meter.totals(), d))}
        )
