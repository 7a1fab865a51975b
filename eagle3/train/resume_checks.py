"""The resume comparison: a checkpoint's records against the run now, before anything of it is loaded.

:func:`check_resume` gathers every refusal into one line: drafter shape (:func:`drafter_args_problem`), data order
(:func:`data_order_problem`: seed, batching, grad_accum, split), loss definition (:func:`recipe_changes`) and data
inputs (:func:`data_inputs_problem`: sha256 of stage 03's split and vocab map, the shards' aux layers and verifier
weights). The records a checkpoint carries for it (:func:`data_config_record`, :func:`split_sha256`,
:func:`vocab_sha256`) are made here too; the checkpoint file itself is :mod:`eagle3.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.errors import UserError

log = logging.getLogger(__name__)


def check_drafter_args(path: str | os.PathLike, saved: dict, current: dict) -> None:
    """Refuse to resume (or export) a checkpoint whose drafter shape differs from the configured one.

    Args:
        saved: ``drafter_args`` stored in the checkpoint (``dataclasses.asdict(DrafterArgs)``).
        current: the drafter args built from the config now.

    Raises:
        UserError: naming the checkpoint and every differing field, e.g.
            ``step_00000010.pt: drafter field 'hidden_size' is 64 in the checkpoint but 32 in the config (...)``.
    """
    problem = drafter_args_problem(saved, current)
    if problem:
        raise UserError(f"{path}: {problem}")


def drafter_args_problem(saved: dict, current: dict) -> Optional[str]:
    """What :func:`check_drafter_args` refuses, without the path (None when the shapes agree): one clause per
    differing field, joined by ``; ``."""
    if (
        "variant" in current
    ):  # a checkpoint written before DrafterArgs.variant existed holds an eagle3 drafter
        saved = {"variant": "eagle3", **saved}
    # DrafterArgs.to_json leaves num_layers out when 1 (and checkpoints written before it existed have one layer)
    # and leaves attention / mla out for the Llama-style layer (the only one before they existed)
    dflt = {"num_layers": 1, "attention": "llama", "mla": None}
    saved, current = {**dflt, **saved}, {**dflt, **current}
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, float) or isinstance(b, float):
            same = a == b or (
                isinstance(a, (int, float))
                and isinstance(b, (int, float))
                and abs(a - b) <= 1e-12 * max(1.0, abs(a))
            )
        else:
            same = a == b
        if not same:
            out.append(
                f"drafter field '{key}' is {a!r} in the checkpoint but {b!r} in the config "
                f"({drafter_field_source(key)}, or train into a new train.output_dir)"
            )
    return "; ".join(out) or None


SPLIT_KEYS = (
    "train.batch_size",
    "train.grad_accum",
)  # how a step is split: free while the global batch is kept


def global_batch(order: dict, world: int) -> int:
    """Units per optimizer step of a ``data_order``: global samples (fixed-size batches) or batches of the token-budget
    plan (``train.batch_tokens``): ``batch_size x grad_accum x processes`` or ``grad_accum x processes``."""
    per = 1 if order.get("train.batch_tokens") is not None else int(order["train.batch_size"])
    return per * int(order["train.grad_accum"]) * int(world)


def _split_text(order: dict, world: int) -> str:
    if order.get("train.batch_tokens") is not None:
        return f"{order['train.grad_accum']} x {world}"
    return f"{order['train.batch_size']} x {order['train.grad_accum']} x {world}"


def global_batch_change(
    saved: Optional[dict], current: dict, worlds: Optional[tuple]
) -> Optional[str]:
    """The resume note when the global batch changes (another process count with the same split), or None.

    ``worlds``: the checkpoint's and this run's process counts (None: unknown, no note). Names both splits and the
    ``train.grad_accum`` that keeps the checkpoint's global batch, when one does."""
    if (
        saved is None
        or worlds is None
        or worlds[0] is None
        or data_order_problem(saved, current, worlds)
    ):
        return None
    then, now = global_batch(saved, worlds[0]), global_batch(current, worlds[1])
    if then == now:
        return None
    budget = current.get("train.batch_tokens") is not None
    unit = "token-budget batches" if budget else "samples"
    what = (
        "train.grad_accum x processes"
        if budget
        else "train.batch_size x train.grad_accum x processes"
    )
    per = global_batch({**current, "train.grad_accum": 1}, worlds[1])
    keep = (
        f"; --set train.grad_accum={then // per} keeps the checkpoint's" if then % per == 0 else ""
    )
    return (
        f"global batch {then} -> {now} {unit} per optimizer step ({what}: {_split_text(saved, worlds[0])} then, "
        f"{_split_text(current, worlds[1])} now){keep}"
    )


