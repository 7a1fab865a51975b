"""Chat rendering: templates, generation prompts, ChatOptions, the stop set and reasoning split.

:func:`check_template` requires the generation prompt to be a suffix of the rendering with
``add_generation_prompt``; a template that ignores the flag needs ``verifier.reply_start``.
Token ids only (Kimi's tokenizer has no offset mapping); segments are tokenized with
``add_special_tokens=False``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from eagle3.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_THINK_TAGS = ("<think>", "</think>")


class TemplateUnusable(UserError):
    """A problem of the template itself (not of one conversation): fatal for the run."""


class TemplateIgnoresGenerationPrompt(TemplateUnusable):
    """The chat template renders the same text with and without ``add_generation_prompt``."""


@dataclass(frozen=True)
class ChatOptions:
    """How conversations are rendered and masked (:meth:`from_verifier`).

    Attributes:
        chat_template: Jinja template overriding the tokenizer's (``verifier.chat_template``).
        template_kwargs: passed to every rendering as a server passes ``chat_template_kwargs``.
        reply_start: text opening a reply, for templates that ignore ``add_generation_prompt``.
        think_tags: the markers around reasoning. loss_on_reasoning: train on reasoning tokens.
    """

    chat_template: Optional[str] = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reply_start: Optional[str] = None
    think_tags: tuple[str, str] = DEFAULT_THINK_TAGS
    loss_on_reasoning: bool = True

    @classmethod
    def from_verifier(cls, verifier, loss_on_reasoning: bool = True) -> "ChatOptions":
        """Options of a ``verifier:`` config section (``chat_template``, ``chat_template_kwargs``,
        ``reply_start``, ``think_tags``) and ``extract.loss_on_reasoning``."""
        return cls(
            chat_template=verifier.chat_template,
            template_kwargs=dict(verifier.chat_template_kwargs),
            reply_start=verifier.reply_start,
            think_tags=tuple(verifier.think_tags),
            loss_on_reasoning=loss_on_reasoning,
        )


_DEFAULT = ChatOptions()


def options_or_default(
    opts: Optional[ChatOptions], chat_template: Optional[str] = None
) -> ChatOptions:
    if opts is not None:
        return opts
    return _DEFAULT if chat_template is None else ChatOptions(chat_template=chat_template)


def _template_text(tokenizer, chat_template: Optional[str]) -> str:
    tpl = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    # several named templates: the default one is used by apply_chat_template
    if isinstance(tpl, dict):
        tpl = tpl.get("default") or next(iter(tpl.values()))
    if not tpl:
        raise TemplateUnusable(
            "verifier.chat_template: the tokenizer has no chat template; set verifier.chat_template"
        )
    return tpl


def chat_template_hash(tokenizer, chat_template: Optional[str] = None) -> str:
    """SHA-256 hex of the chat template text in use (recorded in shard metadata).

    Raises:
        UserError: no template available.
    """
    return hashlib.sha256(_template_text(tokenizer, chat_template).encode("utf-8")).hexdigest()


def template_name(tokenizer, opts: Optional[ChatOptions] = None) -> str:
    """Human-readable name of the template in use, for error messages (source + sha256 prefix)."""
    opts = options_or_default(opts)
    src = (
        "verifier.chat_template (from the config)"
        if opts.chat_template is not None
        else f"the chat template of tokenizer '{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}'"
    )
    return f"{src}, sha256 {chat_template_hash(tokenizer, opts.chat_template)[:12]}"


def end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that end an assistant turn (:func:`eagle3.verifier.load.stop_token_ids`): the
    loss-mask end and the stop set of regeneration and 05's decoding.
    """
    from eagle3.verifier.load import stop_token_ids

    return stop_token_ids(tokenizer)


