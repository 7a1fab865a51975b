#!/usr/bin/env python
"""Stage 03: validate shards, count token frequencies, build the draft vocab (d2t/t2d), split train/val.

    python 03_prepare_data.py --config configs/smollm2-135m.yaml

Writes {data_dir}/token_freq.pt, vocab_map.pt, split.json, data_report.json/.md, coverage.png, and a
validation record (validation_record.json in the shards folder if writable, else in data_dir) that lets a
re-run on unchanged shards skip hashing and loading them (--revalidate forces the full pass).
SIGTERM / Ctrl-C end it with one line `interrupted by SIGTERM|SIGINT: ...` (what was left, how to go on), exit 143 / 130.
"""

from __future__ import annotations

from eagle3.cli import ArgumentParser, refuse_torchrun, run_main
from eagle3.config import add_config_args, load_config
from eagle3.stages import prepare_data


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="skip coverage.png (an earlier run's is removed: it would show another draft vocab)",
    )
    p.add_argument(
        "--revalidate",
        action="store_true",
        help="hash and load every shard even when an earlier 03's validation record matches the shards "
        "(unchanged sizes/mtimes, manifest, data_config); catches bit rot after the first validation",
    )
    a = p.parse_args(argv)
    refuse_torchrun(
        "03_prepare_data.py",
        "it writes one vocab map, split and validation record for every rank of 04",
    )
    cfg = load_config(a.config, a.overrides)
    return prepare_data.main(cfg, plot=not a.no_plot, revalidate=a.revalidate)


if __name__ == "__main__":
    run_main(main)
