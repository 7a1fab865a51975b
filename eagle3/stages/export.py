"""Stage 04's finishing step: export the trained drafter for ``export.engine``, read from the run's config.

- :func:`export_for_run`: the export at the end of training (``04_train.py`` passes it to the training loop).
- :func:`export_from_checkpoint`: ``04_train.py --export-only [--engine <engine>]``: training already exports once
  for ``export.engine``; this writes another engine's folder (or the same again) without retraining, from the newest
  complete checkpoint in ``{train_dir}/checkpoints``, the verifier head saved at
  ``{train_dir}/target_head.safetensors``, the vocab map of stage 03 and the shards' metadata (aux layers in the HF
  convention; :func:`eagle3.engines.layers.engine_layer_ids` converts them per engine): the shards'
  ``data_config.json``, or when the shards were deleted the checkpoint's record of it (:func:`shards_data_config`).
- :func:`check_export_destination`: 04's start-up check of the export folder.
- :func:`check_export_serves`: 04's start-up check that ``export.engine`` can serve the configured drafter (variant,
  MLA sizes, context length), decided once from the config and the verifier's config.
- :func:`load_init_drafter`: ``train.init_from``, an exported folder that starts the run (warm start).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
from pathlib import Path
from typing import Optional

from eagle3.config import RunConfig
from eagle3.data.vocab import load_run_vocab_map
from eagle3.drafter.args import DrafterArgs, copied_rope_scaling
from eagle3.drafter.draft_config import untrained_positions
from eagle3.drafter.mla import resolve_mla
from eagle3.engines.context import check_context_length
from eagle3.errors import UserError
from eagle3.export.common import export_dtype
from eagle3.export.folder import check_replaceable
from eagle3.export.formats import check_engine_serves
from eagle3.export.reader import check_export_folder, load_exported
from eagle3.export.writer import export_drafter
from eagle3.io import exclusive_lock, probe_dirs, rerun_hint
from eagle3.io.read import relative_hint
from eagle3.shards.checks import check_extract_settings, check_verifier
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import DATA_CONFIG
from eagle3.train import checkpoint as ckpt
from eagle3.train import resume_checks
from eagle3.train.folder import TRAIN_LOCK, train_lock_holder
from eagle3.train.inputs import SHAPE_FIELDS, build_drafter_args
from eagle3.train.report import export_provenance, record_export_only
from eagle3.train.sim_accept import BEST_FILE, load_best_for_export
from eagle3.train.warm_start import init_drafter, init_from_not_a_folder
from eagle3.verifier.arch import cfg_get, mla_rope_scaling, mla_sizes, text_config
from eagle3.verifier.head import TargetHead
from eagle3.verifier.load import load_verifier_config, serving_context_length, verifier_dims

log = logging.getLogger(__name__)

#: ``--export-only``'s disk-full advice (:func:`eagle3.io.rerun_hint`).
REDO_HINT = (
    "re-run the same command (--export-only does not resume: it exports the checkpoint again)"
)


def check_export_destination(out: Path, engine: str, field: str = "export.output_dir") -> None:
    """04's start-up check of where the export will go (``04_train.py`` calls it before training): the refusals of
    :func:`eagle3.export.folder.check_replaceable` (a path under a file included), so that they do not come only
    after the whole training.

    ``field``: the config field that puts ``out`` there (``RunConfig.output_field("export")``), for the messages.

    Raises:
        UserError: as :func:`eagle3.export.folder.check_replaceable` (a parent of ``out`` that is a file named
            with ``field``); or a folder above ``out`` that cannot be made (:func:`eagle3.io.probe_dirs`:
            ``<field>: cannot create the output folder ...``).
    """
    out = Path(out)
    check_replaceable(out, engine, field)
    probe_dirs(out.parent, field)  # the export is made beside it and renamed


def check_export_serves(cfg: RunConfig) -> Optional[str]:
    """04's start-up decision (training and ``--export-only``, before anything is read or written) that
    ``export.engine`` can serve the drafter the config describes: its variant and MLA sizes
    (:func:`eagle3.export.formats.check_engine_serves`; null ``drafter.mla`` sizes are the verifier's) and its context
    length against the verifier's (:func:`eagle3.engines.context.check_context_length`). The export does not check
    the context again: it writes what 04 built from the same config (``--export-only``: the config's value, or with
    null at least the verifier's, :func:`_with_config_context`).

    The verifier's config is read when it can be; when it cannot, what needs it is not checked here (04's setup
    then refuses a drafter field it cannot derive).

    Returns:
        vLLM's one warning line for a draft shorter than the verifier (the caller logs it), else None.

    Raises:
        UserError: one line: an engine that cannot serve the variant or MLA sizes, a null ``drafter.mla`` size of a
            verifier without MLA, or (SGLang) ``drafter.max_position_embeddings`` below the verifier's context.
    """
    engine, d = cfg.export.engine, cfg.drafter
    tc = _verifier_text_config(cfg.verifier)
    mla = None
    if d.attention == "mla":
        given = d.mla.model_dump()
        mla = (
            resolve_mla(given, mla_sizes(tc))
            if tc is not None
            else {k: v for k, v in given.items() if v is not None}
        )
    check_engine_serves(engine, d.variant, mla)
    mpe, rope = planned_context(d, tc)
    if mpe is None or tc is None:
        return None
    return check_context_length(mpe, rope, serving_context_length(tc), engine)


def planned_context(drafter, tc) -> tuple[Optional[int], Optional[dict]]:
    """``(max_position_embeddings, rope_scaling)`` of the drafter 04 builds from the ``drafter`` section and the
    verifier's text config ``tc`` (None: unreadable; ``(None, None)`` when they are needed), by
    :func:`eagle3.train.inputs.build_drafter_args`' rule: every ``SHAPE_FIELDS`` set (Llama attention) = the
    verifier is not read and the rope is the default; else a null field is the verifier's (4096 when it states
    none) and its rope scaling is copied (:func:`eagle3.drafter.args.copied_rope_scaling`), an MLA drafter's being
    an MLA verifier's own (:func:`eagle3.verifier.arch.mla_rope_scaling`)."""
    mpe = drafter.max_position_embeddings
    if drafter.attention != "mla" and all(getattr(drafter, f) is not None for f in SHAPE_FIELDS):
        return mpe, None
    if tc is None:
        return None, None
    if mpe is None:
        mpe = cfg_get(tc, "max_position_embeddings", 4096)
    own = mla_rope_scaling(tc) if drafter.attention == "mla" and mla_sizes(tc) is not None else None
    return (None if mpe is None else int(mpe)), own or copied_rope_scaling(tc)


