"""Benchmark (GPU): stage 01's local regeneration wall time, round-by-round vs ready-pool schedule.

Runs :func:`eagle3.prompts.regenerate.regenerate` on the same conversations twice in one process, with
``schedule="rounds"`` (the former plan: every turn k before any turn k+1) and ``schedule="pool"``
(the ready pool of :func:`eagle3.prompts.regenerate.pick_batch`), after a short warm-up ``generate``, and
prints each run's seconds, answers/s, batches and decode steps (sum over batches of the longest
answer), the ratio pool/rounds, and how many answers are identical (greedy answers do not depend
on the schedule up to floating-point rounding of different batch compositions).

Conversations: ``--num`` records spread evenly over ``--prompts`` (a 01 prompts file; its user turns
are re-answered, its assistant turns ignored), so the multi-turn share matches the file. Scale
``--batch-size`` with the subset (e.g. 2,000 of 16,197 conversations at 256 instead of 1024-2048) so the
first-turn bulk spans as many batches as in the full run: the pool's gain is the multi-turn rounds
folded into the bulk. ``bench/regen_schedule.py`` predicts the decode-step ratio without a model.

    python bench/regen_speed.py --prompts outputs/gpu-20261201/prompts.jsonl.gz \\
        [--config configs/smollm2-135m-full.yaml] [--num 2000] [--batch-size 256] [--json out.json]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from eagle3.cli import positive_int, run_main  # noqa: E402
from eagle3.config import load_config  # noqa: E402

SCHEDULES = ("rounds", "pool")


def spread(records: list, num: int) -> list:
    """``num`` records at evenly spaced positions (all of them when ``num >= len(records)``)."""
    if num >= len(records):
        return list(records)
    return [records[i * len(records) // num] for i in range(num)]


def markdown(res: dict) -> str:
    """Markdown table of both runs and the ratio."""
    lines = [f"Stage 01 local regeneration, {res['conversations']} conversations ({res['multi_turn']} multi-turn), "
             f"batch size {res['batch_size']}, max_new_tokens {res['max_new_tokens']}, context cap "
             f"{res['max_context']}, {res['device']}.", "",
             "| schedule | seconds | answers | answers/s | batches | decode steps | ms / decode step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in SCHEDULES:
        r = res["runs"][name]
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['answers']} | {r['answers_per_s']:.1f} | {r['batches']} | "
                     f"{r['decode_steps']} | {r['ms_per_decode_step']:.1f} |")
    q = res["ratio_pool_over_rounds"]
    lines.append(f"| pool / rounds | {q['seconds']:.3f} | | | {q['batches']:.3f} | {q['decode_steps']:.3f} | |")
    lines += ["", f"Identical answers: {res['identical_answers']} of {res['answers_compared']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from regen_schedule import emit, regen_args

    p = regen_args("a 01 prompts.jsonl[.gz] (its user turns are answered)")
    p.description = __doc__.splitlines()[0]
    p.add_argument("--num", type=positive_int, default=2000, help="conversations, spread over the file")
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)

    import torch

    from eagle3.prompts.chat import ChatOptions, end_of_turn_ids
    from eagle3.capture.extract import read_prompts
    from eagle3.prompts.prepare_prompts import max_context_tokens
    from eagle3.prompts.regenerate import generate_greedy, regenerate
    from eagle3.verifier import load_verifier

    batch_size = a.batch_size or cfg.prompts.gen_batch_size
    max_new = a.max_new_tokens or cfg.prompts.max_new_tokens
    cap = max_context_tokens(cfg)
    convs = spread(read_prompts(a.prompts), a.num)
    model, tok = load_verifier(cfg.verifier)
    opts = ChatOptions.from_config(cfg)
    dev = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tok("Hello, how are you?", add_special_tokens=False)["input_ids"]
    generate_greedy(model, [ids] * 8, 16, end_of_turn_ids(tok), pad)  # warm-up: kernels, allocator
    runs, outs = {}, {}
    for name in SCHEDULES:
        stats: dict = {}
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs[name] = regenerate(model, tok, convs, max_new, batch_size, stats=stats, opts=opts, max_context=cap,
                                schedule=name)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        runs[name] = {**stats, "seconds": round(dt, 2), "answers_per_s": stats["answers"] / dt,
                      "ms_per_decode_step": 1000 * dt / max(1, stats["decode_steps"])}
        print(f"{name}: {stats['answers']} answers in {dt:.1f} s, {stats['batches']} batches, "
              f"{stats['decode_steps']} decode steps", flush=True)
    pairs = [(m["tokens"], n["tokens"]) for c, d in zip(outs["rounds"], outs["pool"])
             for m, n in zip(c["messages"], d["messages"]) if "tokens" in m and "tokens" in n]
    res = {"verifier": cfg.verifier.display_name(), "device": str(torch.cuda.get_device_name(dev))
           if dev.type == "cuda" else str(dev), "source": str(a.prompts), "conversations": len(convs),
           "multi_turn": sum(1 for c in convs if sum(m["role"] == "user" for m in c["messages"]) > 1),
           "batch_size": batch_size, "max_new_tokens": max_new, "max_context": cap, "runs": runs,
           "ratio_pool_over_rounds": {k: runs["pool"][k] / runs["rounds"][k] if runs["rounds"][k] else None
                                      for k in ("seconds", "batches", "decode_steps")},
           "identical_answers": sum(x == y for x, y in pairs), "answers_compared": len(pairs)}
    return emit(a, res, markdown(res))


if __name__ == "__main__":
    run_main(main)
