"""The serve gate's verdicts: a real engine's greedy EAGLE-3 serving (vLLM's own spec-decode counters and the layers
it captured, as ``scripts/vllm_probe.py`` reports them) against the same engine without the draft (lossless) and
against 05's offline decoding of the same prompts (``bench.json`` ``per_prompt``), taking plain arguments.

Counts per prompt: ``verify_steps`` (verify forwards that had drafts), ``accepted`` (draft tokens accepted) and
``per_pos`` (``steps`` ints: accepted drafts at draft position k). fp32 greedy makes them exact: the gate asks for
equality."""

from __future__ import annotations

from typing import Optional, Sequence

from eagle3.errors import UserError


def served_counts(row: dict, steps: int) -> dict:
    """One prompt's counts from a probe row (``drafts``, ``accepted``, ``accepted_per_pos``: vLLM's counters)."""
    per_pos = [int(x) for x in row["accepted_per_pos"]][:steps]
    return {
        "verify_steps": int(row["drafts"]),
        "accepted": int(row["accepted"]),
        "per_pos": per_pos,
    }


def predicted_counts(row: dict, steps: int) -> dict:
    """One prompt's counts from 05's ``per_prompt`` row: its ``accept_lengths`` (tokens each verify step emitted,
    accepted drafts + 1)."""
    lengths = [int(n) for n in row["accept_lengths"]]
    per_pos = [sum(1 for n in lengths if n - 1 > k) for k in range(steps)]
    return {
        "verify_steps": len(lengths),
        "accepted": sum(n - 1 for n in lengths),
        "per_pos": per_pos,
    }


def tau(counts: Sequence[dict]) -> Optional[float]:
    """Mean tokens per verify step over ``counts``: 1 + accepted / verify_steps (None without a verify step)."""
    n = sum(c["verify_steps"] for c in counts)
    return 1.0 + sum(c["accepted"] for c in counts) / n if n else None


def judge(
    served: dict,
    plain: dict,
    predicted: Sequence[dict],
    trained_layers: Sequence[int],
    steps: int,
) -> dict:
    """The gate's verdict on one served draft folder.

    Args:
        served: the probe report with the draft (``aux_layers``, ``prompts``: rows with ``id``, ``tokens`` and the
            counters).
        plain: the probe report of the same engine without a draft (``prompts``: ``id``, ``tokens``).
        predicted: 05's ``per_prompt`` rows (``id``, ``accept_lengths``) for the trained layers, in the same order.
        trained_layers: the HF layers the drafter was trained on (its ``eagle3_train.json`` ``aux_layers``).
        steps: draft tokens per step (vLLM's ``num_speculative_tokens``, 05's ``--steps``).

    Returns:
        ``{"passed", "lossless", "layers_match", "counts_match", "captured", "trained", "served_tau",
        "predicted_tau", "reasons", "per_prompt": [{id, lossless, served, predicted, counts_match}]}``; ``passed``
        when every prompt's tokens equal the plain engine's, the captured layers equal the trained ones and every
        prompt's counts equal 05's.

    Raises:
        UserError: the three reports do not cover the same prompts in the same order.
    """
    ids = [r["id"] for r in served["prompts"]]
    if ids != [r["id"] for r in plain["prompts"]] or ids != [r["id"] for r in predicted]:
        raise UserError(
            "serve gate: the served, plain and predicted reports name different prompts; rerun all three"
        )
    rows = []
    for s, p, q in zip(served["prompts"], plain["prompts"], predicted):
        got, want = served_counts(s, steps), predicted_counts(q, steps)
        rows.append(
            {
                "id": s["id"],
                "lossless": s["tokens"] == p["tokens"],
                "tokens": len(s["tokens"]),
                "served": got,
                "predicted": want,
                "counts_match": got == want,
            }
        )
    captured = None if served.get("aux_layers") is None else list(served["aux_layers"])
    out = {
        "captured": captured,
        "trained": list(trained_layers),
        "lossless": all(r["lossless"] for r in rows),
        "layers_match": captured is not None and sorted(captured) == sorted(trained_layers),
        "counts_match": all(r["counts_match"] for r in rows),
        "served_tau": tau([r["served"] for r in rows]),
        "predicted_tau": tau([r["predicted"] for r in rows]),
        "per_prompt": rows,
    }
    out["reasons"] = reasons(out)
    out["passed"] = not out["reasons"]
    return out


