"""The ``drafter`` section: the drafter's decoder-layer shape, attention and variant."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from eagle3.settings.types import Section


class MLAConfig(Section):
    """``drafter.mla``: the MLA layer's sizes (``drafter.attention: mla``; DeepSeek-V3 config names). ``null`` = the
    verifier's when it is an MLA model (DeepSeek-V3, Kimi-K2/K2.5); a verifier without MLA needs every size set
    (``q_lora_rank`` null there = a plain q_proj; SGLang needs it set). ``python -m eagle3.drafter.mla`` prints the
    parameter counts of both layers for a size choice."""

    q_lora_rank: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="query down-projection rank (null: the verifier's, else a plain q_proj)",
    )
    kv_lora_rank: Optional[StrictInt] = Field(None, ge=1, description="latent K/V rank")
    qk_nope_head_dim: Optional[StrictInt] = Field(
        None, ge=1, description="per-head key/query width without rotary"
    )
    qk_rope_head_dim: Optional[StrictInt] = Field(
        None, ge=2, description="per-head rotary width (even)"
    )
    v_head_dim: Optional[StrictInt] = Field(None, ge=1, description="per-head value width")
    rope_interleave: Optional[StrictBool] = Field(
        None,
        description="rotary on interleaved pairs (DeepSeek; the only layout vLLM 0.34's MLA draft serves); null: the "
        "verifier's, else true",
    )


class DrafterConfig(Section):
    """The drafter's decoder layer. ``null`` = copy from the verifier's text config."""

    hidden_size: Optional[StrictInt] = Field(None, ge=1)
    num_attention_heads: Optional[StrictInt] = Field(None, ge=1)
    num_key_value_heads: Optional[StrictInt] = Field(None, ge=1)
    head_dim: Optional[StrictInt] = Field(None, ge=1)
    intermediate_size: Optional[StrictInt] = Field(None, ge=1)
    rms_norm_eps: Optional[StrictFloat] = Field(None, gt=0)
    rope_theta: Optional[StrictFloat] = Field(None, gt=0)
    max_position_embeddings: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="the draft config's context; below the verifier's, 04 refuses at its start for "
        "export.engine sglang (SGLang will not start such a draft) and warns for vllm. No weight depends on it: "
        "--export-only re-exports with the value set here (null = the verifier's)",
    )
    variant: Literal["eagle3", "eagle3.1"] = Field(
        "eagle3",
        description="drafter architecture: eagle3 (the paper) or eagle3.1 (an RMSNorm on each aux hidden state "
        "before fc, and the post-norm output fed back between steps; speculators PR 610/670, TorchSpec PR 97; served by "
        "SGLang 0.5.23 and vLLM 0.33 through the config keys fc_norm / norm_output). eagle3/drafter/model.py",
    )
    attention: Literal["llama", "mla"] = Field(
        "llama",
        description="the decoder layer's attention: llama (GQA, q/k/v/o projections) or mla (DeepSeek-V3 multi-head "
        "latent attention, sizes in drafter.mla; served by SGLang 0.5.23 kimi_k25_eagle3.py and vLLM 0.34 "
        "deepseek_eagle3.py as Eagle3DeepseekV2ForCausalLM; one layer only). eagle3/drafter/model.py",
    )
    mla: MLAConfig = Field(default_factory=MLAConfig)
    num_layers: StrictInt = Field(
        1,
        ge=1,
        description="decoder layers of the drafter (exported as num_hidden_layers). Layer 0 is EAGLE-3's "
        "(q/k/v read cat(input_layernorm(embed), hidden_norm(hidden)), 2H wide); layers 1.. are plain pre-norm Llama "
        "layers (q/k/v read norm(previous layer output), H wide) in one residual stream, the final norm after the "
        "last, all at the same rotary positions, as SGLang 0.5.23 and vLLM 0.33 llama_eagle3.py build them. The "
        "engines name that pre-attention norm differently (SGLang layers.i.hidden_norm, vLLM layers.i.input_layernorm): "
        "exports write it under both names. 1 = the drafter as before, bit for bit",
    )
