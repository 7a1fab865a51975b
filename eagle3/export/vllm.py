"""The vLLM export format (vLLM speculators, read by ``vllm/transformers_utils/configs/speculators``); serve it with
vLLM only.

``config.json`` = ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``,
``transformer_layer_config`` (a LlamaConfig dict), ``draft_vocab_size``, ``target_hidden_size``,
``norm_before_residual: false`` (written explicitly: vLLM's default when absent is true, which is not this drafter),
top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM ids = HF indices) and ``speculators_config`` (greedy proposal
with ``speculative_tokens``, the verifier's ``name_or_path`` and architecture). Weights use the speculators names:
``layers.0.`` instead of ``midlayer.``, the rest as in SGLang (vLLM drops ``t2d`` at load; it is kept for round
trips), except that a full-vocab drafter (``draft_vocab_size`` = the verifier's vocab) has neither ``d2t`` nor
``t2d``: vLLM's loader refuses ``d2t`` then (:func:`writes_vocab_map`). SGLang cannot load it.

Every format module of ``eagle3/export/`` states the same names (:data:`eagle3.export.formats.FORMATS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict

from eagle3.drafter.args import DrafterArgs
from eagle3.errors import validated
from eagle3.export.common import CONFIG_BLOCK, HEAD_KEYS, LAYER_KEYS, MLA_ARCH, variant_keys

ENGINE = "vllm"
ARCH = "Eagle3Speculator"
KEYS = tuple(f"layers.0.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Tensor names of the vLLM speculators export with a reduced draft vocab (``embed_tokens.weight`` optional; a
full-vocab vLLM export has no ``d2t``/``t2d``, see :func:`writes_vocab_map`)."""
UPPER_NORM = "input_layernorm.weight"
"""Which of :data:`eagle3.export.common.UPPER_NORM_KEYS` vLLM 0.33's ``llama_eagle3.py`` applies in layers
``i >= 1``."""
SERVES = {
    "eagle3": "vLLM llama_eagle3.py",
    "eagle3.1": "vLLM 0.33 llama_eagle3.py + transformers_utils/configs/speculators/algos.py (fc_norm, norm_output)",
}
"""The drafter variants vLLM serves, and the model code read to say so."""
LAYER0 = "layers.0."
"""The name prefix of decoder layer 0 in this format (the drafter's is ``midlayer.``)."""
VOCAB_MAP_REFUSAL = (
    "Eagle3LlamaForCausalLM has no 'draft_id_to_target_id' when the draft vocab is the verifier's"
)
"""Why this engine refuses a ``d2t`` where :func:`writes_vocab_map` is false."""
MLA_MODEL_TYPE = "deepseek_v2"
"""``model_type`` of an MLA drafter's ``config.json`` (:func:`mla_config`): one vLLM keeps as an EAGLE-3 draft."""
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
"""Where ``config.json`` states the aux-layer ids."""


def mla_refusal(mla: dict) -> Optional[str]:
    """Why vLLM 0.34 cannot serve an MLA drafter of these sizes (None: it can): ``deepseek_eagle3.py``'s weight
    mapper renames ``kv_a_proj_with_mqa`` to the fused ``fused_qkv_a_proj`` (shard 1), which
    ``DeepseekV2MLAAttention`` creates only with ``q_lora_rank`` set; and it builds its rotary embedding with
    ``is_neox_style=False`` (interleaved pairs) whatever the config says."""
    if "q_lora_rank" in mla and mla["q_lora_rank"] is None:
        return "its deepseek_eagle3.py loads kv_a_proj_with_mqa into a fused q_a projection; set drafter.mla.q_lora_rank"
    if not mla.get("rope_interleave", True):
        return "its deepseek_v2.py rotates interleaved pairs only; set drafter.mla.rope_interleave: true"
    return None


def writes_vocab_map(draft_vocab_size: int, target_vocab_size: int) -> bool:
    """Whether the folder carries ``d2t``/``t2d``: iff ``draft_V < target_V``. vLLM 0.33 ``Eagle3LlamaForCausalLM``
    (``llama_eagle3.py``) has its ``draft_id_to_target_id`` (loaded from ``d2t``; ``t2d`` skipped) only then: it
    refuses a full-vocab folder's ``d2t``, and without one a reduced-vocab folder drafts silently wrong ids."""
    return int(draft_vocab_size) != int(target_vocab_size)


def warn_dtype(dtype: torch.dtype) -> None:
    """Nothing to say: vLLM casts the draft to the verifier's serving dtype."""


