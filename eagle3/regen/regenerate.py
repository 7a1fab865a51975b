"""Regeneration: replace assistant turns with the verifier's own greedy answers.

Turn k's prompt holds user turns 0..k and the regenerated answers 0..k-1, so a multi-turn
conversation stays self-consistent; turn k+1 becomes ready when turn k is answered.

Engines (``prompts.regen_engine``): ``slots`` (default, :class:`eagle3.regen.slots.SlotEngine`,
conversations with the most turns left first), ``hf_continuous`` (transformers'
``ContinuousBatchingManager``, the library baseline) and ``static`` (left-padded ``generate``
batches chosen by :func:`pick_batch`, or ``schedule="rounds"``). Greedy decoding gives the same
tokens in every engine and batch composition up to rounding (float32: equal, tested).

Statistics (``regenerate(stats=...)``): ``answers``, ``new_tokens`` (stop token excluded),
``truncated``, ``seconds``, ``kept_with_tools`` (conversations with tool calls, returned unchanged),
``turns_over_context``, ``dropped_over_context``, ``resumed``, ``batches``, ``decode_steps``,
``engine``, ``engine_stats`` (a continuous engine's ``stats``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional, Sequence

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from eagle3.chat.template import (
    ChatOptions,
    answer_ending,
    generation_prompt,
    has_tool_calls,
    split_reasoning,
    user_turns,
)
from eagle3.process_group import rank_tag
from eagle3.regen.engine_choice import make_engine
from eagle3.regen.resume_log import ResumeLog
from eagle3.sdpa import no_cudnn_sdpa
from eagle3.verifier.load import (
    stop_token_ids,  # THE verifier's stop set (one call site per engine below)
)

log = logging.getLogger(__name__)


def pick_batch(prompt_lens: Sequence[int], remaining: Sequence[int], batch_size: int) -> list[int]:
    """Which ready turns go into the next ``generate`` batch (a pure function of the ready pool).

    With ``bulk = ceil(sum(remaining) / batch_size)``, a conversation with ``remaining >= bulk``
    (and >= 2) is critical and goes first (most remaining first; ties: shorter prompt, position);
    then the others by prompt length: those no wider than the widest critical prompt, longest first,
    then the shortest wider ones, up to ``batch_size``.

    Args:
        prompt_lens: token length of each ready turn's prompt.
        remaining: per ready turn, user turns its conversation still has to answer (>= 1).
        batch_size: rows per batch (>= 1).

    Returns:
        ``min(batch_size, len(prompt_lens))`` positions into the ready lists, in batch order.

    Raises:
        ValueError: lists of different lengths, ``batch_size < 1`` or a ``remaining < 1``.
    """
    if len(prompt_lens) != len(remaining) or batch_size < 1 or any(r < 1 for r in remaining):
        raise ValueError(
            "pick_batch: prompt_lens and remaining must have the same length, "
            "remaining >= 1 and batch_size >= 1"
        )
    bulk = -(-sum(remaining) // batch_size)  # full batches still needed
    critical = sorted(
        (j for j, r in enumerate(remaining) if r >= max(2, bulk)),
        key=lambda j: (-remaining[j], prompt_lens[j], j),
    )[:batch_size]
    width = max((prompt_lens[j] for j in critical), default=0)
    chosen = set(critical)
    others = sorted(
        (j for j in range(len(remaining)) if j not in chosen),
        key=lambda j: (prompt_lens[j], -remaining[j], j),
    )
    under = [j for j in others if prompt_lens[j] <= width][::-1]
    wider = [j for j in others if prompt_lens[j] > width]
    return (critical + under + wider)[:batch_size]


def answer_steps(n_tokens: int, stopped: bool, max_new_tokens: int) -> int:
    """Decode steps ``generate`` spends on one answer: its tokens plus the stop token, at most
    ``max_new_tokens`` (a batch runs until its longest answer stops: the batch costs the max)."""
    return min(max_new_tokens, n_tokens + int(stopped))


@torch.inference_mode()
@no_cudnn_sdpa()  # the KV cache grows every step: no per-shape cuDNN plans (see eagle3.sdpa)
def generate_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int
) -> list[tuple[list[int], Optional[int]]]:
    """Greedy-decode token-id ``prompts`` with left padding (``pad_id``, masked out).

    Returns:
        per prompt ``(answer_ids, stop)``: the new tokens before the first of ``stop_ids``, and that
        token's id (None: ``max_new_tokens`` ran out).
    """
    dev = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, W]
    attn = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, W]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    gcfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_id,
    )
    # [B, W+T]
    out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), generation_config=gcfg)
    new = out[:, width:].tolist()
    results = []
    for row in new:
        cut = next((j for j, t in enumerate(row) if t in stop_ids), None)
        results.append((row[:cut], row[cut]) if cut is not None else (row, None))
    return results


class _Run:
    """State of one regeneration: per conversation the messages so far, the user turns, answered turns, and
    the ready pool (conversation -> (prompt ids, prompt text) of its next turn). Methods are the named steps
    of :func:`regenerate`."""

    def __init__(
        self,
        tokenizer,
        conversations: list[dict],
        opts: ChatOptions,
        max_context: Optional[int],
        journal: Optional[ResumeLog],
    ):
        self.tok, self.convs, self.opts = tokenizer, conversations, opts
        self.max_context, self.journal = max_context, journal
        # Tool results answer the ORIGINAL calls: such a conversation cannot be re-answered turn by turn
        # in-process (no tools run here), so it is kept as it is and counted (``kept_with_tools``).
        self.passthrough = {i for i, c in enumerate(conversations) if has_tool_calls(c)}
        if self.passthrough:
            log.warning(
                "%d conversations with tool calls kept as they are (not regenerated in-process)",
                len(self.passthrough),
            )
        # idx -> {id, messages[, tools]}
        self.finished = journal.load(conversations) if journal is not None else {}
        self.state = []
        for i, c in enumerate(conversations):
            todo = i not in self.passthrough and i not in self.finished
            system, users = user_turns(c) if todo else (None, [])
            self.state.append(([system] if system is not None else [], users))
        self.total = sum(len(u) for _, u in self.state)
        self.st = {
            "answers": 0,
            "new_tokens": 0,
            "truncated": 0,
            "seconds": 0.0,
            "kept_with_tools": len(self.passthrough),
            "turns_over_context": 0,
            "dropped_over_context": 0,
            "batches": 0,
            "decode_steps": 0,
            "resumed": len(self.finished),
        }
        self.dropped: set[int] = set()
        self.done = [0] * len(self.state)  # answered turns per conversation
        self.ready: dict[int, tuple[list[int], str]] = {}
        # final conversations (every turn answered, or cut by the context cap after turn 1) not yet in the resume log
        self.pending_log: list[int] = []

    def result(self, i: int) -> dict:
        """Conversation i as returned: its id, the messages so far (regenerated answers), its tools."""
        c = self.convs[i]
        return {
            "id": c["id"],
            "messages": self.state[i][0],
            **({"tools": c["tools"]} if c.get("tools") else {}),
        }

    def flush_log(self) -> None:
        """Append the finished conversations to the resume log (one fsync for the lot)."""
        if self.journal is not None and self.pending_log:
            self.journal.append_many([(i, self.result(i)) for i in self.pending_log])
        self.pending_log.clear()

    def remaining(self, i: int) -> int:
        """User turns conversation i still has to answer (its ready one included)."""
        return len(self.state[i][1]) - self.done[i]

    def make_ready(self, i: int, bar) -> bool:
        """Render conversation i's next turn into the ready pool; apply the context cap (that turn and later ones
        dropped). Returns whether the turn is ready."""
        head = self._render(i)
        return self._ready(
            i, head, list(self.tok(head, add_special_tokens=False)["input_ids"]), bar
        )

    def make_ready_many(self, idx: list[int], bar, chunk: int = 4096) -> None:
        """:meth:`make_ready` for many conversations, one batched tokenizer call per ``chunk`` prompts (a fast
        tokenizer encodes a batch in parallel; the same ids as one by one)."""
        for c0 in range(0, len(idx), chunk):
            part = idx[c0 : c0 + chunk]
            heads = [self._render(i) for i in part]
            for i, head, ids in zip(
                part, heads, self.tok(heads, add_special_tokens=False)["input_ids"]
            ):
                self._ready(i, head, list(ids), bar)

    def _render(self, i: int) -> str:
        """Append conversation i's next user turn to its messages; the prompt text a server would render."""
        msgs, users = self.state[i]
        msgs.append({"role": "user", "content": users[self.done[i]]})
        return generation_prompt(self.tok, msgs, self.opts, self.convs[i].get("tools"))

    def _ready(self, i: int, head: str, ids: list[int], bar) -> bool:
        """Put the rendered turn in the ready pool, or apply the context cap to it and the later turns."""
        msgs, users = self.state[i]
        k = self.done[i]
        if self.max_context is not None and len(ids) >= self.max_context:
            msgs.pop()  # the unanswered user turn
            self.st["turns_over_context"] += len(users) - k
            bar.update(len(users) - k)
            self.state[i] = (msgs, users[:k])
            if k == 0:
                # not logged: a resumed run finds it over the cap again, without generating
                self.dropped.add(i)
            else:
                self.pending_log.append(i)
            return False
        self.ready[i] = (ids, head)
        return True

    def answer(self, i: int, ans: list[int], stop: Optional[int], bar) -> bool:
        """Store conversation i's answer to its ready turn (``stop``: the stop id it ended on, None = cut at
        ``max_new_tokens``); render the next turn. Returns whether one is ready."""
        head = self.ready.pop(i)[1]
        tok = self.tok
        # ``tokens``: the ids the verifier actually produced. Decoding to text and re-tokenizing is not always
        # the identity (e.g. 24 "\n" tokens re-tokenize as two multi-newline tokens), so stage 02 uses these ids.
        msg = {
            "role": "assistant",
            "content": tok.decode(ans, skip_special_tokens=True),
            "tokens": [int(t) for t in ans],
        }
        # think tags may be special tokens: split on the text with specials kept
        reasoning, text = split_reasoning(
            tok.decode(ans, skip_special_tokens=False),
            self.opts.think_tags,
            head.rstrip().endswith(self.opts.think_tags[0]),
        )
        if reasoning is not None:
            msg.update(content=text, reasoning_content=reasoning)
        msg.update(answer_ending(stop))
        self.state[i][0].append(msg)
        self.done[i] += 1
        self.st["new_tokens"] += len(ans)
        self.st["truncated"] += int(stop is None)
        self.st["answers"] += 1
        bar.update(1)
        if self.done[i] < len(self.state[i][1]):
            return self.make_ready(i, bar)  # turn k+1 is ready as soon as turn k is answered
        self.pending_log.append(i)
        return False

    def outputs(self) -> list[dict]:
        """The conversations in input order, less those left out by the context cap."""
        return [
            c if i in self.passthrough else self.finished.get(i) or self.result(i)
            for i, c in enumerate(self.convs)
            if i not in self.dropped
        ]