def _verifier_text_config(vcfg):
    """The verifier's text config, or None when it cannot be read (no weights loaded)."""
    try:
        return text_config(load_verifier_config(vcfg))
    except (UserError, OSError, ValueError) as e:
        log.debug("verifier config unreadable: %s", e)
        return None


def export_for_run(
    cfg: RunConfig,
    drafter,
    data_config: dict,
    provenance: dict | None = None,
    ttt_length: int | None = None,
    ttt_from: str = "train.ttt_length",
) -> Path:
    """Export ``drafter`` for ``cfg.export.engine`` into ``cfg.export_dir``, in ``export.dtype``
    (``auto`` = ``verifier.dtype``), with the verifier facts and HF aux layers of the shards'
    ``data_config.json``; ``provenance`` (:func:`eagle3.train.report.export_provenance`) is recorded as
    ``trained_from`` in ``eagle3_train.json``. The vLLM folder's ``speculative_tokens`` (what ``vllm serve`` drafts
    when ``--speculative-config`` names only the model) is ``benchmark.steps``, the chain the run benchmarks.
    ``ttt_length`` (default ``train.ttt_length``; ``--export-only`` passes the checkpoint's) is recorded in
    ``eagle3_train.json``: the draft positions the drafter was trained for, which 05 compares with its ``--steps``.
    A vLLM ``speculative_tokens`` above it is warned about in one line (:func:`speculative_tokens_warning`; ``ttt_from``
    says where ``ttt_length`` came from).

    Raises:
        UserError: see :func:`eagle3.export.writer.export_drafter`.
    """
    verifier_info = {
        "name": data_config["verifier"],
        **{k: data_config[k] for k in ("architecture", "num_layers", "hidden_size", "vocab_size")},
        "weights": data_config.get("verifier_weights"),
    }  # 05 warns when verifier.path holds others
    ttt_length = cfg.train.ttt_length if ttt_length is None else int(ttt_length)
    warning = speculative_tokens_warning(cfg, ttt_length, ttt_from)
    if warning:
        log.warning("%s", warning)
    return export_drafter(
        drafter,
        cfg.export_dir,
        engine=cfg.export.engine,
        aux_layers_hf=list(data_config["aux_layers"]),
        verifier_info=verifier_info,
        num_speculative_tokens=cfg.benchmark.steps,
        dtype=export_dtype(cfg.export.dtype, cfg.verifier.dtype),
        provenance=provenance,
        ttt_length=ttt_length,
    )


