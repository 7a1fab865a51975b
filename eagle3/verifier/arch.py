"""Every per-architecture fact of a verifier, in one place.

- Config layout: multimodal wrappers (Kimi-K2.5 ``KimiK25ForConditionalGeneration``, Llava-style) keep the
  language model's settings in a nested ``text_config`` (:func:`text_config`).
- Attention widths: MLA models (DeepSeek-V3, Kimi-K2/K2.5: ``kv_lora_rank`` set) expand their latent into keys
  of ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim`` (:func:`kv_head_dims`); the drafter,
  a Llama-style layer, takes ``hidden_size // heads`` as its head dim (:func:`drafter_head_dim`); an MLA drafter
  (``drafter.attention: mla``) copies the latent sizes, rope layout and RoPE scaling (:func:`mla_sizes`,
  :func:`mla_rope_scaling`).
- Layer-id family: the DeepSeek V2/V3 family that SGLang serves with ``deepseek_v2.py`` and its own aux-layer
  rule (:data:`DEEPSEEK_ARCHS`, :func:`is_deepseek_family`; the rule itself is in :mod:`eagle3.engines.layers`).
- Final norm and head: module names of the final norm (:data:`FINAL_NORM_NAMES`, :func:`find_final_norm`,
  :func:`decoder_norm`), checkpoint tensor names of the embedding, final norm and LM head under the wrapper
  prefixes (:data:`WRAPPER_PREFIXES`, :data:`EMBED_TENSORS`, :data:`NORM_TENSORS`, :data:`LM_HEAD_TENSORS`).
- Last hidden state: whether ``hidden_states[-1]`` is post- or pre-final-norm (:func:`last_hidden_state_kind`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from eagle3.errors import UserError

log = logging.getLogger(__name__)


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` of a ``config.json`` dict or ``getattr(cfg, key)`` of a ``PretrainedConfig``; ``default``
    when absent."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def text_config(hf_config: Any) -> Any:
    """The language model's config: the nested ``text_config`` of a multimodal wrapper (Kimi-K2.5), else
    ``hf_config``; a nested dict (a plain ``PretrainedConfig`` built from raw JSON keeps one) is returned as a dict.

    Args:
        hf_config: ``transformers.PretrainedConfig`` or a ``config.json`` dict.
    """
    sub = cfg_get(hf_config, "text_config")
    return sub if sub is not None else hf_config


# ---- attention widths ----------------------------------------------------------------------------
def kv_head_dims(cfg) -> tuple[int, int]:
    """Per-head widths ``(key, value)`` of the K/V tensors a verifier's attention modules hand to the attention
    function. Standard attention: ``head_dim`` (else ``hidden_size // heads``) for both. MLA (DeepSeek-V3, Kimi-K2.5:
    ``kv_lora_rank`` set) expands its latent into keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of
    ``v_head_dim`` (Kimi: 192 and 128), while its config's ``head_dim`` is the rope part alone (64)."""
    if (
        getattr(cfg, "kv_lora_rank", None) is not None
        and getattr(cfg, "qk_rope_head_dim", None) is not None
    ):
        dk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        return dk, int(getattr(cfg, "v_head_dim", None) or dk)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return d, d


def drafter_head_dim(tc: Any, hidden_size: int, heads: int) -> int:
    """The head dim a Llama-style drafter takes from a text config ``tc``: its ``head_dim`` field for standard
    attention; ``hidden_size // heads`` when the field is absent or the model is MLA (``kv_lora_rank`` set, whose
    ``head_dim`` is the rope part alone)."""
    head_dim = cfg_get(tc, "head_dim")
    if head_dim is None or cfg_get(tc, "kv_lora_rank") is not None:
        head_dim = hidden_size // heads
    return int(head_dim)


MLA_SIZE_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
"""The config keys of an MLA model's latent sizes (DeepSeek-V2/V3, Kimi-K2/K2.5 ``config.json``)."""


def mla_sizes(tc: Any) -> Optional[dict]:
    """The MLA sizes of a text config ``tc`` (:data:`MLA_SIZE_KEYS` plus ``rope_interleave``), or None when the
    model is not MLA (no ``kv_lora_rank``). ``q_lora_rank`` may be None (DeepSeek-V2-Lite: a plain q_proj);
    ``rope_interleave`` absent = true (DeepSeek-V3 / Kimi checkpoints lay rotary dims out in interleaved pairs:
    HF ``DeepseekV3Config`` default, SGLang ``deepseek_v2.py`` ``getattr(config, "rope_interleave", True)``)."""
    if cfg_get(tc, "kv_lora_rank") is None:
        return None
    out = {k: cfg_get(tc, k) for k in MLA_SIZE_KEYS}
    out["rope_interleave"] = bool(cfg_get(tc, "rope_interleave", True))
    return out


def mla_rope_scaling(tc: Any) -> Optional[dict]:
    """An MLA verifier's RoPE scaling (``rope_scaling``, or transformers 5 ``rope_parameters`` without
    ``rope_theta``; None for default rope): Kimi-K2/K2.5 and DeepSeek-V3 use YaRN (factor 32..64,
    ``original_max_position_embeddings`` 4096, ``mscale`` = ``mscale_all_dim``)."""
    rs = cfg_get(tc, "rope_scaling") or cfg_get(tc, "rope_parameters") or None
    if not rs:
        return None
    rs = {k: v for k, v in dict(rs).items() if k != "rope_theta"}
    kind = rs.get("rope_type", rs.get("type", "default"))
    return None if kind == "default" else rs


