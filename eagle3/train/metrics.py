"""What the loop measures and where it goes: window sums of the per-TTT-step metrics (on the device, read at log
steps), ``metrics.jsonl`` and TensorBoard rows (rank 0), and a call's warning lines (``train_report.json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.io import append_bytes, atomic_write_jsonl, cut_torn_tail, disk_full_guard, open_append
from eagle3.process_group import Dist

log = logging.getLogger(__name__)


class Metrics:
    """Rank 0's sinks ``metrics.jsonl`` and TensorBoard. On opening: a torn last line is cut, rows after ``start_step``
    (redone now) are dropped, and so is the final validation row when the run had ``finished`` (it is recomputed).
    """

    def __init__(self, train_dir: Path, start_step: int, enabled: bool, finished: bool = False):
        self.enabled = enabled
        self.path = train_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        torn = cut_torn_tail(self.path)
        if torn:
            log.warning(
                "%s: cut a torn last line (%d bytes a kill left mid-write) before appending",
                self.path,
                torn,
            )
        rows = read_metrics(self.path)
        kept = [
            r
            for r in rows
            if r.get("step", 0) < start_step
            or (r.get("step", 0) == start_step and not (finished and r.get("kind") == "val"))
        ]
        if len(kept) != len(rows) or (self.path.exists() and start_step == 0):
            atomic_write_jsonl(self.path, kept if start_step else [])
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(
            log_dir=str(train_dir / "tb"), purge_step=start_step if start_step else None
        )

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        with open_append(self.path) as f:  # disk full: rolled back, UserError (exit 2)
            append_bytes(f, (json.dumps(row) + "\n").encode("utf-8"), self.path, fsync=False)
        step = row["step"]
        # TensorBoard's writer re-raises its thread's OSError here
        with disk_full_guard(self.path.parent / "tb"):
            for k, v in row.items():
                if k not in ("step", "epoch", "kind") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{row['kind']}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    """Rows of ``metrics.jsonl``; a torn last line (killed mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def reduce_totals(totals: dict[str, torch.Tensor], d: Dist) -> dict[str, torch.Tensor]:
    """Sum :meth:`Accum.totals` over ranks (CPU all-reduce on the gloo control group; host sync)."""
    out = {k: v.detach().to("cpu", torch.float64) for k, v in totals.items()}
    if d.distributed:
        for k in sorted(out):
            dist.all_reduce(out[k], group=d.ctrl_group)
    return out


class Accum:
    """A window's sums of micro-batch metrics (:attr:`KEYS`, float64 ``[K]`` each) on the device (no host sync), from
    zeros ``[K]`` so every rank reduces the same keys.
    """

    KEYS = ("ce_sum", "correct", "count")

    def __init__(self, ttt_length: int):
        self.sums = {k: torch.zeros(ttt_length, dtype=torch.float64) for k in self.KEYS}
        self.n = 0

    def add(self, metrics: dict) -> None:
        self.n += 1
        for k in self.sums:
            v = metrics[k].detach().to(torch.float64)  # [K] on the device
            # the CPU zeros never meet the device
            self.sums[k] = v.clone() if self.n == 1 else self.sums[k] + v

    def totals(self) -> dict[str, torch.Tensor]:
        """The sums plus ``n`` (micro-batches)."""
        return dict(self.sums, n=torch.tensor(float(self.n)))

    @staticmethod
    def summarize(sums: dict[str, torch.Tensor], step_weight: float) -> dict[str, float]:
        """Host floats from (rank-summed) :meth:`totals`, token-weighted: ``step_loss_{i}`` = CE sum / count of step ``i``,
        ``loss`` = ``sum_i step_weight**i * step_loss_{i}``, ``acc_{i}``, ``loss_tokens`` (step 0's count); {} when empty.
        """
        if not sums or float(sums["n"]) == 0:
            return {}
        count = sums["count"].clamp(min=1)  # [K]
        step_loss = (sums["ce_sum"] / count).tolist()  # [K]
        out = {"loss": sum(step_weight**i * x for i, x in enumerate(step_loss))}
        out.update((f"step_loss_{i}", x) for i, x in enumerate(step_loss))
        out.update((f"acc_{i}", x) for i, x in enumerate((sums["correct"] / count).tolist()))
        return {**out, "loss_tokens": float(sums["count"][0])}


class _WarningLines(logging.Handler):
    """A handler listing the messages of WARNING records and above, each text once."""

    def __init__(self, lines: list[str]):
        super().__init__(level=logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()  # formatted now, as shown
        except Exception:  # noqa: BLE001 - a bad log call must not stop training
            return
        if msg not in self.lines:
            self.lines.append(msg)


@contextlib.contextmanager
def collect_warnings(enabled: bool):
    """Within the block, every warning of an ``eagle3`` logger is appended once to the yielded list (``train_report.json``'s
    ``warnings``); ``enabled``: rank 0, else the list stays empty.
    """
    lines: list[str] = []
    handler, target = _WarningLines(lines), logging.getLogger("eagle3")
    if enabled:
        target.addHandler(handler)
    try:
        yield lines
    finally:
        target.removeHandler(handler)  # a no-op when it was not added
