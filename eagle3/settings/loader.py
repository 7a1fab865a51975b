"""Reading a run YAML and its ``--set`` overrides, and one-line errors that name the file and line of a key.

The YAML is read by ruamel.yaml as YAML 1.1 (the dialect PyYAML reads: unquoted ``yes``/``no``/``on``/``off`` are
booleans), with duplicate keys refused. A pydantic error becomes ``<file>:<line>: field '<key>': <what>`` (or
``--set <override>: ...`` when an override set that key): :func:`format_validation_error`.
"""

from __future__ import annotations

import difflib
import re
import typing
import warnings
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML, MappingNode, SequenceNode
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import MantissaNoDotYAML1_1Warning, YAMLError
from ruamel.yaml.resolver import VersionedResolver

from eagle3.errors import UserError
from eagle3.io.read import not_utf8_error, require_file
from eagle3.settings.types import ItemError

Loc = tuple[str, ...]


# PyYAML's YAML 1.1 booleans: the spec's y / Y / n / N are strings there (``path: y`` is the file "y")
_PYYAML_BOOL = re.compile(
    r"^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$"
)


class _PyYAMLResolver(VersionedResolver):
    """ruamel.yaml's resolver with PyYAML's YAML 1.1 booleans (:data:`_PYYAML_BOOL`)."""

    def add_version_implicit_resolver(
        self, version: Any, tag: Any, regexp: Any, first: Any
    ) -> None:
        if version == (1, 1) and tag == "tag:yaml.org,2002:bool":
            regexp = _PYYAML_BOOL
        super().add_version_implicit_resolver(version, tag, regexp, first)


def _yaml(typ: str = "safe") -> YAML:
    """A ruamel.yaml reader of YAML 1.1 as PyYAML reads it (its booleans) that refuses a key given twice in one
    mapping."""
    y = YAML(typ=typ, pure=True)
    y.Resolver = _PyYAMLResolver
    y.version = (1, 1)
    y.allow_duplicate_keys = False
    return y


def parse_yaml(text: str) -> Any:
    """The YAML ``text`` as plain Python values (dict, list, str, int, float, bool, None).

    Raises:
        YAMLError: malformed YAML; ``DuplicateKeyError`` for a key given twice in one mapping.
    """
    with warnings.catch_warnings():  # 1e-3 is a float here; YAML 1.1 wants 1.0e-3 and ruamel warns
        warnings.simplefilter("ignore", MantissaNoDotYAML1_1Warning)
        return _yaml().load(text)


def yaml_error(path: Path, e: YAMLError, text: str) -> UserError:
    """The one line for a YAML ``text`` that does not parse: ``run.yaml:9: config key 'benchmark.num_prompts' given
    twice (first at line 7); keep one``, else ``run.yaml:3: malformed YAML: <the parser's problem>``."""
    mark = getattr(e, "problem_mark", None)
    dup = (
        _duplicate_at(_yaml("rt").compose(text), mark) if isinstance(e, DuplicateKeyError) else None
    )
    if dup is not None:
        return UserError(
            f"{path}:{mark.line + 1}: config key '{dup[0]}' given twice (first at line {dup[1]}); "
            "keep one"
        )
    where = f":{mark.line + 1}" if mark is not None else ""
    return UserError(f"{path}{where}: malformed YAML: {yaml_problem(e)}")


