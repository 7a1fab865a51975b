"""Stage 03's shard validation: hash every shard against 02's manifest, load it, count the loss-token frequencies
and check the totals; a validation record of an earlier pass is reused when the shard set is unchanged
(:mod:`eagle3.data.validation_record`)."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from eagle3.capture.tokenize_pool import available_cpus, map_records
from eagle3.data.validation_record import (
    format_time,
    load_matching_record,
    shard_set_fingerprint,
    write_failed_record,
    write_record,
    write_unfinished_record,
)
from eagle3.data.vocab import count_token_freq
from eagle3.errors import UserError
from eagle3.shards import checksum as shard_checksum  # looked up at call time (tests spy)
from eagle3.shards import format as shard_format  # TOKEN_PROCESS_MIN: tests lower it
from eagle3.shards.checksum import row_checksum
from eagle3.shards.data_config import expect_from_data_config
from eagle3.shards.format import DATA_CONFIG, list_samples
from eagle3.shards.manifest import MANIFEST, read_manifest
from eagle3.shards.read import load_sample

log = logging.getLogger(__name__)


def _validate_one(idx: int, path: Path, expect: dict, want: Optional[tuple[str, str]]) -> dict:
    """Hash one shard against ``want`` = ``(algo, hex)`` of 02's manifest, load it and return ``input_ids`` and
    ``loss_mask`` only (the states are dropped once validated). UserError on a changed or invalid shard.
    """
    shard_checksum.verify_file(path, want, MANIFEST)
    s = load_sample(path, expect=expect)
    return {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"]}


PROCESS_WINDOW = 16384  # shards per map_records call (bounds the results held at once)


def _validate_tokens(_tok, item: tuple) -> tuple:
    """Worker side of :func:`_token_samples_mp`: :func:`_validate_one` as numpy arrays."""
    s = _validate_one(*item)
    return s["input_ids"].numpy(), s["loss_mask"].numpy()


def _token_samples_mp(
    paths: list[tuple[int, Path]], expect: dict, checksums: dict[int, tuple[str, str]], workers: int
):
    """Hash + load token-only samples in ``workers`` processes (their cost is the GIL-bound unpickler), yielded in order
    as ``{input_ids, loss_mask}``; the first bad shard in order is raised.
    """
    for a in range(0, len(paths), PROCESS_WINDOW):
        items = [(i, p, expect, checksums.get(i)) for i, p in paths[a : a + PROCESS_WINDOW]]
        for ids, mask in map_records(
            _validate_tokens,
            None,
            items,
            workers=workers,
            chunk_size=256,
            desc=f"validate shards {a}-{a + len(items)}/{len(paths)}",
            unit="shard",
        ):
            yield {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask)}


def _validated_samples(
    paths: list[tuple[int, Path]],
    expect: dict,
    stats: dict,
    checksums: dict[int, tuple[str, str]],
    workers: Optional[int] = None,
):
    """Every shard validated, in order, counting ``stats`` (``num_samples``, ``num_tokens``, ``num_loss_tokens``,
    ``max_len``); a checksum unlike 02's is an error. Token-only sets of at least
    :data:`eagle3.shards.format.TOKEN_PROCESS_MIN` samples use processes, others ``workers`` threads.
    """
    if (
        expect.get("tokens_only")
        and available_cpus() > 1
        and len(paths) >= shard_format.TOKEN_PROCESS_MIN
    ):
        samples = _token_samples_mp(paths, expect, checksums, workers or available_cpus())
    else:
        # threads: min(8, usable cores) (hashing and reads release the GIL)
        samples = _samples_threaded(paths, expect, checksums, workers or min(8, available_cpus()))
    for s in samples:
        stats["num_samples"] += 1
        stats["num_tokens"] += int(s["input_ids"].numel())
        stats["num_loss_tokens"] += int(s["loss_mask"].sum())
        stats["max_len"] = max(stats["max_len"], int(s["input_ids"].numel()))
        yield s


def _samples_threaded(
    paths: list[tuple[int, Path]], expect: dict, checksums: dict[int, tuple[str, str]], workers: int
):
    """:func:`_validate_one` of every shard on ``workers`` threads, yielded in order."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="validate") as pool:
        pending: deque = deque()
        it = iter(paths)
        bar = tqdm(total=len(paths), desc="validate shards", unit="shard", mininterval=1.0)
        try:
            while True:
                while len(pending) < 4 * workers:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    idx, path = nxt
                    pending.append(
                        pool.submit(_validate_one, idx, path, expect, checksums.get(idx))
                    )
                if not pending:
                    break
                s = pending.popleft().result()  # in order: the first bad shard is reported
                bar.update(1)
                yield s
        finally:
            bar.close()
            for f in pending:
                f.cancel()


