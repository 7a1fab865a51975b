"""Stage 03: validate the shards, count token frequencies, build the draft vocab, split train/val.

Inputs: ``{shards_dir}`` (stage 02: shards + ``data_config.json``). Outputs in ``{data_dir}``
(written as one set, :func:`eagle3.data.outputs.write_outputs`: a failure replaces none of them; the stage is
deterministic, so re-running it rewrites identical files):

- ``token_freq.pt``: int64 ``[target_V]`` counts of target ids at loss-masked positions;
- ``vocab_map.pt``: ``d2t`` int64 ``[draft_V]``, ``t2d`` bool ``[target_V]``, sizes (``eagle3.data.vocab``);
- ``split.json``: ``{"train": [idx...], "val": [idx...]}`` (seeded permutation, both sorted; ``eagle3.data.split``);
- ``data_report.json`` + ``data_report.md`` (+ ``coverage.png``: coverage of loss-masked tokens
  by the top-k target ids as a function of k, the chosen draft size marked);
- ``eagle3_manifest.json``: the ``data:`` settings and the shard set (path, fingerprint) they were made from
  (:class:`eagle3.manifest.DataManifest`; 04 refuses a folder made under others).

Validation (hash + load of every shard, :mod:`eagle3.data.validate`) is skipped when a validation record of an
earlier 03 matches the shard set exactly (``eagle3.data.validation_record``; written to ``{shards_dir}`` when
writable, else ``{data_dir}``); the outputs are then computed from the recorded stats and counts, identically.
``data_report.json`` says which: ``"validation": "full" | "reused"``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from eagle3 import manifest
from eagle3.cli import resume_on_interrupt
from eagle3.config import RunConfig
from eagle3.data.outputs import write_outputs
from eagle3.data.split import exclude_by_id, split_indices, subset_train
from eagle3.data.validate import shard_stats
from eagle3.data.validation_record import fingerprint_now, unfinished_record
from eagle3.data.vocab import build_vocab_map, coverage
from eagle3.errors import UserError
from eagle3.io import make_dirs, output_folder_lock, probe_dirs, rerun_hint
from eagle3.io.lock import lock_held
from eagle3.shards.checks import check_extract_settings, check_verifier
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import DATA_CONFIG, EXTRACT_LOCK, list_samples
from eagle3.shards.manifest import MANIFEST

log = logging.getLogger(__name__)

DATA_LOCK = ".data.lock"  # in data_dir while a 03 writes there (one 03 per data folder)
#: 03's disk-full advice (:func:`eagle3.io.rerun_hint`): a stopped 03 keeps nothing to resume from.
REDO_HINT = "re-run the same command (03 does not resume: it starts over)"


def main(cfg: RunConfig, *, plot: bool, revalidate: bool) -> int:
    """03's command: :func:`run` (SIGTERM / Ctrl-C: one line, exit 143 / 130), then its summary line."""
    with resume_on_interrupt(lambda: interrupt_hint(cfg)):
        r = run(cfg, plot=plot, revalidate=revalidate)
    print(
        f"{r['num_samples']} samples ({r['train_samples']} train / {r['val_samples']} val), draft vocab "
        f"{r['draft_vocab_size']}/{r['target_vocab_size']} covers {r['coverage']:.2%} of loss tokens -> "
        f"{cfg.data_dir}"
    )
    return 0


def run(cfg: RunConfig, *, plot: bool = True, revalidate: bool = False) -> dict:
    """Stage 03 holding ``{data_dir}/.data.lock`` (:func:`eagle3.io.output_folder_lock`): a second 03 on the same data
    folder (a draft-vocab sweep started side by side) stops at once with one line instead of writing its vocab map,
    split and report over the first one's. See :func:`prepare`."""
    holder = (
        f"another 03_prepare_data run is writing to {cfg.data_dir}; wait for it, or set data.output_dir for a "
        f"second data folder"
    )
    with (
        rerun_hint(REDO_HINT),
        output_folder_lock(cfg.data_dir, DATA_LOCK, holder, cfg.output_field("data")),
    ):
        return prepare(cfg, plot=plot, revalidate=revalidate)


