"""Collect a real-data drafter run into issue 10's ``quality.json``: tau per draft length and set, where it is lost.

Reads one run's reports from a folder (a run folder of ``bench/quality_session.sh pack``):

- ``bench-steps{K}.json`` (05, one per chain length K, e.g. 3 and 7): tau, per-position acceptance,
  speedup against batched greedy in the same run, drafter share of the step time;
- ``train_report.json`` (04): ``final_val`` top-1 agreement ``acc_i`` of TTT position i on held-out
  TRAINING data (the validation split), and tokens/s;
- ``data_report.json`` (03) and ``prompts_report.json`` (01): samples, tokens, loss tokens, answers;
- optional ``per_prompt_steps3.json`` (``{"per_prompt": {set: {id: [emitted, verify steps]}}}``), else
  the ``per_prompt`` rows of a full ``bench-steps3.json``: tau by prompt category, the benchmark sets as chat / code / math and
  MT-bench's own 8 categories (read from ``eval/mt_bench_question.jsonl`` in the shared data folder);
- optional ``bench_speed.json`` (``bench/offline_bench_speed.py``): EAGLE-3 vs batched greedy tokens/s per
  batch size (1 / 8 / 32 / 80), tau and the drafter's share of the step time, measured alone on the GPU.

Writes ``quality.json`` (``tau[steps][set]``, ``num_prompts``, ``loss_tokens``, ``config``, the goal and
whether it was met, per-position acceptance, the train/eval gap) and ``quality.md`` beside it, plus
``quality_positions.png``: the drafter's top-1 agreement per draft position on held-out training data
next to the conditional acceptance per position on each benchmark set (the gap between the curves is
the distribution shift between training data and benchmark prompts; their level is the drafter).

    python bench/quality_summary.py bench/results/h200-20261201 --config configs/smollm2-135m-full.yaml \\
        --overrides "train.epochs=2 train.batch_tokens=16384 benchmark.max_new_tokens=256" --out bench/results/quality.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_compare as qc  # noqa: E402

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_save_png, read_json, write_json_and_markdown  # noqa: E402

GOALS = {
    "10": {"3": {"mtbench": 2.5, "gsm8k": 3.0}, "7": {"mtbench": 3.0}},
    "23": {"3": {"mtbench": 2.8, "humaneval": 2.8, "gsm8k": 3.2}, "7": {"mtbench": 3.4}},
}
"""The goals of issue 10 (the first real-data drafter) and issue 23 ("a drafter worth serving")."""
GOAL = GOALS["10"]


def _read(path: Path, required: bool = True) -> Optional[dict]:
    """``path``'s JSON (:func:`eagle3.io.read_json`: one-line error naming the file and line), or None
    when it is absent and not ``required``."""
    return read_json(path) if required or path.is_file() else None


def collect(run: Path, config: str, overrides: str = "", goals: str = "10") -> dict:
    """The quality summary of one run folder (see the module docstring for the files read).

    Raises:
        UserError: no ``bench-steps*.json`` in ``run``, or a file that is not valid JSON.
    """
    benches = {}
    for f in sorted(run.glob("bench-steps*.json")):
        m = re.fullmatch(r"bench-steps(\d+)\.json", f.name)
        if m:
            benches[m.group(1)] = _read(f)
    if not benches:
        raise UserError(f"{run}: no bench-steps<K>.json (05's bench.json for chain length K)")
    train = _read(run / "train_report.json", required=False) or {}
    data = _read(run / "data_report.json", required=False) or {}
    prompts = _read(run / "prompts_report.json", required=False) or {}
    tau, per_pos, speed, nprompts = {}, {}, {}, {}
    for k, b in benches.items():
        tau[k], per_pos[k], speed[k] = {}, {}, {}
        for ds in b["datasets"]:
            name = ds["dataset"]
            tau[k][name] = round(ds["tau"], 4)
            nprompts[name] = ds["num_prompts"]
            per_pos[k][name] = {
                "conditional": [round(x, 4) for x in ds["conditional"]],
                "unconditional": [round(x, 4) for x in ds["unconditional"]],
            }
            speed[k][name] = {
                "batch_size": ds["batch_size"],
                "speedup": round(ds["speedup"], 4),
                "drafter_share": round(ds["drafter_share"], 4),
                "wall_s": round(ds["wall_seconds"], 2),
                "mismatches_beyond_tolerance": ds["failures"],
                "near_ties": ds["near_ties"],
            }
    goal = {
        k: {
            s: {"goal": g, "tau": tau.get(k, {}).get(s), "met": (tau.get(k, {}).get(s) or 0) >= g}
            for s, g in sets.items()
        }
        for k, sets in GOALS[goals].items()
    }
    pp = _read(run / "per_prompt_steps3.json", required=False)
    if pp is None and "3" in benches and all("per_prompt" in ds for ds in benches["3"]["datasets"]):
        pp = {
            "per_prompt": {
                ds["dataset"]: {
                    str(r["id"]): [sum(r["accept_lengths"]), len(r["accept_lengths"])]
                    for r in ds["per_prompt"]
                }
                for ds in benches["3"]["datasets"]
            }
        }
    by_category = _by_category(pp)
    bs = _read(run / "bench_speed.json", required=False)
    speed_by_batch = (
        None
        if bs is None
        else {
            "dataset": bs.get("dataset"),
            "steps": bs.get("steps"),
            "dtype": bs.get("dtype"),
            "prompt_pick": bs.get("prompt_pick", "first"),
            "prompt_ids": bs.get("prompt_ids"),  # older files: the first N
            "warnings": bs.get("warnings", []),
            "rows": [
                {
                    "batch_size": r["batch_size"],
                    "num_prompts": r["num_prompts"],
                    "greedy_tokens_per_s": round(r["greedy_tokens_per_s"], 1),
                    "eagle3_tokens_per_s": round(r["spec_tokens_per_s"], 1),
                    "speedup": round(r["speedup"], 4),
                    "tau": round(r["tau"], 4),
                    "drafter_share": round(r["drafter_share"], 4),
                }
                for r in bs["rows"]
            ],
        }
    )
    first = next(iter(benches.values()))
    regen = prompts.get("regeneration") or {}
    recipe = train.get("recipe") or {}
    # a run stopped at a lease's deadline (SIGTERM, then 04 --export-only) has no train_report; its validation curve
    # is still in 04's sim_accept.json
    sim = train.get("sim_accept") or _read(run / "sim_accept.json", required=False) or {}
    # the held-out top-1 of the weights 05 scored: the best validation's under select_best sim_accept when those are
    # not the last step's (stopped at a deadline, or a finished run whose best came earlier), else final_val's
    val_acc, weights_step = qc.scored_weights(train, sim)
    exported_step = sim.get("exported_step") if weights_step is None else weights_step
    dargs = train.get("drafter_args") or {}
    return {
        "tau": tau,
        "num_prompts": nprompts,
        "variant": dargs.get("variant", "eagle3") if train else None,
        # the drafter's size (drafter.intermediate_size, drafter.num_layers: absent = 1 layer, as DrafterArgs.to_json)
        "drafter": {
            "intermediate_size": dargs.get("intermediate_size"),
            "num_layers": dargs.get("num_layers", 1),
        }
        if train
        else None,
        "loss": recipe.get("loss", "soft_ce") if train else None,
        "num_train_prompts": (prompts.get("counts") or {}).get("kept"),
        "recipe": recipe or None,
        "sim_accept": {
            "chain": sim.get("chain"),
            "select_best": sim.get("select_best"),
            "exported_step": exported_step,
            "best": sim.get("best"),
            "curve": [[r["step"], round(r["tau_sim"], 4)] for r in sim.get("rows") or []],
        }
        if sim
        else None,
        "loss_tokens": data.get("num_loss_tokens"),
        "tokens": data.get("num_tokens"),
        "train_samples": data.get("train_samples"),
        "conversations": (prompts.get("counts") or {}).get("kept"),
        "answers_regenerated": regen.get("answers"),
        "answers_truncated": regen.get("truncated"),
        "config": config,
        "overrides": overrides.split() if overrides else [],
        "evaluator": {
            "dtype": first.get("dtype"),
            "device": first.get("device"),
            "max_new_tokens": first.get("max_new_tokens"),
            "tie_tolerance": first.get("tie_tolerance"),
            "how": "05_benchmark.py, in-process HF verifier, chain drafting, T=0",
        },
        "goal": goal,
        "goal_met": all(v["met"] for sets in goal.values() for v in sets.values()),
        "per_position": per_pos,
        "val_top1_per_position": val_acc,
        "train_eval_gap_pos1": {
            s: (round(val_acc[0] - p["conditional"][0], 4) if val_acc else None)
            for s, p in per_pos[min(per_pos, key=int)].items()
        },
        "speed": speed,
        "speed_by_batch": speed_by_batch,
        "tau_by_category_steps3": by_category,
        "train_tokens_per_s": train.get("tokens_per_s"),
    }


SET_KIND = {"mtbench": "chat", "humaneval": "code", "gsm8k": "math"}


def _by_category(pp: Optional[dict]) -> Optional[dict]:
    """Tau (emitted tokens / verify steps) per prompt category: chat / code / math over the sets, and
    MT-bench's categories when its question file is found (None when the per-prompt file is absent)."""
    if not pp:
        return None
    rows = pp["per_prompt"]
    acc: dict[str, list[int]] = {}
    for name, prompts in rows.items():
        e = sum(v[0] for v in prompts.values())
        n = sum(v[1] for v in prompts.values())
        kind = acc.setdefault(SET_KIND.get(name, name), [0, 0])
        kind[0] += e
        kind[1] += n
    out = {"by_kind": {k: round(e / n, 4) for k, (e, n) in acc.items() if n}}
    if "mtbench" in rows:
        from eagle3.data.eval_prompts import shared_data_dir

        try:
            qfile = shared_data_dir() / "eval" / "mt_bench_question.jsonl"
            cats = {
                str(json.loads(line)["question_id"]): json.loads(line)["category"]
                for line in qfile.read_text().splitlines()
                if line.strip()
            }
        except (OSError, UserError):
            cats = {}
        mt: dict[str, list[int]] = {}
        for qid, (e, n) in rows["mtbench"].items():
            if qid in cats:
                c = mt.setdefault(cats[qid], [0, 0])
                c[0] += e
                c[1] += n
        if mt:
            out["mtbench"] = {
                c: {"tau": round(e / n, 4), "verify_steps": n} for c, (e, n) in sorted(mt.items())
            }
    return out


