"""The resume comparison: a checkpoint's record of its run against the run now, before anything of it is loaded.

A checkpoint records ``data_order``, ``recipe`` and ``data_inputs`` (dotted config keys / input names -> values) and
``world_size``; :class:`ResumeRecord` reads them as one manifest (:mod:`eagle3.manifest`; a key an older checkpoint
lacks is unset and not compared) and :func:`check_resume` refuses, in one line, every field whose change would not
continue the same run (drafter shape, data order, loss definition, data inputs), and lists the tolerated ones. The
records a checkpoint carries for it (:func:`data_config_record`, :func:`split_sha256`, :func:`vocab_sha256`) are made
here too; the checkpoint file itself is :mod:`eagle3.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

import torch
from pydantic import ConfigDict, Field

from eagle3 import manifest
from eagle3.errors import UserError
from eagle3.verifier.load import weights_differ

log = logging.getLogger(__name__)

# What a run trained on (checkpoint key ``data_inputs``): stage 03's split and draft vocab map, hashed by content, the
# aux layers (HF hidden_states indices) of the shards' data_config.json and the fingerprint of the verifier's weight
# files its states came from (:func:`eagle3.verifier.load.weights_fingerprint`; None when 02 recorded none).
SPLIT_FILE, VOCAB_FILE, AUX_LAYERS = "split.json", "vocab_map.pt", "aux_layers"
VERIFIER_WEIGHTS = "verifier_weights"

DATA_ORDER = ("train.seed", "train.batch_tokens", "train.batch_size", "train.grad_accum")
# how a step is split: free while the global batch is kept
SPLIT_KEYS = ("train.batch_size", "train.grad_accum")
# Recipe fields that define the training loss: changed on --resume, the run would optimise another objective with the
# optimizer state of the old one: that is a warm start (train.init_from) into a new output_dir.
LOSS_FIELDS = ("train.ttt_length", "train.step_weight", "train.loss", "train.lk_eta")
# Recipe fields whose CHECKPOINT value goes on after --resume (the optimizer state / lr schedule hold them); a
# checkpoint written after such a resume records the value in use (eagle3.train.resume.save).
KEPT_FIELDS = {
    "train.lr": "with its optimizer state and lr schedule",
    "train.weight_decay": "with its optimizer state",
}
# Recipe fields whose config value is used from the resumed step on, and how.
NOTED_FIELDS = {
    "train.warmup_ratio": "the lr schedule's warmup follows the new value",
    "train.epochs": "the lr schedule is re-stretched to the new horizon",
    "train.max_steps": "the lr schedule is re-stretched to the new horizon",
    "train.grad_clip": "the new value applies from here on",
    "extract.max_length": "the new value applies from here on",
}
_NEW_RUN = "train a new run (a new train.output_dir)"
_SAME_SHARDS = f"use the shards it was trained on (extract.output_dir), or {_NEW_RUN}"
_OLD_DATA = f"{_NEW_RUN}, or re-run 03_prepare_data.py with the old data settings"
# data input -> (its name in the unchecked warning, the refusal; {dir}: 03's folder, {then} / {now}: the values)
DATA_INPUTS = {
    SPLIT_FILE: (
        "split.json (the validation split)",
        "{dir}/split.json is not the split this checkpoint was trained on: the validation split changed since the "
        f"checkpoint, so resuming would validate on trained samples; {_OLD_DATA}",
    ),
    VOCAB_FILE: (
        "vocab_map.pt (the draft vocab)",
        "{dir}/vocab_map.pt is not the draft vocab map this checkpoint was trained with: its lm_head rows would "
        f"stand for other tokens; {_OLD_DATA}",
    ),
    AUX_LAYERS: (
        "the shards' aux layers",
        "the shards' aux layers {now} (data_config.json) are not the {then} this checkpoint was trained on: the "
        f"drafter would be fed (and its export would name) other layers' states; {_SAME_SHARDS}",
    ),
    VERIFIER_WEIGHTS: (
        "the shards' verifier weights",
        "the shards' verifier weights {now:.19}... (data_config.json verifier_weights) are not the {then:.19}... "
        "this checkpoint was trained on: the shards were captured from another verifier of the same shapes; "
        f"{_SAME_SHARDS}",
    ),
}


def _key(key: str) -> Any:
    return Field(None, title=key, validation_alias=key)


def _name(key: str) -> str:
    """The :class:`ResumeRecord` field of a record key (``train.seed`` -> ``train_seed``)."""
    return key.replace(".", "_")


class ResumeRecord(manifest.Manifest):
    """A checkpoint's ``data_order``, ``recipe`` and ``data_inputs`` flattened (each field's ``title`` is the record
    key) with its ``world_size``; the run now is one too (:meth:`of_state`). Only fields a checkpoint set are
    compared (:attr:`model_fields_set`): a group or key it lacks (written before it existed) is not."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    STAGE: ClassVar[str] = "04_train.py"

    train_seed: Optional[int] = _key("train.seed")
    train_batch_tokens: Optional[int] = _key("train.batch_tokens")
    train_batch_size: Optional[int] = _key("train.batch_size")
    train_grad_accum: Optional[int] = _key("train.grad_accum")
    train_ttt_length: Optional[int] = _key("train.ttt_length")
    train_step_weight: Optional[float] = _key("train.step_weight")
    train_loss: Optional[str] = _key("train.loss")
    train_lk_eta: Optional[float] = _key("train.lk_eta")
    train_lr: Optional[float] = _key("train.lr")
    train_weight_decay: Optional[float] = _key("train.weight_decay")
    train_warmup_ratio: Optional[float] = _key("train.warmup_ratio")
    train_epochs: Optional[float] = _key("train.epochs")
    train_max_steps: Optional[int] = _key("train.max_steps")
    train_grad_clip: Optional[float] = _key("train.grad_clip")
    extract_max_length: Optional[int] = _key("extract.max_length")
    split_json: Optional[str] = _key(SPLIT_FILE)
    vocab_map_pt: Optional[str] = _key(VOCAB_FILE)
    aux_layers: Optional[list[int]] = _key(AUX_LAYERS)
    verifier_weights: Optional[str] = _key(VERIFIER_WEIGHTS)
    world_size: Optional[int] = None

    @classmethod
    def of_state(cls, state: dict, where: str | os.PathLike = "the run now") -> ResumeRecord:
        """A checkpoint's (or the run's) groups ``data_order`` / ``recipe`` / ``data_inputs`` and ``world_size``.

        Raises:
            UserError: a malformed value, ``<where>: key '<field>': <what is wrong>; re-run 04_train.py``.
        """
        flat = {"world_size": state["world_size"]} if state.get("world_size") is not None else {}
        for group in ("data_order", "recipe", "data_inputs"):
            if isinstance(state.get(group), dict):
                flat.update(state[group])
        return cls.of_record(flat, where)

    def get(self, key: str) -> Any:
        """The value of record key ``key``."""
        return getattr(self, _name(key))

    def changed(
        self, now: ResumeRecord, keys: Sequence[str], tolerate: Optional[manifest.Tolerate] = None
    ) -> list[str]:
        """The ``keys`` this record set whose value ``now`` differs, in ``keys``' order
        (:func:`eagle3.manifest.differing`)."""
        needed = {_name(k): now.get(k) for k in keys if _name(k) in self.model_fields_set}
        return [self.model_fields[n].title for n in manifest.differing(self, needed, tolerate)]


