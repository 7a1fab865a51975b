"""Stage 02's shard writer: serialisation, checksum and atomic writes on background threads,
manifest in order.

Samples are written by :func:`eagle3.shards.write.write_sample` on a thread pool while the GPU
captures; manifest rows are appended in submission order, each after its shard is durable (one
fsync per group), so the manifest equals the serial loop's and :mod:`eagle3.capture.folder`'s
crash-safety rules hold. While writers exist the GIL switch interval is at most
:data:`SWITCH_INTERVAL_S`. ``threads=0`` is the serial path; :meth:`ShardWriter.submit` blocks
beyond ``max_pending_tokens`` uncommitted tokens.
"""

from __future__ import annotations

import collections
import math
import sys
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from eagle3.shards.checksum import DEFAULT_ALGO, new_hasher
from eagle3.shards.manifest import ManifestWriter
from eagle3.shards.write import NonFiniteStates, write_sample

#: GIL switch interval (seconds) while writer threads run; None leaves Python's setting alone.
SWITCH_INTERVAL_S: Optional[float] = 0.0005
#: token-only samples per worker-process task (``ShardWriter(processes=True)``)
GROUP_SIZE = 64


def _write_one(
    root: Path,
    idx: int,
    rows_per_dir: int,
    input_ids: list[int],
    states: Sequence[torch.Tensor],
    loss_mask: list[int],
    storage=None,
    checksum: str = DEFAULT_ALGO,
) -> str:
    # checksum of the shard's bytes as they are written (no read-back): stage 03 detects later
    # silent corruption with it
    h = new_hasher(checksum)
    write_sample(root, idx, rows_per_dir, input_ids, states, loss_mask, storage, hasher=h)
    return h.hexdigest()


def _write_group(
    root: Path, rows_per_dir: int, items: list[tuple[int, list[int], list[int]]], checksum: str
) -> list[str]:
    """A worker process's task (token-only samples, ``ShardWriter(processes=True)``): ``_write_one`` of each
    ``(idx, input_ids, loss_mask)`` in order; returns their digests."""
    return [
        _write_one(root, idx, rows_per_dir, ids, None, mask, None, checksum)
        for idx, ids, mask in items
    ]


