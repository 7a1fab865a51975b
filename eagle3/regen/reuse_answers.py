"""Answers of an earlier regeneration reused by stage 01 (``prompts.reuse_answers``, needs ``prompts.regenerate``).

A conversation whose non-answer content (:func:`conversation_key`) equals one in the earlier ``prompts.jsonl[.gz]``
takes that file's regenerated conversation, with this run's id; only the others are regenerated, and the output
keeps 01's order. The earlier file's ``prompts_report.json`` (beside it) must record the same regeneration settings
(:data:`REGEN_KEYS`), else 01 refuses naming the first differing key. A conversation the context cap shortened in
the earlier file does not match its full input and is regenerated. In float32 the output equals a full
regeneration (tested).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, field_validator

from eagle3.capture.prompts import PromptRecord
from eagle3.errors import UserError, validated
from eagle3.io import read_json
from eagle3.io.read import iter_jsonl
from eagle3.manifest import PromptsManifest
from eagle3.regen.resume_log import older_fields_warning

log = logging.getLogger(__name__)

# 01 settings (eagle3.stages.prompts_manifest.settings) that determine a regenerated answer
REGEN_KEYS = (
    "regenerate",
    "max_new_tokens",
    "max_context_tokens",
    "verifier",
    "verifier_dtype",
    "verifier_weights",
    "chat_template",
    "chat_template_kwargs",
    "reply_start",
    "regenerate_via",
    "temperature",
    "top_p",
    "model",
    "extra_body",
    "think_tags",
)


def conversation_key(conv: dict) -> str:
    """The match key of a conversation: its messages without the assistant answers (an assistant message is left out,
    or reduced to its ``role`` and ``tool_calls`` when it has any: regeneration replaces the text, reasoning and
    token ids, and appends an answer to a prompt-only input), plus its ``tools``; canonical JSON."""
    msgs = [
        (
            {"role": "assistant", "tool_calls": m["tool_calls"]}
            if m.get("role") == "assistant"
            else {k: v for k, v in m.items() if k != "tokens"}
        )
        for m in conv["messages"]
        if m.get("role") != "assistant" or m.get("tool_calls")
    ]
    return json.dumps(
        {"messages": msgs, "tools": conv.get("tools")}, sort_keys=True, ensure_ascii=False
    )


def _read_rows(path: Path) -> list[dict]:
    """The conversations of ``path`` (:func:`eagle3.io.read.iter_jsonl`), each a :class:`PromptRecord`.

    Raises:
        UserError: an unreadable file or a bad line (file, line and field), naming ``prompts.reuse_answers``.
    """
    try:
        lines = list(iter_jsonl(path))
    except UserError as e:  # file:line: malformed JSON: ...
        raise UserError(f"{e} (prompts.reuse_answers)") from e
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: prompts.reuse_answers: cannot read ({e})") from e
    for i, row in lines:
        validated(
            PromptRecord,
            row,
            f"{path}:{i}",
            "prompts.reuse_answers names an earlier 01 prompts file",
        )
    return [row for _, row in lines]


def check_settings(report: dict, want: dict, report_file: Path) -> None:
    """Refuse an earlier report (:class:`EarlierReport`) whose settings differ from this run's ``want`` on a
    :data:`REGEN_KEYS` key (compared as :meth:`eagle3.manifest.PromptsManifest.changed` does), naming the
    first; older ``answer_fields`` only warn (:func:`eagle3.regen.resume_log.older_fields_warning`)."""
    rec = validated(
        EarlierReport,
        report,
        f"{report_file}: prompts.reuse_answers",
        "name a regenerating 01 run's file",
    )
    warning = older_fields_warning(
        report_file, rec.answer_fields, "prompts.reuse_answers: reusing answers"
    )
    if warning:
        log.warning(warning)
    old = PromptsManifest.of_record(rec.settings, report_file)
    now = PromptsManifest.make(**want)
    diff = old.changed(now)
    k = next((k for k in REGEN_KEYS if k in diff), None)
    if k is not None:
        weights = k == "verifier_weights"
        was, has = getattr(old, k), getattr(now, k)
        how = (
            f"by other weights than this run's verifier.path holds (settings key verifier_weights: "
            f"{was} -> {has}; the verifier's name is the same)"
            if weights
            else f"with {k} = {json.dumps(was)}, this run has {json.dumps(has)}"
        )
        raise UserError(
            f"{report_file}: prompts.reuse_answers: its answers were made {how}; regenerate without "
            f"prompts.reuse_answers or {'set verifier.path back' if weights else 'match the setting'}"
        )


class EarlierReport(BaseModel):
    """What :func:`check_settings` reads of the earlier 01's ``prompts_report.json``."""

    settings: dict
    answer_fields: Any = None

    @field_validator("settings")
    @classmethod
    def _regenerated(cls, settings: dict) -> dict:
        if not settings.get("regenerate"):
            raise ValueError("says regenerate is not true: that run did not regenerate its answers")
        return settings


def load(path: str, want: dict) -> dict[str, dict]:
    """The earlier regenerated conversations of ``path`` by :func:`conversation_key`, after checking its
    ``prompts_report.json`` (beside it) against this run's settings ``want``.

    Raises:
        UserError: the file or its report is missing or unreadable, a line is bad, or the settings differ.
    """
    p = Path(path)
    rep = p.parent / "prompts_report.json"
    if not p.is_file():
        missing = (
            "a folder; give the earlier prompts.jsonl[.gz] in it" if p.is_dir() else "no such file"
        )
        raise UserError(f"prompts.reuse_answers: {p}: {missing}")
    if not rep.is_file():
        raise UserError(
            f"prompts.reuse_answers: {rep}: missing (the report 01 wrote beside {p.name} tells the "
            "settings its answers were made under)"
        )
    check_settings(read_json(rep), want, rep)
    return {conversation_key(r): r for r in _read_rows(p)}


def recorded_fields(path: str) -> object:
    """The ``answer_fields`` the report beside the reused file ``path`` records (None when absent: an older 01), after
    :func:`load` checked that report; for :func:`eagle3.chat.template.common_answer_fields`."""
    report = read_json(Path(path).parent / "prompts_report.json")
    return report.get("answer_fields") if isinstance(report, dict) else None


def split(convs: list[dict], earlier: dict[str, dict]) -> tuple[list[Optional[dict]], list[dict]]:
    """``(reused, todo)``: per input position the earlier conversation that matches it (None: none does), and the
    inputs to regenerate, in order."""
    reused = [earlier.get(conversation_key(c)) for c in convs]
    return reused, [c for c, r in zip(convs, reused) if r is None]


def merge(convs: list[dict], reused: list[Optional[dict]], regenerated: list[dict]) -> list[dict]:
    """The output in input order: each position's reused conversation (with this run's id for it), or its
    regenerated one. ``regenerated`` holds the ``todo`` inputs' answers in order, a failed one left out: an input
    whose id is not the next regenerated id is dropped, as a full regeneration drops it."""
    out, it = [], iter(regenerated)
    nxt = next(it, None)
    for c, r in zip(convs, reused):
        if r is not None:
            out.append({**r, "id": c["id"]} if "id" in c else r)
        elif nxt is not None and nxt.get("id") == c.get("id"):
            out.append(nxt)
            nxt = next(it, None)
    return out
