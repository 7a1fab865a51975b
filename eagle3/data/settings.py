"""The ``data:`` settings stage 03's outputs were made under, and stage 04's check that they are the config's.

Stage 03 writes the vocab map, ``split.json`` and ``data_report.json`` from the shards and the config's ``data:``
section. A later config edit of that section (``data.exclude_id_prefixes``, ``data.train_samples``,
``data.val_fraction``, ``data.seed``, ``data.draft_vocab_size``) needs 03 again, and so does an 03 that then failed
(e.g. every sample excluded): its earlier outputs stay in the folder. 03 records the settings in
``data_report.json`` (key ``settings``); 04 refuses outputs made under other settings (:func:`require_current`), so a
run cannot train on a split that ignores its own config (the fresh-user trial of 2026-12-04f).
"""

from __future__ import annotations

from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import read_json

REPORT_JSON = "data_report.json"
# the data: fields that decide 03's outputs (output_dir only says where they go)
DATA_SETTINGS = ("draft_vocab_size", "val_fraction", "seed", "train_samples", "exclude_id_prefixes")


def data_settings(cfg: RunConfig) -> dict:
    """``{field: value}`` of the config's ``data:`` fields in :data:`DATA_SETTINGS` (JSON-ready)."""
    return {k: getattr(cfg.data, k) for k in DATA_SETTINGS}


def require_current(cfg: RunConfig) -> None:
    """Stop when 03's outputs in ``cfg.data_dir`` were made under other ``data:`` settings than the config's.

    Reads ``{data_dir}/data_report.json``'s ``settings``. A folder without the report (made by hand or by a test) or
    a report from before the settings were recorded is not compared (nothing to compare with).

    Raises:
        UserError: one line naming the data folder, every differing ``data.*`` field with both values, and 03; or an
            unreadable report (file and line).
    """
    path = cfg.data_dir / REPORT_JSON
    if not path.is_file():
        return
    report = read_json(path)
    saved = report.get("settings") if isinstance(report, dict) else None
    if not isinstance(saved, dict):
        return
    diffs = [f"data.{k} {saved[k]!r} there, {v!r} in the config" for k, v in data_settings(cfg).items()
             if k in saved and saved[k] != v]
    if diffs:
        raise UserError(f"{cfg.data_dir}: 03's vocab map and split were made under other data settings ("
                        + "; ".join(diffs) + f", {path.name}); run 03_prepare_data.py again")
