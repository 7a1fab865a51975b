"""Stage 01's selection: every ``prompts.source`` read (in order), deduped, sampled, the self-instruct prompts on
top, the first ``--limit`` kept. Takes the ``prompts:`` config section (``prompts``), no run config."""

from __future__ import annotations

import logging
import random
from collections import Counter
from pathlib import Path
from typing import Optional

from eagle3.capture.prompts import require_prompts_file
from eagle3.chat.template import has_tool_calls
from eagle3.data.readers import dedupe, read_conversations, sample, short_pool_warning, unique_ids
from eagle3.errors import UserError
from eagle3.process_group import is_rank0
from eagle3.regen.report import limit_drops_self_instruct, read_counts_text

log = logging.getLogger(__name__)


def select_conversations(
    prompts, think_tags: tuple[str, str], self_instruct_path: Path, limit: Optional[int]
) -> tuple[list[dict], Counter, dict]:
    """Read every source in order, dedupe, sample ``prompts.sample_size`` (seeded), join them
    ``prompts.chain_conversations`` at a time (:func:`chain`), keep ``limit``.

    Returns:
        ``(conversations, counts, steps)``: the reader's counts and ``normalised``, ``deduped``,
        ``sampled_out``, ``chained_into`` (the conversations after :func:`chain`; only when it joins),
        ``limited_out``.

    Raises:
        UserError: no usable conversation left.
    """
    pc, counts = prompts, Counter()
    convs = _read_sources(pc, think_tags, counts)
    n_read_ok = len(convs)
    n_dup = 0
    if pc.dedupe:
        convs, n_dup = dedupe(convs)
    n_before = len(convs)
    short = short_pool_warning(
        "prompts.sample_size",
        pc.sample_size,
        n_before,
        "conversations left after reading" + (" and dedupe" if pc.dedupe else ""),
    )
    if short and is_rank0():  # asked for more than there are: say so (once under torchrun)
        log.warning("%s", short)
    convs = sample(convs, pc.sample_size, pc.seed)
    n_sampled = len(convs)
    convs = chain(convs, pc.chain_conversations, pc.seed)
    if not convs:
        hint = (
            "; prompt-only sources need prompts.regenerate: true (the verifier writes the answers)"
            if counts.get("skipped_no_assistant") and not pc.regenerate
            else ""
        )
        raise UserError(
            f"prompts.source: no usable conversation in '{pc.source}': {read_counts_text(counts)}{hint}"
        )
    steps = {"normalised": n_read_ok, "deduped": n_dup, "sampled_out": n_before - n_sampled}
    if pc.chain_conversations > 1:
        steps["chained_into"] = len(convs)
    # on top of the sampled sources (sample_size counts the sources only)
    if pc.self_instruct is not None:
        convs, steps["self_instruct"], steps["self_instruct_deduped"] = add_self_instruct(
            pc, think_tags, self_instruct_path, convs
        )
    return _apply_limit(convs, limit, steps, pc.self_instruct is not None), counts, steps


def chain(conversations: list[dict], k: int, seed: int) -> list[dict]:
    """``prompts.chain_conversations``: the conversations without tools or tool calls, in a ``random.Random(seed)``
    shuffle, joined ``k`` at a time into one chat (the last one may join fewer): each one's messages after the
    previous one's, a system message kept only where the chat starts, the id the joined ids with ``+`` between.
    Those with tools stay alone and come first, in their order. ``k == 1``: ``conversations`` as they are."""
    if k == 1:
        return conversations
    alone, rest = [], []
    for c in conversations:
        (alone if c.get("tools") or has_tool_calls(c) else rest).append(c)
    random.Random(seed).shuffle(rest)
    out = []
    for i in range(0, len(rest), k):
        group = rest[i : i + k]
        msgs = list(group[0]["messages"])
        for c in group[1:]:
            msgs += [m for m in c["messages"] if m["role"] != "system"]
        out.append({"id": "+".join(c["id"] for c in group), "messages": msgs})
    return alone + out


def _read_sources(pc, think_tags: tuple[str, str], counts: Counter) -> list[dict]:
    """Every ``prompts.source`` read in order and concatenated (``counts``: the readers' counts), ids repeated
    across the sources made unique (``#2``, ``#3``, as within one file)."""
    sources = [pc.source] if isinstance(pc.source, str) else list(pc.source)
    convs = []
    for src in sources:
        convs += read_conversations(
            src,
            pc.format,
            hf_split=pc.hf_split,
            keep_prompt_only=pc.regenerate,
            system_prompt=pc.system_prompt,
            counts=counts,
            think_tags=tuple(think_tags),
        )
    return unique_ids(convs)


def _apply_limit(
    convs: list[dict], limit: Optional[int], steps: dict, self_instruct: bool
) -> list[dict]:
    """The first ``limit`` conversations (``steps["limited_out"]``: how many cut); with self-instruct prompts (they
    come last, so --limit cuts them first) ``steps["self_instruct_limited_out"]`` and a warning (rank 0) when any."""
    steps["limited_out"] = 0
    if limit is not None and len(convs) > limit:
        steps["limited_out"] = len(convs) - limit
        convs = convs[:limit]
    if self_instruct:
        steps["self_instruct_limited_out"] = dropped = min(
            steps["self_instruct"], steps["limited_out"]
        )
        if dropped and is_rank0():
            n_si, total = steps["self_instruct"], len(convs) + steps["limited_out"]
            log.warning(limit_drops_self_instruct("--limit", limit, n_si, dropped, total))
    return convs


def add_self_instruct(
    prompts, think_tags: tuple[str, str], self_instruct_path: Path, convs: list[dict]
) -> tuple[list[dict], int, int]:
    """``convs`` followed by the prompts of ``self_instruct_path`` (read as a prompt-only source),
    duplicates of ``convs`` dropped when ``prompts.dedupe``.

    Returns:
        ``(conversations, prompts added, prompts dropped as duplicates)``.

    Raises:
        UserError: the file is missing or unreadable.
    """
    pc = prompts
    extra = read_conversations(
        str(self_instruct_path),
        "messages",
        keep_prompt_only=True,
        system_prompt=pc.system_prompt,
        think_tags=tuple(think_tags),
    )
    out, n_dup = dedupe(convs + extra) if pc.dedupe else (convs + extra, 0)
    return unique_ids(out), len(extra) - n_dup, n_dup


def require_source_files(source) -> None:
    """One line for a ``prompts.source`` file (``source``: one or a list) that does not exist (named sets and ``hf:`` sources aside), before 01
    says it remakes ``prompts.jsonl`` (the earlier file is kept)."""
    for x in [source] if isinstance(source, str) else list(source):
        if x != "humaneval" and not x.startswith("hf:"):
            require_prompts_file(x, "prompts.source", folder_ok=True)
