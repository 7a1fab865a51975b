"""Compare drafter runs against a reference run: tau per set with a paired bootstrap CI, held-out top-1.

Each run is ``NAME=PATH``: a 05 ``bench*.json`` (or a folder holding ``bench.json``) split by :func:`split_bench`
(``bench/quality_session.sh pack`` does). Read beside it: the per-prompt file (``bench.json`` -> ``per_prompt.json``,
``bench-X.json`` -> ``per_prompt_X.json``: ``{set: {id: [emitted tokens, verify steps]}}``), and where they
exist ``train_report.json`` (04: ``final_val`` top-1 ``acc_i`` per TTT position on the held-out split,
optimizer steps; a run stopped before its final validation (SIGTERM at a lease's deadline) has none, and its export
holds the best validated weights (``train.select_best: sim_accept``): then the top-1 is that validation's ``alpha``
and the table names the step the weights are from) and ``data_report.json`` (03: training samples, draft vocab, its coverage).

For every run and set: tau = emitted / verify steps over the set's prompts (05's own definition). For
every non-reference run and every set both runs measured: ``delta`` = tau(run) - tau(ref) and its 95%
paired bootstrap interval (prompts resampled with replacement, the same resample for both runs, 2000
draws, seed 0): two drafters scored on the same prompts differ by less than the spread of tau across
prompts, and pairing removes that spread. The interval says how much of a difference is prompt noise; it
does not cover training noise (the same recipe retrained with other GPU nondeterminism).

``--curve`` also writes a PNG of tau (and held-out top-1 at position 1) against the training samples of
each run (``data_report.json``'s ``train_samples``): the data curve of issue 10.

    python bench/quality_compare.py --ref 6K=bench/results/h200-20261201b/runs/curve-6000 \\
        --run "TTT 1=bench/results/h200-20261201b/runs/abl-ttt1" --out bench/results/ablations.json
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_save_png, read_json, write_json_and_markdown  # noqa: E402

SETS = ("mtbench", "humaneval", "gsm8k")


def split_bench(bench: dict) -> tuple[dict, dict]:
    """``(bench without per-prompt rows, {"steps", "per_prompt": {set: {id: [emitted, verify steps]}}})``.

    ``bench``: 05's ``bench.json``. ``emitted`` = sum of the row's accept lengths (tokens the verify rounds
    emitted), ``verify steps`` = number of rounds; a set's tau is ``sum(emitted) / sum(steps)`` over its prompts.
    """
    slim = dict(bench)
    slim["datasets"] = [
        {k: v for k, v in ds.items() if k != "per_prompt"} for ds in bench["datasets"]
    ]
    pp = {
        ds["dataset"]: {
            str(r["id"]): [int(sum(r["accept_lengths"])), len(r["accept_lengths"])]
            for r in ds.get("per_prompt", [])
        }
        for ds in bench["datasets"]
    }
    return slim, {"steps": bench.get("steps"), "per_prompt": pp}


def _json(path: Path, required: bool = True) -> Optional[dict]:
    """``path``'s JSON (:func:`eagle3.io.read_json`: one-line error naming the file and line), or None
    when it is absent and not ``required``."""
    return read_json(path) if required or path.is_file() else None


def load_run(spec: str) -> dict:
    """``NAME=PATH`` -> ``{name, path, tau: {set: float}, per_prompt: {set: {id: [e, n]}}, val, train_samples, ...}``.

    ``PATH`` without a 05 result (a run whose benchmark did not finish) still gives its training reports.

    Raises:
        UserError: no ``=`` in ``spec``, ``PATH`` missing, or a file that is not valid JSON.
    """
    if "=" not in spec:
        raise UserError(f"run {spec!r}: expected NAME=PATH")
    name, p = spec.split("=", 1)
    path = Path(p)
    if path.is_dir():
        bench_path, folder = path / "bench.json", path
    elif path.is_file():
        bench_path, folder = path, path.parent
    else:
        raise UserError(f"{path}: not found (run {name!r})")
    bench = _json(bench_path, required=False)
    tag = bench_path.stem[len("bench") :].lstrip("-")
    pp = (
        _json(folder / (f"per_prompt_{tag}.json" if tag else "per_prompt.json"), required=False)
        or {}
    )
    train = _json(folder / "train_report.json", required=False) or {}
    data = _json(folder / "data_report.json", required=False) or {}
    top1, weights_step = scored_weights(train, train.get("sim_accept") or {})
    return {
        "name": name,
        "path": str(path),
        "tau": {ds["dataset"]: round(ds["tau"], 4) for ds in (bench or {}).get("datasets", [])},
        "per_prompt": pp.get("per_prompt", {}),
        "steps": (bench or {}).get("steps"),
        "dtype": (bench or {}).get("dtype"),
        "temperature": (bench or {}).get("temperature"),
        "rejection_sample_method": (bench or {}).get("rejection_sample_method"),
        "val_top1": top1,
        "optimizer_steps": train.get("step"),
        "weights_step": weights_step,
        "train_tokens_per_s": train.get("tokens_per_s"),
        "train_samples": data.get("train_samples"),
        "val_samples": data.get("val_samples"),
        "draft_vocab_size": data.get("draft_vocab_size"),
        "vocab_coverage": data.get("coverage"),
    }


def scored_weights(train: dict, sim: dict) -> tuple[list[float], Optional[int]]:
    """The held-out top-1 per TTT position of the weights 05 scored, and their step when they are not the last step's.

    ``train``: a ``train_report.json``; ``sim``: its ``sim_accept`` summary (or 04's ``sim_accept.json``). Under
    ``train.select_best: sim_accept`` 04 exports the best validation's weights, at the end of a finished run as after a
    stop (04 --export-only): when that step is not the last one, the final validation (``final_val``) describes
    other weights than the export, and the best validation's ``alpha`` is the scored drafter's top-1 (a finished run
    whose best came early was reported with the last step's top-1 and optimizer steps beside the tau of the earlier
    weights).
    Otherwise ``final_val``'s ``acc_i`` and None.
    """
    val = train.get("final_val") or {}
    top1 = [round(val[f"acc_{i}"], 4) for i in range(64) if f"acc_{i}" in val]
    best = sim.get("best") or {}
    if sim.get("select_best") != "sim_accept" or not best.get("alpha"):
        return top1, None
    step = sim.get("exported_step") if sim.get("exported_step") is not None else best.get("step")
    if top1 and (step is None or step == train.get("step")):
        return top1, None
    return [round(a, 4) for a in best["alpha"]], best.get("step")


def paired_bootstrap(a: dict, b: dict, draws: int = 2000, seed: int = 0) -> Optional[dict]:
    """Tau(b) - tau(a) over the prompt ids both hold, with its 95% paired bootstrap interval.

    Args:
        a, b: ``{prompt id: [emitted tokens, verify steps]}`` of one set for two runs.

    Returns:
        ``{"delta", "lo", "hi", "prompts"}`` or None when no prompt id is shared.
    """
    ids = sorted(set(a) & set(b))
    if not ids:
        return None
    ea, na = [a[i][0] for i in ids], [a[i][1] for i in ids]
    eb, nb = [b[i][0] for i in ids], [b[i][1] for i in ids]

    def delta(idx) -> float:
        return sum(eb[i] for i in idx) / sum(nb[i] for i in idx) - sum(ea[i] for i in idx) / sum(
            na[i] for i in idx
        )

    rng = random.Random(seed)
    n = len(ids)
    ds = sorted(delta([rng.randrange(n) for _ in range(n)]) for _ in range(draws))
    return {
        "delta": round(delta(range(n)), 4),
        "lo": round(ds[int(0.025 * draws)], 4),
        "hi": round(ds[int(0.975 * draws) - 1], 4),
        "prompts": n,
    }


def compare(ref: dict, runs: list[dict]) -> list[dict]:
    """One row per run (reference first): tau per set, deltas vs the reference with intervals, top-1."""
    rows = []
    for r in [ref, *runs]:
        row = {
            k: r[k]
            for k in (
                "name",
                "path",
                "tau",
                "steps",
                "dtype",
                "temperature",
                "rejection_sample_method",
                "val_top1",
                "optimizer_steps",
                "weights_step",
                "train_tokens_per_s",
                "train_samples",
                "val_samples",
                "draft_vocab_size",
                "vocab_coverage",
            )
        }
        row["reference"] = r is ref
        if r is not ref:
            row["delta_vs_ref"] = {
                s: d
                for s in SETS
                if s in r["per_prompt"]
                and s in ref["per_prompt"]
                and (d := paired_bootstrap(ref["per_prompt"][s], r["per_prompt"][s])) is not None
            }
        rows.append(row)
    return rows


def val_split_note(rows: list[dict]) -> str:
    """How large each run's validation split is, from its ``data_report.json`` (``val_samples``): one count when
    every run reports the same, else the count per run; runs without a data report are named as such."""
    sizes = {r["name"]: r.get("val_samples") for r in rows}
    known = {v for v in sizes.values() if v is not None}
    if len(known) == 1 and None not in sizes.values():
        return f"{known.pop()} samples in every run"
    return "; ".join(
        f"{n}: {'no data_report.json' if v is None else f'{v} samples'}" for n, v in sizes.items()
    )


def served_note(rows: list[dict]) -> str:
    """How 05 drafted and verified: ``T=0`` (greedy chain) or ``T=t, <method> verification`` from each bench's
    ``temperature`` / ``rejection_sample_method`` (absent = a greedy 05), one phrase when every run shares it."""

    def one(r: dict) -> str:
        t = r.get("temperature") or 0
        return (
            "T=0"
            if t == 0
            else f"T={t:g}, {r.get('rejection_sample_method') or 'standard'} verification"
        )

    kinds = {r["name"]: one(r) for r in rows}
    if len(set(kinds.values())) == 1:
        return next(iter(kinds.values()))
    return "; ".join(f"{n}: {k}" for n, k in kinds.items())


def markdown(rows: list[dict], title: str) -> str:
    """Table: run, training samples, steps, held-out top-1 at position 1, tau per set with delta [CI]."""
    sets = [s for s in SETS if any(s in r["tau"] for r in rows)]
    lines = [
        f"{title}",
        "",
        "| run | train samples | optimizer steps | held-out top-1 (pos 1) | "
        + " | ".join(f"tau {s}" for s in sets)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(sets),
    ]
    for r in rows:
        cells = []
        for s in sets:
            t = r["tau"].get(s)
            d = (r.get("delta_vs_ref") or {}).get(s)
            cells.append(
                "not measured"
                if t is None
                else f"{t:.2f}"
                + (f" ({d['delta']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}])" if d else "")
            )
        v = f"{r['val_top1'][0]:.3f}" if r["val_top1"] else "-"
        name = r["name"] + (" (ref)" if r["reference"] else "")
        steps = str(r["optimizer_steps"] or "-")
        if r.get("weights_step") is not None and r["weights_step"] != r["optimizer_steps"]:
            steps += f" (weights of step {r['weights_step']})"
        lines.append(
            f"| {name} | {r['train_samples'] or '-'} | {steps} | {v} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        f"tau: 05, chain, {served_note(rows)}; (delta vs ref [95% paired bootstrap over prompts]); held-out top-1: 04's "
        f"validation split ({val_split_note(rows)}).",
    ]
    return "\n".join(lines) + "\n"


def plot_curve(rows: list[dict], path: Path) -> None:
    """Tau per set and held-out top-1 (position 1) against training samples (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted((r for r in rows if r["train_samples"]), key=lambda r: r["train_samples"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in SETS:
        xy = [(r["train_samples"], r["tau"][s]) for r in pts if s in r["tau"]]
        if xy:
            ax.plot(*zip(*xy), "-o", label=s)
    ax.set_xscale("log")
    ax.set_xlabel("training conversations")
    ax.set_ylabel("tau (3-step chain)")
    ax.set_title("Data curve: acceptance length")
    ax.legend(fontsize=8)
    xy = [(r["train_samples"], r["val_top1"][0]) for r in pts if r["val_top1"]]
    ax2.plot(*zip(*xy), "k-o")
    ax2.set_xscale("log")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("training conversations")
    ax2.set_ylabel("top-1 vs verifier, draft position 1")
    ax2.set_title("Held-out training data")
    fig.tight_layout()
    atomic_save_png(fig, path, dpi=110)


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="NAME=PATH of the reference run")
    p.add_argument(
        "--run", action="append", default=[], help="NAME=PATH of a compared run (repeatable)"
    )
    p.add_argument("--title", default="Runs compared with the reference")
    p.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line recorded in the JSON and printed under the table",
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="also write <out>.png: tau and top-1 against training samples",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="JSON path; the Markdown table goes beside it (.md)"
    )
    a = p.parse_args(argv)
    rows = compare(load_run(a.ref), [load_run(s) for s in a.run])
    import shlex

    cmd = shlex.join(
        ["python", "bench/quality_compare.py", *(sys.argv[1:] if argv is None else argv)]
    )
    md = markdown(rows, a.title) + "".join(f"\n{n}\n" for n in a.note)
    write_json_and_markdown(
        a.out, {"title": a.title, "notes": a.note, "command": cmd, "rows": rows}, md
    )
    if a.curve:
        plot_curve(rows, a.out.with_suffix(".png"))
    print(md, end="")
    return 0


if __name__ == "__main__":
    run_main(main)