def validate_all(
    shards: Path, meta: dict, paths: list[tuple[int, Path]]
) -> tuple[dict, torch.Tensor]:
    """Hash + load every shard, count loss-token frequencies, check the totals against ``data_config.json``.

    Returns:
        ``(stats, freq int64 [V])``.

    Raises:
        UserError: an invalid or changed shard, totals unlike ``data_config.json``, no loss-masked token.
    """
    V = int(meta["vocab_size"])
    stats = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 0}
    man_path = shards / MANIFEST
    rows = read_manifest(man_path).rows if man_path.is_file() else {}  # flat folders: none
    checksums = {i: c for i, r in rows.items() if (c := row_checksum(r)) is not None}
    freq = count_token_freq(
        _validated_samples(paths, expect_from_data_config(meta), stats, checksums), V
    )  # [V]
    _check_totals(shards, meta, stats)
    return stats, freq


def _check_totals(shards: Path, meta: dict, stats: dict) -> None:
    """Refuse a shard set by its totals (``stats``, from the shards or their validation record).

    Raises:
        UserError: the first of ``num_samples``, ``num_tokens``, ``num_loss_tokens`` unlike ``data_config.json``'s
            (with the shards added or missing, :func:`_sample_set_change`), else no loss-masked token at all.
    """
    key = next(
        (k for k in ("num_samples", "num_tokens", "num_loss_tokens") if stats[k] != meta[k]), None
    )
    if key is not None:
        why = (
            f"{shards / DATA_CONFIG}: key '{key}' is {meta[key]} but the shards hold {stats[key]} "
            + (_sample_set_change(shards) or "(shards added or removed after stage 02?)")
        )
    elif stats["num_loss_tokens"] == 0:
        why = f"{shards}: no loss-masked token in any shard (no assistant replies?)"
    else:
        return
    raise UserError(why)


def _sample_set_change(shards: Path) -> Optional[str]:
    """The shards added or missing against ``manifest.jsonl`` and the fix, for :func:`_check_totals` (None: none)."""
    man_path = shards / MANIFEST
    if not man_path.is_file():
        return None
    rows, have = read_manifest(man_path).rows, dict(list_samples(shards))

    def some(ids: list[int]) -> str:
        return ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")

    missing, extra = sorted(set(rows) - set(have)), sorted(set(have) - set(rows))
    if missing:
        return (
            f"({len(missing)} of the {len(rows)} shards in {MANIFEST} are missing: sample {some(missing)}); re-run "
            f"02_extract_hidden.py with the same command (without --overwrite) to recapture them, then 03"
        )
    if extra:
        return (
            f"({len(extra)} shard files not in {MANIFEST}: sample {some(extra)}, e.g. {have[extra[0]]}); remove "
            f"them, or re-run 02_extract_hidden.py --overwrite"
        )
    return None


def shard_stats(
    shards: Path, data_dir: Path, meta: dict, paths: list[tuple[int, Path]], revalidate: bool
) -> tuple[dict, torch.Tensor, str, str]:
    """Stats and loss-token counts of the shard set: from a validation record with the same fingerprint
    (:mod:`eagle3.data.validation_record`), else from :func:`validate_all`, then recorded (a failed pass records its
    error, so stage 04 refuses the set).

    Returns:
        ``(stats, freq int64 [V], "full" | "reused", fingerprint)``.

    Raises:
        UserError: as :func:`validate_all`; no folder accepts the record.
    """
    folders = [shards, data_dir]
    # fingerprint BEFORE reading any shard: a shard changed during the pass makes the record stale
    fp = shard_set_fingerprint(shards, paths, shards / MANIFEST, shards / DATA_CONFIG)
    if not revalidate:
        hit = load_matching_record(folders, fp, int(meta["vocab_size"]))
        if hit is not None:
            stats, freq, created, path = hit
            _check_totals(shards, meta, stats)
            log.info(
                "reusing the shard validation of %s (%s; shards, manifest.jsonl and data_config.json unchanged "
                "since); --revalidate forces a full pass",
                format_time(created),
                path,
            )
            return stats, freq, "reused", fp
    if revalidate:  # a forced pass stopped half-way must not leave a passing record in force
        write_unfinished_record(folders, fp)
    try:
        stats, freq = validate_all(shards, meta, paths)
    except UserError as e:  # no record may keep saying the set is valid (stage 04 reads it)
        write_failed_record(folders, fp, str(e))
        raise
    where = write_record(folders, fp, stats, freq)
    log.info(
        "validation record written to %s (a re-run on unchanged shards skips the hashing)", where
    )
    return stats, freq, "full", fp