def speculative_tokens_warning(
    cfg: RunConfig, ttt_length: int, ttt_from: str = "train.ttt_length"
) -> str | None:
    """One warning line when a vLLM export's ``speculative_tokens`` (``benchmark.steps``: what ``vllm serve`` drafts
    when ``--speculative-config`` names only the model) is above the ``ttt_length`` the drafter was trained for
    (``ttt_from``: ``train.ttt_length``, or the checkpoint's for ``--export-only``): vLLM would draft positions never
    trained, at low acceptance. None for SGLang (its draft length is the server's ``--speculative-num-steps``) or
    within ``ttt_length``."""
    steps = int(cfg.benchmark.steps)
    if cfg.export.engine != "vllm" or steps <= int(ttt_length):
        return None
    return (
        f"export: speculative_tokens {steps} (benchmark.steps) in {cfg.export_dir / 'config.json'} is more than "
        f"the ttt_length {ttt_length} ({ttt_from}) the drafter was trained for: vLLM drafts "
        f"{untrained_positions(ttt_length, steps)}, never trained, at low acceptance; export with benchmark.steps "
        f"{ttt_length} (04_train.py --export-only --engine vllm --set benchmark.steps={ttt_length}), or train with "
        f"train.ttt_length {steps}"
    )


def load_init_drafter(cfg: RunConfig, embed_weight, data_config: dict):
    """The drafter of ``train.init_from`` (an exported folder) for 04's warm start
    (:func:`eagle3.train.warm_start.warm_start` copies its trainable tensors).

    Args:
        cfg: the run config (``train.init_from`` set).
        embed_weight: the verifier's input embedding ``[target_V, H]`` (exports leave it out).
        data_config: the shards' ``data_config.json``: its HF ``aux_layers`` must be the folder's.

    Returns:
        ``Eagle3Drafter`` (float32, CPU; :func:`eagle3.export.reader.load_exported`).

    Raises:
        UserError: not a folder; the folder records other HF aux layers than the shards (its ``fc`` reads other
            verifier layers: near-zero acceptance); or any error of :func:`eagle3.export.reader.load_exported`,
            prefixed ``train.init_from: ``.
    """
    path = Path(cfg.train.init_from)
    if not path.is_dir():
        raise init_from_not_a_folder(path)
    aux = [int(i) for i in data_config["aux_layers"]]
    try:
        got = check_export_folder(path)["aux_layers_hf"]
        drafter = load_exported(path, embed_weight=embed_weight)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from e
    if got is not None and list(got) != aux:
        raise UserError(
            f"{path}: train.init_from was trained on HF aux layers {list(got)}, this run's shards hold "
            f"{aux} (data_config.json aux_layers)"
        )
    return drafter


