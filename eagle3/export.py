"""Export a trained drafter as a folder SGLang or vLLM serves, and load such a folder back.

Formats (FIELD-NOTES section 4):

- ``sglang`` (also SpecForge; vLLM loads it too, renaming ``midlayer.`` -> ``layers.0.``):
  ``config.json`` = LlamaConfig fields + ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, ``draft_vocab_size``, ``target_hidden_size`` and
  ``eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state: true}`` with SGLang ids
  (:func:`eagle3.layers.engine_layer_ids`); ``model.safetensors`` with keys :data:`SGLANG_KEYS`.
- ``vllm`` (vLLM speculators format, read by ``vllm/transformers_utils/configs/speculators``):
  ``config.json`` = ``architectures: ["Eagle3Speculator"]``, ``speculators_model_type: "eagle3"``,
  ``transformer_layer_config`` (a LlamaConfig dict), ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual: false`` (written explicitly: vLLM's default when absent is true, which is
  not this drafter), top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM ids = HF indices) and
  ``speculators_config`` (greedy proposal with ``speculative_tokens``, the verifier's
  ``name_or_path`` and architecture). Weights use the speculators names: ``layers.0.`` instead of
  ``midlayer.``, the rest as in SGLang (vLLM drops ``t2d`` at load; it is kept for round trips).

Both also get ``eagle3_train.json``: our metadata (HF aux layers, engine, engine ids, verifier,
drafter args). Embedding weights are omitted unless ``include_embeddings`` (both engines use the
verifier's). Folders are written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from eagle3.errors import UserError
from eagle3.io import atomic_write_json, read_json
from eagle3.layers import check_aux_layers, engine_layer_ids
from eagle3.model import DrafterArgs, Eagle3Drafter

META_FILE = "eagle3_train.json"
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
HEAD_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
SGLANG_KEYS = tuple(f"midlayer.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Required tensor names of the SGLang export (``embed_tokens.weight`` optional)."""
VLLM_KEYS = tuple(f"layers.0.{k}" for k in LAYER_KEYS) + HEAD_KEYS
"""Required tensor names of the vLLM speculators export (``embed_tokens.weight`` optional)."""
EMBED_KEY = "embed_tokens.weight"
VERIFIER_FIELDS = ("name", "architecture", "num_layers", "hidden_size", "vocab_size")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
VLLM_ARCH = "Eagle3Speculator"


