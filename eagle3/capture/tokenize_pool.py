"""Run a per-conversation tokenization function over worker processes, results in input order.

:func:`map_records` returns what ``[fn(tokenizer, r) for r in records]`` returns, computed by a
``ProcessPoolExecutor`` whose workers get the tokenizer once at start-up (inherited under
``fork``). Chunks come back in submission order, so the first failing record raises first.
Workers never touch torch or CUDA.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Optional, Sequence

from tqdm import tqdm

log = logging.getLogger(__name__)

#: Below this many records per worker the pool start-up (fork + first template compile in every
#: worker, ~0.1-0.5 s) costs more than it saves: run in-process.
MIN_RECORDS_PER_WORKER = 32

_WORKER_STATE: dict[str, Any] = {}


def available_cpus() -> int:
    """CPU cores this process may run on (``sched_getaffinity``; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_workers() -> int:
    """Worker processes for ``tokenize_workers: null``: the usable cores divided among the local
    torchrun ranks (``LOCAL_WORLD_SIZE``), at least 1, at most 64."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        local = 1
    return max(1, min(64, available_cpus() // local))


def resolve_workers(workers: Optional[int], num_records: int) -> int:
    """The worker count actually used (1 = in-process): an explicit ``workers`` capped at
    ``num_records``; ``None`` = :func:`default_workers` capped so that each worker gets at least
    :data:`MIN_RECORDS_PER_WORKER` records."""
    if workers is not None:
        return max(1, min(int(workers), num_records))
    return max(1, min(default_workers(), num_records // MIN_RECORDS_PER_WORKER))


def _init_worker(fn: Callable, tokenizer: Any) -> None:
    # A forked child must not use the Rust tokenizer's thread pool inherited from the parent; the
    # per-conversation calls are single encodes anyway.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_STATE.update(fn=fn, tokenizer=tokenizer)


def _run_chunk(records: Sequence[Any]) -> list:
    fn, tok = _WORKER_STATE["fn"], _WORKER_STATE["tokenizer"]
    return [fn(tok, r) for r in records]


def process_context():
    """The start method of this project's worker pools: ``fork`` where there is one (the parent's imports and
    tokenizer are inherited), else ``spawn``."""
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def map_records(
    fn: Callable[[Any, Any], Any],
    tokenizer: Any,
    records: Sequence[Any],
    *,
    workers: Optional[int] = None,
    chunk_size: Optional[int] = None,
    desc: str = "tokenize",
    unit: str = "conv",
) -> list:
    """``[fn(tokenizer, r) for r in records]``, computed by ``workers`` processes.

    Args:
        fn: a module-level function (or partial) of ``(tokenizer, record)``, picklable results.
        tokenizer: passed to every call. records: picklable items.
        workers: processes (None: :func:`default_workers`; 1: in-process loop).
        chunk_size: records per task (default ~8 tasks per worker, <= 256). desc, unit: tqdm labels.

    Returns:
        the results, in record order.

    Raises:
        whatever the first failing call (in record order) raised.
    """
    n = len(records)
    w = resolve_workers(workers, n)
    with tqdm(total=n, desc=desc, unit=unit, mininterval=2.0) as bar:
        if w == 1:
            out = []
            for r in records:
                out.append(fn(tokenizer, r))
                bar.update(1)
            return out
        cs = chunk_size or max(1, min(256, -(-n // (w * 8))))
        chunks = [records[i : i + cs] for i in range(0, n, cs)]
        log.info(
            "%s: %d records in %d worker processes (%d chunks of <= %d)",
            desc,
            n,
            w,
            len(chunks),
            cs,
        )
        return _pool_map(fn, tokenizer, chunks, w, bar)


def _pool_map(fn: Callable, tokenizer: Any, chunks: list, workers: int, bar: tqdm) -> list:
    """``fn(tokenizer, r)`` of every record of ``chunks`` (in order) over ``workers`` processes, one task a chunk;
    ``bar`` advances per finished chunk. The first failure (in chunk order) cancels the pending tasks and is raised.
    """
    out: list = []
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=process_context(),
        initializer=_init_worker,
        initargs=(fn, tokenizer),
    ) as pool:
        futures = [pool.submit(_run_chunk, c) for c in chunks]
        try:
            for fut, c in zip(futures, chunks):
                out += fut.result()
                bar.update(len(c))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return out