def export_from_checkpoint(cfg: RunConfig, engine: str | None = None) -> Path:
    """``04 --export-only``: :func:`_export_from_checkpoint` holding 04's lock on the train folder
    (:data:`eagle3.train.folder.TRAIN_LOCK`), as training does: a second export or a training 04 there stops at once
    with one line. No lock where the train folder is missing or the lock file cannot be made (read-only checkpoints).
    A full disk says to re-run (:data:`REDO_HINT`): an export starts over.

    Raises:
        UserError: ``<train_dir>/.train.lock: another 04_train run is training or exporting in <train_dir>; ...``;
            and everything :func:`_export_from_checkpoint` raises.
    """
    with contextlib.ExitStack() as held:
        held.enter_context(rerun_hint(REDO_HINT))
        if cfg.train_dir.is_dir():
            try:
                held.enter_context(
                    exclusive_lock(cfg.train_dir / TRAIN_LOCK, train_lock_holder(cfg.train_dir))
                )
            except OSError as e:  # read-only checkpoints: no 04 writes there
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                log.info(
                    "%s: not locked (%s); the export folder's lock still holds",
                    cfg.train_dir / TRAIN_LOCK,
                    e.strerror,
                )
        return _export_from_checkpoint(cfg, engine)


def _export_from_checkpoint(cfg: RunConfig, engine: str | None = None) -> Path:
    """Build the drafter from the newest checkpoint and export it. Writes only the export folder, and the run's
    ``train_report.{json,md}`` when written at this checkpoint's step (:func:`eagle3.train.report.record_export_only`).

    Weights: ``train.select_best: last`` -> the checkpoint's; ``sim_accept`` -> ``best_drafter.pt``
    (:func:`_select_weights`). Checkpoint: :func:`_latest_checkpoint`; drafter: :func:`_drafter_from_checkpoint`.

    ``engine``: one of :data:`eagle3.engines.ENGINES` (default ``export.engine``). Returns the export folder.

    Raises:
        UserError: those of the three steps above and of :func:`export_for_run`.
    """
    if engine is not None:
        cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"engine": engine})})
    path, state = _latest_checkpoint(cfg)
    drafter, data_config = _drafter_from_checkpoint(cfg, path, state)
    step = int(state["step"])
    weights_step = _select_weights(cfg, drafter, path, step)
    prov = export_provenance(cfg.train_dir, path, step, cfg.train.select_best, weights_step)
    # the TTT steps the checkpoint trained (--resume refuses another train.ttt_length), else the config's
    ttt = (state.get("recipe") or {}).get("train.ttt_length")
    ttt_from = f"train.ttt_length of {path.name}" if ttt else "train.ttt_length"
    out = export_for_run(
        cfg,
        drafter,
        data_config,
        provenance=prov,
        ttt_length=int(ttt or cfg.train.ttt_length),
        ttt_from=ttt_from,
    )
    record_export_only(
        cfg.train_dir, out, path, step, weights_step, cfg.export.engine, cfg.train.select_best
    )
    return out


def _latest_checkpoint(cfg: RunConfig) -> tuple[Path, dict]:
    """The newest complete checkpoint ``(path, state)``. When the checkpoint supplies the weights (``last``, or
    ``sim_accept`` without a best file) a newest file that does not load is an error naming it and the step of the
    newest one that does (an older checkpoint's weights are not what was asked for: delete the broken file to export
    that step, or ``--resume``). With ``sim_accept`` and a ``best_drafter.pt`` the checkpoint gives only the drafter
    shape and the step named in messages, so the newest that loads is used, with a warning naming each skipped file
    (:func:`eagle3.train.checkpoint.find_latest_checkpoint`).

    Raises:
        UserError: no checkpoint, or checkpoint files none of which loads, or (weights from the checkpoint) a newest
            checkpoint file that does not load.
    """
    found = ckpt.find_latest_checkpoint(cfg.train_dir, fallback=not _weights_from_checkpoint(cfg))
    if found is None:
        where = ckpt.ckpt_dir(cfg.train_dir)
        raise UserError(
            f"{where}: no complete checkpoint to export (run 04_train.py first"
            + (f"; {relative_hint(where)})" if relative_hint(where) else ")")
        )
    return found


