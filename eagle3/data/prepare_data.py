"""Stage 03: validate the shards, count token frequencies, build the draft vocab, split train/val.

Inputs: ``{shards_dir}`` (stage 02: shards + ``data_config.json``). Outputs in ``{data_dir}``
(written as one set, :func:`_write_outputs`: a failure replaces none of them; the stage is deterministic, so
re-running it rewrites identical files):

- ``token_freq.pt``: int64 ``[target_V]`` counts of target ids at loss-masked positions;
- ``vocab_map.pt``: ``d2t`` int64 ``[draft_V]``, ``t2d`` bool ``[target_V]``, sizes (``eagle3.data.vocab``);
- ``split.json``: ``{"train": [idx...], "val": [idx...]}`` (seeded permutation, both sorted);
- ``data_report.json`` + ``data_report.md`` (+ ``coverage.png``: coverage of loss-masked tokens
  by the top-k target ids as a function of k, the chosen draft size marked).

Validation (hash + load of every shard) is skipped when a validation record of an earlier 03 matches
the shard set exactly (``eagle3.data.validation_record``; written to ``{shards_dir}`` when writable, else
``{data_dir}``); the outputs are then computed from the recorded stats and counts, identically.
``data_report.json`` says which: ``"validation": "full" | "reused"``.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from eagle3.config import RunConfig
from eagle3.data.settings import REPORT_JSON, data_settings
from eagle3.data.validation_record import (
    format_time,
    load_matching_record,
    shard_set_fingerprint,
    write_failed_record,
    write_record,
    write_unfinished_record,
)
from eagle3.data.vocab import (
    TOKEN_FREQ,
    VOCAB_MAP,
    build_vocab_map,
    count_token_freq,
    coverage,
    vocab_map_record,
)
from eagle3.errors import UserError
from eagle3.io import atomic_write_files, make_dirs, probe_dirs
from eagle3.io.lock import lock_held
from eagle3.shards.checksum import row_checksum
from eagle3.shards.format import (
    DATA_CONFIG,
    EXTRACT_LOCK,
    check_extract_settings,
    check_verifier,
    expect_from_data_config,
    list_samples,
    load_sample,
    read_data_config,
)
from eagle3.shards.manifest import MANIFEST, read_manifest

log = logging.getLogger(__name__)

SPLIT = "split.json"
REPORT_MD = "data_report.md"
PLOT = "coverage.png"


def split_indices(indices: list[int], val_fraction: float, seed: int) -> dict[str, list[int]]:
    """Seeded train/val split of sample ids.

    ``n_val = round(val_fraction * n)``, at least 1 when ``val_fraction > 0`` and ``n >= 2``, and
    never all samples. The permutation is ``random.Random(seed).shuffle`` of the ids sorted
    ascending, so the split depends only on the id set, the fraction and the seed.

    Returns:
        ``{"train": sorted ids, "val": sorted ids}``.
    """
    ids = sorted(int(i) for i in indices)
    n = len(ids)
    n_val = round(val_fraction * n)
    if val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    n_val = min(n_val, max(n - 1, 0))
    perm = list(ids)
    random.Random(seed).shuffle(perm)
    return {"train": sorted(perm[n_val:]), "val": sorted(perm[:n_val])}


def subset_train(train: list[int], n: Optional[int], seed: int) -> list[int]:
    """``data.train_samples``: a seeded subset of ``n`` training ids (sorted), or all when ``n`` is None or
    not smaller. Subsets of one seed are nested (the first ``n`` of one seeded permutation), so the
    points of a data-scaling curve add data rather than swap it. ``n`` above ``len(train)`` is warned (all are used)."""
    if n is not None and n > len(train):
        log.warning(
            "data.train_samples: %d asked, the training split holds %d (after the validation split and "
            "data.exclude_id_prefixes): all of them are used",
            n,
            len(train),
        )
    if n is None or n >= len(train):
        return list(train)
    perm = sorted(train)
    random.Random(seed + 1).shuffle(perm)
    return sorted(perm[:n])


def exclude_by_id(
    train: list[int], shards: Path, prefixes: list[str]
) -> tuple[list[int], dict[str, int]]:
    """``data.exclude_id_prefixes``: drop the training samples whose id starts with one of ``prefixes``.

    Args:
        train: sample indices of the training split.
        shards: 02's output folder; the ids come from its ``manifest.jsonl`` (``{"idx", "id", ...}``: 01's
            conversation id plus 02's turn suffix).
        prefixes: id prefixes (an empty list keeps every sample).

    Returns:
        ``(kept indices in their order, {prefix: samples dropped})``.

    Raises:
        UserError: the manifest is missing or lacks a training sample's row, or every training sample is dropped.
    """
    if not prefixes:
        return list(train), {}
    from eagle3.shards.manifest import MANIFEST, read_manifest

    path = shards / MANIFEST
    if not path.is_file():
        raise UserError(
            f"data.exclude_id_prefixes: {path} is missing (02 writes it); re-run 02_extract_hidden.py"
        )
    rows = read_manifest(path).rows
    kept, dropped = [], {p: 0 for p in prefixes}
    for i in train:
        if i not in rows:
            raise UserError(
                f"{path}: no row for sample {i} (data.exclude_id_prefixes needs every sample's id); "
                "re-run 02_extract_hidden.py to complete it"
            )
        hit = next((p for p in prefixes if rows[i]["id"].startswith(p)), None)
        if hit is None:
            kept.append(i)
        else:
            dropped[hit] += 1
    if not kept:
        raise UserError(
            f"data.exclude_id_prefixes: {prefixes} drops all {len(train)} training samples of {shards}"
        )
    unmatched = [
        p for p, n in dropped.items() if n == 0
    ]  # a typo (case, a missing '/') would otherwise be silent
    stems = (
        sorted({rows[i]["id"].split("/")[0] + "/" for i in train if "/" in rows[i]["id"]})
        if unmatched
        else []
    )
    for p in unmatched:
        log.warning(
            "data.exclude_id_prefixes: %r matches no training sample (ids are case-sensitive; their "
            "prefixes here: %s)",
            p,
            ", ".join(stems[:12]) + (", ..." if len(stems) > 12 else "") or "none",
        )
    return kept, dropped


def _validate_one(idx: int, path: Path, expect: dict, want: Optional[tuple[str, str]]) -> dict:
    """Hash (against 02's manifest: ``want`` = ``(algo, hex)``, :mod:`eagle3.shards.checksum`) and load one
    shard; returns only ``input_ids`` and ``loss_mask`` (the hidden states are validated, then
    dropped, so memory stays one shard per worker)."""
    from eagle3.shards.checksum import file_checksum

    if want is not None and file_checksum(path, want[0]) != want[1]:
        raise UserError(
            f"{path}: contents changed since extraction ({want[0]} differs from manifest.jsonl); "
            "delete the file and re-run 02_extract_hidden.py to recapture it"
        )
    s = load_sample(path, expect=expect)
    return {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"]}


def validate_workers() -> int:
    """Threads that hash and load shards in 03: min(8, usable cores). The hashers and file reads release
    the GIL, so threads scale (one thread hashed sha256 at ~0.6 GB/s on the H200 machine: 54 s for
    32 GB; xxh3_128, what 02 records now, hashes ~20x faster, so loading dominates)."""
    from eagle3.capture.tokenize_pool import available_cpus

    return min(8, available_cpus())


#: shards per :func:`eagle3.capture.tokenize_pool.map_records` call there (bounds the results held at once)
PROCESS_WINDOW = 16384


def _validate_tokens(_tok, item: tuple) -> tuple:
    """Worker side of :func:`_token_samples_mp`: :func:`_validate_one` of ``item = (idx, path, expect, want)``,
    returned as numpy arrays (pickled by value: no shared-memory handle per tensor)."""
    s = _validate_one(*item)
    return s["input_ids"].numpy(), s["loss_mask"].numpy()


def _token_samples_mp(
    paths: list[tuple[int, Path]], expect: dict, checksums: dict[int, tuple[str, str]], workers: int
):
    """Hash + load token-only samples in ``workers`` processes, yielded in order as ``{input_ids, loss_mask}``
    (int64 ``[L]`` each). A token-only sample is ~16 bytes/token, so per shard the cost is the
    ``torch.load`` unpickler, which holds the GIL: threads gave ~630 shards/s on the 16-core H200 machine
    (26K samples in 41 s, lease 2026-12-02b), one process ~1,400/s on this repo's CPU. The first bad shard
    in order is the one raised (``map_records`` raises the first failure in record order)."""
    from eagle3.capture.tokenize_pool import map_records

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
    """Load and validate every shard, in order, counting ``stats`` (``num_samples``, ``num_tokens``,
    ``num_loss_tokens``, ``max_len``); a shard whose checksum differs from the one 02 recorded in
    ``manifest.jsonl`` (bit rot, a partial copy, an edit) is an error even when it still unpickles.
    ``workers`` threads hash and load ahead (at most ``4 x workers`` shards in flight); token-only sets of
    at least :data:`eagle3.shards.format.TOKEN_PROCESS_MIN` samples go to worker processes instead (one per usable core,
    :func:`_token_samples_mp`)."""
    from eagle3.capture.tokenize_pool import available_cpus
    from eagle3.shards import format as shard_format

    if (
        expect.get("tokens_only")
        and available_cpus() > 1
        and len(paths) >= shard_format.TOKEN_PROCESS_MIN
    ):
        samples = _token_samples_mp(paths, expect, checksums, workers or available_cpus())
    else:
        samples = _samples_threaded(paths, expect, checksums, workers or validate_workers())
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
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

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
                s = (
                    pending.popleft().result()
                )  # in order: the first bad shard in order is the one reported
                bar.update(1)
                yield s
        finally:
            bar.close()
            for f in pending:
                f.cancel()


def _coverage_png(freq: torch.Tensor, draft_v: int, cov: float) -> bytes:
    """``coverage.png``: the coverage of loss-masked tokens by the top-k target ids against k, ``draft_v`` marked."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sorted_freq = torch.sort(freq, descending=True).values.double()  # [V]
    curve = torch.cumsum(sorted_freq, 0) / sorted_freq.sum()  # [V]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(curve) + 1), curve.numpy())
    ax.axvline(draft_v, color="r", ls="--", label=f"draft vocab {draft_v}: {cov:.2%}")
    ax.set_xscale("log")
    ax.set_xlabel("draft vocab size (most frequent target ids)")
    ax.set_ylabel("coverage of loss-masked tokens")
    ax.legend(loc="lower right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def _torch_bytes(obj) -> bytes:
    """``torch.save(obj)``'s bytes (what :func:`eagle3.io.atomic_torch_save` writes)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_outputs(
    out: Path,
    freq: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    split: dict,
    report: dict,
    cov: float,
    plot: bool,
) -> None:
    """03's outputs in ``out`` as one set (:func:`eagle3.io.atomic_write_files`): written one by one, a full disk at
    the report or the plot left the new vocab map and split beside the earlier run's report (whose ``settings`` 04
    checks) or plot; now a failure replaces none of them. Without ``plot`` an earlier ``coverage.png`` is removed."""
    files = [
        (out / TOKEN_FREQ, _torch_bytes(freq)),
        (out / VOCAB_MAP, _torch_bytes(vocab_map_record(d2t, t2d, str(out / VOCAB_MAP)))),
        (out / SPLIT, (json.dumps(split, indent=2, ensure_ascii=False) + "\n").encode("utf-8")),
        (
            out / REPORT_JSON,
            (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
        ),
        (out / REPORT_MD, _markdown(report).encode("utf-8")),
    ]
    if plot:
        files.append((out / PLOT, _coverage_png(freq, int(d2t.numel()), cov)))
    atomic_write_files(files, remove=() if plot else (out / PLOT,))


def _validate_all(
    shards: Path, meta: dict, paths: list[tuple[int, Path]]
) -> tuple[dict, torch.Tensor]:
    """Full validation: hash + load every shard, count loss-token frequencies, check the totals.

    Returns:
        ``(stats, freq)``: stats ``num_samples``, ``num_tokens``, ``num_loss_tokens``, ``max_len``
        (tokens); freq int64 ``[V]``.

    Raises:
        UserError: an invalid shard, a checksum differing from ``manifest.jsonl``, totals differing from
            ``data_config.json``, no loss-masked token.
    """
    V = int(meta["vocab_size"])
    stats = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 0}
    man_path = shards / MANIFEST
    rows = (
        read_manifest(man_path).rows if man_path.is_file() else {}
    )  # flat vLLM-speculators folders: none
    checksums = {i: c for i, r in rows.items() if (c := row_checksum(r)) is not None}
    freq = count_token_freq(
        _validated_samples(paths, expect_from_data_config(meta), stats, checksums), V
    )  # [V]
    _check_totals(shards, meta, stats)
    return stats, freq


def _check_totals(shards: Path, meta: dict, stats: dict) -> None:
    meta_path = shards / DATA_CONFIG
    for key in ("num_samples", "num_tokens", "num_loss_tokens"):
        if stats[key] != meta[key]:
            raise UserError(
                f"{meta_path}: key '{key}' is {meta[key]} but the shards hold {stats[key]} "
                + (_sample_set_change(shards) or "(shards added or removed after stage 02?)")
            )
    if stats["num_loss_tokens"] == 0:
        raise UserError(f"{shards}: no loss-masked token in any shard (no assistant replies?)")


def _sample_set_change(shards: Path) -> Optional[str]:
    """Which shards differ from ``manifest.jsonl`` and what to do, for :func:`_check_totals`'s error (None when the
    files are the manifest's samples, or there is no manifest). A deleted shard said only `(shards added or removed
    after stage 02?)` (fresh-user trial 2026-12-05d); 02 with the same command recaptures a missing one."""
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


def _shard_stats(
    cfg: RunConfig, meta: dict, paths: list[tuple[int, Path]], revalidate: bool
) -> tuple[dict, torch.Tensor, str, str]:
    """Stats and loss-token counts of the shard set: reused from a validation record whose fingerprint
    matches (``eagle3.data.validation_record``), else from a full validation, after which the record is
    written (shards folder if writable, else the data folder): a passing one, or, when the pass raises, a
    failed one holding the error (replacing an earlier passing record of the same fingerprint; stage 04 then
    refuses the set).

    Raises:
        UserError: as :func:`_validate_all`; no folder accepts the passing record.

    Returns:
        ``(stats, freq int64 [V], "full" | "reused", the shard set's fingerprint)``.
    """
    shards = cfg.shards_dir
    folders = [shards, cfg.data_dir]
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
    if (
        revalidate
    ):  # a forced pass stopped half-way must not leave the earlier passing record in force
        write_unfinished_record(folders, fp)
    try:
        stats, freq = _validate_all(shards, meta, paths)
    except (
        UserError
    ) as e:  # the set is not valid: no record may keep saying it is (stage 04 reads it)
        write_failed_record(folders, fp, str(e))
        raise
    where = write_record(folders, fp, stats, freq)
    log.info(
        "validation record written to %s (a re-run on unchanged shards skips the hashing)", where
    )
    return stats, freq, "full", fp


DATA_LOCK = ".data.lock"  # in data_dir while a 03 writes there (one 03 per data folder)
#: 03's disk-full advice (:func:`eagle3.io.rerun_hint`): a stopped 03 keeps nothing to resume from.
REDO_HINT = "re-run the same command (03 does not resume: it starts over)"


def run(cfg: RunConfig, *, plot: bool = True, revalidate: bool = False) -> dict:
    """Stage 03 holding ``{data_dir}/.data.lock`` (:func:`eagle3.io.output_folder_lock`): a second 03 on the same data
    folder (a draft-vocab sweep started side by side) stops at once with one line instead of writing its vocab map,
    split and report over the first one's (trial 2026-12-05g). See :func:`prepare`."""
    from eagle3.io import output_folder_lock, rerun_hint

    holder = (
        f"another 03_prepare_data run is writing to {cfg.data_dir}; wait for it, or set data.output_dir for a "
        f"second data folder"
    )
    with (
        rerun_hint(REDO_HINT),
        output_folder_lock(cfg.data_dir, DATA_LOCK, holder, cfg.output_field("data")),
    ):
        return prepare(cfg, plot=plot, revalidate=revalidate)


def check_not_being_extracted(shards: Path) -> None:
    """Stop 03 while 02 is still writing ``shards`` (it holds ``{shards}/.extract.lock``, :data:`EXTRACT_LOCK`): 03
    validated the half-written set and recorded a failed validation of it (trial 2026-12-05g). A lock file left by a
    02 that died is not held (:func:`eagle3.io.lock.lock_held`: the OS released its ``flock``) and does not stop 03.

    Raises:
        UserError: ``<shards>/.extract.lock: 02_extract_hidden is still writing the shards in <shards> ...``.
    """
    lock = Path(shards) / EXTRACT_LOCK
    if lock_held(lock):
        raise UserError(
            f"{lock}: 02_extract_hidden is still writing the shards in {shards} (it holds this lock); "
            f"wait for it to end, then run 03_prepare_data.py (a half-written shard set would fail "
            f"validation)"
        )


def check_shards_unchanged(shards: Path, fingerprint: str, out: Path) -> None:
    """Before 03 writes its outputs: the shard set is still the one it read (``fingerprint``, taken before the
    validation pass: :func:`eagle3.data.validation_record.fingerprint_now`) and no 02 holds its lock now. 03 checked
    02's lock only at its start, so a 02 started on the same shards folder during 03's pass (minutes on a large set)
    was not noticed and 03 published a vocab map and split of a set 02 was changing.

    Raises:
        UserError: one line, ``<shards>/.extract.lock: 02_extract_hidden is still writing ...`` (a 02 runs now), or
            ``<shards>: the shard set changed while 03_prepare_data read it ...`` (a 02 ran, or shards were added,
            removed or rewritten); nothing is written to ``out``.
    """
    from eagle3.data.validation_record import fingerprint_now

    check_not_being_extracted(shards)
    if fingerprint_now(shards) != fingerprint:
        raise UserError(
            f"{shards}: the shard set changed while 03_prepare_data read it (shards, {MANIFEST} or "
            f"{DATA_CONFIG} written since it started: a 02_extract_hidden run there?); nothing written to "
            f"{out}; run 03_prepare_data.py again once 02 has finished"
        )


def prepare(cfg: RunConfig, *, plot: bool = True, revalidate: bool = False) -> dict:
    """Run stage 03 (:func:`run` holds the data folder's lock around it).

    Args:
        revalidate: hash and load every shard even when a validation record matches the shard set
            (``03_prepare_data.py --revalidate``; see ``eagle3.data.validation_record``).

    Raises:
        UserError: missing/invalid ``data_config.json``; ``extract.aux_layers``/``max_length`` differ from
            it (``check_extract_settings``); verifier id differs from the config's ``verifier.display_name()``;
            ``data.draft_vocab_size`` > target vocab; any invalid shard (file + key); shard count/tokens differ
            from ``data_config.json``; no loss-masked token; fewer than 1 training sample; a 02 writing the shards
            at the start or before the outputs are written, or a shard set changed meanwhile
            (:func:`check_shards_unchanged`: nothing written).

    Returns:
        the report dict (also ``data_report.json``).
    """
    shards = cfg.shards_dir
    check_not_being_extracted(shards)
    meta, meta_path = read_data_config(shards), shards / DATA_CONFIG
    unchecked = check_verifier(
        cfg.verifier, meta, shards
    )  # first: another verifier explains any other difference
    if unchecked:  # weights not comparable (shards without a fingerprint): said
        log.warning("%s", unchecked)
    check_extract_settings(cfg.extract, meta, shards)
    V = int(meta["vocab_size"])
    draft = cfg.data.draft_vocab_size
    if draft > V:
        raise UserError(
            f"data.draft_vocab_size: {draft} is larger than the verifier's vocab ({V} tokens, {meta_path}); "
            f"use at most {V}"
        )
    paths = list_samples(shards)
    if not paths:
        raise UserError(f"{shards}: no shards found")
    probe_dirs(
        cfg.data_dir, cfg.output_field("data")
    )  # before the validation pass (minutes), not after it
    stats, freq, how, fp = _shard_stats(cfg, meta, paths, revalidate)  # freq: [V]
    d2t, t2d = build_vocab_map(freq, draft)
    cov = coverage(freq, t2d)
    split = split_indices([i for i, _ in paths], cfg.data.val_fraction, cfg.data.seed)
    if not split["train"]:
        raise UserError(
            f"{shards}: not enough samples for a training split ({stats['num_samples']})"
        )
    train_all = len(split["train"])
    split["train"], excluded = exclude_by_id(split["train"], shards, cfg.data.exclude_id_prefixes)
    split["train"] = subset_train(split["train"], cfg.data.train_samples, cfg.data.seed)

    check_shards_unchanged(shards, fp, cfg.data_dir)  # a 02 started meanwhile: publish nothing
    out = cfg.data_dir
    make_dirs(out, cfg.output_field("data"))
    report = {
        "shards_dir": str(shards),
        "verifier": meta["verifier"],
        "target_vocab_size": V,
        "draft_vocab_size": int(d2t.numel()),
        "identity_vocab_map": bool(d2t.numel() == V),
        "coverage": round(cov, 6),
        "distinct_loss_tokens": int((freq > 0).sum()),
        "num_samples": stats["num_samples"],
        "num_tokens": stats["num_tokens"],
        "num_loss_tokens": stats["num_loss_tokens"],
        "loss_token_fraction": round(stats["num_loss_tokens"] / stats["num_tokens"], 6),
        "max_sample_len": stats["max_len"],
        "mean_sample_len": round(stats["num_tokens"] / stats["num_samples"], 2),
        "train_samples": len(split["train"]),
        "train_samples_available": train_all,
        "excluded_by_id_prefix": excluded,
        "val_samples": len(split["val"]),
        "val_fraction": cfg.data.val_fraction,
        "seed": cfg.data.seed,
        "aux_layers": meta["aux_layers"],
        "last_hidden_state": meta["last_hidden_state"],
        "skipped_in_02": meta["skipped"],
        "bytes_per_token": meta["bytes_per_token"],
        "storage_dtype": meta.get(
            "storage_dtype", "bfloat16"
        ),  # fp8 shards were validated with their scales
        "validation": how,  # "full": every shard hashed + loaded now; "reused": a matching validation record
        "settings": data_settings(
            cfg
        ),  # the data: fields these outputs were made under (04 checks them)
        "shards_fingerprint": fp,  # the shard set they were made from (04 checks it: eagle3.data.settings)
    }
    _write_outputs(out, freq, d2t, t2d, split, report, cov, plot)
    log.info(
        "draft vocab %d/%d covers %.2f%% of %d loss tokens; %d train / %d val",
        d2t.numel(),
        V,
        100 * cov,
        stats["num_loss_tokens"],
        len(split["train"]),
        len(split["val"]),
    )
    return report


def _markdown(r: dict) -> str:
    rows = [
        ("verifier", r["verifier"]),
        (
            "samples (train / val)",
            f"{r['num_samples']} ({r['train_samples']} / {r['val_samples']})",
        ),
        ("tokens", r["num_tokens"]),
        ("loss-masked tokens", r["num_loss_tokens"]),
        ("target vocab", r["target_vocab_size"]),
        ("draft vocab", r["draft_vocab_size"]),
        ("coverage of loss tokens by draft vocab", f"{r['coverage']:.4%}"),
        ("distinct loss-token ids", r["distinct_loss_tokens"]),
        ("mean / max sample length", f"{r['mean_sample_len']} / {r['max_sample_len']}"),
        ("aux layers (HF index)", r["aux_layers"]),
        ("last hidden state", r["last_hidden_state"]),
        ("shard validation", r["validation"]),
    ]
    lines = ["# Stage 03: data report", "", "| item | value |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def interrupt_hint(cfg: RunConfig) -> str:
    """What an interrupted 03 left and how to go on (the line after ``interrupted by SIGINT:``): a ``--revalidate``
    pass stopped half-way leaves the shard set's validation record ``unfinished`` (04 refuses the set until 03
    runs again); otherwise each output is written whole, and the same command makes them again."""
    from eagle3.data.validation_record import unfinished_record

    record = unfinished_record([cfg.shards_dir, cfg.data_dir])
    if record is not None:
        return (
            f"the --revalidate pass did not finish: {record} says unfinished, so 04_train.py refuses the shard "
            f"set; re-run 03_prepare_data.py (it validates every shard)"
        )
    return (
        f"nothing is half-written in {cfg.data_dir} (its files are replaced together or not at all: an earlier "
        f"run's stay as they were); re-run the same command"
    )
