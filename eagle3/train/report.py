"""What a training run reports: its parts (``segments``), ``train_report.{json,md}`` + ``loss.png``, 04's closing
lines, and an export's record of where its weights come from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.draft_config import EXPORT_META_FILE
from eagle3.errors import UserError
from eagle3.io import atomic_write_files, probe_dirs, read_json
from eagle3.train.metrics import read_metrics
from eagle3.train.sim_accept import BEST_FILE, markdown_lines, step_png

log = logging.getLogger(__name__)


def segment_record(
    start: int,
    end: int,
    hidden_states: Optional[str],
    backend: Optional[str],
    world_size: int,
    tokens_per_s: Optional[float],
    peak_gpu_mem_gib: Optional[float] = None,
    warnings: Sequence[str] = (),
) -> dict:
    """One part of a run (the steps one 04 call trained): ``{start_step, end_step, hidden_states, extract_backend (online
    only), world_size, tokens_per_s, peak_gpu_mem_gib, warnings}``.
    """
    return {
        "start_step": int(start),
        "end_step": int(end),
        "hidden_states": hidden_states,
        "extract_backend": backend if hidden_states == "online" else None,
        "world_size": int(world_size),
        "tokens_per_s": tokens_per_s,
        "peak_gpu_mem_gib": peak_gpu_mem_gib,
        "warnings": list(warnings),
    }


def earlier_segments(state: dict) -> list[dict]:
    """A checkpoint's ``segments``, each cut at its step; without the key, one part 0..step with ``hidden_states`` None."""
    step = int(state["step"])
    segs = state.get("segments")
    if not isinstance(segs, list):
        one = segment_record(0, step, None, None, int(state.get("world_size", 1)), None)
        return [one] if step > 0 else []
    segs = [g for g in segs if isinstance(g, dict) and int(g.get("start_step", step)) < step]
    return [{**g, "end_step": min(int(g["end_step"]), step)} for g in segs]


def state_source_switch(path: Path, earlier: list[dict], now: dict) -> Optional[str]:
    """The warning of a resume taking its states from another source than the checkpoint's last part (allowed: the same
    verifier's states up to storage rounding), else None.
    """
    last = earlier[-1] if earlier else {}
    if last.get("hidden_states") is None:
        return None

    def name(g: dict) -> str:
        return g["hidden_states"] + (
            f" (extract.backend {g['extract_backend']})" if g.get("extract_backend") else ""
        )

    if name(last) == name(now):
        return None
    return (
        f"{path}: steps {last['start_step']}-{last['end_step']} were trained with train.hidden_states "
        f"{name(last)}, this call trains with {name(now)} from step {now['start_step']}; the states are the same "
        f"verifier's up to the shards' storage rounding (bf16 / fp8) and the capture dtype; train_report.json "
        f"'segments' lists each part"
    )


def export_provenance(
    train_dir: Path, checkpoint, step: int, select_best: str, selected_step: int
) -> dict:
    """An export's ``trained_from`` (in ``eagle3_train.json``): ``{train_dir, checkpoint}`` (absolute; checkpoint None when
    absent), ``step`` (the run's), ``select_best``, ``selected_step`` (the step whose weights are exported).
    """
    return {
        "train_dir": str(Path(train_dir).resolve()),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
        "step": int(step),
        "select_best": select_best,
        "selected_step": int(selected_step),
    }


