"""Learning-rate schedule: linear warmup then cosine decay to zero, stepped per optimizer step.

Convention: the same shape as Hugging Face ``get_cosine_schedule_with_warmup`` (num_cycles 0.5),
which SpecForge and most EAGLE-3 trainers use:

- ``s < W``:  ``lr(s) = base_lr * s / W``
- ``s >= W``: ``lr(s) = base_lr * 0.5 * (1 + cos(pi * (s - W) / max(1, T - W)))``

where ``s`` is the number of optimizer steps already taken (the LR used *for* step ``s + 1``),
``W`` the warmup steps and ``T`` the total steps; bit-identical to transformers' schedule for
``s <= T`` (tests/train/test_train.py). Kept as its own object: ``LambdaLR.state_dict`` saves a
callable object's attributes, so each checkpoint records the horizon ``(W, T)`` that ``--resume``
compares and re-stretches (transformers' lambda is a ``functools.partial``: nothing is saved), and
past ``T`` the factor stays 0 (transformers' rises again).
"""

from __future__ import annotations

import math

import torch

from eagle3.errors import UserError


def warmup_steps_for(total_steps: int, warmup_ratio: float) -> int:
    """Warmup length in optimizer steps: ``ceil(warmup_ratio * total_steps)`` (0 when the ratio is 0)."""
    return int(math.ceil(warmup_ratio * total_steps))


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base LR after ``step`` optimizer steps (see module docstring).

    Args:
        step: optimizer steps already taken (0-based), ``>= 0``.
        warmup_steps: ``W >= 0``.
        total_steps: ``T >= 1``; for ``step >= T`` the factor stays 0.

    Returns:
        float in ``[0, 1]``.
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """LR multiplier for ``LambdaLR``; a plain object, so ``LambdaLR.state_dict()`` stores its two ints (weights-only loadable)."""

    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup_steps, self.total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with linear warmup + cosine decay; call ``.step()`` once per optimizer step.

    Raises:
        UserError: ``total_steps < 1`` (no data for even one optimizer step).
    """
    if total_steps < 1:
        raise UserError(
            f"train: the schedule has {total_steps} optimizer steps; need at least 1 (more data, or smaller batch_size/grad_accum)"
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps_for(total_steps, warmup_ratio), total_steps)
    )