def as_written(key: str, v: Any) -> Any:
    """A recipe value as the YAML writes it: a whole ``train.epochs`` (``epochs: 2``, read as 2.0) without ``.0``."""
    return int(v) if key == "train.epochs" and isinstance(v, float) and v.is_integer() else v


def drafter_args_problem(saved: dict, current: dict) -> Optional[str]:
    """One clause per differing ``drafter_args`` field of a checkpoint (``saved``) and the run (``current``), joined by
    ``; ``, or None. The fields :meth:`eagle3.drafter.args.DrafterArgs.to_json` leaves out at their defaults (and
    checkpoints written before they existed lack) compare as those defaults."""
    dflt = {"num_layers": 1, "attention": "llama", "mla": None}
    if "variant" in current:
        dflt["variant"] = "eagle3"
    saved, current = {**dflt, **saved}, {**dflt, **current}
    return (
        "; ".join(
            f"drafter field '{k}' is {saved.get(k, '<absent>')!r} in the checkpoint but "
            f"{current.get(k, '<absent>')!r} in the config ({drafter_field_source(k)}, or train into a new "
            f"train.output_dir)"
            for k in sorted(set(saved) | set(current))
            if saved.get(k, "<absent>") != current.get(k, "<absent>")
        )
        or None
    )


def _split(rec: ResumeRecord, world: int) -> list[int]:
    """The factors of the units per optimizer step: samples (``batch_size x grad_accum x processes``) or, under
    ``train.batch_tokens``, token-budget batches (``grad_accum x processes``)."""
    per = [] if rec.train_batch_tokens is not None else [int(rec.train_batch_size)]
    return [*per, int(rec.train_grad_accum), int(world)]