def data_order_problem(
    saved: Optional[dict], current: dict, worlds: Optional[tuple] = None
) -> Optional[str]:
    """What a resume refuses of a checkpoint's ``data_order`` (``saved``; None: a checkpoint from before the key,
    not checked) against ``current`` (keys ``train.*``), without the path (None: nothing to refuse).

    The checkpoint's position ``(epoch, steps_in_epoch)`` is skipped in the epoch's batch order, a function of
    ``train.seed``, ``train.batch_tokens`` / ``train.batch_size`` and ``train.grad_accum``: another value would skip
    other steps than those trained on. ``train.epochs`` / ``train.max_steps`` and the number of processes are free.
    ``worlds``: the checkpoint's and this run's process counts, when known. ``train.batch_size`` / ``train.grad_accum``
    may then change where the global batch (:func:`global_batch`) stays the checkpoint's: a step consumes the next
    global batch of the epoch's order whatever its split (``samples_in_epoch`` locates it), and the loss does not
    depend on the split (DESIGN.md "Loss normalisation"), so 8 ranks resumed on 4 with twice the ``grad_accum``
    continue the same run."""
    if saved is None:
        return None
    keys = [
        k
        for k in sorted(set(saved) | set(current))
        if saved.get(k, "<absent>") != current.get(k, "<absent>")
    ]
    known = worlds is not None and worlds[0] is not None and all(k in saved for k in SPLIT_KEYS)
    if (
        known
        and not set(keys) - set(SPLIT_KEYS)
        and global_batch(saved, worlds[0]) == global_batch(current, worlds[1])
    ):
        return None
    if not keys:
        return None
    then = ", ".join(f"{k}={saved.get(k, '<absent>')}" for k in keys)
    now = ", ".join(f"{k}={current.get(k, '<absent>')}" for k in keys)
    split = ""
    if known and not set(keys) - set(SPLIT_KEYS):
        split = (
            f" (train.batch_size and train.grad_accum may change only where they keep the global batch of "
            f"{global_batch(saved, worlds[0])}: {_split_text(saved, worlds[0])} then, "
            f"{_split_text(current, worlds[1])} now)"
        )
    return (
        f"written with {then} but the config has {now}; resume keeps the data order only with the same seed "
        f"and batching{split} (set them back, or train into a new train.output_dir)"
    )


# Recipe fields that define the training loss: changed on --resume, the run would optimise (and log, validate,
# select by) another objective from the checkpoint's step on, with the optimizer state of the old one, and its report
# could name only one of them. That is a new run warm-started from the old weights: train.init_from, new output_dir.
LOSS_FIELDS = ("train.ttt_length", "train.step_weight", "train.loss", "train.lk_eta")
# Recipe fields whose CHECKPOINT value goes on after --resume (the optimizer state / lr schedule loaded from it hold
# them); a checkpoint written after such a resume records the value in use (eagle3.train.resume.save), not the config's.
KEPT_FIELDS = {
    "train.lr": "with its optimizer state and lr schedule",
    "train.weight_decay": "with its optimizer state",
}
# Recipe fields whose new (config) value is used from the resumed step on.
_RECIPE_NOTES = {
    "train.warmup_ratio": "the lr schedule's warmup follows the new value",
    "train.epochs": "the lr schedule is re-stretched to the new horizon",
    "train.max_steps": "the lr schedule is re-stretched to the new horizon",
    "train.grad_clip": "the new value applies from here on",
    "extract.max_length": "the new value applies from here on",
}


WHOLE_NUMBER_FIELDS = ("train.epochs",)
"""Recipe fields read as floats that a YAML writes as whole numbers (``epochs: 2``): named without ``.0``."""


def as_written(key: str, v: Any) -> Any:
    """Recipe field ``key``'s value ``v`` as the YAML writes it: a whole float of :data:`WHOLE_NUMBER_FIELDS`
    (``epochs: 2``, read as 2.0) without its ``.0``; anything else as it is."""
    return int(v) if key in WHOLE_NUMBER_FIELDS and isinstance(v, float) and v.is_integer() else v


