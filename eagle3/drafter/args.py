"""The drafter's shape: :class:`DrafterArgs` (layer sizes, variant, attention, MLA sizes), its JSON round trip
(checkpoints and exports) and its derivation from a verifier's HF config. Variants and attention kinds:
:mod:`eagle3.drafter.model`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated, Any, Literal, Optional

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs
from typing_extensions import NotRequired, TypedDict

from eagle3.drafter.attention import rope_inv_freq
from eagle3.errors import refusal

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

PositiveInt = Annotated[StrictInt, Field(gt=0)]
"""An integer >= 1 (``bool``, ``float`` and ``str`` refused)."""


def _positive(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"must be a positive number, got {v!r}")
    return v


Positive = Annotated[Any, AfterValidator(_positive)]
"""A number > 0, kept as given (an ``int`` stays an ``int``: the JSON round trip is unchanged)."""


class MLASizes(TypedDict):
    """``DrafterArgs.mla`` of an MLA drafter: exactly the keys of :data:`MLA_FIELDS`, sizes strict integers >= 1
    (``q_lora_rank`` None or absent = a plain ``q_proj``), ``qk_rope_head_dim`` even (rotary pairs)."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]

    q_lora_rank: NotRequired[Optional[PositiveInt]]
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: Annotated[PositiveInt, Field(multiple_of=2)]
    v_head_dim: PositiveInt
    rope_interleave: bool


_FIXES = {"mla": f"set drafter.mla ({', '.join(MLA_FIELDS)}) for attention mla"}


@dataclass(config=ConfigDict(extra="forbid"))
class DrafterArgs:
    """Shape of the drafter (a LlamaConfig subset plus the EAGLE-3 fields), validated on construction: a bad field
    raises ``UserError`` ``drafter: field '<name>' <what>; <fix>`` (:func:`eagle3.errors.refusal`).

    ``hidden_size`` H must equal the verifier's embedding width (the frozen ``embed_tokens`` is the
    verifier's); ``target_hidden_size`` Ht is the width of each aux state (``fc``: ``3Ht -> H``).
    ``rope_scaling``: HF dict (``rope_type`` default/linear/llama3) or ``None``.
    ``variant``: one of :data:`VARIANTS` (module docstring); absent in checkpoints and exports
    written before it existed, which are ``eagle3``.
    ``num_layers``: decoder layers (module docstring, "Depth"); :meth:`to_json` leaves it out when 1, so the
    one-layer drafter's checkpoints, exports and fingerprints are what they were before it existed.
    ``attention``: one of :data:`ATTENTIONS`; ``mla``: for ``mla`` the sizes (:class:`MLASizes`), else None. For an
    MLA drafter ``num_key_value_heads`` = heads and ``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim``
    (:func:`eagle3.drafter.mla.mla_shape_fields`); ``rope_scaling`` may be YaRN. :meth:`to_json` leaves both out for
    ``llama``.
    """

    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: Annotated[PositiveInt, Field(multiple_of=2)]  # rotary pairs
    intermediate_size: PositiveInt
    rms_norm_eps: Positive
    rope_theta: Positive
    max_position_embeddings: PositiveInt
    draft_vocab_size: PositiveInt
    target_vocab_size: PositiveInt
    target_hidden_size: PositiveInt
    rope_scaling: Optional[dict] = None
    variant: Literal[VARIANTS] = "eagle3"
    num_layers: PositiveInt = 1
    attention: Literal[ATTENTIONS] = "llama"
    mla: Optional[MLASizes] = Field(default=None, validate_default=True)

    @model_validator(mode="wrap")
    @classmethod
    def _one_line(cls, values, handler, info):
        """Any fault as one ``UserError`` line (``info.context["where"]`` names the source, default ``drafter``)."""
        try:
            return handler(values)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            field = str(err["loc"][0]) if err["loc"] else ""
            own = err["type"] == "unexpected_keyword_argument" or (
                err["type"] == "value_error" and field == "mla"
            )
            ctx = info.context or {}
            fix = ctx.get("fix") or _FIXES.get(field, f"set drafter.{field}")
            raise refusal(e, ctx.get("where", "drafter"), "" if own else fix) from None

    @field_validator("num_key_value_heads")
    @classmethod
    def _divides(cls, v: int, info) -> int:
        heads = info.data.get("num_attention_heads")
        if heads and heads % v:
            raise ValueError(f"({v}) must divide num_attention_heads ({heads})")
        return v

    @field_validator("target_vocab_size")
    @classmethod
    def _holds_draft(cls, v: int, info) -> int:
        draft = info.data.get("draft_vocab_size")
        if draft and draft > v:
            raise ValueError(f"({v}) is smaller than draft_vocab_size ({draft})")
        return v

    @field_validator("mla", mode="wrap")
    @classmethod
    def _mla_iff_attention_mla(cls, v, handler, info):
        """``mla`` is set iff ``attention`` is ``mla``; an MLA drafter has one layer. Returns ``v`` as given (key
        order kept)."""
        if info.data.get("attention") != "mla":
            if v is not None:
                raise ValueError("is set but attention is llama; set drafter.attention: mla")
            return v
        if v is None:
            raise ValueError(f"is required for attention mla; {_FIXES['mla']}")
        if info.data.get("num_layers", 1) != 1:
            raise ValueError(
                f"is for one layer, but num_layers is {info.data['num_layers']} with attention mla; the engines' "
                f"MLA draft classes (SGLang 0.5.23 kimi_k25_eagle3.py) build one layer: set drafter.num_layers: 1"
            )
        handler(v)
        return v

    def __post_init__(self):
        rope_inv_freq(
            self.rope_head_dim, self.rope_theta, self.rope_scaling, allow_yarn=self.is_mla
        )  # validates rope_scaling

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
    def from_json(
        cls, obj: dict | str, source: str = "drafter args", fix: Optional[str] = None
    ) -> "DrafterArgs":
        """Build from :meth:`to_json` output (a dict or its JSON text); ``fix`` replaces the refusal's advice
        (default ``set drafter.<field>``).

        Raises:
            UserError: a field missing, unknown or invalid, naming it and ``source``.
        """
        if isinstance(obj, str):
            obj = json.loads(obj)
        return cls.__pydantic_validator__.validate_python(
            ArgsKwargs((), obj), context={"where": source, "fix": fix}
        )

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
        return cls.from_json(
            vals, source="verifier config"
        )  # a size it lacks: "... got None; set drafter.<field>"


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
