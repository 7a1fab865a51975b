"""Reading the pipeline's input files with one-line errors: a missing file names the stage that writes it, a file
that is not UTF-8 names its line and column, a JSON record holding a lone UTF-16 surrogate names its field, and a
torch file is loaded by the weights-only unpickler."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from eagle3.errors import UserError

if TYPE_CHECKING:
    import torch


def parse_json(text: str, path: str | os.PathLike, line: Optional[int] = None) -> Any:
    """``json.loads(text)``, ``text`` being the content of the file ``path``, or its line ``line`` (a JSONL record).

    Raises:
        UserError: ``<path>:<line>: malformed JSON: <what> (column N)``, the error's own line when ``line`` is
            None; the column is given apart because ``json.JSONDecodeError.msg`` alone ends in "at" for some
            errors ("Invalid control character at").
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = e.lineno if line is None else line
        raise UserError(f"{path}:{at}: malformed JSON: {e.msg} (column {e.colno})") from e


# A file a later stage reads -> the stage that writes it, so that running a stage too early says what to run
# (names as the stages define them: eagle3.shards.format.DATA_CONFIG, eagle3.data.vocab.VOCAB_MAP ...; tested).
WRITTEN_BY = {
    "prompts.jsonl": "01_prepare_prompts.py",
    "data_config.json": "02_extract_hidden.py",
    "manifest.jsonl": "02_extract_hidden.py",
    "vocab_map.pt": "03_prepare_data.py",
    "token_freq.pt": "03_prepare_data.py",
    "split.json": "03_prepare_data.py",
    "target_head.safetensors": "04_train.py",
}


def file_not_found(
    path: str | os.PathLike, what: str = "file", advice: Optional[str] = None
) -> UserError:
    """``<path>: <what> not found (<advice>)``. Without ``advice`` the note in brackets is
    ``02_extract_hidden.py writes it: run that stage first`` when ``path`` is a file a stage writes (:data:`WRITTEN_BY`,
    by file name), and for a relative path the folder it was looked for from (:func:`relative_hint`); none when
    neither applies."""
    path = Path(path)
    if advice is None:
        stage = WRITTEN_BY.get(path.name)
        notes = [f"{stage} writes it: run that stage first"] if stage else []
        advice = "; ".join(notes + ([relative_hint(path)] if relative_hint(path) else []))
    return UserError(f"{path}: {what} not found" + (f" ({advice})" if advice else ""))


def require_file(path: str | os.PathLike, what: str = "file", advice: Optional[str] = None) -> Path:
    """``path`` as a ``Path`` when it names an existing file, else the refusal :func:`file_not_found`
    ``(path, what, advice)`` (a folder is not a file).

    Raises:
        UserError: ``<path>: <what> not found (<advice>)``.
    """
    path = Path(path)
    if not path.is_file():
        raise file_not_found(path, what, advice)
    return path


def relative_hint(path: str | os.PathLike) -> str:
    """``relative paths are read from the current folder, /x`` for a relative ``path``, else ``''``: a config's
    relative ``output_root`` read from another folder than the earlier stages' is named as such."""
    return (
        ""
        if Path(path).is_absolute()
        else f"relative paths are read from the current folder, {Path.cwd()}"
    )