def recipe_changes(saved: Optional[dict], current: dict) -> tuple[Optional[str], list[str]]:
    """A checkpoint's ``recipe`` (``saved``: dotted config keys -> values; None: from before the key, nothing
    compared) against ``current`` on ``--resume``: ``(what is refused or None, the allowed changes)``.

    Refused: a changed :data:`LOSS_FIELDS` (``train.lk_eta`` only when the loss uses it): another objective
    mid-run, with the old one's optimizer moments; that is a warm start (``train.init_from``) into a new
    ``train.output_dir``. Every other change is one sorted line saying which value is used: :data:`KEPT_FIELDS`
    keep the checkpoint's, the rest take the config's."""
    if saved is None:
        return None, []
    changed = [
        k
        for k in sorted(set(saved) | set(current))
        if saved.get(k, "<absent>") != current.get(k, "<absent>")
    ]
    if (
        "train.lk_eta" in changed
        and saved.get("train.loss") == current.get("train.loss") == "soft_ce"
    ):
        changed.remove("train.lk_eta")  # soft_ce does not use eta
    bad = [k for k in changed if k in LOSS_FIELDS]
    problem = None
    if bad:
        what = ", ".join(
            f"{k} {as_written(k, saved.get(k, '<absent>'))} -> "
            f"{as_written(k, current.get(k, '<absent>'))}"
            for k in bad
        )
        problem = (
            f"--resume with another loss definition ({what}); set them back, or start a new run from this "
            f"one's export with train.init_from in a new train.output_dir (a run stopped before its end has "
            f"none yet: 04_train.py --export-only writes it from the checkpoint)"
        )
    notes = []
    for k in (k for k in changed if k not in LOSS_FIELDS):
        then, now = (
            as_written(k, saved.get(k, "<absent>")),
            as_written(k, current.get(k, "<absent>")),
        )
        if k in KEPT_FIELDS:
            notes.append(
                f"{k}: the config's {now} is not used; the checkpoint's {then} is kept {KEPT_FIELDS[k]}"
            )
        else:
            notes.append(f"{k} {then} -> {now} ({_RECIPE_NOTES.get(k, 'the new value is used')})")
    return problem, notes


# What a run trained on (checkpoint key ``data_inputs``): stage 03's split and draft vocab map, hashed by content, and
# the aux layers (HF hidden_states indices) of the shards' data_config.json, whose states the drafter was fed, and the
# fingerprint of the verifier's weight files those states came from (data_config.json ``verifier_weights``,
# :func:`eagle3.verifier.load.weights_fingerprint`; None when 02 recorded none).
SPLIT_FILE, VOCAB_FILE, AUX_LAYERS = "split.json", "vocab_map.pt", "aux_layers"
VERIFIER_WEIGHTS = "verifier_weights"

# What ``04 --export-only`` reads of the shards' data_config.json (checkpoint key ``data_config``): the verifier's id,
# architecture, dims and weights fingerprint, the aux layers (HF indices) and their conventions, and ``max_length``
# (compared with a config's ``extract.max_length``), so that a train folder exports after its shards are deleted; a
# checkpoint without the record exports only beside the shards' file.
DATA_CONFIG_RECORD = "data_config"
DATA_CONFIG_RECORD_KEYS = (
    "verifier",
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "aux_layers",
    "layer_index_convention",
    "last_hidden_state",
    "max_length",
    VERIFIER_WEIGHTS,
)


def data_config_record(meta: dict) -> dict:
    """The checkpoint's ``data_config`` record (:data:`DATA_CONFIG_RECORD_KEYS`) of a shard set's ``data_config.json``
    ``meta``: the keys it has (a shard set may lack ``verifier_weights``)."""
    return {k: meta[k] for k in DATA_CONFIG_RECORD_KEYS if k in meta}