def _split_text(rec: ResumeRecord, world: int) -> str:
    return " x ".join(map(str, _split(rec, world)))


def _kept_global_batch(found: ResumeRecord, now: ResumeRecord) -> Optional[tuple[int, int]]:
    """Both global batches, when the process counts and the checkpoint's split are known, else None."""
    if found.world_size is None or now.world_size is None:
        return None
    if not {_name(k) for k in SPLIT_KEYS} <= found.model_fields_set:
        return None
    return math.prod(_split(found, found.world_size)), math.prod(_split(now, now.world_size))


def data_order_problem(found: ResumeRecord, now: ResumeRecord) -> Optional[str]:
    """What a resume refuses of the checkpoint's ``data_order`` (None: nothing).

    :data:`DATA_ORDER` fixes the epoch's batch order; with both process counts known, ``train.batch_size`` /
    ``train.grad_accum`` may change where the global batch (:func:`_split`) stays the checkpoint's (the loss does
    not depend on the split, DESIGN.md "Loss normalisation")."""
    keys = found.changed(now, sorted(DATA_ORDER))
    if not keys:
        return None
    batches = _kept_global_batch(found, now) if not set(keys) - set(SPLIT_KEYS) else None
    if batches and batches[0] == batches[1]:
        return None
    split = ""
    if batches:
        split = (
            f" (train.batch_size and train.grad_accum may change only where they keep the global batch of "
            f"{batches[0]}: {_split_text(found, found.world_size)} then, {_split_text(now, now.world_size)} now)"
        )
    return (
        f"written with {', '.join(f'{k}={found.get(k)}' for k in keys)} but the config has "
        f"{', '.join(f'{k}={now.get(k)}' for k in keys)}; resume keeps the data order only with the same seed "
        f"and batching{split} (set them back, or train into a new train.output_dir)"
    )


def global_batch_change(found: ResumeRecord, now: ResumeRecord) -> Optional[str]:
    """The resume note when another process count with the same data order changes the global batch, or None; names
    both splits and the ``train.grad_accum`` that keeps the checkpoint's global batch, when one does."""
    batches = _kept_global_batch(found, now)
    if batches is None or batches[0] == batches[1] or data_order_problem(found, now):
        return None
    (then, new), budget = batches, now.train_batch_tokens is not None
    unit = "token-budget batches" if budget else "samples"
    what = (
        "train.grad_accum x processes"
        if budget
        else "train.batch_size x train.grad_accum x processes"
    )
    per = new // now.train_grad_accum
    keep = (
        f"; --set train.grad_accum={then // per} keeps the checkpoint's" if then % per == 0 else ""
    )
    return (
        f"global batch {then} -> {new} {unit} per optimizer step ({what}: "
        f"{_split_text(found, found.world_size)} then, {_split_text(now, now.world_size)} now){keep}"
    )


def recipe_changes(found: ResumeRecord, now: ResumeRecord) -> tuple[Optional[str], list[str]]:
    """The checkpoint's ``recipe`` against the run's: ``(the refusal or None, the allowed changes)``.

    Refused: a changed :data:`LOSS_FIELDS` (``train.lk_eta`` only when the loss uses it). Every other change is one
    line saying which value is used: :data:`KEPT_FIELDS` keep the checkpoint's, the rest take the config's."""
    soft_ce = found.train_loss == now.train_loss == "soft_ce"  # soft_ce does not use eta

    def unused_eta(name: str, then: Any, new: Any) -> bool:
        return soft_ce and name == _name("train.lk_eta")

    changed = found.changed(now, sorted([*LOSS_FIELDS, *KEPT_FIELDS, *NOTED_FIELDS]), unused_eta)
    bad = [k for k in changed if k in LOSS_FIELDS]
    problem = None
    if bad:
        what = ", ".join(
            f"{k} {as_written(k, found.get(k))} -> {as_written(k, now.get(k))}" for k in bad
        )
        problem = (
            f"--resume with another loss definition ({what}); set them back, or start a new run from this "
            f"one's export with train.init_from in a new train.output_dir (a run stopped before its end has "
            f"none yet: 04_train.py --export-only writes it from the checkpoint)"
        )
    notes = []
    for k in (k for k in changed if k not in LOSS_FIELDS):
        then, new = as_written(k, found.get(k)), as_written(k, now.get(k))
        if k in KEPT_FIELDS:
            notes.append(
                f"{k}: the config's {new} is not used; the checkpoint's {then} is kept {KEPT_FIELDS[k]}"
            )
        else:
            notes.append(f"{k} {then} -> {new} ({NOTED_FIELDS[k]})")
    return problem, notes


