"""Stage 01's regeneration resume log: finished conversations, appended and fsynced one by one,
next to the prompts file (:data:`PARTIAL_NAME`); a rerun with the same settings answers only
the rest, and 01 deletes it once ``prompts.jsonl`` is written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional

from eagle3.chat.template import ANSWER_FIELDS, common_answer_fields
from eagle3.errors import UserError
from eagle3.io import atomic_write_text
from eagle3.manifest import PromptsManifest
from eagle3.shards.manifest import read_append_log

log = logging.getLogger(__name__)

PARTIAL_NAME = "prompts.regen-partial.jsonl"


def older_fields_warning(path: Path, fields: Any, what: str) -> Optional[str]:
    """One warning line when ``fields`` (a log's or report's ``answer_fields``) lacks some of
    :data:`eagle3.chat.template.ANSWER_FIELDS` (its answers are kept), else None.
    """
    missing = [f for f in ANSWER_FIELDS if not (isinstance(fields, list) and f in fields)]
    if not missing:
        return None
    # hand-edited: any items
    have = ", ".join(map(str, fields)) if isinstance(fields, list) else "none recorded"
    return (
        f"{path}: {what} an older 01 wrote without {' / '.join(missing)} on each answer (answer_fields: {have}); "
        f"they are kept as they are (02 counts an answer without stop_token as stopped on the template's "
        f"end-of-turn token) and prompts_report.json records only the fields every answer has; pass --force to "
        f"regenerate them all"
    )


def logged_answer_fields(paths: list[Path]) -> list[str]:
    """:func:`eagle3.chat.template.common_answer_fields` of the resume logs ``paths`` (each header's ``answer_fields``;
    no log: all of :data:`eagle3.chat.template.ANSWER_FIELDS`). A header that does not read counts as none (its log is
    refused later, by :meth:`ResumeLog.load`)."""
    headers = []
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                row = json.loads(f.readline())
        except (OSError, ValueError):
            row = None
        headers.append(row.get("answer_fields") if isinstance(row, dict) else None)
    return common_answer_fields(*headers) if headers else list(ANSWER_FIELDS)


class ResumeLog:
    """Append-only log of finished conversations.

    Line 1: ``{"settings", "answer_fields"}``; then ``{"idx", "id", "messages", "tools"?}`` per
    finished conversation, fsynced before :meth:`append` returns. :meth:`load` drops a torn last line.

    Args:
        path: the log file. settings: 01's settings (:func:`eagle3.stages.prompts_manifest.settings`); a log
            of other settings is refused.
    """

    def __init__(self, path: str | os.PathLike, settings: dict):
        self.path = Path(path)
        self.settings = json.loads(json.dumps(settings))  # normalised as it will read back
        self._f = None
        self._lock = threading.Lock()

    def load(self, conversations: list[dict]) -> dict[int, dict]:
        """Finished conversations in the log, by input position.

        Raises:
            UserError: other settings or input, or a malformed line other than the last.
        """
        if not self.path.is_file():
            return {}
        rows, torn = _read_log(self.path)
        done: dict[int, dict] = {}
        for j, (n, row, _) in enumerate(rows):
            foreign = self._foreign_line(j, n, row, conversations)
            if foreign is not None:
                raise UserError(foreign)
            if j == 0:  # the header
                warning = older_fields_warning(
                    self.path, row.get("answer_fields"), "resuming answers"
                )
                if warning:
                    log.warning(warning)
                continue
            done[row["idx"]] = {k: v for k, v in row.items() if k != "idx"}
        if torn and rows:
            log.warning("%s: dropped a torn last line (interrupted write)", self.path)
            atomic_write_text(
                self.path, b"".join(raw + b"\n" for _, _, raw in rows).decode("utf-8")
            )
        elif torn:  # not even the header made it
            self.path.unlink()
        return done

    def _foreign_line(self, j: int, n: int, row: dict, conversations: list[dict]) -> Optional[str]:
        """Why line ``n`` of the log (``j``: its place among the lines read, 0 the header) is not of this run, as the
        one-line refusal with its fix: a header of other settings (the :class:`eagle3.manifest.PromptsManifest` fields
        that differ, :meth:`~eagle3.manifest.PromptsManifest.changed`; ``header`` when its settings do not read), or an
        entry whose position, id or messages do not match ``conversations``. None when it is this run's."""
        if j == 0:
            try:
                old = PromptsManifest.of_record(row.get("settings"), self.path)
                diff = old.changed(PromptsManifest.make(**self.settings))
            except UserError:
                diff = ["header"]
            if not diff:
                return None
            return (
                f"{self.path}: a regeneration was started here with other settings "
                f"({', '.join(diff)} differ); rerun with those settings to resume, "
                "or pass --force to discard it and start over"
            )
        idx, cid = row.get("idx"), row.get("id")
        if (
            not isinstance(idx, int)
            or not 0 <= idx < len(conversations)
            or cid != conversations[idx]["id"]
            or not isinstance(row.get("messages"), list)
        ):
            return (
                f"{self.path}:{n}: entry {cid!r} at position {idx!r} does not match the input "
                "conversations; pass --force to discard the log and start over"
            )
        return None

    def open(self) -> None:
        """Open for appending; a new log gets its settings line first (written atomically)."""
        if not self.path.is_file():
            header = {"settings": self.settings, "answer_fields": list(ANSWER_FIELDS)}
            atomic_write_text(self.path, json.dumps(header, ensure_ascii=False) + "\n")
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, idx: int, conv: dict) -> None:
        """Record conversation ``idx`` as finished (one line, flushed and fsynced before returning)."""
        self.append_many([(idx, conv)])

    def append_many(self, entries: list[tuple[int, dict]]) -> None:
        """Record several finished conversations ``(idx, conv)``: one line each, one flush + fsync for all
        (in-process regeneration finishes thousands a minute; an fsync each would cost seconds)."""
        text = "".join(
            json.dumps({"idx": int(idx), **conv}, ensure_ascii=False) + "\n"
            for idx, conv in entries
        )
        with self._lock:
            # the run is ending (Ctrl-C, error): these are redone by the next run
            if self._f is None:
                raise InterruptedError(f"{self.path}: closed")
            self._f.write(text)
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        """Close the file; waits for an append in progress (no line is left half-written)."""
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    def remove(self) -> None:
        """Delete the log (after the final prompts file is written)."""
        self.close()
        self.path.unlink(missing_ok=True)


def _read_log(path: Path) -> tuple[list, bool]:
    """:func:`eagle3.shards.manifest.read_append_log` of a resume log: ``(rows, torn)``, each row a dict."""
    return read_append_log(
        path, lambda r: isinstance(r, dict), "malformed line in the regeneration resume log"
    )


def logged_positions(paths: list[Path]) -> set[int]:
    """Distinct conversation positions the logs ``paths`` hold (torn last line not counted).

    Raises:
        UserError: a line other than the last is malformed.
    """
    seen: set[int] = set()
    for p in paths:
        rows, _torn = _read_log(p)
        seen.update(row["idx"] for _, row, _ in rows if isinstance(row.get("idx"), int))
    return seen


def log_resuming(done: int, total: int) -> None:
    """Say, once per run, that 01 continues an interrupted regeneration: ``done`` of ``total`` conversations are
    taken from the resume log(s) (nothing is said when ``done`` is 0)."""
    if done:
        log.info(
            "resuming: %d of %d conversations already regenerated (resume log), %d to go",
            done,
            total,
            total - done,
        )
