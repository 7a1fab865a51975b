"""Stage 04: train an EAGLE-3 drafter with training-time test (TTT) on the captured shards, then report and export.

One call of :func:`run` does, on every process (single process, or ``torchrun`` ranks):

1. torch.distributed from the torchrun environment; the ranks compare their config and flags first
   (:mod:`eagle3.train.ranks`); with an export, whether ``export.engine`` can serve the configured drafter
   (:func:`eagle3.stages.export.check_export_serves`: variant, MLA sizes, context length).
2. Setup (:mod:`eagle3.train.inputs`), every input checked before the first write, under 04's lock on the train
   folder (:func:`eagle3.train.folder.train_lock`): drafter shape, verifier head, drafter init or warm start
   (``train.init_from``, :mod:`eagle3.train.warm_start`), the hidden-state source (:mod:`eagle3.train.online`), the
   data order (:mod:`eagle3.train.order`), AdamW with warmup + cosine. A refusal or a signal during setup removes
   what this call created.
3. ``--resume``: the newest complete checkpoint, bit-identically on CPU (data order, LR, RNG), also on another
   number of processes (:func:`eagle3.train.resume.restore`).
4. The loop (:class:`eagle3.train.loop.TrainLoop`): step-normalised TTT loss over micro-batches and ranks, metrics,
   validation every ``eval_every`` steps, checkpoints every ``ckpt_every`` steps and on SIGTERM/SIGINT (04 then
   exits 128 + signal).
5. The end: final validation, the choice of the exported weights (``train.select_best``), the export (rank 0) and
   ``train_report.{json,md}`` + ``loss.png`` (:mod:`eagle3.train.report`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from eagle3 import manifest
from eagle3.cli import Terminated, resume_on_interrupt
from eagle3.config import RunConfig, load_config
from eagle3.data.dataset import read_split
from eagle3.data.validation_record import record_fingerprint, require_passed
from eagle3.data.vocab import load_run_vocab_map
from eagle3.engines.layers import check_servable
from eagle3.io import rerun_hint
from eagle3.process_group import Dist, process_group_scope
from eagle3.sdpa import no_cudnn_sdpa
from eagle3.shards.checks import check_extract_settings, check_verifier
from eagle3.shards.data_config import read_data_config
from eagle3.stages.export import (
    check_export_destination,
    check_export_serves,
    export_for_run,
    export_from_checkpoint,
    load_init_drafter,
)
from eagle3.train import inputs as setup
from eagle3.train import metrics, order, ranks, report, resume_checks
from eagle3.train import resume as resuming
from eagle3.train.folder import REDO_HINT, train_lock, undo_on_refusal
from eagle3.train.loop import LoopSettings, TrainLoop
from eagle3.train.online import check_hidden_states
from eagle3.train.ranks import StopFlag, init_distributed
from eagle3.train.sim_accept import BestTracker, effective_chain
from eagle3.train.warm_start import WARM_START_SHAPE, check_init_from

log = logging.getLogger(__name__)


def main(
    config,
    overrides=(),
    *,
    resume: bool = False,
    max_steps: Optional[int] = None,
    stop_at: Optional[int] = None,
    export_only: bool = False,
    engine: Optional[str] = None,
) -> int:
    """04 after its argument parsing: the config (``engine`` overrides ``export.engine``), the export destination
    checked before training, then ``--export-only`` (the newest checkpoint's weights exported) or :func:`run` with
    the export at its end. Returns the exit status: 0, or ``128 + signal`` for a run stopped by a signal."""
    cfg = load_config(config, overrides)
    if engine:
        cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"engine": engine})})
    # before training (not after it) or the export
    check_export_destination(cfg.export_dir, cfg.export.engine, cfg.output_field("export"))
    if export_only:
        warn_export_serves(cfg, True)
        with resume_on_interrupt(lambda: export_interrupt_hint(cfg)):  # SIGTERM / Ctrl-C: one line
            out = export_from_checkpoint(cfg)
        print(f"exported: {out}")
        return 0
    res = run(
        cfg,
        resume=resume,
        max_steps=max_steps,
        export=export_for_run,
        init=load_init_drafter,
        stop_at=stop_at,
    )
    return interrupted_exit(res) if res["stopped"] else 0


def warn_export_serves(cfg: RunConfig, is_main: bool) -> None:
    """:func:`eagle3.stages.export.check_export_serves` (its refusals raised on every rank), its warning logged on
    rank 0 (``is_main``; within training, also in ``train_report.json``'s ``warnings``)."""
    warning = check_export_serves(cfg)
    if warning and is_main:
        log.warning("%s", warning)


def export_interrupt_hint(cfg: RunConfig) -> str:
    """What an interrupted ``--export-only`` left (the line after ``interrupted by SIGTERM:``): the export is written
    in a temporary folder beside ``export_dir`` (removed on the signal) and renamed over it only once whole."""
    return (
        f"nothing is half-written: {cfg.export_dir} is replaced only by a whole export (its temporary folder was "
        f"removed), and the checkpoints are only read; re-run the same command to export"
    )


def interrupted_exit(res: dict) -> int:
    """One stderr line (rank 0) for a run stopped by a signal; returns ``128 + signal`` (SIGTERM: another rank's)."""
    signum = res.get("signal") or signal.SIGTERM
    if os.environ.get("RANK", "0") == "0":
        print(
            f"interrupted by {signal.Signals(signum).name} at step {res['step']}/{res['total_steps']}: checkpoint "
            f"{res['checkpoint']}, nothing exported; continue with the same command plus --resume",
            file=sys.stderr,
        )
    return 128 + int(signum)


def run(
    cfg: RunConfig,
    resume: bool = False,
    max_steps: Optional[int] = None,
    stop_after: Optional[int] = None,
    device: Optional[str] = None,
    export: Optional[Callable[[RunConfig, Any, dict], Path]] = None,
    init: Optional[Callable[[RunConfig, torch.Tensor, dict], nn.Module]] = None,
    stop_at: Optional[int] = None,
) -> dict:
    """Train (or continue training) the drafter described by ``cfg``; see the module docstring.

    Args:
        resume: continue from the newest complete checkpoint (none: starts fresh, with a warning); without it, an
            existing checkpoint folder is refused.
        max_steps: a cap on the optimizer steps of ``train.epochs`` (overrides ``train.max_steps``).
        stop_after: stop after this many optimizer steps *of this call*, with a checkpoint (tests, time slices).
        device: ``"cpu"`` to force CPU.
        export: ``export(cfg, drafter, data_config, provenance=...)`` -> the export folder, on rank 0 when training
            finishes (not when stopped). ``init``: ``init(cfg, embed_weight [V, H], data_config)`` -> the drafter of
            ``train.init_from``. ``stop_at``: end at this optimizer step, as a finished run ends.

    Returns:
        ``train_report.json``'s dict: ``step``, ``total_steps``, ``stopped``, ``signal`` (this rank's, else None),
        ``checkpoint``, ``export_dir`` (None when stopped), ``final_val``, ``tokens_per_s``, ...

    Raises:
        UserError: a refused input, resume or folder; a full disk (the line ends with ``REDO_HINT``).
    """
    d = init_distributed(device)
    stop = StopFlag()
    with process_group_scope(d.ctrl_group, owned=d.initialized_here):  # barrier only on success
        try:  # no per-shape cuDNN plans (~40 ms each): batch shapes change every step
            with no_cudnn_sdpa(), rerun_hint(REDO_HINT):
                return _run(cfg, d, stop, resume, max_steps, stop_after, export, init, stop_at)
        finally:
            stop.restore()


def _run(cfg, d, stop, resume, max_steps, stop_after, export=None, init=None, stop_at=None) -> dict:
    """The stage in named steps: setup under 04's lock (taken by :func:`eagle3.train.inputs.load_inputs` before
    its first write, held to the end), the loop, the end."""
    flags = {
        "--resume": resume,
        "--max-steps": max_steps,
        "--stop-at": stop_at,
        "stop_after": stop_after,
    }
    ranks.ranks_agree(d, {**ranks.dotted(cfg.model_dump(mode="json")), **flags})
    with contextlib.ExitStack() as held, metrics.collect_warnings(d.is_main) as warned:
        setup.warn_world_size(cfg, d)
        if export is not None:  # before anything is read or written: not after the training
            warn_export_serves(cfg, d.is_main)
        lock = lambda: held.enter_context(  # noqa: E731
            train_lock(cfg.train_dir, d, cfg.output_field("train"))
        )
        loop, rec = _start(cfg, d, stop, resume, max_steps, init, stop_at, lock, warned)
        try:
            _sinks(cfg, loop)
            loop.run(stop, stop_after)
            return _finish(cfg, loop, rec, stop, export)
        finally:
            loop.inputs.states.close()


def stop_before_training(stop: Optional[StopFlag], d: Dist) -> None:
    """Honour a signal that came before the first optimizer step of this call (04's start-up): stop now, nothing
    trained and no checkpoint written; every rank calls it at the same points.

    Raises:
        eagle3.cli.Terminated: a ``KeyboardInterrupt`` carrying the signal (``run_main`` exits 128 + signal).
    """
    if stop is None or not ranks.any_rank(stop.requested, d):
        return
    e = Terminated(stop.signum or signal.SIGTERM)
    e.hint = (
        "stopped during start-up, before the first optimizer step: nothing trained, no checkpoint written; "
        "re-run the same command"
    )
    raise e


def _start(cfg, d, stop, resume, max_steps, init, stop_at, lock, warned):
    """Setup and resume (a refusal or a signal removes what this call created): the loop, its RunRecord."""
    stop_check = lambda: stop_before_training(stop, d)  # noqa: E731
    s = _setup(cfg)
    load = None if init is None else (lambda embed, dc: init(cfg, embed, dc))
    with undo_on_refusal(cfg.train_dir, d.is_main):
        data_config, vocab, split = _read_data(cfg, d)
        inputs = setup.load_inputs(s, d, data_config, vocab, split, resume, load, stop_check, lock)
        try:
            ranks.same_data(
                d, order.data_inputs(inputs.split, inputs.vocab, inputs.data_config), cfg.data_dir
            )
            data = setup.build_data(s, d, inputs, max_steps)
            stop_check()
            opt = setup.build_optimisation(s, d, inputs, data.total_steps)
            rec = _record(cfg, s, d, inputs, opt, warned)
            pos = resuming.Progress(total_steps=data.total_steps)
            if resume:
                resuming.restore(pos, rec, d, data, opt, inputs, stop_at)
            else:
                resuming.set_stop_at(pos, stop_at, data, cfg.train.epochs)
            stop_check()  # a signal during start-up: no resume line, no step
            resuming.announce_resume(pos, d, data.order)
        except BaseException:
            inputs.states.close()
            raise
    save = lambda: resuming.save(pos, rec, d, data.order, opt, inputs)  # noqa: E731
    return TrainLoop(_settings(cfg), d, inputs, data, opt, pos, save, stop_check), rec


def _setup(cfg: RunConfig) -> setup.Setup:
    """What the setup reads of ``cfg`` (:class:`eagle3.train.inputs.Setup`)."""
    sections = {k: getattr(cfg, k) for k in ("train", "drafter", "verifier", "extract")}
    folders = {k: getattr(cfg, k) for k in ("train_dir", "data_dir", "shards_dir")}
    return setup.Setup(**sections, **folders, train_field=cfg.output_field("train"))


def _read_data(cfg: RunConfig, d: Dist) -> tuple[dict, dict, dict]:
    """``(data_config, vocab, split)``: 02's ``data_config.json`` checked against the config (verifier, extract,
    engine aux layers, hidden-state source); 03's vocab map and split (its validation passed, current with both)."""
    data_config = read_data_config(cfg.shards_dir)
    # first: another verifier explains the rest
    unchecked = check_verifier(cfg.verifier, data_config, cfg.shards_dir)
    if unchecked and d.is_main:  # shards without a weights fingerprint (report's warnings too)
        log.warning("%s", unchecked)
    check_extract_settings(cfg.extract, data_config, cfg.shards_dir)
    where = str(cfg.shards_dir / "data_config.json")  # before training, not at the export after it
    check_servable(
        data_config["aux_layers"], cfg.export.engine, str(data_config["architecture"]), where
    )
    check_hidden_states(cfg.train.hidden_states, cfg.extract, cfg.shards_dir, data_config)
    vocab = load_run_vocab_map(
        cfg.data_dir, cfg.data.draft_vocab_size, int(data_config["vocab_size"])
    )
    split = read_split(cfg.data_dir)
    now = record_fingerprint(require_passed(cfg.shards_dir, cfg.data_dir))
    made = manifest.read(cfg.data_dir, manifest.DataManifest)
    needed = {k: getattr(cfg.data, k) for k in made.SETTINGS}
    if made.shards_fingerprint != now:  # another folder's shards, or these re-extracted since
        needed |= {"shards_dir": str(cfg.shards_dir.resolve()), "shards_fingerprint": now}
    manifest.require(made, needed, made.STAGE)
    return data_config, vocab, split


def _sinks(cfg: RunConfig, loop: TrainLoop) -> None:
    """The loop's ``metrics.jsonl`` / TensorBoard rows and its best-weights tracker (``train.select_best``)."""
    t, d, pos = cfg.train, loop.d, loop.pos
    loop.metrics = metrics.Metrics(
        cfg.train_dir, pos.step, d.is_main, finished=pos.step >= pos.total_steps
    )
    chain, capped = effective_chain(t.select_chain, cfg.benchmark.steps, t.ttt_length)
    if capped and d.is_main:  # once per call, also in train_report's warnings
        log.warning(capped)
    # an end set in steps (--stop-at, a step cap): a best kept from before the resume past it is dropped
    end = pos.end_step if (pos.stop_at is not None or loop.data.horizon is not None) else None
    loop.tracker = BestTracker(
        cfg.train_dir,
        chain,
        d.is_main,
        start_step=pos.step,
        keep_best=t.select_best == "sim_accept",
        end_step=end,
        temperature=t.select_temperature,
        top_p=t.select_top_p,
    )


def _settings(cfg: RunConfig) -> LoopSettings:
    """The loop's ``train.*`` values (same names)."""
    return LoopSettings(**{f.name: getattr(cfg.train, f.name) for f in fields(LoopSettings)})


def _record(cfg: RunConfig, s, d: Dist, inputs, opt, warned: list) -> resuming.RunRecord:
    """What the checkpoints record of this run, and what a resume compares (:class:`eagle3.train.resume.RunRecord`)."""
    i, t = inputs, cfg.train
    current = setup.resume_current(s, i.args, i.split, i.vocab, i.data_config)
    same = ("seed", "epochs", "warmup_ratio", "keep_checkpoints", "hidden_states")
    return resuming.RunRecord(
        train_dir=cfg.train_dir,
        data_dir=cfg.data_dir,
        current={**current, "world_size": d.world},
        fingerprint=opt.fingerprint,
        extract_backend=cfg.extract.backend,
        warnings=warned,
        **{k: getattr(t, k) for k in same},
    )


def _recipe_used(cfg: RunConfig, opt) -> dict:
    """``train_report.json``'s recipe: the config's, but ``lr`` / ``weight_decay`` from the optimizer state."""
    keys = "loss lk_eta epochs batch_tokens batch_size grad_accum warmup_ratio ttt_length select_best".split()
    return {**{k: getattr(cfg.train, k) for k in keys}, **resuming.optimizer_values(opt)}


def _finish(
    cfg: RunConfig,
    loop: TrainLoop,
    rec: resuming.RunRecord,
    stop: StopFlag,
    export: Optional[Callable],
) -> dict:
    """End step: the result dict; unless stopped: final validation, the selection and ``export`` (rank 0), the
    report and the closing lines."""
    d, p, t, tracker = loop.d, loop.pos, cfg.train, loop.tracker
    result = {
        "step": p.step,
        "total_steps": p.total_steps,
        "stop_at": p.stop_at,
        "stopped": p.stopped,
        "signal": stop.signum if p.stopped else None,
        "checkpoint": str(p.last_ckpt) if p.last_ckpt else None,
        "export_dir": None,
        "final_val": {},
        "tokens_per_s": (p.tok_total / p.t_total) if p.t_total > 0 else None,
        "peak_gpu_mem_gib": report.peak_gpu_mem_gib(d.device),
        "hidden_states": t.hidden_states,
        "init_from": loop.inputs.init_from,
        "segments": resuming.segments(p, rec, d),
        "recipe": _recipe_used(cfg, loop.opt),
        "warnings": rec.warnings,
        "val_samples": len(loop.data.val_ds) if loop.data.val_ds is not None else 0,
    }
    if not result["val_samples"]:  # said in the report and closing lines, not an empty tau table
        result["no_validation"] = report.no_validation_note(result["step"], stopped=p.stopped)
    if p.stopped:  # no final validation, no export; the report says where it stopped, how to go on
        loop.metrics.close()
        if d.is_main:
            result["sim_accept"] = dict(
                tracker.summary(), select_best=t.select_best, exported_step=None, stopped=True
            )
            report.write_report(cfg.train_dir, result, loop.inputs.args)
        d.barrier()
        return result
    result["final_val"] = final_val = loop.validate()
    loop.check_states()
    loop.log_validation(final_val)
    loop.metrics.close()
    if d.is_main:
        try:  # training is done: its report is written anyway, saying why nothing was exported
            _select_and_export(cfg, loop, result, export)
        except Exception as e:
            sim = dict(loop.tracker.summary(), select_best=t.select_best, exported_step=None)
            raise report.export_failed(
                cfg.train_dir, result, loop.inputs.args, sim, p.last_ckpt, e
            ) from e
        report.write_report(cfg.train_dir, result, loop.inputs.args)
        print(report.headline(result, cfg.train_dir, loop.inputs.args))
    d.barrier()
    return result


def _select_and_export(
    cfg: RunConfig, loop: TrainLoop, result: dict, export: Optional[Callable]
) -> None:
    """Rank 0 at the end: the ``train.select_best`` weights into the drafter, the plot, ``export`` (its folder)."""
    sel, tracker, drafter = cfg.train.select_best, loop.tracker, loop.inputs.drafter
    summary = tracker.summary()
    best = tracker.restore_best(drafter) if sel == "sim_accept" else None
    result["sim_accept"] = dict(summary, select_best=sel, exported_step=best)
    if sel == "sim_accept" and best is None:  # nothing was selected
        log.warning(
            setup.no_val_selection(cfg)
            if loop.data.val_ds is None
            else f"train.select_best: sim_accept found no best weights to restore; the last step's weights "
            f"(step {loop.pos.step}) are exported instead"
        )
    tracker.plot()
    if export is not None:
        p = loop.pos
        prov = report.export_provenance(cfg.train_dir, p.last_ckpt, p.step, sel, best or p.step)
        result["export_dir"] = str(export(cfg, drafter, loop.inputs.data_config, provenance=prov))


def check_init_from_config(cfg: RunConfig) -> bool:
    """:func:`eagle3.train.warm_start.check_init_from` of ``cfg`` (neither verifier nor shards needed)."""
    drafter = {k: getattr(cfg.drafter, k, None) for k in WARM_START_SHAPE}
    return check_init_from(cfg.train.init_from, drafter, resume_checks.DRAFTER_CONFIG_KEYS)
