"""Stage 02: tokenize the prompts file, capture verifier hidden states, write speculators shards (resumable).

``python 02_extract_hidden.py --config run.yaml``, or ``torchrun --nproc_per_node N ...`` (HF backend: each rank
captures every N-th batch of the same global plan, :mod:`eagle3.capture.dist`). :func:`run`: check the prompts are
01's current ones; nothing to do when the folder is finished; read and tokenize the prompts
(:mod:`eagle3.capture.prompts`); check the folder's settings and resume (:mod:`eagle3.capture.resume`, crash
safety: :mod:`eagle3.capture.folder`); the disk plan; the capture loop (:mod:`eagle3.capture.loop`); then
``data_config.json`` written LAST (it marks a complete extraction) and the report. Token-only samples
(``train.hidden_states: online``): the same steps, shards of ``input_ids`` and ``loss_mask`` only, no prefill.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.capture import resume
from eagle3.capture.backends import checked_backend, shard_expect
from eagle3.capture.base import CaptureBackend
from eagle3.capture.disk_plan import NotEnoughDisk, plan_pending
from eagle3.capture.dist import DIST_TIMEOUT, JOB, gather_ranks, ranks_agree
from eagle3.capture.folder import (
    MANIFEST,
    REPORT_JSON,
    REPORT_MD,
    exclusive,
    finished_rows,
    merge_rank_manifests,
    rank_manifest_name,
    remove_fresh_folder,
    wipe_frees_bytes,
)
from eagle3.capture.loop import assign_batches, default_write_threads, write_pending
from eagle3.capture.prompts import (
    Sample,
    check_token_ids,
    read_prompts,
    self_instruct_dropped,
    tokenize,
)
from eagle3.capture.report import data_config, markdown, rank_stats, rate_text, summary_lines
from eagle3.chat.template import ChatOptions
from eagle3.cli import resume_on_interrupt
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import atomic_write_json, atomic_write_text, make_dirs, remove_stale_tmp
from eagle3.io.read import file_sha256
from eagle3.process_group import Dist, init_dist, process_group_scope, rank_cuda_device
from eagle3.regen.report import limit_drops_self_instruct
from eagle3.shards.data_config import write_data_config
from eagle3.shards.format import DATA_CONFIG, TOKEN_BYTES_PER_TOKEN
from eagle3.shards.fp8 import storage_from_config
from eagle3.shards.write import NonFiniteStates
from eagle3.stages.prompts_manifest import read_report, require_current
from eagle3.verifier.load import weights_record

log = logging.getLogger(__name__)


def token_only(cfg: RunConfig) -> bool:
    """Whether stage 02 writes token-only samples (``train.hidden_states: online``)."""
    return cfg.train.hidden_states == "online"


def fingerprint(cfg: RunConfig, prompts_sha256: str) -> tuple[str, dict]:
    """:func:`eagle3.capture.resume.settings_fingerprint` of ``cfg``: ``(hex, components)``."""
    storage = storage_from_config(cfg.extract)
    return resume.settings_fingerprint(
        cfg.verifier.model_dump(exclude={"device"}, mode="json"),
        cfg.extract.model_dump(include=set(resume.FINGERPRINT_EXTRACT_KEYS), mode="json"),
        prompts_sha256=prompts_sha256,
        verifier_id=cfg.verifier.display_name(),
        storage=storage.to_meta() if storage.is_fp8 else None,
        tokens_only=token_only(cfg),
    )


def tokenize_prompts(
    tokenizer, prompts: list[dict], cfg: RunConfig, prompts_path: Path
) -> tuple[list[Sample], Counter, dict[str, list[str]]]:
    """:func:`eagle3.capture.prompts.tokenize` under ``cfg``'s ``extract.{max_length, too_long,
    tokenize_workers}`` and chat options."""
    ex = cfg.extract
    opts = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    return tokenize(
        tokenizer, prompts, prompts_path, max_length=ex.max_length, too_long=ex.too_long,
        opts=opts, workers=ex.tokenize_workers
    )  # fmt: skip


def warn_limit_drops_self_instruct(cfg: RunConfig, limit: int) -> Optional[str]:
    """Warn (one line; also returned) when ``--limit`` leaves out ``prompts.self_instruct`` prompts (how many,
    from ``prompts_report.json``'s counts). None: nothing left out, or no such report."""
    got = self_instruct_dropped(read_report(cfg)[1], limit)
    if got is None:
        return None
    n_si, dropped, kept = got
    text = limit_drops_self_instruct("--limit", limit, n_si, dropped, kept)
    log.warning(text)
    return text


def interrupt_hint(cfg: RunConfig) -> str:
    """What an interrupted 02 kept and how to go on (the line after ``interrupted by SIGTERM:``)."""
    root = cfg.shards_dir
    n = finished_rows(root)
    return f"{n} finished shards kept in {root}; re-run the same command (without --overwrite) to resume"


def main(cfg: RunConfig, *, overwrite: bool, limit: Optional[int], ignore_disk_check: bool) -> int:
    """02's command: :func:`run` (SIGTERM / Ctrl-C: one line, exit 143 / 130), then its summary lines."""
    with resume_on_interrupt(lambda: interrupt_hint(cfg)):
        s = run(cfg, overwrite=overwrite, limit=limit, ignore_disk_check=ignore_disk_check)
    # torchrun rank > 0: rank 0 reports; up to date: logged
    if "samples" in s and not s.get("up_to_date"):
        print("\n".join(summary_lines(s)))
    return 0


def run(
    cfg: RunConfig,
    *,
    overwrite: bool = False,
    limit: Optional[int] = None,
    backend: Optional[CaptureBackend] = None,
    tokenizer=None,
    ignore_disk_check: bool = False,
) -> dict:
    """Run stage 02 (resumable).

    Args:
        overwrite: delete this stage's files in ``cfg.shards_dir`` (once the disk plan fits) and start over.
        limit: only the first ``limit`` prompts.
        backend, tokenizer: an already-built backend and tokenizer (tests, benchmarks); default
            :func:`eagle3.capture.backends.make_backend`. Its ``aux_layers`` must be the configured/default ones.
        ignore_disk_check: capture even when the disk plan does not fit.

    Returns:
        the summary (also ``extract_report.json`` / ``.md``); a finished folder of the same settings is not
        touched: its ``extract_report.json`` with ``up_to_date: True``.

    Raises:
        UserError: bad prompts file, prompts made under other ``prompts:`` settings, fingerprint mismatch, unknown
            folder contents, bad aux layers. NotEnoughDisk: the run does not fit (nothing written; a shards folder
            this call created is removed again).
    """
    root = cfg.shards_dir
    d = init_dist(timeout=DIST_TIMEOUT, job=JOB)
    created = [p for p in (root, *root.parents) if not p.exists()]  # deepest first
    with process_group_scope(d.ctrl_group, owned=d.initialized_here):  # barrier on success only
        try:
            with contextlib.ExitStack() as stack:
                cfg = _lock(cfg, root, backend, d, stack)
                return _extract(
                    cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk_check
                )
        except (NotEnoughDisk, UserError):
            if created and d.rank == 0:
                remove_fresh_folder(created)
            raise


def _lock(cfg: RunConfig, root: Path, backend, d: Dist, stack: contextlib.ExitStack) -> RunConfig:
    """Create the shards folder and take its lock (rank 0 only under torchrun; released with ``stack``);
    returns ``cfg`` with this rank's verifier device (``cuda:LOCAL_RANK``; not part of the fingerprint)."""
    if d.world > 1 and cfg.extract.backend != "hf" and backend is None:
        raise UserError(
            f"extract.backend: torchrun (WORLD_SIZE={d.world}) is supported for the hf backend only, "
            f"got '{cfg.extract.backend}'; run the sglang backend as one process"
        )

    def lock() -> None:
        make_dirs(root, cfg.output_field("shards"))
        stack.enter_context(exclusive(root))

    d.on_rank0(lock)
    dev = str(cfg.verifier.device)
    if d.world > 1 and (dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available())):
        cfg = cfg.model_copy(deep=True)
        cfg.verifier.device = rank_cuda_device(d.local_rank)
        torch.cuda.set_device(d.local_rank)
    return cfg


