"""Resuming into a stage-02 shards folder: the settings it was made under, the verifier weights it records,
whether it is finished, and which samples it already holds.

``extract_state.json`` holds a fingerprint (sha256 of the verifier section minus ``device``, the extract fields that
change the tensors, the prompts file sha256 and the verifier id), written at start. A different fingerprint on
re-run is refused unless ``--overwrite``. ``batch_tokens`` is not part of it, so a run that ran out of memory can
resume with a smaller budget (the resumed part then differs from an uninterrupted run only by float rounding).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

from eagle3.capture.folder import (
    RANK_MANIFEST_PREFIX,
    REPORT_JSON,
    STATE,
    iter_stage_files,
    wipe_shards_dir,
)
from eagle3.capture.prompts import Sample, read_prompts
from eagle3.errors import UserError
from eagle3.io import atomic_write_json, read_json
from eagle3.io.read import file_sha256
from eagle3.shards.checksum import DEFAULT_ALGO, file_checksum
from eagle3.shards.format import DATA_CONFIG, list_samples, shard_path
from eagle3.shards.manifest import MANIFEST, read_manifest, rewrite_manifest
from eagle3.shards.read import load_sample
from eagle3.verifier.load import weights_differ

log = logging.getLogger(__name__)

FINGERPRINT_EXTRACT_KEYS = (
    "backend",
    "aux_layers",
    "max_length",
    "too_long",
    "rows_per_dir",
    "loss_on_reasoning",
)
# rendering fields added later: left out while at their defaults, so older folders still resume
_VERIFIER_DEFAULTS = (
    ("chat_template_kwargs", {}),
    ("reply_start", None),
    ("think_tags", ["<think>", "</think>"]),
)


def settings_fingerprint(
    verifier: dict,
    extract: dict,
    *,
    prompts_sha256: str,
    verifier_id: str,
    storage: Optional[dict],
    tokens_only: bool,
) -> tuple[str, dict]:
    """sha256 over what determines the shard tensors: returns ``(hex, components)``.

    Args:
        verifier: the ``verifier`` section as JSON without ``device``.
        extract: the ``extract`` section's :data:`FINGERPRINT_EXTRACT_KEYS` as JSON.
        storage: the fp8 storage's ``to_meta()`` (None: bfloat16, left out so bf16 folders keep their fingerprint).
        tokens_only: token-only samples (component ``samples: tokens``: a folder of one kind never resumes as the
            other).
    """
    ver, ext = dict(verifier), dict(extract)
    for key, default in _VERIFIER_DEFAULTS:
        if ver.get(key) == default:
            del ver[key]
    if ext.get("loss_on_reasoning") is True:
        del ext["loss_on_reasoning"]
    comp = {"verifier": ver, "extract": ext, "prompts_sha256": prompts_sha256}
    comp["verifier_id"] = verifier_id
    if tokens_only:
        comp["samples"] = "tokens"
    elif storage is not None:
        comp["storage"] = storage
    blob = json.dumps(comp, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), comp


def flat_components(comp: dict) -> dict:
    """A fingerprint's components one level flat (``extract.max_length``), for naming the ones that differ."""
    return {
        f"{k}.{k2}" if isinstance(v, dict) else k: v2
        for k, v in comp.items()
        for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])
    }


_STORAGE_KEYS = {
    "storage_dtype": "storage_dtype",
    "scale_scheme": "fp8_scale",
    "scale_block_size": "fp8_block_size",
}