def _decode_static(
    run: _Run, model, max_new_tokens: int, batch_size: int, schedule: str, bar
) -> None:
    """The static-batch engine: ``generate`` batches of ready turns (:func:`pick_batch` or rounds), each
    decoding until its longest answer stops."""
    stop_ids = stop_token_ids(run.tok)
    pad_id = run.tok.pad_token_id if run.tok.pad_token_id is not None else run.tok.eos_token_id
    while run.ready:
        pool = sorted(run.ready)
        if schedule == "rounds":  # the lowest turn index only, by prompt length
            k = min(run.done[i] for i in pool)
            chunk = sorted(
                (i for i in pool if run.done[i] == k), key=lambda i: (len(run.ready[i][0]), i)
            )[:batch_size]
        else:
            pick = pick_batch(
                [len(run.ready[i][0]) for i in pool], [run.remaining(i) for i in pool], batch_size
            )
            chunk = [pool[j] for j in pick]
        answers = generate_greedy(
            model, [run.ready[i][0] for i in chunk], max_new_tokens, stop_ids, pad_id
        )
        run.st["batches"] += 1
        run.st["decode_steps"] += max(
            answer_steps(len(ans), stop is not None, max_new_tokens) for ans, stop in answers
        )
        for i, (ans, stop) in zip(chunk, answers):
            run.answer(i, ans, stop, bar)
        run.flush_log()


