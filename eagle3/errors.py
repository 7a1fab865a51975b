"""User-facing errors: one line, naming the file, line, key or field at fault."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import TypeAdapter, ValidationError


class UserError(Exception):
    """Bad input (file, config field, shard...). The CLI prints ``error: <message>`` and exits 2.

    The message must be a single line that names the file and the line/key/field at fault.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


_OBJECT_TYPES = ("model_type", "dict_type", "model_attributes_type")


def refusal(err, where: str, fix: str = "") -> UserError:
    """The one-line refusal of a record that failed its pydantic model: the first error of the
    ``pydantic.ValidationError`` ``err`` as ``<where>: field '<loc>' <what is wrong>, got <value>[; <fix>]``.

    ``where`` names the file and record (``prompts.jsonl:3``); ``loc`` is the field path in the record
    (``messages[0].tokens[2]``); a record that is not an object at all says so.
    """
    e = err.errors(include_url=False)[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
    value = e.get("input")
    got = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    if e["type"] in _OBJECT_TYPES:
        what = f"should be a JSON object, got {type(value).__name__}"
    elif e["type"] == "missing":
        what = "is missing"
    elif e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        what = "is not a known field"
    elif e["type"] == "value_error":
        what = e["msg"].removeprefix("Value error, ")
    elif e["type"] == "too_short":
        what = f"should hold at least {e['ctx']['min_length']} item(s), got {got}"
    elif e["type"] == "list_type":
        what = f"should be a list, got {got}"
    else:
        what = f"{e['msg'].removeprefix('Input ')}, got {got}"
    head = f"{where}: field '{loc}'" if loc else f"{where}: the record"
    return UserError(f"{head} {what}" + (f"; {fix}" if fix else ""))


def validated(model, obj: Any, where: str, fix: str = "", context: Optional[dict] = None):
    """``obj`` validated as ``model`` (a pydantic model class or a ``TypeAdapter``) and returned as that model;
    the first fault raises :func:`refusal` ``(where, fix)``."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(obj, context=context)
        return model.model_validate(obj, context=context)
    except ValidationError as e:
        raise refusal(e, where, fix) from None
