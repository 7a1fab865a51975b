"""Write a trained drafter as the folder one serving engine loads (:func:`export_drafter`).

Each engine takes its own folder (``04_train.py --export-only --engine <engine>`` writes any of them from the same
checkpoint); they differ in the aux-layer ids they state, and a folder served by another engine loads without error
but captures the wrong verifier layers. The formats: :mod:`eagle3.export.sglang`, :mod:`eagle3.export.vllm`; what
they share: :mod:`eagle3.export.common`.

Both ``config.json`` carry an ``eagle3_train`` block (:data:`eagle3.export.common.CONFIG_BLOCK`: ``engine``,
``aux_layers_hf``, ``engine_layer_ids``, ``layer_id_convention``, the verifier architecture) that makes a folder used
by the wrong engine, or ids edited by hand, detectable (:func:`eagle3.export.reader.check_export_folder`), and
``torch_dtype`` / ``dtype`` = the weights' dtype (:func:`eagle3.export.common.export_dtype`). ``eagle3_train.json``
holds our metadata (HF aux layers, engine, engine ids, verifier, drafter args, and ``trained_from``: ``train_dir``,
``checkpoint``, ``step``, ``select_best``, ``selected_step``). Embedding weights are omitted unless
``include_embeddings``; both engines then use the verifier's, which requires equal hidden sizes
(:func:`eagle3.export.common.check_export_contract`). Folders are written to a temporary sibling and renamed into
place (:func:`eagle3.export.folder.write_export_folder`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.draft_config import DEFAULT_EXPORT_DTYPE, draft_layer_config
from eagle3.drafter.model import Eagle3Drafter
from eagle3.engines import LABELS, known, others, spelled
from eagle3.engines.layers import check_aux_layers, engine_layer_ids, layer_id_convention
from eagle3.export.common import (
    CONFIG_BLOCK,
    EMBED_KEY,
    VERIFIER_FIELDS,
    VOCAB_KEYS,
    WEIGHTS_FILE,
    check_export_contract,
    export_dtype,
    layer_keys,
    state_key,
)
from eagle3.export.folder import write_export_folder
from eagle3.export.formats import FORMATS, check_engine_serves, required_keys


def export_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    engine: str,
    aux_layers_hf: list[int],
    verifier_info: dict,
    include_embeddings: bool = False,
    num_speculative_tokens: int = 3,
    dtype: str | torch.dtype = DEFAULT_EXPORT_DTYPE,
    provenance: Optional[dict] = None,
    ttt_length: Optional[int] = None,
) -> Path:
    """Write ``drafter`` as the ``engine`` folder ``out_dir`` (replaced if it exists; module docstring).

    Args:
        drafter: trained drafter (its ``d2t``/``t2d`` must be the run's vocab map).
        engine: one of :data:`eagle3.engines.ENGINES`; the folder is for that engine only.
        aux_layers_hf: the three aux layers as HF ``hidden_states`` indices (capture convention).
        verifier_info: ``{name, architecture, num_layers, hidden_size, vocab_size}`` (required: stage 04 takes them
            from ``data_config.json``, whose reader refuses a missing one), optionally ``weights``. The draft's
            context length against the verifier's is 04's start-up decision
            (:func:`eagle3.stages.export.check_export_serves`), not checked here.
        include_embeddings: also store ``embed_tokens.weight`` (required when the drafter's hidden size differs).
        num_speculative_tokens: vLLM ``speculators_config.proposal_methods[0].speculative_tokens``.
        dtype: the weights' dtype (a name from :data:`eagle3.export.common.EXPORT_DTYPES` is accepted), recorded
            as ``torch_dtype``/``dtype`` in ``config.json``.
        provenance: ``trained_from`` of ``eagle3_train.json`` only; replacing an export recorded from another
            ``train_dir`` logs a warning.
        ttt_length: the TTT steps the drafter was trained for, recorded in ``eagle3_train.json`` (None: not).

    Raises:
        UserError: unknown engine or dtype, an engine that cannot serve the drafter's variant, aux layers invalid
            for the verifier, a broken shape contract, a required tensor missing, or the folder's write refusals
            (:func:`eagle3.export.folder.write_export_folder`).
    """
    out_dtype, aux = _check_request(
        drafter, engine, aux_layers_hf, verifier_info, include_embeddings, dtype
    )
    a = drafter.args
    tensors = _export_tensors(drafter, engine, include_embeddings, out_dtype)
    config = export_config(a, engine, aux, verifier_info, out_dtype, num_speculative_tokens)
    meta = _export_meta(config, verifier_info, drafter, include_embeddings)
    if ttt_length is not None:
        meta["ttt_length"] = int(ttt_length)
    if provenance is not None:
        meta["trained_from"] = dict(provenance)
    return write_export_folder(Path(out_dir), engine, tensors, config, meta, provenance)


def export_config(
    a: DrafterArgs,
    engine: str,
    aux_layers_hf: list[int],
    verifier_info: dict,
    dtype: torch.dtype = DEFAULT_EXPORT_DTYPE,
    num_speculative_tokens: int = 3,
) -> dict:
    """The ``config.json`` :func:`export_drafter` writes for a drafter of args ``a`` (no weights needed: the
    full-size loader tests read it with :func:`export_tensor_names`)."""
    ids = engine_layer_ids(list(aux_layers_hf), engine, str(verifier_info["architecture"]))
    block = _config_block(engine, list(aux_layers_hf), ids, verifier_info, a.variant)
    return FORMATS[engine].build_config(
        draft_layer_config(a, dtype), a, ids, block, verifier_info, num_speculative_tokens
    )


def export_tensor_names(a: DrafterArgs, engine: str) -> dict[str, str]:
    """Export tensor name -> drafter ``state_dict`` name of what :func:`export_drafter` writes for args ``a``
    (embedding omitted; without ``d2t``/``t2d`` where the engine refuses them)."""
    required = required_keys(engine, a.variant, a.num_layers, layer_keys(a))
    if not FORMATS[engine].writes_vocab_map(a.draft_vocab_size, a.target_vocab_size):
        required = tuple(k for k in required if k not in VOCAB_KEYS)  # full vocab: vLLM refuses d2t
    return {key: state_key(key) for key in required}


def _check_request(
    drafter: Eagle3Drafter,
    engine: str,
    aux_layers_hf: list[int],
    verifier_info: dict,
    include_embeddings: bool,
    dtype: str | torch.dtype,
) -> tuple[torch.dtype, list[int]]:
    """:func:`export_drafter`'s refusals before anything is written; returns ``(dtype, HF aux layers)``."""
    known(engine, "export.engine")
    check_engine_serves(engine, drafter.args.variant, drafter.args.mla)
    out_dtype = export_dtype(dtype)
    FORMATS[engine].warn_dtype(out_dtype)
    aux = check_aux_layers(aux_layers_hf, int(verifier_info["num_layers"]), field="aux_layers_hf")
    check_export_contract(
        drafter, verifier_info, include_embeddings, export_tensor_names(drafter.args, engine)
    )
    return out_dtype, aux


def _export_tensors(
    drafter: Eagle3Drafter, engine: str, include_embeddings: bool, out_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The folder's tensors by export name: floating ones cast to ``out_dtype``, all contiguous CPU copies (every
    one in the drafter state: :func:`eagle3.export.common.check_export_contract`, before)."""
    sd = drafter.state_dict()
    tensors = {key: sd[src] for key, src in export_tensor_names(drafter.args, engine).items()}
    if include_embeddings:
        tensors[EMBED_KEY] = sd[EMBED_KEY]
    return {
        k: (v.to(out_dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone()
        for k, v in tensors.items()
    }


def _config_block(
    engine: str, aux: list[int], ids: list[int], verifier_info: dict, variant: str
) -> dict:
    """Our ``eagle3_train`` block of ``config.json``: the engine, its ids and the HF layers they select."""
    arch = str(verifier_info["architecture"])
    return {
        "format_version": 1,
        "engine": engine,
        "serve_with": f"{LABELS[engine]} only (the other engine reads these layer ids in another convention; "
        f"export with --engine {spelled(others(engine))})",
        "aux_layers_hf": aux,
        "engine_layer_ids": ids,
        "layer_id_convention": layer_id_convention(engine, arch),
        "verifier_architecture": arch,
        "verifier_num_layers": int(verifier_info["num_layers"]),
        "variant": variant,
    }


def _export_meta(
    config: dict, verifier_info: dict, drafter: Eagle3Drafter, include_embeddings: bool
) -> dict:
    """``eagle3_train.json`` without ``ttt_length`` and ``trained_from`` (added by the caller when known); its first
    keys and dtype are those of ``config`` (``config.json``) and its block (:func:`_config_block`)."""
    block = config[CONFIG_BLOCK]
    weights = {"weights": verifier_info["weights"]} if verifier_info.get("weights") else {}
    first = ("format_version", "engine", "aux_layers_hf", "engine_layer_ids", "layer_id_convention")
    return {
        **{k: block[k] for k in first},
        # + the weights' fingerprint 02 recorded
        "verifier": {**{f: verifier_info[f] for f in VERIFIER_FIELDS}, **weights},
        "drafter_args": drafter.args.to_json(),
        "include_embeddings": bool(include_embeddings),
        "variant": drafter.args.variant,
        "dtype": config["torch_dtype"],
        "weights": WEIGHTS_FILE,
    }