def changed_settings(old: dict, new: dict) -> list[str]:
    """What differs between two :func:`fingerprint` component dicts, one entry per config key:
    ``extract.max_length: 2048 -> 4096``, ``verifier.dtype: 'bfloat16' -> 'float32'``, ``the prompts
    file (prompts.jsonl: sha256 1a2b3c4d -> 5e6f7a8b)``, ``train.hidden_states: 'offline' -> 'online'`` (token-only
    samples, component ``samples``). A key left out of one side (a rendering field at its
    default, see :func:`fingerprint`) shows as ``default``; an old state file without components gives []."""

    def flat(comp: dict) -> dict[str, Any]:  # Storage.to_meta() names -> the extract config keys
        return {
            k if not k.startswith("storage.") else f"extract.{_STORAGE_KEYS[k[8:]]}": v
            for k, v in flat_components(comp).items()
            if not k.startswith("storage.") or (k[8:] in _STORAGE_KEYS and v is not None)
        }

    if not old:
        return []
    a, b = flat(old), flat(new)
    for side, comp, other in ((a, old, new), (b, new, old)):
        if "storage" in other and "storage" not in comp:
            side.setdefault("extract.storage_dtype", "bfloat16")
        # token-only samples: named by the key the user set
        side["train.hidden_states"] = (
            "online" if side.pop("samples", None) == "tokens" else "offline"
        )
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, "default"), b.get(key, "default")
        if va == vb:
            continue
        if key == "prompts_sha256":
            out.append(f"the prompts file (sha256 {str(va)[:8]} -> {str(vb)[:8]})")
        elif key == "verifier_id":
            out.append(f"the verifier id: {va!r} -> {vb!r}")
        else:
            fa = "default" if key not in a else _short_value(va)
            fb = "default" if key not in b else _short_value(vb)
            out.append(f"{key}: {fa} -> {fb}")
    return out


def _short_value(v: Any, limit: int = 60) -> str:
    """``repr`` of a setting on one line, cut to ``limit`` characters (chat templates are long)."""
    t = repr(v)
    return t if len(t) <= limit else t[: limit - 3] + "..."


def check_state(root: Path, fp: str, comp: dict, overwrite: bool, weights: dict) -> None:
    """Refuse to resume into ``root`` under other settings, then record this run's in ``extract_state.json``.

    Args:
        fp, comp: :func:`fingerprint` of this run.
        weights: ``{"verifier_weights": ...}`` of the verifier (:func:`eagle3.verifier.load.weights_record`; ``{}``: none):
            recorded beside the fingerprint (outside its hash, so folders of before keep theirs) and compared with
            the one recorded there (the state's, else ``data_config.json``'s): weights replaced at the same
            ``verifier.path`` would mix two models' states in one set.

    Raises:
        UserError: ``<extract_state.json>: the shards in <root> were extracted with other settings: changed ...;
            re-run with --overwrite ..., or set extract.output_dir to another folder ...``, or shards without a
            state file.
    """
    state_path = root / STATE
    if overwrite:
        n = wipe_shards_dir(root)
        if n:
            log.info("--overwrite: removed %d files from %s", n, root)
    elif root.is_dir() and any(True for _ in iter_stage_files(root)):
        foreign = foreign_shards(root, fp, comp, weights)
        if foreign is not None:
            raise UserError(foreign)
        unchecked = weights_unchecked(root, read_state(root), weights)
        if unchecked:  # resumed with the weights not compared: said, not silent
            log.warning("%s", unchecked)
    atomic_write_json(
        state_path, {"fingerprint": fp, "components": comp, **weights, "started_at": time.time()}
    )


def foreign_shards(root: Path, fp: str, comp: dict, weights: dict) -> Optional[str]:
    """Why the shards in ``root`` are not this run's to resume, as the one-line refusal with its fix (``--overwrite``
    or another ``extract.output_dir``): no ``extract_state.json`` (unknown provenance), or one that records other
    settings than ``fp`` / ``comp`` (:func:`settings_fingerprint`; the components that changed are named) or other
    verifier weights than ``weights`` (:func:`weights_changed`). None when they are this run's.

    Raises:
        UserError: ``extract_state.json`` is not JSON (:func:`eagle3.io.read_json`).
    """
    state_path = root / STATE
    if not state_path.is_file():
        return (
            f"{root}: holds shards but no {STATE} (unknown provenance); re-run with --overwrite to delete them, or set "
            "extract.output_dir to another folder to keep them"
        )
    state, changed = read_json(state_path), []
    if not isinstance(state, dict) or state.get("fingerprint") != fp:
        old_comp = state.get("components", {}) if isinstance(state, dict) else {}
        changed = changed_settings(old_comp, comp) or ["the settings fingerprint"]
    elif moved := weights_changed(root, state, weights):
        changed = [f"the weights at verifier.path (verifier_weights: {moved})"]
    if not changed:
        return None
    return (
        f"{state_path}: the shards in {root} were extracted with other settings: changed "
        f"{'; '.join(changed)}; re-run with --overwrite to delete them and start over, or set extract.output_dir "
        f"to another folder to keep them (another run may read them)"
    )


