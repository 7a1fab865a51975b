"""Every drafter run under ``bench/results`` with its 05 result where one exists, in one table (issue 23).

Two kinds of file are read, found by their shape, anywhere under ``--root``:

* a 05 result (``bench*.json``: ``{"steps", "dtype", "datasets": [{"dataset", "tau", ...}]}``): one run, read by
  :func:`quality_compare.load_run` with the reports beside it (``train_report.json``: optimizer steps, the drafter's
  shape, a stop by signal; ``data_report.json``: training samples);
* a comparison table (``bench/quality_compare.py``'s JSON: ``{"rows": [{"name", "path", "tau", ...}]}``): its rows
  name runs whose 05 files are not all in git (the early leases kept only the comparison); such a row is listed from
  the values the table recorded, unless its ``path`` is a 05 file found above (then that file's row wins, and the
  comparison's names are added to it).

Files git ignores (a lease's ``runs/`` folders, kept out of git) are not read: every figure comes from a file a
clone has. Rows are keyed by the 05 file (``path`` of a comparison row resolved against the repository root), so a
run that several comparisons name appears once, with every name it was given. Nothing is typed in by hand: each figure is
read from a committed file, and the row says which.

    python bench/quality_index.py --out bench/results/quality_runs.json   # + quality_runs.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality_compare import SETS, load_run  # noqa: E402

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.io import write_json_and_markdown  # noqa: E402

GOALS = {3: {"mtbench": 2.8, "humaneval": 2.8, "gsm8k": 3.2}, 7: {"mtbench": 3.4}}  # issue 23


def _read(path: Path) -> Optional[dict]:
    """``path``'s JSON object, or None (not JSON, not an object: not a file this index reads)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def is_bench(obj: dict) -> bool:
    """A 05 result: a ``datasets`` list of ``{"dataset", "tau"}`` entries and the chain's ``steps``."""
    ds = obj.get("datasets")
    return (
        isinstance(ds, list)
        and bool(ds)
        and all(isinstance(d, dict) and "tau" in d and "dataset" in d for d in ds)
        and isinstance(obj.get("steps"), int)
    )


def is_comparison(obj: dict) -> bool:
    """A ``bench/quality_compare.py`` table: ``rows`` of ``{"name", "path", "tau"}``."""
    rows = obj.get("rows")
    return (
        isinstance(rows, list)
        and bool(rows)
        and all(isinstance(r, dict) and {"name", "path", "tau"} <= set(r) for r in rows)
    )


def _drafter(train: dict) -> Optional[str]:
    """``eagle3.1, 2 layers, MLP 6144`` from a ``train_report.json``'s ``drafter_args``, or None."""
    args = train.get("drafter_args")
    if not isinstance(args, dict):
        return None
    layers = int(
        args.get("num_layers", 1)
    )  # (DrafterArgs; absent before the field existed: one layer)
    return (
        f"{args.get('variant', 'eagle3')}, {layers} layer{'s' if layers > 1 else ''}, "
        f"MLP {args.get('intermediate_size')}"
    )


def bench_row(path: Path, repo: Path) -> dict:
    """One run from its 05 file (tau per set, chain steps, dtype) and the reports beside it."""
    r = load_run(f"run={path}")
    train = _read(path.parent / "train_report.json") or {}
    return {
        "file": str(path.relative_to(repo)),
        "names": [],
        "steps": r["steps"],
        "dtype": r["dtype"],
        "tau": {k: round(v, 2) for k, v in r["tau"].items()},
        "optimizer_steps": r["optimizer_steps"],
        "weights_step": r["weights_step"],
        "stopped": bool(train.get("stopped")),
        "train_samples": r["train_samples"],
        "drafter": _drafter(train),
        "from": "05 file",
    }


def comparison_row(row: dict, table: Path, repo: Path) -> dict:
    """A run known only from a comparison table's row (its 05 file is not in git)."""
    return {
        "file": row["path"],
        "names": [row["name"]],
        "steps": row.get("steps"),
        "dtype": row.get("dtype"),
        "tau": {k: round(v, 2) for k, v in (row.get("tau") or {}).items()},
        "optimizer_steps": row.get("optimizer_steps"),
        "weights_step": row.get("weights_step"),
        "stopped": None,
        "train_samples": row.get("train_samples"),
        "drafter": row.get("variant"),
        "from": f"comparison {table.relative_to(repo)}",
    }


