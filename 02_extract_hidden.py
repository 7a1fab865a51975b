#!/usr/bin/env python
"""Stage 02: run the verifier over the prompts and write EAGLE-3 hidden-state shards (resumable).

    python 02_extract_hidden.py --config configs/smollm2-135m.yaml
    python 02_extract_hidden.py --config configs/kimi-k2.5.yaml --backend sglang --server http://host:30000
    python 02_extract_hidden.py --config configs/kimi-k2.5.yaml --server http://node1:30000 http://node2:30000 \
        --capture-dir /shared/capture/node1 /shared/capture/node2   # several capture nodes
    torchrun --nproc_per_node 8 02_extract_hidden.py --config configs/smollm2-135m.yaml   # hf: one replica per GPU

Re-running the same command after a crash resumes (finished shards are kept, none is rewritten).
A run whose config/prompts/verifier changed is refused unless --overwrite (deletes the old shards, once the
new run's disk plan fits counting the space they free).
"""

from __future__ import annotations

from eagle3.cli import ArgumentParser, http_url, positive_int, run_main
from eagle3.config import add_config_args, load_config


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument(
        "--backend", choices=["hf", "sglang"], default=None, help="overrides extract.backend"
    )
    p.add_argument(
        "--server",
        nargs="+",
        type=http_url,
        default=None,
        metavar="URL",
        help="SGLang server URL(s), one per node (overrides extract.sglang_url)",
    )
    p.add_argument(
        "--capture-dir",
        nargs="+",
        default=None,
        metavar="DIR",
        help="each server's capture folder as this host sees it, in --server order (overrides extract.capture_dir)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete existing shards in the output folder and start over",
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="only the first N prompts"
    )
    p.add_argument(
        "--ignore-disk-check",
        action="store_true",
        help="capture even when the disk plan says the shards will not fit (extract.disk_margin)",
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    if a.backend:
        cfg.extract.backend = a.backend
    if a.server:
        cfg.extract.sglang_url = a.server[0] if len(a.server) == 1 else a.server
    if a.capture_dir:
        cfg.extract.capture_dir = a.capture_dir[0] if len(a.capture_dir) == 1 else a.capture_dir
    from eagle3.stages import (
        extract,  # torch and the stage: after the config is read (its errors stay instant)
    )

    return extract.main(
        cfg, overwrite=a.overwrite, limit=a.limit, ignore_disk_check=a.ignore_disk_check
    )


if __name__ == "__main__":
    run_main(main)