def _drafter_from_checkpoint(cfg: RunConfig, path: Path, state: dict):
    """The checkpoint's drafter (``(Eagle3Drafter, data_config)``) with the run's target head and vocab map, after
    checking that the checkpoint was trained on these inputs and has the config's drafter shape
    (``max_position_embeddings`` may differ: only the exported config changes, :func:`_with_config_context`).

    Raises:
        UserError: missing target head / vocab map, no data_config.json and no record of it
            (:func:`shards_data_config`), other trained inputs, a drafter shape that disagrees with the vocab map or
            with the config's ``drafter.*`` (:func:`_trained_inputs_problem`), or a missing/unexpected state key
            (:func:`_model_state_problem`): one line ``<checkpoint>: <problem>``.
    """
    data_config = shards_data_config(cfg, path, state)
    vocab = load_run_vocab_map(
        cfg.data_dir, cfg.data.draft_vocab_size, int(data_config["vocab_size"])
    )
    args = DrafterArgs.from_json(state["drafter_args"], source=f"{path}: drafter_args")
    problem = _trained_inputs_problem(cfg, path, state, args, (vocab, data_config))
    if not problem:
        args = _with_config_context(cfg, args)
        drafter = init_drafter(args, TargetHead.load(cfg.train_dir), vocab, seed=0)
        problem = _model_state_problem(drafter, state["model"])
    if problem:
        raise UserError(f"{path}: {problem}")
    return drafter, data_config


def _model_state_problem(drafter, model_state: dict) -> Optional[str]:
    """``model_state`` loaded into ``drafter`` (in place); what keeps it from being the drafter's whole trained state:
    ``key 'model.<name>' unexpected`` (a tensor the drafter has not) or ``... missing`` (a trainable one absent), the
    first by name; None when it loads."""
    missing, unexpected = drafter.load_state_dict(model_state, strict=False)
    trainable = {k for k, p in drafter.named_parameters() if p.requires_grad}
    if not (unexpected or trainable & set(missing)):
        return None
    key = sorted(unexpected or (trainable & set(missing)))[0]
    return f"key 'model.{key}' {'unexpected' if unexpected else 'missing'}"


def _trained_inputs_problem(
    cfg: RunConfig, path: Path, state: dict, args: DrafterArgs, inputs: tuple[dict, dict]
) -> Optional[str]:
    """The first way the checkpoint (``path``, loaded as ``state``, its ``args``) was not trained on this run's
    ``inputs`` (vocab map, the shards' data_config) or shape, or None: other data inputs
    (:func:`eagle3.train.resume_checks.export_inputs_problem`), a draft vocab size not the vocab map's, a drafter
    shape not the config's ``drafter.*`` (:func:`eagle3.train.resume_checks.drafter_args_problem`;
    ``max_position_embeddings`` may differ: only the exported config changes, :func:`_with_config_context`)."""
    vocab, data_config = inputs
    problem = resume_checks.export_inputs_problem(
        path, state.get("data_inputs"), vocab, data_config, cfg.data_dir
    )
    if problem:
        return problem
    if args.draft_vocab_size != int(vocab["d2t"].shape[0]):
        return (
            f"drafter_args.draft_vocab_size {args.draft_vocab_size} differs from "
            f"{cfg.data_dir / 'vocab_map.pt'} ({int(vocab['d2t'].shape[0])})"
        )
    want = dataclasses.asdict(build_drafter_args(cfg, data_config, vocab))
    saved = {k: v for k, v in state["drafter_args"].items() if k != "max_position_embeddings"}
    return resume_checks.drafter_args_problem(
        saved, {k: v for k, v in want.items() if k != "max_position_embeddings"}
    )


def _select_weights(cfg: RunConfig, drafter, path: Path, step: int) -> int:
    """Load the weights ``train.select_best`` names into ``drafter``; returns their step. ``last``: the checkpoint's
    (already loaded). ``sim_accept``: ``best_drafter.pt``, the weights the finished training exported
    (:func:`eagle3.train.sim_accept.load_best_for_export`): a best file that does not load, does not fit or is not the
    step ``sim_accept.json`` names is a UserError (``--set train.select_best=last`` exports the checkpoint); no best
    file at all exports the checkpoint's weights with a warning naming the field."""
    if cfg.train.select_best != "sim_accept":
        log.info("export: the weights of checkpoint %s (train.select_best: last)", path.name)
        return step
    best, warning = load_best_for_export(cfg.train_dir, drafter, step)
    if warning:
        log.warning(warning)
    return best if best is not None else step


