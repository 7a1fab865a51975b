"""Long-context prompts for stage 05's context-length buckets (``benchmark.context_lengths``).

Each prompt is a chat whose earlier turns are GSM8K test problems with their worked answers (``eval/gsm8k_test.jsonl``
of the shared data, calculator annotations ``<<...>>`` removed) as user / assistant history, ending with one more
GSM8K question for the verifier to answer: real multi-turn context of the kind a served model sees, grown to a chosen
length. For every target length ``L`` (the bucket edges, :func:`capped_edges`) the builder makes ``per_length``
prompts, each with the most history pairs whose chat-rendered prompt (generation prompt included) has at most ``L``
tokens, so it lands in the bucket ending at ``L`` (:func:`eagle3.decoding.metrics.bucket_index`). Prompt ``i`` takes
its final question from the end of the file and its history from consecutive rows starting at an offset of its own,
so no two prompts of one length share their history start and no final question is in a history.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

from pydantic import BaseModel, StrictStr

from eagle3.data.eval_prompts import EvalPrompt, shared_file
from eagle3.errors import UserError, validated
from eagle3.io.read import iter_jsonl

SOURCE = "eval/gsm8k_test.jsonl"
#: the ``dataset`` label of the built set in ``bench.json``
LABEL = "context"
_CALC = re.compile(r"<<[^>]*>>")


def capped_edges(
    lengths: Sequence[int], max_positions: Optional[int], max_new_tokens: int, steps: int
) -> tuple[list[int], list[str]]:
    """The bucket edges: ``lengths`` (ascending) with each one past ``limit = max_positions - max_new_tokens - steps``
    (the longest prompt 05 decodes, :func:`eagle3.decoding.offline.check_context`) replaced by ``limit``, kept once;
    no cap without ``max_positions``.

    Returns:
        ``(edges, warnings)``: one warning line naming the lengths capped.

    Raises:
        UserError: ``limit`` < 1 (the verifier's context leaves no room for a prompt).
    """
    limit = max_positions - max_new_tokens - steps if max_positions else None
    if limit is None or all(n <= limit for n in lengths):
        return list(lengths), []
    if limit < 1:
        raise UserError(
            "benchmark.context_lengths: the verifier's context leaves no prompt tokens after max_new_tokens and "
            "steps; lower benchmark.max_new_tokens"
        )
    over = [n for n in lengths if n > limit]
    edges = sorted({min(n, limit) for n in lengths})
    return edges, [
        f"benchmark.context_lengths: {over} past the longest prompt the verifier's context allows ({limit} tokens "
        f"after max_new_tokens and steps): capped at {limit}"
    ]


def load_pairs() -> list[tuple[str, str]]:
    """``(question, answer)`` rows of GSM8K (:data:`SOURCE` in the shared data folder), annotations removed.

    Raises:
        UserError: the file is missing, or a row lacks a ``question`` / ``answer`` string (file:line).
    """
    path = shared_file(SOURCE, "the long-context source for benchmark.context_lengths")
    rows = (validated(_Pair, row, f"{path}:{lineno}") for lineno, row in iter_jsonl(path))
    return [(r.question, _CALC.sub("", r.answer)) for r in rows]


class _Pair(BaseModel):
    """A GSM8K row (other keys ignored)."""

    question: StrictStr
    answer: StrictStr


def _messages(pairs: Sequence[tuple[str, str]], start: int, n: int, final: str) -> list[dict]:
    """``n`` history pairs from ``pairs[start:]`` (wrapping) as user / assistant turns, then ``final`` as the user."""
    msgs = []
    for j in range(n):
        q, a = pairs[(start + j) % len(pairs)]
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": final}]


def build_context_prompts(
    count_tokens: Callable[[list[dict]], int],
    lengths: Sequence[int],
    per_length: int,
    pairs: Sequence[tuple[str, str]],
) -> list[EvalPrompt]:
    """``per_length`` prompts for each target length (module docstring), ids ``ctx{L}-{i}``, in length order.

    Args:
        count_tokens: the chat-rendered prompt length of a message list (05: the verifier's template, generation
            prompt included); it must grow with the history.
        lengths: target lengths in tokens (the bucket edges).
        per_length: prompts per length (>= 1).
        pairs: ``(question, answer)`` rows (:func:`load_pairs`); more than ``per_length``.

    Returns:
        the prompts; one whose final question alone passes ``L`` keeps no history (its bucket is then a later one).
    """
    if len(pairs) <= per_length:
        raise UserError(
            f"benchmark.context_prompts: {per_length} needs more than {len(pairs)} source rows; lower it"
        )
    # history rows; the last per_length rows are the final questions
    pool = pairs[: len(pairs) - per_length]
    stride = max(1, len(pool) // per_length)
    out = []
    for L in lengths:
        for i in range(per_length):
            final, start = pairs[len(pairs) - 1 - i][0], i * stride

            def fits(n: int) -> bool:
                return count_tokens(_messages(pool, start, n, final)) <= L

            # the most history pairs that fit: doubling, then bisection (fits(lo) or lo == 0)
            lo, hi = 0, 1
            while hi <= len(pool) and fits(hi):
                lo, hi = hi, hi * 2
            hi = min(hi, len(pool) + 1)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            out.append(EvalPrompt(id=f"ctx{L}-{i}", messages=_messages(pool, start, lo, final)))
    return out


def context_set(
    lengths: Sequence[int],
    per_length: int,
    count_tokens: Callable[[list[dict]], int],
    max_positions: Optional[int],
    max_new_tokens: int,
    steps: int,
    taken: Sequence[str] = (),
) -> tuple[tuple[str, list[EvalPrompt]], list[str]]:
    """05's long-context set: ``((label, prompts), warnings)`` for ``benchmark.context_lengths`` capped to the
    verifier's context (:func:`capped_edges`), built from :func:`load_pairs` (:func:`build_context_prompts`); the
    label is :data:`LABEL`, ``context#2``, ... when the other sets' labels ``taken`` hold it."""
    edges, warnings = capped_edges(lengths, max_positions, max_new_tokens, steps)
    prompts = build_context_prompts(count_tokens, edges, per_length, load_pairs())
    label, n = LABEL, 1
    while label in taken:
        n += 1
        label = f"{LABEL}#{n}"
    return (label, prompts), warnings
