"""Collect issue 9's headline GPU-speed figures into one JSON + Markdown table.

Reads the JSON files the per-stage bench scripts write (``--json``) from a results folder and writes
``gpu_speed.json`` / ``gpu_speed.md`` with one entry per headline key, each carrying its value, the
baseline it is a ratio against, the source file and the command that produced it. A figure whose
source file is absent is written as ``null`` with ``"measured": false``: the table never invents a
number, so a partial GPU session shows exactly what was and was not measured.

| key | source file (``--json`` of) | value |
|---|---|---|
| ``tokenize_conv_per_s`` | ``tokenize.json`` (bench/tokenize_throughput.py) | conversations/s at N workers |
| ``capture_vs_bare_ratio`` | ``capture.json`` (bench/extract_throughput.py) | captured / bare tokens/s, same batch |
| ``small_train_tokens_per_s`` | ``small_train.json`` (bench/small_train_speed.py) | token-budget loop tokens/s |
| ``small_train_wall_vs_reference`` | ``small_train.json`` | projected issue-run wall / 320 s |
| ``bench_80x256_s`` | ``bench_speed.json`` (bench/offline_bench_speed.py) | wall s, 80 prompts x 256 tokens, 3 steps |
| ``kimi_step_ms``, ``kimi_mfu`` | ``kimi_step.json`` (bench/train_throughput.py) | ms/step and MFU of the first run |

Fallbacks where the dedicated bench did not run: ``small_train_*`` from 04's ``train_report.json``
(tokens/s of a real token-budget run; wall vs the reference projected at that rate), ``bench_80x256_s``
from 05's ``bench-steps3.json`` (the MT-bench 80 x 256, 3-step set's wall, greedy baseline included),
``capture_vs_bare_ratio`` from ``capture_disk.json`` (``bench/gpu_session.sh``'s tail: shards to the run's disk).

Several folders (newest session first): each figure comes from the first folder that measured it, so
figures not re-measured in a later session keep the earlier session's value and say which file.

    python bench/gpu_speed_summary.py RESULTS_DIR [RESULTS_DIR ...] [--out bench/results/gpu_speed.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from small_train_speed import ISSUE_REFERENCE_S, ISSUE_RUN_TOKENS  # noqa: E402  (issue 9's run: 6.96M tokens, 320 s)

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import write_json_and_markdown  # noqa: E402

CFG = "configs/smollm2-135m-full.yaml --set verifier.path=$EAGLE3_GGUF_DIR"


def _first(d: dict, *keys: str) -> Any:
    """The first of ``keys`` present in ``d`` (None if none)."""
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def _bench_wall(d: dict) -> Optional[float]:
    return _first(d, "bench_80x256_s", "headline_wall_s", "wall_s")


def _kimi(d: dict, key: str) -> Optional[float]:
    runs = d.get("runs") or []
    if not runs:
        return None
    r = runs[0]
    if key == "step_ms" and r.get("step_ms") is None and r.get("tokens_per_s"):
        return 1000.0 * r["seq"] / r["tokens_per_s"]  # batch 1: ms per step = seq tokens / rate
    return r.get(key)


def _bench_set(
    d: dict, dataset: str = "mtbench", n: int = 80, new: int = 256, steps: int = 3
) -> Optional[float]:
    """Wall seconds of one dataset in a 05 ``bench.json`` when it is the ``n x new``, ``steps``-step set."""
    if d.get("max_new_tokens") != new or d.get("steps") != steps:
        return None
    for ds in d.get("datasets") or []:
        if ds.get("dataset") == dataset and ds.get("num_prompts") == n:
            return ds.get("wall_seconds")
    return None


HEADLINE_BATCH_TOKENS = (
    16384  # the training figures' batches (their command sets train.batch_tokens=16384)
)


def _train_tps(d: dict) -> Optional[float]:
    """04's tokens/s from a ``train_report.json`` trained with the headline's 16,384-token batches (a report without
    ``recipe``, written before it was recorded, counts). The session's own 04 runs the config's batches, 4,096 since
    configs/smollm2-135m-full.yaml took them (lease 2026-12-05g): smaller batches, another figure, not this one."""
    recipe = d.get("recipe") if isinstance(d.get("recipe"), dict) else {}
    if recipe.get("batch_tokens", HEADLINE_BATCH_TOKENS) != HEADLINE_BATCH_TOKENS:
        return None
    return d.get("tokens_per_s")


def _train_vs_reference(d: dict) -> Optional[float]:
    t = _train_tps(d)
    return None if not t else ISSUE_RUN_TOKENS / t / ISSUE_REFERENCE_S


# key -> (file, extractor, baseline, command); later entries of FALLBACKS are tried when the first yields nothing
FIGURES: dict[str, tuple[str, Callable[[dict], Any], str, str]] = {
    "tokenize_conv_per_s": (
        "tokenize.json",
        lambda d: _first(d, "tokenize_conv_per_s", "conv_per_s"),
        "1 worker in the same run",
        f"python3 bench/tokenize_throughput.py --config {CFG} --json tokenize.json",
    ),
    "capture_vs_bare_ratio": (
        "capture.json",
        lambda d: _first(d, "capture_vs_bare_ratio", "ratio"),
        "bare verifier forward at the same batch (64 x 2048)",
        f"python3 bench/extract_throughput.py --config {CFG} --device cuda --batch 64 --seq 2048 --json capture.json",
    ),
    "small_train_tokens_per_s": (
        "small_train.json",
        lambda d: d.get("small_train_tokens_per_s"),
        "legacy batch-8 loop in the same run",
        "python3 bench/small_train_speed.py --json small_train.json",
    ),
    "small_train_wall_vs_reference": (
        "small_train.json",
        lambda d: d.get("small_train_wall_vs_reference"),
        "published trainer, 320 s for the issue's 6.96M-token run",
        "python3 bench/small_train_speed.py --json small_train.json",
    ),
    "bench_80x256_s": (
        "bench_speed.json",
        _bench_wall,
        "batched greedy in the same run",
        f"python3 bench/offline_bench_speed.py --config {CFG} --batch-sizes 1 8 32 --json bench_speed.json",
    ),
    "kimi_step_ms": (
        "kimi_step.json",
        lambda d: _kimi(d, "step_ms"),
        "matmul ceiling measured in the same run",
        "python3 bench/train_throughput.py --kv-heads 64 --compile --no-checkpoint-logits --json kimi_step.json",
    ),
    "kimi_mfu": (
        "kimi_step.json",
        lambda d: _kimi(d, "mfu"),
        "matmul ceiling measured in the same run",
        "python3 bench/train_throughput.py --kv-heads 64 --compile --no-checkpoint-logits --json kimi_step.json",
    ),
}


FALLBACKS: dict[str, list[tuple[str, Callable[[dict], Any], str, str]]] = {
    "small_train_tokens_per_s": [
        (
            "train_report.json",
            _train_tps,
            "04 on real shards (train.batch_tokens), all steps",
            f"python3 04_train.py --config {CFG} --set train.batch_tokens=16384",
        )
    ],
    "small_train_wall_vs_reference": [
        (
            "train_report.json",
            _train_vs_reference,
            "published trainer, 320 s for the issue's 6.96M-token run (projected at the measured tokens/s)",
            f"python3 04_train.py --config {CFG} --set train.batch_tokens=16384",
        )
    ],
    "capture_vs_bare_ratio": [
        (
            "capture_shm.json",
            lambda d: d.get("capture_vs_bare_ratio"),
            "bare verifier forward at the same batch (64 x 2048, 12 batches); shards to RAM (/dev/shm), "
            "so the storage does not bind (the run's disk: capture_disk.json beside it)",
            f"python3 bench/extract_throughput.py --config {CFG} --device cuda --batch 64 --seq 2048 "
            "--batches 12 --repeats 3 --no-serial --out-dir /dev/shm --json capture_shm.json",
        ),
        (
            "capture_disk.json",
            lambda d: d.get("capture_vs_bare_ratio"),
            "bare verifier forward at the same batch (64 x 2048); shards to the run's disk",
            f"python3 bench/extract_throughput.py --config {CFG} --device cuda --batch 64 --seq 2048 "
            "--no-serial --out-dir RUN_DIR --json capture_disk.json",
        ),
    ],
    "bench_80x256_s": [
        (
            "bench-steps3.json",
            _bench_set,
            "batched greedy in the same run (inside the wall)",
            f"python3 05_benchmark.py --config {CFG} --set benchmark.max_new_tokens=256 --steps 3",
        )
    ],
}


def collect(results: Path | list[Path]) -> dict:
    """``{key: {value, measured, baseline, source, command}}`` for every headline key; ``results``: one
    folder or several (the first folder, then its fallbacks, then the next folder...).

    Raises:
        UserError: a source file exists but is not valid JSON.
    """
    dirs = [results] if isinstance(results, Path) else list(results)
    results = dirs[0]
    out = {}
    for key, first in FIGURES.items():
        for folder, (name, get, baseline, cmd) in [
            (d, c) for d in dirs for c in [first, *FALLBACKS.get(key, [])]
        ]:
            f = folder / name
            value = None
            if f.is_file():
                try:
                    value = get(json.loads(f.read_text()))
                except json.JSONDecodeError as e:
                    raise UserError(f"{f}: line {e.lineno}: not valid JSON ({e.msg})") from None
            out[key] = {
                "value": value,
                "measured": value is not None,
                "baseline": baseline,
                "source": str(f) if f.is_file() else None,
                "command": cmd,
            }
            if value is not None:
                break
        if out[key]["value"] is None:  # unmeasured: name the primary source and command
            name, _, baseline, cmd = first
            out[key].update(
                baseline=baseline,
                command=cmd,
                source=str(results / name) if (results / name).is_file() else None,
            )
    return out


def markdown(figs: dict) -> str:
    """The figures as a Markdown table (unmeasured ones say so)."""
    lines = ["| figure | value | baseline | command |", "|---|---:|---|---|"]
    for k, v in figs.items():
        val = (
            "not measured"
            if v["value"] is None
            else (f"{v['value']:.4g}" if isinstance(v["value"], float) else v["value"])
        )
        lines.append(f"| `{k}` | {val} | {v['baseline']} | `{v['command']}` |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "results",
        type=Path,
        nargs="+",
        help="folders holding the bench scripts' JSON files (newest first)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_speed.json"))
    a = p.parse_args(argv)
    for r in a.results:
        if not r.is_dir():
            raise UserError(f"{r}: not a folder")
    figs = collect(a.results)
    write_json_and_markdown(a.out, figs, markdown(figs))
    print(markdown(figs), end="")
    return 0


if __name__ == "__main__":
    run_main(main)