def shards_data_config(cfg: RunConfig, path: Path, state: dict) -> dict:
    """What the export reads of the shards' ``data_config.json`` (aux layers, verifier id, dims, weights fingerprint),
    checked against the config as 04 training checks it.

    With ``{shards_dir}/data_config.json`` present: that file (:func:`eagle3.shards.data_config.read_data_config`), the
    config's verifier and ``extract`` settings checked against it, and (by the caller) the checkpoint's ``data_inputs``
    (aux layers, vocab map, verifier weights). Without it (users delete the shards after training to free terabytes):
    the checkpoint's record of it (key ``data_config``, :func:`eagle3.train.resume_checks.data_config_record`), the
    config checked against that. A checkpoint of before the record needs the file: one line says which file and that
    the shard files themselves are not read.

    Raises:
        UserError: ``<shards>/data_config.json: file not found, and <checkpoint> has no record of it ...``; the checks'
            errors (:func:`eagle3.shards.checks.check_verifier`,
            :func:`eagle3.shards.checks.check_extract_settings`), against the file or the checkpoint's record.
    """
    file = cfg.shards_dir / DATA_CONFIG
    record = state.get(resume_checks.DATA_CONFIG_RECORD)
    if file.is_file():
        data_config, where = read_data_config(cfg.shards_dir), cfg.shards_dir
    elif isinstance(record, dict):
        log.info(
            "export: %s not found; the shards' aux layers %s, verifier %r and dims from %s (key '%s', recorded "
            "at training)",
            file,
            record.get("aux_layers"),
            record.get("verifier"),
            path.name,
            resume_checks.DATA_CONFIG_RECORD,
        )
        data_config, where = dict(record), f"{path} (key '{resume_checks.DATA_CONFIG_RECORD}')"
    else:
        raise UserError(
            f"{file}: file not found, and {path} has no record of it (checkpoint key "
            f"'{resume_checks.DATA_CONFIG_RECORD}': written by 04 since 2026-12-05g, this checkpoint is older), "
            f"so --export-only needs the shards' {DATA_CONFIG} for their aux layers, verifier and dims: "
            f"put that one file back at {file} (the shard files are not read), or re-run "
            f"02_extract_hidden.py" + (f"; {relative_hint(file)}" if relative_hint(file) else "")
        )
    unchecked = check_verifier(cfg.verifier, data_config, where)  # as 04 training does
    if unchecked:
        log.warning("%s", unchecked)
    check_extract_settings(cfg.extract, data_config, where)
    return data_config


def _weights_from_checkpoint(cfg: RunConfig) -> bool:
    """Whether ``--export-only`` exports the checkpoint's weights (``select_best: last``, or ``sim_accept`` without a
    ``best_drafter.pt``) rather than the best file's."""
    return cfg.train.select_best != "sim_accept" or not (cfg.train_dir / BEST_FILE).is_file()


def _with_config_context(cfg: RunConfig, args):
    """The checkpoint's drafter args with ``max_position_embeddings`` from the config when it asks
    for another one (``drafter.max_position_embeddings``; ``null`` = the verifier's when the
    checkpoint's is shorter). Only the exported config changes: no weight depends on it
    (rotary angles are computed), so this is how a draft SGLang would refuse is re-exported."""
    want = cfg.drafter.max_position_embeddings
    if want is None:
        try:
            want = verifier_dims(text_config(load_verifier_config(cfg.verifier)))[
                "max_position_embeddings"
            ]
        except UserError:
            return args
        if want is None or want <= args.max_position_embeddings:
            return args
    if want != args.max_position_embeddings:
        log.info(
            "export: max_position_embeddings %d (checkpoint: %d), from drafter.max_position_embeddings",
            want,
            args.max_position_embeddings,
        )
        args = dataclasses.replace(args, max_position_embeddings=int(want))
    return args
