"""What every engine's export folder shares: file names, tensor names, the export dtype and the shape contract.

A folder holds ``config.json`` (the engine's format, :mod:`eagle3.export.sglang` / :mod:`eagle3.export.vllm`, plus
our :data:`CONFIG_BLOCK`), ``model.safetensors`` (:data:`WEIGHTS_FILE`) and ``eagle3_train.json`` (:data:`META_FILE`).

Deeper drafters (``DrafterArgs.num_layers`` = ``num_hidden_layers`` in both configs): layer 0 keeps its names
(``midlayer.`` / ``layers.0.``); each layer ``i >= 1`` adds :func:`upper_layer_keys` in both formats. Its
pre-attention norm is written twice, as ``layers.{i}.hidden_norm.weight`` (what SGLang applies) and
``layers.{i}.input_layernorm.weight`` (what vLLM applies): each engine creates both modules and leaves the other
unused (:data:`UPPER_NORM_KEYS`).

EAGLE-3.1 drafters (``DrafterArgs.variant == "eagle3.1"``) add the tensors ``fc_norm.{0,1,2}.weight`` (same names in
both engines) and the config keys ``fc_norm: true`` and ``norm_output: true`` (:func:`variant_keys`), which SGLang
0.5.23 reads from the draft config and vLLM 0.33 copies from the speculators config. An engine release whose model
code predates these keys would load such a folder as EAGLE-3.0: serve 3.1 folders with those versions or newer.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from eagle3.data.vocab import check_vocab_map
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.draft_config import EXPORT_META_FILE
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError

log = logging.getLogger(__name__)

META_FILE = EXPORT_META_FILE
WEIGHTS_FILE = "model.safetensors"
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)
MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
"""The MLA draft class of both engines (SGLang 0.5.23 ``models/kimi_k25_eagle3.py`` ``EntryClass``; vLLM 0.34
``models/registry.py`` -> ``deepseek_eagle3.py``): ``config.json`` ``architectures`` of an MLA export."""
MLA_Q_KEYS = (
    "self_attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
)
"""The MLA layer's query tensors with ``q_lora_rank`` set (without it: ``self_attn.q_proj.weight``)."""
MLA_KV_KEYS = (
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
)
VOCAB_KEYS = ("d2t", "t2d")
HEAD_KEYS = ("fc.weight", "norm.weight", "lm_head.weight") + VOCAB_KEYS
FC_NORM_KEYS = tuple(f"fc_norm.{j}.weight" for j in range(3))
"""The extra tensors of an ``eagle3.1`` drafter (one RMSNorm weight ``[Ht]`` per aux state), both engines."""
EMBED_KEY = "embed_tokens.weight"
VERIFIER_FIELDS = ("name", "architecture", "num_layers", "hidden_size", "vocab_size")
CONFIG_BLOCK = "eagle3_train"
"""Key of our block in an exported ``config.json`` (engine, HF aux layers, id convention)."""
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
UPPER_NORM_KEYS = ("input_layernorm.weight", "hidden_norm.weight")
"""The two names of the pre-attention norm of a decoder layer ``i >= 1`` (vLLM 0.33 reads ``input_layernorm``,
SGLang 0.5.23 ``hidden_norm``); an export writes the drafter's one weight (``layers.{i}.input_layernorm``) under both."""


def layer_keys(a: DrafterArgs) -> tuple[str, ...]:
    """Decoder layer 0's tensor names without prefix: :data:`LAYER_KEYS` (llama), or the MLA layer's (the names of
    DeepSeek-V3 checkpoints, which both engines' MLA draft loaders take: q_a/q_b or q_proj, kv_a_proj_with_mqa,
    the two latent norms, kv_b_proj, o_proj; the MLP and the three norms as :data:`LAYER_KEYS`)."""
    if not a.is_mla:
        return LAYER_KEYS
    q = ("self_attn.q_proj.weight",) if a.mla["q_lora_rank"] is None else MLA_Q_KEYS
    return q + MLA_KV_KEYS + tuple(k for k in LAYER_KEYS if not k.startswith("self_attn."))


def upper_layer_keys(num_layers: int) -> tuple[str, ...]:
    """Tensor names of decoder layers ``1..num_layers-1`` (same in both formats): ``layers.{i}.`` + :data:`LAYER_KEYS`
    (q/k/v ``[*, H]``; ``input_layernorm`` and ``hidden_norm`` hold the same weight, see :data:`UPPER_NORM_KEYS`)."""
    return tuple(f"layers.{i}.{k}" for i in range(1, int(num_layers)) for k in LAYER_KEYS)


def state_key(key: str) -> str:
    """The drafter ``state_dict`` key an export key (either format) is written from: ``layers.0.`` -> ``midlayer.``,
    ``layers.{i}.hidden_norm`` (``i >= 1``) -> ``layers.{i}.input_layernorm``, the rest as is."""
    if key.startswith("layers.0."):
        return key.replace("layers.0.", "midlayer.", 1)
    if key.startswith("layers.") and key.endswith(".hidden_norm.weight"):
        return key[: -len("hidden_norm.weight")] + "input_layernorm.weight"
    return key


def variant_keys(variant: str) -> dict:
    """The draft-config keys both engines read for ``variant`` (none for ``eagle3``: folders stay as before)."""
    return {"fc_norm": True, "norm_output": True} if variant == "eagle3.1" else {}


