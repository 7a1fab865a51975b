"""Benchmark: host-dispatched ops per greedy token and per EAGLE-3 round at batch 1 (05's decoding loops).

At batch 1 a small verifier's decode is host-bound: on the H200 (lease 2026-12-03b) greedy decoding of SmolLM2-135M
cost 21.8 ms a token for ~0.07 ms of weight reads. A round of EAGLE-3 cost 27.3 ms of verify forward + 5.4 ms of
drafting (1.50x a greedy token), which caps the batch-1 speedup at tau / 1.50. The ops PyTorch dispatches are the
host cost's unit and the same on every device, so this script counts them on any machine. It profiles
:func:`eagle3.decoding.decode.greedy_generate_batch` and :func:`~eagle3.decoding.decode.speculative_generate_batch`
on one prompt (``torch.profiler``, CPU activity only), with the drafter and verify phases of 05's own phase timer
and each verifier forward as labelled ranges. It reports top-level ops (those whose parent is no other op) per greedy
token, and per round split into draft / verify forward / verify bookkeeping, plus the round-to-token ratio. The
ratio is the host-bound batch-1 cost model: speedup ~ tau / ratio. ``--top`` lists the op names whose per-forward
counts differ most between a verify forward and a greedy one.

An untrained drafter of the verifier's shape drafts. Per-round counts do not depend on what it accepts, only the
number of rounds does.

    python bench/batch1_host_ops.py --config configs/smollm2-135m.yaml --json bench/results/batch1_host_ops.json \\
        --md bench/results/batch1_host_ops.md

CPU smoke (tests/bench/test_batch1_host_ops.py): ``--tiny`` (a random 2-layer Llama).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text  # noqa: E402

PHASES = ("draft", "verify forward", "verify bookkeeping")


def _labelled(dec):
    """Wrap 05's phase timer and verifier forward in ``record_function`` ranges (``PH_draft``, ``PH_verify``,
    ``PH_fwd``); returns a function that undoes it."""
    from torch.profiler import record_function

    start, stop, fwd = dec.PhaseTimer.start, dec.PhaseTimer.stop, dec._forward
    open_ = {}

    def start_(self, name):
        open_[name] = record_function(f"PH_{name}")
        open_[name].__enter__()
        start(self, name)

    def stop_(self, name):
        stop(self, name)
        open_.pop(name).__exit__(None, None, None)

    def fwd_(*a, **k):
        with record_function("PH_fwd"):
            return fwd(*a, **k)

    dec.PhaseTimer.start, dec.PhaseTimer.stop, dec._forward = start_, stop_, fwd_

    def undo():
        dec.PhaseTimer.start, dec.PhaseTimer.stop, dec._forward = start, stop, fwd

    return undo


def _ranges(e) -> list[str]:
    names, p = [], e.cpu_parent
    while p is not None:
        if p.name.startswith("PH_"):
            names.append(p.name)
        p = p.cpu_parent
    return names


def top_level_ops(events) -> list[tuple[str, list[str]]]:
    """``(op name, enclosing PH_ ranges innermost first)`` for every op whose parent is a ``PH_`` range or none."""
    out = []
    for e in events:
        if e.name.startswith("PH_"):
            continue
        p = e.cpu_parent
        if p is None or p.name.startswith("PH_"):
            out.append((e.name, _ranges(e)))
    return out


def count(
    model, drafter, prompt: list[int], aux: list[int], steps: int, max_new: int, top: int = 12
) -> dict:
    """Profile one greedy and one EAGLE-3 decode of ``prompt`` (batch 1); the per-token / per-round op counts.

    Returns:
        ``greedy``: ``forwards``, ``ops`` (top-level ops, prefill included), ``ops_per_token`` (decode forwards'
        ops / decode forwards); ``eagle3``: ``rounds``, ``ops``, ``per_round`` {phase: ops}, ``ops_per_round``;
        ``ratio_round_to_token``; ``verify_vs_greedy_forward``: [op, greedy per forward, verify per forward] rows.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    import eagle3.decoding.decode as dec

    undo = _labelled(dec)
    try:
        with torch.inference_mode():
            dec.greedy_generate_batch(
                model, [prompt], 2
            )  # warm both paths (lazy inits are not per-token costs)
            dec.speculative_generate_batch(
                model, drafter, [prompt], aux, steps=steps, max_new_tokens=2
            )
            with profile(activities=[ProfilerActivity.CPU]) as pg:
                dec.greedy_generate_batch(model, [prompt], max_new)
            with profile(activities=[ProfilerActivity.CPU]) as ps:
                s = dec.speculative_generate_batch(
                    model, drafter, [prompt], aux, steps=steps, max_new_tokens=max_new
                )
    finally:
        undo()
    gops, sops = top_level_ops(pg.events()), top_level_ops(ps.events())
    n_fwd = sum(1 for e in pg.events() if e.name == "PH_fwd")
    tok = (len(gops) - _first_forward_ops(pg.events())) / max(
        1, n_fwd - 1
    )  # decode forwards + the loop's own ops
    phase = Counter()
    verify_fwd = Counter()
    for n, r in sops:
        if "PH_draft" in r:
            phase["draft"] += 1
        elif "PH_verify" in r and r[:1] == ["PH_fwd"]:
            phase["verify forward"] += 1
            verify_fwd[n] += 1
        elif "PH_verify" in r:
            phase["verify bookkeeping"] += 1
        else:
            phase["prefill and loop"] += 1
    rounds = max(1, s.rounds)
    per_round = {k: phase[k] / rounds for k in PHASES}
    ops_round = sum(per_round.values())
    gfwd = Counter(n for n, r in gops if r[:1] == ["PH_fwd"])
    diffs = []
    for n in set(gfwd) | set(verify_fwd):
        a, b = gfwd[n] / max(1, n_fwd), verify_fwd[n] / rounds
        if abs(a - b) >= 0.5:
            diffs.append([n, round(a, 1), round(b, 1)])
    diffs.sort(key=lambda r: -abs(r[2] - r[1]))
    return {
        "greedy": {"forwards": n_fwd, "ops": len(gops), "ops_per_token": tok},
        "eagle3": {
            "rounds": s.rounds,
            "ops": len(sops),
            "per_round": per_round,
            "ops_per_round": ops_round,
            "prefill_and_loop_ops": phase["prefill and loop"],
        },
        "ratio_round_to_token": ops_round / tok if tok else None,
        "verify_vs_greedy_forward": diffs[:top],
    }


