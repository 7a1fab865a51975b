#!/usr/bin/env python
"""The demo's last lines: per stage its wall time and headline figure, then the reports and the export.

``scripts/demo.sh`` runs it after stage 05 with the seconds it measured::

    python scripts/demo_summary.py --config configs/smollm2-135m.yaml --seconds setup=112 01_prepare_prompts=306 ...

It reads what the stages wrote (``prompts_report.json``, ``shards/extract_report.json``,
``data/data_report.json``, ``train/train_report.json``, ``bench/bench.json``), prints a table and the
paths, and writes ``{output_root}/demo_summary.json``. README's demo table is generated from that JSON
by ``python scripts/demo_table.py outputs/<run_name>/demo_summary.json`` (never typed by hand).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SUMMARY_NAME = "demo_summary.json"
SUMMARY_VERSION = 1


def _read(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None when the file is missing (a stage that did not run).

    Raises:
        UserError: ``file:line: malformed JSON: ...``, or ``file: not a JSON object`` (one line, no traceback).
    """
    from eagle3.errors import UserError
    from eagle3.io import read_json

    if not path.is_file():
        return None
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object, got a JSON {type(obj).__name__}")
    return obj


def _kilo(n: float) -> str:
    """``60123`` -> ``60.1K``; below 10,000 the plain integer."""
    return f"{n / 1000:.1f}K" if n >= 10_000 else f"{int(n)}"


# --- one function per stage: (figures, headline, report paths) from what the stage wrote -------------
def _prompts(cfg) -> tuple[dict, str, list[Path]]:
    """Stage 01: conversations kept, how many were regenerated and the new tokens (prompts_report.json)."""
    rep_path = cfg.prompts_path.with_name("prompts_report.json")
    rep = _read(rep_path) or {}
    c = rep.get("counts", {})
    reg = rep.get("regeneration") or {}
    # answers: the turns the verifier answered in this run (a multi-turn conversation has several); a report without
    # the figure: the regenerated conversations (one answer each in the demo's HumanEval)
    fig = {
        "prompts": c.get("kept"),
        "regenerated": reg.get("answers", c.get("regenerated")),
        "new_tokens": reg.get("new_tokens"),
        "generated_tokens_per_s": reg.get("tokens_per_s"),
    }
    text = f"{fig['prompts']} prompts"
    if fig["regenerated"]:
        text += f", {fig['regenerated']} answers regenerated"
        if fig["new_tokens"]:
            text += f" ({_kilo(fig['new_tokens'])} new tokens"
            text += (
                f", {fig['generated_tokens_per_s']:.0f} tok/s)"
                if fig["generated_tokens_per_s"]
                else ")"
            )
    return fig, text, [cfg.prompts_path, rep_path.with_suffix(".md")]


def _capture(cfg) -> tuple[dict, str, list[Path]]:
    """Stage 02: samples and tokens captured, loss-masked tokens (shards/extract_report.json)."""
    rep_path = cfg.shards_dir / "extract_report.json"
    rep = _read(rep_path) or {}
    meta = _read(cfg.shards_dir / "data_config.json") or {}
    fig = {
        "samples": rep.get("samples"),
        "tokens": rep.get("num_tokens"),
        "loss_tokens": rep.get("num_loss_tokens"),
        "disk_gb": rep.get("disk_gb"),
        "aux_layers": meta.get("aux_layers"),
    }
    text = f"{fig['samples']} samples, {_kilo(fig['tokens'] or 0)} tokens ({_kilo(fig['loss_tokens'] or 0)} loss-masked)"
    if fig["aux_layers"]:
        text += f", aux layers {fig['aux_layers']}"
    return fig, text, [rep_path.with_suffix(".md"), cfg.shards_dir / "data_config.json"]


def _data(cfg) -> tuple[dict, str, list[Path]]:
    """Stage 03: draft vocab size, its coverage of the loss tokens, the train/val split (data/data_report.json)."""
    rep_path = cfg.data_dir / "data_report.json"
    rep = _read(rep_path) or {}
    fig = {
        "draft_vocab_size": rep.get("draft_vocab_size"),
        "coverage": rep.get("coverage"),
        "train_samples": rep.get("train_samples"),
        "val_samples": rep.get("val_samples"),
    }
    cov = f"{100 * fig['coverage']:.1f}%" if fig["coverage"] is not None else "?"
    text = (
        f"draft vocab {fig['draft_vocab_size']} (coverage {cov}), "
        f"split {fig['train_samples']}/{fig['val_samples']}"
    )
    return fig, text, [rep_path.with_suffix(".md"), cfg.data_dir / "coverage.png"]