def _duplicate_at(node, mark, prefix: tuple = ()) -> Optional[tuple[str, int]]:
    """``(dotted key, line of its first occurrence)`` of the key node at ``mark`` in the composed YAML ``node``."""
    if isinstance(node, MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            key = prefix + (str(k.value),)
            if (k.start_mark.line, k.start_mark.column) == (mark.line, mark.column):
                return field_path(key), first.get(str(k.value), k.start_mark.line + 1)
            first.setdefault(str(k.value), k.start_mark.line + 1)
            if found := _duplicate_at(v, mark, key):
                return found
    elif isinstance(node, SequenceNode):
        for i, v in enumerate(node.value):
            if found := _duplicate_at(v, mark, prefix + (i,)):
                return found
    return None


def key_lines(text: str) -> dict[Loc, int]:
    """1-based line of every key in the YAML ``text``: ``{("train", "lr"): 14, ...}`` (list items by index, as
    strings). Empty when the text does not parse (:func:`parse_yaml` reports that)."""
    try:
        root = _yaml("rt").compose(text)
    except YAMLError:
        return {}
    out: dict[Loc, int] = {}

    def walk(node, prefix: Loc) -> None:
        if isinstance(node, MappingNode):
            items = [(str(k.value), k, v) for k, v in node.value]
        elif isinstance(node, SequenceNode):
            items = [(str(i), v, v) for i, v in enumerate(node.value)]
        else:
            return
        for name, at, value in items:
            out[prefix + (name,)] = at.start_mark.line + 1
            walk(value, prefix + (name,))

    walk(root, ())
    return out


def yaml_problem(e: YAMLError) -> str:
    """The parser's own one-line description of a YAML error (its ``problem``, else the whole text)."""
    return " ".join(str(getattr(e, "problem", None) or e).split())


def one_line(text: str, limit: int = 80) -> str:
    """``text`` with line breaks shown as ``\\n``, cut to ``limit`` characters."""
    t = text.replace("\r", "\\r").replace("\n", "\\n")
    return t if len(t) <= limit else t[: limit - 3] + "..."


def _short(value, limit: int = 80) -> str:
    """``repr`` on one line, cut to ``limit`` characters (a chat template can be kilobytes)."""
    return one_line(repr(value), limit)


def apply_overrides(raw: dict, overrides: list[str]) -> dict[Loc, str]:
    """Apply ``section.key=value`` overrides to the parsed YAML mapping ``raw`` in place.

    The value is parsed as YAML (``train.lr=3e-4`` is a float, ``export.engine=vllm`` a string); to
    pass a string YAML would read otherwise (a Jinja template ``{{ x }}`` or ``{% if %}``, a leading
    ``*`` or ``!``), quote it: ``--set "verifier.chat_template='{{ x }}'"``.

    Returns:
        ``{key tuple: override text for messages}`` (later overrides of the same key win).

    Raises:
        UserError: ``--set <override>: ...`` for a missing ``=``, an empty key part, a value that is
            not valid YAML, or a key below a field that is not a section (naming the earlier override that
            made it a value, e.g. ``--set train=1`` before ``--set train.lr=...``).
    """
    applied: dict[Loc, str] = {}
    for ov in overrides:
        fault = _override_fault(raw, ov, applied)
        if isinstance(fault, str):
            raise UserError(f"--set {one_line(ov, 80)}: {fault}")
        parts, value, node = fault
        node[parts[-1]] = value
        applied[parts] = one_line(ov, 80)
    return applied


def _override_fault(raw: dict, ov: str, applied: dict[Loc, str]) -> str | tuple[Loc, Any, dict]:
    """What is wrong with the override ``ov`` (``section.key=value``), the text after ``--set <override>: ``: a
    missing ``=``, an empty key part, a value that is not valid YAML, or a key below a field that is not a section
    (naming the earlier override in ``applied`` that made it a value); else ``(key parts, parsed value, the section
    of ``raw`` it goes in)``, the sections on its path created as empty ones."""
    key, sep, val = ov.partition("=")
    if not sep:
        return "expected section.key=value"
    parts = tuple(x.strip() for x in key.split("."))
    if not all(parts):
        return f"empty key name in '{key}' (expected section.key=value)"
    try:
        value = parse_yaml(val)
    except YAMLError as e:
        return (
            f"value is not valid YAML ({yaml_problem(e)}); to pass it as a string, "
            f"quote it: --set \"{key}='...'\""
        )
    node = raw
    for i, p in enumerate(parts[:-1]):
        if node.get(p) is None:  # absent, or an empty section (`train:` with nothing under it)
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            prefix = parts[: i + 1]
            by = f" (set by --set {applied[prefix]})" if prefix in applied else ""
            return f"'{'.'.join(prefix)}' is a value{by}, not a section"
    return parts, value, node


def field_path(loc) -> str:
    """The name of a config field (or a record's field) at ``loc``, a pydantic error location or a key path: keys
    joined by ``.``, list items as ``[i]`` (``benchmark.datasets[0]``, ``prompts.self_instruct.exclude[1]``), the form
    :func:`eagle3.io.read.lone_surrogate_field` and the prompt readers use."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def at_item(e: dict, raw) -> dict:
    """The pydantic error ``e`` moved to the list item an :class:`ItemError` names (its ``loc`` + ``[i]``, its
    ``input`` the item), when the value at ``loc`` in ``raw`` (the mapping that was validated) is a list: one string
    a list field read as a list of one keeps the field's name."""
    item = (e.get("ctx") or {}).get("error")
    if isinstance(item, ItemError) and isinstance(_value_at(raw, e["loc"]), list):
        return {**e, "loc": (*e["loc"], item.index), "input": item.item}
    return e


def _value_at(raw, loc):
    """The value at ``loc`` (keys and list indices) in the parsed YAML ``raw``, or None where there is none."""
    for part in loc:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and isinstance(part, int) and 0 <= part < len(raw):
            raw = raw[part]
        else:
            return None
    return raw


def format_validation_error(
    path: Path,
    err: ValidationError,
    root: type[BaseModel],
    overrides: Optional[dict] = None,
    lines: Optional[dict] = None,
    raw: Optional[dict] = None,
) -> str:
    """One line for the first pydantic error of validating ``raw`` as ``root``: ``<where>: <what>``.

    ``where`` is the ``--set`` override that set the key (:func:`_blamed_override`), else the file and the line of
    the key (``run.yaml:14``, from ``lines`` = :func:`key_lines`; for a missing key, the section that lacks it). An
    unknown key gets the closest valid key (``did you mean 'lr'?``, :func:`did_you_mean`).
    """
    e = at_item(err.errors()[0], raw)
    loc_t = tuple(str(x) for x in e["loc"])
    loc = field_path(e["loc"])
    where = _blamed_override(e["type"], loc_t, overrides or {}, lines or {})
    if where is None:
        where = str(path)
        line = next(
            (lines[loc_t[:n]] for n in range(len(loc_t), 0, -1) if loc_t[:n] in (lines or {})),
            None,
        )
        if line is not None:
            where = f"{where}:{line}"
    if e["type"] == "extra_forbidden":
        return f"{where}: unknown config key '{loc}'{did_you_mean(root, loc_t)}"
    if e["type"] == "missing":
        return f"{where}: missing required config key '{loc}'"
    msg = _error_words(e)
    got = "" if msg.endswith(repr(e.get("input"))) else f" (got {_short(e.get('input'))})"
    return f"{where}: field '{loc}': {msg}{got}"


def _blamed_override(kind: str, loc: Loc, overrides: dict, lines: dict) -> Optional[str]:
    """``--set <text>`` of the override behind the error at ``loc``: one at or below that key, or above it (an
    unknown section the override created), or, for a missing key, one that created the section lacking it
    (``--set prompts.self_instruct.exclude=x`` on a config without ``prompts.self_instruct``); else None."""
    blamed = None
    for keys, text in overrides.items():
        n = min(len(keys), len(loc))
        if n and keys[:n] == loc[:n]:
            blamed = f"--set {text}"
        elif (
            kind == "missing"
            and len(loc) > 1
            and keys[: len(loc) - 1] == loc[:-1]
            and loc[:-1] not in lines
        ):
            blamed = f"--set {text}"
    return blamed


def _error_words(e: dict) -> str:
    """The message of the pydantic error ``e`` in a YAML user's words: a strict type's refusal says what was given
    (a boolean for a number, a string for an integer, anything but ``true``/``false`` for a flag); a validator's
    ``ValueError`` keeps its own text."""
    kind, value = e["type"], e.get("input")
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return "expected a number, not a boolean"
    if kind == "int_type" and isinstance(value, str):
        quoted = re.fullmatch(
            r"\s*[-+]?\d+\s*", value
        )  # "32000": a number in quotes; '10k': not one
        why = "(quoted in the YAML?)" if quoted else "(digits only: no separators, units or words)"
        return f"expected an integer, not a string {why}"
    if kind == "bool_type":
        return "expected true or false (an unquoted YAML boolean)"
    if kind == "float_type" and isinstance(
        value, str
    ):  # the lax float's words, as before strict types
        return "Input should be a valid number, unable to parse string as a number"
    return e["msg"].removeprefix("Value error, ") if kind == "value_error" else e["msg"]


def _section_model(root: type[BaseModel], loc: Loc) -> Optional[type[BaseModel]]:
    """The config section model reached by the keys ``loc`` from ``root`` (None past a leaf)."""

    def sub(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return ann
        return next((m for a in typing.get_args(ann) if (m := sub(a)) is not None), None)

    model: Optional[type[BaseModel]] = root
    for part in loc:
        field = model.model_fields.get(part) if model else None
        model = sub(field.annotation) if field else None
    return model


def did_you_mean(root: type[BaseModel], loc: Loc) -> str:
    """`` (did you mean 'lr'?)`` for the unknown key ``loc[-1]`` among its section's keys (difflib's
    closest match, ratio >= 0.6), else ``''``. A key of another section (``train.draft_vocab_size``,
    ``benchmark.engine``, ``draft_vocab_size`` at the top) names where it belongs instead:
    ``(did you mean 'data.draft_vocab_size'?)``."""
    model = _section_model(root, loc[:-1])
    if model is None:
        return ""
    if loc == ("output_dir",):  # the run's folder: five sections have an output_dir, none is meant
        return (
            " (did you mean 'output_root', the run's folder? a stage's own folder is its section's output_dir, "
            "e.g. 'train.output_dir')"
        )
    elsewhere = [
        f"{name}.{loc[-1]}"
        for name in root.model_fields
        if (section := _section_model(root, (name,))) is not None
        and (name,) != loc[:-1]
        and loc[-1] in section.model_fields
    ]
    if elsewhere:
        return " (did you mean " + " or ".join(f"'{k}'" for k in elsewhere) + "?)"
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def read_config_text(path: Path) -> str:
    """The text of the config file ``path``.

    Raises:
        UserError: ``<path>: config file not found`` (``(it is a directory)``; :func:`eagle3.io.read.require_file`),
            not UTF-8 (with the line), or unreadable (with the OS's reason).
    """
    require_file(path, "config file", "it is a directory" if path.is_dir() else "")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # run.yaml:3: not UTF-8 text: byte 0xe9 at column 14 ...
        raise not_utf8_error(path, e) from e
    except OSError as e:
        raise UserError(
            f"{path}: cannot read the config file ({e.__class__.__name__}: "
            f"{getattr(e, 'strerror', None) or e})"
        ) from e