@dataclass
class _Prepared:
    """What the plan step fixes before any capture: prompts, fingerprint, backend, samples, finished set."""

    prompts: list[dict]
    prompts_sha: str
    fp: str
    backend: Any
    tokenizer: Any
    info: dict
    aux: list[int]
    samples: list[Sample]
    counts: Counter
    skipped_ids: dict[str, list[str]]
    done: dict[int, dict]
    disk: dict


def _prepare(cfg, root, overwrite, limit, backend, tokenizer, d: Dist, ignore_disk) -> _Prepared:
    """Plan + tokenize steps: read prompts, check/prepare the folder (rank 0), build the backend, tokenize,
    reconcile the manifest with the shards and check the disk plan (rank 0). ``--overwrite`` deletes the old
    shards only once the new run's plan fits (counting the space they free): a refused run keeps them."""
    prompts = read_prompts(cfg.prompts_path, limit)
    prompts_sha = file_sha256(cfg.prompts_path)
    fp, comp = fingerprint(cfg, prompts_sha)
    freed = d.on_rank0(lambda: wipe_frees_bytes(root)) if overwrite else 0

    def prepare_folder() -> None:
        resume.check_state(root, fp, comp, overwrite, weights_record(cfg.verifier))
        if stale := remove_stale_tmp(root):
            log.info("removed %d unfinished temporary files from an interrupted run", len(stale))
        if merged := merge_rank_manifests(root):
            log.info("merged %d per-rank manifests of an interrupted multi-process run", merged)

    if not overwrite:
        d.on_rank0(prepare_folder)
    backend, tokenizer, info, aux = checked_backend(
        cfg.verifier, cfg.extract, cfg.export.engine, backend, tokenizer
    )
    check_token_ids(prompts, int(info["vocab_size"]), cfg.prompts_path)
    samples, counts, skipped_ids = tokenize_prompts(tokenizer, prompts, cfg, cfg.prompts_path)
    expect = shard_expect(info, storage_from_config(cfg.extract).dtype, tokens_only=token_only(cfg))

    def reconcile() -> dict[int, dict]:
        done = resume.resume_state(root, samples, cfg.extract.rows_per_dir, expect, root / MANIFEST)
        if any(s.idx not in done for s in samples):
            (root / DATA_CONFIG).unlink(missing_ok=True)  # present == complete
        return done

    def disk(done: dict, freed: int = 0) -> dict:
        todo = [s for s in samples if s.idx not in done]
        ex = cfg.extract
        return plan_pending(
            root, todo, hidden_size=info["hidden_size"], storage=storage_from_config(ex),
            tokens_only=token_only(cfg), rows_per_dir=ex.rows_per_dir, margin=ex.disk_margin,
            margin_bytes=ex.disk_margin_bytes, skipped_ids=skipped_ids, ignore=ignore_disk,
            freed_by_overwrite=freed
        )  # fmt: skip

    if overwrite:  # plan first (nothing will be resumed), delete only when it fits
        plan = d.on_rank0(lambda: disk({}, freed))
        d.on_rank0(prepare_folder)
        done = d.on_rank0(reconcile)
    else:
        done = d.on_rank0(reconcile)
        plan = d.on_rank0(lambda: disk(done))
    if d.rank == 0:
        n_skipped = counts["skipped_too_long"] + counts["skipped_no_loss_tokens"]
        log.info("%d samples (%d already done), %d skipped", len(samples), len(done), n_skipped)
    return _Prepared(
        prompts, prompts_sha, fp, backend, tokenizer, info, aux, samples, counts, skipped_ids, done, plan
    )  # fmt: skip


