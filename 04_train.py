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

from eagle3.cli import ArgumentParser, positive_int, refuse_torchrun, run_main
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
    load_config(a.config, a.overrides)  # a config error stays instant: before torch and the stage
    from eagle3.stages import train  # the stage reads the config again

    return train.main(
        a.config,
        a.overrides,
        resume=a.resume,
        max_steps=a.max_steps,
        stop_at=a.stop_at,
        export_only=a.export_only,
        engine=a.engine,
    )


if __name__ == "__main__":
    run_main(main)