class ShardWriter:
    """Write shards (one per sample) and log them in ``manifest.jsonl`` in submission order.

    Args:
        root, rows_per_dir: see :func:`eagle3.shards.format.shard_path`.
        manifest: open manifest; rows ``{idx, id, num_tokens, num_loss_tokens, <checksum>}``.
        threads: writer threads (0 = inline).
        max_pending_tokens: bound on submitted-but-uncommitted tokens (one larger sample passes alone).
        on_commit: called with each appended row, in order.
        storage: :class:`eagle3.shards.fp8.Storage` (None = bf16). checksum: the per-shard hash.
        processes: token-only samples: ``threads`` forked processes write groups of
            :data:`GROUP_SIZE` (the pickler holds the GIL); same files and rows.
    """

    def __init__(
        self,
        root: Path,
        rows_per_dir: int,
        manifest: ManifestWriter,
        threads: int = 0,
        max_pending_tokens: int = 1 << 18,
        on_commit: Optional[Callable[[dict], None]] = None,
        storage=None,
        checksum: str = DEFAULT_ALGO,
        processes: bool = False,
    ):
        self.root = Path(root)
        self.rows_per_dir = int(rows_per_dir)
        self.manifest = manifest
        self.threads = int(threads)
        self.max_pending_tokens = int(max_pending_tokens)
        self.on_commit = on_commit
        self.storage = storage
        new_hasher(checksum)  # unknown name: ValueError now, not in a writer thread
        self.checksum = checksum
        self.processes = bool(processes) and self.threads > 0
        if self.processes and storage is not None:
            raise ValueError(
                "ShardWriter: processes=True writes token-only samples only (no storage)"
            )
        # processes: samples not yet sent
        self._group: list[tuple[dict, tuple[int, list[int], list[int]]]] = []
        self._pool = None
        self._old_switch: Optional[float] = None
        if self.processes:
            from eagle3.capture.tokenize_pool import process_context

            self._pool = ProcessPoolExecutor(self.threads, mp_context=process_context())
        elif self.threads > 0:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard-writer")
            if SWITCH_INTERVAL_S is not None:
                self._old_switch = sys.getswitchinterval()
                sys.setswitchinterval(min(self._old_switch, SWITCH_INTERVAL_S))
        # (row meta, write future, index of the sample's digest in a group write's result or None)
        self._pending: collections.deque[tuple[dict, Future, Optional[int]]] = collections.deque()
        self._pending_tokens = 0

    def submit(
        self,
        idx: int,
        sample_id: str,
        input_ids: list[int],
        states: Sequence[torch.Tensor],
        loss_mask: list[int],
    ) -> None:
        """Queue sample ``idx`` (prompt ``sample_id``) for writing; ``states`` = 4 bf16 CPU ``[L, H]``.

        Raises:
            the error of an earlier write (e.g. ``OSError`` on a full disk), before queueing more.
        """
        meta = {
            "idx": int(idx),
            "id": str(sample_id),
            "num_tokens": len(input_ids),
            "num_loss_tokens": sum(loss_mask),
        }
        args = (self.root, idx, self.rows_per_dir, input_ids, states, loss_mask)
        args += (self.storage, self.checksum)
        if self._pool is None:
            try:
                digest = _write_one(*args)
            except NonFiniteStates as e:
                raise e.explained(sample_id=meta["id"]) from None
            self._append([(meta, digest)])
            return
        if self.processes:
            if states is not None:
                raise ValueError(
                    "ShardWriter(processes=True): token-only samples only (states must be None)"
                )
            self._group.append((meta, (int(idx), list(input_ids), list(loss_mask))))
            if len(self._group) >= GROUP_SIZE:
                self._send_group()
            return
        L = len(input_ids)
        self._make_room(L)
        fut = self._pool.submit(_write_one, *args)
        self._pending.append((meta, fut, None))
        self._pending_tokens += L

    def _make_room(self, L: float) -> None:
        """Commit what is done, then wait while ``L`` more tokens would pass ``max_pending_tokens`` (``inf``: until
        every write is committed)."""
        self.commit_ready()
        while self._pending and self._pending_tokens + L > self.max_pending_tokens:
            self._pending[0][1].exception()  # wait for the oldest; commit_ready raises its error
            self.commit_ready()

    def _send_group(self) -> None:
        """processes: submit the buffered samples as one task (one pending entry per sample, in order)."""
        group, self._group = self._group, []
        if not group:
            return
        L = sum(meta["num_tokens"] for meta, _ in group)
        self._make_room(L)
        fut = self._pool.submit(
            _write_group, self.root, self.rows_per_dir, [item for _, item in group], self.checksum
        )
        for k, (meta, _) in enumerate(group):
            self._pending.append((meta, fut, k))
        self._pending_tokens += L

    def commit_ready(self) -> int:
        """Append the rows of the leading finished writes (in submission order); return how many.

        Raises:
            the error of the first failed write among them (rows before it are appended first).
        """
        done: list[tuple[dict, str]] = []
        err: Optional[BaseException] = None
        while self._pending and self._pending[0][1].done():
            meta, fut, k = self._pending[0]
            if fut.cancelled():
                break
            err = fut.exception()
            if isinstance(err, NonFiniteStates):
                err = err.explained(sample_id=meta["id"])  # the conversation id, known here
            if err is not None:
                break
            self._pending.popleft()
            self._pending_tokens -= meta["num_tokens"]
            done.append((meta, fut.result() if k is None else fut.result()[k]))
        if done:
            self._append(done)
        if err is not None:
            raise err
        return len(done)

    def _append(self, done: list[tuple[dict, str]]) -> None:
        rows = self.manifest.append_many([{**meta, self.checksum: digest} for meta, digest in done])
        if self.on_commit is not None:
            for row in rows:
                self.on_commit(row)

    def flush(self) -> None:
        """Wait for every queued write and append all rows (raises the first write error)."""
        self._send_group()
        self._make_room(math.inf)

    def close(self, wait_commit: bool = True) -> None:
        """Flush (when ``wait_commit``) and stop the threads; with ``wait_commit=False`` queued writes
        are cancelled, running ones finish and the leading finished rows are still appended.
        """
        try:
            if wait_commit:
                self.flush()
        finally:
            self._group = []  # not flushed (an error upstream): never written, so never in the manifest
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
                if self._old_switch is not None:
                    sys.setswitchinterval(self._old_switch)
                    self._old_switch = None
                if not wait_commit:
                    try:
                        self.commit_ready()
                    except Exception:  # noqa: BLE001 - the upstream error is the one to report
                        pass

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(wait_commit=exc_type is None)