def _up_to_date(cfg: RunConfig, root: Path, limit: Optional[int], d: Dist) -> Optional[dict]:
    """The finished report when the folder already holds exactly this run (every rank gets it), else None."""
    finished = d.on_rank0(
        lambda: resume.finished_report(
            root, cfg.prompts_path, limit, lambda sha: fingerprint(cfg, sha)[0],
            lambda: weights_record(cfg.verifier), cfg.extract.rows_per_dir
        )
    )  # fmt: skip
    if finished is None:
        return None
    if d.rank == 0:
        msg = "shards up to date: %s (%d samples, settings unchanged; use --overwrite to redo)"
        log.info(msg, root, finished["samples"])
        unchecked = resume.weights_unchecked(
            root, resume.read_state(root), weights_record(cfg.verifier)
        )
        if unchecked:
            log.warning("%s", unchecked)
    return {**(finished if d.rank == 0 else {"shards_dir": str(root)}), "up_to_date": True}


def _extract(cfg, root, overwrite, limit, backend, tokenizer, d: Dist, ignore_disk) -> dict:
    """The stage in named steps: check the prompts, nothing to do, prepare (plan + tokenize + disk check),
    capture + write, gather ranks, finalise."""
    t_start = time.perf_counter()
    d.on_rank0(lambda: require_current(cfg))
    try:
        mine: Any = resume.flat_components(fingerprint(cfg, file_sha256(cfg.prompts_path))[1])
    except (UserError, OSError) as e:
        mine = f"cannot read {cfg.prompts_path}: {e}"
    ranks_agree(d, mine, cfg.shards_dir, cfg.prompts_path)
    if limit is not None:
        d.on_rank0(lambda: warn_limit_drops_self_instruct(cfg, limit))
    if not overwrite and (finished := _up_to_date(cfg, root, limit, d)) is not None:
        return finished
    p = _prepare(cfg, root, overwrite, limit, backend, tokenizer, d, ignore_disk)
    n_resumed = len(p.done)
    done_tok = sum(len(s.input_ids) for s in p.samples if s.idx in p.done)
    captured_tok = sum(len(s.input_ids) for s in p.samples) - done_tok
    mine = assign_batches(p.samples, p.done, cfg.extract.batch_tokens, d.rank, d.world)
    my_tok = sum(
        len(p.samples[i].input_ids) for g in mine for i in g if p.samples[i].idx not in p.done
    )
    t_cap = time.perf_counter()
    my_rows = _capture(cfg, root, p, mine, d, my_tok, done_tok if d.world == 1 else 0)
    written, t_cap = len(my_rows), time.perf_counter() - t_cap
    ranks: list[dict] = []
    if d.world > 1:  # the all-gather is the barrier after which rank 0 alone finalises the folder
        mine_stats = rank_stats(d.rank, written, my_tok, t_cap)
        gathered = d.all_gather({**mine_stats, "rows": my_rows})
        if d.rank != 0:
            return {**mine_stats, "world_size": d.world, "shards_dir": str(root)}
        written, t_cap = gather_ranks(root, p.samples, p.done, gathered, ranks)
    summary = _finalise(cfg, root, p, n_resumed, written, t_cap, captured_tok, t_start)
    if d.world > 1:
        per_s = round(written / t_cap, 2) if t_cap > 0 and written else None
        summary.update(world_size=d.world, samples_per_s=per_s, ranks=ranks)
        msg = "all %d ranks: %d samples in %.1f s = %s samples/s"
        log.info(msg, d.world, written, t_cap, rate_text(per_s))
    atomic_write_json(root / REPORT_JSON, summary)
    atomic_write_text(root / REPORT_MD, markdown(summary))
    return summary


