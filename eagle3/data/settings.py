"""The ``data:`` settings stage 03's outputs were made under, and stage 04's check that they are the config's.

Stage 03 writes the vocab map, ``split.json`` and ``data_report.json`` from the shards and the config's ``data:``
section. A later config edit of that section (``data.exclude_id_prefixes``, ``data.train_samples``,
``data.val_fraction``, ``data.seed``, ``data.draft_vocab_size``) needs 03 again, and so does an 03 that then failed
(e.g. every sample excluded): its earlier outputs stay in the folder. 03 records the settings in
``data_report.json`` (key ``settings``); 04 refuses outputs made under other settings (:func:`require_current`), so a
run cannot train on a split that ignores its own config (the fresh-user trial of 2026-12-04f).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from eagle3.data.validation_record import fingerprint_now, record_fingerprint
from eagle3.errors import UserError
from eagle3.io import read_json

REPORT_JSON = "data_report.json"
# the data: fields that decide 03's outputs (output_dir only says where they go)
DATA_SETTINGS = ("draft_vocab_size", "val_fraction", "seed", "train_samples", "exclude_id_prefixes")


def data_settings(data) -> dict:
    """``{field: value}`` of the config's ``data:`` section's fields in :data:`DATA_SETTINGS` (JSON-ready)."""
    return {k: getattr(data, k) for k in DATA_SETTINGS}


def require_current(
    data_dir: Path, shards_dir: Path, settings: dict, record: Optional[Path] = None
) -> None:
    """Stop when 03's outputs in ``data_dir`` were made under other ``data:`` settings than ``settings`` (the config's
    :func:`data_settings`), or from another shard set than ``shards_dir`` holds now.

    Reads ``{data_dir}/data_report.json``'s ``settings`` and ``shards_fingerprint`` (the shard set 03 read, as in its
    validation record). ``record``: the passing validation record of the current shards (:func:`require_passed`), whose
    fingerprint is the shards' now; without it the fingerprint is computed. A folder without the report (made by hand or
    by a test) or a report from before a key was recorded is not compared on that key (nothing to compare with).

    Raises:
        UserError: one line naming the data folder, every differing ``data.*`` field with both values, and 03; a data
            folder made from other shards (both folders named; the ``extract.output_dir`` fault of the fresh-user trial
            2026-12-05d); or an unreadable report (file and line).
    """
    path = data_dir / REPORT_JSON
    if not path.is_file():
        return
    report = read_json(path)
    saved = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(saved, dict):
        return
    diffs = [
        f"data.{k} {saved[k]!r} there, {v!r} in the config"
        for k, v in settings.items()
        if k in saved and saved[k] != v
    ]
    if diffs:
        raise UserError(
            f"{data_dir}: 03's vocab map and split were made under other data settings ("
            + "; ".join(diffs)
            + f", {path.name}); run 03_prepare_data.py again"
        )
    _require_same_shards(data_dir, shards_dir, report, path, record)


def _require_same_shards(
    data_dir: Path, shards_dir: Path, report: dict, path: Path, record: Optional[Path]
) -> None:
    """:func:`require_current`'s shard-set check: the report's ``shards_fingerprint`` is the current shards'."""
    made_from = report.get("shards_fingerprint")
    if made_from is None:
        return
    now = record_fingerprint(record) if record is not None else None
    if made_from == (now or fingerprint_now(shards_dir)):
        return
    there = Path(str(report.get("shards_dir", "")))
    if there.resolve() != shards_dir.resolve():
        raise UserError(
            f"{data_dir}: 03's vocab map and split were made from the shards in {there}, not from "
            f"{shards_dir} (extract.output_dir; {path.name}); run 03_prepare_data.py for these shards "
            f"(with a data.output_dir of their own to keep both)"
        )
    raise UserError(
        f"{data_dir}: 03's vocab map and split were made from an earlier shard set in {there} "
        f"(re-extracted or changed since; {path.name}); run 03_prepare_data.py again"
    )