def split_sha256(split: dict) -> str:
    """sha256 (hex) of a split's content (``{"train": [ids], "val": [ids]}``, order kept; the file's formatting is
    not part of it)."""
    blob = json.dumps(
        {"train": list(split["train"]), "val": list(split["val"])}, separators=(",", ":")
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def vocab_sha256(vocab: dict) -> str:
    """sha256 (hex) of a draft vocab map's content: its ``d2t`` (int64) and ``t2d`` (bool) tensors, shapes included
    (``torch.save`` bytes are not compared: they may differ between identical maps)."""
    h = hashlib.sha256()
    for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        t = vocab[key].detach().to("cpu", dtype).contiguous()
        h.update(f"{key}{list(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def data_inputs_problem(
    saved: Optional[dict], current: dict, data_dir: str | os.PathLike
) -> Optional[str]:
    """What a resumed checkpoint's recorded ``data_inputs`` (``{"split.json": sha256, "vocab_map.pt": sha256,
    "aux_layers": [HF indices]}``, see :func:`split_sha256` / :func:`vocab_sha256`) refuses against the files in
    ``data_dir`` and the shards now; None when they agree. Checkpoints from before the key (None), or without one of
    the entries, are not checked for it.

    A different ``split.json`` (03 re-run with another ``data.seed`` / ``data.val_fraction`` / ``data.train_samples``
    ...): samples the checkpoint trained on may now be validation samples, so val loss, ``sim_accept`` and
    ``select_best`` would score on trained data. A different ``vocab_map.pt`` of the same size (another size is
    already a differing drafter field): the checkpoint's lm_head rows would stand for other tokens. Other
    ``aux_layers`` (02 re-run with another ``extract.aux_layers``, or another run's ``extract.output_dir``): the drafter's
    fc layer would read other layers' states. Other ``verifier_weights`` (shards of another verifier of the same
    shapes, e.g. base vs instruct): the drafter was trained on another model's states and would be served beside a
    verifier whose proposals it never learned. A fingerprint missing on either side (a checkpoint from before the
    record, shards of a verifier folder 02 found no weight file in) is not compared.
    """
    if not isinstance(saved, dict):
        return None
    out = []
    d = Path(data_dir)
    if saved.get(SPLIT_FILE) not in (None, current.get(SPLIT_FILE)):
        out.append(
            f"{d / SPLIT_FILE} is not the split this checkpoint was trained on: the validation split changed "
            f"since the checkpoint, so resuming would validate on trained samples; train a new run (a new "
            f"train.output_dir), or re-run 03_prepare_data.py with the old data settings"
        )
    if saved.get(VOCAB_FILE) not in (None, current.get(VOCAB_FILE)):
        out.append(
            f"{d / VOCAB_FILE} is not the draft vocab map this checkpoint was trained with: its lm_head rows "
            f"would stand for other tokens; train a new run (a new train.output_dir), or re-run "
            f"03_prepare_data.py with the old data settings"
        )
    then, now = saved.get(AUX_LAYERS), current.get(AUX_LAYERS)
    if then is not None and now is not None and list(then) != list(now):
        out.append(
            f"the shards' aux layers {list(now)} (data_config.json) are not the {list(then)} this checkpoint "
            f"was trained on: the drafter would be fed (and its export would name) other layers' states; use "
            f"the shards it was trained on (extract.output_dir), or train a new run (a new train.output_dir)"
        )
    from eagle3.verifier.load import weights_differ

    then, now = saved.get(VERIFIER_WEIGHTS), current.get(VERIFIER_WEIGHTS)
    if weights_differ(then, now):
        out.append(
            f"the shards' verifier weights {str(now)[:19]}... (data_config.json verifier_weights) are not the "
            f"{str(then)[:19]}... this checkpoint was trained on: the shards were captured from another "
            f"verifier of the same shapes; use the shards it was trained on (extract.output_dir), or train a "
            f"new run (a new train.output_dir)"
        )
    return "; ".join(out) or None


_INPUT_NAMES = {
    SPLIT_FILE: "split.json (the validation split)",
    VOCAB_FILE: "vocab_map.pt (the draft vocab)",
    AUX_LAYERS: "the shards' aux layers",
    VERIFIER_WEIGHTS: "the shards' verifier weights",
}


def data_inputs_unchecked(
    path: str | os.PathLike,
    saved: Optional[dict],
    current: dict,
    what: str,
    keys: Sequence[str] = (SPLIT_FILE, VOCAB_FILE, AUX_LAYERS, VERIFIER_WEIGHTS),
) -> Optional[str]:
    """The one warning line saying which of :func:`data_inputs_problem`'s comparisons (``keys``) could not be made, or
    None: a checkpoint without ``data_inputs`` (from before the record) or without an entry, or a weights
    fingerprint on one side only. Both sides without one (shards captured before fingerprints, which
    :func:`eagle3.shards.checks.check_verifier` already says) is not repeated. Those skips were silent.

    Args:
        path: the checkpoint, named in the line.
        saved: its ``data_inputs`` (None when absent).
        current: the same entries as the run has them now.
        what: the stage (``--resume``, ``--export-only``).
    """
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
        f"{path}: {why}: {what} did not check {', '.join(_INPUT_NAMES[k] for k in gaps)} against what it was "
        f"trained on; check that 02 and 03 were not re-run with other settings since that checkpoint"
    )