# What 01 records on each regenerated assistant message beside its text, recorded as ``answer_fields`` in
# ``prompts_report.json`` and in the resume log's header: a file or log without it (or with fewer fields) was written
# before 01 recorded them all, and its answers lack them (a cut answer, or one stopped on another stop id than the
# template's end-of-turn, is then trained on the template's end-of-turn token as if the verifier had emitted it).
ANSWER_FIELDS = ("tokens", "truncated", "stop_token")

_PIPELINE_KEYS = ANSWER_FIELDS  # 01's own message fields: never passed to a template


def common_answer_fields(*recorded: Any) -> list[str]:
    """The :data:`ANSWER_FIELDS` that every one of ``recorded`` lists (each an ``answer_fields`` value of a report or a
    resume-log header: a list of names; anything else, e.g. absent from an older 01's file, lists none), in
    :data:`ANSWER_FIELDS` order. What a ``prompts.jsonl`` holding answers of all of them records, so that 01's
    up-to-date check still names the fields its older answers lack."""
    return [f for f in ANSWER_FIELDS if all(isinstance(r, list) and f in r for r in recorded)]


def has_tool_calls(conv: dict) -> bool:
    """Whether a conversation holds tool calls or results (regeneration keeps it as it is)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in conv["messages"])


def user_turns(conv: dict) -> tuple[Optional[dict], list[str]]:
    """``(system message or None, user contents)`` of a conversation; assistant turns dropped."""
    msgs = conv["messages"]
    system = msgs[0] if msgs and msgs[0]["role"] == "system" else None
    return system, [m["content"] for m in msgs if m["role"] == "user"]


def answer_ending(stop: Optional[int]) -> dict:
    """01's fields on a regenerated message about how it ended: ``{"stop_token": stop}``, or
    ``{"truncated": True}`` when ``stop`` is None (cut at ``max_new_tokens``).
    """
    return {"truncated": True} if stop is None else {"stop_token": int(stop)}


def _template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` without the pipeline's own ``tokens``, ``truncated`` and ``stop_token`` fields: a server never passes them
    to the template either, and transformers walks every id of ``tokens`` on each rendering (a third of 02's
    tokenization time on regenerated data)."""
    return [
        {k: v for k, v in m.items() if k not in _PIPELINE_KEYS}
        if any(k in m for k in _PIPELINE_KEYS)
        else m
        for m in messages
    ]


def tokenize_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def render_text(
    tokenizer,
    messages: list[dict],
    opts: Optional[ChatOptions] = None,
    add_generation_prompt: bool = False,
    tools: Optional[list] = None,
) -> str:
    """The chat template's text for ``messages`` (``apply_chat_template(tokenize=False)``, with
    ``opts.template_kwargs`` and ``tools``).

    Raises:
        UserError: no chat template, or the template raised (message names the cause).
    """
    opts = options_or_default(opts)
    tpl = _template_text(tokenizer, opts.chat_template)
    kw = dict(opts.template_kwargs)
    if tools:
        kw["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            _template_messages(messages),
            chat_template=tpl,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kw,
        )
    except Exception as e:  # jinja2 TemplateError and friends: the template rejects this input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"verifier.chat_template: rendering failed: {first}") from e


