"""Benchmark (no model): stage 01's local regeneration schedule, round by round vs a ready pool.

Replays a real regenerated prompts file (01's ``prompts.jsonl[.gz]``: assistant messages carry
``tokens``, the ids the verifier generated) through two batching plans and counts what the GPU
would do, without running a model:

- ``rounds`` (the old plan): turn round k answers the k-th user turn of every conversation that has
  one, prompts sorted by length and cut into batches of ``--batch-size``; round k+1 starts when
  round k is done.
- ``pooled`` (:func:`eagle3.regen.regenerate.regenerate` now): a conversation's turn k+1 is ready as soon
  as its turn k is answered; every batch takes up to ``--batch-size`` ready turns of any round,
  chosen by :func:`eagle3.regen.regenerate.pick_batch`.

A ``generate`` batch runs until its longest answer stops, and decoding a small verifier is
launch-bound (a decode step costs about the same at 10 rows as at 1024 on an H200), so the GPU-time
figure is the decode steps summed over batches: per batch the longest answer's steps
(:func:`eagle3.regen.regenerate.answer_steps`: recorded tokens + the stop token, at most
``--max-new-tokens``; an answer of ``--max-new-tokens`` tokens counts as truncated). Prompt lengths
are the verifier tokenizer's ids of :func:`eagle3.chat.template.generation_prompt` of the recorded history,
exactly what 01 renders; turns whose prompt reaches ``--max-context`` (default: the config's
regeneration cap) are dropped with the conversation's later turns, as 01 does. Also reported: padded
prefill tokens (rows x widest prompt, summed over batches).

    python bench/regen_schedule.py --prompts outputs/.../prompts.jsonl.gz \\
        [--config configs/smollm2-135m-full.yaml] [--batch-size 1024] [--max-new-tokens 512] \\
        [--json bench/results/regen_schedule.json] [--md bench/results/regen_schedule.md]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eagle3.cli import ArgumentParser, non_negative_int, positive_int, run_main  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text  # noqa: E402
from eagle3.regen.regenerate import answer_steps, pick_batch  # noqa: E402

# one turn: (prompt tokens, recorded answer tokens); a conversation: its turns in order
Turn = tuple[int, int]


def recorded_turns(tokenizer, conv: dict, opts, max_context: int | None) -> list[Turn] | None:
    """``[(prompt_len, answer_len)]`` per regenerated turn of one 01 record, or None when the record
    was not regenerated in-process (an assistant message without ``tokens``: tool-call passthrough).

    ``prompt_len`` = ids of :func:`eagle3.chat.template.generation_prompt` of the messages up to that turn's
    user message (with the recorded earlier answers); ``answer_len`` = ``len(tokens)``. Turns from
    the first whose prompt has ``>= max_context`` ids are dropped (None = no cap).
    """
    from eagle3.chat.template import generation_prompt

    msgs = conv["messages"]
    answers = [j for j, m in enumerate(msgs) if m["role"] == "assistant"]
    if not answers or any("tokens" not in msgs[j] for j in answers):
        return None
    out = []
    for j in answers:
        head = generation_prompt(tokenizer, msgs[:j], opts, conv.get("tools"))
        n = len(tokenizer(head, add_special_tokens=False)["input_ids"])
        if max_context is not None and n >= max_context:
            break
        out.append((n, len(msgs[j]["tokens"])))
    return out


def plan_rounds(convs: list[list[Turn]], batch_size: int) -> list[list[tuple[int, int]]]:
    """The old round-synchronous plan: batches of ``(conversation, turn)`` pairs, round by round,
    each round's prompts sorted by (length, conversation) and cut into ``batch_size`` chunks."""
    batches = []
    for k in range(max((len(t) for t in convs), default=0)):
        todo = sorted(
            (i for i, t in enumerate(convs) if len(t) > k), key=lambda i: (convs[i][k][0], i)
        )
        batches += [
            [(i, k) for i in todo[b : b + batch_size]] for b in range(0, len(todo), batch_size)
        ]
    return batches


