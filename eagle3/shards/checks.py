"""Refusals when a run's settings differ from the shards it reads (stages 03, 04, 05 and export).

Each check reads the shards' ``data_config.json`` as their manifest (:class:`eagle3.manifest.ShardsManifest`) and
compares one config section (``verifier``, ``extract``) with it through :func:`eagle3.manifest.require`: one line,
the field, recorded -> now, 02 to re-run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from eagle3 import manifest
from eagle3.engines.layers import default_aux_layers
from eagle3.errors import UserError
from eagle3.shards.format import DATA_CONFIG


def check_verifier(verifier: Any, meta: dict, root: str | os.PathLike) -> Optional[str]:
    """Refuse a config whose verifier is not the one the shards were captured with (03, 04, 04 --export-only),
    before any shape: by name, then, when 02 recorded it and ``verifier.path`` holds weight files here, by their
    content fingerprint (``verifier_weights``, :func:`eagle3.verifier.load.weights_fingerprint`; the rule
    :func:`eagle3.verifier.load.weights_differ`).

    Args:
        verifier: the config's ``verifier`` section (its ``display_name()`` is what 02 records).
        meta: the shards' ``data_config.json``.
        root: the shards folder (or the file itself), for the message.

    Returns:
        None, or (the shards record no ``verifier_weights`` while ``verifier.path`` holds weights) the one warning
        line saying the weights were not compared; the caller logs it (rank 0).

    Raises:
        UserError: ``<data_config.json>: verifier (verifier.name / verifier.path) 'a' -> 'b'; re-run
            02_extract_hidden.py``, or the same for ``the weights at verifier.path``.
    """
    path = _data_config_path(root)
    found = manifest.ShardsManifest.of_record(meta, path)
    manifest.require(found, {"verifier": verifier.display_name()}, found.STAGE)
    if not hasattr(verifier, "resolved_path"):
        return None
    from eagle3.verifier.load import weights_differ, weights_fingerprint  # transformers: heavy

    now = weights_fingerprint(verifier)
    if now is None:  # the verifier's files are not on this machine (03 needs none)
        return None
    if not found.verifier_weights:  # shards without a fingerprint: not compared (said, not silent)
        return (
            f"{path}: records no verifier_weights: the weights at verifier.path '{verifier.path}' were not checked "
            f"against the model the shards were captured from, only the name {found.verifier!r}; a verifier.path "
            f"pointed at another model of the same shapes would train against its lm_head without an error: check "
            f"that it is the model 02 captured from, or re-run 02 to record its fingerprint"
        )
    if weights_differ(found.verifier_weights, now):
        manifest.require(found, {"verifier_weights": now}, found.STAGE)
    return None


def _data_config_path(root: str | os.PathLike) -> Path:
    """``{root}/data_config.json`` for a shards folder, else ``root`` itself (the file, or a checkpoint's record)."""
    return Path(root) / DATA_CONFIG if Path(root).is_dir() else Path(root)


VERIFIER_DIMS = ("num_layers", "hidden_size", "vocab_size")
"""What ``data_config.json`` / ``eagle3_train.json`` record of the verifier's shape."""


def verifier_dims_differ(dims: dict, recorded: dict) -> Optional[str]:
    """``num_layers 6 recorded, 30 at verifier.path; ...`` for each of :data:`VERIFIER_DIMS` that the verifier the
    config loads (``dims``: :func:`eagle3.verifier.load.verifier_dims`) has other than ``recorded`` (the shards'
    ``data_config.json`` or an export's ``verifier`` block), or None."""
    diffs = [
        f"{k} {recorded[k]} recorded, {dims[k]} at verifier.path"
        for k in VERIFIER_DIMS
        if recorded.get(k) is not None
        and dims.get(k) is not None
        and int(recorded[k]) != int(dims[k])
    ]
    return "; ".join(diffs) or None


def check_verifier_dims(dims: dict, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a verifier loaded from ``verifier.path`` (``dims``: :func:`eagle3.verifier.load.verifier_dims`) of
    other :data:`VERIFIER_DIMS` than the shards' (``meta``): another model under the old ``verifier.name``.

    Raises:
        UserError: ``<data_config.json>: num_layers at verifier.path 6 -> 30; re-run 02_extract_hidden.py``.
    """
    found = manifest.ShardsManifest.of_record(meta, _data_config_path(root))
    needed = {
        k: int(dims[k])
        for k in VERIFIER_DIMS
        if dims.get(k) is not None and getattr(found, k) is not None
    }
    manifest.require(found, needed, found.STAGE)


def check_extract_settings(extract: Any, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a config whose ``extract.aux_layers`` / ``extract.max_length`` differ from the shards' (03, 04, 05,
    export): the shards' values are what those stages use, so a config that says otherwise would silently be
    ignored. Only a key the config sets (pydantic ``model_fields_set``) is compared; ``aux_layers: null`` means the
    EAGLE default ``[2, N//2, N-3]`` of the shards' ``num_layers``. A key the record lacks is not compared.

    Raises:
        UserError: ``<data_config.json>: extract.aux_layers [1, 3, 4] -> [2, 3, 4]; re-run 02_extract_hidden.py``.
    """
    found = manifest.ShardsManifest.of_record(meta, _data_config_path(root))
    needed: dict[str, Any] = {}
    for key in ("aux_layers", "max_length"):
        if key not in getattr(extract, "model_fields_set", set()) or getattr(found, key) is None:
            continue
        want = getattr(extract, key)
        if key == "aux_layers" and want is None:
            try:
                want = default_aux_layers(int(found.num_layers))
            except (TypeError, ValueError, UserError):
                continue  # no default to compare with
        needed[key] = [int(i) for i in want] if key == "aux_layers" else int(want)
    manifest.require(found, needed, found.STAGE)
