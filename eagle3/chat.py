"""Chat rendering and the loss mask: which verifier tokens the drafter is trained on.

The loss mask is found purely from token ids, by rendering turn prefixes with the chat template
(DESIGN.md "Loss mask"; the same idea as SpecForge's template-based masking, without its regex):

* ``render(messages[:k], add_generation_prompt=True)`` ends exactly where assistant turn ``k``'s
  reply begins (after the assistant header, e.g. ChatML ``<|im_start|>assistant\\n`` or Kimi
  ``<|im_assistant|>assistant<|im_middle|>``);
* ``render(messages[:k+1])`` ends where that turn ends, i.e. just before the next turn's header.

Both must be true token prefixes of the full rendering; otherwise the template is not
prefix-stable (it rewrites earlier turns depending on later ones, or a BPE merge crosses the
boundary) and :class:`TemplateNotPrefixStable` is raised. No offset mappings and no regex on text
are used, so slow/remote-code tokenizers without offsets (Kimi's tiktoken tokenizer) work.

End-of-turn policy: the mask covers the reply tokens and the end-of-turn token(s) the template
writes after the reply (ChatML ``<|im_end|>``, Kimi ``<|im_end|>``), because the verifier emits
them and the drafter must predict them. Template text that follows the LAST end-of-turn token of
the turn (ChatML's ``"\\n"`` after ``<|im_end|>``) gets mask 0: generation stops at the
end-of-turn token, so the verifier never produces it at serving time (SpecForge masks it out too).
When the turn contains no end-of-turn token at all, the whole span up to the next header is masked.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from eagle3.errors import UserError

# Special tokens that end an assistant turn in common chat templates (ChatML/Kimi, Llama 3,
# Phi-3, Gemma, GPT-2 style, Llama 2). Only those present in the tokenizer's vocab are used.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|end_of_text|>")


class TemplateNotPrefixStable(UserError):
    """A rendered turn prefix is not a token prefix of the full conversation's rendering."""


def _template_text(tokenizer, chat_template: Optional[str]) -> str:
    tpl = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # several named templates: the default one is used by apply_chat_template
        tpl = tpl.get("default") or next(iter(tpl.values()))
    if not tpl:
        raise UserError("verifier.chat_template: the tokenizer has no chat template; set verifier.chat_template")
    return tpl


def chat_template_hash(tokenizer, chat_template: Optional[str] = None) -> str:
    """SHA-256 (hex, 64 chars) of the chat template text in use (``chat_template`` or the tokenizer's).

    Recorded in shard metadata so data rendered with a different template is detected.

    Raises:
        UserError: no template available.
    """
    return hashlib.sha256(_template_text(tokenizer, chat_template).encode("utf-8")).hexdigest()


def end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that end an assistant turn: the EOS id(s) plus known end-of-turn specials in the vocab.

    Used both for the loss-mask end (see module docstring) and as stop tokens of greedy
    regeneration, so the two agree.
    """
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    for t in _END_OF_TURN_TOKENS:
        if t in vocab:
            ids.add(int(vocab[t]))
    return ids


def render(tokenizer, messages: list[dict], chat_template: Optional[str] = None,
           add_generation_prompt: bool = False) -> list[int]:
    """Render ``messages`` with the chat template and tokenize the text (no extra special tokens).

    Equivalent to ``apply_chat_template(..., tokenize=True)``, which also tokenizes the rendered text
    with ``add_special_tokens=False`` (the template writes BOS itself when it wants one); done in two
    steps so the return type is the same plain ``list[int]`` on every transformers version.

    Args:
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
        chat_template: Jinja template overriding the tokenizer's.
        add_generation_prompt: append the assistant header that opens a new reply.

    Returns:
        token ids, ``list[int]``.

    Raises:
        UserError: no chat template, or the template raised an error (message names the cause).
    """
    tpl = _template_text(tokenizer, chat_template)
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=tpl, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2 TemplateError and friends: the template rejects this input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"verifier.chat_template: rendering failed: {first}") from e
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _check_prefix(prefix: list[int], full: list[int], what: str) -> None:
    if len(prefix) > len(full) or full[: len(prefix)] != prefix:
        n = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise TemplateNotPrefixStable(
            f"verifier.chat_template: the template is not prefix-stable: rendering of {what} differs from the "
            f"full conversation at token {n} (the loss mask needs every turn prefix to be a token prefix)")


def assistant_spans(tokenizer, messages: list[dict], chat_template: Optional[str] = None,
                    limit: Optional[int] = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Full rendering plus the ``[start, end)`` token span of each assistant reply.

    ``start`` = length of ``render(messages[:k], add_generation_prompt=True)``; ``end`` = one past
    the last end-of-turn token (:func:`end_of_turn_ids`) inside ``[start, len(render(messages[:k+1])))``,
    or that whole length when the turn has none. See the module docstring for the policy.

    ``limit``: stop at the first assistant turn starting at or after this token index (its span
    and later ones would be truncated away anyway); saves the quadratic prefix renderings of long
    multi-turn conversations.

    Returns:
        ``(input_ids, spans)``.

    Raises:
        TemplateNotPrefixStable: a prefix rendering is not a token prefix of the full rendering.
    """
    return _spans(tokenizer, messages, chat_template, render(tokenizer, messages, chat_template), limit)