def build_config(
    llama: dict,
    a: DrafterArgs,
    ids: list[int],
    block: dict,
    verifier_info: dict,
    num_speculative_tokens: int,
) -> dict:
    """The speculators ``config.json``: ``llama`` (:func:`eagle3.drafter.draft_config.llama_config`) as the
    ``transformer_layer_config``, the greedy proposal of ``num_speculative_tokens``, the verifier's name and
    architecture, and our ``block`` (:data:`eagle3.export.common.CONFIG_BLOCK`). An MLA drafter: vLLM's
    speculators configs map only llama / qwen3 layers (``speculators/algos.py``), so the folder is a plain HF config
    (:func:`mla_config`)."""
    if a.is_mla:
        return mla_config(llama, a, ids, block)
    arch = str(verifier_info["architecture"])
    return {
        "architectures": [ARCH],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama},
        "draft_vocab_size": a.draft_vocab_size,
        "target_hidden_size": a.target_hidden_size,
        "norm_before_residual": False,
        **variant_keys(a.variant),
        "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_info["name"]), "architectures": [arch]},
        },
        "torch_dtype": llama["torch_dtype"],
        "dtype": llama["dtype"],
        CONFIG_BLOCK: block,
    }


def mla_config(ds: dict, a: DrafterArgs, ids: list[int], block: dict) -> dict:
    """The ``config.json`` of an MLA drafter for vLLM 0.34 ``deepseek_eagle3.py`` (``Eagle3DeepseekV2ForCausalLM``,
    ``--speculative-config '{"method": "eagle3", ...}'``): its DeepseekV3Config fields ``ds``
    (:func:`eagle3.drafter.draft_config.deepseek_config`), ``draft_vocab_size``, ``target_hidden_size``,
    ``norm_before_residual: false`` (read by ``DeepseekV2Eagle3DecoderLayer``), the EAGLE-3.1 keys, and the
    top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM ids = HF indices). ``model_type`` is ``deepseek_v2`` (the
    same fields, :data:`MLA_MODEL_TYPE`): vLLM 0.32 / 0.34 ``SpeculativeConfig.hf_config_override`` turns a
    ``deepseek_v3`` draft into ``DeepSeekMTPModel``, which ``method: eagle3`` then refuses as
    ``Eagle3DeepSeekMTPModel``."""
    return {
        "architectures": [MLA_ARCH],
        **ds,
        "model_type": MLA_MODEL_TYPE,
        "draft_vocab_size": a.draft_vocab_size,
        "target_hidden_size": a.target_hidden_size,
        "norm_before_residual": False,
        **variant_keys(a.variant),
        "eagle_aux_hidden_state_layer_ids": ids,
        CONFIG_BLOCK: block,
    }


def is_format(cfg: dict) -> bool:
    """Whether a ``config.json`` dict is in this format (``speculators_model_type: eagle3`` or :data:`ARCH`, or
    :data:`eagle3.export.common.MLA_ARCH` with top-level ``eagle_aux_hidden_state_layer_ids``)."""
    archs = cfg.get("architectures") or []
    if MLA_ARCH in archs:
        return "eagle_aux_hidden_state_layer_ids" in cfg
    return cfg.get("speculators_model_type") == "eagle3" or ARCH in archs


class _Keys(BaseModel):
    """The speculators keys :func:`layer_source` reads (others pass): ``norm_before_residual`` false (vLLM's default
    when absent is true: hidden_norm before the residual, not implemented here)."""

    model_config = ConfigDict(extra="allow")

    norm_before_residual: Literal[False]


class _LlamaKeys(_Keys):
    transformer_layer_config: dict


def layer_source(cfg: dict, path: Path) -> dict:
    """The LlamaConfig fields of the drafter's decoder layer (``transformer_layer_config``; an MLA folder's own
    keys) with ``draft_vocab_size`` and ``target_hidden_size``, from a ``config.json`` of this format.

    Raises:
        UserError: ``norm_before_residual`` not false, or no ``transformer_layer_config`` object (naming the file
            and key).
    """
    mla = MLA_ARCH in (cfg.get("architectures") or [])
    fix = "this drafter is written with norm_before_residual: false (04_train.py --export-only --engine vllm)"
    validated(_Keys if mla else _LlamaKeys, cfg, str(path), fix)
    layer = cfg if mla else cfg["transformer_layer_config"]
    src = dict(layer)
    src["draft_vocab_size"] = cfg.get("draft_vocab_size")
    src["target_hidden_size"] = cfg.get("target_hidden_size") or layer.get("hidden_size")
    return src


def layer_ids(cfg: dict) -> Optional[object]:
    """The aux-layer ids vLLM reads from ``config.json`` (unchecked; ``None`` when not stated)."""
    return cfg.get("eagle_aux_hidden_state_layer_ids")
