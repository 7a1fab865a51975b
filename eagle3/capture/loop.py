"""The capture loop of stage 02: capture each planned batch and write its pending samples' shards.

With ``write_threads > 0`` batch k+1's forward is launched before batch k's states are waited for
and shards are written by :mod:`eagle3.capture.shard_writer`; rows still land in batch order after
their shard is durable, so the folder equals the serial loop's. Test hook:
``EAGLE3_EXTRACT_SLEEP_PER_BATCH`` (seconds) sleeps after each batch.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Callable, Optional

from tqdm import tqdm

from eagle3.capture.base import CaptureBackend, check_captured
from eagle3.capture.hf import plan_batches
from eagle3.capture.multi import prefetching
from eagle3.capture.prompts import Sample
from eagle3.capture.shard_writer import ShardWriter
from eagle3.capture.tokenize_pool import default_workers
from eagle3.shards import (
    format as shard_format,  # TOKEN_PROCESS_MIN read at call time (tests lower it)
)
from eagle3.shards.checksum import DEFAULT_ALGO
from eagle3.shards.fp8 import Storage
from eagle3.shards.manifest import ManifestWriter

SLEEP_ENV = "EAGLE3_EXTRACT_SLEEP_PER_BATCH"


def default_write_threads() -> int:
    """Writer threads for ``extract.write_threads: null``: the usable cores divided among the local
    torchrun ranks, at most 8 (enough to keep up with one H200 on SmolLM2-size shards)."""
    return max(1, min(8, default_workers()))


def assign_batches(
    samples: list[Sample], done: dict[int, dict], batch_tokens: int, rank: int, world: int
) -> list[list[int]]:
    """Rank ``rank``'s batches (positions into ``samples``): the batches of the global plan
    (:func:`eagle3.capture.hf.plan_batches` over ALL samples) with a pending sample, every ``world``-th one. The
    batches come from the global plan, so padding (and every tensor) matches one process and an uninterrupted run."""
    plan = plan_batches([len(s.input_ids) for s in samples], batch_tokens)
    todo = [g for g in plan if any(samples[i].idx not in done for i in g)]
    return todo[rank::world]


def start_capture(
    backend: CaptureBackend, batch: list[list[int]], storage: Optional[Storage] = None
):
    """Launch ``batch``'s capture; the handle's ``states()`` returns per sample what the writer
    takes (:class:`eagle3.shards.write.StoredStates` when the backend encodes on its device, else
    the 4 bf16 tensors).
    """
    start = getattr(backend, "capture_async", None)  # HFCapture: encodes on its device
    if callable(start):
        return SimpleNamespace(states=start(batch, storage=storage or Storage()).stored)
    states = backend.capture(batch)
    return SimpleNamespace(states=lambda: states)


def capture_and_write(
    backend: Optional[CaptureBackend],
    samples: list[Sample],
    batches: list[list[int]],
    done: dict[int, dict],
    hidden_size: int,
    root,
    rows_per_dir: int,
    manifest_path,
    *,
    write_threads: int,
    max_pending_tokens: int,
    on_commit: Optional[Callable[[dict], None]] = None,
    storage: Optional[Storage] = None,
    checksum: str = DEFAULT_ALGO,
) -> list[dict]:
    """Capture each batch of ``samples`` positions and write the shards of samples not in ``done``
    (updated as rows land) to ``manifest_path``; returns the new rows in order.

    ``backend`` None: only write the pending token-only samples (``{input_ids, loss_mask}``), by processes from
    :data:`eagle3.shards.format.TOKEN_PROCESS_MIN` samples on (``storage`` must then be None).
    ``write_threads``: 0 serial, else pipelined with that many writer threads (same bytes).
    ``storage``: bf16 (None) or fp8. ``checksum``: the hash recorded per row.

    Raises:
        RuntimeError: a backend broke its contract. UserError / OSError: a write failed.
    """
    sleep_s = float(os.environ.get(SLEEP_ENV, "0") or 0)
    rows: list[dict] = []
    n_todo = sum(samples[i].idx not in done for group in batches for i in group)
    procs = backend is None and write_threads > 1 and n_todo >= shard_format.TOKEN_PROCESS_MIN
    with (
        ManifestWriter(manifest_path) as man,
        ShardWriter(
            root,
            rows_per_dir,
            man,
            threads=write_threads,
            max_pending_tokens=max_pending_tokens,
            on_commit=_committer(done, rows, on_commit),
            storage=storage,
            checksum=checksum,
            processes=procs,
        ) as writer,
    ):
        if backend is None:
            for s in (samples[i] for group in batches for i in group):
                if s.idx not in done:
                    writer.submit(s.idx, s.id, s.input_ids, None, s.loss_mask)
            return rows
        # every member is captured (padded shapes as uninterrupted); only unfinished ones are written
        _feed(
            batches,
            lambda group: start_capture(backend, [samples[i].input_ids for i in group], storage),
            lambda group, handle: _write_captured(
                samples, done, hidden_size, writer, group, handle.states(), sleep_s
            ),
            serial=write_threads == 0,
        )
    return rows


def _write_captured(
    samples: list[Sample],
    done: dict[int, dict],
    hidden_size: int,
    writer: ShardWriter,
    group: list[int],
    states: list,
    sleep_s: float,
) -> None:
    """Hand ``writer`` the captured ``states`` of the batch ``group`` (positions in ``samples``), skipping samples
    already in ``done``; each is checked first (:func:`eagle3.capture.base.check_captured`). ``sleep_s``: a
    pause after the states arrive (the tests' slow-capture knob, :data:`SLEEP_ENV`)."""
    if sleep_s:
        time.sleep(sleep_s)
    for i, st in zip(group, states):
        s = samples[i]
        if s.idx in done:
            continue
        check_captured(s.input_ids, st, hidden_size, f"sample {s.idx} ('{s.id}')")
        writer.submit(s.idx, s.id, s.input_ids, st, s.loss_mask)


def _committer(
    done: dict[int, dict], rows: list[dict], on_commit: Optional[Callable[[dict], None]]
) -> Callable[[dict], None]:
    """The shard writer's ``on_commit``: record ``row`` in ``done`` and ``rows``, then call ``on_commit``."""

    def committed(row: dict) -> None:
        done[row["idx"]] = row
        rows.append(row)
        if on_commit is not None:
            on_commit(row)

    return committed


def _feed(batches: list[list[int]], start: Callable, write: Callable, serial: bool) -> None:
    """Start each batch's capture (``start(group) -> handle``) and hand it to ``write(group, handle)``; pipelined
    unless ``serial``: batch k-1 is written after batch k's forward was launched."""
    prev = None
    for group in batches:
        handle = start(group)
        if serial:
            write(group, handle)
            continue
        if prev is not None:
            write(*prev)
        prev = (group, handle)
    if prev is not None:
        write(*prev)


def write_pending(
    backend: Optional[CaptureBackend],
    samples: list[Sample],
    mine: list[list[int]],
    done: dict[int, dict],
    root,
    manifest_path,
    *,
    rows_per_dir: int,
    batch_tokens: int,
    write_threads: int,
    storage: Optional[Storage],
    hidden_size: int,
    bar: dict,
) -> list[dict]:
    """Capture (``backend``) or, for token-only samples (``backend`` None), only write the pending samples of the
    batches ``mine``, with a tqdm token bar (``bar``: ``total``, ``initial``, ``desc``, ``position``); at most
    ``2 x batch_tokens`` tokens in flight to the writers. Returns the new manifest rows (in order)."""
    with tqdm(unit="tok", unit_scale=True, mininterval=1.0, **bar) as pbar:
        kw = dict(
            write_threads=write_threads,
            max_pending_tokens=2 * batch_tokens,
            on_commit=lambda row: pbar.update(row["num_tokens"]),
            storage=storage,
        )
        if backend is None:
            kw["storage"] = None
        # several SGLang servers: the batch plan is announced so batches are captured ahead, in parallel
        with prefetching(backend, [[samples[i].input_ids for i in g] for g in mine]):
            return capture_and_write(
                backend, samples, mine, done, hidden_size, root, rows_per_dir, manifest_path, **kw,
            )  # fmt: skip