def safe_torch_load(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with one-line errors.

    Raises:
        UserError: the file is missing, truncated/corrupt, or holds objects that the
            weights-only unpickler refuses (e.g. a pickle crafted to run code).
    """
    path = require_file(path)
    try:
        if not zipfile.is_zipfile(path):  # torch.save writes a zip archive since torch 1.6
            raise zipfile.BadZipFile("not a complete zip archive, or not a torch file at all")
        import torch  # on use: the config imports this module before a stage's heavy imports

        return torch.load(path, map_location=map_location, weights_only=True)
    except (
        pickle.UnpicklingError,
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        ValueError,
        OSError,
    ) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        unsafe = isinstance(e, pickle.UnpicklingError)  # its line whole: it names what was refused
        why = (
            "refused by the weights-only loader (unsafe or foreign pickle)"
            if unsafe
            else "truncated or corrupt torch file"
        )
        raise UserError(f"{path}: {why}: {first if unsafe else first[:160]}") from e


def not_utf8_error(path: str | os.PathLike, exc: UnicodeDecodeError) -> UserError:
    """The one-line error for a file that is not UTF-8: ``file:line: not UTF-8 text: byte 0xff at
    column 12 ...`` (line and 1-based byte column found by decoding the file again; ``.gz`` and a BOM
    handled as the readers do).
    """
    path = Path(path)
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError):
        raw = b""
    start = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    try:
        raw[start:].decode("utf-8")
        pos = None
    except UnicodeDecodeError as e:
        pos = start + e.start
    if (
        pos is None
    ):  # the bytes changed since, or the error came from elsewhere: the codec's own words
        return UserError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); save the file as UTF-8"
        )
    line = raw.count(b"\n", 0, pos) + 1
    col = pos - raw.rfind(b"\n", 0, pos)
    return UserError(
        f"{path}:{line}: not UTF-8 text: byte 0x{raw[pos]:02x} at column {col} (byte {pos} of the file); "
        "save the file as UTF-8"
    )


# A JSON backslash-u escape of a UTF-16 surrogate (D800-DFFF): half of a pair is a lone surrogate after json.loads, which no
# UTF-8 writer or tokenizer takes (ShareGPT dumps hold such cut emoji). A whole pair decodes to one character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_field(obj: Any, field: str = "") -> Optional[str]:
    """The path (``messages[1].content``; ``<key>`` for a key itself) of the first string in ``obj`` holding a lone
    UTF-16 surrogate, else None."""
    if isinstance(obj, str):
        return (field or "<value>") if _SURROGATE.search(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{field}.{k}" if field else str(k)
            if isinstance(k, str) and _SURROGATE.search(k):
                return sub
            found = lone_surrogate_field(v, sub)
            if found:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = lone_surrogate_field(v, f"{field}[{i}]")
            if found:
                return found
    return None


def check_no_lone_surrogate(text: str, record: Any, where: str) -> None:
    """Refuse a record parsed from JSON ``text`` that holds a lone surrogate (regex pre-filter first).

    Raises:
        UserError: ``<where>: field '...' holds an unpaired UTF-16 surrogate escape ...``.
    """
    if not _SURROGATE_ESCAPE.search(text):
        return
    field = lone_surrogate_field(record)
    if field is not None:
        raise lone_surrogate_error(where, field)


def lone_surrogate_error(where: str, field: str) -> UserError:
    """The one wording of a lone-surrogate refusal, for every reader and the config: ``<where>: field '<field>' holds an
    unpaired UTF-16 surrogate escape ...`` (``where``: ``file:line``, or the ``--set`` that gave it)."""
    return UserError(
        f"{where}: field '{field}' holds an unpaired UTF-16 surrogate escape (half of a \\uD83D\\uDE00 "
        "pair, e.g. a cut emoji), which is not text: no UTF-8 file or tokenizer takes it; remove it or "
        "complete the pair"
    )


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, record)`` per non-blank line of a JSONL file (``.gz``: gzip; BOM skipped).

    Raises:
        UserError: ``file:line: malformed JSON``, not UTF-8 (:func:`not_utf8_error`), or a lone
            surrogate (:func:`check_no_lone_surrogate`).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                # the line ending dropped: an error at the line's end would otherwise land at column 1 of the next
                rec = parse_json(line.rstrip("\r\n"), path, lineno)
                check_no_lone_surrogate(line, rec, f"{path}:{lineno}")
                yield lineno, rec
    except UnicodeDecodeError as e:
        raise not_utf8_error(path, e) from e


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, streamed in 1 MiB blocks (shard checksums, input fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