def weights_changed(root: Path, state: dict, weights: dict) -> Optional[str]:
    """``'<recorded> -> <now>'`` when the verifier weights recorded for ``root`` (``extract_state.json``'s
    ``verifier_weights``, else ``data_config.json``'s) differ from ``weights`` (:func:`eagle3.verifier.load.weights_record`
    of this run); None when they agree or either side has none (nothing to compare, as 03/04 do)."""
    now = weights.get("verifier_weights")
    was, _ = recorded_weights(root, state)
    return f"{was} -> {now}" if weights_differ(was, now) else None


def recorded_weights(root: Path, state: Any) -> tuple[Optional[str], Path]:
    """``(fingerprint, file)``: the verifier weights the shards folder ``root`` records, from ``state``
    (``extract_state.json``'s content) else from ``data_config.json`` (None when neither records one or the file does
    not read; ``file``: where it was read, ``extract_state.json`` when nowhere)."""
    was = state.get("verifier_weights") if isinstance(state, dict) else None
    if was is None and (root / DATA_CONFIG).is_file():
        was = (read_state(root, DATA_CONFIG) or {}).get("verifier_weights")
        if was is not None:
            return was, root / DATA_CONFIG
    return was, root / STATE


def read_state(root: Path, name: str = STATE) -> Optional[dict]:
    """``extract_state.json`` (or the file ``name``) of ``root``, or None when it does not read as a JSON object."""
    try:
        state = read_json(root / name)
    except UserError:
        return None
    return state if isinstance(state, dict) else None


def weights_unchecked(root: Path, state: Any, weights: dict) -> Optional[str]:
    """The one warning line saying that the verifier weights of the shards in ``root`` were not compared with this
    run's (:func:`weights_changed`) because only one side has a fingerprint: the folder's record (``state``:
    ``extract_state.json``, else ``data_config.json``) has none (shards of a 02 from before 2026-12-05f) or the
    folder at ``verifier.path`` holds no weight file here (``weights`` ``{}``); None when both or neither have one
    (neither: :func:`eagle3.shards.checks.check_verifier` says so at 03/04)."""
    now = weights.get("verifier_weights")
    was, where = recorded_weights(root, state)
    if bool(was) == bool(now):
        return None
    if not was:
        why = (
            f"{where}: records no verifier_weights (shards extracted by a 02 of before 2026-12-05f): 02 did not "
            f"check the weights at verifier.path against the model the shards in {root} were captured from"
        )
    else:
        why = (
            f"{where}: records verifier_weights {str(was)[:19]}... but verifier.path holds no weight file here: "
            f"02 did not check that it is the model the shards in {root} were captured from"
        )
    return (
        why
        + "; check that it is, or re-run with --overwrite to capture every shard from this one (a set from "
        "two models trains against one's lm_head)"
    )


def finished_report(
    root: Path,
    prompts_path: Path,
    limit: Optional[int],
    fingerprint_of: Callable[[str], str],
    weights_of: Callable[[], dict],
    rows_per_dir: int,
) -> Optional[dict]:
    """``extract_report.json`` of a finished extraction of exactly this run, else None (the run goes on).

    Finished: ``extract_state.json`` and ``data_config.json`` carry this run's fingerprint
    (``fingerprint_of(prompts sha256)``) and prompts SHA-256, the report counts at least the prompts this run reads
    (a ``--limit`` at or below the finished run's prompts is a prefix of them: nothing to do),
    ``manifest.jsonl`` holds ``data_config.json``'s ``num_samples`` rows (no torn line, no per-rank manifest
    left), every row's shard is at its place, and ``data_config.json``'s ``verifier_weights`` (when recorded) are
    ``weights_of()`` (:func:`weights_changed`; called last: reads 1 MiB a weight file). Reads only; needs no
    verifier model or tokenizer.
    """
    paths = [root / name for name in (STATE, DATA_CONFIG, REPORT_JSON, MANIFEST)]
    if not all(p.is_file() for p in paths) or any(root.glob(RANK_MANIFEST_PREFIX + "*.jsonl")):
        return None
    try:
        state, meta, report = (read_json(p) for p in paths[:3])
        prompts_sha = file_sha256(prompts_path)
        n_prompts = len(read_prompts(prompts_path, limit))
    except (UserError, OSError):
        return None  # let the normal run report the problem
    if not all(isinstance(x, dict) for x in (state, meta, report)):
        return None
    fp = fingerprint_of(prompts_sha)
    if (
        (state.get("fingerprint"), meta.get("config_fingerprint"), meta.get("prompts_sha256"))
        != (fp, fp, prompts_sha)
        or not isinstance(report.get("prompts"), int)
        or n_prompts > report["prompts"]
        or report.get("samples") != meta.get("num_samples")
    ):
        return None
    if weights_changed(root, {"verifier_weights": meta.get("verifier_weights")}, weights_of()):
        return None  # other weights at the same verifier.path: the run goes on and refuses the folder in one line
    man = read_manifest(root / MANIFEST)
    if man.dropped_tail or len(man.rows) != meta.get("num_samples"):
        return None
    if not all(shard_path(root, idx, rows_per_dir).is_file() for idx in man.rows):
        return None
    return report


