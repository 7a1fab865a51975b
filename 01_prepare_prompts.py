#!/usr/bin/env python
"""Stage 01: read prompt/conversation data, normalise, dedupe, sample, optionally regenerate the
answers with the verifier, and write ``{output_root}/prompts.jsonl`` + ``prompts_report.json``.

Example::

    python 01_prepare_prompts.py --config configs/smollm2-135m.yaml --source ../shared/data/train/alpaca_subset_1000.json

Self-instruct mode (``--self-instruct N --out FILE``): sample N user prompts from the verifier itself (its chat
template up to a user message, continued; :mod:`eagle3.regen.self_instruct`) into FILE, a messages-JSONL to list in
``prompts.source``; nothing else runs::

    python 01_prepare_prompts.py --config configs/smollm2-135m-127k.yaml --self-instruct 30000 \
        --out data/self_instruct.jsonl --exclude ../shared/data/eval/mt_bench_question.jsonl

``prompts.self_instruct: {num: N, exclude: [...]}`` in the config does both in one normal run: the file is
``{output_root}/self_instruct.jsonl``, its prompts come on top of the ``sample_size`` sampled sources.
"""

from __future__ import annotations

import argparse

from eagle3.cli import ArgumentParser, positive_float, positive_int, resume_on_interrupt, run_main
from eagle3.config import add_config_args, load_config
from eagle3.data.readers import FORMATS
from eagle3.settings.prompts import SELF_INSTRUCT_BATCH


def main(argv=None):
    p = ArgumentParser(description="Stage 01: prepare the prompts/conversations file.")
    add_config_args(p)
    p.add_argument(
        "--source",
        help="override prompts.source: 'humaneval', a .json/.jsonl(.gz) file, or 'hf:<name>'",
    )
    p.add_argument("--format", dest="fmt", choices=FORMATS, help="override prompts.format")
    p.add_argument(
        "--regenerate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override prompts.regenerate (answers from the verifier itself: in-process greedy, or "
        "through serving endpoints with prompts.regenerate_via: sglang|openai)",
    )
    p.add_argument(
        "--limit", type=positive_int, help="keep only the first N conversations after sampling"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="recompute even if the outputs are up to date (also discards the regeneration's resume logs, "
        "in-process or through endpoints: the answers an interrupted run kept are redone)",
    )
    g = p.add_argument_group(
        "self-instruct mode (sample user prompts from the verifier; nothing else runs)"
    )
    g.add_argument(
        "--self-instruct",
        type=positive_int,
        metavar="N",
        help="sample N user prompts from the verifier",
    )
    g.add_argument("--out", help="the messages-JSONL they go to (list it in prompts.source)")
    g.add_argument(
        "--self-instruct-temperature", type=positive_float, default=1.0, help="sampling temperature"
    )
    g.add_argument(
        "--self-instruct-top-p", type=positive_float, default=1.0, help="nucleus sampling share"
    )
    g.add_argument(
        "--self-instruct-max-tokens",
        type=positive_int,
        default=128,
        help="token budget of a query; one not ended by then is dropped",
    )
    g.add_argument(
        "--self-instruct-min-chars", type=int, default=16, help="shortest query kept (characters)"
    )
    g.add_argument(
        "--self-instruct-batch-size",
        type=positive_int,
        default=SELF_INSTRUCT_BATCH,
        help="queries per generate call (seeded per batch: another value samples another file)",
    )
    g.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="FILE",
        help="leave out prompts equal to a first user message of FILE (e.g. an evaluation set; repeatable)",
    )
    a = p.parse_args(argv)
    _check_mode(p, a)
    cfg = load_config(a.config, a.overrides)
    if a.self_instruct is not None:
        from eagle3.stages import self_instruct

        with resume_on_interrupt(
            lambda: f"nothing written ({a.out} is written at the end); re-run the same command"
        ):
            return self_instruct.run(
                cfg,
                a.self_instruct,
                a.out,
                a.self_instruct_temperature,
                a.self_instruct_top_p,
                a.self_instruct_max_tokens,
                a.self_instruct_min_chars,
                a.exclude,
                force=a.force,
                batch_size=a.self_instruct_batch_size,
            )
    import eagle3.stages.prepare_prompts as stage

    with resume_on_interrupt(
        lambda: stage.interrupt_hint(cfg, a.regenerate)
    ):  # SIGTERM / Ctrl-C: one line, exit 143 / 130
        return stage.run(
            cfg, source=a.source, fmt=a.fmt, regenerate=a.regenerate, limit=a.limit, force=a.force
        )


# flags of one mode that the other would silently ignore (a user passing --exclude without --self-instruct would
# believe the evaluation set left out): (dest, flag)
_SELF_INSTRUCT_ONLY = (
    ("exclude", "--exclude"),
    ("self_instruct_temperature", "--self-instruct-temperature"),
    ("self_instruct_top_p", "--self-instruct-top-p"),
    ("self_instruct_max_tokens", "--self-instruct-max-tokens"),
    ("self_instruct_min_chars", "--self-instruct-min-chars"),
    ("self_instruct_batch_size", "--self-instruct-batch-size"),
)
_PREPARE_ONLY = (
    ("source", "--source"),
    ("fmt", "--format"),
    ("regenerate", "--[no-]regenerate"),
    ("limit", "--limit"),
)


def _check_mode(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """One-line usage error (exit 2) for ``--self-instruct`` without ``--out`` (or the reverse), and for a flag of
    the other mode given a value other than its default: the self-instruct flags without ``--self-instruct``, 01's
    ``--source/--format/--[no-]regenerate/--limit`` with it (self-instruct runs nothing else)."""
    if (a.self_instruct is None) != (a.out is None):
        p.error("--self-instruct N and --out FILE go together")
    if a.self_instruct is not None:
        wrong = [f for d, f in _PREPARE_ONLY if getattr(a, d) is not None]
        if wrong:
            p.error(
                f"{wrong[0]} has no effect with --self-instruct (it only samples user prompts into --out); run 01 "
                f"without --self-instruct for that"
            )
    else:
        wrong = [f for d, f in _SELF_INSTRUCT_ONLY if getattr(a, d) != p.get_default(d)]
        if wrong:
            p.error(f"{wrong[0]} applies only with --self-instruct N --out FILE")


if __name__ == "__main__":
    run_main(main)