def refused(
    error: str, predicted: Sequence[dict], trained_layers: Sequence[int], steps: int
) -> dict:
    """The verdict on a folder the engine refused to serve (``error``: its last error line): :func:`judge`'s keys,
    failed, with nothing served (``captured`` None, ``per_prompt`` empty) and 05's ``predicted_tau`` and
    ``predicted_per_pos`` kept for the report."""
    want = [predicted_counts(q, steps) for q in predicted]
    return {
        "captured": None,
        "trained": list(trained_layers),
        "lossless": False,
        "layers_match": False,
        "counts_match": False,
        "served_tau": None,
        "predicted_tau": tau(want),
        "predicted_verify_steps": sum(c["verify_steps"] for c in want),
        "predicted_accepted": sum(c["accepted"] for c in want),
        "predicted_per_pos": [sum(c["per_pos"][k] for c in want) for k in range(steps)],
        "per_prompt": [],
        "refused": error,
        "reasons": [f"the engine refused to serve it: {error}"],
        "passed": False,
    }


def reasons(verdict: dict) -> list[str]:
    """Why a verdict of :func:`judge` fails, one line each (empty: it passes)."""
    out = []
    lost = [r["id"] for r in verdict["per_prompt"] if not r["lossless"]]
    if lost:
        out.append(
            f"output differs from the engine without the draft on {len(lost)} prompts ({lost[0]}, ...)"
        )
    if not verdict["layers_match"]:
        out.append(
            f"the engine captured layers {verdict['captured']}, the drafter was trained on {verdict['trained']}"
        )
    off = [r["id"] for r in verdict["per_prompt"] if not r["counts_match"]]
    if off:
        out.append(
            f"served counts differ from 05's on {len(off)} prompts (tau {verdict['served_tau']:.4f} served, "
            f"{verdict['predicted_tau']:.4f} predicted)"
        )
    return out


def markdown(report: dict) -> str:
    """The gate's report as a Markdown table: one row per served folder (the candidate and each control), summed over
    the prompts."""
    lines = [
        f"# Serve gate: {report['engine']} `method: {report['method']}`, {report['num_prompts']} prompts, "
        f"{report['steps']} draft steps, fp32 greedy",
        "",
        f"Command: `{report['command']}`",
        "",
        "| folder | role | captured | trained | lossless | verify steps (served / 05) | accepted (served / 05) "
        "| tau served | tau 05 | per position served | per position 05 | served = 05 at the captured layers | gate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["folders"]:
        v = c["verdict"]
        if "refused" in v:
            lines.append(
                f"| {c['name']} | {c['role']} | - | {v['trained']} | refused | - / {v['predicted_verify_steps']} | "
                f"- / {v['predicted_accepted']} | - | {_f(v['predicted_tau'])} | - | {v['predicted_per_pos']} | - | "
                "FAIL |"
            )
            continue
        s = [r["served"] for r in v["per_prompt"]]
        q = [r["predicted"] for r in v["per_prompt"]]
        pos = [
            [sum(x["per_pos"][k] for x in rows) for k in range(report["steps"])] for rows in (s, q)
        ]
        lines.append(
            f"| {c['name']} | {c['role']} | {v['captured']} | {v['trained']} | "
            f"{sum(r['lossless'] for r in v['per_prompt'])}/{len(v['per_prompt'])} | "
            f"{sum(x['verify_steps'] for x in s)} / {sum(x['verify_steps'] for x in q)} | "
            f"{sum(x['accepted'] for x in s)} / {sum(x['accepted'] for x in q)} | "
            f"{_f(v['served_tau'])} | {_f(v['predicted_tau'])} | {pos[0]} | {pos[1]} | "
            f"{_at_captured(c)} | {'pass' if v['passed'] else 'FAIL'} |"
        )
    lines += [
        f"\n{c['name']}: the engine refused to serve it: `{c['verdict']['refused']}`"
        for c in report["folders"]
        if "refused" in c["verdict"]
    ]
    lines += ["", f"**Verdict: {'PASS' if report['passed'] else 'FAIL'}**: {report['summary']}", ""]
    return "\n".join(lines)


def _at_captured(folder: dict) -> str:
    """``yes (tau)`` / ``no (tau)``: whether the served counts equal 05's fed the layers the engine captured (the
    ``served_equals_05_at_captured_layers`` and ``tau_05_at_captured_layers`` keys); ``-`` when not measured."""
    if "served_equals_05_at_captured_layers" not in folder:
        return "-"
    same = "yes" if folder["served_equals_05_at_captured_layers"] else "no"
    return f"{same} (tau {_f(folder['tau_05_at_captured_layers'])})"


def _f(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def overall(folders: Sequence[dict]) -> tuple[bool, str]:
    """The gate passes when every ``candidate`` folder passes and every ``control`` folder fails:
    ``(passed, one-line summary)``."""
    bad = [
        f"{c['name']} ({c['role']}) {'failed' if c['role'] == 'candidate' else 'passed'}"
        for c in folders
        if c["verdict"]["passed"] != (c["role"] == "candidate")
    ]
    if bad:
        return False, "; ".join(bad)
    return True, "the candidate passes, every control fails"