def _decode_continuous(run: _Run, engine, bar) -> None:
    """A continuous engine: every ready turn is submitted (most turns left first); each answer
    submits its conversation's next turn as the ``parent``'s successor (the answered turn was
    submitted with ``retain`` when a next turn existed).
    """

    def submit(i: int, parent: bool = False) -> None:
        engine.submit(
            i,
            run.ready[i][0],
            (-run.remaining(i), len(run.ready[i][0])),
            parent=i if parent else None,
            retain=run.remaining(i) > 1,
        )

    for i in sorted(run.ready):
        submit(i)
    last_flush = time.monotonic()
    try:
        for i, ans, stop in engine.results():
            if run.answer(i, ans, stop, bar):
                submit(i, parent=True)
            if run.pending_log and (
                len(run.pending_log) >= 256 or time.monotonic() - last_flush > 1.0
            ):
                run.flush_log()  # at most ~1 s of finished conversations is lost to a kill
                last_flush = time.monotonic()
    finally:
        run.flush_log()  # Ctrl-C / error: what finished is kept
    run.st["engine_stats"] = dict(engine.stats)
    es = engine.stats
    if "reused_tokens" in es:
        prompt = es["reused_tokens"] + es["prefill_tokens"]
        log.info(
            "%sregeneration prompts: %d tokens, %d prefilled, %d reused from the previous turn's KV (%.1f%%; "
            "prompts.regen_prefix_reuse: %s)",
            rank_tag(suffix=": "),
            prompt,
            es["prefill_tokens"],
            es["reused_tokens"],
            100.0 * es["reused_tokens"] / max(1, prompt),
            str(es["prefix_reuse"]).lower(),
        )
    run.st["batches"] += engine.stats.get("prefill_calls", 0)
    run.st["decode_steps"] += engine.stats.get("decode_steps", 0)


