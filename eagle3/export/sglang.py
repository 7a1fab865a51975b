"""The SGLang export format (also SpecForge's); serve it with SGLang only.

``config.json`` = LlamaConfig fields + ``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers``
(= ``num_layers``, 1 by default), ``draft_vocab_size``, ``target_hidden_size`` and
``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}`` with SGLang ids
(:func:`eagle3.engines.layers.engine_layer_ids`: HF index - 1 for Llama-family verifiers, the HF index for
DeepSeek/Kimi ones); ``model.safetensors`` with keys :data:`KEYS`. vLLM would load these weights too, but reads the
``eagle_config`` ids as HF indices: one layer off for Llama.

Every format module of ``eagle3/export/`` states the same names (:data:`eagle3.export.formats.FORMATS`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.export.common import CONFIG_BLOCK, HEAD_KEYS, LAYER_KEYS, MLA_ARCH, variant_keys

log = logging.getLogger(__name__)

ENGINE = "sglang"
ARCH = "LlamaForCausalLMEagle3"
KEYS = tuple(f"midlayer.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Tensor names of the SGLang export (``embed_tokens.weight`` optional)."""
UPPER_NORM = "hidden_norm.weight"
"""Which of :data:`eagle3.export.common.UPPER_NORM_KEYS` SGLang 0.5.23's ``llama_eagle3.py`` applies in layers
``i >= 1``."""
SERVES = {
    "eagle3": "SGLang llama_eagle3.py",
    "eagle3.1": "SGLang 0.5.23 llama_eagle3.py (config keys fc_norm, norm_output)",
}
"""The drafter variants SGLang serves, and the model code read to say so."""
LAYER0 = "midlayer."
"""The name prefix of decoder layer 0 in this format (the drafter's is ``midlayer.``)."""
VOCAB_MAP_REFUSAL = None
"""This engine accepts ``d2t`` in every folder (:func:`writes_vocab_map` is always true)."""
IDS_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"
"""Where ``config.json`` states the aux-layer ids."""


def mla_refusal(mla: dict) -> Optional[str]:
    """Why SGLang 0.5.23 cannot build an MLA drafter of these sizes (None: it can): ``kimi_k25_eagle3.py``
    ``Eagle3MLADecoderLayer`` raises without ``q_lora_rank`` (it fuses ``q_a_proj`` with ``kv_a_proj_with_mqa``)."""
    if "q_lora_rank" in mla and mla["q_lora_rank"] is None:
        return "its kimi_k25_eagle3.py needs q_lora_rank (a q_a_proj); set drafter.mla.q_lora_rank"
    return None


def writes_vocab_map(draft_vocab_size: int, target_vocab_size: int) -> bool:
    """Always: SGLang 0.5.23 (``sglang/srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3.load_weights``) sets
    ``hot_token_id = d2t + arange`` when ``d2t`` is present and skips ``t2d``; without ``d2t`` the draft ids are used
    as target ids. A full-vocab ``d2t`` is all zeros (identity, accepted)."""
    return True


def warn_dtype(dtype: torch.dtype) -> None:
    """Warn for float32 weights: SGLang's ``--dtype auto`` serves a float32 draft config as float16."""
    if dtype == torch.float32:
        log.warning(
            "export.dtype float32 for SGLang: its --dtype auto serves a float32 draft config as float16 "
            "(ModelConfig._get_and_verify_dtype); launch the server with --dtype bfloat16/float32, or export "
            "with export.dtype: auto (bfloat16)"
        )


def build_config(
    llama: dict,
    a: DrafterArgs,
    ids: list[int],
    block: dict,
    verifier_info: dict,
    num_speculative_tokens: int,
) -> dict:
    """SGLang's ``config.json``: ``llama`` (:func:`eagle3.drafter.draft_config.llama_config`) with the EAGLE-3 keys
    and our ``block`` (:data:`eagle3.export.common.CONFIG_BLOCK`; ``verifier_info`` and ``num_speculative_tokens`` are not part of this format).
    An MLA drafter: ``llama`` is its DeepseekV3Config fields (:func:`eagle3.drafter.draft_config.deepseek_config`)
    and ``architectures`` is :data:`eagle3.export.common.MLA_ARCH` (``kimi_k25_eagle3.py``, which reads the same
    EAGLE-3 keys and maps ``midlayer.`` and ``layers.0.`` alike)."""
    return {
        "architectures": [MLA_ARCH if a.is_mla else ARCH],
        **llama,
        "draft_vocab_size": a.draft_vocab_size,
        "target_hidden_size": a.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        **variant_keys(a.variant),
        CONFIG_BLOCK: block,
    }


def is_format(cfg: dict) -> bool:
    """Whether a ``config.json`` dict is in this format: ``architectures`` names :data:`ARCH`, or
    :data:`eagle3.export.common.MLA_ARCH` with the ids in ``eagle_config`` and none at the top level (a vLLM MLA
    folder states them there)."""
    archs = cfg.get("architectures") or []
    if MLA_ARCH in archs:
        return "eagle_aux_hidden_state_layer_ids" not in cfg
    return ARCH in archs


def layer_source(cfg: dict, path: Path) -> dict:
    """The LlamaConfig fields of the drafter's decoder layer, with ``target_hidden_size`` (``hidden_size`` when
    absent), from a ``config.json`` of this format."""
    return {**cfg, "target_hidden_size": cfg.get("target_hidden_size") or cfg.get("hidden_size")}


def layer_ids(cfg: dict) -> Optional[object]:
    """The aux-layer ids SGLang reads from ``config.json`` (unchecked; ``None`` when not stated)."""
    ec = cfg.get("eagle_config") or {}
    return ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, dict) else None