def plan_pooled(convs: list[list[Turn]], batch_size: int) -> list[list[tuple[int, int]]]:
    """The ready-pool plan of :func:`eagle3.regen.regenerate.regenerate`: batches of ``(conversation, turn)``
    pairs chosen by :func:`eagle3.regen.regenerate.pick_batch` among each conversation's next turn."""
    nxt = {i: 0 for i, t in enumerate(convs) if t}  # conversation -> its ready turn
    batches = []
    while nxt:
        pool = sorted(nxt)
        pick = pick_batch(
            [convs[i][nxt[i]][0] for i in pool], [len(convs[i]) - nxt[i] for i in pool], batch_size
        )
        batch = [(pool[j], nxt[pool[j]]) for j in pick]
        for i, k in batch:
            if k + 1 < len(convs[i]):
                nxt[i] = k + 1
            else:
                del nxt[i]
        batches.append(batch)
    return batches


def plan_figures(
    convs: list[list[Turn]], batches: list[list[tuple[int, int]]], max_new_tokens: int
) -> dict:
    """``batches``, ``answers``, ``decode_steps`` (sum over batches of the longest answer's
    :func:`eagle3.regen.regenerate.answer_steps`), ``prefill_tokens`` (prompt ids) and
    ``padded_prefill_tokens`` (rows x widest prompt, summed over batches)."""
    steps = padded = real = rows = 0
    for batch in batches:
        turns = [convs[i][k] for i, k in batch]
        steps += max(answer_steps(n, n < max_new_tokens, max_new_tokens) for _, n in turns)
        padded += len(turns) * max(p for p, _ in turns)
        real += sum(p for p, _ in turns)
        rows += len(turns)
    return {
        "batches": len(batches),
        "answers": rows,
        "decode_steps": steps,
        "prefill_tokens": real,
        "padded_prefill_tokens": padded,
    }


def prefix_reuse(convs: list[list[Turn]]) -> dict:
    """How much of the prefill a KV-cache prefix reuse across a conversation's turns would skip.

    Turn k of a conversation (k >= 1) re-prefills the history that turn k-1 already had in the cache: its prompt and
    its answer, ``p[k-1] + a[k-1]`` tokens (at most ``p[k]``; a chat template that renders the history differently
    than it generated it would keep less). Returns ``prefill_tokens`` (every turn's prompt, as 01 prefills today),
    ``reusable_tokens`` (those cached prefixes) and their ratio ``reusable_share``.
    """
    total = sum(p for turns in convs for p, _ in turns)
    reusable = sum(
        min(turns[k][0], turns[k - 1][0] + turns[k - 1][1])
        for turns in convs
        for k in range(1, len(turns))
    )
    return {
        "prefill_tokens": total,
        "reusable_tokens": reusable,
        "reusable_share": round(reusable / total, 4) if total else 0.0,
    }


def compare(convs: list[list[Turn]], batch_size: int, max_new_tokens: int) -> dict:
    """Both plans' figures, new/old ratios, and the pooled plan's lower bound on batches: the
    longest conversation (one batch per turn) or the answers / ``batch_size``, whichever is larger."""
    old = plan_figures(convs, plan_rounds(convs, batch_size), max_new_tokens)
    new = plan_figures(convs, plan_pooled(convs, batch_size), max_new_tokens)
    answers = sum(len(t) for t in convs)
    ratio = {
        k: (new[k] / old[k] if old[k] else None)
        for k in ("batches", "decode_steps", "padded_prefill_tokens")
    }
    return {
        "rounds": old,
        "pooled": new,
        "ratio_pooled_over_rounds": ratio,
        "longest_conversation_turns": max((len(t) for t in convs), default=0),
        "min_batches": max(
            max((len(t) for t in convs), default=0), math.ceil(answers / batch_size)
        ),
    }


