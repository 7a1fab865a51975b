"""Convert a finished shard set between bf16 (speculators-v1) and fp8 storage (``eagle3-fp8-v1``).

``convert(src, dst, storage)`` reads every shard of ``src`` (a stage-02 folder with
``data_config.json``; nested ``rows_*`` or flat layout), re-encodes its hidden states
(:func:`eagle3.shards.fp8.quantize` for fp8; :func:`eagle3.shards.read.hidden_states_bf16` for bf16) and writes
the same sample ids into ``dst`` in the nested layout, with the same guarantees as stage 02:

- each shard is written atomically (``eagle3.io``); after it lands, ``{dst}/manifest.jsonl`` gets
  ``{idx, id, num_tokens, num_loss_tokens, xxh3_128}`` (fsynced; :mod:`eagle3.shards.checksum`), so stage 03 checks the new files;
- ``{dst}/convert_state.json`` fingerprints the source (its ``data_config.json``) and the target
  storage; a re-run with the same arguments resumes (finished = manifest row + file), a different
  one is refused unless ``overwrite``; ``*.tmp-*`` leftovers are removed at start;
- a source shard whose checksum differs from the source manifest is an error (no silent copy of bit rot);
- ``{dst}/data_config.json`` (the source's, with ``format``/``dtype``/storage keys and
  ``bytes_per_token`` updated and ``converted_from`` added) is written last: present == complete;
- disk full (ENOSPC/EDQUOT) stops with one line (:mod:`eagle3.io`) and a re-run continues.

Stages 03/04 read the result by pointing ``extract.output_dir`` at ``dst``. The source is never
modified; delete it yourself once 03 has validated ``dst``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from eagle3.errors import UserError
from eagle3.io import atomic_write_json, make_dirs, read_json, remove_stale_tmp
from eagle3.io.lock import exclusive_lock
from eagle3.shards.checksum import DEFAULT_ALGO, file_checksum, new_hasher, row_checksum
from eagle3.shards.data_config import (
    expect_from_data_config,
    read_data_config,
    storage_meta,
    write_data_config,
)
from eagle3.shards.format import DATA_CONFIG, list_samples, shard_path
from eagle3.shards.fp8 import Storage
from eagle3.shards.manifest import MANIFEST, ManifestWriter, read_manifest
from eagle3.shards.read import hidden_states_bf16, load_sample
from eagle3.shards.write import write_sample

log = logging.getLogger(__name__)

STATE = "convert_state.json"
LOCK = ".convert.lock"


def _fingerprint(src_meta: dict, storage: Storage) -> tuple[str, dict]:
    comp = {
        "source": {k: src_meta[k] for k in sorted(src_meta) if k != "prompts_file"},
        "storage": storage.to_meta(),
    }
    blob = json.dumps(comp, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), comp


def _stage_files(dst: Path) -> list[Path]:
    if not dst.is_dir():
        return []
    return [
        p
        for p in dst.iterdir()
        if (p.is_dir() and p.name.startswith("rows_"))
        or p.name in (MANIFEST, DATA_CONFIG)
        or (p.name.startswith("data_") and p.suffix == ".pt")
    ]


def _wipe(dst: Path) -> None:
    """Delete this tool's files in ``dst`` (shards, ``rows_*``, manifest, data_config, state); keep others."""
    for p in _stage_files(dst):
        if p.is_dir():
            for f in p.iterdir():
                if f.is_file() and f.name.startswith("data_"):
                    f.unlink()
            with contextlib.suppress(OSError):
                p.rmdir()
        else:
            p.unlink()
    (dst / STATE).unlink(missing_ok=True)


