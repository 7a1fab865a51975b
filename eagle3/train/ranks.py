"""Training under torchrun: this rank's :class:`eagle3.process_group.Dist`, the CPU collectives of training (gloo
control group, never a GPU sync), the rank-agreement refusals (config, data,
checkpoint; :meth:`Dist.agree` raises them), the SIGTERM/SIGINT flag.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from eagle3.process_group import Dist, init_dist, rank_cuda_device, torchrun_env
from eagle3.train import checkpoint as ckpt


def init_distributed(device: Optional[str] = None) -> Dist:
    """This rank's :class:`Dist` from the torchrun env: NCCL on ``cuda:{LOCAL_RANK}`` when CUDA is available and
    ``device`` is not ``"cpu"``, else gloo; a world of 1 without torchrun. UserError: non-integer env values.
    """
    _, _, local_rank = torchrun_env()
    use_cuda = torch.cuda.is_available() and device != "cpu"
    dev = torch.device(rank_cuda_device(local_rank) if use_cuda else "cpu")
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


def _differing(first: dict, theirs: dict) -> list[str]:
    """The keys whose values differ between two ranks' dicts (sorted; an absent key differs from any value)."""
    return sorted(
        k for k in set(theirs) | set(first) if theirs.get(k, "<absent>") != first.get(k, "<absent>")
    )


def ranks_agree(d: Dist, mine: dict) -> None:
    """UserError on every rank when some rank's ``mine`` (dotted config keys and flags, :func:`dotted`) differs from rank
    0's, naming the first such rank and the keys."""

    def refusal(r: int, first: dict, theirs: dict) -> str:
        keys = _differing(first, theirs)
        shown = ", ".join(
            f"{k}: {first.get(k, '<absent>')!r} on rank 0, {theirs.get(k, '<absent>')!r} on rank {r}"
            for k in keys[:4]
        ) + (f" (and {len(keys) - 4} more)" if len(keys) > 4 else "")
        return (
            f"torchrun rank {r} runs 04 with another config or command line than rank 0 ({shown}); "
            f"every rank must read the same YAML, --set overrides and flags (a node with another copy?)"
        )

    d.agree(mine, refusal)


def same_data(d: Dist, inputs: dict, data_dir: Path) -> None:
    """UserError on every rank when some rank read other data than rank 0 (``inputs``:
    :func:`eagle3.train.order.data_inputs`), naming the first such rank and the inputs."""
    d.agree(
        inputs,
        lambda r, first, theirs: (
            f"{data_dir}: torchrun rank {r} read other data than rank 0 (differing: "
            f"{', '.join(_differing(first, theirs))}); every rank must read the same data folder and shards (a node "
            f"with another copy?)"
        ),
    )


def same_checkpoint(train_dir: Path, found: Optional[tuple], d: Dist) -> None:
    """UserError on every rank when some rank found another newest checkpoint (or none) than rank 0 on ``--resume``."""
    say = lambda w: "no checkpoint" if w is None else f"{w[0]} (step {w[1]})"  # noqa: E731
    d.agree(
        None if found is None else (found[0].name, int(found[1]["step"])),
        lambda r, first, theirs: (
            f"{ckpt.ckpt_dir(train_dir)}: --resume: torchrun rank {r} found {say(theirs)}, rank 0 {say(first)}; "
            f"every rank must see the same train.output_dir (a node-local folder?)"
        ),
    )


def any_rank(flag: bool, d: Dist) -> bool:
    """True if ``flag`` is True on any rank (:func:`sum_ranks`)."""
    return sum_ranks([float(flag)], d)[0] > 0


def sum_ranks(values: list[float], d: Dist) -> list[float]:
    """``values`` summed over ranks (one CPU all-reduce on the control group)."""
    if not d.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=d.ctrl_group)
    return t.tolist()


class StopFlag:
    """SIGTERM/SIGINT set a flag (the loop finishes the step, checkpoints, returns); a second SIGINT reaches the previous
    handler. Installed in the main thread only; :meth:`restore` puts the old handlers back.
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
