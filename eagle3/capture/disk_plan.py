"""Stage 02's disk plan: the bytes a run will write, checked against the free space before capture.

Stage 02 knows, once the prompts are tokenized, exactly how many tokens each pending sample has.
A shard file of ``L`` tokens is ``a + b * L`` bytes: ``b`` = the storage dtype's hidden-state bytes
per token (``4 x H x 2`` in bf16, FIELD-NOTES section 5) plus 16 bytes of ``input_ids`` and
``loss_mask`` (int64), ``a`` = ``torch.save``'s zip/pickle overhead per file. Both are measured,
not assumed: :func:`shard_size_model` serialises two probe shards (``L = 64`` and ``L = 128``) built by
the run's own shard encoder (:func:`eagle3.shards.write.shard_object`) in memory, exactly as
``eagle3.io.atomic_torch_save`` serialises a shard before writing it (nothing touches a disk that may
be full), so every storage format (bf16, fp8 with scales) is measured the same way. The zip writer aligns each tensor to 64 bytes, so a real file differs
from ``a + b * L`` by at most ``64 x (tensors)`` bytes (measured: < 100 bytes for 6 tensors).

On top come the metadata files (manifest rows with their checksum, ``data_config.json``, reports,
``extract_state.json``) and the filesystem's block rounding (each file and ``rows_*`` folder takes
whole blocks of ``statvfs().f_frsize`` bytes). The plan covers only samples not yet written (a
resumed run needs room for the rest only). The check refuses to start when the free space of the
filesystem holding the shards folder (or its nearest existing parent; :func:`eagle3.io.free_bytes`)
is below ``allocated + margin``, where ``margin = max(extract.disk_margin x allocated,
extract.disk_margin_bytes)``; ``--ignore-disk-check`` runs anyway (the plan is still recorded).
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
FIXED_METADATA_BYTES = (
    16 * 1024
)  # data_config.json, reports, extract_state.json, lock, without the id lists


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
    hidden_bytes_per_token: (
        int  # hidden-state bytes per token of the storage dtype (bf16: 4 x H x 2)
    )
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
    freed_by_overwrite: int = (
        0  # old shards --overwrite deletes once the plan fits (counted in free_bytes)
    )

    def to_dict(self) -> dict:
        return asdict(self)

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
    """``(overhead bytes per file, bytes per token)`` of shards encoded by ``encode``, measured.

    Serialises (``torch.save`` into memory, as :func:`eagle3.io.atomic_torch_save` does before it
    writes) shards of :data:`PROBE_LENGTHS` tokens (hidden states all ones: finite, and a non-zero
    scale for quantised storage) and fits ``size = a + b * L`` through their byte counts.
    """
    sizes = []
    for L in PROBE_LENGTHS:
        states = [
            torch.ones(L, hidden_size, dtype=torch.bfloat16) for _ in range(num_states)
        ]  # [L, H]
        buf = io.BytesIO()
        torch.save(encode([0] * L, states, [0] * L), buf)
        sizes.append(buf.tell())
    (l0, l1), (s0, s1) = PROBE_LENGTHS, sizes
    per_token = (s1 - s0) / (l1 - l0)
    return s0 - per_token * l0, per_token


def _round_up(n: int | float, block: int) -> int:
    n = int(round(n))
    return -(-n // block) * block


def block_size_of(folder: str | os.PathLike) -> int:
    """The filesystem's allocation unit (``statvfs().f_frsize``; 4096 when unknown)."""
    try:
        st = os.statvfs(folder)
        return int(st.f_frsize or st.f_bsize or 4096)
    except (OSError, AttributeError):
        return 4096


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
    """The disk plan of writing the ``pending`` samples (``(id, num_tokens)`` each) under ``root``.

    Args:
        root: the shards folder (need not exist yet).
        pending: id and token count of each sample still to write; ``pending_idx`` their shard idx
            (for the ``rows_*`` folders they land in).
        hidden_size: verifier H; ``hidden_bytes_per_token``: the storage dtype's hidden-state bytes
            per token (recorded; bf16 = ``4 x H x 2``).
        encode: the shard encoder (measured by :func:`shard_size_model`).
        margin, margin_bytes: headroom = ``max(margin x allocated, margin_bytes)``.
        skipped_ids: the id lists data_config.json and the report will carry.
        free: ``(free bytes, folder)`` (default :func:`eagle3.io.free_bytes` of ``root``).
        freed_by_overwrite: bytes of old shards that ``--overwrite`` deletes only once this plan fits:
            added to the free bytes (recorded, and named in the messages).
    """
    overhead, per_token = shard_size_model(hidden_size, encode)
    free_b, where = free if free is not None else free_bytes(root)
    free_b += freed_by_overwrite
    block = block_size_of(where)
    tokens = sum(n for _, n in pending)
    shard_bytes, metadata, allocated = _footprint(
        pending, pending_idx, overhead, per_token, block, rows_per_dir, skipped_ids
    )
    margin_b = max(int(margin * allocated), int(margin_bytes))
    needed = allocated + margin_b
    return DiskPlan(
        path=str(where),
        samples=len(pending),
        tokens=tokens,
        hidden_bytes_per_token=int(hidden_bytes_per_token),
        file_bytes_per_token=per_token,
        file_overhead_bytes=overhead,
        shard_bytes=shard_bytes,
        metadata_bytes=metadata,
        bytes=shard_bytes + metadata,
        block_size=block,
        allocated_bytes=allocated,
        margin_bytes=margin_b,
        needed_bytes=needed,
        free_bytes=int(free_b),
        fits=free_b >= needed,
        checked=True,
        freed_by_overwrite=int(freed_by_overwrite),
    )


