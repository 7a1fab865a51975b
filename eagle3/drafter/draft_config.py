"""The served draft's HF config (a LlamaConfig of ``num_layers`` layers, or for an MLA drafter a DeepseekV3Config of
one layer: :func:`draft_layer_config`), written by the export
(:mod:`eagle3.export.writer`); the engines' context-length rule reads it (:mod:`eagle3.engines.context`).
"""

from __future__ import annotations

import torch

from eagle3.drafter.args import DrafterArgs

DEFAULT_EXPORT_DTYPE = torch.bfloat16
#: An export folder's own metadata file (HF aux layers, engine ids, verifier, drafter_args, trained_from): written by
#: :mod:`eagle3.export.writer`, read back by 04 (``train.init_from``, the export record) and 05.
EXPORT_META_FILE = "eagle3_train.json"


def untrained_positions(ttt_length: int, steps: int, verb: bool = False) -> str:
    """``position 3`` / ``positions 3..5`` (with ``verb``: ``position 3 was`` / ``positions 3..5 were``): the draft
    positions past ``ttt_length`` (the TTT steps the drafter trained, ``train.ttt_length``) that a chain of ``steps``
    drafts, for the warnings of 05 and the vLLM export (positions counted from 1, as in the per-position
    acceptance). Needs ``steps > ttt_length``."""
    first = int(ttt_length) + 1
    if first == int(steps):
        return f"position {first}" + (" was" if verb else "")
    return f"positions {first}..{int(steps)}" + (" were" if verb else "")


def draft_layer_config(a: DrafterArgs, dtype: torch.dtype) -> dict:
    """The decoder layer's HF config fields: :func:`deepseek_config` for an MLA drafter, else :func:`llama_config`."""
    return deepseek_config(a, dtype) if a.is_mla else llama_config(a, dtype)


def deepseek_config(a: DrafterArgs, dtype: torch.dtype) -> dict:
    """DeepseekV3Config fields of an MLA drafter (one layer; ``vocab_size`` = verifier vocab, for embeddings): what
    SGLang 0.5.23 ``kimi_k25_eagle3.py`` / vLLM 0.34 ``deepseek_eagle3.py`` read (``q_lora_rank``,
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``rope_interleave``,
    ``rope_theta`` / ``rope_scaling``, ``hidden_act``, ``intermediate_size`` of the dense MLP). ``head_dim`` is the
    rotary part, as in DeepSeek-V3 configs."""
    m = a.mla
    return {
        "model_type": "deepseek_v3",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_attention_heads,
        "num_hidden_layers": 1,
        "q_lora_rank": m["q_lora_rank"],
        "kv_lora_rank": m["kv_lora_rank"],
        "qk_nope_head_dim": m["qk_nope_head_dim"],
        "qk_rope_head_dim": m["qk_rope_head_dim"],
        "v_head_dim": m["v_head_dim"],
        "head_dim": m["qk_rope_head_dim"],
        "rope_interleave": m["rope_interleave"],
        **_shared_fields(a),
        **_dtype_fields(dtype),
    }


def llama_config(a: DrafterArgs, dtype: torch.dtype) -> dict:
    """LlamaConfig fields of the drafter (``num_hidden_layers`` = ``num_layers``; ``vocab_size`` = verifier vocab, for
    embeddings)."""
    return {
        "model_type": "llama",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.num_layers,
        **_shared_fields(a),
        "mlp_bias": False,
        **_dtype_fields(dtype),
    }


def _shared_fields(a: DrafterArgs) -> dict:
    """The fields both layer configs write alike: activation, norm eps, RoPE, context, verifier vocab, no biases."""
    return {
        "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "vocab_size": a.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def _dtype_fields(dtype: torch.dtype) -> dict:
    """``torch_dtype`` (the key older transformers and the engines read) and ``dtype`` (transformers 5)."""
    name = str(dtype).replace("torch.", "")
    return {"torch_dtype": name, "dtype": name}