def export_dtype(name: str | torch.dtype, verifier_dtype: str = "bfloat16") -> torch.dtype:
    """The dtype an export is written in: ``export.dtype``; ``auto`` = the dtype the verifier is SERVED in:
    ``verifier.dtype`` (its ``auto``: bfloat16), except that a float32 verifier (this project's exactness setting,
    not a serving dtype: SGLang 0.5.23 serves a float32 draft config as float16, vLLM 0.33 casts the draft to the
    verifier's serving dtype) gives bfloat16. An explicit ``float32`` is written as asked
    (:func:`eagle3.export.writer.export_drafter` warns for SGLang).

    Raises:
        UserError: an unknown dtype name.
    """
    if verifier_dtype == "auto":  # decided at load; served in bfloat16 (CUDA)
        verifier_dtype = "bfloat16"
    if name == "auto" and verifier_dtype == "float32":
        log.info(
            "export.dtype auto with verifier.dtype float32: exporting bfloat16, the serving dtype "
            "(set export.dtype: float32 to keep float32 weights)"
        )
        return torch.bfloat16
    key = verifier_dtype if name == "auto" else name
    out = EXPORT_DTYPES.get(key) if isinstance(key, str) else key
    if out not in EXPORT_DTYPES.values():
        raise UserError(
            f"export.dtype: unknown dtype {key!r} (expected auto, {', '.join(sorted(EXPORT_DTYPES))})"
        )
    return out


def check_export_contract(
    drafter: Eagle3Drafter,
    verifier_info: dict,
    include_embeddings: bool,
    exported: Mapping[str, str],
) -> None:
    """Check the drafter/verifier shape contract a serving engine relies on (and does not check), and that the
    drafter state holds every tensor the engine's folder stores (``exported``: export name -> state name,
    :func:`eagle3.export.writer.export_tensor_names`).

    - verifier ``hidden_size`` = the drafter's ``target_hidden_size``; ``fc.weight`` is
      ``[H, 3 x target_hidden_size]`` (three aux states concatenated, SGLang ``llama_eagle3.py``
      ``fc = Linear(target_hidden_size * num_aux, hidden_size)``);
    - verifier ``vocab_size`` = ``target_vocab_size``; ``lm_head.weight`` is ``[draft_V, H]`` and
      the vocab map is valid for ``draft_V`` / ``target_V`` (:func:`eagle3.data.vocab.check_vocab_map`);
    - every other tensor has the shape the drafter args imply;
    - a drafter whose hidden size differs from the verifier's is exported with ``include_embeddings=True``: both
      engines use the verifier's embedding only when the sizes agree (SGLang 0.5.23 ``set_embed`` otherwise keeps
      the folder's, random when it has none).

    Raises:
        UserError: naming the field or tensor, the shape found and the shape required; or ``drafter state: missing
            required tensor '<state name>' (export key '<export name>')``.
    """
    a = drafter.args
    vh, vv = int(verifier_info["hidden_size"]), int(verifier_info["vocab_size"])
    sd = drafter.state_dict()
    faults = (
        _size_faults(a, vh, vv, include_embeddings)
        or _tensor_shape_faults(sd, a, vh, vv)
        or [
            f"drafter state: missing required tensor '{src}' (export key '{key}')"
            for key, src in exported.items()
            if src not in sd
        ]
    )
    if faults:
        raise UserError(faults[0])
    check_vocab_map(
        sd["d2t"],
        sd["t2d"],
        "drafter vocab map",
        target_vocab_size=vv,
        draft_vocab_size=a.draft_vocab_size,
        draft_key="drafter draft_vocab_size",
        target_source="verifier_info.vocab_size",
    )


def _size_faults(a: DrafterArgs, vh: int, vv: int, include_embeddings: bool) -> list[str]:
    """One line per size the verifier (hidden ``vh``, vocab ``vv``) and the drafter args ``a`` disagree on, and the
    missing embedding of a drafter narrower or wider than the verifier."""
    faults = [
        f"verifier_info.{key}: {got}, but the drafter was built for target_{key} {built}{why}"
        for key, got, built, why in (
            ("hidden_size", vh, a.target_hidden_size, " (its fc reads 3 x target hidden)"),
            ("vocab_size", vv, a.target_vocab_size, ""),
        )
        if got != built
    ]
    if a.hidden_size != vh and not include_embeddings:
        faults.append(
            f"drafter hidden_size {a.hidden_size} differs from the verifier hidden_size {vh}: the engines then "
            f"do not use the verifier's embedding and would run the draft with a random one; export with "
            f"include_embeddings=True (writes '{EMBED_KEY}')"
        )
    return faults


def _tensor_shape_faults(sd: dict, a: DrafterArgs, vh: int, vv: int) -> list[str]:
    """One line per tensor of the drafter state ``sd`` whose shape is not the one its args ``a`` imply (``vh``/``vv``:
    the verifier's hidden and vocab sizes, for the messages), naming the tensor, its shape and the shape required."""
    with torch.device("meta"):
        ref = Eagle3Drafter(a).state_dict()
    why = {
        "fc.weight": f"[hidden_size, 3 x verifier hidden_size] = [{a.hidden_size}, 3 x {vh}]",
        "lm_head.weight": f"[draft_vocab_size, hidden_size] = [{a.draft_vocab_size}, {a.hidden_size}]",
        EMBED_KEY: f"[verifier vocab_size, hidden_size] = [{vv}, {a.hidden_size}]",
    }
    return [
        f"drafter tensor '{key}': shape {list(sd[key].shape)}, EAGLE-3 export needs "
        f"{why.get(key, list(want.shape))}"
        for key, want in ref.items()
        # a key not in sd: a missing required tensor when the engine's folder stores it
        if key in sd and tuple(sd[key].shape) != tuple(want.shape)
    ]
