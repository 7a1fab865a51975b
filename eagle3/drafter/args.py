"""The drafter's shape: :class:`DrafterArgs` (layer sizes, variant, attention, MLA sizes), its JSON round trip
(checkpoints and exports) and its derivation from a verifier's HF config. Variants and attention kinds:
:mod:`eagle3.drafter.model`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, PositiveInt, field_validator

from eagle3.drafter.attention import rope_inv_freq
from eagle3.errors import UserError, validated

VARIANTS = ("eagle3", "eagle3.1")
"""Drafter architectures (module docstring): ``eagle3`` (paper) and ``eagle3.1`` (fc_norm + norm_output)."""
ATTENTIONS = ("llama", "mla")
"""Decoder-layer attention (module docstring, "Attention"): ``llama`` (GQA, the default) or ``mla`` (DeepSeek-V3
multi-head latent attention)."""
MLA_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
)
"""The keys of ``DrafterArgs.mla`` (DeepSeek-V3 config names; ``q_lora_rank`` None = a plain ``q_proj``)."""


class MLASizes(BaseModel):
    """``DrafterArgs.mla`` of an MLA drafter: exactly the keys of :data:`MLA_FIELDS`, sizes strict integers >= 1
    (``q_lora_rank`` None or absent = a plain ``q_proj``), ``qk_rope_head_dim`` even (rotary pairs)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    q_lora_rank: Optional[PositiveInt] = None
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt
    rope_interleave: bool

    @field_validator("qk_rope_head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"must be even for rotary embeddings, got {v}")
        return v


class _MLABlock(BaseModel):
    mla: MLASizes


OPTIONAL_FIELDS = ("rope_scaling", "variant", "num_layers", "attention", "mla")
""":class:`DrafterArgs` fields with a default (absent in checkpoints/exports written before they existed)."""


@dataclass
class DrafterArgs:
    """Shape of the drafter (a LlamaConfig subset plus the EAGLE-3 fields).

    ``hidden_size`` H must equal the verifier's embedding width (the frozen ``embed_tokens`` is the
    verifier's); ``target_hidden_size`` Ht is the width of each aux state (``fc``: ``3Ht -> H``).
    ``rope_scaling``: HF dict (``rope_type`` default/linear/llama3) or ``None``.
    ``variant``: one of :data:`VARIANTS` (module docstring); absent in checkpoints and exports
    written before it existed, which are ``eagle3``.
    ``num_layers``: decoder layers (module docstring, "Depth"); :meth:`to_json` leaves it out when 1, so the
    one-layer drafter's checkpoints, exports and fingerprints are what they were before it existed.
    ``attention``: one of :data:`ATTENTIONS`; ``mla``: for ``mla`` the sizes (:data:`MLA_FIELDS`), else None. For an
    MLA drafter ``num_key_value_heads`` = heads and ``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim``
    (:func:`eagle3.drafter.mla.mla_shape_fields`); ``rope_scaling`` may be YaRN. :meth:`to_json` leaves both out for
    ``llama``.
    """

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab_size: int
    target_vocab_size: int
    target_hidden_size: int
    rope_scaling: Optional[dict] = None
    variant: str = "eagle3"
    num_layers: int = 1
    attention: str = "llama"
    mla: Optional[dict] = None

    def __post_init__(self):
        for key, allowed in (("variant", VARIANTS), ("attention", ATTENTIONS)):
            if getattr(self, key) not in allowed:
                raise UserError(
                    f"drafter field '{key}' must be one of {', '.join(allowed)}, got {getattr(self, key)!r}"
                )
        for f in fields(self):
            if f.name in OPTIONAL_FIELDS and f.name != "num_layers":
                continue
            v, kind = getattr(self, f.name), int if f.name == "num_layers" else (int, float)
            if not isinstance(v, kind) or isinstance(v, bool) or v <= 0:
                what = "an integer >= 1" if kind is int else "a positive number"
                raise UserError(f"drafter field '{f.name}' must be {what}, got {v!r}")
        self._check_mla()
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"drafter field 'num_key_value_heads' ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise UserError(
                f"drafter field 'head_dim' must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.draft_vocab_size > self.target_vocab_size:
            raise UserError(
                f"drafter field 'draft_vocab_size' ({self.draft_vocab_size}) exceeds target_vocab_size ({self.target_vocab_size})"
            )
        rope_inv_freq(
            self.rope_head_dim, self.rope_theta, self.rope_scaling, allow_yarn=self.is_mla
        )  # validates rope_scaling

    def _check_mla(self) -> None:
        """``mla`` is set (all of :data:`MLA_FIELDS`) iff ``attention`` is ``mla``."""
        if not self.is_mla:
            if self.mla is not None:
                raise UserError(
                    "drafter field 'mla' is set but attention is llama; set drafter.attention: mla"
                )
            return
        validated(
            _MLABlock,
            {"mla": self.mla},
            "drafter",
            f"set drafter.mla ({', '.join(MLA_FIELDS)}) for attention mla",
        )
        if self.num_layers != 1:
            raise UserError(
                f"drafter.num_layers is {self.num_layers} with attention mla; the engines' MLA draft classes "
                f"(SGLang 0.5.23 kimi_k25_eagle3.py) build one layer: set drafter.num_layers: 1"
            )

    @property
    def is_mla(self) -> bool:
        """Whether the decoder layer's attention is MLA (``attention == "mla"``)."""
        return self.attention == "mla"

    @property
    def rope_head_dim(self) -> int:
        """Width of the rotary part of a query/key head: ``head_dim`` (llama), ``mla.qk_rope_head_dim`` (mla)."""
        return int(self.mla["qk_rope_head_dim"]) if self.is_mla else self.head_dim

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of all fields (``num_layers`` only when it is not 1; ``attention`` and ``mla`` only
        for an MLA drafter)."""
        d = asdict(self)
        if d["num_layers"] == 1:
            del d["num_layers"]
        if not self.is_mla:
            del d["attention"], d["mla"]
        return d

    @classmethod
    def from_json(cls, obj: dict | str, source: str = "drafter args") -> "DrafterArgs":
        """Build from :meth:`to_json` output (a dict or its JSON text).

        Raises:
            UserError: a field is missing or unknown, naming it and ``source``.
        """
        if isinstance(obj, str):
            obj = json.loads(obj)
        unknown = sorted(set(obj) - {f.name for f in fields(cls)})
        missing = [f.name for f in fields(cls) if f.name not in {*obj, *OPTIONAL_FIELDS}]
        if unknown or missing:
            fault = (
                f"unknown drafter field '{unknown[0]}'"
                if unknown
                else f"missing drafter field '{missing[0]}'"
            )
            raise UserError(f"{source}: {fault}")
        return cls(**obj)

    @property
    def fc_norm(self) -> bool:
        """EAGLE-3.1: one RMSNorm per aux state before ``fc`` (engine config key ``fc_norm``)."""
        return self.variant == "eagle3.1"

    @property
    def norm_output(self) -> bool:
        """EAGLE-3.1: the step output is the post-final-norm state (engine config key ``norm_output``)."""
        return self.variant == "eagle3.1"

    @classmethod
    def from_hf_config(cls, cfg: Any, draft_vocab_size: int, **overrides) -> "DrafterArgs":
        """Copy the decoder-layer shape from a verifier (text) config; ``overrides`` that are not None win.

        Reads ``hidden_size, num_attention_heads, num_key_value_heads (default: heads), head_dim
        (default: hidden/heads), intermediate_size, rms_norm_eps, rope_theta`` (or transformers 5
        ``rope_parameters["rope_theta"]``), ``max_position_embeddings, vocab_size``. The verifier's
        rope scaling is copied only if it is default/linear/llama3 (else default rope, e.g. for
        YaRN verifiers such as Kimi; the export states ``rope_scaling: null`` so serving agrees).
        """
        get = (
            (lambda k, d=None: cfg.get(k, d))
            if isinstance(cfg, dict)
            else (lambda k, d=None: getattr(cfg, k, d))
        )
        rp = get("rope_parameters") or {}
        rs = copied_rope_scaling(cfg)
        H = get("hidden_size")
        heads = get("num_attention_heads")
        vals = dict(
            hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or (H // heads if H and heads else None),
            intermediate_size=get("intermediate_size"),
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=get("rope_theta") or rp.get("rope_theta", 10000.0),
            max_position_embeddings=get("max_position_embeddings", 4096),
            draft_vocab_size=draft_vocab_size,
            target_vocab_size=get("vocab_size"),
            target_hidden_size=H,
            rope_scaling=rs,
        )
        vals.update({k: v for k, v in overrides.items() if v is not None})
        missing = [k for k, v in vals.items() if v is None and k not in OPTIONAL_FIELDS]
        if missing:
            raise UserError(
                f"verifier config: cannot derive drafter field '{missing[0]}'; set drafter.{missing[0]}"
            )
        return cls(**vals)


def copied_rope_scaling(cfg: Any) -> Optional[dict]:
    """The verifier's rope scaling a drafter copies (:meth:`DrafterArgs.from_hf_config`): ``rope_scaling``, or a
    non-default transformers 5 ``rope_parameters``, when its type is ``linear`` or ``llama3``; else None (default
    rope, e.g. for YaRN verifiers such as Kimi). ``cfg``: a (text) config object or ``config.json`` dict."""
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    rp = get("rope_parameters") or {}
    rs = get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    if rs and rs.get("rope_type", rs.get("type")) not in ("linear", "llama3"):
        return None  # default rope (transformers 5 reports it as a dict), or an unsupported type
    return dict(rs) if rs else None