def peak_gpu_mem_gib(device: torch.device) -> Optional[float]:
    """Peak tensor memory this process allocated on ``device`` (GiB, ``max_memory_allocated``), None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def no_validation_note(step: int, stopped: bool = False) -> str:
    """The sentence of a run without a validation split (report, closing lines); ``stopped``: exported later."""
    what = (
        "an export (at the end of `--resume`, or `--export-only`) holds the last step's weights"
        if stopped
        else f"the export holds the last step's weights (step {step})"
    )
    return (
        f"no validation split (data.val_fraction is 0: stage 03's split.json has no 'val' samples), so no "
        f"validation loss, accuracy or simulated acceptance (tau); {what}; set data.val_fraction > 0 and re-run "
        f"03 and 04 to measure them"
    )


def headline(result: dict, train_dir: Path, args=None) -> str:
    """04's closing lines: steps, final validation loss and top-1 per TTT step, the drafter's shape (``args``), the report
    and the export.
    """
    val = result.get("final_val") or {}
    acc = [val[k] for k in _acc_keys(val)]
    text = f"trained: {result['step']}/{result['total_steps']} optimizer steps"
    if result.get("stop_at") and not result.get("stopped"):
        text += f" (--stop-at {result['stop_at']}: the lr followed the {result['total_steps']}-step schedule)"
    if "loss" in val:
        text += f"; final validation loss {val['loss']:.4f}"
    if acc:
        text += f", top-1 {' / '.join(f'{a:.3f}' for a in acc)} (TTT steps 0..{len(acc) - 1})"
    elif not val:
        text += "; " + (result.get("no_validation") or no_validation_note(result["step"]))
    picked = selected_weights_line(result)
    shape = [] if args is None else [f"drafter: {drafter_shape(args)}"]
    return "\n".join(
        [
            text,
            *([picked] if picked else []),
            *shape,
            f"report: {train_dir / 'train_report.md'}",
            f"export: {result['export_dir']}",
        ]
    )


def selected_weights_line(result: dict) -> Optional[str]:
    """``exported: the weights of step N, ...`` when ``train.select_best: sim_accept`` exported another step than the
    last, else None.
    """
    sa = result.get("sim_accept") or {}
    step, best = sa.get("exported_step"), sa.get("best") or {}
    if step is None or int(step) == int(result["step"]):
        return None
    k = sa.get("chain")
    last = next((r for r in sa.get("rows") or [] if r.get("step") == result["step"]), None)
    text = f"exported: the weights of step {step}, not the last step's (train.select_best: {sa.get('select_best')}"
    if best.get("step") == step:
        text += f": the best validation, tau_sim({k}) {best['tau_sim']:.4f}"
        if last is not None:
            text += f" against {last['tau_sim']:.4f} at step {result['step']}"
        if isinstance(best.get("loss"), (int, float)):
            text += f"; its validation loss {best['loss']:.4f}"
        if best.get("alpha"):
            text += f", top-1 {' / '.join(f'{a:.3f}' for a in best['alpha'])}"
    return text + ")"


def drafter_shape(args, hidden: bool = False) -> str:
    """``eagle3.1, 2 decoder layers, [MLA attention, ][hidden 576, ]MLP 6144, draft vocab 32000`` of a ``DrafterArgs``."""
    return (
        f"{args.variant}, {args.num_layers} decoder layer{'s' if args.num_layers > 1 else ''}, "
        + ("MLA attention, " if getattr(args, "is_mla", False) else "")
        + (f"hidden {args.hidden_size}, " if hidden else "")
        + f"MLP {args.intermediate_size}, draft vocab {args.draft_vocab_size}"
    )


def _export_line(result: dict) -> str:
    """The ``- export:`` value of ``train_report.md``: the folder, or why there is none."""
    if result.get("export_dir"):
        return f"`{result['export_dir']}`"
    if result.get("export_error"):
        return (
            f"**refused**: {result['export_error']}. Training finished and its checkpoint is kept: after the fix, "
            f"`04_train.py --export-only` exports it without retraining"
        )
    if result.get("stopped"):
        what = _export_only_what(result, "the newest checkpoint")
        return f"none (stopped before the end; `04_train.py --resume` goes on, `--export-only` exports {what})"
    return "none (no export was asked for)"


def _export_only_what(result: dict, checkpoint: str) -> str:
    """What ``--export-only`` exports of a stopped run: the best validation's weights, or ``checkpoint``."""
    sim = result.get("sim_accept") or {}
    best = sim.get("best") or {}
    if sim.get("select_best") == "sim_accept" and best.get("step") is not None:
        return f"step {best['step']}, the best validation's weights ({BEST_FILE})"
    return checkpoint