def _spans(tokenizer, messages: list[dict], chat_template: Optional[str], full: list[int],
           limit: Optional[int]) -> tuple[list[int], list[tuple[int, int]]]:
    stops = end_of_turn_ids(tokenizer)
    spans: list[tuple[int, int]] = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:k], chat_template, add_generation_prompt=True)
        _check_prefix(head, full, f"messages[:{k}] + generation prompt")
        if limit is not None and len(head) >= limit:
            break
        upto = render(tokenizer, messages[: k + 1], chat_template)
        _check_prefix(upto, full, f"messages[:{k + 1}]")
        start, stop = len(head), len(upto)
        end = stop
        for j in range(stop - 1, start - 1, -1):
            if full[j] in stops:
                end = j + 1
                break
        spans.append((start, end))
    return full, spans


def _render_text(tokenizer, messages: list[dict], chat_template: Optional[str], add_generation_prompt: bool) -> str:
    tpl = _template_text(tokenizer, chat_template)
    try:
        return tokenizer.apply_chat_template(messages, chat_template=tpl, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"verifier.chat_template: rendering failed: {first}") from e


def segment_spans(tokenizer, messages: list[dict], chat_template: Optional[str] = None
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """Fallback of :func:`assistant_spans` for conversations whose token prefixes are unstable.

    The rendered TEXT of every turn prefix (``messages[:k]`` + generation prompt, ``messages[:k+1]``)
    must be a string prefix of the full rendering; the text is cut at those boundaries and each
    segment tokenized on its own, so the sequence is header tokens followed by reply tokens exactly
    as a serving engine produces them (it tokenizes the prompt, then appends generated tokens;
    it never re-tokenizes across the boundary). An assistant message that carries ``tokens`` (the
    ids the verifier generated, written by :mod:`eagle3.regenerate`) contributes those ids verbatim
    followed by the tokenized template text after its content (e.g. ``<|im_end|>\n``), because
    decoding and re-tokenizing is not always the identity. The mask span of a reply runs to its
    last end-of-turn token, as in :func:`assistant_spans`.

    Returns:
        ``(input_ids, spans)``.

    Raises:
        TemplateNotPrefixStable: the template rewrites earlier turns (text prefixes differ).
    """
    full = _render_text(tokenizer, messages, chat_template, False)
    cuts: list[tuple[int, bool]] = []  # (char offset where a segment ends, segment is a reply)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render_text(tokenizer, messages[:k], chat_template, True)
        upto = _render_text(tokenizer, messages[: k + 1], chat_template, False)
        for what, t in ((f"messages[:{k}] + generation prompt", head), (f"messages[:{k + 1}]", upto)):
            if not full.startswith(t):
                raise TemplateNotPrefixStable(
                    f"verifier.chat_template: the template is not prefix-stable even as text: the rendering of "
                    f"{what} is not a prefix of the full conversation (the template rewrites earlier turns)")
        cuts += [(len(head), False), (len(upto), True)]
    stops = end_of_turn_ids(tokenizer)
    replies = [m for m in messages if m["role"] == "assistant"]
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for end, is_reply in cuts + [(len(full), False)]:
        text = full[pos:end]
        seg = None
        if is_reply:
            m = replies[len(spans)]
            toks = m.get("tokens")
            if toks is not None and text.startswith(m["content"]):
                # the verifier's own generated ids, then the template's end-of-turn text
                seg = [int(t) for t in toks] + list(
                    tokenizer(text[len(m["content"]):], add_special_tokens=False)["input_ids"])
        if seg is None:
            seg = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        if is_reply:
            start = len(ids)
            stop = start + len(seg)
            last = max((start + j + 1 for j, t in enumerate(seg) if t in stops), default=stop)
            spans.append((start, last))
        ids += seg
        pos = end
    return ids, spans


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int, chat_template: Optional[str] = None,
                          too_long: str = "truncate") -> Optional[tuple[list[int], list[int]]]:
    """Tokenize a conversation and build its loss mask.

    Args:
        tokenizer: the verifier's tokenizer (fast or slow; no offset mapping needed).
        messages: ``[{"role", "content"}]`` as in the prompts file.
        max_length: maximum number of tokens (>= 1).
        chat_template: Jinja template overriding the tokenizer's.
        too_long: ``"truncate"`` keeps the first ``max_length`` tokens; ``"skip"`` returns None.

    Returns:
        ``(input_ids, loss_mask)``, two ``list[int]`` of equal length L <= max_length; ``loss_mask[i]``
        is 1 iff token i belongs to an assistant reply (incl. its end-of-turn token, see module
        docstring). None when the conversation is skipped: too long under ``"skip"``, or no
        loss-masked token is left (no assistant turn, or all replies truncated away).

    Raises:
        ValueError: bad ``too_long`` or ``max_length``.
        TemplateNotPrefixStable / UserError: see :func:`assistant_spans` and :func:`render`.
    """
    if too_long not in ("truncate", "skip"):
        raise ValueError(f"too_long must be 'truncate' or 'skip', got {too_long!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    full = render(tokenizer, messages, chat_template)
    if too_long == "skip" and len(full) > max_length:
        return None
    try:
        if any("tokens" in m for m in messages if m["role"] == "assistant"):
            raise TemplateNotPrefixStable("regenerated replies carry their token ids: build by segments")
        ids, spans = _spans(tokenizer, messages, chat_template, full, limit=max_length)
    except TemplateNotPrefixStable:
        # A BPE merge crosses a turn boundary (e.g. a reply starting with whitespace): tokenize
        # each turn segment on its own, as a server would (it never re-tokenizes generated tokens).
        ids, spans = segment_spans(tokenizer, messages, chat_template)
        if too_long == "skip" and len(ids) > max_length:
            return None
    mask = [0] * len(ids)
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        return None
    return ids, mask