def markdown(q: dict) -> str:
    """Tau table (chain lengths x sets, with the goal), per-position acceptance vs held-out top-1, speedups."""
    sets = list(q["num_prompts"])
    lines = [
        "| steps | " + " | ".join(f"{s} ({q['num_prompts'][s]})" for s in sets) + " |",
        "|---:|" + "---:|" * len(sets),
    ]
    for k in sorted(q["tau"], key=int):
        cells = []
        for s in sets:
            t = q["tau"][k].get(s)
            g = (q["goal"].get(k) or {}).get(s)
            cells.append("-" if t is None else f"{t:.2f}" + (f" (goal {g['goal']})" if g else ""))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    k0 = min(q["per_position"], key=int)
    lines += [
        "",
        f"Top-1 per draft position: held-out training data (04 validation) vs conditional acceptance "
        f"on each set ({k0} steps):",
        "",
        "| position | " + " | ".join(["held-out train", *sets]) + " |",
        "|---:|" + "---:|" * (len(sets) + 1),
    ]
    for i in range(int(k0)):
        v = q["val_top1_per_position"][i] if i < len(q["val_top1_per_position"]) else None
        # a set scored at another chain length only (e.g. MT-bench at 7 steps, not at 3): "-" in this table
        at_k0 = q["per_position"][k0]
        row = [f"{v:.2f}" if v is not None else "-"] + [
            f"{at_k0[s]['conditional'][i]:.2f}" if s in at_k0 else "-" for s in sets
        ]
        lines.append(f"| {i + 1} | " + " | ".join(row) + " |")
    cat = q.get("tau_by_category_steps3")
    if cat:
        lines += [
            "",
            "Tau by prompt category (3 steps): "
            + ", ".join(f"{k} {v:.2f}" for k, v in cat["by_kind"].items()),
        ]
        if cat.get("mtbench"):
            lines += ["", "| MT-bench category | tau | verify steps |", "|---|---:|---:|"]
            lines += [
                f"| {c} | {v['tau']:.2f} | {v['verify_steps']} |" for c, v in cat["mtbench"].items()
            ]
    sb = q.get("speed_by_batch")
    if sb:
        lines += [
            "",
            f"Speedup by batch size ({sb['dataset']}, {sb['steps']} steps, {sb['dtype']}, prompts picked "
            f"{sb.get('prompt_pick', 'first')}, bench/offline_bench_speed.py alone on the GPU):",
            "",
        ]
        lines += [f"Warning: {w}" for w in sb.get("warnings") or []] + (
            [""] if sb.get("warnings") else []
        )
        lines += [
            "| batch | prompts | greedy tok/s | EAGLE-3 tok/s | speedup | tau | drafter share |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['batch_size']} | {r['num_prompts']} | {r['greedy_tokens_per_s']:.0f} | {r['eagle3_tokens_per_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['tau']:.2f} | {r['drafter_share']:.2f} |"
            for r in sb["rows"]
        ]
    if q.get("speed_note"):
        lines += ["", q["speed_note"]]
    lines += [
        "",
        "| steps | set | batch | speedup vs batched greedy | drafter share | wall s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for k in sorted(q["speed"], key=int):
        for s, v in q["speed"][k].items():
            lines.append(
                f"| {k} | {s} | {v['batch_size']} | {v['speedup']:.2f}x | {v['drafter_share']:.2f} | {v['wall_s']} |"
            )
    return "\n".join(lines) + "\n"


def plot(q: dict, path: Path) -> None:
    """Per-position curves: held-out training top-1 and each set's conditional acceptance (longest chain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(q["per_position"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    val = q["val_top1_per_position"][: int(k)]
    if val:
        ax.plot(range(1, len(val) + 1), val, "k--o", label="held-out training data (top-1)")
    for s, p in q["per_position"][k].items():
        ax.plot(
            range(1, len(p["conditional"]) + 1),
            p["conditional"],
            "-o",
            label=f"{s} (conditional acceptance)",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | previous accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Where tau is lost ({k}-step chain)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_png(fig, path, dpi=110)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "run",
        type=Path,
        help="folder with bench-steps<K>.json, train_report.json, data_report.json, prompts_report.json",
    )
    p.add_argument(
        "--config", default="configs/smollm2-135m-full.yaml", help="the run's config (recorded)"
    )
    p.add_argument(
        "--overrides", default="", help="the run's --set overrides, space-separated (recorded)"
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/quality.json"))
    p.add_argument(
        "--goals",
        choices=sorted(GOALS),
        default="10",
        help="whose goals the table shows: issue 10's or issue 23's",
    )
    p.add_argument(
        "--speed-note",
        default="",
        help="a line printed above the per-set speedups (e.g. that the GPU was shared)",
    )
    a = p.parse_args(argv)
    if not a.run.is_dir():
        raise UserError(f"{a.run}: not a folder")
    q = collect(a.run, a.config, a.overrides, a.goals)
    q["source"] = str(a.run)
    q["speed_note"] = a.speed_note or None
    md = markdown(q)
    write_json_and_markdown(a.out, q, md)
    plot(q, a.out.with_name(a.out.stem + "_positions.png"))
    print(md, end="")
    return 0


if __name__ == "__main__":
    run_main(main)
