"""Summarise the recipe runs of one ``bench/quality_session.sh`` lease: every run's quality.json, one table
of all runs against the reference, and the headline ``quality.json`` (issue 23).

Input: a folder of run folders (what ``quality_session.sh pack`` writes under ``res/runs/``), each in the
flat layout :mod:`bench.quality_summary` reads (``bench-steps3.json`` [+ ``per_prompt_steps3.json``],
``bench-steps7.json``, ``train_report.json``, ``data_report.json``, ``prompts_report.json``). Output
(``--out DIR``):

- ``DIR/<run>/quality.json`` + ``.md``: :func:`bench.quality_summary.collect` of each run (issue 23's goals;
  keys ``variant``, ``loss``, ``num_train_prompts``, ``recipe``, ``sim_accept`` beside the former ones;
  ``overrides``: the run's ``overrides.txt``, the driver's ``--set`` list, one a line, when there is one);
- ``DIR/recipes.json`` + ``.md``: one row per run, the reference first: its recipe (what differs from the
  reference), tau per set at 3 steps with the delta against the reference and its 95% paired bootstrap
  interval over prompts (:func:`bench.quality_compare.paired_bootstrap`), MT-bench at 7 steps, held-out
  top-1 at position 1, the best simulated acceptance tau_sim(3) and the step it was taken at;
- ``DIR/headline/quality.json`` (+ ``.md``, ``_positions.png``): the run with the highest mean tau over the
  sets at 3 steps (the reference when that is highest), i.e. what ``bench/results/quality.json`` should hold.

    python bench/quality_recipes.py outputs/quality/res/runs --ref ref --out outputs/quality/res/summary
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_compare as qc  # noqa: E402
import quality_summary as qs  # noqa: E402

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text, make_dirs  # noqa: E402


def _drafter_args(run: Path) -> dict:
    """The drafter's fields of ``run/train_report.json`` (``drafter_args``; absent ``num_layers`` / ``variant``: their
    defaults, 1 and eagle3, as :class:`DrafterArgs` leaves them out), ``{}`` without a report."""
    path = run / "train_report.json"
    args = (qs._read(path, required=False) or {}).get("drafter_args") or {}
    return (
        {**args, "num_layers": args.get("num_layers", 1), "variant": args.get("variant", "eagle3")}
        if args
        else {}
    )


def _recipe_diff(
    recipe: Optional[dict], ref: Optional[dict], drafter: dict, ref_drafter: dict
) -> str:
    """``key=value`` of what a run changed against the reference (``-`` for none): its variant first, every other
    drafter field (the MLP width, the layers, the draft vocabulary: a recipe of ``drafter.intermediate_size=6144`` was
    labelled ``-``, the table's only column of what a run is), then the training recipe."""
    out = (
        [f"drafter.variant={drafter.get('variant')}"]
        if drafter.get("variant") != ref_drafter.get("variant")
        else []
    )
    if drafter and ref_drafter:
        out += [
            f"drafter.{k}={drafter.get(k)}"
            for k in sorted(set(drafter) | set(ref_drafter))
            if k != "variant" and drafter.get(k) != ref_drafter.get(k)
        ]
    for k, v in sorted((recipe or {}).items()):
        if (ref or {}).get(k) != v:
            out.append(f"train.{k}={v}")
    return " ".join(out) or "-"


def summarise(runs_dir: Path, ref: str, out: Path, config: str = "") -> dict:
    """Write the per-run, table and headline files (module docstring); return the table.

    Raises:
        UserError: ``runs_dir`` holds no run with a 3-step benchmark, or the reference is not among them.
    """
    runs = sorted(p for p in runs_dir.iterdir() if (p / "bench-steps3.json").is_file())
    if not runs:
        raise UserError(f"{runs_dir}: no run folder with bench-steps3.json")
    names = [p.name for p in runs]
    if ref not in names:
        raise UserError(f"{runs_dir}: no reference run '{ref}' (runs: {', '.join(names)})")
    quality = {}
    for p in runs:
        q = qs.collect(p, config, goals="23")
        if (
            p / "overrides.txt"
        ).is_file():  # the lease driver's --set list of the run (quality_session.sh)
            q["overrides"] = [x for x in (p / "overrides.txt").read_text().splitlines() if x]
        q["source"] = str(p)
        quality[p.name] = q
        make_dirs(out / p.name, "--out")
        atomic_write_json(out / p.name / "quality.json", q)
        atomic_write_text(out / p.name / "quality.md", qs.markdown(q))
    loaded = {p.name: qc.load_run(f"{p.name}={p / 'bench-steps3.json'}") for p in runs}
    rows = qc.compare(loaded[ref], [loaded[n] for n in names if n != ref])
    rq = quality[ref]
    drafters = {p.name: _drafter_args(p) for p in runs}
    for row in rows:
        q = quality[row["name"]]
        best = (q.get("sim_accept") or {}).get("best") or {}
        no_report = q.get("recipe") is None and row["name"] != ref
        if (
            no_report
            and not row.get("optimizer_steps")
            and (q.get("sim_accept") or {}).get("curve")
        ):
            row["optimizer_steps"] = q["sim_accept"]["curve"][-1][
                0
            ]  # the last validation (>= steps - eval_every)
        row.update(
            variant=q["variant"],
            loss=q["loss"],
            num_train_prompts=q["num_train_prompts"],
            change=(
                "(no train_report: stopped at the deadline; see the run's command)"
                if no_report
                else _recipe_diff(
                    q.get("recipe"), rq.get("recipe"), drafters[row["name"]], drafters[ref]
                )
            ),
            tau_steps7=q["tau"].get("7", {}),
            sim_accept_best=best.get("tau_sim"),
            sim_accept_best_step=best.get("step"),
            exported_step=(q.get("sim_accept") or {}).get("exported_step"),
        )
    table = {"reference": ref, "rows": rows}
    atomic_write_json(out / "recipes.json", table)
    atomic_write_text(out / "recipes.md", markdown(table))

    def mean_tau(name: str) -> float:
        t = quality[name]["tau"].get("3", {})
        return sum(t.values()) / len(t) if t else float("-inf")

    most = max(
        len(quality[n]["tau"].get("3", {})) for n in names
    )  # only runs benchmarked on every set compete
    full = [n for n in names if len(quality[n]["tau"].get("3", {})) == most]
    head = max(full, key=lambda n: (mean_tau(n), n == ref))
    hq = dict(
        quality[head],
        headline_run=head,
        headline_rule="highest mean tau at 3 steps among the runs benchmarked on every set",
    )
    make_dirs(out / "headline", "--out")
    atomic_write_json(out / "headline" / "quality.json", hq)
    atomic_write_text(out / "headline" / "quality.md", qs.markdown(hq))
    qs.plot(hq, out / "headline" / "quality_positions.png")
    table["headline"] = head
    return table


def markdown(table: dict) -> str:
    """One row per run: change vs the reference, tau at 3 steps (delta [CI]), MT-bench at 7, top-1, tau_sim."""
    rows = table["rows"]
    sets = [s for s in qc.SETS if any(s in r["tau"] for r in rows)]
    lines = [
        "| run | change vs ref | optimizer steps | held-out top-1 (pos 1) | best tau_sim(3) (step) | "
        + " | ".join(f"tau {s}" for s in sets)
        + " | tau mtbench, 7 steps |",
        "|---|---|---:|---:|---:|" + "---:|" * len(sets) + "---:|",
    ]
    for r in rows:
        cells = []
        for s in sets:
            t = r["tau"].get(s)
            d = (r.get("delta_vs_ref") or {}).get(s)
            cells.append(
                "-"
                if t is None
                else f"{t:.2f}"
                + (f" ({d['delta']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}])" if d else "")
            )
        v = f"{r['val_top1'][0]:.3f}" if r["val_top1"] else "-"
        sim = (
            f"{r['sim_accept_best']:.2f} ({r['sim_accept_best_step']})"
            if r.get("sim_accept_best")
            else "-"
        )
        t7 = r["tau_steps7"].get("mtbench")
        name = r["name"] + (" (ref)" if r["reference"] else "")
        steps = str(
            r["optimizer_steps"] or "-"
        )  # (as quality_compare's table: the scored weights' step when earlier)
        if r.get("weights_step") is not None and r["weights_step"] != r["optimizer_steps"]:
            steps += f" (weights of step {r['weights_step']})"
        lines.append(
            f"| {name} | {r['change']} | {steps} | {v} | {sim} | "
            + " | ".join(cells)
            + f" | {'-' if t7 is None else f'{t7:.2f}'} |"
        )
    lines += [
        "",
        "tau: 05, chain, T=0, fp32 verifier; (delta vs ref [95% paired bootstrap over prompts]: prompt noise "
        "only, not training noise); tau_sim: 04's validation split (eagle3/train/sim_accept.py).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "runs", type=Path, help="folder of run folders (bench-steps3.json, train_report.json, ...)"
    )
    p.add_argument("--ref", default="ref", help="the reference run's folder name")
    p.add_argument("--config", default="", help="the runs' config (recorded)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    a = p.parse_args(argv)
    if not a.runs.is_dir():
        raise UserError(f"{a.runs}: not a folder")
    table = summarise(a.runs, a.ref, a.out, a.config)
    print(markdown(table), end="")
    print(f"headline run: {table['headline']} -> {a.out / 'headline' / 'quality.json'}")
    return 0


if __name__ == "__main__":
    run_main(main)