def render(
    tokenizer,
    messages: list[dict],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = False,
    *,
    opts: Optional[ChatOptions] = None,
    tools: Optional[list] = None,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (no extra special tokens); ``opts``
    supersedes ``chat_template``. For a generation prompt use :func:`prompt_ids`.

    Raises:
        UserError: no chat template, or the template raised.
    """
    return tokenize_text(
        tokenizer,
        render_text(
            tokenizer,
            messages,
            options_or_default(opts, chat_template),
            add_generation_prompt,
            tools,
        ),
    )


@dataclass(frozen=True)
class TemplateInfo:
    """Result of :func:`check_template`: ``generation_prompt`` = the text the template appends for
    ``add_generation_prompt=True`` (or ``reply_start`` when ``ignores_generation_prompt``)."""

    generation_prompt: str
    ignores_generation_prompt: bool


_CHECKED: dict[tuple, TemplateInfo] = {}


def check_template(
    tokenizer,
    opts: Optional[ChatOptions] = None,
    probe: Optional[list[dict]] = None,
    tools: Optional[list] = None,
) -> TemplateInfo:
    """Loss-mask self-check of the template (cached): the rendering of ``probe`` with
    ``add_generation_prompt`` must be the one without plus a non-empty suffix.

    Returns:
        :class:`TemplateInfo`.

    Raises:
        TemplateIgnoresGenerationPrompt: both equal and no ``opts.reply_start``.
        TemplateUnusable: no template, or the generation prompt is not a suffix.
        UserError: the probe cannot be rendered.
    """
    opts = options_or_default(opts)
    key = (
        type(tokenizer).__name__,
        getattr(tokenizer, "name_or_path", ""),
        chat_template_hash(tokenizer, opts.chat_template),
        json.dumps(dict(opts.template_kwargs), sort_keys=True, default=str),
        opts.reply_start,
    )
    hit = _CHECKED.get(key)
    if hit is not None:
        return hit
    probe = probe if probe else [{"role": "user", "content": "Hello"}]
    with_gp = render_text(tokenizer, probe, opts, True, tools)
    without = render_text(tokenizer, probe, opts, False, tools)
    if with_gp == without:
        if not opts.reply_start:
            raise TemplateIgnoresGenerationPrompt(
                f"verifier.chat_template: {template_name(tokenizer, opts)} ignores add_generation_prompt (rendering "
                "with and without it gives the same text), so the assistant header would be trained on as part of "
                "the reply; fix the template or set verifier.reply_start to the text that opens an assistant "
                "reply (e.g. '<|im_start|>assistant\\n')"
            )
        info = TemplateInfo(opts.reply_start, True)
    elif not with_gp.startswith(without):
        raise TemplateUnusable(
            f"verifier.chat_template: {template_name(tokenizer, opts)}: add_generation_prompt=True does not append "
            f"a generation prompt at the end (the rendering changes before it), so the reply start cannot be found"
        )
    else:
        info = TemplateInfo(with_gp[len(without) :], False)
    _CHECKED[key] = info
    return info


def generation_prompt(
    tokenizer,
    messages: list[dict],
    opts: Optional[ChatOptions] = None,
    tools: Optional[list] = None,
) -> str:
    """The text a server renders before the next assistant reply to ``messages`` (with
    ``reply_start`` appended for a template that ignores the flag).

    Raises:
        UserError, TemplateIgnoresGenerationPrompt: as :func:`render_text`, :func:`check_template`.
    """
    opts = options_or_default(opts)
    info = check_template(tokenizer, opts, messages, tools)
    if info.ignores_generation_prompt:
        return render_text(tokenizer, messages, opts, False, tools) + info.generation_prompt
    return render_text(tokenizer, messages, opts, True, tools)


def prompt_ids(
    tokenizer,
    messages: list[dict],
    opts: Optional[ChatOptions] = None,
    tools: Optional[list] = None,
) -> list[int]:
    """Token ids of :func:`generation_prompt` (what regeneration and benchmarks feed the verifier)."""
    return tokenize_text(tokenizer, generation_prompt(tokenizer, messages, opts, tools))


def split_reasoning(
    text: str, think_tags: tuple[str, str] = DEFAULT_THINK_TAGS, opened: bool = False
) -> tuple[Optional[str], str]:
    """Split a reply into ``(reasoning or None, answer)`` at the think block (it opens at the
    start, or ``opened``; no close tag: all reasoning), both stripped as servers' parsers do.
    """
    open_, close = think_tags
    body = text
    if not opened:
        s = text.lstrip()
        if not s.startswith(open_):
            return None, text
        body = s[len(open_) :]
    if close not in body:
        return body.strip(), ""
    r, a = body.split(close, 1)
    return r.strip(), a.strip()
