"""Prompt and conversation readers: many public formats -> one normalised conversation list.

Output record (DESIGN.md "Prompts file"): ``{"id": str, "messages": [{"role": "system"|"user"|"assistant"|"tool",
"content": str, ...}], "tools"?: [...]}``; messages keep ``reasoning_content`` (or ``reasoning``), ``tool_calls``,
``tool_call_id``/``name``, records their ``tools`` (the chat template renders them).

Inputs: one pydantic model per format (:data:`RECORDS`: sharegpt, messages, alpaca, humaneval, questions);
``fmt="auto"`` picks it per record from its keys (:func:`detect_format`). A record its model refuses stops the read
with one line naming file:line, the field and the expected shape (:func:`eagle3.errors.refusal`).

Files: ``.jsonl``/``.jsonl.gz`` (a record per line), ``.json``/``.json.gz`` (an array of records or one record), or
``hf:<dataset name or local path>`` (Hugging Face ``datasets``, imported lazily).

Normalisation (each skip counted under ``skipped_<reason>`` in ``counts``):

* roles mapped to system/user/assistant; content stripped; a system message only first; a record's top-level
  ``system`` field (LLaMA-Factory) is that first system message (blank: none); ``system_prompt`` prepended when
  there is none;
* leading assistant turns (ShareGPT "split" chunks) dropped (``dropped_leading_assistant``, conversation kept);
  an assistant reply opening with an inline ``<think>...</think>`` and no ``reasoning_content`` is split into both
  (``inline_reasoning_split``);
* empty content -> ``skipped_empty_content`` (except an assistant turn that only calls tools or only reasoned, and
  with ``keep_prompt_only`` an empty answer in a conversation without tool calls); unknown role ->
  ``skipped_unknown_role``; no user turn -> ``skipped_no_user``; no message -> ``skipped_empty_conversation``;
  roles not alternating user/assistant -> ``skipped_non_alternating`` (``tool`` results may follow an assistant
  turn with ``tool_calls``; trailing unanswered results are dropped);
* a conversation with answers ending on a user turn loses that turn unless ``keep_prompt_only``; a prompt-only
  conversation (no assistant turn) is kept only with ``keep_prompt_only`` (01 regenerating), else
  ``skipped_no_assistant``.

Ids are stable: the record's ``id``/``question_id``/``uid``/``task_id``, else ``<file stem>-<line>`` (JSONL,
1-based) or ``<file stem>-<index>`` (JSON array, 0-based); a repeated id gets ``#2``, ``#3``... (across sources
too: :func:`unique_ids`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    Field,
    StrictStr,
    model_validator,
)

from eagle3.chat.template import split_reasoning
from eagle3.data.record_files import iter_file, iter_hf, iter_humaneval
from eagle3.errors import UserError, validated

FORMATS = ("auto", "sharegpt", "messages", "alpaca", "questions", "humaneval", "hf")
"""``prompts.format`` values: :class:`eagle3.settings.prompts.PromptsConfig`'s Literal, 01's ``--format`` choices."""

_SHAREGPT_ROLES = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "chatgpt", "bing"), "assistant"),
    "system": "system",
}
_ID_KEYS = ("id", "question_id", "uid", "task_id")
_RECOGNISED = ("conversations", "messages", "instruction", "turns", "prompt", "question")

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function "
    "(signature, docstring and body) in one Python code block."
)


def detect_format(rec: dict) -> Optional[str]:
    """The format of one record from its keys (see module table), or None when none matches."""
    if "conversations" in rec:
        return "sharegpt"
    if "messages" in rec:
        return "messages"
    if "task_id" in rec and "prompt" in rec and "entry_point" in rec:
        return "humaneval"
    if "instruction" in rec and ("output" in rec or "instances" in rec):
        return "alpaca"
    if any(k in rec for k in ("turns", "prompt", "question", "instruction")):
        return "questions"
    return None


def _joined_text(x: Any) -> Any:
    """A message's text: None -> "", OpenAI content parts -> their ``text`` parts joined (other parts, such as
    images, dropped); anything else is left to the ``str`` check."""
    if x is None:
        return ""
    if not isinstance(x, list):
        return x
    out = []
    for j, part in enumerate(x):
        if not isinstance(part, dict):
            raise ValueError(
                f'item {j} should be a content part {{"type": "text", "text": ...}}, got {type(part).__name__}'
            )
        if part.get("type", "text") == "text":
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"item {j}: 'text' should be a string, got {type(text).__name__}")
            out.append(text)
    return "".join(out)


Text = Annotated[StrictStr, BeforeValidator(_joined_text)]


def humaneval_message(prompt: str) -> str:
    """The user message for a HumanEval problem: an instruction plus the prompt in a code block."""
    return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"


class _Record(BaseModel):
    """A source record; ``system`` (LLaMA-Factory) is a first system message; other keys are ignored."""

    system: Optional[Text] = None


class ShareGPTTurn(BaseModel):
    role: Any = Field("", validation_alias=AliasChoices("from", "role"))
    value: Text = Field("", validation_alias=AliasChoices("value", "content"))


class ShareGPT(_Record):
    conversations: list[ShareGPTTurn]

    def raw(self) -> list:
        return [
            (_SHAREGPT_ROLES.get(str(t.role).lower(), "?" + str(t.role).lower()), t.value)
            for t in self.conversations
        ]


class OpenAIMessage(BaseModel):
    role: Any = ""
    content: Text = ""
    reasoning_content: Optional[Text] = Field(
        None, validation_alias=AliasChoices("reasoning_content", "reasoning")
    )
    tool_calls: Optional[list] = None
    tool_call_id: Any = None
    name: Any = None

    def as_dict(self) -> dict:
        """role (unknown: ``?<role>``), content, reasoning, tool calls, a tool result's ``tool_call_id`` / ``name``."""
        role = str(self.role).lower()
        role = role if role in ("system", "user", "assistant", "tool") else "?" + role
        msg = {"role": role, "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        for key in ("tool_call_id", "name"):
            if role == "tool" and getattr(self, key) is not None:
                msg[key] = str(getattr(self, key))
        return msg


class OpenAIChat(_Record):
    messages: list[OpenAIMessage]
    tools: Optional[list] = None

    def raw(self) -> list:
        return [m.as_dict() for m in self.messages]


class AlpacaInstance(BaseModel):
    input: Text = ""
    output: Optional[Text] = None


class Alpaca(_Record):
    """Alpaca; a self-instruct record without ``output`` answers with its first ``instances`` entry."""

    instruction: Text
    input: Text = ""
    output: Optional[Text] = None
    instances: Optional[list[AlpacaInstance]] = None

    def raw(self) -> list:
        inp, outp = self.input, self.output
        if outp is None and self.instances:
            inp, outp = self.instances[0].input, self.instances[0].output
        user = self.instruction.strip()
        if inp.strip():
            user = f"{user}\n\n{inp.strip()}"
        return [("user", user), ("assistant", outp or "")]


class HumanEvalProblem(_Record):
    prompt: Text

    def raw(self) -> list:
        return [("user", humaneval_message(self.prompt))]


class Questions(_Record):
    """User prompts without answers: ``turns`` (MT-bench), else the first of ``prompt``, ``question``,
    ``instruction``."""

    turns: Optional[list[Text]] = None
    prompt: Optional[Text] = None
    question: Optional[Text] = None
    instruction: Optional[Text] = None

    @model_validator(mode="after")
    def _has_one(self):
        if all(x is None for x in (self.turns, self.prompt, self.question, self.instruction)):
            raise ValueError("has none of the keys turns, prompt, question, instruction")
        return self

    def raw(self) -> list:
        if self.turns is not None:
            return [("user", t) for t in self.turns]
        text = next(x for x in (self.prompt, self.question, self.instruction) if x is not None)
        return [("user", text)]


RECORDS = {
    "sharegpt": ShareGPT,
    "messages": OpenAIChat,
    "alpaca": Alpaca,
    "humaneval": HumanEvalProblem,
    "questions": Questions,
}
SHAPES = {
    "sharegpt": '{"conversations": [{"from": "human"|"gpt"|..., "value": str}]}',
    "messages": '{"messages": [{"role": ..., "content": str or text parts}]}',
    "alpaca": '{"instruction": str, "input"?: str, "output": str}',
    "humaneval": '{"task_id", "prompt": str, "entry_point"}',
    "questions": '{"turns": [str]} or {"prompt"|"question"|"instruction": str}',
}


def with_record_system(
    raw: list, system: Optional[str], where: str, inner: str = "messages[0]"
) -> list:
    """``raw`` (``[(role, content)]`` or message dicts) with a record's top-level ``system`` text (LLaMA-Factory's
    ShareGPT and Alpaca records) as its first, system, message. A blank ``system`` adds nothing; one equal to the
    conversation's own first system message is that message.

    Raises:
        UserError: the conversation opens with a system message of other text (``inner`` names it).
    """
    if system is None or not system.strip():
        return raw
    first = _as_message(raw[0]) if raw else None
    if first is not None and first["role"] == "system":
        if first["content"].strip() == system.strip():
            return raw
        raise UserError(
            f"{where}: field 'system' and {inner} are two different system prompts; keep one"
        )
    return [{"role": "system", "content": system}, *raw]


def _as_message(x) -> dict:
    if isinstance(x, dict):
        return dict(x)
    role, content = x
    return {"role": role, "content": content}


def _valid_order(msgs: list[dict]) -> bool:
    """user/assistant alternate, starting with user; ``tool`` results follow an assistant turn with
    ``tool_calls`` (or another tool result) and are followed by an assistant turn or more results."""
    prev, calls = None, False
    for m in msgs:
        r = m["role"]
        if r == "user":
            ok = prev in (None, "assistant") and not calls
        elif r == "assistant":
            ok = prev in ("user", "tool")
        else:  # tool
            ok = calls and prev in ("assistant", "tool")
        if not ok:
            return False
        if r == "assistant":
            calls = bool(m.get("tool_calls"))
        elif r == "user":
            calls = False
        prev = r
    return True


def normalise(
    raw: list,
    keep_prompt_only: bool,
    system_prompt: Optional[str],
    counts: Counter,
    think_tags: tuple[str, str] = ("<think>", "</think>"),
) -> Optional[list[dict]]:
    """Apply the module's normalisation policies to ``[(role, content)]`` or message dicts.

    Message dicts may carry ``reasoning_content``, ``tool_calls`` (assistant) and ``tool_call_id``
    / ``name`` (tool); they are kept. An assistant reply whose content starts with an inline think
    block (``think_tags``) and has no ``reasoning_content`` is split into ``reasoning_content`` and
    the answer (counted ``inline_reasoning_split``), as a server's reasoning parser returns it.

    Returns:
        ``[{"role", "content", ...}]`` or None when the conversation is skipped (reason counted).
    """
    msgs = [_as_message(x) for x in raw]
    for m in msgs:
        m["content"] = m["content"].strip()
    if any(m["role"].startswith("?") for m in msgs):
        counts["skipped_unknown_role"] += 1
        return None
    system = None
    if msgs and msgs[0]["role"] == "system":
        system = msgs.pop(0)["content"]
    # assistant / tool turns before the first user turn (ShareGPT "split" chunks): dropped, counted once
    lead = next(
        (k for k, m in enumerate(msgs) if m["role"] not in ("assistant", "tool")), len(msgs)
    )
    if lead:
        del msgs[:lead]
        counts["dropped_leading_assistant"] += 1
    if not msgs:
        counts["skipped_no_user" if raw else "skipped_empty_conversation"] += 1
        return None
    _split_inline_reasoning(msgs, think_tags, counts)
    if _empty_content(msgs, keep_prompt_only) or (system is not None and not system):
        counts["skipped_empty_content"] += 1
        return None
    reason = _order_problem(msgs, keep_prompt_only)
    if reason is not None:
        counts[reason] += 1
        return None
    if system is None and system_prompt:
        system = system_prompt
    out = [{"role": "system", "content": system}] if system is not None else []
    return out + msgs


def _split_inline_reasoning(msgs: list[dict], think_tags: tuple[str, str], counts: Counter) -> None:
    """In place: an assistant reply opening with an inline think block and no ``reasoning_content`` split into both
    (counted ``inline_reasoning_split``); every ``reasoning_content`` stripped."""
    for m in msgs:
        if m["role"] == "assistant" and m.get("reasoning_content") is None:
            r, a = split_reasoning(m["content"], think_tags)
            if r is not None:
                m["reasoning_content"], m["content"] = r, a
                counts["inline_reasoning_split"] += 1
        if m.get("reasoning_content") is not None:
            m["reasoning_content"] = m["reasoning_content"].strip()


def _empty_content(msgs: list[dict], keep_prompt_only: bool) -> bool:
    """Whether a message has no text where it needs some. An assistant turn may have none when it only calls
    tools or only reasoned; with ``keep_prompt_only`` (01 regenerates every answer) an empty answer is replaced
    like any other, unless the conversation holds tool results (kept as it is)."""
    regenerated = keep_prompt_only and not any(
        m["role"] == "tool" or m.get("tool_calls") for m in msgs
    )
    return any(
        not m["content"]
        and not (
            m["role"] == "assistant"
            and (m.get("tool_calls") or m.get("reasoning_content") or regenerated)
        )
        for m in msgs
    )


def _order_problem(msgs: list[dict], keep_prompt_only: bool) -> Optional[str]:
    """The skip reason (``skipped_non_alternating``, ``skipped_no_assistant``) of the turns' order, or None; a kept
    conversation with answers loses (in place) a trailing user turn (unless ``keep_prompt_only``) and trailing
    tool results nobody answered."""
    roles = [m["role"] for m in msgs]
    if "assistant" not in roles:
        if any(r != "user" for r in roles):
            return "skipped_non_alternating"
        return None if keep_prompt_only else "skipped_no_assistant"
    if not _valid_order(msgs):
        return "skipped_non_alternating"
    if roles[-1] == "user" and not keep_prompt_only:
        msgs.pop()
    while msgs[-1]["role"] == "tool":  # results nobody answered: nothing to learn after them
        msgs.pop()
    return None


def read_conversations(
    source: str,
    fmt: str = "auto",
    *,
    hf_split: str = "train",
    keep_prompt_only: bool = False,
    system_prompt: Optional[str] = None,
    counts: Optional[Counter] = None,
    think_tags: tuple[str, str] = ("<think>", "</think>"),
) -> list[dict]:
    """Read and normalise conversations from ``source``.

    Args:
        source: ``"humaneval"``, a file path (.json/.jsonl, optionally .gz), or ``"hf:<name or path>"``.
        fmt: one of :data:`FORMATS` (the config and 01's flag refuse others); ``"auto"`` detects per record
            (``"hf"`` = auto on a HF dataset).
        hf_split: split for ``hf:`` sources.
        keep_prompt_only: keep conversations without an assistant turn (they will be regenerated).
        system_prompt: system message prepended to conversations that have none.
        counts: Counter updated with ``read`` (records seen) and the skip/drop reasons.
        think_tags: reasoning markers, for inline think blocks in assistant content.

    Returns:
        ``[{"id": str, "messages": [{"role", "content", ...}], "tools"?: [...]}]`` in source order
        (``tools``: the record's OpenAI tool declarations, when it has any).

    Raises:
        UserError: missing/unreadable file, malformed JSON, a record of no known format or one its model refuses
            (``file:line``).
    """
    counts = counts if counts is not None else Counter()
    it, stem = _records(source, fmt, hf_split)
    out: list[dict] = []
    for where, rec in it:
        counts["read"] += 1
        conv = _conversation(
            rec, where, fmt, stem, keep_prompt_only, system_prompt, counts, think_tags
        )
        if conv is not None:
            out.append(conv)
    return unique_ids(out)  # a repeated id: #2, #3, ...


def _records(source: str, fmt: str, hf_split: str):
    """``(iterator of (where, record), id stem)`` of a source (module docstring: files, ``hf:``, ``humaneval``)."""
    if source == "humaneval":
        return iter_humaneval(), "humaneval"
    if source.startswith("hf:"):
        return iter_hf(source[3:], hf_split), Path(source[3:]).name or "hf"
    if fmt == "hf":
        raise UserError(
            f"prompts.source: format 'hf' needs a source of the form 'hf:<name>', got '{source}'"
        )
    path = Path(source)
    return iter_file(path), path.name.split(".")[0]


def _conversation(
    rec,
    where: str,
    fmt: str,
    stem: str,
    keep_prompt_only: bool,
    system_prompt: Optional[str],
    counts: Counter,
    think_tags: tuple[str, str],
) -> Optional[dict]:
    """One record read and normalised: ``{"id", "messages", "tools"?}``, or None when skipped (counted)."""
    rec, rfmt = _record_format(rec, where, fmt)
    forced = (
        ""
        if fmt in ("auto", "hf")
        else f" (prompts.format '{fmt}'; keys seen: {', '.join(map(str, rec))})"
    )
    record = validated(
        RECORDS[rfmt], rec, where, f"{rfmt} records look like {SHAPES[rfmt]}{forced}"
    )
    inner = "conversations[0]" if rfmt == "sharegpt" else "messages[0]"
    raw = with_record_system(record.raw(), record.system, where, inner)
    msgs = normalise(raw, keep_prompt_only, system_prompt, counts, think_tags)
    if msgs is None:
        return None
    rid = next((str(rec[k]) for k in _ID_KEYS if rec.get(k) not in (None, "")), None)
    if rid is None:
        rid = f"{stem}-{where.rsplit(':', 1)[1].strip('[]')}"
    tools = getattr(record, "tools", None)
    return {"id": rid, "messages": msgs, **({"tools": tools} if tools else {})}


def _record_format(rec, where: str, fmt: str) -> tuple[dict, str]:
    """``(record without its null keys, its format)``: ``fmt``, or with ``auto`` / ``hf`` the one its keys show
    (:func:`detect_format`); a null key is an absent one (a HF dataset's column a row lacks, pandas' to_json of
    mixed rows).

    Raises:
        UserError: ``<where>: expected a JSON object, got <type>``, or ``<where>: unrecognised record: ...``
            naming the keys looked for and those seen (null ones apart).
    """
    if not isinstance(rec, dict):
        why = f"expected a JSON object, got {type(rec).__name__}"
    else:
        nulls = sorted(str(k) for k, v in rec.items() if v is None)
        rec = {k: v for k, v in rec.items() if v is not None}
        rfmt = detect_format(rec) if fmt in ("auto", "hf") else fmt
        if rfmt is not None:
            return rec, rfmt
        why = (
            f"unrecognised record: none of the keys {', '.join(_RECOGNISED)} "
            f"(keys seen: {', '.join(sorted(map(str, rec))) or 'none'}"
            + (f"; null: {', '.join(nulls)})" if nulls else ")")
        )
    raise UserError(f"{where}: {why}")


def unique_ids(conversations: list[dict]) -> list[dict]:
    """``conversations`` (in order) with every repeated ``id`` made unique: the second ``x`` becomes ``x#2`` (the
    next free ``#k``), the first keeps its id; ``prompts.jsonl`` holds one conversation per id."""
    seen: set[str] = set()
    out = []
    for c in conversations:
        cid = c["id"]
        if cid in seen:
            k = 2
            while f"{cid}#{k}" in seen:
                k += 1
            c = {**c, "id": f"{cid}#{k}"}
        seen.add(c["id"])
        out.append(c)
    return out


def first_user_message(conv: dict) -> str:
    """The content of the conversation's first user message ("" when it has none)."""
    return next((m["content"] for m in conv["messages"] if m["role"] == "user"), "")


def dedupe_key(conv: dict) -> str:
    """01's dedupe key of a conversation: its first user message, whitespace runs collapsed, stripped, lower-cased
    ("" when it has no user turn)."""
    first = first_user_message(conv)
    return re.sub(r"\s+", " ", first).strip().lower()


def dedupe(conversations: list[dict]) -> tuple[list[dict], int]:
    """Keep the first conversation of each normalised first user message (case- and whitespace-insensitive).

    Returns:
        ``(kept, number_removed)``; order preserved.
    """
    seen: set[str] = set()
    kept = []
    for c in conversations:
        k = dedupe_key(c)
        if k in seen:
            continue
        seen.add(k)
        kept.append(c)
    return kept, len(conversations) - len(kept)


def short_pool_warning(
    option: str, asked: Optional[int], have: int, what: str = "conversations"
) -> Optional[str]:
    """The one-line warning of an option that samples ``asked`` items from a pool of only ``have`` (all are kept):
    ``prompts.sample_size 50: only 3 conversations; keeping all 3``; None when the pool is large enough, ``asked``
    is None, or the pool is empty (an error elsewhere)."""
    if asked is None or not 0 < have < asked:
        return None
    return f"{option} {asked}: only {have} {what}; keeping all {have}"


def sample(conversations: list[dict], n: Optional[int], seed: int) -> list[dict]:
    """``n`` conversations drawn without replacement with ``random.Random(seed)``, in source order.

    Deterministic for a given input order, ``n`` and ``seed``; ``n`` None or >= len -> all.
    """
    if n is None or n >= len(conversations):
        return list(conversations)
    idx = sorted(random.Random(seed).sample(range(len(conversations)), n))
    return [conversations[i] for i in idx]