def regenerate(
    model,
    tokenizer,
    conversations: list[dict],
    max_new_tokens: int,
    batch_size: int,
    chat_template: Optional[str] = None,
    stats: Optional[dict] = None,
    opts: Optional[ChatOptions] = None,
    max_context: Optional[int] = None,
    schedule: str = "pool",
    journal: Optional[ResumeLog] = None,
    engine: str = "slots",
    engine_options: Optional[dict] = None,
) -> list[dict]:
    """Replace every assistant turn with the verifier's greedy answer, turn by turn.

    Args:
        model, tokenizer: the verifier (eval mode) and its tokenizer.
        conversations: normalised ``{id, messages}`` (each user turn is answered).
        max_new_tokens: answer budget per turn. batch_size: decode rows or prompts per batch.
        chat_template, opts: a Jinja template overriding the tokenizer's, or the rendering options
            (prompts: :func:`eagle3.chat.template.generation_prompt`).
        max_context: token cap: a turn whose prompt reaches it is not answered, nor later ones; a
            conversation whose first prompt reaches it is left out. None: no cap.
        journal: :class:`eagle3.regen.resume_log.ResumeLog`: its conversations are taken, finished
            ones appended.
        engine, engine_options: ``slots`` | ``hf_continuous`` | ``static`` and the continuous
            engine's keyword arguments (:func:`make_engine`). schedule: static only, ``pool`` | ``rounds``.
        stats: filled with the run's figures (module docstring).

    Returns:
        new conversations ``{id, messages}`` in input order (less those left out): user and
        regenerated assistant turns with ``reasoning_content`` split off and the generated ``tokens``.

    Raises:
        UserError: a ``journal`` of other settings or conversations.
    """
    opts = opts if opts is not None else ChatOptions(chat_template=chat_template)
    run = _Run(tokenizer, conversations, opts, max_context, journal)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if journal is not None:
            journal.open()
            stack.callback(journal.close)
        bar = stack.enter_context(
            tqdm(total=run.total, desc=f"regenerate{rank_tag(' ')}", unit="answer")
        )
        # every conversation's first turn (the resumed ones are taken from the journal)
        run.make_ready_many([i for i, (_, users) in enumerate(run.state) if users], bar)
        run.flush_log()
        if engine == "static":
            _decode_static(run, model, max_new_tokens, batch_size, schedule, bar)
        elif run.ready:
            eng = _engine(run, engine, model, max_new_tokens, batch_size, engine_options)
            stack.callback(eng.close)
            _decode_continuous(run, eng, bar)
    _finish(run, time.perf_counter() - t0, engine, max_context, stats)
    return run.outputs()


def _engine(run: _Run, engine, model, max_new_tokens, batch_size, options):
    """The continuous ``engine`` (:func:`make_engine`) for ``run``'s ready turns: one row per conversation in flight
    (at most ``batch_size``), told the answers planned (for ``regen_compile: auto``)."""
    return make_engine(
        engine,
        model,
        run.tok,
        max_new_tokens,
        min(batch_size, len(run.ready)),
        run.max_context,
        options,
        planned_answers=sum(run.remaining(i) for i in run.ready),
    )


def _finish(
    run: "_Run", seconds: float, engine: str, max_context: Optional[int], stats: Optional[dict]
) -> None:
    """Record the wall time (seconds), the conversations left out and the engine; warn about those left out;
    copy the figures into ``stats``."""
    run.st.update(seconds=seconds, dropped_over_context=len(run.dropped), engine=engine)
    if run.dropped:
        log.warning(
            "%d conversations left out: their first prompt has >= %d tokens (prompts.max_context_tokens)",
            len(run.dropped),
            max_context,
        )
    if stats is not None:
        stats.update(run.st)