def _capture(cfg, root, p: _Prepared, mine, d: Dist, my_tok: int, shown_done: int) -> list[dict]:
    """This rank's capture + write step (:func:`eagle3.capture.loop.write_pending`); a NaN/Inf state is named
    with its layer and the dtype the verifier ran in (one error line)."""
    ex = cfg.extract
    bar = dict(total=shown_done + my_tok, initial=shown_done, position=d.rank)
    bar["desc"] = "capture" if d.world == 1 else f"capture rank {d.rank}/{d.world}"
    try:
        return write_pending(
            None if token_only(cfg) else p.backend, p.samples, mine, p.done, root,
            root / MANIFEST if d.world == 1 else root / rank_manifest_name(d.rank),
            rows_per_dir=ex.rows_per_dir, batch_tokens=ex.batch_tokens,
            write_threads=default_write_threads() if ex.write_threads is None else ex.write_threads,
            storage=storage_from_config(ex), hidden_size=p.info["hidden_size"], bar=bar
        )  # fmt: skip
    except NonFiniteStates as e:
        dtype = cfg.verifier.dtype if ex.backend == "hf" else None
        raise e.explained(aux_layers=p.aux, dtype=dtype) from None


def _finalise(cfg, root, p: _Prepared, n_resumed, written, t_cap, captured_tok, t_start) -> dict:
    """Finalise step: ``data_config.json`` (written last: marks the extraction complete); returns the summary."""
    meta = data_config(
        cfg.verifier, cfg.extract, tokens_only=token_only(cfg), info=p.info, aux=p.aux,
        tokenizer=p.tokenizer, fp=p.fp, prompts_sha=p.prompts_sha, prompts_path=cfg.prompts_path,
        rows=[p.done[k] for k in sorted(p.done)], counts=p.counts, skipped_ids=p.skipped_ids,
        weights=weights_record(cfg.verifier)
    )  # fmt: skip
    write_data_config(root, meta)
    bpt = TOKEN_BYTES_PER_TOKEN if token_only(cfg) else meta["bytes_per_token"]
    rate = round(captured_tok / t_cap, 1) if t_cap > 0 and captured_tok else None
    servers = p.backend.server_summary() if hasattr(p.backend, "server_summary") else None
    return {
        "shards_dir": str(root),
        "prompts": len(p.prompts),
        "samples": meta["num_samples"],
        "written": written,
        "resumed": n_resumed,
        **{k: meta[k] for k in ("num_tokens", "num_loss_tokens", "skipped", "truncated")},
        "split_conversations": meta["split"]["conversations"],
        "split_samples": meta["split"]["samples"],
        "skipped_ids": p.skipped_ids,
        "capture_s": round(t_cap, 3),
        "total_s": round(time.perf_counter() - t_start, 3),
        "captured_tokens_per_s": rate,
        "disk_gb": round(meta["num_tokens"] * bpt / 1e9, 4),
        "disk_plan": p.disk,
        **({"servers": servers} if servers is not None else {}),
    }