def _one_side(name: str, then: Any, now: Any) -> bool:
    """Tolerated by :func:`data_inputs_problem`: a side without a value (a checkpoint of before the record, shards of
    a verifier folder 02 found no weight file in) has nothing to compare (:func:`weights_differ`'s rule)."""
    return not weights_differ(then, now)


def data_inputs_problem(
    found: ResumeRecord,
    now: ResumeRecord,
    data_dir: str | os.PathLike,
    keys: Sequence[str] = tuple(DATA_INPUTS),
) -> Optional[str]:
    """What the checkpoint's ``data_inputs`` refuse against 03's files in ``data_dir`` and the shards now (None: they
    agree; a value missing on either side is not compared): another split would validate on trained samples,
    another vocab map give the lm_head rows other tokens, other aux layers or verifier weights feed the drafter
    states it was not trained on. Each refusal is :data:`DATA_INPUTS`'s line."""
    return (
        "; ".join(
            DATA_INPUTS[k][1].format(dir=Path(data_dir), then=found.get(k), now=now.get(k))
            for k in found.changed(now, keys, tolerate=_one_side)
        )
        or None
    )


def data_inputs_unchecked(
    path: str | os.PathLike,
    saved: Optional[dict],
    current: dict,
    what: str,
    keys: Sequence[str] = tuple(DATA_INPUTS),
) -> Optional[str]:
    """The one warning line naming which of :func:`data_inputs_problem`'s comparisons (``keys``) could not be made, or
    None: a checkpoint (``path``, its ``data_inputs`` ``saved``) without the record or an entry, or a weights
    fingerprint on one side only (both sides without one is :func:`eagle3.shards.checks.check_verifier`'s to say).
    ``current``: the run's entries; ``what``: the stage (``--resume``, ``--export-only``)."""
    saved = saved if isinstance(saved, dict) else {}
    gaps = [k for k in keys if k != VERIFIER_WEIGHTS and saved.get(k) is None]
    if VERIFIER_WEIGHTS in keys and (saved.get(VERIFIER_WEIGHTS) is None) != (
        current.get(VERIFIER_WEIGHTS) is None
    ):
        gaps.append(VERIFIER_WEIGHTS)
    if not gaps:
        return None
    absent = [f"data_inputs.{k}" for k in gaps if saved.get(k) is None]
    if not saved:
        why = "records no data_inputs (a checkpoint of before the record)"
    elif absent:
        why = "records no " + ", ".join(absent)
    else:
        why = f"records data_inputs.{VERIFIER_WEIGHTS} but the shards' data_config.json has none"
    return (
        f"{path}: {why}: {what} did not check {', '.join(DATA_INPUTS[k][0] for k in gaps)} against what it was "
        f"trained on; check that 02 and 03 were not re-run with other settings since that checkpoint"
    )


def export_inputs_problem(
    path: str | os.PathLike,
    saved: Optional[dict],
    vocab: dict,
    data_config: dict,
    data_dir: str | os.PathLike,
) -> Optional[str]:
    """What ``04 --export-only`` refuses of a checkpoint (``path``, its ``data_inputs`` ``saved``) trained with another
    draft vocab map (``vocab``), other aux layers or another verifier's weights than the shards' ``data_config``
    (the split is not compared: the weights do not depend on it): each difference named
    (:func:`data_inputs_problem`), or None. A missing record or entry is one warning line
    (:func:`data_inputs_unchecked`).

    Raises:
        UserError: a malformed record (:meth:`ResumeRecord.of_state`).
    """
    keys = (VOCAB_FILE, AUX_LAYERS, VERIFIER_WEIGHTS)
    current = {
        VOCAB_FILE: vocab_sha256(vocab),
        AUX_LAYERS: list(data_config["aux_layers"]),
        VERIFIER_WEIGHTS: data_config.get(VERIFIER_WEIGHTS),
    }
    unchecked = data_inputs_unchecked(path, saved, current, "--export-only", keys)
    if unchecked:  # said, not silent
        log.warning("%s", unchecked)
    found = ResumeRecord.of_state({"data_inputs": saved}, path)
    return data_inputs_problem(
        found, ResumeRecord.of_state({"data_inputs": current}), data_dir, keys
    )


