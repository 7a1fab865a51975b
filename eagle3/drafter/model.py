"""The EAGLE-3 drafter: ``fc`` + Llama-style decoder layers (``midlayer``, then ``layers.{i}``) + ``norm`` + ``lm_head``.

Architecture (FIELD-NOTES section 1; EAGLE-3 paper arXiv 2503.01840; SGLang ``llama_eagle3.py``):
three verifier aux hidden states ``f_t = cat(aux1, aux2, aux3)`` ``[3Ht]`` are projected by ``fc``
(no bias) to ``H``. The decoder layer takes ``cat(input_layernorm(embed(x)), hidden_norm(h))``
(width ``2H``, embedding first) as the input of q/k/v, keeps the un-normalised ``h`` as the
residual (``norm_before_residual = false`` in vLLM speculators terms), then
``post_attention_layernorm`` + SwiGLU MLP with a second residual. Its output (pre final norm) is
both the next TTT step's / draft step's hidden input and, through ``norm`` and ``lm_head``
(``H -> draft_V``), the draft logits. ``embed_tokens`` is the verifier's, frozen.

Variants (:data:`VARIANTS`, ``DrafterArgs.variant``, config ``drafter.variant``):

- ``eagle3``: as above (EAGLE-3 paper; SafeAILab ``cnets.py``: ``lm_head`` reads the normed state,
  the next step the un-normed one).
- ``eagle3.1``: two changes, as speculators (PR 610 ``norm_output``, PR 670 ``fc_norm``), TorchSpec
  PR 97 ("post-norm architecture", arXiv 2605.09992) and the engines define them:
  ``fc_norm`` = one RMSNorm per aux state (``fc_norm.{0,1,2}``, width ``Ht``) applied to each chunk
  before ``fc``: ``fc(cat(n0(aux1), n1(aux2), n2(aux3)))``; ``norm_output`` = the step output is
  ``norm(midlayer(...))``, fed back as the next step's hidden AND read by ``lm_head`` directly (no
  second norm). SGLang 0.5.23 ``llama_eagle3.py`` (config keys ``fc_norm``, ``norm_output``) and
  vLLM 0.33 ``llama_eagle3.py`` + ``speculators/algos.py`` (the same keys) serve it; a single norm
  over the whole concatenation (speculators' ``norm_before_fc``) is not this variant.

Depth (``DrafterArgs.num_layers``, config ``drafter.num_layers``, default 1 = the drafter above): decoder layer 0 is
the layer described above (``midlayer``); layers ``i >= 1`` (:class:`Eagle3UpperLayer`, ``layers.{i}``) are plain
pre-norm Llama layers, as SGLang 0.5.23 / vLLM 0.33 ``llama_eagle3.py`` build ``num_hidden_layers > 1``: with
``h_0`` = layer 0's output, ``h_i = g + mlp_i(post_attention_layernorm_i(g))``, ``g = h_{i-1} +
attn_i(input_layernorm_i(h_{i-1}))`` (q/k/v ``H`` wide; no embedding). The engines write this with fused
``norm(x, residual)`` calls; it is the same residual stream. The last layer's output is what one layer's output was
(step output, final ``norm``). All layers use the step's rotary positions; each has its own keys/values (TTT: step
``i`` of layer ``l`` attends to layer ``l``'s keys of steps ``0..i``; decoding: ``DrafterCache.keys[l]``,
``StaticKVCache`` layer ``l``). SGLang calls ``input_layernorm_i`` ``layers.i.hidden_norm``, vLLM
``layers.i.input_layernorm``: the export writes it under both names (:mod:`eagle3.export.common`).

Attention (:data:`ATTENTIONS`, ``DrafterArgs.attention``, config ``drafter.attention``): ``llama`` = the GQA
``q/k/v/o_proj`` above (:class:`Eagle3Attention`); ``mla`` = DeepSeek-V3 multi-head latent attention
(:class:`Eagle3MLAAttention`, sizes in ``DrafterArgs.mla``) in the same layer, as SGLang 0.5.23
``kimi_k25_eagle3.py`` and vLLM 0.34 ``deepseek_eagle3.py`` build it (norms, concatenation, residuals and MLP as
above; one decoder layer). Its keys/values are per head after the up-projection, so TTT and the caches take them
unchanged, with value head dim ``v_head_dim``.

Parameter names equal the SGLang / SpecForge checkpoint keys (FIELD-NOTES section 4), so for one layer
``state_dict()`` minus ``embed_tokens.weight`` is the SGLang export (a deeper drafter adds ``layers.{i}.*`` and the
export adds ``layers.{i}.hidden_norm.weight``, a copy of ``layers.{i}.input_layernorm.weight``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.data.vocab import check_vocab_map
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.attention import (
    apply_rotary,
    cached_attention,
    mla_softmax_scale,
    rope_attention_factor,
    rope_inv_freq,
    rotary_cos_sin,
    ttt_attention,
)
from eagle3.drafter.caches import DrafterCache, StaticKVCache
from eagle3.errors import UserError
from eagle3.sdpa import resolve_attn_impl


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``weight * x / sqrt(mean(x^2) + eps)``, statistics in float32, output in input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., D]
        return self.weight * xf.to(dt)


class Eagle3Attention(nn.Module):
    """q/k/v projections from the ``in_mult * H`` wide input (``2H``: layer 0's concatenation; ``H``: layers >= 1),
    ``o_proj`` back to ``H`` (no biases)."""

    def __init__(self, a: DrafterArgs, in_mult: int = 2):
        super().__init__()
        self.nh, self.kvh, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(in_mult * a.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_mult * a.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(in_mult * a.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(self.hd)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[B, T, in_mult * H]`` -> q ``[B, nh, T, hd]``, k, v ``[B, kvh, T, hd]`` (rotary on q, k)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)  # [B, kvh, T, hd]
        v = self.v_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)  # [B, kvh, T, hd]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """``o`` ``[B, nh, T, hd]`` -> ``[B, T, H]``."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class Eagle3MLAAttention(nn.Module):
    """DeepSeek-V3 multi-head latent attention (non-absorbed form) from the ``in_mult * H`` wide input (no biases).

    With ``D = in_mult * H``, ``nh`` heads, ``dn = qk_nope_head_dim``, ``dr = qk_rope_head_dim``, ``dv =
    v_head_dim`` (DeepSeek-V3 ``modeling_deepseek.py`` / HF ``DeepseekV3Attention``; SGLang 0.5.23
    ``kimi_k25_eagle3.py`` and vLLM 0.34 ``deepseek_eagle3.py`` widen the down projections to ``2H``):

    - queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``D -> q_lora_rank -> nh*(dn+dr)``), or ``q_proj(x)`` when
      ``q_lora_rank`` is None; per head ``[q_nope (dn), q_pe (dr)]``;
    - ``kv_a_proj_with_mqa(x)`` (``D -> kv_lora_rank + dr``) = ``[c_kv, k_pe]``; ``kv_b_proj(kv_a_layernorm(c_kv))``
      (``kv_lora_rank -> nh*(dn+dv)``) = per head ``[k_nope, v]``; ``k_pe`` is shared by all heads;
    - rotary on ``q_pe`` / ``k_pe`` only: interleaved pairs ``(2k, 2k+1)`` when ``rope_interleave`` (DeepSeek, the
      engines' ``is_neox_style=False``), else the two halves (Llama); YaRN scales them by
      :func:`eagle3.drafter.attention.rope_attention_factor`;
    - keys ``[k_nope, k_pe]``, softmax scale :func:`eagle3.drafter.attention.mla_softmax_scale`, ``o_proj``:
      ``nh*dv -> H``.

    Keys and values are per head after the up-projection (``kvh = nh``), so the TTT attention and the caches take
    them as the Llama-style layer's, with value head dim ``dv``.
    """

    def __init__(self, a: DrafterArgs, in_mult: int = 2):
        super().__init__()
        m = a.mla
        self.nh = self.kvh = a.num_attention_heads
        self.dn, self.dr, self.dv = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        self.kv_rank = m["kv_lora_rank"]
        self.interleave = m["rope_interleave"]
        self.q_lora = m["q_lora_rank"]
        D, qk = in_mult * a.hidden_size, self.dn + self.dr
        if m["q_lora_rank"] is None:
            self.q_proj = nn.Linear(D, self.nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, m["q_lora_rank"], bias=False)
            self.q_a_layernorm = RMSNorm(m["q_lora_rank"], a.rms_norm_eps)
            self.q_b_proj = nn.Linear(m["q_lora_rank"], self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, a.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, a.hidden_size, bias=False)
        self.scale = mla_softmax_scale(qk, a.rope_scaling)
        self.rope_factor = rope_attention_factor(a.rope_scaling)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[B, heads, T, dr]``. Interleaved pairs are first gathered into halves (HF
        ``apply_rotary_pos_emb_interleave``): the same permutation of q and k leaves every score unchanged."""
        if self.interleave:
            B, h, T, d = x.shape
            x = x.view(B, h, T, d // 2, 2).transpose(-1, -2).reshape(B, h, T, d)
        x = apply_rotary(x, cos, sin)
        return x * self.rope_factor if self.rope_factor != 1.0 else x

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x`` ``[B, T, in_mult * H]``, cos/sin ``[B, 1, T, dr]`` -> q, k ``[B, nh, T, dn+dr]``, v ``[B, nh, T, dv]``."""
        B, T, _ = x.shape
        if self.q_lora is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.nh, self.dn + self.dr).transpose(1, 2)  # [B, nh, T, dn+dr]
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.kv_rank, self.dr], dim=-1
        )  # [B, T, r], [B, T, dr]
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(B, T, self.nh, self.dn + self.dv)
        k_nope, v = kv.transpose(1, 2).split(
            [self.dn, self.dv], dim=-1
        )  # [B, nh, T, dn], [B, nh, T, dv]
        q_pe = self._rope(q_pe, cos, sin)  # [B, nh, T, dr]
        k_pe = self._rope(k_pe[:, None], cos, sin).expand(B, self.nh, T, self.dr)  # [B, nh, T, dr]
        q = torch.cat([q_nope, q_pe], dim=-1)  # [B, nh, T, dn+dr]
        k = torch.cat([k_nope, k_pe], dim=-1)  # [B, nh, T, dn+dr]
        return q, k, v.contiguous()

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """``o`` ``[B, nh, T, dv]`` -> ``[B, T, H]``."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.dv))


def make_attention(a: DrafterArgs, in_mult: int = 2) -> nn.Module:
    """The decoder layer's attention for ``a.attention``: :class:`Eagle3Attention` or :class:`Eagle3MLAAttention`."""
    return Eagle3MLAAttention(a, in_mult) if a.is_mla else Eagle3Attention(a, in_mult)