def markdown(res: dict) -> str:
    """A Markdown table of both plans and the ratio."""
    r = res["ratio_pooled_over_rounds"]
    lines = [
        f"Stage 01 regeneration schedule, replayed without a model: {res['conversations']} conversations, "
        f"{res['answers']} answers (longest conversation {res['longest_conversation_turns']} turns), "
        f"batch size {res['batch_size']}, max_new_tokens {res['max_new_tokens']}, "
        f"context cap {res['max_context']}. Source: `{res['source']}`.",
        "",
        "| plan | batches | decode steps | padded prefill tokens | prefill padding |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("rounds", "pooled"):
        f = res[name]
        pad = (
            1 - f["prefill_tokens"] / f["padded_prefill_tokens"]
            if f["padded_prefill_tokens"]
            else 0.0
        )
        lines.append(
            f"| {name} | {f['batches']} | {f['decode_steps']} | {f['padded_prefill_tokens']} | {pad:.1%} |"
        )
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines.append(
        f"| pooled / rounds | {fmt(r['batches'])} | {fmt(r['decode_steps'])} | "
        f"{fmt(r['padded_prefill_tokens'])} | |"
    )
    lines += [
        "",
        f"Lower bound on pooled batches: {res['min_batches']} (longest conversation, or answers / batch size). "
        "Decode steps = sum over batches of the longest answer (tokens + stop, at most max_new_tokens): "
        "the GPU-time figure of a launch-bound decoder.",
    ]
    if "prefix_reuse" in res:
        pr = res["prefix_reuse"]
        lines += [
            "",
            f"Prefix reuse across turns: {pr['reusable_tokens']} of {pr['prefill_tokens']} prompt tokens "
            f"({pr['reusable_share']:.1%}) are the previous turn's prompt + answer, which a KV-cache prefix reuse "
            "would not prefill again.",
        ]
    return "\n".join(lines) + "\n"


def regen_args(prompts_help: str) -> ArgumentParser:
    """The flags this script and ``bench/regen_speed.py`` share: config, overrides, prompts file, batch
    size, answer budget and the JSON / Markdown outputs."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        "-c",
        default=str(ROOT / "configs" / "smollm2-135m-full.yaml"),
        help="run YAML: the verifier, its chat options, the default batch size, max_new_tokens and "
        "context cap (default: configs/smollm2-135m-full.yaml)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field (value parsed as YAML); repeatable",
    )
    p.add_argument("--prompts", type=Path, required=True, help=prompts_help)
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="default: prompts.gen_batch_size"
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=None, help="default: prompts.max_new_tokens"
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--md", type=Path, default=None, help="write the Markdown table here")
    return p


def emit(a, res: dict, md: str) -> int:
    """Print the Markdown table; write ``--json`` / ``--md`` when given (atomically). Returns 0."""
    print(md, end="")
    if a.json:
        atomic_write_json(a.json, res)
    if a.md:
        atomic_write_text(a.md, md)
    return 0


def main(argv=None) -> int:
    p = regen_args("a regenerated 01 prompts.jsonl[.gz]")
    p.add_argument(
        "--max-context",
        type=non_negative_int,
        default=None,
        help="context cap in tokens, 0 = none (default: prompts.max_context_tokens or extract.max_length)",
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, help="only the first N conversations"
    )
    a = p.parse_args(argv)
    cfg = load_config(a.config, a.overrides)

    from tqdm import tqdm

    from eagle3.capture.prompts import read_prompts
    from eagle3.chat.template import ChatOptions
    from eagle3.regen.manifest import max_context_tokens
    from eagle3.verifier.load import load_tokenizer

    batch_size = a.batch_size or cfg.prompts.gen_batch_size
    max_new = a.max_new_tokens or cfg.prompts.max_new_tokens
    cap = max_context_tokens(cfg) if a.max_context is None else (a.max_context or None)
    tok = load_tokenizer(cfg.verifier)
    opts = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    records = read_prompts(a.prompts, a.limit)
    t0 = time.perf_counter()
    convs, passthrough = [], 0
    for rec in tqdm(records, desc="prompt lengths", unit="conv"):
        turns = recorded_turns(tok, rec, opts, cap)
        if turns is None:
            passthrough += 1
        elif turns:
            convs.append(turns)
    res = {
        "source": str(a.prompts),
        "verifier": cfg.verifier.display_name(),
        "records": len(records),
        "conversations": len(convs),
        "not_regenerated": passthrough,
        "answers": sum(len(t) for t in convs),
        "answers_recorded": sum(
            sum(m["role"] == "assistant" for m in r["messages"]) for r in records
        ),
        "batch_size": batch_size,
        "max_new_tokens": max_new,
        "max_context": cap,
        "prompt_lengths_s": round(time.perf_counter() - t0, 1),
        "prefix_reuse": prefix_reuse(convs),
        **compare(convs, batch_size, max_new),
    }
    return emit(a, res, markdown(res))


if __name__ == "__main__":
    run_main(main)
