"""Chat rendering and the loss mask: which verifier tokens the drafter is trained on.

The mask covers exactly the tokens the verifier generated, in the context the server rendered for
them. For assistant turn ``k`` a server renders ``head_k = render(messages[:k],
add_generation_prompt=True, **chat_template_kwargs)`` and appends the reply ``c_k``: what follows
turn ``k``'s generation prompt in ``render(messages[:k+1])``. Reasoning the template drops from a
finished turn is put back inside the think block (``verifier.think_tags``); a message with
``tokens`` (from regeneration) contributes those ids verbatim.

Turns whose ``head_k + c_k`` is a prefix of ``head_{k+1}`` share one sample; otherwise the next
turn starts a new sample ``{id}#turn{n}``. A conversation with no consistent rendering is skipped
with a reason (:func:`conversation_samples`).

Mask: the reply and the end-of-turn token(s) after it get 1; template text after the last
end-of-turn token gets 0. A reply cut at ``max_new_tokens`` (``truncated: true``) or stopped on
another stop id (``stop_token``) gets 0 from the template's end-of-turn token on. Reasoning (up to
``</think>``) gets 0 unless ``loss_on_reasoning``. System, user, tool text and the generation
prompt are never in the mask. Rendering itself: :mod:`eagle3.chat.template`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from eagle3.chat.template import (
    ChatOptions,
    TemplateInfo,
    TemplateUnusable,
    check_template,
    end_of_turn_ids,
    generation_prompt,
    options_or_default,
    render_text,
    tokenize_text,
)
from eagle3.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class _Turn:
    number: int  # 1-based assistant turn number
    head: str  # context text the server rendered (ends with the generation prompt)
    reply: str  # template text of the reply up to the next turn (reasoning restored)
    message: dict


class _Inconsistent(Exception):
    """A turn has no consistent rendering; ``args[0]`` = short reason key."""


def _reply_text(
    tokenizer,
    messages: list[dict],
    k: int,
    head: str,
    info: TemplateInfo,
    opts: ChatOptions,
    tools: Optional[list],
) -> str:
    """Template text of assistant turn ``k``'s reply as generated (see module docstring)."""
    m = messages[k]
    upto = render_text(tokenizer, messages[: k + 1], opts, False, tools)
    if upto.startswith(head):
        reply = upto[len(head) :]
    else:
        # The history renders differently once turn k is there (Kimi: a tool-call chain's reasoning is
        # dropped when it ends): turn k's own text follows its generation prompt, the last one.
        gp = info.generation_prompt
        pos = upto.rfind(gp) if gp.strip() else -1
        if pos < 0:
            raise _Inconsistent("generation_prompt_not_found")
        reply = upto[pos + len(gp) :]
    content = m.get("content")
    if isinstance(content, str) and content.strip() and content.strip() not in reply:
        raise _Inconsistent("reply_not_rendered")
    reasoning = (m.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in reply:
        open_, close = opts.think_tags
        # "<think>" ends the prompt (Kimi)
        if head.rstrip().endswith(open_) and reply.lstrip().startswith(close):
            reply = reasoning + reply
        elif reply.startswith(open_ + close):  # an empty think block opens the reply
            reply = open_ + reasoning + reply[len(open_) :]
        else:
            raise _Inconsistent("reasoning_not_rendered")
    if m.get("tool_calls"):
        bare = {key: v for key, v in m.items() if key != "tool_calls"}
        if render_text(tokenizer, messages[:k] + [bare], opts, False, tools) == upto:
            raise _Inconsistent("tool_calls_not_rendered")
    return reply


def _reasoning_chars(head: str, reply: str, opts: ChatOptions) -> int:
    """Length of the reasoning part of ``reply`` (through the close tag); 0 without a think block."""
    open_, close = opts.think_tags
    if not (head.rstrip().endswith(open_) or reply.lstrip().startswith(open_)):
        return 0
    j = reply.find(close)
    return len(reply) if j < 0 else j + len(close)


def _find_sub(seq: list[int], sub: list[int]) -> int:
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if seq[i : i + n] == sub:
            return i
    return -1


def _reply_ids(
    tokenizer, turn: _Turn, opts: ChatOptions, stops: set[int]
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one reply segment (mask per the module's end-of-turn/reasoning policy; a message with
    ``truncated: true``, or with a ``stop_token`` other than the template's end-of-turn token, is masked up to its
    generated tokens: the template's end-of-turn and later text get 0)."""
    reply, m = turn.reply, turn.message
    n_r_chars = _reasoning_chars(turn.head, reply, opts)
    toks = m.get("tokens")
    if toks is not None:
        # generated ids verbatim, then the template text from the last end-of-turn token on
        eot_strings = [s for s in tokenizer.convert_ids_to_tokens(sorted(stops)) if s]
        pos = max((reply.rfind(s) for s in eot_strings), default=-1)
        if pos < 0:
            c = m.get("content") or ""
            j = reply.rfind(c) if c else -1
            pos = j + len(c) if j >= 0 else len(reply)
        gen = [int(t) for t in toks]
        ids = gen + tokenize_text(tokenizer, reply[pos:])
        n_r = 0
        if n_r_chars:
            close_ids = tokenize_text(tokenizer, opts.think_tags[1])
            j = _find_sub(gen, close_ids) if close_ids else -1
            n_r = len(gen) if j < 0 else j + len(close_ids)
    else:
        first = tokenize_text(tokenizer, reply[:n_r_chars])
        ids = first + tokenize_text(tokenizer, reply[n_r_chars:])
        n_r = len(first)
    first_eot = next(
        (j for j in range(len(gen) if toks is not None else 0, len(ids)) if ids[j] in stops), None
    )
    if m.get("truncated") is True or not stopped_on_template_eot(
        m, ids[first_eot] if first_eot is not None else None
    ):
        # cut at max_new_tokens, or stopped on another stop id: the verifier never emitted the template's end-of-turn
        end = len(gen) if toks is not None else (first_eot if first_eot is not None else len(ids))
    else:
        end = next((j + 1 for j in range(len(ids) - 1, -1, -1) if ids[j] in stops), len(ids))
    mask = [1] * end + [0] * (len(ids) - end)
    if not opts.loss_on_reasoning:
        mask[:n_r] = [0] * min(n_r, len(mask))
    return ids, mask


def stopped_on_template_eot(message: Mapping[str, Any], template_eot: Optional[int]) -> bool:
    """Whether an assistant ``message`` ended on ``template_eot``, the end-of-turn id the template
    appends (None: none): True without a recorded ``stop_token``, without a template token, or
    when they are equal.
    """
    stop = message.get("stop_token")
    return stop is None or template_eot is None or int(stop) == int(template_eot)


@dataclass
class ChatSample:
    """One training sample of a conversation: ``suffix`` is appended to the conversation id
    (``""`` when the conversation is one sample, else ``"#turn{n}"``)."""

    suffix: str
    input_ids: list[int]
    loss_mask: list[int]
    turns: int  # assistant turns with loss tokens in this sample


@dataclass
class ConversationSamples:
    """What :func:`conversation_samples` made of one conversation.

    ``samples``: kept samples (>= 1 loss token, <= max_length). ``counts``: ``truncated``,
    ``skipped_too_long``, ``skipped_no_loss_tokens``, ``skipped_inconsistent``,
    ``skipped_render_failed``, ``split_conversations``, ``split_samples``. ``skip_reason``:
    ``"inconsistent:<why>"`` or ``"render_failed: <error>"`` when skipped, else None.
    """

    samples: list[ChatSample]
    counts: Counter
    skip_reason: Optional[str] = None


def _served_turns(
    tokenizer, messages: list[dict], opts: ChatOptions, tools: Optional[list]
) -> list[_Turn]:
    turns: list[_Turn] = []
    info = None
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if info is None:
            info = check_template(tokenizer, opts, messages[:k], tools)
        head = generation_prompt(tokenizer, messages[:k], opts, tools)
        turns.append(
            _Turn(
                len(turns) + 1,
                head,
                _reply_text(tokenizer, messages, k, head, info, opts, tools),
                m,
            )
        )
    return turns


def _group(turns: list[_Turn]) -> list[list[_Turn]]:
    """Consecutive turns whose served text is a prefix of the next turn's context share a sample."""
    groups: list[list[_Turn]] = []
    for t in turns:
        if groups:
            last = groups[-1][-1]
            if t.head.startswith(last.head + last.reply):
                groups[-1].append(t)
                continue
        groups.append([t])
    return groups


def _group_ids(
    tokenizer, group: list[_Turn], opts: ChatOptions, stops: set[int], cap: int
) -> tuple[list[int], list[int], int]:
    """Tokens and mask of one sample; stops adding turns once ``cap`` tokens are reached."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    turns = 0
    for t in group:
        if len(ids) >= cap:
            break
        ctx = tokenize_text(tokenizer, t.head[len(done) :])
        r_ids, r_mask = _reply_ids(tokenizer, t, opts, stops)
        ids += ctx + r_ids
        mask += [0] * len(ctx) + r_mask
        done = t.head + t.reply
        turns += 1
    return ids, mask, turns


def conversation_samples(
    tokenizer,
    messages: list[dict],
    max_length: int,
    opts: Optional[ChatOptions] = None,
    too_long: str = "truncate",
    tools: Optional[list] = None,
) -> ConversationSamples:
    """Training samples (ids + loss mask) of one conversation (stage 02; pure, process-safe).

    Args:
        tokenizer: the verifier's tokenizer.
        messages: the prompts-file messages (``reasoning_content``, ``tool_calls``,
            ``tool_call_id``, ``tokens`` as stage 01 writes them).
        max_length: tokens per sample (>= 1).
        opts: :class:`ChatOptions`.
        too_long: ``"truncate"`` (first ``max_length`` tokens) or ``"skip"`` (``extract.too_long``).
        tools: the conversation's tool declarations.

    Returns:
        :class:`ConversationSamples` (samples without loss tokens dropped).

    Raises:
        TemplateUnusable: a template-wide problem (fatal, unlike a per-conversation ``skip_reason``).
    """
    opts = options_or_default(opts)
    counts: Counter = Counter()
    try:
        turns = _served_turns(tokenizer, messages, opts, tools)
    except _Inconsistent as e:
        counts["skipped_inconsistent"] += 1
        return ConversationSamples([], counts, f"inconsistent:{e.args[0]}")
    except TemplateUnusable:
        raise
    except UserError as e:  # the template raised on this conversation
        counts["skipped_render_failed"] += 1
        return ConversationSamples([], counts, f"render_failed: {e}")
    if not turns:
        counts["skipped_no_loss_tokens"] += 1
        return ConversationSamples([], counts)
    return ConversationSamples(
        _samples(tokenizer, _group(turns), opts, max_length, too_long, counts), counts
    )


def _samples(
    tokenizer, groups: list, opts: ChatOptions, max_length: int, too_long: str, counts: Counter
) -> list[ChatSample]:
    """One sample per turn group (ids cut to ``max_length`` or skipped, per ``too_long``; one without loss tokens
    dropped), counted in ``counts``; a split conversation's samples carry ``#turn<k>`` id suffixes."""
    stops = end_of_turn_ids(tokenizer)
    samples: list[ChatSample] = []
    for g in groups:
        ids, mask, n_turns = _group_ids(tokenizer, g, opts, stops, max_length + 1)
        if len(ids) > max_length:
            if too_long == "skip":
                counts["skipped_too_long"] += 1
                continue
            counts["truncated"] += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            counts["skipped_no_loss_tokens"] += 1
            continue
        suffix = "" if len(groups) == 1 else f"#turn{g[n_turns - 1].number}"
        samples.append(ChatSample(suffix, ids, mask, n_turns))
    if len(groups) > 1:
        counts["split_conversations"] += 1
        counts["split_samples"] += len(samples)
    return samples
