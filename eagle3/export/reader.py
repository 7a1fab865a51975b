"""Read an exported folder back: which engine it is for and which verifier layers it makes that engine capture
(:func:`check_export_folder`), the cheap checks before loading (:func:`preflight_export`), and the drafter itself
(:func:`load_exported`). Reads this project's folders of every format in :data:`eagle3.export.formats.FORMATS`, and
compatible SGLang/SpecForge/speculators ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Annotated, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter, field_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eagle3.data.vocab import check_vocab_map
from eagle3.drafter.args import DrafterArgs, Positive, PositiveInt
from eagle3.drafter.model import Eagle3Drafter
from eagle3.engines import LABELS, Engine, others, spelled
from eagle3.engines.layers import engine_layer_ids, hf_layers_from_engine, layer_id_convention
from eagle3.errors import UserError, validated
from eagle3.export.common import (
    CONFIG_BLOCK,
    EMBED_KEY,
    META_FILE,
    MLA_ARCH,
    UPPER_NORM_KEYS,
    WEIGHTS_FILE,
    layer_keys,
)
from eagle3.export.folder import recorded_meta
from eagle3.export.formats import FORMATS, format_of, required_keys
from eagle3.io import read_json
from eagle3.train.checkpoint import ckpt_dir, list_checkpoints
from eagle3.verifier.arch import mla_sizes

log = logging.getLogger(__name__)


def check_export_folder(
    path: str | os.PathLike,
    serving_engine: Optional[str] = None,
    shards_aux_hf: Optional[list[int]] = None,
    verifier_architecture: Optional[str] = None,
) -> dict:
    """Which engine an exported folder is for, which verifier layers it makes that engine capture,
    and whether that agrees with its metadata, the intended engine and the shards.

    The engine is read from ``config.json`` (:func:`eagle3.export.formats.format_of`); the ids it states are
    converted to HF indices with that engine's rule (:func:`eagle3.engines.layers.hf_layers_from_engine`; verifier
    architecture from the ``eagle3_train`` block or ``verifier_architecture``).

    Args:
        path: exported folder.
        serving_engine: the engine that serves the folder when the caller knows it (e.g. the SGLang server
            benchmark); ``None`` for engine-neutral loaders.
        shards_aux_hf: the HF aux layers of the training shards (``data_config.json``).
        verifier_architecture: used when the folder records none (third-party exports).

    Returns:
        ``{"engine", "engine_layer_ids" (or None), "aux_layers_hf" (HF indices the engine
        captures, or None when unknown), "warnings": [str], "drafter_args": DrafterArgs}``.

    Raises:
        UserError: ``config.json`` unreadable or of no known format; the recorded engine differs from the folder's
            format; the stated ids are not the engine's ids for the recorded HF layers (edited by hand or copied
            from another engine's folder); or the folder is for another engine than ``serving_engine``.
    """
    root = Path(path)
    cfg_path, cfg = _read_config_json(root)
    engine, args = _args_from_config(cfg, cfg_path)
    ids = _config_layer_ids(cfg, engine, cfg_path)
    block = _recorded_block(cfg, root)
    arch = (block or {}).get("verifier_architecture") or verifier_architecture
    problem = _layers_problem(cfg_path, engine, ids, block, arch, serving_engine)
    if problem:
        raise UserError(problem)
    aux_hf, warnings = _captured_layers(cfg_path, engine, ids, block, arch)
    if (
        shards_aux_hf is not None
        and aux_hf is not None
        and list(aux_hf) != [int(i) for i in shards_aux_hf]
    ):
        warnings.append(
            f"{cfg_path}: {engine} will capture HF layers {aux_hf} (ids {ids}) but the shards were "
            f"extracted at HF layers {list(shards_aux_hf)}: expect near-zero acceptance"
        )
    return {
        "engine": engine,
        "engine_layer_ids": ids,
        "aux_layers_hf": aux_hf,
        "warnings": warnings,
        "drafter_args": args,
    }


def _layers_problem(
    cfg_path: Path,
    engine: str,
    ids: Optional[list[int]],
    block: Optional[dict],
    arch: Optional[str],
    serving_engine: Optional[str],
) -> Optional[str]:
    """Why the folder's ``engine`` and its layer ``ids`` cannot be served as they stand, or None: another engine
    (``serving_engine``) serves it; the recorded block (:func:`_recorded_block`) names another engine than the
    format; ``ids`` are not the engine's ids for the block's HF layers (``arch``: the verifier architecture)."""
    root = cfg_path.parent
    if serving_engine is not None and serving_engine != engine:
        return (
            f"{cfg_path}: this folder is for {engine}, but {serving_engine} serves it; {serving_engine} reads "
            f"its layer ids {ids} in another convention (one layer off for Llama verifiers). Use the "
            f"{serving_engine} export: {reexport_hint(root, serving_engine)}"
        )
    if block is None:
        return None
    if block["engine"] != engine:
        return (
            f"{block['source']}: key 'engine' is {block['engine']!r} but {cfg_path} is in the {engine} "
            f"format; the folder mixes two exports (re-export with --engine {block['engine']})"
        )
    aux_hf = [int(i) for i in block["aux_layers_hf"]]
    want = engine_layer_ids(aux_hf, engine, str(arch)) if arch is not None else ids
    if ids == want:
        return None
    return (
        f"{cfg_path}: layer ids {ids} are not {engine}'s ids for the recorded HF aux layers "
        f"{aux_hf} (expected {want}: {layer_id_convention(engine, str(arch))}); edited by hand "
        f"or copied from the {spelled(others(engine))} folder? Re-export with --engine {engine}"
    )


def _captured_layers(
    cfg_path: Path,
    engine: str,
    ids: Optional[list[int]],
    block: Optional[dict],
    arch: Optional[str],
) -> tuple[Optional[list[int]], list[str]]:
    """The HF layers ``engine`` captures for the folder's ``ids`` (None when unknown) and the warnings saying why
    unknown; the recorded block (:func:`_recorded_block`) agrees with the format and the ids
    (:func:`_layers_problem`)."""
    if block is not None:
        return [int(i) for i in block["aux_layers_hf"]], []
    if ids is not None and arch is not None:
        return hf_layers_from_engine(ids, engine, str(arch)), []
    if ids is None:
        return None, [f"{cfg_path}: states no aux layer ids; {engine} will use its default layers"]
    return None, [
        f"{cfg_path}: no '{CONFIG_BLOCK}' block and no verifier architecture: cannot tell which "
        f"verifier layers the {engine} ids {ids} select"
    ]


def reexport_hint(root: Path, engine: str) -> str:
    """How to get the ``engine`` export of the run that exported ``root`` (the text after ``Use the <engine> export: ``
    in :func:`check_export_folder`'s refusal). ``04_train.py --export-only`` reads the run's checkpoints, which the
    host serving or benchmarking the folder may not have; the folder's ``eagle3_train.json``
    ``trained_from.train_dir`` says where they were: an export of that run for ``engine`` beside ``root`` is named
    first; else ``--export-only`` when that folder holds checkpoints here; else that it needs them."""
    cmd = f"04_train.py --export-only --engine {engine}"
    src = _trained_from_dir(root)
    sib = root.parent / f"drafter-{engine}"
    if src and sib != root and (sib / "config.json").is_file() and _trained_from_dir(sib) == src:
        return f"{sib} (the same run's, beside this one)"
    if not src:
        return cmd
    if list_checkpoints(src):
        return f"{cmd} writes it from {ckpt_dir(src)} (with the run's config)"
    return (
        f"{cmd} needs the run's checkpoints, and {ckpt_dir(src)} (trained_from in {root / META_FILE}) holds none on "
        f"this machine: run it where they are"
    )


def _trained_from_dir(root: Path) -> Optional[str]:
    """``trained_from.train_dir`` of ``root``'s ``eagle3_train.json``; None when absent or unreadable."""
    src = recorded_meta(root).get("trained_from")
    return src.get("train_dir") if isinstance(src, dict) else None


def _recorded_block(cfg: dict, root: Path) -> Optional[dict]:
    """Our ``eagle3_train`` block of ``config.json``, else the same facts from ``eagle3_train.json``."""
    block = cfg.get(CONFIG_BLOCK)
    src = root / "config.json"
    if block is None and (root / META_FILE).is_file():
        meta = read_json(root / META_FILE)
        if isinstance(meta, dict) and "engine" in meta and "aux_layers_hf" in meta:
            block = {
                "engine": meta["engine"],
                "aux_layers_hf": meta["aux_layers_hf"],
                "verifier_architecture": (meta.get("verifier") or {}).get("architecture"),
            }
            src = root / META_FILE
    if block is None:
        return None
    validated(_RecordedBlock, block, f"{src} ({CONFIG_BLOCK})", _REEXPORT)
    return dict(block, source=str(src))


class _RecordedBlock(BaseModel):
    """The facts :func:`_recorded_block` reads: the engine the folder is for, the three HF aux layers its ids state."""

    model_config = ConfigDict(extra="allow")

    engine: Engine
    aux_layers_hf: Annotated[list[StrictInt], Field(min_length=3, max_length=3)]


def preflight_export(path: str | os.PathLike) -> tuple[Path, str, DrafterArgs, Path, list[str]]:
    """The cheap checks of an exported folder, without reading its tensors: ``config.json`` (keys, engine), the
    folder's layer ids (:func:`check_export_folder`: its warnings are returned, not logged) and the weights file's
    safetensors header against its size (a truncated or half-written file fails here). Stage 05 runs it before
    loading the verifier, so a bad ``--drafter`` fails at once.

    Returns:
        ``(config.json path, engine, DrafterArgs, weights path, warnings)``.

    Raises:
        UserError: as :func:`load_exported` for ``config.json``; the weights file missing or not a readable
            safetensors file (naming it).
    """
    root = Path(path)
    found = check_export_folder(root)
    wpath = root / WEIGHTS_FILE
    try:
        with safe_open(str(wpath), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(wpath, e) from e
    return root / "config.json", found["engine"], found["drafter_args"], wpath, found["warnings"]


def _unreadable(wpath: Path, e: Exception) -> UserError:
    """``<file>: file not found``, else ``<file>: unreadable safetensors file: <first line of the error>``."""
    if isinstance(e, FileNotFoundError):
        return UserError(f"{wpath}: file not found")
    return UserError(
        f"{wpath}: unreadable safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    )


def load_exported(
    path: str | os.PathLike, embed_weight: Optional[torch.Tensor] = None
) -> Eagle3Drafter:
    """Load an exported folder (any format) into an :class:`Eagle3Drafter` (float32, CPU).

    Weights stored in bfloat16/float16 are upcast exactly, so ``load_exported(...).to(bf16)``
    computes what the exported drafter cast to bf16 computes.

    Args:
        path: folder written by :func:`eagle3.export.writer.export_drafter` (or a compatible
            SGLang/SpecForge/speculators one).
        embed_weight: the verifier's input embedding ``[target_V, H]``; required when the folder has
            no ``embed_tokens.weight``.

    A folder without ``d2t``/``t2d`` is accepted when ``draft_vocab_size`` equals ``vocab_size``
    (identity map; vLLM's full-vocab format); a folder WITH ``d2t`` where its engine refuses one is refused
    (the format module's ``writes_vocab_map``).

    Raises:
        UserError: missing/bad ``config.json`` key, a folder whose layer ids disagree with its
            recorded engine/HF layers (:func:`check_export_folder`), missing or unexpected tensor,
            wrong tensor shape, an invalid ``d2t``/``t2d`` (:func:`eagle3.data.vocab.check_vocab_map`),
            or no embeddings available -- each naming the file and key.
    """
    cfg_path, engine, args, wpath, warnings = preflight_export(path)
    for w in warnings:
        log.warning("%s", w)
    tensors = _read_tensors(wpath, FORMATS[engine])
    problem, drafter = _fit_tensors(tensors, args, FORMATS[engine], (wpath, cfg_path), embed_weight)
    if problem:
        raise UserError(f"{wpath}: {problem}")
    sd = drafter.state_dict()
    check_vocab_map(
        tensors["d2t"],
        tensors["t2d"],
        str(wpath),
        target_vocab_size=args.target_vocab_size,
        draft_vocab_size=args.draft_vocab_size,
        draft_key=f"{cfg_path.name} draft_vocab_size",
        target_source=f"{cfg_path.name} vocab_size",
    )
    with torch.no_grad():
        for k, v in tensors.items():
            sd[k].copy_(v.to(sd[k].dtype) if v.is_floating_point() else v)
    return drafter


def _read_tensors(wpath: Path, fmt: ModuleType) -> dict[str, torch.Tensor]:
    """The folder's tensors, layer 0 under the drafter's ``midlayer.`` names.

    Raises:
        UserError: not a readable safetensors file.
    """
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(wpath, e) from e
    return {
        (k.replace(fmt.LAYER0, "midlayer.", 1) if k.startswith(fmt.LAYER0) else k): v
        for k, v in tensors.items()
    }


def _fit_tensors(
    tensors: dict,
    args: DrafterArgs,
    fmt: ModuleType,
    paths: tuple[Path, Path],
    embed_weight: Optional[torch.Tensor],
) -> tuple[Optional[str], Optional[Eagle3Drafter]]:
    """The folder's ``tensors`` (``paths``: its weights file and ``config.json``) made the state of the drafter its
    config implies (in place: the identity vocab map of a full-vocab folder, the upper layers' norm its engine
    applies, ``embed_weight`` where the folder stores no embedding).

    Returns:
        ``(None, the drafter to copy them into)``, or ``(the first fault, None)``: a ``d2t`` where the folder's
        engine refuses one, a missing or unexpected tensor, a tensor of another shape, no embedding to use.
    """
    wpath, cfg_path = paths
    problem = _stray_vocab_map(tensors, args, fmt, cfg_path)
    if problem:
        return problem, None
    # a full-vocab folder without a map: the identity, as both engines use it
    if args.draft_vocab_size == args.target_vocab_size and not {"d2t", "t2d"} & set(tensors):
        tensors["d2t"] = torch.zeros(args.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(args.target_vocab_size, dtype=torch.bool)
    problem = _tensor_names_problem(tensors, args, fmt)
    if problem:
        return problem, None
    _pick_upper_norms(tensors, args, fmt, wpath)
    drafter = Eagle3Drafter(args)
    sd = drafter.state_dict()
    problem = next(
        (
            f"tensor '{k}' has shape {list(v.shape)}, config implies {list(sd[k].shape)}"
            for k, v in tensors.items()
            if tuple(v.shape) != tuple(sd[k].shape)
        ),
        None,
    )
    if problem is None and EMBED_KEY not in tensors:
        problem = _embedding_problem(embed_weight, sd, args, cfg_path)
        tensors[EMBED_KEY] = embed_weight  # copied only when it fits (no problem)
    return (problem, None) if problem else (None, drafter)


def _stray_vocab_map(
    tensors: dict, args: DrafterArgs, fmt: ModuleType, cfg_path: Path
) -> Optional[str]:
    """The fault of a ``d2t`` in a full-vocab folder whose engine refuses one (:data:`VOCAB_MAP_REFUSAL` of its
    format), or None."""
    if fmt.writes_vocab_map(args.draft_vocab_size, args.target_vocab_size) or "d2t" not in tensors:
        return None
    return (
        f"tensor 'd2t' in a full-vocab folder ({cfg_path.name} draft_vocab_size = vocab_size = "
        f"{args.draft_vocab_size}): {LABELS[fmt.ENGINE]} refuses it ({fmt.VOCAB_MAP_REFUSAL}); re-export "
        f"with 04_train.py --export-only --engine {fmt.ENGINE}"
    )


def _tensor_names_problem(tensors: dict, args: DrafterArgs, fmt: ModuleType) -> Optional[str]:
    """The first required tensor missing (named as the folder names it; for ``d2t``, why it is needed), else the
    first unexpected one, or None."""
    want = required_keys(
        "sglang", args.variant, args.num_layers, layer_keys(args)
    )  # the drafter's names
    missing = [k for k in want if k not in tensors]
    extra = sorted(set(tensors) - set(want) - {EMBED_KEY})
    if missing:
        why = (
            f" (draft_vocab_size {args.draft_vocab_size} < vocab_size {args.target_vocab_size}: without it the "
            f"engine takes every draft id for the target id of the same number)"
            if missing[0] == "d2t"
            else ""
        )
        return f"missing required tensor '{missing[0].replace('midlayer.', fmt.LAYER0, 1)}'{why}"
    return f"unexpected tensor '{extra[0]}'" if extra else None


def _pick_upper_norms(tensors: dict, args: DrafterArgs, fmt: ModuleType, wpath: Path) -> None:
    """Layers ``i >= 1``: keep the pre-attention norm the folder's engine applies (``UPPER_NORM`` of its format)
    under the drafter's name ``layers.{i}.input_layernorm.weight``; warn when the two written copies differ."""
    for i in range(1, args.num_layers):
        pre = f"layers.{i}."
        used = pre + fmt.UPPER_NORM
        other = pre + [k for k in UPPER_NORM_KEYS if k != fmt.UPPER_NORM][0]
        if not torch.equal(tensors[used], tensors[other]):
            log.warning(
                "%s: '%s' differs from '%s'; %s applies '%s' (loaded), the other engine the other one",
                wpath,
                used,
                other,
                fmt.ENGINE,
                used,
            )
        weight = tensors.pop(used)
        tensors.pop(other)
        tensors[pre + "input_layernorm.weight"] = weight  # the drafter's name (Eagle3UpperLayer)


def _embedding_problem(
    embed_weight: Optional[torch.Tensor], sd: dict, args: DrafterArgs, cfg_path: Path
) -> Optional[str]:
    """Why ``embed_weight`` cannot stand for the ``embed_tokens.weight`` a folder does not store (none given, or of
    another shape than the config implies), or None."""
    want = list(sd[EMBED_KEY].shape)
    if embed_weight is not None and list(embed_weight.shape) == want:
        return None
    hint = (
        f" (the drafter's hidden_size {args.hidden_size} differs from target_hidden_size "
        f"{args.target_hidden_size}: the folder must carry its own '{EMBED_KEY}')"
        if args.hidden_size != args.target_hidden_size
        else ""
    )
    got = "not given" if embed_weight is None else f"of shape {list(embed_weight.shape)}"
    return (
        f"no '{EMBED_KEY}' stored and embed_weight is {got}; pass the verifier's embedding of shape "
        f"{want} ({cfg_path.name} implies it){hint}"
    )


def _read_config_json(root: Path) -> tuple[Path, dict]:
    """``(path, dict)`` of an exported folder's ``config.json``.

    Raises:
        UserError: missing or unreadable file (:func:`eagle3.io.read_json`), or not a JSON object.
    """
    cfg_path = root / "config.json"
    return cfg_path, validated(_OBJECT, read_json(cfg_path), str(cfg_path), _REEXPORT)


_REEXPORT = "re-export with 04_train.py --export-only"
_OBJECT = TypeAdapter(dict)
_LAYER_IDS = TypeAdapter(dict[str, Optional[list[StrictInt]]])
"""``{IDS_KEY: ids}`` of a format: the aux-layer ids, a list of integers or not stated."""


class _LayerKeys(BaseModel):
    """The keys of the drafter's decoder layer a ``config.json`` must state (after the format's ``layer_source``);
    the others are read with their defaults by :func:`_args_from_config`."""

    model_config = ConfigDict(extra="allow")

    num_hidden_layers: PositiveInt = 1
    num_attention_heads: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    rms_norm_eps: Positive
    draft_vocab_size: PositiveInt
    vocab_size: PositiveInt


def _args_from_config(cfg: dict, path: Path) -> tuple[str, DrafterArgs]:
    """The engine a ``config.json`` dict is for (:func:`eagle3.export.formats.format_of`) and its
    :class:`DrafterArgs`.

    Raises:
        UserError: no known format; a missing or invalid key (naming the file and key).
    """
    fmt = format_of(cfg, path)
    src = fmt.layer_source(cfg, path)
    k = validated(_LayerKeys, src, str(path), _REEXPORT)
    mla = mla_sizes(src) if MLA_ARCH in (cfg.get("architectures") or []) else None
    heads, H = k.num_attention_heads, k.hidden_size
    fields = dict(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=src.get("num_key_value_heads") or heads,
        head_dim=src.get("head_dim") or H // heads,
        intermediate_size=k.intermediate_size,
        rms_norm_eps=k.rms_norm_eps,
        rope_theta=src.get("rope_theta")
        or (src.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=src.get("max_position_embeddings", 2048),
        draft_vocab_size=k.draft_vocab_size,
        target_vocab_size=k.vocab_size,
        target_hidden_size=src["target_hidden_size"],
        rope_scaling=src.get("rope_scaling"),
        variant=_config_variant(cfg, path),
        num_layers=k.num_hidden_layers,
    )
    if mla:  # kv heads = heads, head_dim = nope + rope (a size that is no integer: refused by DrafterArgs)
        fields.update(attention="mla", mla=mla, num_key_value_heads=heads)
        if all(isinstance(mla[k], int) for k in ("qk_nope_head_dim", "qk_rope_head_dim")):
            fields["head_dim"] = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    return fmt.ENGINE, DrafterArgs.from_json(fields, str(path), _REEXPORT)


class _VariantKeys(BaseModel):
    """The keys SGLang 0.5.23 / vLLM 0.33 build the drafter variant from, as booleans: ``fc_norm`` (or SGLang's
    legacy ``use_aux_norm``) and ``norm_output`` both true = ``eagle3.1``, both false = ``eagle3``; ``norm_before_fc``
    (one RMSNorm over the concatenated aux states) is not implemented here."""

    norm_before_fc: Literal[False]
    fc_norm: bool
    norm_output: bool

    @field_validator("norm_output")
    @classmethod
    def _both_or_neither(cls, v: bool, info) -> bool:
        if v != info.data.get("fc_norm", v):
            raise ValueError(
                f"({v}) differs from fc_norm ({not v}): eagle3 has both false, eagle3.1 both true"
            )
        return v


def _config_variant(cfg: dict, path: Path) -> str:
    """The drafter variant a ``config.json`` makes the engines build (:class:`_VariantKeys`).

    Raises:
        UserError: ``norm_before_fc`` true, or only one of the two EAGLE-3.1 keys set, naming the file and key.
    """
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    keys = {
        "norm_before_fc": bool(cfg.get("norm_before_fc") or ec.get("norm_before_fc")),
        "fc_norm": bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
        "norm_output": bool(cfg.get("norm_output")),
    }
    fix = "this project implements eagle3 and eagle3.1 (fc_norm: one norm per aux state) only"
    return "eagle3.1" if validated(_VariantKeys, keys, str(path), fix).fc_norm else "eagle3"


def _config_layer_ids(cfg: dict, engine: str, path: Path) -> Optional[list[int]]:
    """The aux-layer ids the engine reads from ``config.json`` (``None`` when not stated).

    Raises:
        UserError: not a list of integers (naming the file and the key).
    """
    key = FORMATS[engine].IDS_KEY
    return validated(_LAYER_IDS, {key: FORMATS[engine].layer_ids(cfg)}, str(path), _REEXPORT)[key]