def _train(cfg) -> tuple[dict, str, list[Path]]:
    """Stage 04: optimizer steps, final validation loss and top-1 per TTT step, the export (train_report.json)."""
    rep_path = cfg.train_dir / "train_report.json"
    rep = _read(rep_path) or {}
    val = rep.get("final_val") or {}
    acc = [
        val[k]
        for k in sorted(
            (k for k in val if k.startswith("acc_")), key=lambda k: int(k.split("_")[-1])
        )
    ]
    exported = (rep.get("sim_accept") or {}).get("exported_step")
    fig = {
        "steps": rep.get("step"),
        "val_loss": val.get("loss"),
        "val_top1": acc or None,
        "export_dir": rep.get("export_dir"),
        "exported_step": exported,
    }
    text = f"{fig['steps']} steps"
    if fig["val_loss"] is not None:
        text += f", val loss {fig['val_loss']:.3f}"
    if acc:
        text += f", val top-1 {' / '.join(f'{a:.2f}' for a in acc)} (TTT steps 0..{len(acc) - 1})"
    if (
        exported is not None and exported != fig["steps"]
    ):  # train.select_best: sim_accept picked an earlier step
        text += (
            f"; exported: step {exported}'s weights (best simulated acceptance; the figures above are the last "
            f"step's)"
        )
    if rep.get("no_validation"):
        text += ", no validation split (data.val_fraction 0): last step exported"
    return fig, text, [rep_path.with_suffix(".md"), cfg.train_dir / "loss.png"]


def _bench(cfg) -> tuple[dict, str, list[Path]]:
    """Stage 05: per dataset tau, tokens/s greedy and with the drafter, speedup, lossless (bench/bench.json)."""
    rep_path = cfg.bench_dir / "bench.json"
    rep = _read(rep_path) or {}
    rows = []
    for d in rep.get("datasets", []):
        fails = d.get("failures", len(d.get("mismatches", [])))
        rows.append(
            {
                "dataset": d["dataset"],
                "prompts": d["num_prompts"],
                "tau": d["tau"],
                "greedy_tokens_per_s": d["greedy_tokens_per_s"],
                "spec_tokens_per_s": d["spec_tokens_per_s"],
                "speedup": d["speedup"],
                "lossless": fails == 0,
                "near_ties": d.get("near_ties", 0),
            }
        )
    fig = {
        "device": rep.get("device"),
        "dtype": rep.get("dtype"),
        "steps": rep.get("steps"),
        "datasets": rows,
    }
    parts = []
    for r in rows:
        ll = "lossless" if r["lossless"] else "NOT lossless"
        if r["lossless"] and r["near_ties"]:
            ll += f" ({r['near_ties']} near-ties)"
        parts.append(
            f"{r['dataset']}: tau {r['tau']:.2f}, {r['greedy_tokens_per_s']:.1f} tok/s greedy vs "
            f"{r['spec_tokens_per_s']:.1f} with the drafter ({r['speedup']:.2f}x), {ll}"
        )
    return (
        fig,
        "; ".join(parts) or "no result",
        [rep_path.with_suffix(".md"), cfg.bench_dir / "acceptance.png"],
    )


STAGES: list[tuple[str, Callable]] = [
    ("01_prepare_prompts", _prompts),
    ("02_extract_hidden", _capture),
    ("03_prepare_data", _data),
    ("04_train", _train),
    ("05_benchmark", _bench),
]


def collect(cfg, seconds: dict[str, float], config_path: str = "") -> dict:
    """The summary dict: per stage ``{stage, seconds, figures, headline, reports}``, the setup time and the export.

    ``seconds`` maps a stage name (``01_prepare_prompts`` ...; ``setup`` for scripts/setup.sh) to its wall
    time in seconds as the demo measured it; a stage whose report is missing gets headline ``not run``.
    """
    stages = []
    for name, fn in STAGES:
        fig, text, reports = fn(cfg)
        ran = any(v is not None for v in fig.values() if not isinstance(v, list)) or bool(
            fig.get("datasets")
        )
        stages.append(
            {
                "stage": name,
                "seconds": seconds.get(name),
                "figures": fig,
                "headline": text if ran else "not run",
                "reports": [str(p) for p in reports if p.exists()],
            }
        )
    total = sum(s["seconds"] for s in stages if s["seconds"] is not None)
    return {
        "version": SUMMARY_VERSION,
        "config": config_path,
        "run_name": cfg.run_name,
        "output_root": str(cfg.root),
        "setup_seconds": seconds.get("setup"),
        "stages_seconds": total,
        "stages": stages,
        "export_dir": str(cfg.export_dir) if cfg.export_dir.is_dir() else None,
    }