def record_export_only(
    train_dir: Path,
    export_dir: Path,
    checkpoint: Path,
    ckpt_step: int,
    weights_step: int,
    engine: str,
    select_best: Optional[str] = None,
) -> bool:
    """After ``--export-only``: rewrite ``train_report.{json,md}`` (``export_dir``, ``export_only``, ``other_exports``,
    ``sim_accept.exported_step``/``select_best``) when a report written at ``ckpt_step`` exists and the folder is
    writable (else a warning; the export stands). Returns whether it was rewritten.
    """
    path = train_dir / "train_report.json"
    if not path.is_file():
        return False
    try:
        report = read_json(path)
        args = DrafterArgs.from_json(report.pop("drafter_args"), source=f"{path}: drafter_args")
    except (UserError, KeyError, TypeError, ValueError) as e:
        log.warning("%s: not updated after --export-only (%s)", path, e)
        return False
    if report.get("step") != int(ckpt_step):
        log.warning(
            "%s: written at step %s, not at the exported checkpoint's step %d (%s): not updated",
            path,
            report.get("step"),
            ckpt_step,
            checkpoint,
        )
        return False
    report.pop("export_error", None)
    report["other_exports"] = _other_exports(report, train_dir, export_dir)
    report["export_dir"] = str(export_dir)
    done = dict(checkpoint=str(checkpoint), weights_step=int(weights_step), engine=engine)
    report["export_only"] = done
    try:  # a read-only train folder: the export stands
        probe_dirs(train_dir)
    except UserError as e:
        log.warning(
            "%s: not updated after --export-only (%s); the export in %s stands", path, e, export_dir
        )
        return False
    if isinstance(report.get("sim_accept"), dict):
        report["sim_accept"]["exported_step"] = int(weights_step)
        if select_best:
            report["sim_accept"]["select_best"] = select_best
    write_report(train_dir, report, args)
    return True


def _other_exports(report: dict, train_dir: Path, export_dir: Path) -> list[dict]:
    """The earlier exports of ``train_dir`` a report recorded that still exist, other than ``export_dir``."""
    earlier = [
        o.get("export_dir") for o in report.get("other_exports") or [] if isinstance(o, dict)
    ]
    others = [
        _export_record(Path(d), train_dir)
        for d in dict.fromkeys(earlier + [report.get("export_dir")])
        if d and Path(d).resolve() != Path(export_dir).resolve()
    ]
    return [o for o in others if o is not None]


def _export_record(folder: Path, train_dir: Path) -> Optional[dict]:
    """``{export_dir, engine, weights_step, select_best}`` of an export of ``train_dir`` in ``folder``, or None."""
    try:
        info = read_json(folder / EXPORT_META_FILE)
        src = info.get("trained_from") or {}
        if Path(src["train_dir"]).resolve() != Path(train_dir).resolve():
            return None
        return {
            "export_dir": str(folder),
            "engine": info["engine"],
            "weights_step": src.get("selected_step"),
            "select_best": src.get("select_best"),
        }
    except (UserError, OSError, KeyError, TypeError, AttributeError):
        return None


def export_failed(
    train_dir: Path, result: dict, args, sim_accept: dict, checkpoint, e: Exception
) -> Exception:
    """After a finished training whose selection or export failed: write the report anyway (``export_error``) and return
    the error to raise (a UserError says the checkpoint and report are kept and how to ``--export-only``; another
    error as it is).
    """
    why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    result["export_error"] = why
    result.setdefault("sim_accept", sim_accept)
    try:
        write_report(train_dir, result, args)
    except Exception as w:  # noqa: BLE001 - the export's error is the one to tell
        log.warning("train_report: could not be written after the failed export (%s)", w)
        return e
    if not isinstance(e, UserError):
        return e
    err = UserError(
        f"{why} [training finished: checkpoint {checkpoint} kept, report "
        f"{train_dir / 'train_report.md'}; after the fix, 04_train.py --export-only exports it "
        f"without retraining]"
    )
    err.exit_code = e.exit_code
    return err