def check_resume(
    path: str | os.PathLike, state: dict, current: dict, data_dir: str | os.PathLike
) -> list[str]:
    """Every check of a checkpoint (``path``, loaded as ``state``) against the run now (``current``: its
    ``drafter_args``, ``data_order``, ``recipe``, ``data_inputs`` and ``world_size``) before anything of it is
    loaded (``04 --resume``): drafter shape, data order, loss definition and data inputs (``data_dir``: 03's folder,
    named in their lines).

    Returns:
        The allowed changes (:func:`recipe_changes`' lines, then :func:`global_batch_change`'s).

    Raises:
        UserError: one line, ``{path}: `` then every refusal, joined by ``; ``.
    """
    found, now = ResumeRecord.of_state(state, path), ResumeRecord.of_state(current)
    rec_problem, notes = recipe_changes(found, now)
    problems = [
        drafter_args_problem(state["drafter_args"], current["drafter_args"]),
        data_order_problem(found, now),
        rec_problem,
        data_inputs_problem(found, now, data_dir),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    change = global_batch_change(found, now)
    return notes + ([change] if change else [])


# What ``04 --export-only`` reads of the shards' data_config.json (checkpoint key ``data_config``), so that a train
# folder exports after its shards are deleted; a checkpoint without the record exports only beside the shards' file.
DATA_CONFIG_RECORD = "data_config"
DATA_CONFIG_RECORD_KEYS = (
    *"verifier architecture num_layers hidden_size vocab_size aux_layers layer_index_convention".split(),
    *("last_hidden_state", "max_length", VERIFIER_WEIGHTS),
)


def data_config_record(meta: dict) -> dict:
    """The checkpoint's ``data_config`` record (:data:`DATA_CONFIG_RECORD_KEYS`) of a shard set's ``data_config.json``
    ``meta``: the keys it has (a shard set may lack ``verifier_weights``)."""
    return {k: meta[k] for k in DATA_CONFIG_RECORD_KEYS if k in meta}


def split_sha256(split: dict) -> str:
    """sha256 (hex) of a split's content (``{"train": [ids], "val": [ids]}``, order kept; not the file's format)."""
    blob = json.dumps(
        {"train": list(split["train"]), "val": list(split["val"])}, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def vocab_sha256(vocab: dict) -> str:
    """sha256 (hex) of a draft vocab map's ``d2t`` (int64) and ``t2d`` (bool) tensors, shapes included (the
    ``torch.save`` bytes of identical maps may differ)."""
    h = hashlib.sha256()
    for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        t = vocab[key].detach().to("cpu", dtype).contiguous()
        h.update(f"{key}{list(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


#: The DrafterArgs fields that are ``drafter.*`` config keys (:class:`eagle3.config.DrafterConfig`'s fields; a test
#: pins the equality); the others come from stage 03's vocab map and from the verifier.
DRAFTER_CONFIG_KEYS = frozenset(
    "attention head_dim hidden_size intermediate_size max_position_embeddings mla num_attention_heads "
    "num_key_value_heads num_layers rms_norm_eps rope_theta variant".split()
)


def drafter_field_source(key: str) -> str:
    """How a user sets a :class:`eagle3.drafter.args.DrafterArgs` field back: the config key (:data:`DRAFTER_CONFIG_KEYS`)
    or the input it comes from (the draft vocab size from 03's ``vocab_map.pt``, the rest from the verifier)."""
    if key in DRAFTER_CONFIG_KEYS:
        return f"set drafter.{key} back"
    if key == "draft_vocab_size":
        return "set data.draft_vocab_size back and re-run 03_prepare_data.py"
    if key in ("target_vocab_size", "target_hidden_size"):
        return "it comes from the verifier (verifier.path) and its shards' data_config.json; use the checkpoint's verifier"
    return "it comes from the verifier's config (verifier.path); use the checkpoint's verifier"
