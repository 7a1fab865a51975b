"""Benchmark: stage 03 with a full shard validation vs. reusing the validation record, on one shard set.

Runs ``eagle3.stages.prepare_data.run`` twice on the config's shards, in the same process: first with
``revalidate=True`` (hash every shard against manifest.jsonl + load it: what every 03 did before the
validation record), then plainly (the record just written matches: nothing hashed or loaded). Each
writes into its own temporary data folder, so the run's own ``data/`` is left alone; the full pass
does (re)write ``validation_record.json`` in the shards folder, as 03 would. Also times the
fingerprint alone (the cost a reused run still pays: a stat per shard + sha256 of the manifest and
data_config). Checks that both passes wrote byte-identical token_freq.pt / vocab_map.pt / split.json.

    python bench/prepare_reuse.py --config configs/smollm2-135m.yaml [--set ...] [--json out.json]

Prints a Markdown table and the JSON (``full_s``, ``reused_s``, ``speedup``, ``fingerprint_s``,
``outputs_identical``, ``shard_bytes``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.data.validation_record import shard_set_fingerprint  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402
from eagle3.shards.format import DATA_CONFIG, list_samples  # noqa: E402
from eagle3.shards.manifest import MANIFEST  # noqa: E402
from eagle3.stages.prepare_data import run  # noqa: E402

COMPARED = ("token_freq.pt", "vocab_map.pt", "split.json")


def _timed_run(cfg, data_dir: Path, revalidate: bool) -> tuple[float, dict]:
    c = cfg.model_copy(update={"data": cfg.data.model_copy(update={"output_dir": str(data_dir)})})
    t0 = time.perf_counter()
    rep = run(c, plot=False, revalidate=revalidate)
    return time.perf_counter() - t0, rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(p)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    shards = cfg.shards_dir
    paths = list_samples(shards)
    with tempfile.TemporaryDirectory(prefix="prepare_reuse-") as tmp:
        full_s, rep_full = _timed_run(cfg, Path(tmp) / "full", revalidate=True)
        reused_s, rep_reused = _timed_run(cfg, Path(tmp) / "reused", revalidate=False)
        identical = all(
            (Path(tmp) / "full" / n).read_bytes() == (Path(tmp) / "reused" / n).read_bytes()
            for n in COMPARED
        )
    t0 = time.perf_counter()
    shard_set_fingerprint(shards, paths, shards / MANIFEST, shards / DATA_CONFIG)
    fp_s = time.perf_counter() - t0
    res = {
        "shards_dir": str(shards),
        "shards": len(paths),
        "shard_bytes": sum(p.stat().st_size for _, p in paths),
        "num_tokens": rep_full["num_tokens"],
        "full_s": round(full_s, 3),
        "reused_s": round(reused_s, 3),
        "speedup": round(full_s / max(reused_s, 1e-9), 1),
        "fingerprint_s": round(fp_s, 3),
        "validation": [rep_full["validation"], rep_reused["validation"]],
        "outputs_identical": identical,
    }
    print("| shards | GB | 03 full s | 03 reused s | speedup | fingerprint s | outputs identical |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {res['shards']} | {res['shard_bytes'] / 1e9:.2f} | {res['full_s']} | {res['reused_s']} | "
        f"{res['speedup']}x | {res['fingerprint_s']} | {identical} |"
    )
    print(json.dumps(res))
    if a.json:
        atomic_write_json(a.json, res)
    return 0 if identical and res["validation"] == ["full", "reused"] else 1


if __name__ == "__main__":
    sys.exit(main())
