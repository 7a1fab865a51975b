#!/usr/bin/env python
"""Stage 01: read prompt/conversation data, normalise, dedupe, sample, optionally regenerate the
answers with the verifier, and write ``{output_root}/prompts.jsonl`` + ``prompts_report.json``.

Example::

    python 01_prepare_prompts.py --config configs/smollm2-135m.yaml --source ../shared/data/train/alpaca_subset_1000.json
"""

from __future__ import annotations

import argparse

from eagle3.cli import ArgumentParser, positive_int, resume_on_interrupt, run_main
from eagle3.config import add_config_args, load_config
from eagle3.prompts.readers import FORMATS


def main(argv=None):
    p = ArgumentParser(description="Stage 01: prepare the prompts/conversations file.")
    add_config_args(p)
    p.add_argument("--source", help="override prompts.source: 'humaneval', a .json/.jsonl(.gz) file, or 'hf:<name>'")
    p.add_argument("--format", dest="fmt", choices=FORMATS, help="override prompts.format")
    p.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=None,
                   help="override prompts.regenerate (answers from the verifier itself: in-process greedy, or "
                        "through serving endpoints with prompts.regenerate_via: sglang|openai)")
    p.add_argument("--limit", type=positive_int, help="keep only the first N conversations after sampling")
    p.add_argument("--force", action="store_true",
                   help="recompute even if the outputs are up to date (also discards a server regeneration's resume log)")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    import eagle3.prompts.prepare_prompts as stage

    with resume_on_interrupt(lambda: stage.interrupt_hint(cfg, a.regenerate)):  # SIGTERM / Ctrl-C: one line, exit 143 / 130
        return stage.run(cfg, source=a.source, fmt=a.fmt, regenerate=a.regenerate, limit=a.limit, force=a.force)


if __name__ == "__main__":
    run_main(main)
