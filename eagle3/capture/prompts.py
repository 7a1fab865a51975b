"""The prompts file of stage 01 -> tokenized training samples (stage 02's input side).

:func:`read_prompts` checks the JSONL records; :func:`check_token_ids` refuses answer token ids outside the
verifier's vocab; :func:`tokenize` turns every conversation into one or several :class:`Sample` with
:func:`eagle3.chat.samples.conversation_samples` (spread over :mod:`eagle3.capture.tokenize_pool` workers, results
in file order).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr

from eagle3.capture.tokenize_pool import map_records
from eagle3.chat.samples import conversation_samples
from eagle3.errors import UserError, validated
from eagle3.io.read import iter_jsonl, relative_hint

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One tokenized conversation: dense shard ``idx``, prompt ``id``, ids and mask (``list[int]``)."""

    idx: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


# ---------------------------------------------------------------------------------------------


TokenId = Annotated[StrictInt, Field(ge=0)]


class PromptMessage(BaseModel):
    """One message of the prompts file (DESIGN.md "Prompts file"); other keys are not checked.

    ``tokens``: the ids the verifier generated (assistant); ``truncated``: cut at ``prompts.max_new_tokens`` (no loss
    on the template's end-of-turn token); ``stop_token``: the stop id the verifier ended on.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr
    reasoning_content: Optional[StrictStr] = None
    tool_calls: Optional[list] = None
    tool_call_id: Optional[StrictStr] = None
    tokens: Optional[list[TokenId]] = None
    truncated: Optional[StrictBool] = None
    stop_token: Optional[TokenId] = None


class PromptRecord(BaseModel):
    """One line of the prompts file 01 writes: ``{"id", "messages", "tools"?}``."""

    id: StrictStr
    messages: Annotated[list[PromptMessage], Field(min_length=1)]
    tools: Optional[list] = None


PROMPTS_FIX = "the prompts file is 01_prepare_prompts.py's output: re-run it or mend the record"


def require_prompts_file(path: str | os.PathLike, fix: str, *, folder_ok: bool = False) -> None:
    """Refuse a prompts file that is not there (``folder_ok``: a folder passes, its reader names it):
    ``<path>: prompts file not found (<fix>[; <where relative paths are read from>])``, ``path`` as given."""
    if not (Path(path).exists() if folder_ok else Path(path).is_file()):
        hint = relative_hint(path)
        raise UserError(f"{path}: prompts file not found ({fix}{'; ' + hint if hint else ''})")


def read_prompts(path: str | os.PathLike, limit: Optional[int] = None) -> list[dict]:
    """The first ``limit`` (None: all) records of the 01 prompts file, each validated as :class:`PromptRecord` and
    returned as read, plus its ``line``.

    Raises:
        UserError: missing or empty file, malformed JSON, a record its model refuses (``file:line: field ...``).
    """
    path = Path(path)
    require_prompts_file(path, "run 01_prepare_prompts.py first")
    out: list[dict] = []
    for n, rec in iter_jsonl(path):
        if limit is not None and len(out) >= limit:
            break
        validated(PromptRecord, rec, f"{path}:{n}", PROMPTS_FIX)
        tools = rec.get("tools")
        out.append(
            {
                "id": rec["id"],
                "messages": rec["messages"],
                "line": n,
                **({"tools": tools} if tools else {}),
            }
        )
    if not out:
        raise UserError(
            f"{path}: no conversations in the prompts file (empty or blank lines only; re-run "
            "01_prepare_prompts.py)"
        )
    return out


def check_token_ids(prompts: list[dict], vocab_size: int, path: Path) -> None:
    """Refuse a ``tokens`` or ``stop_token`` id at or past the verifier's vocab, before anything is captured.

    Raises:
        UserError: ``<path>:<line>: field 'messages[k].tokens[i]' = 99999 is not a token id of this verifier ...``.
    """
    for rec in prompts:
        for k, m in enumerate(rec["messages"]):
            bad = next(
                (
                    (f"tokens[{i}]", t)
                    for i, t in enumerate(m.get("tokens") or ())
                    if t >= vocab_size
                ),
                None,
            )
            if bad is None and m.get("stop_token") is not None and m["stop_token"] >= vocab_size:
                bad = ("stop_token", m["stop_token"])
            if bad is not None:
                raise UserError(
                    f"{path}:{rec['line']}: field 'messages[{k}].{bad[0]}' = {bad[1]} is not a token "
                    f"id of this verifier (vocab {vocab_size}): were the answers generated by another one? "
                    "Re-run 01_prepare_prompts.py with this verifier"
                )


MAX_SKIPPED_IDS = 1000  # ids of skipped conversations kept per reason in data_config / the report


def _tokenize_one(tokenizer, rec: dict, *, max_length: int, opts, too_long: str, where: str):
    """The per-conversation step of :func:`tokenize` (module-level: runs in
    :mod:`eagle3.capture.tokenize_pool` workers): :func:`eagle3.chat.samples.conversation_samples` of ``rec``; a
    template-wide error becomes ``UserError("{where}:{line}: ...")``."""
    try:
        return conversation_samples(
            tokenizer, rec["messages"], max_length, opts, too_long, rec.get("tools")
        )
    except UserError as e:
        raise UserError(f"{where}:{rec['line']}: {e}") from e


def tokenize(
    tokenizer,
    prompts: list[dict],
    prompts_path: Path,
    *,
    max_length: int,
    too_long: str,
    opts,
    workers: Optional[int] = None,
) -> tuple[list[Sample], Counter, dict[str, list[str]]]:
    """Turn every conversation into training samples (:func:`eagle3.chat.samples.conversation_samples`): one
    sample (id = its id) or, when the template's history changes as turns are added, several (``{id}#turn{n}``);
    dense ``idx`` in file order. ``workers`` processes (:mod:`eagle3.capture.tokenize_pool`; results in file
    order). ``max_length`` / ``too_long``: ``extract.*``; ``opts``: :class:`eagle3.chat.template.ChatOptions`.

    Returns:
        ``(samples, counts, skipped_ids)``: counts ``skipped_*`` (too_long, no_loss_tokens, inconsistent,
        render_failed), ``truncated``, ``split_conversations``, ``split_samples``; ``skipped_ids``: reason ->
        conversation ids (first :data:`MAX_SKIPPED_IDS`).

    Raises:
        UserError: template-wide problems, or no sample at all (:func:`_refuse_no_sample`); the conversation
            named is the first in file order, whatever the worker count.
    """
    one = functools.partial(
        _tokenize_one, max_length=max_length, opts=opts, too_long=too_long, where=str(prompts_path)
    )
    samples: list[Sample] = []
    counts: Counter = Counter()
    skipped: dict[str, list[str]] = {}
    first_failure = None
    for rec, res in zip(
        prompts, map_records(one, tokenizer, prompts, workers=workers, desc="tokenize")
    ):
        counts.update(res.counts)
        if res.skip_reason is not None:
            reason = res.skip_reason
            ids = skipped.setdefault(
                reason.split(":", 1)[0] if reason.startswith("render_failed") else reason, []
            )
            if len(ids) < MAX_SKIPPED_IDS:
                ids.append(rec["id"])
            if first_failure is None:
                first_failure = (
                    f"{prompts_path}:{rec['line']}: conversation '{rec['id']}' skipped: {reason}"
                )
                log.warning("%s", first_failure)
        for s in res.samples:
            samples.append(
                Sample(len(samples), rec["id"] + s.suffix, list(s.input_ids), list(s.loss_mask))
            )
    if not samples and prompts:
        _refuse_no_sample(prompts, prompts_path, counts, first_failure)
    if counts["split_conversations"]:
        log.info(
            "%d conversations split into %d samples (history rendered differently per turn)",
            counts["split_conversations"],
            counts["split_samples"],
        )
    return samples, counts, skipped


def _refuse_no_sample(
    prompts: list[dict], prompts_path: Path, counts: Counter, first_failure: Optional[str]
) -> None:
    """Refuse a run in which every conversation was skipped (an empty shard set that 03 would refuse).

    Raises:
        UserError: every conversation failed to render (naming the first), else every one was skipped (the
            counts per reason and the fix).
    """
    if first_failure is not None and counts["skipped_render_failed"] == len(prompts):
        raise UserError(f"every conversation failed to render; the first: {first_failure}")
    why = ", ".join(
        f"{k.removeprefix('skipped_').replace('_', ' ')}: {v}"
        for k, v in sorted(counts.items())
        if k.startswith("skipped_") and v
    )
    hints = [
        h
        for k, h in (
            ("skipped_too_long", "raise extract.max_length or set extract.too_long: truncate"),
            (
                "skipped_no_loss_tokens",
                "a conversation needs an assistant answer (01 with "
                "prompts.regenerate: true writes them)",
            ),
        )
        if counts[k]
    ]
    raise UserError(
        f"{prompts_path}: no sample to capture: every conversation was skipped ({why}; the first at "
        f"line {prompts[0]['line']}, conversation '{prompts[0]['id']}'); "
        + "".join(h + "; " for h in hints)
        + "nothing written"
    )


def self_instruct_dropped(report: Optional[dict], limit: int) -> Optional[tuple[int, int, int]]:
    """``(self_instruct prompts in the file, how many a --limit of limit leaves out, kept)`` from 01's report
    counts (``prompts.self_instruct`` prompts come after the sampled sources); None: nothing left out, no counts."""
    c = report.get("counts") if isinstance(report, dict) else None
    if not isinstance(c, dict) or not all(
        isinstance(c.get(k), int) for k in ("self_instruct", "kept")
    ):
        return None
    n_si = c["self_instruct"] - min(c["self_instruct"], int(c.get("limited_out") or 0))
    dropped = min(n_si, c["kept"] - limit)
    return (n_si, dropped, c["kept"]) if dropped > 0 else None