def _first_forward_ops(events) -> int:
    """Top-level ops inside the first ``PH_fwd`` range (the prefill)."""
    first = min((e for e in events if e.name == "PH_fwd"), key=lambda e: e.time_range.start)
    return sum(
        1
        for e in events
        if e.cpu_parent is not None and e.cpu_parent.id == first.id and not e.name.startswith("PH_")
    )


def markdown(res: dict) -> str:
    g, s = res["greedy"], res["eagle3"]
    d = res.get("drafter")
    shape = (
        f", a random {d['variant']} drafter of {d['num_layers']} layer{'s' if d['num_layers'] > 1 else ''} "
        f"(MLP {d['intermediate_size']})"
        if d
        else ""
    )
    lines = [
        f"Host-dispatched ops at batch 1, {res['verifier']}{shape}, chain of {res['steps']}, {res['max_new_tokens']} "
        f"new tokens (top-level ops: those no other op dispatched).",
        "",
        "| what | ops |",
        "|---|---:|",
        f"| greedy: per token (decode forward + loop) | {g['ops_per_token']:.0f} |",
    ]
    lines += [f"| EAGLE-3 round: {k} | {s['per_round'][k]:.0f} |" for k in PHASES]
    lines += [
        f"| EAGLE-3 round: all | {s['ops_per_round']:.0f} |",
        f"| **round / greedy token** | **{res['ratio_round_to_token']:.2f}** |",
        "",
        "Host-bound batch-1 speedup ~ tau / (round / greedy token).",
        "",
    ]
    if res["verify_vs_greedy_forward"]:
        lines += ["| op | per greedy forward | per verify forward |", "|---|---:|---:|"]
        lines += [f"| `{n}` | {a} | {b} |" for n, a, b in res["verify_vs_greedy_forward"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from eagle3.config import load_config

    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", help="run YAML (its verifier; not needed with --tiny)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a random 2-layer Llama instead of the config's verifier",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=24)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--top", type=positive_int, default=12)
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    import torch
    from offline_bench_speed import _random_drafter

    torch.manual_seed(0)
    if a.tiny:
        from regen_step import tiny_model

        model, name = tiny_model(), "tiny random Llama (2 layers)"
        prompt = [int(x) for x in torch.randint(3, model.config.vocab_size, (12,))]
        aux = [1, 1, 1]
    else:
        if not a.config:
            p.error("--config is required without --tiny")
        from eagle3.engines.layers import default_aux_layers
        from eagle3.verifier.load import load_verifier, verifier_dims

        cfg = load_config(a.config, a.overrides)
        vcfg = cfg.verifier.model_copy(update={"dtype": "float32", "device": "cpu"})
        model, tok = load_verifier(vcfg, torch.device("cpu"))
        name = cfg.verifier.name or cfg.verifier.path
        prompt = tok("Write a short poem about the sea.")["input_ids"]
        aux = cfg.extract.aux_layers or default_aux_layers(
            verifier_dims(model.config)["num_layers"]
        )
    model.eval()
    drafter = _random_drafter(
        model, torch.device("cpu"), torch.float32, None if a.tiny else cfg.drafter
    )
    shape = {
        "num_layers": drafter.args.num_layers,
        "variant": drafter.args.variant,
        "intermediate_size": drafter.args.intermediate_size,
    }
    res = {
        "verifier": name,
        "drafter": shape,
        "steps": a.steps,
        "max_new_tokens": a.max_new_tokens,
        "aux_layers": list(aux),
        **count(model, drafter, prompt, list(aux), a.steps, a.max_new_tokens, a.top),
    }
    md = markdown(res)
    print(md)
    for path, write, obj in ((a.json, atomic_write_json, res), (a.md, atomic_write_text, md)):
        if path:
            write(path, obj)
    return 0


if __name__ == "__main__":
    run_main(main)
