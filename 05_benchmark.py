#!/usr/bin/env python
"""Stage 05: benchmark an EAGLE-3 drafter.

Offline (default): batched greedy vs batched chain speculative decoding with the transformers
verifier (--batch-size prompts at a time), lossless check of every emitted token, acceptance length
tau, per-position acceptance, tokens/s, speedup and the drafter's share of the step time ->
{bench_dir}/bench.json, bench.md, acceptance.png.

Each difference from greedy is listed with its logit gap; gaps up to --tie-tolerance are near-ties
(counted). On CPU the verifier runs in float32 and a difference beyond the tolerance fails the run
(exit 2). On GPU it runs in verifier.dtype; bf16 rounding can flip a near-tie argmax, so differences
are listed in bench.json/bench.md instead (use --set verifier.dtype=float32 for a strict check).

Server mode (--server URL [URL2], or benchmark.server_urls in the config): benchmark a running SGLang server
started with --speculative-algorithm EAGLE3, or a vLLM server with --speculative-config '{"method": "eagle3", ...}'
(told apart by /v1/models; tau from its /metrics counters), URL2 = same verifier without speculation, for the speedup ->
{bench_dir}/server_bench.json, server_bench.md, server_acceptance.png ({bench_dir}/server-<set>/ per set when
several are given); the sets are --datasets, else the config's benchmark.datasets when it sets them, else mtbench.
Each report written is printed as a `report: PATH` line.
SIGTERM / Ctrl-C end it with one line `interrupted by SIGTERM|SIGINT: ...` and exit 143 / 130.
"""

from __future__ import annotations

import argparse

from eagle3.cli import (
    ArgumentParser,
    http_url,
    positive_float,
    positive_int,
    refuse_torchrun,
    resume_on_interrupt,
    run_main,
)
from eagle3.config import add_config_args, load_config


def main(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument(
        "--drafter",
        help="exported drafter folder (default: export.output_dir, else "
        "{output_root}/drafter-{export.engine})",
    )
    p.add_argument(
        "--datasets",
        nargs="+",
        help="mtbench, humaneval, gsm8k or JSONL prompt files (default: benchmark.datasets; in server mode mtbench when the config sets none)",
    )
    p.add_argument(
        "--steps", type=positive_int, help="chain draft length k (default: benchmark.steps)"
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        help="N prompts of each dataset, picked by benchmark.prompt_pick (default: benchmark.num_prompts)",
    )
    p.add_argument("--max-new-tokens", type=positive_int, help="default: benchmark.max_new_tokens")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        help="prompts decoded together (default: benchmark.batch_size)",
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        metavar="LOGITS",
        help="near-tie tolerance of the lossless check in logits (default: benchmark.tie_tolerance)",
    )
    p.add_argument(
        "--serve-aux-layers",
        nargs=3,
        type=int,
        metavar="I",
        help="ablation: feed the drafter these HF-index aux layers instead of the ones it was trained on",
    )
    p.add_argument(
        "--server",
        nargs="+",
        type=http_url,
        metavar="URL",
        help="SGLang (EAGLE3) or vLLM (eagle3) server URL [+ baseline server URL] (default: benchmark.server_urls; server mode when either is set)",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        help="requests in flight per server (server mode; default 1)",
    )
    p.add_argument(
        "--timeout", type=positive_float, help="seconds per HTTP request (server mode; default 600)"
    )
    a = p.parse_args(argv)
    refuse_torchrun(
        "05_benchmark.py",
        "copies would decode side by side, each measuring the others' load as its "
        "tokens/s, and write the same report",
    )
    cfg = load_config(a.config, a.overrides)
    from eagle3.stages import (
        benchmark,  # torch and the stage: after the config is read (its errors stay instant)
    )

    if a.tie_tolerance is not None and not a.tie_tolerance >= 0:
        p.error(f"argument --tie-tolerance: must be >= 0, got {a.tie_tolerance}")
    urls = (
        a.server or cfg.benchmark.server_urls
    )  # the config's servers unless --server names others
    # a flag of the other mode would be ignored without a word (an offline ablation silently run against a server)
    other = (
        [
            f
            for f, v in (
                ("--drafter", a.drafter),
                ("--steps", a.steps),
                ("--batch-size", a.batch_size),
                ("--tie-tolerance", a.tie_tolerance),
                ("--serve-aux-layers", a.serve_aux_layers),
            )
            if v is not None
        ]
        if urls
        else [
            f
            for f, v in (("--concurrency", a.concurrency), ("--timeout", a.timeout))
            if v is not None
        ]
    )
    if other:
        mode = (
            "server mode (--server or benchmark.server_urls)"
            if urls
            else "the offline benchmark (server mode needs --server or benchmark.server_urls)"
        )
        p.error(f"{', '.join(other)}: not used in {mode}")
    with resume_on_interrupt(interrupt_hint):  # SIGTERM / Ctrl-C: one line, exit 143 / 130
        if urls:
            return benchmark.run_server(
                cfg,
                urls,
                a.datasets,
                a.num_prompts,
                a.max_new_tokens,
                a.concurrency or 1,
                a.timeout or 600.0,
            )
        return benchmark.run(
            cfg,
            a.drafter,
            a.datasets,
            a.steps,
            a.num_prompts,
            a.max_new_tokens,
            a.serve_aux_layers,
            a.batch_size,
            a.tie_tolerance,
        )


def interrupt_hint() -> str:
    """What an interrupted 05 left: each report file is written whole or not at all (atomic writes; server mode
    writes a set's reports once that set is measured), and there is no partial state to resume from."""
    return (
        "no report is half-written (each file is written whole at the end of its measurement); re-run the same "
        "command to benchmark again"
    )


if __name__ == "__main__":
    run_main(main)