def require_export_inputs(
    path: str | os.PathLike,
    saved: Optional[dict],
    vocab: dict,
    data_config: dict,
    data_dir: str | os.PathLike,
) -> None:
    """``04 --export-only``'s refusal of a checkpoint (``path``, its ``data_inputs`` ``saved``) trained with another
    draft vocab map (``vocab``), other aux layers or another verifier's weights than the shards' ``data_config``: the
    export takes the map and the aux layers from the run's files. The split is not compared (the weights do not
    depend on it). A missing record or entry is one warning line (:func:`data_inputs_unchecked`).

    Raises:
        UserError: ``{path}: ...`` naming each difference (:func:`data_inputs_problem`).
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
    if isinstance(saved, dict):
        problem = data_inputs_problem({k: saved.get(k) for k in keys}, current, data_dir)
        if problem:
            raise UserError(f"{path}: {problem}")


def check_resume(
    path: str | os.PathLike, state: dict, current: dict, data_dir: str | os.PathLike
) -> list[str]:
    """Every check of a checkpoint against the run now, before anything of it is loaded (``04 --resume``): drafter
    shape (:func:`check_drafter_args`), data order (:func:`data_order_problem`), loss definition (:func:`recipe_changes`)
    and data inputs (:func:`data_inputs_problem`). All refusals are gathered into one line, so a resume with several
    changed fields names every one of them.

    Args:
        state: the loaded checkpoint.
        current: ``drafter_args`` / ``data_order`` / ``recipe`` / ``data_inputs`` as the trainer builds them now.
        data_dir: stage 03's folder (named in the data-input messages).

    Returns:
        The allowed recipe changes (:func:`recipe_changes`' lines).

    Raises:
        UserError: one line, ``{path}: `` then every refusal, joined by ``; ``.
    """
    rec_problem, notes = recipe_changes(state.get("recipe"), current["recipe"])
    worlds = (state.get("world_size"), current["world_size"]) if "world_size" in current else None
    problems = [
        drafter_args_problem(state["drafter_args"], current["drafter_args"]),
        data_order_problem(state.get("data_order"), current["data_order"], worlds),
        rec_problem,
        data_inputs_problem(state.get("data_inputs"), current["data_inputs"], data_dir),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise UserError(f"{path}: " + "; ".join(problems))
    change = global_batch_change(state.get("data_order"), current["data_order"], worlds)
    return notes + ([change] if change else [])


#: The DrafterArgs fields that are ``drafter.*`` config keys (:class:`eagle3.config.DrafterConfig`'s fields; a test
#: pins the equality); the others come from stage 03's vocab map and from the verifier.
DRAFTER_CONFIG_KEYS = frozenset(
    {
        "attention",
        "head_dim",
        "hidden_size",
        "intermediate_size",
        "max_position_embeddings",
        "mla",
        "num_attention_heads",
        "num_key_value_heads",
        "num_layers",
        "rms_norm_eps",
        "rope_theta",
        "variant",
    }
)


def drafter_field_source(key: str) -> str:
    """How a user sets a :class:`eagle3.drafter.args.DrafterArgs` field back: the real config key or input.

    ``drafter.*`` config keys exist only for the decoder-layer shape (:data:`DRAFTER_CONFIG_KEYS`);
    the draft vocab size comes from ``data.draft_vocab_size`` through stage 03's ``vocab_map.pt``,
    and the target sizes / rope scaling from the verifier and its shards.
    """
    if key in DRAFTER_CONFIG_KEYS:
        return f"set drafter.{key} back"
    if key == "draft_vocab_size":
        return "set data.draft_vocab_size back and re-run 03_prepare_data.py"
    if key in ("target_vocab_size", "target_hidden_size"):
        return "it comes from the verifier (verifier.path) and its shards' data_config.json; use the checkpoint's verifier"
    return "it comes from the verifier's config (verifier.path); use the checkpoint's verifier"
