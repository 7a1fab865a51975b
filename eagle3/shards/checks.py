"""Refusals when a run's settings differ from the shards it reads (stages 03, 04, 05 and export).

Each check compares one config section (``verifier``, ``extract``) or the loaded verifier's
dimensions with the shards' ``data_config.json`` and raises a one-line ``UserError`` naming the
setting and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from eagle3.engines.layers import default_aux_layers
from eagle3.errors import UserError
from eagle3.shards.format import DATA_CONFIG


def check_verifier(verifier: Any, meta: dict, root: str | os.PathLike) -> Optional[str]:
    """Refuse a config whose verifier is not the one the shards were captured with (03, 04, 04 --export-only).

    Checked before any shape: a config pointing at another verifier otherwise fails later on a symptom (a hidden
    size, an aux layer out of range) that names a setting the user never changed. Then, when 02 recorded it, the
    content fingerprint of the weight files (``verifier_weights``, :func:`eagle3.verifier.load.weights_fingerprint`):
    a ``verifier.path`` pointed at another model of the same shapes under the old ``verifier.name`` would otherwise
    train without an error against the other model's lm_head.

    Args:
        verifier: the config's ``verifier`` section (its ``display_name()`` is what 02 records).
        meta: the shards' ``data_config.json``.
        root: the shards folder (or the file itself), for the message.

    Returns:
        None when the weights were compared, or there is nothing here to compare (``verifier.path`` holds no weight
        file on this machine; ``verifier`` is no config section); else (the shards record no ``verifier_weights``)
        the one warning line saying they were not compared and how to check by hand. The caller logs it (rank 0).

    Raises:
        UserError: ``<data_config.json>: key 'verifier' is 'a' but the config's verifier is 'b' (verifier.name /
            verifier.path); re-run 02 for this verifier``; or other weights at ``verifier.path`` than recorded.
    """
    path = _data_config_path(root)
    _check_verifier_name(verifier, meta, path)
    if not hasattr(verifier, "resolved_path"):
        return None
    return _check_verifier_weights(verifier, meta.get("verifier_weights"), path)


def _data_config_path(root: str | os.PathLike) -> Path:
    """``{root}/data_config.json``, or ``root`` itself when it names a ``.json`` file."""
    path = Path(root)
    if path.is_dir() or not path.name.endswith(".json"):
        path = path / DATA_CONFIG
    return path


def _check_verifier_name(verifier: Any, meta: dict, path: Path) -> None:
    want = verifier.display_name()
    if meta.get("verifier") != want:
        raise UserError(
            f"{path}: key 'verifier' is {meta.get('verifier')!r} but the config's verifier is {want!r} "
            "(verifier.name / verifier.path); re-run 02 for this verifier"
        )


def _check_verifier_weights(verifier: Any, recorded: Any, path: Path) -> Optional[str]:
    """Compare the weights at ``verifier.path`` with the recorded fingerprint (see :func:`check_verifier`)."""
    from eagle3.verifier.load import weights_differ, weights_fingerprint  # transformers: heavy

    want = verifier.display_name()
    now = weights_fingerprint(verifier)
    if now is None:  # the verifier's files are not on this machine (03 needs none)
        return None
    if (
        not recorded
    ):  # shards without a fingerprint: the weights cannot be compared (said, not silent)
        return (
            f"{path}: records no verifier_weights (shards captured before 2026-12-05f): the weights at "
            f"verifier.path '{verifier.path}' were not checked against the model the shards were captured from, "
            f"only the name {want!r}; a verifier.path pointed at another model of the same shapes would train "
            f"against its lm_head without an error: check that it is the model 02 captured from, or re-run 02 to "
            f"record its fingerprint"
        )
    if weights_differ(recorded, now):
        raise UserError(
            f"verifier.path: '{verifier.path}' holds other weights than the model the shards in "
            f"{path.parent} were captured from ({path.name}: key 'verifier_weights'; the name "
            f"{want!r} is the same): its lm_head would score another model's hidden states; set "
            f"verifier.path back to that model, or re-run 02 for this one (with a verifier.name of "
            f"its own)"
        )
    return None


VERIFIER_DIMS = (
    "num_layers",
    "hidden_size",
    "vocab_size",
)  # what data_config.json / eagle3_train.json record of it


def verifier_dims_differ(dims: dict, recorded: dict) -> Optional[str]:
    """``num_layers 6 recorded, 30 at verifier.path; ...`` for each of :data:`VERIFIER_DIMS` that the verifier the
    config loads (``dims``: :func:`eagle3.verifier.load.verifier_dims`) has other than ``recorded`` (the shards'
    ``data_config.json`` or an export's ``verifier`` block), or None. :func:`check_verifier` compares names only: a
    config whose ``verifier.path`` was pointed at another model under the old ``verifier.name`` otherwise fails on a
    drafter field the user never set."""
    diffs = [
        f"{k} {recorded[k]} recorded, {dims[k]} at verifier.path"
        for k in VERIFIER_DIMS
        if recorded.get(k) is not None
        and dims.get(k) is not None
        and int(recorded[k]) != int(dims[k])
    ]
    return "; ".join(diffs) or None


def check_verifier_dims(verifier: Any, dims: dict, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a verifier (loaded from ``verifier.path``) of other dimensions than the shards' (``meta``).

    Raises:
        UserError: ``verifier.path: '<path>' is another model than the shards in <root> were captured from ('<name>':
            num_layers 6 recorded, 30 at verifier.path; ...); set verifier.path back, or re-run 02 for this model ...``.
    """
    diff = verifier_dims_differ(dims, meta)
    if diff:
        raise UserError(
            f"verifier.path: '{verifier.path}' is another model than the shards in {root} were captured "
            f"from ({meta.get('verifier')!r}, {DATA_CONFIG}: {diff}); set verifier.path back to that model, "
            f"or re-run 02 for this one (with a verifier.name of its own)"
        )


def check_extract_settings(extract: Any, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a config whose ``extract.aux_layers`` / ``extract.max_length`` differ from the shards'.

    Stages 03, 04 and 05 read the shards' values from ``data_config.json`` (``meta``); a config that says
    otherwise would silently be ignored. Only a key the config sets (pydantic ``model_fields_set`` of
    ``extract``) is compared; ``aux_layers: null`` set explicitly means the EAGLE default ``[2, N//2, N-3]``
    of the shards' ``num_layers`` (named so in the message). Keys missing from ``meta`` are not compared.

    Raises:
        UserError: one line naming every differing key, both values, the shards folder and the fixes.
    """
    set_keys = getattr(extract, "model_fields_set", set())
    diffs = []
    for key in ("aux_layers", "max_length"):
        if key not in set_keys or meta.get(key) is None:
            continue
        want, have = getattr(extract, key), meta[key]
        shown = want
        if key == "aux_layers":
            if want is None:
                try:
                    want = default_aux_layers(int(meta["num_layers"]))
                except (KeyError, TypeError, ValueError, UserError):
                    continue  # no default to compare with
                shown = f"null (the EAGLE default {want})"
            want, have = [int(i) for i in want], [int(i) for i in have]
        elif int(want) == int(have):
            continue
        if want != have:
            diffs.append((key, shown, have))
    if len(diffs) == 1:
        ((k, s, h),) = diffs
        raise UserError(
            f"extract.{k} {s} but the shards in {root} were captured with {h}: re-run 02 or set "
            f"extract.{k} to the shards' value"
        )
    if diffs:
        raise UserError(
            "; ".join(f"extract.{k} {s}" for k, s, _ in diffs)
            + f" but the shards in {root} were captured "
            "with "
            + "; ".join(f"{k} {h}" for k, _, h in diffs)
            + ": re-run 02 or set "
            + " and ".join(f"extract.{k}" for k, _, _ in diffs)
            + " to the shards' values"
        )
