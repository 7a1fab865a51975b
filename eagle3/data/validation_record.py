"""Stage 03's validation record: what a full shard validation established, reused while the shards are unchanged.

A full validation in 03 hashes every shard against ``manifest.jsonl`` (sha256 recorded by 02) and loads it through
:func:`eagle3.shards.read.load_sample` (keys, dtypes, shapes, NaN/Inf). The record (JSON, ``VALIDATION_RECORD``) holds

- ``fingerprint``: sha256 over the resolved shards folder path, the sha256 of ``manifest.jsonl`` and of
  ``data_config.json``, and ``(relative path, size, mtime_ns)`` of every shard file;
- ``status``: ``"passed"`` (``stats``: ``num_samples``, ``num_tokens``, ``num_loss_tokens``, ``max_len``;
  ``token_freq``: the int64 ``[target_V]`` loss-token counts as a list); ``"failed"`` (``error``: 03's one-line
  error) replacing a passing record of the same fingerprint; ``"unfinished"``: written by ``03 --revalidate`` before
  its full pass, so a pass stopped half-way leaves no passing record. A record without ``status`` (written before
  it existed) is a passing one;
- ``version`` (:data:`RECORD_VERSION`) and ``created_at`` (unix seconds, UTC).

A later 03 whose fingerprint matches a passing record reuses stats and counts instead of hashing and loading; a failed
or unfinished record is never reused. Stage 04 trains only on a shard set with a passing record of its current
fingerprint (:func:`require_passed`). The fingerprint changes with a shard file's size or mtime, an added or removed
shard, a changed manifest / data_config; it cannot see bytes changed in place with size and mtime kept
(``--revalidate`` forces the full pass).

Where it lives: the shards folder when writable, else the run's data folder; readers look in both, shards folder first;
a written record replaces one of the same fingerprint in the other folder. A record that cannot be read or parsed, has
another version, or holds inconsistent values is ignored (a warning for the unreadable/inconsistent kinds) and
rewritten after the full pass; never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from eagle3.errors import UserError
from eagle3.io import atomic_write_json
from eagle3.io.read import file_sha256

log = logging.getLogger(__name__)

VALIDATION_RECORD = "validation_record.json"
RECORD_FORMAT = "eagle3-03-validation"
RECORD_VERSION = 1  # ``status`` was added without a bump: a record without it is a passing one
PASSED, FAILED, UNFINISHED = (
    "passed",
    "failed",
    "unfinished",
)  # unfinished: a --revalidate pass under way
STAT_KEYS = ("num_samples", "num_tokens", "num_loss_tokens", "max_len")
Count = Annotated[StrictInt, Field(ge=0)]


class RecordStats(BaseModel):
    """A passing record's ``stats``: non-negative integers."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    num_samples: Count
    num_tokens: Count
    num_loss_tokens: Count
    max_len: Count


