"""The run YAML's field types: the base of every section and the types pydantic has no word for.

Scalar fields use pydantic's strict types (``StrictInt``, ``StrictFloat``, ``StrictBool``): a YAML boolean is never
a number, a quoted number never an integer, and a true/false field takes only a YAML boolean;
:func:`eagle3.settings.loader.format_validation_error` words their errors. The YAML is read as YAML 1.1 (unquoted
``yes``/``no``/``on``/``off`` are booleans), so the ``auto|on|off`` fields take an unquoted ``on``/``off``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict


class ItemError(ValueError):
    """A validator's refusal of one item of a list field: the error names the item (``field
    'benchmark.server_urls[1]': ...``, with the item's own YAML line and value), not the whole list
    (:func:`eagle3.settings.loader.at_item`)."""

    def __init__(self, index: int, item, message: str):
        super().__init__(message)
        self.index, self.item = index, item


def check_items(values: list, check) -> list:
    """``[check(v) for v in values]``, a ``ValueError`` of item ``i`` re-raised as :class:`ItemError` naming it."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(check(v))
        except ItemError:
            raise
        except ValueError as e:
            raise ItemError(i, v, str(e)) from None
    return out


def check_http_url(url: str) -> str:
    """``url`` if it is an absolute ``http://`` or ``https://`` URL with a host (a server base URL such
    as ``http://127.0.0.1:30000``); else ``ValueError`` with a one-line reason (pydantic and argparse
    turn it into the field's / flag's message)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a non-numeric or out-of-range port
    except ValueError as e:
        raise ValueError(f"not a valid URL ({e}): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://host:port, got {url!r}")
    return url


def type_word(v) -> str:
    """A YAML user's word for the type of ``v`` (``a number``, ``a mapping``, ...)."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return "null" if v is None else type(v).__name__


def _one_as_list(v):
    """One string where a list of strings goes is a list of one (``datasets: humaneval``)."""
    return [v] if isinstance(v, str) else v


def _str_or_str_list(v):
    """A string, or a list of strings naming the bad item: pydantic reports each branch of the Union apart, and its
    first one (``field 'prompts.source.str'``) names a key that does not exist and hides that a list is fine."""
    if v is None:
        raise ValueError("expected a string or a list of strings, not null")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of strings, not {type_word(v)}")
    bad = next((i for i, x in enumerate(v) if not isinstance(x, str)), None)
    if bad is not None:
        raise ItemError(bad, v[bad], f"must be a string, not {type_word(v[bad])}")
    return v


def _on_off(v):
    """An unquoted ``on``/``off`` (or ``true``/``false``) is a YAML 1.1 boolean: it means that word."""
    return ("on" if v else "off") if isinstance(v, bool) else v


#: A list of strings that also takes one string as a list of one (``--set benchmark.datasets=humaneval``).
StrList = Annotated[list[str], BeforeValidator(_one_as_list)]
#: A string or a list of strings (``prompts.source``, ``extract.sglang_url``), a bad item named ``field[i]``.
StrOrList = Annotated[Union[str, list[str]], BeforeValidator(_str_or_str_list)]
#: ``auto|on|off`` (``train.bf16``): the YAML boolean of an unquoted ``on``/``off`` is that word.
OnOff = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors (``extra="forbid"``) and an assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
