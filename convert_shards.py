#!/usr/bin/env python
"""Convert a stage-02 shard set between bf16 (speculators-v1) and fp8 (scaled e4m3) storage.

    # explicit folders
    python convert_shards.py --src out/shards --dst out/shards-fp8 --to float8_e4m3fn
    # from a run config: source = its shards folder, target storage = its extract.storage_dtype/fp8_*
    python convert_shards.py --config configs/smollm2-135m.yaml --set extract.storage_dtype=float8_e4m3fn \\
        --dst out/shards-fp8
    # then train on it: add --set extract.output_dir=out/shards-fp8 to 03_prepare_data.py and 04_train.py

Atomic and resumable (re-run the same command after a kill or a full disk); see eagle3/shards/convert.py.
"""

from __future__ import annotations

import argparse
import json

from eagle3.cli import ArgumentParser, positive_int, run_main
from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.io import atomic_write_text
from eagle3.shards.convert import convert
from eagle3.shards.fp8 import Storage


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--config", help="run YAML: default source folder and target storage")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (repeatable), e.g. extract.storage_dtype=float8_e4m3fn",
    )
    p.add_argument("--src", help="source shard folder (default: the config's shards folder)")
    p.add_argument(
        "--dst", required=True, help="destination folder (created; must differ from --src)"
    )
    p.add_argument(
        "--to",
        choices=["bfloat16", "float8_e4m3fn"],
        help="target storage dtype (default: the config's extract.storage_dtype)",
    )
    p.add_argument(
        "--scale",
        choices=["per_token", "per_block"],
        help="fp8 scale scheme (default: config or per_token)",
    )
    p.add_argument(
        "--block-size",
        type=positive_int,
        help="fp8 per_block: columns per scale (default: config or 128)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="shards converted concurrently (default min(8, cores))",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete a different earlier conversion in --dst"
    )
    p.add_argument("--json", help="also write the summary as JSON here")
    return p


def _source_and_storage(a: argparse.Namespace) -> tuple[str, Storage]:
    """The source folder and target storage: command-line values, else the config's, else defaults.

    Raises:
        UserError: ``--set`` without ``--config``; ``--src`` / ``--to`` missing without ``--config``;
            a ``--block-size`` that the scheme refuses.
    """
    src, to, scale, block = a.src, a.to, a.scale, a.block_size
    if a.config:
        ex = (cfg := load_config(a.config, a.overrides)).extract
        src, to = src or str(cfg.shards_dir), to or ex.storage_dtype
        scale = scale or ex.fp8_scale
        block = block if block is not None else ex.fp8_block_size
    elif a.overrides:
        raise UserError("--set needs --config")
    if src is None:
        raise UserError("--src: required without --config")
    if to is None:
        raise UserError("--to: required without --config")
    scale = scale or "per_token"
    block = block if block is not None else 128
    try:
        storage = (
            Storage()
            if to == "bfloat16"
            else Storage(to, scale, block if scale == "per_block" else None)
        )
    except ValueError as e:
        raise UserError(f"--block-size: {e}") from e
    return src, storage


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    src, storage = _source_and_storage(a)
    summary = convert(src, a.dst, storage, overwrite=a.overwrite, workers=a.workers)
    text = json.dumps(summary, indent=2)
    print(text)
    if a.json:
        atomic_write_text(a.json, text + "\n")
    return 0


if __name__ == "__main__":
    run_main(main)
