"""Stage 02's disk plan: the bytes a run will write, checked against the free space before capture.

A shard of ``L`` tokens is ``a + b * L`` bytes, both measured by :func:`shard_size_model` on two
probe shards serialised in memory by the run's own encoder (any storage format; within 64 bytes
per tensor of a real file). Metadata files and block rounding (``statvfs().f_frsize``) come on top;
only samples not yet written count. The check refuses when the free space is below ``allocated +
max(extract.disk_margin x allocated, extract.disk_margin_bytes)``; ``--ignore-disk-check`` runs
anyway.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from eagle3.errors import UserError
from eagle3.io import format_bytes, free_bytes
from eagle3.shards.checksum import DEFAULT_ALGO, HEX_LEN
from eagle3.shards.data_config import bytes_per_token
from eagle3.shards.fp8 import Storage
from eagle3.shards.write import shard_object

log = logging.getLogger(__name__)

# Multiples of 64: every tensor's byte count (L x any element size, e.g. fp8's per-token fp32 scales) is then a
# multiple of torch.save's 64-byte alignment, so the fit carries no padding (probing at L = 8, 16 was 2% low for fp8).
PROBE_LENGTHS = (64, 128)
# data_config.json, reports, extract_state.json, lock, without the id lists
FIXED_METADATA_BYTES = 16 * 1024


#: ``encode(input_ids, hidden_states, loss_mask) -> dict``: the object a shard file holds
#: (:func:`eagle3.shards.write.shard_object` with the run's storage).
ShardEncodeFn = Callable[..., dict]


class NotEnoughDisk(UserError):
    """The shards folder's filesystem has less free space than the plan needs (exit code 2)."""


@dataclass
class DiskPlan:
    """What a stage-02 run will write and whether it fits (all sizes in bytes)."""

    path: str  # the folder whose filesystem was measured
    samples: int  # samples still to write
    tokens: int  # their tokens
    # hidden-state bytes per token of the storage dtype (bf16: 4 x H x 2)
    hidden_bytes_per_token: int
    file_bytes_per_token: float  # measured slope of one shard file (hidden states + ids + mask)
    file_overhead_bytes: float  # measured torch.save bytes per file
    shard_bytes: int  # the shard files' sizes
    metadata_bytes: int  # manifest rows + JSON files
    bytes: int  # shard_bytes + metadata_bytes (what ``du --apparent-size`` would show)
    block_size: int  # filesystem allocation unit
    allocated_bytes: int  # ``bytes`` with every file and rows_* folder rounded up to whole blocks
    margin_bytes: int
    needed_bytes: int  # allocated_bytes + margin_bytes
    free_bytes: int  # free on the filesystem, plus freed_by_overwrite
    fits: bool
    checked: bool  # False under --ignore-disk-check
    # old shards --overwrite deletes once the plan fits (counted in free_bytes)
    freed_by_overwrite: int = 0

    def describe(self) -> str:
        """One human-readable line: samples, tokens, estimate, margin, free space."""
        return (
            f"disk plan: {self.samples} samples, {self.tokens} tokens x {self.file_bytes_per_token:.0f} B/token "
            f"(+{self.file_overhead_bytes:.0f} B per file) = {format_bytes(self.bytes)} "
            f"({format_bytes(self.allocated_bytes)} in {self.block_size}-byte blocks) + margin "
            f"{format_bytes(self.margin_bytes)}; {format_bytes(self.free_bytes)} free on {self.path}"
            + (
                f" (counting {format_bytes(self.freed_by_overwrite)} of old shards that --overwrite deletes)"
                if self.freed_by_overwrite
                else ""
            )
        )


def shard_size_model(
    hidden_size: int, encode: ShardEncodeFn, num_states: int = 4
) -> tuple[float, float]:
    """``(overhead bytes per file, bytes per token)`` of shards encoded by ``encode``, fitted on
    in-memory ``torch.save`` sizes of :data:`PROBE_LENGTHS`-token probes.
    """
    sizes = []
    for L in PROBE_LENGTHS:
        # distinct tensors: torch.save stores a shared one once
        states = [torch.ones(L, hidden_size, dtype=torch.bfloat16) for _ in range(num_states)]
        buf = io.BytesIO()
        torch.save(encode([0] * L, states, [0] * L), buf)
        sizes.append(buf.tell())
    (l0, l1), (s0, s1) = PROBE_LENGTHS, sizes
    per_token = (s1 - s0) / (l1 - l0)
    return s0 - per_token * l0, per_token