class ValidationRecord(BaseModel):
    """The record file (fields in the file's order; see the module docstring). A passing one holds ``stats`` and
    ``token_freq`` (int, ``[target_V]``), a failed or unfinished one ``error``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    format: Literal["eagle3-03-validation"] = RECORD_FORMAT
    version: Literal[1] = RECORD_VERSION
    created_at: Union[StrictInt, StrictFloat] = Field(default_factory=time.time)
    fingerprint: str
    status: Literal["passed", "failed", "unfinished"] = PASSED
    error: Optional[str] = None
    stats: Optional[RecordStats] = None
    token_freq: Optional[list[Count]] = None


def shard_set_fingerprint(
    shards: Path, paths: list[tuple[int, Path]], manifest: Path, data_config: Path
) -> str:
    """Hex sha256 identifying the shard set as 03 sees it (cheap: a stat per shard, no shard read).

    Covers the resolved ``shards`` path (a copied folder is validated again), the sha256 of
    ``manifest`` (None when absent: flat speculators folders) and of ``data_config``, and
    ``(path relative to shards, st_size, st_mtime_ns)`` of each shard in ``paths`` order
    (``eagle3.shards.format.list_samples``: sorted by idx).

    Raises:
        OSError: a shard vanished between listing and ``stat``.
    """
    files = []
    for _, p in paths:
        st = os.stat(p)
        files.append([p.relative_to(shards).as_posix(), st.st_size, st.st_mtime_ns])
    parts = {
        "shards_dir": str(shards.resolve()),
        "manifest_sha256": file_sha256(manifest) if manifest.is_file() else None,
        "data_config_sha256": file_sha256(data_config),
        "files": files,
    }
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def _inconsistent(rec: ValidationRecord, vocab_size: int) -> Optional[str]:
    """What makes a passing record unusable (None: nothing): ``stats`` / ``token_freq`` missing, another vocab
    size, or counts that do not sum to ``stats.num_loss_tokens``."""
    if rec.stats is None or rec.token_freq is None:
        return "no stats / token_freq"
    if len(rec.token_freq) != vocab_size:
        return f"key 'token_freq' holds {len(rec.token_freq)} counts, not {vocab_size}"
    if sum(rec.token_freq) != rec.stats.num_loss_tokens:
        return (
            f"key 'token_freq' sums to {sum(rec.token_freq)}, key 'stats' says "
            f"{rec.stats.num_loss_tokens} loss tokens"
        )
    return None


def load_matching_record(
    folders: list[Path], fingerprint: str, vocab_size: int
) -> Optional[tuple[dict, torch.Tensor, float, Path]]:
    """The first record in ``folders`` whose fingerprint equals ``fingerprint``.

    Returns:
        ``(stats, token_freq int64 [vocab_size], created_at unix seconds, record path)``, or None when
        no folder holds a matching, readable record. Unreadable or inconsistent records are logged as
        warnings and skipped; records of another format/version or another fingerprint are skipped
        (logged at info).
    """
    for folder in folders:
        path = folder / VALIDATION_RECORD
        rec, problem = _read_record(path)
        if problem:
            log.warning("%s: %s; ignoring it, validating every shard, rewriting it", path, problem)
        if rec is None:
            continue
        if rec.fingerprint != fingerprint:
            skip = "the shards changed since that validation"
        elif rec.status == UNFINISHED:
            skip = "an earlier 03_prepare_data.py --revalidate did not finish"
        elif rec.status != PASSED:
            skip = f"03's last validation of these shards failed ({rec.error})"
        else:
            skip = None
        if skip:
            log.info("%s: %s; validating every shard", path, skip)
            continue
        bad = _inconsistent(rec, vocab_size)
        if bad:
            log.warning(
                "%s: corrupt validation record (%s); ignoring it, validating every shard, rewriting it",
                path,
                bad,
            )
            continue
        stats = rec.stats.model_dump()
        return stats, torch.tensor(rec.token_freq, dtype=torch.int64), float(rec.created_at), path
    return None


def write_record(folders: list[Path], fingerprint: str, stats: dict, freq: torch.Tensor) -> Path:
    """Write a passing record atomically into the first folder of ``folders`` that accepts it.

    ``freq``: int64 ``[target_V]``. A folder that refuses the write (read-only, permissions, disk
    full) is skipped with a warning. A record of the same fingerprint in a later folder (a failed one
    of an earlier 03) is replaced by this one.

    Returns:
        the path written.

    Raises:
        UserError: no folder accepts it (stage 04 trains only on a shard set with a passing record).
    """
    record = ValidationRecord(
        fingerprint=fingerprint,
        stats=RecordStats(**{k: int(stats[k]) for k in STAT_KEYS}),
        token_freq=[int(x) for x in freq.tolist()],
    )
    path = _write_first(folders, record)
    if path is None:
        raise UserError(
            f"{folders[0] / VALIDATION_RECORD}: cannot write the validation record here nor in "
            f"{folders[-1]} (see the warnings above); 04_train.py needs it: free space or fix "
            "permissions and re-run 03_prepare_data.py"
        )
    return path


def write_failed_record(folders: list[Path], fingerprint: str, error: str) -> Optional[Path]:
    """Record that a full validation of the shard set ``fingerprint`` failed with ``error`` (03's one-line
    message), replacing any record of that fingerprint in ``folders`` (an earlier passing one included),
    so stage 04 refuses the set until 03 passes on it again.

    Returns:
        the path written, or None (no folder accepted it; warned).
    """
    record = ValidationRecord(
        fingerprint=fingerprint, status=FAILED, error=error.splitlines()[0] if error else "error"
    )
    return _write_first(folders, record)


def write_unfinished_record(folders: list[Path], fingerprint: str) -> Optional[Path]:
    """Record that a forced full validation (``03 --revalidate``) of the shard set ``fingerprint`` has started,
    replacing any record of that fingerprint in ``folders`` (a passing one included): until the pass writes its
    outcome, no 03 reuses an earlier validation and stage 04 refuses the set.

    Returns:
        the path written, or None (no folder accepted it; warned).
    """
    record = ValidationRecord(
        fingerprint=fingerprint,
        status=UNFINISHED,
        error="03_prepare_data.py --revalidate started a full validation that did not finish",
    )
    return _write_first(folders, record)


def _write_first(folders: list[Path], record: ValidationRecord) -> Optional[Path]:
    """``record`` into the first folder that accepts it; then a record of the same fingerprint in any other
    folder is removed (a failed one after a pass, or a passing one after a failure)."""
    written = None
    for folder in folders:
        path = folder / VALIDATION_RECORD
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, record.model_dump(exclude_none=True))
            written = path
            break
        except (OSError, UserError) as e:
            log.warning(
                "%s: cannot write the validation record (%s)",
                path,
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
    others = [f / VALIDATION_RECORD for f in folders] if written is not None else []
    for path in others:
        if path != written and record_fingerprint(path) == record.fingerprint:
            try:
                path.unlink()
            except OSError as e:
                log.warning(
                    "%s: cannot remove this older validation record of the same shards (%s)",
                    path,
                    e,
                )
    return written


def _read_record(path: Path) -> tuple[Optional[ValidationRecord], Optional[str]]:
    """The record at ``path`` when it is one of this version: ``(record, None)``; else ``(None, why)`` for a file
    that cannot be read or is not such a record, ``(None, None)`` when there is no file."""
    if not path.is_file():
        return None, None
    try:
        return ValidationRecord.model_validate_json(path.read_bytes()), None
    except OSError as e:
        return None, f"unreadable validation record ({e})"
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            return None, f"unreadable validation record ({err['msg']})"
        where = ".".join(map(str, err["loc"])) or "(top level)"
        why = f"not a version-{RECORD_VERSION} validation record (key {where!r}: {err['msg']})"
        return None, why


def record_fingerprint(path: Path) -> Optional[str]:
    """The ``fingerprint`` of the record at ``path``, or None (absent, unreadable, not a record)."""
    rec, _ = _read_record(path)
    return None if rec is None else rec.fingerprint


def unfinished_record(folders: list[Path]) -> Optional[Path]:
    """The validation record that an interrupted ``03 --revalidate`` left ``unfinished``
    (:func:`write_unfinished_record`), or None: the first folder of ``folders`` holding a readable record decides
    (03's own order: the shards folder, then the data folder)."""
    for folder in folders:
        path = Path(folder) / VALIDATION_RECORD
        rec, _ = _read_record(path)
        if rec is not None:
            return path if rec.status == UNFINISHED else None
    return None


def fingerprint_now(shards: Path) -> str:
    """:func:`shard_set_fingerprint` of the shard set in ``shards`` as it is now (its samples listed, its
    ``manifest.jsonl`` and ``data_config.json``; a stat per shard, no shard read)."""
    from eagle3.shards.format import DATA_CONFIG, list_samples
    from eagle3.shards.manifest import MANIFEST

    shards = Path(shards)
    return shard_set_fingerprint(
        shards, list_samples(shards), shards / MANIFEST, shards / DATA_CONFIG
    )


def require_passed(shards: Path, data_dir: Path) -> Path:
    """Stage 04's input check: the shard set as it is now passed 03's last validation of it.

    Computes :func:`shard_set_fingerprint` of ``shards`` (a stat per shard, sha256 of ``manifest.jsonl`` and
    ``data_config.json``; no shard read) and looks for a record of it in ``shards`` then ``data_dir``.

    Returns:
        the passing record's path.

    Raises:
        UserError: one line naming the shards folder and record, saying to run 03: a record of this
            fingerprint says 03's last validation failed (its error quoted); or no record of a passing
            validation matches the current shards (none written, or shards / manifest / data_config changed
            since: added, removed, re-extracted, replaced or ``touch``ed shards; a shard modified after the shards
            folder's record was written is named: :func:`_changed_file`).
    """
    shards, data_dir = Path(shards), Path(data_dir)
    fp = fingerprint_now(shards)
    recs = [
        (f / VALIDATION_RECORD, _read_record(f / VALIDATION_RECORD)[0]) for f in (shards, data_dir)
    ]
    recs = [(path, rec) for path, rec in recs if rec is not None]
    current = [(path, rec) for path, rec in recs if rec.fingerprint == fp]
    bad = [(path, rec) for path, rec in current if rec.status != PASSED]
    if current and not bad:
        return current[0][0]
    changed = _changed_file(shards, recs[0][0]) if recs and not current else None
    if bad and bad[0][1].status == UNFINISHED:
        why = (
            f"03_prepare_data.py --revalidate of this shard set did not finish (record: {bad[0][0]}); run "
            f"03_prepare_data.py before training"
        )
    elif bad:
        why = (
            f"03's last validation of this shard set failed ({bad[0][1].error}); fix or re-extract the shard and "
            f"run 03_prepare_data.py (record: {bad[0][0]})"
        )
    elif recs:
        why = (
            f"the shards, manifest.jsonl or data_config.json changed since 03 last validated them, or the folder "
            f"was moved or copied (the record holds its path, each shard's size and mtime: {recs[0][0]}); run "
            f"03_prepare_data.py before training"
        )
    else:
        why = (
            f"no record that 03 validated this shard set ({VALIDATION_RECORD} in {shards} or {data_dir}); run "
            f"03_prepare_data.py before training"
        )
    raise UserError(changed or f"{shards}: {why}")


def _changed_file(shards: Path, stale: Path) -> Optional[str]:
    """The refusal naming the file behind a stale record when its mtime says so: the first shard (idx order) whose
    ``st_mtime_ns`` is later than the time the shards folder's own record ``stale`` was written (its ``created_at``,
    unix seconds): its mtime is then not the one 03's fingerprint holds. A stat per shard; only on 04's refusal path.

    One line naming the shard, when 03 validated the set, how many other shards changed since, and to run 03 again;
    None when no shard is newer (a removed or added shard, a changed manifest.jsonl / data_config.json (hashed, not
    dated), a moved or copied folder, a file restored with an older mtime, or a record kept in the data folder:
    :func:`require_passed`'s general message then says what may have changed).
    """
    from eagle3.shards.format import list_samples

    rec, _ = _read_record(stale)
    if rec is None or stale.parent != shards:
        return None
    created = rec.created_at
    newer = [p for _, p in list_samples(shards) if p.stat().st_mtime_ns > created * 1e9]
    if not newer:
        return None
    n = len(newer) - 1
    more = f" (and {n} more file{'s' if n > 1 else ''})" if n else ""
    return (
        f"{newer[0]}: changed after 03 validated this shard set ({format_time(created)}){more}; "
        f"run 03_prepare_data.py again before training (record: {stale})"
    )


def format_time(ts: float) -> str:
    """``YYYY-MM-DD HH:MM:SS UTC`` of unix seconds ``ts``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
