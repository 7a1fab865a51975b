"""Token-budget batches: samples of similar length grouped so that a micro-batch holds about
``batch_tokens`` padded tokens, in a deterministic, resumable, rank-disjoint order.

Why: a fixed number of samples per micro-batch pads every sample to the longest one (with a
1024-token cut-off and replies of 20 to 1000 tokens, over half of a batch-8 step can be padding)
and, for a small drafter, leaves the GPU idle between tiny kernels. Grouping by length and filling
a token budget makes every step carry about the same, large, amount of real work.

The plan of one epoch (:meth:`TokenBudgetBatchSampler.epoch_batches`), a pure function of
``(lengths, batch_tokens, window, seed, epoch, num_replicas, grad_accum)``:

1. ``perm = torch.randperm(N, generator=seed + epoch)`` (the ``DistributedSampler`` seeding convention);
2. ``perm`` is cut into windows of ``window`` samples; each window is sorted by length (stable, so
   ties keep the shuffled order) and cut greedily into batches: a sample joins the open batch while
   ``(n + 1) * max_len <= batch_tokens`` (padded tokens, the compute a batch costs); a sample longer
   than the budget is a batch of its own;
3. the batch order is shuffled with the same generator (so lengths do not rise within an epoch);
4. the batch count is cut down to a multiple of ``num_replicas * grad_accum`` (every rank runs
   the same number of optimizer steps; the dropped tail, fewer than ``num_replicas * grad_accum``
   batches, is the analogue of ``DistributedSampler(drop_last=True)``'s dropped samples).

Optimizer step ``s`` of the epoch uses global batches ``s*W*A .. s*W*A + W*A - 1`` (``W`` ranks,
``A`` = ``grad_accum``); rank ``r``'s micro-batch ``m`` is global batch ``s*W*A + m*W + r``. Ranks
therefore see disjoint batches and equal step counts, and resuming at step ``s`` of an epoch is
skipping its first ``s*W*A`` global batches (:meth:`set_start`), which reproduces the uninterrupted
order exactly. Steps consume a prefix of the uncut plan on any process count, so a checkpoint written
on ``W`` processes resumes on ``W'`` by skipping the batches its ``samples_in_epoch`` covers
(:meth:`batches_for_samples`, :meth:`set_start_batch`) and dealing the rest out to the ``W'`` ranks:
each batch of the epoch is trained once. Bucketing by sorted length within a shuffled window follows fairseq / HF
``group_by_length`` practice.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from eagle3.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_WINDOW = (
    2048  # samples sorted together: large enough for near-zero padding, small enough to stay random
)


def sample_lengths(shards_dir: str | os.PathLike, dataset, max_length: Optional[int]) -> list[int]:
    """Token count of each item of ``dataset`` (a :class:`eagle3.data.dataset.ShardDataset`), after the cut at ``max_length``.

    Read from ``{shards_dir}/manifest.jsonl`` (``num_tokens`` of stage 02, DESIGN.md "Shards");
    samples without a manifest row (flat speculators folders, hand-made data) are loaded once.

    Returns:
        list of ints, one per dataset item, in dataset order.

    Raises:
        UserError: the manifest is corrupt (see :func:`eagle3.shards.manifest.read_manifest`) or a shard is unreadable.
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
    """Batch sampler (``torch.utils.data.DataLoader(batch_sampler=...)``) of one rank; see the module docstring.

    Args:
        lengths: tokens of each dataset item (:func:`sample_lengths`).
        batch_tokens: padded-token budget of one micro-batch (``n * max_len <= batch_tokens``).
        num_replicas, rank: DDP world size and this rank.
        grad_accum: micro-batches per optimizer step.
        seed: shuffle seed (``train.seed``); epoch ``e`` uses ``seed + e``.
        window: samples sorted together before cutting batches (``0`` = the whole epoch).
        shuffle: False keeps dataset order (validation): windows are then sorted in place and the
            batch order is not shuffled.

    Raises:
        UserError: ``batch_tokens`` < 1, or fewer batches than one optimizer step needs.
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
        if batch_tokens < 1:
            raise UserError(f"train.batch_tokens must be >= 1, got {batch_tokens}")
        self.lengths = [int(n) for n in lengths]
        self.batch_tokens = int(batch_tokens)
        self.num_replicas, self.rank, self.grad_accum = (
            int(num_replicas),
            int(rank),
            int(grad_accum),
        )
        self.seed, self.window, self.shuffle = int(seed), int(window), shuffle
        self.epoch = 0
        self.start_batch = 0
        self._cache: dict[int, list[list[int]]] = {}

    # ---- the plan ----------------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Global batches of ``epoch`` (all ranks), dataset positions, cut to a multiple of ``num_replicas * grad_accum``."""
        batches = self.epoch_plan(epoch)
        per_step = self.num_replicas * self.grad_accum
        return batches[: len(batches) // per_step * per_step]

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """Global batches of ``epoch`` before the cut (steps 1-3 of the module docstring): a pure
        function of ``(lengths, batch_tokens, window, seed, epoch)``, independent of the process count."""
        if epoch in self._cache:
            return self._cache[epoch]
        N = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(N, generator=g).tolist() if self.shuffle else list(range(N))
        win = self.window if self.window > 0 else max(N, 1)
        batches: list[list[int]] = []
        for w in range(0, N, win):
            chunk = sorted(
                order[w : w + win], key=lambda i: self.lengths[i]
            )  # stable: ties keep the shuffle
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
        """How many leading global batches of ``epoch``'s plan hold ``samples`` samples (a checkpoint's
        ``samples_in_epoch``: steps consume a prefix of the plan on any process count).

        Raises:
            UserError: no prefix of the plan holds exactly that many samples.
        """
        total = 0
        for n, b in enumerate(self.epoch_plan(epoch)):
            if total == samples:
                return n
            total += len(b)
        if total == samples:
            return len(self.epoch_plan(epoch))
        raise UserError(
            f"checkpoint: key 'samples_in_epoch' {samples} is not a batch boundary of epoch {epoch}'s "
            f"token-budget plan (train.batch_tokens {self.batch_tokens}): the shards or split changed"
        )

    def steps_after(self, epoch: int, start_batch: int) -> int:
        """Optimizer steps of ``epoch`` left after its first ``start_batch`` global batches, on this process count."""
        return max(0, len(self.epoch_plan(epoch)) - start_batch) // (
            self.num_replicas * self.grad_accum
        )

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (the same on every rank)."""
        return len(self.epoch_batches(epoch)) // (self.num_replicas * self.grad_accum)

    def total_steps(self, epochs: float) -> int:
        """Optimizer steps of ``epochs`` epochs (a fractional last epoch is rounded up), summed over the epoch plans.

        Raises:
            UserError: the first epoch has no optimizer step.
        """
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

    # ---- sampler protocol --------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use the plan of ``epoch`` from its first step (resets :meth:`set_start`)."""
        self.epoch = int(epoch)
        self.start_batch = 0

    def set_start(self, step_in_epoch: int) -> None:
        """Begin the next iteration at optimizer step ``step_in_epoch`` of the current epoch (this process count)."""
        self.start_batch = int(step_in_epoch) * self.num_replicas * self.grad_accum

    def set_start_batch(self, start_batch: int) -> None:
        """Begin the next iteration after the first ``start_batch`` global batches of the epoch's plan,
        dealing the rest out to the current ranks (a checkpoint written on another process count:
        :meth:`batches_for_samples`); each batch of the epoch is then trained once."""
        self.start_batch = int(start_batch)

    def rank_batches(self) -> list[list[int]]:
        """This rank's micro-batches from :attr:`start_batch` on, in training order: step ``s`` after
        the start, micro-batch ``m`` = plan batch ``start + s*W*A + m*W + rank``."""
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
    """Validation batches of one rank: rank ``r`` takes samples ``r, r+W, ...`` (every sample once over the
    ranks, and every rank has samples when there are at least ``W``), sorted by length and cut by the token
    budget; batch counts may differ across ranks (validation has no collective inside the loop)."""
    mine = list(range(rank, len(lengths), num_replicas))
    s = TokenBudgetBatchSampler([lengths[i] for i in mine], batch_tokens, shuffle=False, window=0)
    return [[mine[j] for j in b] for b in s.epoch_batches(0)]