def _footprint(
    pending: Sequence[tuple[str, int]],
    pending_idx: Sequence[int],
    overhead: float,
    per_token: float,
    block: int,
    rows_per_dir: int,
    skipped_ids: Optional[dict],
) -> tuple[int, int, int]:
    """``(shard bytes, metadata bytes, allocated bytes)`` of writing ``pending`` (:func:`plan_disk`'s arguments):
    each shard ``overhead + per_token x tokens`` rounded up to ``block``, the manifest and the metadata files
    (the skipped id lists go into data_config.json and the report), one block per new ``rows_*`` folder."""
    shard_bytes = 0
    allocated = 0
    for _, n in pending:
        size = overhead + per_token * n
        shard_bytes += int(round(size))
        allocated += _round_up(size, block)
    man = _manifest_bytes(pending, pending_idx)
    ids_json = len(json.dumps(skipped_ids or {}))
    metadata = (
        man + FIXED_METADATA_BYTES + 2 * ids_json
    )  # the id lists go into data_config.json and the report
    new_dirs = {i // rows_per_dir for i in pending_idx}
    allocated += (
        _round_up(man, block)
        + _round_up(FIXED_METADATA_BYTES + 2 * ids_json, block)
        + len(new_dirs) * block
    )
    return shard_bytes, metadata, allocated


def _manifest_bytes(pending: Sequence[tuple[str, int]], pending_idx: Sequence[int]) -> int:
    """Bytes of the manifest rows of ``pending`` (``(id, num_tokens)``) as ManifestWriter writes them (checksum
    included), one line each."""
    return sum(
        len(
            json.dumps(
                {
                    "idx": i,
                    "id": sid,
                    "num_tokens": n,
                    "num_loss_tokens": n,
                    DEFAULT_ALGO: "0" * HEX_LEN[DEFAULT_ALGO],
                }
            )
        )
        + 1
        for i, (sid, n) in zip(pending_idx, pending)
    )


def check_disk(plan: DiskPlan, ignore: bool) -> DiskPlan:
    """Log the plan; raise :class:`NotEnoughDisk` when it does not fit (unless ``ignore``).

    Returns the plan with ``checked = not ignore``.

    Raises:
        NotEnoughDisk: one line naming the folder measured, the bytes needed and the bytes free.
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
    """Stage 02's disk-plan step (rank 0, before any capture): :func:`plan_disk` of the pending samples ``todo``
    (:class:`eagle3.capture.prompts.Sample`) then :func:`check_disk`; returns the plan as a dict (recorded in
    ``extract_report.json``/``.md``; not in data_config.json, whose content depends only on the data).

    ``storage``: the shards' storage (fp8: values + scales are measured); ``tokens_only``: token-only shards
    (ids + mask, no hidden states). ``freed_by_overwrite``: bytes of old shards that ``--overwrite`` deletes once
    the plan fits (counted as free, so a refused plan deletes nothing).

    Raises:
        NotEnoughDisk: the filesystem of ``root`` has less free space than needed (and not ``ignore``).
    """
    encode = functools.partial(shard_object, storage=storage)
    hidden_bpt = bytes_per_token(hidden_size, storage=storage)
    if tokens_only:
        encode, hidden_bpt = _token_encode, 0
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
    return check_disk(plan, ignore).to_dict()


def _token_encode(input_ids, _hidden_states, loss_mask) -> dict:
    """The shard encoder of token-only samples (the states of the probe are dropped)."""
    return shard_object(input_ids, None, loss_mask)