def _round_up(n: int | float, block: int) -> int:
    return -(-int(round(n)) // block) * block


def block_size_of(folder: str | os.PathLike) -> int:
    """The filesystem's allocation unit (``statvfs().f_frsize``; 4096 when unknown)."""
    try:
        st = os.statvfs(folder)
        return int(st.f_frsize or st.f_bsize or 4096)
    except (OSError, AttributeError):
        return 4096


def _manifest_bytes(pending: Sequence[tuple[str, int]], pending_idx: Sequence[int]) -> int:
    """Bytes of the manifest rows of ``pending`` as ManifestWriter writes them (checksum included), a line each."""
    checksum = "0" * HEX_LEN[DEFAULT_ALGO]
    return sum(
        len(
            json.dumps(
                {"idx": i, "id": sid, "num_tokens": n, "num_loss_tokens": n, DEFAULT_ALGO: checksum}
            )
        )
        + 1
        for i, (sid, n) in zip(pending_idx, pending)
    )


def plan_disk(
    root: str | os.PathLike,
    pending: Sequence[tuple[str, int]],
    *,
    hidden_size: int,
    hidden_bytes_per_token: int,
    rows_per_dir: int,
    pending_idx: Sequence[int],
    encode: ShardEncodeFn,
    margin: float,
    margin_bytes: int,
    skipped_ids: Optional[dict] = None,
    free: Optional[tuple[int, Path]] = None,
    freed_by_overwrite: int = 0,
) -> DiskPlan:
    """The disk plan of writing the ``pending`` samples ``(id, num_tokens)`` under ``root``.

    Args:
        root: the shards folder. pending_idx: the samples' shard idx (their ``rows_*`` folders).
        hidden_size, hidden_bytes_per_token: recorded.
        encode: the shard encoder. margin, margin_bytes: headroom ``max(margin x allocated, margin_bytes)``.
        skipped_ids: the id lists data_config.json and the report carry.
        free: ``(free bytes, folder)`` (default :func:`eagle3.io.free_bytes` of ``root``).
        freed_by_overwrite: bytes ``--overwrite`` deletes once the plan fits (counted free).
    """
    overhead, per_token = shard_size_model(hidden_size, encode)
    free_b, where = free if free is not None else free_bytes(root)
    free_b += freed_by_overwrite
    block = block_size_of(where)
    sizes = [overhead + per_token * n for _, n in pending]
    shard_bytes = sum(int(round(x)) for x in sizes)
    man = _manifest_bytes(pending, pending_idx)
    # the skipped id lists go into data_config.json and the report
    files = FIXED_METADATA_BYTES + 2 * len(json.dumps(skipped_ids or {}))
    new_dirs = {i // rows_per_dir for i in pending_idx}  # one block per new rows_* folder
    allocated = sum(_round_up(x, block) for x in sizes) + _round_up(man, block)
    allocated += _round_up(files, block) + len(new_dirs) * block
    margin_b = max(int(margin * allocated), int(margin_bytes))
    needed = allocated + margin_b
    return DiskPlan(
        path=str(where),
        samples=len(pending),
        tokens=sum(n for _, n in pending),
        hidden_bytes_per_token=int(hidden_bytes_per_token),
        file_bytes_per_token=per_token,
        file_overhead_bytes=overhead,
        shard_bytes=shard_bytes,
        metadata_bytes=man + files,
        bytes=shard_bytes + man + files,
        block_size=block,
        allocated_bytes=allocated,
        margin_bytes=margin_b,
        needed_bytes=needed,
        free_bytes=int(free_b),
        fits=free_b >= needed,
        checked=True,
        freed_by_overwrite=int(freed_by_overwrite),
    )


def check_disk(plan: DiskPlan, ignore: bool) -> DiskPlan:
    """Log the plan and return it with ``checked = not ignore``.

    Raises:
        NotEnoughDisk: it does not fit (unless ``ignore``): folder, bytes needed, bytes free.
    """
    log.info("%s", plan.describe())
    plan.checked = not ignore
    if plan.fits:
        return plan
    if ignore:
        log.warning(
            "--ignore-disk-check: %s needed, only %s free on %s; the run may stop on a full disk",
            format_bytes(plan.needed_bytes),
            format_bytes(plan.free_bytes),
            plan.path,
        )
        return plan
    raise NotEnoughDisk(
        f"{plan.path}: not enough disk space for stage 02: needs {format_bytes(plan.needed_bytes)} "
        f"({plan.samples} samples, {plan.tokens} tokens, {format_bytes(plan.allocated_bytes)} + margin "
        f"{format_bytes(plan.margin_bytes)}), {format_bytes(plan.free_bytes)} free"
        + (
            f" counting {format_bytes(plan.freed_by_overwrite)} of old shards that --overwrite would delete "
            "(nothing was deleted)"
            if plan.freed_by_overwrite
            else ""
        )
        + "; free space, set extract.output_dir to a larger filesystem, or pass --ignore-disk-check"
    )


def plan_pending(
    root: Path,
    todo: Sequence,
    *,
    hidden_size: int,
    storage: Storage,
    tokens_only: bool,
    rows_per_dir: int,
    margin: float,
    margin_bytes: int,
    skipped_ids: dict,
    ignore: bool,
    freed_by_overwrite: int = 0,
) -> dict:
    """:func:`plan_disk` of the pending ``todo`` then :func:`check_disk` (rank 0, before capture);
    the plan as a dict for ``extract_report.json``. ``storage``: the shards' storage;
    ``tokens_only``: token-only shards.

    Raises:
        NotEnoughDisk: less free space than needed (and not ``ignore``).
    """
    encode = functools.partial(shard_object, storage=storage)
    hidden_bpt = bytes_per_token(hidden_size, storage=storage)
    if tokens_only:  # token-only shards: the probe's states are dropped
        hidden_bpt = 0
        encode = lambda input_ids, _states, loss_mask: shard_object(input_ids, None, loss_mask)  # noqa: E731
    plan = plan_disk(
        root,
        [(s.id, len(s.input_ids)) for s in todo],
        hidden_size=hidden_size,
        hidden_bytes_per_token=hidden_bpt,
        rows_per_dir=rows_per_dir,
        pending_idx=[s.idx for s in todo],
        encode=encode,
        margin=margin,
        margin_bytes=margin_bytes,
        skipped_ids=skipped_ids,
        freed_by_overwrite=freed_by_overwrite,
    )
    return asdict(check_disk(plan, ignore))