def _exclusive(dst: Path):
    """Exclusive ``flock`` on ``{dst}/{LOCK}`` (:func:`eagle3.io.lock.exclusive_lock`); UserError if held."""
    return exclusive_lock(dst / LOCK, f"another conversion is writing to {dst}")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    storage: Storage,
    *,
    overwrite: bool = False,
    workers: Optional[int] = None,
    limit: Optional[int] = None,
) -> dict:
    """Convert the shard set ``src`` into ``dst`` with hidden states stored as ``storage``.

    Args:
        src: stage-02 output (``data_config.json`` + shards, bf16 or fp8).
        dst: output folder (created); must differ from ``src``.
        storage: target storage (:class:`eagle3.shards.fp8.Storage`); bf16 gives speculators-v1 shards.
        overwrite: delete an earlier conversion in ``dst`` made with other arguments.
        workers: shards converted concurrently (threads; torch ops release the GIL); default
            ``min(8, cpu count)``.
        limit: stop after this many converted shards in this call (tests; the run stays resumable).

    Returns:
        summary: ``samples``, ``converted``, ``resumed``, ``src_bytes``, ``dst_bytes`` (shard files),
        ``ratio`` (dst/src file bytes), ``bytes_per_token`` (hidden states, from the format), seconds.

    Raises:
        UserError: missing/invalid source, ``dst == src``, different earlier conversion in ``dst``,
            a corrupt source shard (validation or checksum), disk full (one line; re-run resumes).
    """
    src, dst = Path(src), Path(dst)
    meta = read_data_config(src)
    if dst.resolve() == src.resolve():
        raise UserError(
            f"{dst}: the destination must differ from the source folder (conversion is not in place)"
        )
    if src.resolve() in dst.resolve().parents:
        raise UserError(
            f"{dst}: the destination is inside the source folder {src} (its shards would be read as "
            "source shards by later stages); choose a folder outside it"
        )
    H = int(meta["hidden_size"])
    try:
        storage.num_blocks(H)
    except ValueError as e:
        raise UserError(f"--block-size: {e}") from e
    make_dirs(dst, "--dst")
    with _exclusive(dst):
        return _convert(src, dst, meta, storage, overwrite, workers, limit)


def _convert(
    src: Path,
    dst: Path,
    meta: dict,
    storage: Storage,
    overwrite: bool,
    workers: Optional[int],
    limit: Optional[int],
) -> dict:
    """:func:`convert` under ``dst``'s lock: claim ``dst``, convert what is pending, finish when complete."""
    t0 = time.perf_counter()
    samples = list_samples(src)
    if not samples:  # before anything in dst is deleted
        raise UserError(f"{src}: no shards found")
    _claim(src, dst, meta, storage, overwrite)
    job = _Job(src, dst, meta, storage)
    man_path = dst / MANIFEST
    done = {
        i: r
        for i, r in read_manifest(man_path).rows.items()
        if shard_path(dst, i, job.rows_per_dir).is_file()
    }
    pending = [(i, p) for i, p in samples if i not in done]
    n_resumed = len(samples) - len(pending)
    if limit is not None:
        pending = pending[:limit]
    n_workers = workers or min(8, os.cpu_count() or 1)
    _run_pool(job, pending, man_path, done, len(samples), n_workers)
    complete = all(i in done for i, _ in samples)
    summary = {
        "src": str(src),
        "dst": str(dst),
        "storage": storage.to_meta(),
        "samples": len(samples),
        "converted": len(pending),
        "resumed": n_resumed,
        "complete": complete,
    }
    if complete:
        summary.update(_finish(job, samples))
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary


def _claim(src: Path, dst: Path, meta: dict, storage: Storage, overwrite: bool) -> None:
    """Make ``dst`` this conversion's: wipe it (``overwrite``) or refuse other contents, record the
    fingerprint in ``{dst}/convert_state.json``, remove ``*.tmp-*`` leftovers."""
    fp, comp = _fingerprint(meta, storage)
    state_path = dst / STATE
    if overwrite:
        _wipe(dst)
    elif _stage_files(dst):
        old = read_json(state_path) if state_path.is_file() else None
        if not isinstance(old, dict) or old.get("fingerprint") != fp:
            raise UserError(
                f"{dst}: holds a different conversion (or other shards) than {src} -> "
                f"{storage.dtype}; re-run with --overwrite to delete them and start over"
            )
    atomic_write_json(state_path, {"fingerprint": fp, "components": comp, "source": str(src)})
    remove_stale_tmp(dst)