def git_ignored(paths: list[Path], repo: Path) -> set[Path]:
    """The ``paths`` git ignores in ``repo`` (``git check-ignore``), never committed; none outside a git work tree."""
    import subprocess

    if not paths:
        return set()
    try:
        r = subprocess.run(
            ["git", "-C", str(repo), "check-ignore", "--stdin", "-z"],
            capture_output=True,
            text=True,
            input="\0".join(str(p) for p in paths),
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError):
        return set()
    if r.returncode not in (0, 1):  # 128: not a git work tree
        return set()
    return {Path(x) if Path(x).is_absolute() else repo / x for x in r.stdout.split("\0") if x}


def collect(root: Path, repo: Path) -> list[dict]:
    """Every run under ``root`` (module docstring), sorted by chain steps then file. Files git ignores are not read
    (a lease's ``runs/`` folders, unpacked beside its committed comparison: the index listed their 05 files as its
    source, "05 file", and figures no clone has, so the committed table came out otherwise from a clean checkout)."""
    paths = sorted(root.rglob("*.json"))
    ignored = git_ignored(paths, repo)
    found = {p: obj for p in paths if p not in ignored and (obj := _read(p)) is not None}
    runs = {
        str(p.relative_to(repo)): bench_row(p, repo) for p, obj in found.items() if is_bench(obj)
    }
    for table, obj in found.items():
        if not is_comparison(obj):
            continue
        for row in obj["rows"]:
            key = (
                str(Path(row["path"]) / "bench.json")
                if (repo / row["path"]).is_dir()
                else row["path"]
            )
            if key not in runs:
                runs[key] = comparison_row(row, table, repo)
            elif row["name"] not in runs[key]["names"]:
                runs[key]["names"].append(row["name"])
    return sorted(runs.values(), key=lambda r: (r["steps"] or 0, r["file"]))


def _cell(r: dict, s: str) -> str:
    v = r["tau"].get(s)
    if v is None:
        return "-"
    goal = GOALS.get(r["steps"] or 0, {}).get(s)
    return f"**{v:.2f}**" if goal is not None and v >= goal else f"{v:.2f}"


def markdown(runs: list[dict]) -> str:
    """The table: one row per run; a tau at or above issue 23's goal in bold."""
    lines = [
        "Every drafter run in `bench/results` (`python bench/quality_index.py`): tau per set, chain of `steps` "
        "draft tokens, T=0 (a run without a 05 result: `-`); bold: at or above issue 23's goal (3 steps: "
        "MT-bench 2.8, HumanEval 2.8, GSM8K 3.2; 7 steps: MT-bench 3.4).",
        "",
        "| file | names in comparisons | steps | dtype | MT-bench | HumanEval | GSM8K | other sets | optimizer "
        "steps | train samples | drafter |",
        "|---|---|---:|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in runs:
        other = (
            ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["tau"].items()) if k not in SETS) or "-"
        )
        opt = r["optimizer_steps"]
        opt = (
            "-"
            if opt is None
            else f"{opt}" + (f" (weights of {r['weights_step']})" if r["weights_step"] else "")
        )
        lines.append(
            f"| `{r['file']}` | {'; '.join(r['names']) or '-'} | {r['steps'] or '-'} | {r['dtype'] or '-'} | "
            + " | ".join(_cell(r, s) for s in SETS)
            + f" | {other} | {opt} | {r['train_samples'] or '-'} | {r['drafter'] or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    repo = Path(__file__).resolve().parents[1]
    p.add_argument(
        "--root",
        type=Path,
        default=repo / "bench" / "results",
        help="folder searched (recursively)",
    )
    p.add_argument("--repo", type=Path, default=repo, help="paths are written relative to it")
    p.add_argument(
        "--out", type=Path, required=True, help="JSON path; the Markdown table goes beside it (.md)"
    )
    a = p.parse_args(argv)
    runs = collect(a.root.resolve(), a.repo.resolve())
    md = markdown(runs)
    write_json_and_markdown(
        a.out, {"goals": {str(k): v for k, v in GOALS.items()}, "runs": runs}, md
    )
    print(md, end="")
    return 0


if __name__ == "__main__":
    run_main(main)
