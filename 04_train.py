#!/usr/bin/env python
"""Stage 04: train the EAGLE-3 drafter on the captured shards, then export it for SGLang/vLLM.

Single process: ``python 04_train.py --config configs/smollm2-135m.yaml``
Several GPUs:   ``torchrun --nproc_per_node 8 04_train.py --config configs/kimi-k2.5.yaml``
Continue after a crash/preemption: add ``--resume`` (newest complete checkpoint in {train_dir}/checkpoints).
Export for the other engine without retraining: ``--export-only --engine vllm``.
End early on a longer lr schedule (exported as a finished run): ``--stop-at 6000`` with ``train.max_steps: 7986``.
Warm start from an exported drafter (also one of other data): ``--set train.init_from=outputs/run/drafter-sglang``.
SIGTERM/SIGINT finish the current optimizer step, write a checkpoint and exit 128 + the signal
number (143 for SIGTERM, 130 for SIGINT, the shell's convention for a process ended by a signal), with
no export: so `04_train.py && 05_benchmark.py` stops there, and a scheduler does not count the run as
finished (a 0 would let 05 benchmark an older export left in the folder). A signal during start-up (before the first
optimizer step) stops at once: one line, no checkpoint, no train folder left that this call made. With
``--export-only`` they stop the export: one line, exit 143 / 130, the export folder as it was, no temporary folder.
"""

from __future__ import annotations

from eagle3.cli import ArgumentParser, positive_int, refuse_torchrun, resume_on_interrupt, run_main
from eagle3.config import add_config_args, load_config
from eagle3.engines import ENGINES


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint"
    )
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        help="cap on the optimizer steps of train.epochs (overrides train.max_steps); it cannot go past "
        "them: raise train.epochs for a longer run",
    )
    p.add_argument(
        "--stop-at",
        type=positive_int,
        default=None,
        metavar="STEP",
        help="end the run at this optimizer step, before the schedule's last: the lr follows the whole "
        "schedule up to it, then final validation, export and report as for a finished run (reproduces "
        "a run stopped early on a longer schedule; --resume continues it)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="no training: export the trained weights (the newest checkpoint's; with train.select_best: "
        "sim_accept the best validation's, best_drafter.pt), e.g. for the other engine with --engine",
    )
    p.add_argument("--engine", choices=ENGINES, help="override export.engine")
    a = p.parse_args(argv)
    if a.export_only:  # no training: the training flags would be ignored silently
        given = [
            f
            for f, v in (
                ("--resume", a.resume),
                ("--max-steps", a.max_steps),
                ("--stop-at", a.stop_at),
            )
            if v
        ]
        if given:
            p.error(
                f"--export-only exports the newest checkpoint without training; it cannot be combined with "
                f"{', '.join(given)}"
            )
        refuse_torchrun(
            "04_train.py --export-only", "it writes one export folder; every rank would write it"
        )
    cfg = load_config(a.config, a.overrides)
    if a.engine:
        cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"engine": a.engine})})
    from eagle3.stages.export import check_export_destination

    # before training (not after it) or the export
    check_export_destination(cfg.export_dir, cfg.export.engine, cfg.output_field("export"))
    if a.export_only:
        from eagle3.stages.export import export_from_checkpoint

        with resume_on_interrupt(
            lambda: export_interrupt_hint(cfg)
        ):  # SIGTERM / Ctrl-C: one line, exit 143 / 130
            out = export_from_checkpoint(cfg)
        print(f"exported: {out}")
        return 0
    from eagle3.stages.export import export_for_run, load_init_drafter
    from eagle3.train.trainer import run

    res = run(
        cfg,
        resume=a.resume,
        max_steps=a.max_steps,
        export=export_for_run,
        init=load_init_drafter,
        stop_at=a.stop_at,
    )
    if res["stopped"]:
        return interrupted_exit(res)
    return 0


def export_interrupt_hint(cfg) -> str:
    """What an interrupted ``--export-only`` left (the line after ``interrupted by SIGTERM:``): the export is written
    in a temporary folder beside ``export_dir`` (removed on the signal) and renamed over it only once whole."""
    return (
        f"nothing is half-written: {cfg.export_dir} is replaced only by a whole export (its temporary folder was "
        f"removed), and the checkpoints are only read; re-run the same command to export"
    )


def interrupted_exit(res: dict) -> int:
    """One stderr line for a run stopped by a signal (rank 0 only: under torchrun every rank printed it, one copy a
    rank); returns ``128 + signal`` (SIGTERM when another rank received it: every rank of a DDP run exits with the
    same code)."""
    import os
    import signal
    import sys

    signum = res.get("signal") or signal.SIGTERM
    if os.environ.get("RANK", "0") == "0":
        print(
            f"interrupted by {signal.Signals(signum).name} at step {res['step']}/{res['total_steps']}: checkpoint "
            f"{res['checkpoint']}, nothing exported; continue with the same command plus --resume",
            file=sys.stderr,
        )
    return 128 + int(signum)


if __name__ == "__main__":
    run_main(main)