def check_shards_stable(
    shards: Path, fingerprint: Optional[str] = None, out: Optional[Path] = None
) -> None:
    """That the shard set 03 reads is not being written: no 02 holds ``{shards}/.extract.lock`` (:data:`EXTRACT_LOCK`:
    03 would validate a half-written set and record a failed validation of it; a lock file left by a 02 that died is
    not held, :func:`eagle3.io.lock.lock_held`: the OS released its ``flock``) and, with ``fingerprint`` (taken before
    the validation pass: :func:`eagle3.data.validation_record.fingerprint_now`; before 03 writes its outputs to
    ``out``), the set is still the one it read. 03 checks both again before writing, so a 02 started on the same
    shards folder during 03's pass (minutes on a large set) is noticed and no vocab map or split of a set 02 was
    changing is published.

    Raises:
        UserError: one line, ``<shards>/.extract.lock: 02_extract_hidden is still writing the shards in <shards> ...``
            (a 02 runs now), or ``<shards>: the shard set changed while 03_prepare_data read it ...`` (a 02 ran, or
            shards were added, removed or rewritten); nothing is written to ``out``.
    """
    lock = Path(shards) / EXTRACT_LOCK
    if lock_held(lock):
        problem = (
            f"{lock}: 02_extract_hidden is still writing the shards in {shards} (it holds this lock); "
            f"wait for it to end, then run 03_prepare_data.py (a half-written shard set would fail "
            f"validation)"
        )
    elif fingerprint is not None and fingerprint_now(shards) != fingerprint:
        problem = (
            f"{shards}: the shard set changed while 03_prepare_data read it (shards, {MANIFEST} or "
            f"{DATA_CONFIG} written since it started: a 02_extract_hidden run there?); nothing written to "
            f"{out}; run 03_prepare_data.py again once 02 has finished"
        )
    else:
        return
    raise UserError(problem)


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
            (:func:`check_shards_stable`: nothing written).

    Returns:
        the report dict (also ``data_report.json``).
    """
    shards, out = cfg.shards_dir, cfg.data_dir
    meta, paths = _read_shards(cfg)
    probe_dirs(out, cfg.output_field("data"))  # before the validation pass (minutes), not after it
    stats, freq, how, fp = shard_stats(shards, out, meta, paths, revalidate)  # freq: [V]
    d2t, t2d = build_vocab_map(freq, cfg.data.draft_vocab_size)
    cov = coverage(freq, t2d)
    split, train_all, excluded = _split(cfg, paths, stats)
    check_shards_stable(shards, fp, out)  # a 02 started meanwhile: publish nothing
    make_dirs(out, cfg.output_field("data"))
    report = {
        "shards_dir": str(shards),
        "verifier": meta["verifier"],
        **_report_counts(meta, stats, freq, d2t, cov),
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
        "storage_dtype": meta.get("storage_dtype", "bfloat16"),  # fp8: validated with their scales
        "validation": how,  # "full": every shard hashed + loaded now; "reused": a matching record
    }
    made = manifest.DataManifest.make(
        shards_dir=str(shards.resolve()),
        shards_fingerprint=fp,
        **{k: getattr(cfg.data, k) for k in manifest.DataManifest.SETTINGS},
    )
    write_outputs(out, freq, d2t, t2d, split, report, made, cov, plot)
    log.info(
        "draft vocab %d/%d covers %.2f%% of %d loss tokens; %d train / %d val",
        d2t.numel(),
        report["target_vocab_size"],
        100 * cov,
        stats["num_loss_tokens"],
        len(split["train"]),
        len(split["val"]),
    )
    return report


def _read_shards(cfg: RunConfig) -> tuple[dict, list[tuple[int, Path]]]:
    """``(data_config.json, [(idx, shard path)])`` of ``cfg.shards_dir`` after 03's up-front checks: no 02 writing
    there, the verifier (first: another verifier explains any other difference) and extract settings match the
    config, ``data.draft_vocab_size`` fits the verifier's vocab, at least one shard."""
    shards = cfg.shards_dir
    check_shards_stable(shards)
    meta, meta_path = read_data_config(shards), shards / DATA_CONFIG
    unchecked = check_verifier(cfg.verifier, meta, shards)
    if unchecked:  # weights not comparable (shards without a fingerprint): said
        log.warning("%s", unchecked)
    check_extract_settings(cfg.extract, meta, shards)
    V, draft = int(meta["vocab_size"]), cfg.data.draft_vocab_size
    if draft > V:
        raise UserError(
            f"data.draft_vocab_size: {draft} is larger than the verifier's vocab ({V} tokens, {meta_path}); "
            f"use at most {V}"
        )
    return meta, list_samples(shards, at_least_one=True)


def _split(cfg: RunConfig, paths, stats: dict) -> tuple[dict, int, dict]:
    """``(split, training samples before exclusion, {prefix: excluded})``: the seeded train/val split, then
    ``data.exclude_id_prefixes`` and ``data.train_samples`` on the training side."""
    d = cfg.data
    split = split_indices([i for i, _ in paths], d.val_fraction, d.seed)
    if not split["train"]:
        raise UserError(
            f"{cfg.shards_dir}: not enough samples for a training split ({stats['num_samples']})"
        )
    train_all = len(split["train"])
    split["train"], excluded = exclude_by_id(split["train"], cfg.shards_dir, d.exclude_id_prefixes)
    split["train"] = subset_train(split["train"], d.train_samples, d.seed)
    return split, train_all, excluded


def _report_counts(
    meta: dict, stats: dict, freq: torch.Tensor, d2t: torch.Tensor, cov: float
) -> dict:
    """The report's vocab and token figures (``freq`` int64 ``[V]``, ``d2t`` ``[draft_V]``)."""
    V = int(meta["vocab_size"])
    return {
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
    }


def interrupt_hint(cfg: RunConfig) -> str:
    """What an interrupted 03 left and how to go on (the line after ``interrupted by SIGINT:``): a ``--revalidate``
    pass stopped half-way leaves the shard set's validation record ``unfinished`` (04 refuses the set until 03
    runs again); otherwise each output is written whole, and the same command makes them again."""
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