def wall_time(s: Optional[float]) -> str:
    """``586`` -> ``586 s (9.8 min)``; None -> ``-``."""
    if s is None:
        return "-"
    return f"{s:.0f} s" + (f" ({s / 60:.1f} min)" if s >= 60 else "")


def terminal_text(summary: dict) -> str:
    """The demo's last lines: an aligned table (stage | wall time | result), then reports and export paths."""
    rows = [("stage", "wall time", "result")]
    if summary.get("setup_seconds") is not None:
        rows.append(
            ("setup", wall_time(summary["setup_seconds"]), ".venv ready (scripts/setup.sh)")
        )
    rows += [(s["stage"], wall_time(s["seconds"]), s["headline"]) for s in summary["stages"]]
    rows.append(("01 -> 05", wall_time(summary["stages_seconds"]), ""))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    lines = [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    lines.insert(1, "-" * max(len(x) for x in lines))
    lines += ["", "reports:"]
    lines += [f"  {p}" for s in summary["stages"] for p in s["reports"]]
    lines.append(f"export (serve this folder): {summary['export_dir'] or 'none'}")
    return "\n".join(lines)


def markdown_table(summary: dict) -> str:
    """README's demo table (scripts/demo_table.py prints it): one row per stage (what it produced, wall
    time), the 01 -> 05 total, then one line with the set-up time."""
    lines = ["| stage | result | wall time |", "|---|---|---:|"]
    for s in summary["stages"]:
        lines.append(
            f"| {s['stage'][:2]} | {s['headline'].replace('|', '/')} | {wall_time(s['seconds'])} |"
        )
    lines.append(f"| **01 -> 05** | | **{wall_time(summary['stages_seconds'])}** |")
    if summary.get("setup_seconds") is not None:
        lines += [
            "",
            f"Set-up before it (`scripts/setup.sh`, run by `scripts/demo.sh`): {wall_time(summary['setup_seconds'])}.",
        ]
    return "\n".join(lines) + "\n"


def check_ran(summary: dict, cfg) -> None:
    """Raise a one-line :class:`UserError` when no stage left a report under ``cfg.root`` (a wrong
    ``output_root`` / config, or a run not started): there is nothing to summarise, so nothing is written."""
    from eagle3.errors import UserError

    if any(s["headline"] != "not run" for s in summary["stages"]):
        return
    where = f"{cfg.root} (no such folder)" if not cfg.root.is_dir() else str(cfg.root)
    raise UserError(
        f"output_root {where}: no stage outputs to summarise (looked for prompts_report.json, "
        f"shards/extract_report.json, data/data_report.json, train/train_report.json, bench/bench.json; "
        f"run the stages first or check --config / output_root)"
    )


def parse_seconds(items: list[str]) -> dict[str, float]:
    """``["01_prepare_prompts=306", ...]`` -> ``{"01_prepare_prompts": 306.0, ...}``; ValueError on a bad item."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise ValueError(f"--seconds: expected STAGE=SECONDS, got {it!r}")
        out[k] = float(v)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from eagle3.cli import ArgumentParser
    from eagle3.config import add_config_args, load_config
    from eagle3.io import atomic_write_json

    p = ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_config_args(p)
    p.add_argument(
        "--seconds",
        nargs="*",
        default=[],
        metavar="STAGE=SECONDS",
        help="wall time per stage (and setup)",
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)
    try:
        secs = parse_seconds(a.seconds)
    except ValueError as e:
        p.error(str(e))
    summary = collect(cfg, secs, a.config)
    check_ran(summary, cfg)
    out = cfg.root / SUMMARY_NAME
    atomic_write_json(out, summary)
    print(terminal_text(summary))
    print(f"summary: {out}  (README's demo table: python scripts/demo_table.py {out})")
    return 0


if __name__ == "__main__":
    from eagle3.cli import run_main

    run_main(main)