class Eagle3MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The drafter's first decoder layer (layer 0; SGLang key prefix ``midlayer.``)."""

    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = make_attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = Eagle3MLP(a)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """emb, hidden ``[B, T, H]`` -> q, k, v of ``cat(input_layernorm(emb), hidden_norm(hidden))``."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        return self.self_attn.qkv(x, cos, sin)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, nh, T, hd]`` (MLA: ``v_head_dim``) + residual ``[B, T, H]`` -> layer output ``[B, T, H]``."""
        h = residual + self.self_attn.out(attn)  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


class Eagle3UpperLayer(Eagle3DecoderLayer):
    """A decoder layer ``i >= 1`` of a deeper drafter (key prefix ``layers.{i}.``): a plain pre-norm Llama layer.

    q/k/v read ``input_layernorm(h)`` (``H`` wide; no embedding) where ``h`` is the previous layer's output, which
    is also the residual. The engines name this norm differently: vLLM 0.33 ``layers.i.input_layernorm``, SGLang
    0.5.23 ``layers.i.hidden_norm`` (both fused with the residual add); here it is ``input_layernorm`` and the export
    writes it under both names (:mod:`eagle3.export.common`). No ``hidden_norm`` module of its own.
    """

    def __init__(self, a: DrafterArgs):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Eagle3Attention(a, in_mult=1)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = Eagle3MLP(a)

    def qkv(
        self,
        emb: Optional[torch.Tensor],
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ):
        """hidden ``[B, T, H]`` (``emb`` unused) -> q, k, v of ``input_layernorm(hidden)``."""
        return self.self_attn.qkv(self.input_layernorm(hidden), cos, sin)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter with SGLang-compatible parameter names.

    Submodules: ``embed_tokens`` (frozen, ``[target_V, H]``), ``fc`` (``3Ht -> H``), ``midlayer`` (decoder
    layer 0), ``layers`` (decoder layers ``1..num_layers-1``, keys ``layers.{i}.*``, :class:`Eagle3UpperLayer`;
    empty for the one-layer drafter), ``norm``, ``lm_head`` (``H -> draft_V``), and for ``eagle3.1`` ``fc_norm``
    (3 RMSNorms of width ``Ht``, keys ``fc_norm.{0,1,2}.weight`` as in SGLang/vLLM). "Step output" below is what a
    step feeds to the next one and to :meth:`compute_logits`: the last decoder layer's output (``eagle3``) or
    ``norm`` of it (``eagle3.1``, ``norm_output``). Buffers: ``d2t`` int64 ``[draft_V]`` (offset table,
    ``target = draft + d2t[draft]``), ``t2d`` bool ``[target_V]`` (FIELD-NOTES section 3).
    Initialisation: linear weights ``N(0, 0.02)`` (HF ``initializer_range``), norms 1, identity
    vocab map (``d2t = 0``, ``t2d[:draft_V] = True``) until :meth:`set_vocab_map`.
    """

    def __init__(self, args: DrafterArgs, embed_weight: Optional[torch.Tensor] = None):
        super().__init__()
        self.args = args
        a = args
        self.embed_tokens = nn.Embedding(a.target_vocab_size, a.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * a.target_hidden_size, a.hidden_size, bias=False)
        if a.fc_norm:
            self.fc_norm = nn.ModuleList(
                [RMSNorm(a.target_hidden_size, a.rms_norm_eps) for _ in range(3)]
            )
        self.midlayer = Eagle3DecoderLayer(a)
        # layers 1.. of a deeper drafter; keys "layers.{i}.*" (empty, so no keys, for the one-layer drafter)
        self.layers = nn.ModuleDict({str(i): Eagle3UpperLayer(a) for i in range(1, a.num_layers)})
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(a.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(a.target_vocab_size, dtype=torch.bool)
        t2d[: a.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, 0.02)
        if embed_weight is not None:
            self.load_embeddings(embed_weight)

    # ---- setup -------------------------------------------------------------------------------
    def load_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the verifier's input embedding ``[target_V, H]`` into the frozen ``embed_tokens``.

        Raises:
            UserError: shape mismatch.
        """
        want = tuple(self.embed_tokens.weight.shape)
        if tuple(weight.shape) != want:
            raise UserError(
                f"verifier embedding has shape {tuple(weight.shape)}, drafter expects {want}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_vocab_map(
        self,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
        where: str = "vocab map",
        draft_key: str = "drafter draft_vocab_size",
    ) -> None:
        """Install the draft vocab map (``vocab_map.pt`` of stage 03): ``d2t`` int64 ``[draft_V]``
        offsets, ``t2d`` bool ``[target_V]``.

        Args:
            where / draft_key: file and setting named in errors (see :func:`eagle3.data.vocab.check_vocab_map`).

        Raises:
            UserError: any :func:`eagle3.data.vocab.check_vocab_map` failure against this drafter's
                ``draft_vocab_size`` / ``target_vocab_size`` (wrong dtype or length, target ids
                out of range, duplicated or unsorted, ``t2d`` not the set ``d2t`` describes).
        """
        a = self.args
        check_vocab_map(
            d2t,
            t2d,
            where,
            target_vocab_size=a.target_vocab_size,
            draft_vocab_size=a.draft_vocab_size,
            draft_key=draft_key,
            target_source="the drafter's target_vocab_size",
        )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # ---- building blocks ---------------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc``: aux features ``[..., 3Ht]`` -> ``[..., H]`` (cast to ``fc``'s dtype unless autocast is on).

        ``eagle3.1``: each ``Ht`` chunk (aux1, aux2, aux3) is first normed by its own ``fc_norm[j]``
        (SGLang/vLLM ``combine_hidden_states``: ``chunk(3)``, norm, ``cat``)."""
        if not torch.is_autocast_enabled(aux.device.type):
            aux = aux.to(self.fc.weight.dtype)
        if self.args.fc_norm:
            chunks = aux.chunk(3, dim=-1)  # 3 x [..., Ht]
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)  # [..., 3Ht]
        return self.fc(aux)

    def step_output(self, h: torch.Tensor) -> torch.Tensor:
        """The step output of the last decoder layer's output ``h`` ``[..., H]``: ``h`` (``eagle3``) or ``norm(h)`` (``eagle3.1``)."""
        return self.norm(h) if self.args.norm_output else h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits of a step output ``[..., H]`` -> ``[..., draft_V]`` (draft-vocab ids):
        ``lm_head(norm(h))`` (``eagle3``), ``lm_head(h)`` (``eagle3.1``: ``h`` is already normed)."""
        return self.lm_head(h if self.args.norm_output else self.norm(h))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft ids (any shape, int64) to verifier ids: ``draft + d2t[draft]``."""
        return draft_ids + self.d2t[draft_ids]

    def decoder_layers(self) -> list[Eagle3DecoderLayer]:
        """The decoder layers in order: ``midlayer``, then ``layers["1"]``, ``layers["2"]`` ..."""
        return [self.midlayer] + [self.layers[str(i)] for i in range(1, self.args.num_layers)]

    def _inv_freq(self, device) -> torch.Tensor:
        a = self.args
        return rope_inv_freq(
            a.rope_head_dim, a.rope_theta, a.rope_scaling, device=device, allow_yarn=a.is_mla
        )  # [rope_head_dim/2]

    # ---- training: training-time test -------------------------------------------------------
    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        ttt_length: int,
        attn_impl: str = "auto",
    ) -> list[torch.Tensor]:
        """Unroll the drafter for ``ttt_length`` TTT steps over a whole sequence.

        Indexing (DESIGN.md "TTT indexing"): step ``i`` at position ``t`` embeds token
        ``x_{t+1+i}`` (id 0 beyond the sequence; such positions are never counted by the loss),
        takes hidden ``fc(f_t)`` for ``i = 0`` else the step-``(i-1)`` output at ``t``, uses rotary
        position ``t + i`` and attends to step-0 keys ``s <= t`` plus the keys of steps ``1..i``
        at ``t``.

        Args:
            input_ids: int64 ``[B, L]`` verifier tokens ``x_0..x_{L-1}``.
            aux_hidden: ``[B, L, 3Ht]`` concatenated aux states ``f_t``.
            ttt_length: number of steps (>= 1).
            attn_impl: ``auto`` (= ``sdpa``), ``sdpa`` (fast) or ``eager`` (reference).

        Returns:
            ``ttt_length`` tensors ``[B, L, H]``: each step's output (the last decoder layer's output, pre final
            norm; ``eagle3.1``: after the final norm), fed to the next step and to :meth:`compute_logits`.

        Raises:
            UserError: bad ``attn_impl`` or ``ttt_length`` < 1.
        """
        impl = resolve_attn_impl(attn_impl)
        if ttt_length < 1:
            raise UserError(f"train.ttt_length must be >= 1, got {ttt_length}")
        B, L = input_ids.shape
        layers = self.decoder_layers()
        hidden = self.project(aux_hidden)  # [B, L, H]
        inv_freq = self._inv_freq(input_ids.device)
        keys: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer, per step
        values: list[list[torch.Tensor]] = [[] for _ in layers]
        outs: list[torch.Tensor] = []
        for i in range(ttt_length):
            ids = F.pad(
                input_ids[:, 1 + i :], (0, min(1 + i, L))
            )  # [B, L] x_{t+1+i}, 0 past the end
            emb = self.embed_tokens(ids).to(hidden.dtype)  # [B, L, H]
            pos = torch.arange(i, L + i, device=input_ids.device)  # [L] rotary position t+i
            cos, sin = rotary_cos_sin(pos, inv_freq)  # [1, 1, L, hd] float32
            h = hidden
            for j, layer in enumerate(layers):  # layer j attends to its own keys of steps 0..i
                q, k, v = layer.qkv(emb, h, cos, sin)  # [B, nh, L, hd], [B, kvh, L, hd] x2
                keys[j].append(k)
                values[j].append(v)
                o = ttt_attention(
                    q, keys[j], values[j], layer.self_attn.scale, impl
                )  # [B, nh, L, hd]
                h = layer.finish(o, h)  # [B, L, H]
            hidden = self.step_output(h)  # [B, L, H]
            outs.append(hidden)
        return outs

    # ---- inference: KV-cached decoding --------------------------------------------------------
    def decode(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DrafterCache,
        valid: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the midlayer on ``T`` new positions, appending their keys/values to ``cache``.

        Each new query attends to every valid cached key and causally to the new ones, which
        reproduces TTT: prefill verified positions (token ``x_{t+1}``, hidden ``fc(f_t)``,
        position ``t``), then feed draft step ``i`` (drafted token, the previous step's output,
        position ``t+i``) one at a time (SGLang / vLLM chain drafting).

        Args:
            input_ids: int64 ``[B, T]`` verifier-vocab token ids.
            hidden: ``[B, T, H]`` already projected (:meth:`project` output or a previous output).
            position_ids: int64 ``[B, T]`` rotary positions (per row: rows of a batch may be at
                different positions).
            cache: :class:`DrafterCache`, extended in place by ``T`` slots.
            valid: bool ``[B, T]``, which new slots hold real positions (None = all). Invalid slots
                (left padding, rejected drafts of a batched round) are never attended to by later
                queries; their own outputs are meaningless.

        Returns:
            ``[B, T, H]`` step outputs (last decoder layer outputs; ``eagle3.1``: normed), fed to
            :meth:`compute_logits` or back as ``hidden``.
        """
        past = cache.length
        T = input_ids.shape[1]
        mask = []  # the same for every layer (they share the slots); known after layer 0's append

        def attend(layer, q, k, v):
            k_all, v_all = cache.append(layer, k, v, valid)  # [B, kvh, past+T, hd]
            if layer == 0:
                mask.append(cache.attention_mask(T))
            return cached_attention(
                q, k_all, v_all, past, self.midlayer.self_attn.scale, mask=mask[0]
            )  # [B, nh, T, hd]

        return self._decode_layers(input_ids, hidden, position_ids, attend)  # [B, T, H]

    def _decode_layers(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, attend
    ):
        """The step outputs ``[B, T, H]`` of ``T`` decode positions (token embedding + hidden, rotary at
        ``position_ids`` ``[B, T]`` for every layer); ``attend(j, q [B, nh, T, hd], k, v [B, kvh, T, hd])`` stores
        layer ``j``'s keys/values in its cache and returns its attention output ``[B, nh, T, hd]``."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = rotary_cos_sin(
            position_ids, self._inv_freq(hidden.device)
        )  # [B, 1, T, hd] float32
        h = hidden
        for j, layer in enumerate(self.decoder_layers()):
            q, k, v = layer.qkv(emb, h, cos, sin)  # [B, nh, T, hd], [B, kvh, T, hd] x2
            h = layer.finish(attend(j, q, k, v), h)  # [B, T, H]
        return self.step_output(h)

    def decode_static(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: StaticKVCache,
    ) -> torch.Tensor:
        """:meth:`decode` for ONE sequence over a :class:`StaticKVCache` (the batch-1 static decoder of
        :mod:`eagle3.decoding.static_decode`; fixed shapes and no host sync, so it can be captured in a CUDA graph).

        Position ``p``'s keys/values go to column ``p`` and a query at ``p`` attends every column ``<= p``. That is
        :meth:`decode`'s rule when the columns ``< p`` hold the verified positions' step-0 keys and this round's
        earlier draft steps: drafted step ``i`` sits at position ``t + i``, exactly where the next round's step-0
        chunk (positions ``t + 1 ..``) writes, so nothing is cropped and a rejected slot is written over.

        Args:
            input_ids: int64 ``[1, T]`` verifier-vocab ids.
            hidden: ``[1, T, H]`` projected hidden (:meth:`project` output or a previous step output).
            position_ids: int64 ``[1, T]`` rotary positions = cache columns (each ``< cache.capacity``).
            cache: the drafter's :class:`StaticKVCache` (``num_layers`` layers), written in place.

        Returns:
            ``[1, T, H]`` step outputs, as :meth:`decode`.
        """
        pos = position_ids[0]  # [T]
        mask = cache.mask(pos)  # [1, 1, T, C]

        def attend(layer, q, k, v):
            k_all, v_all = cache.write(layer, k, v, pos)  # [1, kvh, C, hd]
            return cached_attention(
                q, k_all, v_all, 0, self.midlayer.self_attn.scale, mask=mask
            )  # [1, nh, T, hd]

        return self._decode_layers(input_ids, hidden, position_ids, attend)  # [1, T, H]
