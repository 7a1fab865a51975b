"""Token-budget batches: samples of similar length grouped into micro-batches of about ``batch_tokens`` padded
tokens, in a deterministic, resumable, rank-disjoint order.

One epoch's plan, a pure function of ``(lengths, batch_tokens, window, seed, epoch)``: ``randperm(N, seed +
epoch)``; cut into windows of ``window`` samples, each sorted by length (stable) and cut greedily while
``(n + 1) * max_len <= batch_tokens`` (a longer sample is a batch alone); the batch order shuffled with the same
generator; cut to a multiple of ``W * A`` (``W`` ranks, ``A`` = ``grad_accum``). Rank ``r``'s micro-batch ``m`` of
step ``s`` is global batch ``s*W*A + m*W + r``. Steps consume a prefix of the plan on any ``W``, so a resume skips
the batches the checkpoint's ``samples_in_epoch`` covers (:meth:`TokenBudgetBatchSampler.batches_for_samples`)
and deals the rest to the current ranks.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from eagle3.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 2048  # samples sorted together: near-zero padding, still random


def sample_lengths(shards_dir: str | os.PathLike, dataset, max_length: Optional[int]) -> list[int]:
    """Tokens of each item of ``dataset`` (a :class:`eagle3.data.dataset.ShardDataset`) cut at ``max_length``, from
    ``manifest.jsonl``'s ``num_tokens``, else by loading the shard. UserError: corrupt manifest or unreadable shard.
    """
    from eagle3.shards.manifest import MANIFEST, read_manifest
    from eagle3.shards.read import load_sample

    rows = read_manifest(Path(shards_dir) / MANIFEST).rows
    out, loaded = [], 0
    for idx, path in zip(dataset.indices, dataset.paths):
        row = rows.get(idx)
        if row is not None and row.get("num_tokens", 0) > 0:
            n = int(row["num_tokens"])
        else:
            n = int(load_sample(path, expect=getattr(dataset, "expect", None))["input_ids"].numel())
            loaded += 1
        out.append(n if max_length is None else min(n, max_length))
    if loaded:
        log.info(
            "token-budget batching: read the length of %d samples from their shards (no manifest row)",
            loaded,
        )
    return out


class TokenBudgetBatchSampler:
    """One rank's ``DataLoader`` batch sampler (module docstring); ``batch_tokens >= 1`` (the config's bound).
    ``window`` 0 = the whole epoch; ``shuffle=False`` keeps dataset order (validation).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_tokens: int,
        num_replicas: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        seed: int = 0,
        window: int = DEFAULT_WINDOW,
        shuffle: bool = True,
    ):
        self.lengths = [int(n) for n in lengths]
        self.batch_tokens = int(batch_tokens)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.grad_accum = int(grad_accum)
        self.seed, self.window, self.shuffle = int(seed), int(window), shuffle
        self.epoch = 0
        self.start_batch = 0
        self._cache: dict[int, list[list[int]]] = {}

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Global batches of ``epoch`` (dataset positions), cut to a multiple of ``W * A``."""
        batches = self.epoch_plan(epoch)
        per_step = self.num_replicas * self.grad_accum
        return batches[: len(batches) // per_step * per_step]

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """Global batches of ``epoch`` before the cut (independent of the process count)."""
        if epoch in self._cache:
            return self._cache[epoch]
        N = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(N, generator=g).tolist() if self.shuffle else list(range(N))
        win = self.window if self.window > 0 else max(N, 1)
        batches: list[list[int]] = []
        for w in range(0, N, win):
            chunk = sorted(order[w : w + win], key=lambda i: self.lengths[i])  # stable
            cur: list[int] = []
            for i in chunk:  # ascending, so lengths[i] is the new max of the open batch
                if cur and (len(cur) + 1) * self.lengths[i] > self.batch_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        self._cache = {epoch: batches}  # one epoch at a time: plans are cheap to rebuild
        return batches

    def batches_for_samples(self, epoch: int, samples: int) -> int:
        """Leading batches of ``epoch``'s plan that hold ``samples`` samples; UserError when no prefix holds exactly that."""
        prefixes = list(itertools.accumulate(map(len, self.epoch_plan(epoch)), initial=0))
        if samples in prefixes:
            return prefixes.index(samples)
        raise UserError(
            f"checkpoint: key 'samples_in_epoch' {samples} is not a batch boundary of epoch {epoch}'s "
            f"token-budget plan (train.batch_tokens {self.batch_tokens}): the shards or split changed"
        )

    def steps_after(self, epoch: int, start_batch: int) -> int:
        """Optimizer steps of ``epoch`` after its first ``start_batch`` global batches."""
        per_step = self.num_replicas * self.grad_accum
        return max(0, len(self.epoch_plan(epoch)) - start_batch) // per_step

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (the same on every rank)."""
        return len(self.epoch_batches(epoch)) // (self.num_replicas * self.grad_accum)

    def total_steps(self, epochs: float) -> int:
        """Optimizer steps of ``epochs`` (a fractional last epoch rounded up); UserError when epoch 0 has none."""
        if self.steps_in_epoch(0) < 1:
            raise UserError(
                f"train.batch_tokens: {len(self.lengths)} samples make {len(self.epoch_batches(0))} "
                f"batches of {self.batch_tokens} tokens, fewer than one optimizer step needs "
                f"(grad_accum {self.grad_accum} x {self.num_replicas} processes)"
            )
        full = int(math.floor(epochs))
        total = sum(self.steps_in_epoch(e) for e in range(full))
        frac = epochs - full
        if frac > 0:
            total += math.ceil(frac * self.steps_in_epoch(full))
        return total

    def set_epoch(self, epoch: int) -> None:
        """Use the plan of ``epoch`` from its first step (resets :meth:`set_start`)."""
        self.epoch = int(epoch)
        self.start_batch = 0

    def set_start(self, step_in_epoch: int) -> None:
        """Begin the next iteration at step ``step_in_epoch`` (this process count)."""
        self.start_batch = int(step_in_epoch) * self.num_replicas * self.grad_accum

    def set_start_batch(self, start_batch: int) -> None:
        """Begin the next iteration after the plan's first ``start_batch`` global batches."""
        self.start_batch = int(start_batch)

    def rank_batches(self) -> list[list[int]]:
        """This rank's micro-batches from :attr:`start_batch` on, in training order."""
        batches = self.epoch_plan(self.epoch)
        W, A, r, g0 = self.num_replicas, self.grad_accum, self.rank, self.start_batch
        steps = self.steps_after(self.epoch, g0)
        return [batches[g0 + s * W * A + m * W + r] for s in range(steps) for m in range(A)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.rank_batches())

    def __len__(self) -> int:
        return self.steps_after(self.epoch, self.start_batch) * self.grad_accum


def eval_batches(
    lengths: Sequence[int], batch_tokens: int, num_replicas: int = 1, rank: int = 0
) -> list[list[int]]:
    """One rank's validation batches: samples ``rank, rank+W, ...`` sorted by length and cut by the budget (counts may
    differ across ranks).
    """
    mine = list(range(rank, len(lengths), num_replicas))
    s = TokenBudgetBatchSampler([lengths[i] for i in mine], batch_tokens, shuffle=False, window=0)
    return [[mine[j] for j in b] for b in s.epoch_batches(0)]