def resume_state(
    root: Path, samples: list[Sample], rows_per_dir: int, expect: dict, writer_path: Path
) -> dict[int, dict]:
    """Finished idx -> manifest row, after reconciling ``manifest.jsonl`` with the shard files: a recorded row whose
    shard is gone is redone, a shard the manifest lacks is adopted when it holds its prompt (else removed and
    redone); the manifest is rewritten once every row is this run's (:func:`foreign_row`).

    Raises:
        UserError: :func:`foreign_row`'s line for the first row of this run's samples that is not this run's.
    """
    man = read_manifest(writer_path)
    on_disk = {idx: p for idx, p in list_samples(root)} if root.is_dir() else {}
    by_idx = {s.idx: s for s in samples}
    done: dict[int, dict] = {}
    changed = man.dropped_tail
    for idx, row in man.rows.items():
        if idx in on_disk:
            done[idx] = row
        else:
            changed = True  # shard deleted: redo it
    adopt = sorted(set(on_disk) - set(done))
    for idx in adopt:
        s = by_idx.get(idx)
        if s is None:
            continue  # a shard outside this run's samples (e.g. an earlier run without --limit): keep
        try:
            got = load_sample(on_disk[idx], expect=expect)
            ok = (
                got["input_ids"].tolist() == s.input_ids
                and got["loss_mask"].tolist() == s.loss_mask
            )
        except UserError:
            ok = False
        if ok:
            done[idx] = {
                "idx": idx,
                "id": s.id,
                "num_tokens": len(s.input_ids),
                "num_loss_tokens": sum(s.loss_mask),
                DEFAULT_ALGO: file_checksum(on_disk[idx], DEFAULT_ALGO),
            }
            changed = True
        else:
            log.warning("%s: does not match its prompt; rewriting it", on_disk[idx])
            on_disk[idx].unlink()
    for idx, row in done.items():  # a shard outside this run's samples is kept as it is
        s = by_idx.get(idx)
        if s is not None and (
            foreign := foreign_row(row, s, on_disk[idx], root, rows_per_dir, writer_path)
        ):
            raise UserError(foreign)
    if changed:
        rewrite_manifest(writer_path, done)
    return done


def foreign_row(
    row: dict, sample: Sample, path: Path, root: Path, rows_per_dir: int, writer_path: Path
) -> Optional[str]:
    """Why the finished ``row`` (of ``writer_path``, the manifest; its shard at ``path``) is not this run's
    ``sample``, as the one-line refusal with its fix (``--overwrite``): it records another prompt id than the
    prompts file gives, or its shard is elsewhere than ``rows_per_dir`` puts it (a foreign layout). None when it
    is this run's."""
    idx = sample.idx
    if row["id"] != sample.id:
        return (
            f"{writer_path}: sample {idx} is recorded as prompt '{row['id']}' but the prompts "
            f"file gives '{sample.id}'; re-run with --overwrite"
        )
    if path != shard_path(root, idx, rows_per_dir):
        return (
            f"{path}: sample {idx} is not at {shard_path(root, idx, rows_per_dir)}; "
            "re-run with --overwrite"
        )
    return None