class _Job:
    """What converting one shard needs: source manifest rows, the load checks, the target layout."""

    def __init__(self, src: Path, dst: Path, meta: dict, storage: Storage):
        self.src_man_path = src / MANIFEST
        self.src_rows = read_manifest(self.src_man_path).rows if self.src_man_path.is_file() else {}
        self.rows_per_dir = int(meta["rows_per_dir"])
        self.expect = expect_from_data_config(meta)
        self.src, self.dst, self.meta, self.storage = src, dst, meta, storage

    def one(self, item: tuple[int, Path]) -> dict:
        """Convert shard ``item = (idx, path)``; returns its manifest row (checksum of the bytes written)."""
        idx, path = item
        want = row_checksum(self.src_rows.get(idx, {}))  # (algo, hex) or None
        if want is not None and file_checksum(path, want[0]) != want[1]:
            raise UserError(
                f"{path}: contents changed since extraction ({want[0]} differs from {self.src_man_path})"
            )
        s = load_sample(path, expect=self.expect)
        h = new_hasher(DEFAULT_ALGO)  # of the bytes as written (no read-back)
        write_sample(
            self.dst,
            idx,
            self.rows_per_dir,
            s["input_ids"],
            hidden_states_bf16(s),
            s["loss_mask"],
            self.storage,
            hasher=h,
        )
        return {
            "idx": idx,
            "id": self.src_rows.get(idx, {}).get("id", str(idx)),
            "num_tokens": int(s["input_ids"].numel()),
            "num_loss_tokens": int(s["loss_mask"].sum()),
            DEFAULT_ALGO: h.hexdigest(),
        }


def _run_pool(
    job: _Job, pending: list, man_path: Path, done: dict, total: int, n_workers: int
) -> None:
    """Convert ``pending`` on ``n_workers`` threads, appending each finished row to the manifest
    (and to ``done``) in completion order; a worker's error cancels the rest and is re-raised."""
    with (
        ManifestWriter(man_path) as man,
        cf.ThreadPoolExecutor(n_workers) as pool,
        tqdm(
            total=total,
            initial=total - len(pending),
            unit="shard",
            desc="convert",
            mininterval=1.0,
        ) as bar,
    ):
        # A bounded window of futures keeps memory flat on million-shard sets.
        it = iter(pending)
        window = {pool.submit(job.one, x) for x in _take(it, 4 * n_workers)}
        try:
            while window:
                finished, window = cf.wait(window, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    row = f.result()  # re-raises a worker's UserError (disk full, corrupt source)
                    extra = {k: v for k, v in row.items() if k not in ("idx", "id", "num_tokens")}
                    done[row["idx"]] = man.append(row["idx"], row["id"], row["num_tokens"], **extra)
                    bar.update(1)
                window |= {pool.submit(job.one, x) for x in _take(it, len(finished))}
        except BaseException:
            for f in window:
                f.cancel()  # shards already being written finish atomically; the re-run redoes them
            raise


def _finish(job: _Job, samples: list) -> dict:
    """Write ``{dst}/data_config.json`` (last: present == complete); the summary's byte counts."""
    meta, storage = job.meta, job.storage
    new = {
        **meta,
        **storage_meta(storage),
        "bytes_per_token": storage.bytes_per_token(int(meta["hidden_size"])),
    }
    if not storage.is_fp8:
        for k in (
            "storage_dtype",
            "scale_scheme",
            "scale_block_size",
            "scale_dtype",
            "storage_format_version",
        ):
            new.pop(k, None)
    new["converted_from"] = {
        "path": str(job.src),
        "format": meta["format"],
        "dtype": meta["dtype"],
    }
    write_data_config(job.dst, new)
    src_bytes = sum(p.stat().st_size for _, p in samples)
    dst_bytes = sum(shard_path(job.dst, i, job.rows_per_dir).stat().st_size for i, _ in samples)
    return {
        "src_bytes": src_bytes,
        "dst_bytes": dst_bytes,
        "ratio": round(dst_bytes / src_bytes, 4),
        "bytes_per_token": new["bytes_per_token"],
        "src_bytes_per_token": meta["bytes_per_token"],
    }


def _take(it, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out
