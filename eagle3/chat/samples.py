"""Chat rendering and the loss mask: which verifier tokens the drafter is trained on.

The rule: the loss mask covers exactly the tokens the verifier GENERATED when the answer was
served, and a training sample holds them in exactly the context the server rendered for them.
For assistant turn ``k`` of a conversation ``messages`` a chat server (SGLang, vLLM) renders

* the context ``head_k = render(messages[:k], add_generation_prompt=True, **chat_template_kwargs)``
  (history, then the assistant header, e.g. ChatML ``<|im_start|>assistant\\n``, Kimi thinking mode
  ``<|im_assistant|>assistant<|im_middle|><think>``), tokenizes it, and
* appends the generated tokens: the reply ``c_k`` (reasoning, ``</think>``, answer, tool-call text)
  and the end-of-turn token at which generation stopped.

``c_k`` is read off the template, never off regex heuristics on the data: it is what follows
turn ``k``'s generation prompt in ``render(messages[:k+1])``. Reasoning that the template drops
from a finished turn (Kimi-K2.5 renders every non-tool-call assistant turn with an empty
``<think></think>``; Qwen3 drops the think block of turns before the last user query) is put back
where the verifier generated it, inside the think block (``verifier.think_tags``). An assistant
message with ``tokens`` (the ids the verifier generated, from regeneration) contributes those ids
verbatim, followed by the template's end-of-turn text (decode + re-tokenize is not the identity).

Samples per conversation. Turns whose served text ``head_k + c_k`` is a prefix of the next turn's
context ``head_{k+1}`` share one sample (the usual case: ChatML, thinking off, or a think block the
model left empty); when the history changes as turns are added (reasoning dropped), the next turn
starts a new sample rendered as the server rendered its context then. In the worst case
(reasoning in every turn) that is one sample per assistant turn; sample ids are then
``{id}#turn{n}`` (``n`` = 1-based number of the sample's last assistant turn). A conversation for
which some turn has no consistent rendering (its generation prompt cannot be found in the
rendering of the turn, the template drops its tool calls or reasoning with no think block to put it
back in, or the template raises) is skipped with a reason, never fatal: see
:func:`conversation_samples`.

End-of-turn policy: the mask covers the reply and the end-of-turn token(s) the template writes
after it (ChatML/Kimi ``<|im_end|>``), because the verifier emits them; template text after the
LAST end-of-turn token of the turn (ChatML's ``"\\n"``) gets mask 0 (generation stops at the
end-of-turn token; SpecForge masks it out too). A reply without any end-of-turn token is masked
whole. A reply 01 cut at ``prompts.max_new_tokens`` (``truncated: true`` on the message; a message without
the key counts as finished, as before) is masked up to its last generated token: the end-of-turn token
the template appends, and the template text after it, get 0 (the verifier never emitted them; SpecForge and
speculators train on generated tokens only); the next turn's context still holds them, as served.
Likewise a reply that the verifier stopped on another stop id than the template's end-of-turn token
(``stop_token: <id>`` on the message, e.g. SmolLM2's ``<|endoftext|>`` against the template's ``<|im_end|>``; a
message without the key counts as stopped on the template's token, as before): the template's token is not what
the verifier emitted there, so it and the text after it get 0.
Tokens of the reasoning (from the reply start up to and including ``</think>``) get mask 0 when
``loss_on_reasoning`` is off. Never masked: system, user and tool-result text, tool
declarations, and the assistant header / generation prompt.

Rendering itself: :mod:`eagle3.chat.template`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from eagle3.chat.template import (
    ChatOptions,
    TemplateInfo,
    TemplateNotPrefixStable,
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


# ---------------------------------------------------------------------------------------------
# served turns -> samples
# ---------------------------------------------------------------------------------------------
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
        if head.rstrip().endswith(open_) and reply.lstrip().startswith(
            close
        ):  # "<think>" ends the prompt (Kimi)
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
    """Whether an assistant ``message`` ended on the end-of-turn token id ``template_eot`` that the chat template
    appends after it (None: the template appends none).

    True when the message records no ``stop_token`` (01 before it recorded one, a text-only endpoint, a hand-made
    file: counted as stopped there, as before), when the template appends none, or when the recorded id equals it.
    False when the verifier stopped on another stop id (e.g. ``<|endoftext|>`` where the template writes
    ``<|im_end|>``): the template's token is not what the verifier emitted, so it gets no loss."""
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

    ``samples``: kept samples (each with at least one loss token, length <= max_length).
    ``counts``: ``truncated``, ``skipped_too_long``, ``skipped_no_loss_tokens`` (per sample),
    ``skipped_inconsistent`` / ``skipped_render_failed`` (per conversation, see ``skip_reason``),
    ``split_conversations`` (1 when the conversation gave several samples), ``split_samples``.
    ``skip_reason``: why the whole conversation was skipped (``"inconsistent:<why>"`` or
    ``"render_failed: <error>"``), else None.
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
    """Stage 02's per-conversation entry point: training samples (ids + loss mask) of one conversation.

    Pure function of its arguments (safe to call from worker processes). See the module docstring
    for what is rendered and masked and when a conversation becomes several samples.

    Args:
        tokenizer: the verifier's tokenizer (fast or slow; no offset mapping needed).
        messages: the prompts-file messages (system/user/assistant/tool; ``reasoning_content``,
            ``tool_calls``, ``tool_call_id``, ``tokens`` as written by stage 01).
        max_length: maximum tokens per sample (>= 1).
        opts: rendering/masking options (:meth:`ChatOptions.from_verifier`).
        too_long: ``"truncate"`` keeps the first ``max_length`` tokens of a longer sample (counted
            ``truncated``); ``"skip"`` drops it (``skipped_too_long``).
        tools: the conversation's tool declarations (rendered by the template like a server does).

    Returns:
        :class:`ConversationSamples`. A sample left without loss tokens (no assistant turn, or
        replies truncated away) is dropped and counted ``skipped_no_loss_tokens``.

    Raises:
        ValueError: bad ``too_long`` or ``max_length``.
        TemplateUnusable (incl. TemplateIgnoresGenerationPrompt): template-wide problems (see
            :func:`check_template`, no template at all): fatal for the run, unlike a single
            conversation that cannot be rendered consistently or makes the template raise
            (``skip_reason``).
    """
    if too_long not in ("truncate", "skip"):
        raise ValueError(f"too_long must be 'truncate' or 'skip', got {too_long!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
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


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    chat_template: Optional[str] = None,
    too_long: str = "truncate",
    *,
    opts: Optional[ChatOptions] = None,
    tools: Optional[list] = None,
) -> Optional[tuple[list[int], list[int]]]:
    """Single-sample view of :func:`conversation_samples` (tests, tools): ``(input_ids, loss_mask)``.

    Returns:
        the one sample's ``(input_ids, loss_mask)`` (``list[int]`` each, length <= max_length), or
        None when the conversation yields no sample (too long under ``"skip"``, no loss token left).

    Raises:
        TemplateNotPrefixStable: the conversation needs several samples (its history changes as
            turns are added) or has no consistent rendering; stage 02 handles both.
        ValueError, UserError: see :func:`conversation_samples`.
    """
    res = conversation_samples(
        tokenizer, messages, max_length, options_or_default(opts, chat_template), too_long, tools
    )
    if res.skip_reason is not None:
        raise TemplateNotPrefixStable(
            f"verifier.chat_template: the template is not prefix-stable for this "
            f"conversation and it has no consistent rendering ({res.skip_reason})"
        )
    if res.counts["split_conversations"]:
        raise TemplateNotPrefixStable(
            "verifier.chat_template: the template is not prefix-stable for this conversation (its history changes "
            f"as turns are added): it gives {res.counts['split_samples']} samples, one per served context"
        )
    if not res.samples:
        return None
    return res.samples[0].input_ids, res.samples[0].loss_mask
