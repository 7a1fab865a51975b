"""Learning-rate schedule: linear warmup then cosine decay to zero, per optimizer step: ``lr(s) = base * s / W`` for
``s < W``, else ``base * 0.5 * (1 + cos(pi * (s - W) / max(1, T - W)))`` (``s`` steps taken, ``W`` warmup, ``T``
total). Bit-identical to transformers' ``get_cosine_schedule_with_warmup`` for ``s <= T``; kept as an object so
``LambdaLR.state_dict`` records the horizon ``(W, T)`` that ``--resume`` compares and re-stretches (transformers'
``partial`` saves nothing), and the factor stays 0 past ``T``.
"""

from __future__ import annotations

import math

import torch

from eagle3.errors import UserError


def warmup_steps_for(total_steps: int, warmup_ratio: float) -> int:
    """``ceil(warmup_ratio * total_steps)``."""
    return int(math.ceil(warmup_ratio * total_steps))


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """The base-LR multiplier in ``[0, 1]`` after ``step >= 0`` steps (module docstring)."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """The ``LambdaLR`` multiplier; its two ints are what ``state_dict`` stores."""

    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.warmup_steps, self.total_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` of :class:`WarmupCosine`; UserError for ``total_steps < 1``."""
    if total_steps < 1:
        raise UserError(
            f"train: the schedule has {total_steps} optimizer steps; need at least 1 (more data, or smaller batch_size/grad_accum)"
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps_for(total_steps, warmup_ratio), total_steps)
    )