def _llama_config(a: DrafterArgs, dtype: torch.dtype) -> dict:
    """LlamaConfig fields of the one-layer drafter (``vocab_size`` = verifier vocab, for embeddings)."""
    return {
        "model_type": "llama",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "vocab_size": a.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def export_drafter(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    engine: str,
    aux_layers_hf: list[int],
    verifier_info: dict,
    include_embeddings: bool = False,
    num_speculative_tokens: int = 3,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write ``drafter`` as a serving-engine folder (see the module docstring for both formats).

    Args:
        drafter: trained drafter (its ``d2t``/``t2d`` must be the run's vocab map).
        out_dir: destination folder (replaced if it exists).
        engine: ``"sglang"`` or ``"vllm"``.
        aux_layers_hf: the three aux layers as HF ``hidden_states`` indices (capture convention).
        verifier_info: ``{name, architecture, num_layers, hidden_size, vocab_size}``
            (``eagle3.verifier.verifier_dims`` + the verifier id).
        include_embeddings: also store ``embed_tokens.weight``.
        num_speculative_tokens: vLLM ``speculators_config.proposal_methods[0].speculative_tokens``.
        dtype: cast floating weights to this dtype (default: as stored in the drafter).

    Returns:
        The folder path.

    Raises:
        UserError: unknown engine, missing ``verifier_info`` field, aux layers invalid for the
            verifier, verifier dims not matching the drafter, or a required tensor missing.
    """
    from safetensors.torch import save_file

    if engine not in ("sglang", "vllm"):
        raise UserError(f"export.engine: unknown engine '{engine}' (expected sglang or vllm)")
    for f in VERIFIER_FIELDS:
        if f not in verifier_info or verifier_info[f] is None:
            raise UserError(f"verifier_info: missing field '{f}'")
    a = drafter.args
    arch = str(verifier_info["architecture"])
    aux = check_aux_layers(aux_layers_hf, int(verifier_info["num_layers"]), field="aux_layers_hf")
    if int(verifier_info["hidden_size"]) != a.target_hidden_size:
        raise UserError(f"verifier_info.hidden_size {verifier_info['hidden_size']} != drafter target_hidden_size {a.target_hidden_size}")
    if int(verifier_info["vocab_size"]) != a.target_vocab_size:
        raise UserError(f"verifier_info.vocab_size {verifier_info['vocab_size']} != drafter target_vocab_size {a.target_vocab_size}")
    ids = engine_layer_ids(aux, engine, arch)

    sd = drafter.state_dict()
    required = SGLANG_KEYS if engine == "sglang" else VLLM_KEYS
    tensors: dict[str, torch.Tensor] = {}
    for key in required:
        src = key.replace("layers.0.", "midlayer.", 1) if key.startswith("layers.0.") else key
        if src not in sd:
            raise UserError(f"drafter state: missing required tensor '{src}' (export key '{key}')")
        tensors[key] = sd[src]
    if include_embeddings:
        tensors[EMBED_KEY] = sd[EMBED_KEY]
    out_dtype = dtype or drafter.fc.weight.dtype
    tensors = {
        k: (v.to(out_dtype) if v.is_floating_point() else v).detach().cpu().contiguous().clone() for k, v in tensors.items()
    }

    llama = _llama_config(a, out_dtype)
    if engine == "sglang":
        config = {
            "architectures": [SGLANG_ARCH],
            **llama,
            "draft_vocab_size": a.draft_vocab_size,
            "target_hidden_size": a.target_hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        }
    else:
        config = {
            "architectures": [VLLM_ARCH],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **llama},
            "draft_vocab_size": a.draft_vocab_size,
            "target_hidden_size": a.target_hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": ids,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [
                    {"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens), "verifier_accept_k": 1, "accept_tolerance": 0.0}
                ],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": str(verifier_info["name"]), "architectures": [arch]},
            },
            "torch_dtype": llama["torch_dtype"],
        }
    meta = {
        "format_version": 1,
        "engine": engine,
        "aux_layers_hf": aux,
        "engine_layer_ids": ids,
        "verifier": {f: verifier_info[f] for f in VERIFIER_FIELDS},
        "drafter_args": a.to_json(),
        "include_embeddings": bool(include_embeddings),
        "weights": WEIGHTS_FILE,
    }

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
        atomic_write_json(tmp / META_FILE, meta)
        old = None
        if out.exists():
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _need(cfg: dict, key: str, where: Path):
    if key not in cfg or cfg[key] is None:
        raise UserError(f"{where}: missing config key '{key}'")
    return cfg[key]


def _args_from_config(cfg: dict, path: Path) -> tuple[str, DrafterArgs]:
    """Detect the format and build :class:`DrafterArgs` from a ``config.json`` dict."""
    archs = cfg.get("architectures") or []
    if cfg.get("speculators_model_type") == "eagle3" or VLLM_ARCH in archs:
        engine = "vllm"
        layer = _need(cfg, "transformer_layer_config", path)
        if cfg.get("norm_before_residual", True):
            raise UserError(f"{path}: key 'norm_before_residual' must be false for this drafter (hidden_norm before the residual is not implemented)")
        src = dict(layer)
        src["draft_vocab_size"] = _need(cfg, "draft_vocab_size", path)
        src["target_hidden_size"] = cfg.get("target_hidden_size") or layer.get("hidden_size")
    elif SGLANG_ARCH in archs:
        engine = "sglang"
        src = dict(cfg)
        src["target_hidden_size"] = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    else:
        raise UserError(f"{path}: key 'architectures' is {archs}; expected [{SGLANG_ARCH!r}] or [{VLLM_ARCH!r}]")
    if int(src.get("num_hidden_layers", 1)) != 1:
        raise UserError(f"{path}: key 'num_hidden_layers' must be 1, got {src.get('num_hidden_layers')}")
    heads = _need(src, "num_attention_heads", path)
    H = _need(src, "hidden_size", path)
    args = DrafterArgs(
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=src.get("num_key_value_heads") or heads,
        head_dim=src.get("head_dim") or H // heads,
        intermediate_size=_need(src, "intermediate_size", path),
        rms_norm_eps=_need(src, "rms_norm_eps", path),
        rope_theta=src.get("rope_theta") or (src.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=src.get("max_position_embeddings", 2048),
        draft_vocab_size=_need(src, "draft_vocab_size", path),
        target_vocab_size=_need(src, "vocab_size", path),
        target_hidden_size=src["target_hidden_size"],
        rope_scaling=src.get("rope_scaling"),
    )
    return engine, args


def load_exported(path: str | os.PathLike, embed_weight: Optional[torch.Tensor] = None) -> Eagle3Drafter:
    """Load an exported folder (either format) into an :class:`Eagle3Drafter` (float32, CPU).

    Args:
        path: folder written by :func:`export_drafter` (or a compatible SGLang/SpecForge/speculators one).
        embed_weight: the verifier's input embedding ``[target_V, H]``; required when the folder has
            no ``embed_tokens.weight``.

    Raises:
        UserError: missing/bad ``config.json`` key, missing or unexpected tensor, wrong tensor
            shape, or no embeddings available -- each naming the file and key.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    cfg_path = root / "config.json"
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object")
    engine, args = _args_from_config(cfg, cfg_path)
    wpath = root / WEIGHTS_FILE
    if not wpath.is_file():
        raise UserError(f"{wpath}: file not found")
    try:
        tensors = load_file(str(wpath))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{wpath}: unreadable safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if engine == "vllm":
        tensors = {(k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    for key in SGLANG_KEYS:
        if key not in tensors:
            shown = key.replace("midlayer.", "layers.0.", 1) if engine == "vllm" else key
            raise UserError(f"{wpath}: missing required tensor '{shown}'")
    extra = sorted(set(tensors) - set(SGLANG_KEYS) - {EMBED_KEY})
    if extra:
        raise UserError(f"{wpath}: unexpected tensor '{extra[0]}'")
    drafter = Eagle3Drafter(args)
    sd = drafter.state_dict()
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(sd[k].shape):
            raise UserError(f"{wpath}: tensor '{k}' has shape {list(v.shape)}, config implies {list(sd[k].shape)}")
    if EMBED_KEY not in tensors:
        if embed_weight is None:
            raise UserError(f"{wpath}: no '{EMBED_KEY}' stored; pass the verifier's embedding (embed_weight)")
        if tuple(embed_weight.shape) != tuple(sd[EMBED_KEY].shape):
            raise UserError(f"embed_weight has shape {list(embed_weight.shape)}, {cfg_path} implies {list(sd[EMBED_KEY].shape)}")
        tensors[EMBED_KEY] = embed_weight
    with torch.no_grad():
        for k, v in tensors.items():
            sd[k].copy_(v.to(sd[k].dtype) if v.is_floating_point() else v)
    try:
        drafter.set_vocab_map(drafter.d2t.clone(), drafter.t2d.clone())  # validates the stored map
    except UserError as e:
        raise UserError(f"{wpath}: {e}") from e
    return drafter


def read_export_meta(path: str | os.PathLike) -> dict:
    """Our metadata ``eagle3_train.json`` of an exported folder (aux layers, engine ids, verifier).

    Raises:
        UserError: file missing or malformed.
    """
    return read_json(Path(path) / META_FILE)
