"""Training under torchrun: this rank's :class:`eagle3.process_group.Dist` (:func:`init_distributed`), the few CPU
collectives of training (on the gloo control group, never a GPU sync), the rank-agreement refusals (config, data,
checkpoint), and the stop flag of SIGTERM/SIGINT."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from eagle3.errors import UserError
from eagle3.process_group import Dist, init_dist, torchrun_env
from eagle3.train import checkpoint as ckpt


def init_distributed(device: Optional[str] = None) -> Dist:
    """This rank's :class:`Dist` from the torchrun env (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``): NCCL on ``cuda:{LOCAL_RANK}`` when CUDA is available, else gloo; a world of 1 without torchrun.

    Args:
        device: ``"cpu"`` forces CPU (and gloo); None = ``cuda:{LOCAL_RANK}`` if available else CPU.

    Raises:
        UserError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers.
    """
    _, _, local_rank = torchrun_env()
    use_cuda = torch.cuda.is_available() and device != "cpu"
    dev = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    return init_dist(backend="nccl" if use_cuda else "gloo", device=dev, job="stage 04")


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested config dump as ``{"train.lr": 0.001, ...}``."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def ranks_agree(d: Dist, mine: dict) -> None:
    """Every torchrun rank must train under rank 0's config and command line (``mine``: the dotted config keys and
    the stage's flags, :func:`dotted`). Each rank reads them itself; one with another ``train.lr`` stepped its DDP
    replica with its own lr, one with another ``train.batch_size`` aborted rank 0 with no message.

    Raises:
        UserError: on every rank, naming the first rank that differs from rank 0 and the differing keys.
    """
    if not d.distributed:
        return
    everyone = d.all_gather(mine)
    first = everyone[0]
    for r, theirs in enumerate(everyone):
        keys = sorted(
            k
            for k in set(theirs) | set(first)
            if theirs.get(k, "<absent>") != first.get(k, "<absent>")
        )
        if keys:
            shown = ", ".join(
                f"{k}: {first.get(k, '<absent>')!r} on rank 0, {theirs.get(k, '<absent>')!r} on rank {r}"
                for k in keys[:4]
            ) + (f" (and {len(keys) - 4} more)" if len(keys) > 4 else "")
            raise UserError(
                f"torchrun rank {r} runs 04 with another config or command line than rank 0 ({shown}); "
                f"every rank must read the same YAML, --set overrides and flags (a node with another copy?)"
            )


def same_data(d: Dist, inputs: dict, data_dir: Path) -> None:
    """Every torchrun rank must train on rank 0's data (``inputs``: :func:`eagle3.train.order.data_inputs`: 03's
    split and vocab map by content sha256, the shards' aux layers and verifier weights). Each rank reads them itself;
    a rank on a node with another copy of the data folder trained other samples (or targets) without a word.

    Raises:
        UserError: on every rank, naming the first rank whose data differs from rank 0's and the differing inputs.
    """
    if not d.distributed:
        return
    everyone = d.all_gather(inputs)
    for r, theirs in enumerate(everyone):
        keys = sorted(
            k for k in set(theirs) | set(everyone[0]) if theirs.get(k) != everyone[0].get(k)
        )
        if keys:
            raise UserError(
                f"{data_dir}: torchrun rank {r} read other data than rank 0 (differing: "
                f"{', '.join(keys)}); every rank must read the same data folder and shards (a node with "
                f"another copy?)"
            )


def same_checkpoint(train_dir: Path, found: Optional[tuple], d: Dist) -> None:
    """Every torchrun rank must resume from rank 0's checkpoint. Each rank looks for it itself; a rank that saw no
    checkpoint (a node-local ``train.output_dir``) or another newest one started from another step than rank 0, and
    the DDP replicas trained on from different weights and data positions.

    Raises:
        UserError: on every rank, naming the first rank whose checkpoint differs from rank 0's.
    """
    if not d.distributed:
        return
    mine = None if found is None else (found[0].name, int(found[1]["step"]))
    everyone = d.all_gather(mine)
    say = lambda w: "no checkpoint" if w is None else f"{w[0]} (step {w[1]})"  # noqa: E731
    for r, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            raise UserError(
                f"{ckpt.ckpt_dir(train_dir)}: --resume: torchrun rank {r} found {say(theirs)}, rank 0 "
                f"{say(everyone[0])}; every rank must see the same train.output_dir (a node-local folder?)"
            )


def any_rank(flag: bool, d: Dist) -> bool:
    """True if ``flag`` is True on any rank (one CPU all-reduce on the gloo control group)."""
    if not d.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=d.ctrl_group)
    return bool(t.item())


def sum_ranks(values: list[float], d: Dist) -> list[float]:
    if not d.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=d.ctrl_group)
    return t.tolist()


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop finishes the current optimizer step, checkpoints and returns.

    A second SIGINT falls through to the previous handler (so Ctrl-C twice still aborts).
    Handlers are installed only in the main thread and restored by :meth:`restore`.
    """

    def __init__(self):
        self.requested = False
        self.signum: Optional[int] = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            old = self._old.get(signum)
            if callable(old):
                old(signum, frame)
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
