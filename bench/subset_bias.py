"""How far a benchmark subset's tau is from its whole set's, and what a batch-1 speedup measured on a subset would be
on the whole set (a projection, not a measurement).

Reads 05's per-prompt files (``per_prompt_steps3.json``: ``{"per_prompt": {set: {id: [emitted tokens, verify
steps]}}}``, prompts in set order) and, optionally, batch-1 speed JSONs of ``bench/offline_bench_speed.py``. For every
run and set: tau (emitted / verify steps, 05's definition) of the whole set, of its first N prompts and of N spread
over it (:func:`eagle3.data.eval_prompts.pick_prompts`, the code the benchmarks pick with).

A speed JSON (``--speed NAME=PATH``, NAME one of the ``--run`` names) names its set, prompt count and pick (``first``
for files from before the pick was recorded). Its projection assumes the round's cost in greedy steps and the ratio of
its dtype's tau to 05's fp32 tau stay as measured on the subset, so the speedup scales with tau:
``projected = measured speedup x tau(whole set) / tau(the same subset)``, both taus from the same 05 run.

    python bench/subset_bias.py --run "wide=bench/results/h200-20261204d/per_prompt_steps3.json" \\
        --speed "wide=bench/results/h200-20261204d/batch1_speed_mtbench.json" --num 8 16 --out bench/results/subset_bias.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.data.eval_prompts import pick_prompts  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text, read_json  # noqa: E402


def tau(rows: list) -> float:
    """tau of per-prompt ``[emitted, verify steps]`` rows: total emitted / total verify steps."""
    return sum(r[0] for r in rows) / sum(r[1] for r in rows)


def _spec(spec: str, flag: str) -> tuple[str, Path]:
    if "=" not in spec:
        raise UserError(f"{flag} {spec!r}: expected NAME=PATH")
    name, p = spec.split("=", 1)
    return name, Path(p)


def subset_taus(per_prompt: dict, nums: list[int]) -> dict:
    """``{set: {"all": tau, "n": prompts, "first_N": tau, "spread_N": tau, ...}}`` of one run's per-prompt file."""
    out = {}
    for name, by_id in per_prompt["per_prompt"].items():
        rows = list(by_id.values())
        out[name] = {"n": len(rows), "all": round(tau(rows), 4)}
        for n in nums:
            for pick in ("first", "spread"):
                out[name][f"{pick}_{n}"] = round(tau(pick_prompts(rows, n, pick)), 4)
    return out


def projection(speed: dict, per_prompt: dict) -> dict:
    """The whole-set speedup a batch-1 speed JSON projects to (see the module docstring); keys ``dataset``,
    ``num_prompts``, ``prompt_pick``, ``measured_speedup``, ``subset_tau_fp32``, ``set_tau_fp32``, ``projected_speedup``.

    Raises:
        UserError: the speed JSON's set is not in the per-prompt file, or it has no successful batch-1 row.
    """
    name, pick = speed.get("dataset"), speed.get("prompt_pick", "first")
    if name not in per_prompt["per_prompt"]:
        raise UserError(
            f"speed JSON of set {name!r}: the per-prompt file has only {sorted(per_prompt['per_prompt'])}"
        )
    row = next(
        (r for r in speed.get("rows", []) if r.get("batch_size") == 1 and "error" not in r), None
    )
    if row is None:
        raise UserError(f"speed JSON of set {name!r}: no successful batch-1 row")
    rows = list(per_prompt["per_prompt"][name].values())
    sub, whole = tau(pick_prompts(rows, row["num_prompts"], pick)), tau(rows)
    return {
        "dataset": name,
        "num_prompts": row["num_prompts"],
        "prompt_pick": pick,
        "decoder": row.get("decoder"),
        "measured_speedup": round(row["speedup"], 4),
        "measured_tau": round(row["tau"], 4),
        "subset_tau_fp32": round(sub, 4),
        "set_tau_fp32": round(whole, 4),
        "projected_speedup": round(row["speedup"] * whole / sub, 4),
    }


def markdown(res: dict) -> str:
    nums = res["nums"]
    head = " | ".join(f"first {n} | spread {n}" for n in nums)
    lines = [
        f"| run | set | prompts | whole set | {head} |",
        "|---|---|---:|---:|" + "---:|" * (2 * len(nums)),
    ]
    for run, sets in res["taus"].items():
        for name, t in sets.items():
            cells = " | ".join(f"{t[f'first_{n}']:.2f} | {t[f'spread_{n}']:.2f}" for n in nums)
            lines.append(f"| {run} | {name} | {t['n']} | {t['all']:.2f} | {cells} |")
    if res["projections"]:
        lines += [
            "",
            "Batch-1 speedup measured on a subset, projected to the whole set (tau ratio, not a measurement):",
            "",
            "| run | set | subset | measured speedup (tau) | subset tau, 05 fp32 | set tau, 05 fp32 | projected |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for run, p in res["projections"]:
            lines.append(
                f"| {run} | {p['dataset']} | {p['prompt_pick']} {p['num_prompts']} | {p['measured_speedup']:.2f}x "
                f"({p['measured_tau']:.2f}) | {p['subset_tau_fp32']:.2f} | {p['set_tau_fp32']:.2f} | "
                f"{p['projected_speedup']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--run", action="append", required=True, help="NAME=per_prompt_steps3.json (repeatable)"
    )
    p.add_argument(
        "--speed",
        action="append",
        default=[],
        help="NAME=batch-1 speed JSON of run NAME (repeatable)",
    )
    p.add_argument(
        "--num", type=int, nargs="+", default=[8, 16], help="subset sizes (default 8 16)"
    )
    p.add_argument("--out", help="write JSON here and the Markdown table beside it (.md)")
    a = p.parse_args(argv)
    if min(a.num) < 1:
        p.error("--num values must be >= 1")
    runs = dict(_spec(s, "--run") for s in a.run)
    pp = {name: read_json(path) for name, path in runs.items()}
    res = {
        "nums": a.num,
        "taus": {name: subset_taus(d, a.num) for name, d in pp.items()},
        "projections": [],
    }
    for s in a.speed:
        name, path = _spec(s, "--speed")
        if name not in pp:
            raise UserError(f"--speed {s!r}: no --run named {name!r}")
        res["projections"].append([name, projection(read_json(path), pp[name])])
    md = markdown(res)
    print(md)
    if a.out:
        atomic_write_json(a.out, res)
        atomic_write_text(Path(a.out).with_suffix(".md"), md)
    return 0


if __name__ == "__main__":
    run_main(main)
