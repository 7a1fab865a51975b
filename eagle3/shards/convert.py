"""Convert a finished shard set between bf16 (speculators-v1) and fp8 (``eagle3-fp8-v1``) storage, with stage 02's
guarantees: atomic shards, each followed by its fsynced ``manifest.jsonl`` row (xxh3_128 of the bytes written);
``convert_state.json`` fingerprints source and target storage (a re-run resumes, other arguments are refused unless
``overwrite``); source checksums verified; ``data_config.json`` written last; disk full stops with one line. The
source is never modified.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import logging
import os
import time
from itertools import islice
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from eagle3.errors import UserError
from eagle3.io import atomic_write_json, make_dirs, read_json, remove_stale_tmp
from eagle3.io.lock import exclusive_lock
from eagle3.shards.checksum import DEFAULT_ALGO, new_hasher, row_checksum, verify_file
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


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    storage: Storage,
    *,
    overwrite: bool = False,
    workers: Optional[int] = None,
    limit: Optional[int] = None,
) -> dict:
    """Convert the shard set ``src`` into ``dst`` (nested layout, same sample ids) with states stored as ``storage``.

    Args:
        workers: threads (default ``min(8, cpu count)``); ``limit``: stop after this many shards (resumable).

    Returns:
        summary: ``samples``, ``converted``, ``resumed``, ``complete``, and when complete ``src_bytes``,
        ``dst_bytes``, ``ratio``, ``bytes_per_token``; ``seconds``.

    Raises:
        UserError: bad source, ``dst`` equal to or inside ``src``, another conversion in ``dst``, a corrupt source
        shard, disk full (a re-run resumes), ``dst`` locked.
    """
    src, dst = Path(src), Path(dst)
    meta = read_data_config(src)
    problem = _arguments_problem(src, dst, storage, int(meta["hidden_size"]))
    if problem is not None:
        raise UserError(problem)
    make_dirs(dst, "--dst")
    with exclusive_lock(dst / LOCK, f"another conversion is writing to {dst}"):
        return _convert(src, dst, meta, storage, overwrite, workers, limit)


def _arguments_problem(src: Path, dst: Path, storage: Storage, hidden_size: int) -> Optional[str]:
    """Why :func:`convert` refuses its arguments before anything is written, else None: ``dst`` equal to or inside
    ``src``, or a per_block ``--block-size`` that does not divide the source's hidden size."""
    if src.resolve() in (dst.resolve(), *dst.resolve().parents):
        return (
            f"{dst}: the destination must be outside the source folder {src} (conversion is not in place, "
            "and shards inside it would be read as source shards by later stages); choose another folder"
        )
    try:
        storage.num_blocks(hidden_size)
    except ValueError as e:
        return f"--block-size: {e}"
    return None


def _convert(
    src: Path,
    dst: Path,
    meta: dict,
    storage: Storage,
    overwrite: bool,
    workers: Optional[int],
    limit: Optional[int],
) -> dict:
    """:func:`convert` under ``dst``'s lock."""
    t0 = time.perf_counter()
    samples = list_samples(src, at_least_one=True)  # before anything in dst is deleted
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
    """Make ``dst`` this conversion's: wipe it (``overwrite``) or refuse other contents; record the fingerprint; remove
    ``*.tmp-*`` leftovers.
    """
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
    """Converting one shard: source manifest rows, load checks, target layout."""

    def __init__(self, src: Path, dst: Path, meta: dict, storage: Storage):
        self.src_man_path = src / MANIFEST
        self.src_rows = read_manifest(self.src_man_path).rows if self.src_man_path.is_file() else {}
        self.rows_per_dir = int(meta["rows_per_dir"])
        self.expect = expect_from_data_config(meta)
        self.src, self.dst, self.meta, self.storage = src, dst, meta, storage

    def one(self, item: tuple[int, Path]) -> dict:
        """Convert shard ``(idx, path)``; returns its manifest row."""
        idx, path = item
        src_row = self.src_rows.get(idx, {})
        verify_file(path, row_checksum(src_row), str(self.src_man_path))
        s = load_sample(path, expect=self.expect)
        ids, mask = s["input_ids"], s["loss_mask"]
        h = new_hasher(DEFAULT_ALGO)  # of the bytes as written (no read-back)
        hs = hidden_states_bf16(s)
        write_sample(self.dst, idx, self.rows_per_dir, ids, hs, mask, self.storage, hasher=h)
        return {
            "idx": idx,
            "id": src_row.get("id", str(idx)),
            "num_tokens": int(ids.numel()),
            "num_loss_tokens": int(mask.sum()),
            DEFAULT_ALGO: h.hexdigest(),
        }


def _run_pool(
    job: _Job, pending: list, man_path: Path, done: dict, total: int, n_workers: int
) -> None:
    """Convert ``pending`` on ``n_workers`` threads (a bounded window of futures), appending each row to the manifest and
    ``done`` as it finishes; an error cancels the rest and is re-raised.
    """
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
        it = iter(pending)
        window = {pool.submit(job.one, x) for x in islice(it, 4 * n_workers)}
        try:
            while window:
                finished, window = cf.wait(window, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    row = f.result()  # re-raises a worker's UserError (disk full, corrupt source)
                    done[row["idx"]] = man.append_many([row])[0]
                    bar.update(1)
                window |= {pool.submit(job.one, x) for x in islice(it, len(finished))}
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
        fp8_keys = ("scale_scheme", "scale_block_size", "scale_dtype", "storage_format_version")
        for k in ("storage_dtype", *fp8_keys):
            new.pop(k, None)
    new["converted_from"] = {"path": str(job.src), "format": meta["format"], "dtype": meta["dtype"]}
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