def write_report(train_dir: Path, result: dict, args) -> None:
    """``train_report.json``, ``train_report.md`` and ``loss.png`` written as one set (:func:`eagle3.io.atomic_write_files`)."""
    report = dict(result, drafter_args=args.to_json())
    files = [
        (
            train_dir / "train_report.json",
            (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        ),
        (train_dir / "train_report.md", _report_markdown(result, args).encode("utf-8")),
    ]
    png = _loss_png(read_metrics(train_dir / "metrics.jsonl"))
    if png is not None:
        files.append((train_dir / "loss.png", png))
    atomic_write_files(files)


def _acc_keys(val: dict) -> list[str]:
    """The ``acc_{j}`` keys of a validation row in numeric order of ``j`` (a row may skip positions)."""
    return sorted((k for k in val if k.startswith("acc_")), key=lambda k: int(k.split("_")[-1]))


def _report_markdown(result: dict, args) -> str:
    """``train_report.md`` of :func:`write_report`."""
    val = result.get("final_val") or {}
    acc_keys = _acc_keys(val)
    lines = [
        "# Training report",
        "",
        f"- optimizer steps: {result['step']} / {result['total_steps']}"
        + (
            f" (ended at `--stop-at {result['stop_at']}` on the {result['total_steps']}-step lr schedule)"
            if result.get("stop_at") and not result.get("stopped")
            else ""
        ),
        f"- drafter: {drafter_shape(args, hidden=True)}",
        f"- checkpoint: `{result['checkpoint']}`",
        f"- export: {_export_line(result)}",
    ]
    picked = selected_weights_line(result) if result.get("export_dir") else None
    if picked:
        lines.append(f"- {picked}")
    lines += _export_notes(result)
    lines += [f"- **warning**: {w}" for w in result.get("warnings") or []]
    segs = result.get("segments") or []
    # a resumed run: each part's state source, processes and throughput, earlier calls' warnings
    if len(segs) > 1:
        lines.append("- trained in parts: " + "; ".join(_segment_text(g) for g in segs))
        lines += [
            f"- **warning** (steps {g['start_step']}-{g['end_step']}): {w}"
            for g in segs[:-1]
            for w in g.get("warnings") or []
        ]
    if result.get("tokens_per_s"):
        lines.append(
            f"- training throughput: {result['tokens_per_s']:.0f} tokens/s (all ranks"
            + (
                f"; this call's, steps {segs[-1]['start_step']}-{segs[-1]['end_step']})"
                if len(segs) > 1
                else ")"
            )
        )
    if result.get("peak_gpu_mem_gib") is not None:
        lines.append(f"- peak GPU memory (tensors, rank 0): {result['peak_gpu_mem_gib']:.1f} GiB")
    if "loss" in val:
        lines.append(f"- final validation loss: {val['loss']:.4f}")
    if acc_keys:
        lines += ["", "| TTT step | val top-1 acc |", "|---:|---:|"]
        lines += [f"| {k.split('_')[-1]} | {val[k]:.4f} |" for k in acc_keys]
    if result.get("no_validation"):  # instead of an empty simulated-acceptance table
        lines += ["", f"Validation: {result['no_validation']}."]
    elif result.get("sim_accept"):
        lines += ["", *markdown_lines(result["sim_accept"])]
    return "\n".join(lines) + "\n"


def _export_notes(result: dict) -> list[str]:
    """``train_report.md``'s lines on a stop by a signal and on later exports."""
    lines: list[str] = []
    if result.get("stopped"):
        lines.append(
            f"- **stopped** by signal {result.get('signal')} at step {result['step']}: no final validation"
            + (
                ", exported afterwards by `--export-only` (below)"
                if result.get("export_only")
                else ", no export; `04_train.py --resume` goes on, `--export-only` exports "
                + _export_only_what(result, "this checkpoint")
            )
        )
    if result.get("export_only"):
        e = result["export_only"]
        lines.append(
            f"- exported by `04_train.py --export-only` ({e['engine']}): the weights of step "
            f"{e['weights_step']} (checkpoint `{e['checkpoint']}`)"
        )
    lines += [
        f"- also exported: `{o['export_dir']}` ({o['engine']}, the weights of step {o['weights_step']}, "
        f"select_best: {o['select_best']})"
        for o in result.get("other_exports") or []
    ]
    return lines


def _segment_text(g: dict) -> str:
    """One part for ``train_report.md``: ``steps 0-40 offline, 1 process, 1234 tokens/s``."""
    how = g.get("hidden_states") or "hidden states not recorded"
    if g.get("extract_backend"):
        how += f" ({g['extract_backend']})"
    n = g.get("world_size")
    tps = f", {g['tokens_per_s']:.0f} tokens/s" if g.get("tokens_per_s") else ""
    return (
        f"steps {g['start_step']}-{g['end_step']} {how}, {n} process{'' if n == 1 else 'es'}{tps}"
    )


def _loss_png(rows: list[dict]) -> Optional[bytes]:
    """``loss.png``: train and val loss per step from ``metrics.jsonl`` rows (None without a train loss)."""
    tr = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and "loss" in r]
    va = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "val" and "loss" in r]
    if not tr:
        return None
    series = [(*zip(*tr), "-" if len(tr) > 1 else "o", {"label": "train"})]  # one row: a dot
    if va:
        series.append((*zip(*va), "o-", {"label": "val"}))
    return step_png("TTT loss", *series)