# ---- layer-id family -----------------------------------------------------------------------------
DEEPSEEK_ARCHS = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "KimiK25ForConditionalGeneration",
        "KimiK2ForCausalLM",
        "Glm4MoeLiteForCausalLM",  # SGLang glm4_moe_lite.py: its own copy of the DeepSeek rule
        "MistralLarge3ForCausalLM",  # subclass of DeepseekV3ForCausalLM in SGLang
        "GlmMoeDsaForCausalLM",  # subclass of DeepseekV2ForCausalLM in SGLang
        "deepseek_v2",
        "deepseek_v3",
        "kimi_k2",
        "kimi_k25",
    }
)


def is_deepseek_family(architecture: str) -> bool:
    """True for architectures (or ``model_type`` strings) that SGLang serves with ``deepseek_v2.py``."""
    return architecture in DEEPSEEK_ARCHS


# ---- final norm and head -------------------------------------------------------------------------
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f")
"""Attribute names of a decoder's final norm (HF Llama/DeepSeek ``norm``, Phi/GPT-NeoX ``final_layernorm``,
GPT-2 ``ln_f``)."""

WRAPPER_PREFIXES = ("", "language_model.", "model.language_model.")
"""Checkpoint tensor-name prefixes tried in order: a plain causal LM, Kimi-K2.5's ``language_model.``,
transformers-5 style wrappers' ``model.language_model.``."""
EMBED_TENSORS = ("model.embed_tokens.weight", "embed_tokens.weight")
NORM_TENSORS = ("model.norm.weight", "norm.weight")
LM_HEAD_TENSORS = ("lm_head.weight",)


def find_final_norm(hf_model: torch.nn.Module) -> torch.nn.Module:
    """The verifier's final norm module: a :data:`FINAL_NORM_NAMES` attribute with a weight on the decoder body,
    ``model``, ``language_model`` or the model itself (in that order); else, for multimodal wrappers, the first
    module so named outside the layers.

    Raises:
        UserError: no such module.
    """
    candidates = []
    dec = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else None
    for base in (
        dec,
        getattr(hf_model, "model", None),
        getattr(hf_model, "language_model", None),
        hf_model,
    ):
        if base is None:
            continue
        for name in FINAL_NORM_NAMES:
            m = getattr(base, name, None)
            if isinstance(m, torch.nn.Module) and getattr(m, "weight", None) is not None:
                candidates.append(m)
    if not candidates:
        for name, m in hf_model.named_modules():
            if name.split(".")[-1] in FINAL_NORM_NAMES and ".layers." not in name:
                candidates.append(m)
    if not candidates:
        raise UserError(
            f"verifier {type(hf_model).__name__}: final norm not found (looked for 'norm', 'final_layernorm', 'ln_f')"
        )
    return candidates[0]


def decoder_norm(model) -> Optional[torch.nn.Module]:
    """The ``norm`` module of the decoder body (``get_decoder()``) or of ``model.model``, else None: the norm the
    post/pre-norm probe (:func:`last_hidden_state_kind`) applies."""
    decoder = None
    with contextlib.suppress(AttributeError, NotImplementedError):  # no decoder body
        decoder = model.get_decoder()
    for cand in (decoder, getattr(model, "model", None)):
        norm = getattr(cand, "norm", None) if cand is not None else None
        if isinstance(norm, torch.nn.Module):
            return norm
    return None


# ---- post/pre-norm probe -------------------------------------------------------------------------
def last_hidden_state_kind(model, last: torch.Tensor, logits: torch.Tensor) -> str:
    """``"post_norm"`` if ``lm_head(last)`` reproduces ``logits``, ``"pre_norm"`` if ``lm_head(norm(last))`` does.

    Args:
        model: the verifier (``get_output_embeddings()``; its :func:`decoder_norm`).
        last: ``hidden_states[-1]`` of a probe forward ``[1, n, H]``.
        logits: that forward's logits ``[1, n, V]``.

    Returns:
        ``"pre_norm"`` also when neither matches and no final norm is found (a warning says so).

    Raises:
        RuntimeError: neither matches while a final norm exists (logit scaling or soft-capping).
    """
    logits = logits.float()  # [1, n, V]
    head = model.get_output_embeddings()

    def close(h: torch.Tensor) -> bool:
        pred = head(h).float()  # [1, n, V]
        if pred.shape != logits.shape:
            return False
        err = (pred - logits).abs().max().item()
        return err <= 1e-2 * logits.abs().max().item() + 1e-4

    if close(last):
        return "post_norm"
    norm = decoder_norm(model)
    if norm is None:
        log.warning(
            "lm_head(hidden_states[-1]) != logits and no final norm found; recording pre_norm"
        )
        return "pre_norm"
    if close(norm(last)):
        return "pre_norm"
    raise RuntimeError(
        "cannot tell whether the verifier's hidden_states[-1] is post- or pre-norm: lm_head(h) matches the "
        "logits neither with nor without the final norm (logit scaling/soft-capping are not supported)"
    )
