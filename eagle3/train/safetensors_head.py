"""Read the verifier's embedding, final norm and LM head straight from a (sharded) safetensors checkpoint.

Stage 04 needs only three verifier tensors (``TargetHead``). For Kimi-K2.5 the checkpoint is
~600 GB in 64 shards; loading the model to read 2 x 163840 x 7168 bf16 + 7168 values would be
absurd. This module reads ``model.safetensors.index.json`` (or a single ``model.safetensors``),
opens only the shard(s) holding those tensors with ``safetensors.safe_open`` (memory-mapped) and
materialises only those tensors, so peak memory is about the size of the three tensors.

Tensor names follow the HF layout (``model.embed_tokens.weight``, ``model.norm.weight``,
``lm_head.weight``), optionally under a multimodal wrapper prefix: ``language_model.`` (Kimi-K2.5
``KimiK25ForConditionalGeneration``, FIELD-NOTES section 6) or ``model.language_model.``
(transformers-5 style wrappers). When no ``lm_head`` tensor exists the embeddings are tied
(``tie_word_embeddings``, e.g. SmolLM2) and the embedding is returned for both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open

from eagle3.errors import UserError
from eagle3.io import read_json
from eagle3.train.target_head import TargetHead
from eagle3.verifier import text_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: Wrapper prefixes tried in order ("" = plain causal LM).
PREFIXES = ("", "language_model.", "model.language_model.")

#: Candidate tensor names per role, before a wrapper prefix is applied.
_EMBED = ("model.embed_tokens.weight", "embed_tokens.weight")
_NORM = ("model.norm.weight", "norm.weight")
_HEAD = ("lm_head.weight",)


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name (relative to ``folder``).

    Raises:
        UserError: neither an index nor a single ``model.safetensors`` exists; the index is malformed.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        data = read_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise UserError(f"{index}: key 'weight_map' missing or empty")
        return {str(k): str(v) for k, v in wm.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise UserError(
                f"{single}: not a readable safetensors file: {str(e).splitlines()[0] if str(e) else e}"
            ) from e
    raise UserError(
        f"{folder}: no {INDEX_FILE} or {SINGLE_FILE} (expected a safetensors checkpoint folder)"
    )


def _find(
    weight_map: dict[str, str], names: tuple[str, ...], prefixes: tuple[str, ...]
) -> Optional[tuple[str, str]]:
    """First ``(prefix, prefix + name)`` present in the weight map (prefix-major order), else None."""
    for p in prefixes:
        for n in names:
            if p + n in weight_map:
                return p, p + n
    return None


def _cfg_get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def locate_head_tensors(folder: str | os.PathLike) -> dict[str, Optional[str]]:
    """Names of the embedding, final norm and LM head tensors in a checkpoint folder.

    Returns:
        ``{"embed": name, "norm": name, "lm_head": name or None (tied)}``.

    Raises:
        UserError: the folder is not a safetensors checkpoint, or the embedding / final norm is absent.
    """
    folder = Path(folder)
    wm = _weight_map(folder)
    # The prefix is fixed by where the embedding lives, so a vision tower's own
    # ``*.norm.weight`` or embedding can never be picked for the language model.
    found = _find(wm, _EMBED, PREFIXES)
    if found is None:
        raise UserError(
            f"{folder}: no token embedding tensor (looked for {[p + _EMBED[0] for p in PREFIXES]})"
        )
    prefix, embed = found
    norm = _find(wm, _NORM, (prefix,))
    if norm is None:
        raise UserError(f"{folder}: no final norm tensor '{prefix}{_NORM[0]}' next to '{embed}'")
    # transformers-5 wrappers keep lm_head at the top level, K2.5 under its prefix.
    head = _find(wm, _HEAD, (prefix, "") if prefix else ("",))
    return {"embed": embed, "norm": norm[1], "lm_head": head[1] if head else None}


def load_target_head_from_safetensors(
    folder: str | os.PathLike,
    last_hidden_state: str = "post_norm",
    dtype: Optional[torch.dtype] = None,
) -> TargetHead:
    """Build a :class:`eagle3.train.target_head.TargetHead` from a checkpoint folder without loading the model.

    Reads ``config.json`` (the nested ``text_config`` for multimodal wrappers such as Kimi-K2.5) for
    ``hidden_size``, ``vocab_size`` and ``rms_norm_eps``; then opens only the shard files that hold
    the three tensors and reads only those tensors.

    Args:
        folder: local HF checkpoint folder (``config.json`` + ``model.safetensors[.index.json]``).
        last_hidden_state: ``"post_norm"`` | ``"pre_norm"``, as recorded by the capture backend
            (the SGLang capture returns the post-norm state, see ``eagle3.capture.sglang``).
        dtype: cast the tensors to this dtype (None = keep the stored dtype, usually bf16).

    Returns:
        ``TargetHead(embed [V, Ht], lm_head [V, Ht] (same tensor when tied), norm_weight [Ht], norm_eps)``.

    Raises:
        UserError: missing/malformed ``config.json`` or index, a missing tensor, a shard that cannot be
            read, an untied config without ``lm_head``, or tensor shapes that disagree with the config.
    """
    if last_hidden_state not in ("post_norm", "pre_norm"):
        raise UserError(
            f"last_hidden_state must be 'post_norm' or 'pre_norm', got {last_hidden_state!r}"
        )
    folder = Path(folder)
    cfg_path = folder / "config.json"
    cfg = text_config(read_json(cfg_path))
    hidden = _cfg_get(cfg, "hidden_size")
    vocab = _cfg_get(cfg, "vocab_size")
    eps = _cfg_get(cfg, "rms_norm_eps")
    for key, val in (("hidden_size", hidden), ("vocab_size", vocab), ("rms_norm_eps", eps)):
        if val is None:
            raise UserError(f"{cfg_path}: key '{key}' missing (also looked in 'text_config')")
    names = locate_head_tensors(folder)
    if names["lm_head"] is None:
        root = read_json(cfg_path)
        tie = _cfg_get(cfg, "tie_word_embeddings")
        if tie is None:
            tie = _cfg_get(root, "tie_word_embeddings")
        if tie is False:
            raise UserError(
                f"{folder}: no 'lm_head.weight' tensor but {cfg_path} says tie_word_embeddings: false"
            )

    wm = _weight_map(folder)
    by_shard: dict[str, list[str]] = {}
    for role in ("embed", "norm", "lm_head"):
        name = names[role]
        if name is not None:
            by_shard.setdefault(wm[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for shard, wanted in by_shard.items():
        path = folder / shard
        if not path.is_file():
            raise UserError(
                f"{folder / INDEX_FILE}: shard '{shard}' (holding {wanted[0]}) not found"
            )
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in wanted:
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise UserError(
                f"{path}: cannot read {wanted}: {str(e).splitlines()[0] if str(e) else e}"
            ) from e

    embed = tensors[names["embed"]]  # [V, Ht]
    norm_w = tensors[names["norm"]]  # [Ht]
    lm_head = tensors[names["lm_head"]] if names["lm_head"] is not None else embed  # [V, Ht]
    for role, t, shape in (
        ("embed", embed, (vocab, hidden)),
        ("lm_head", lm_head, (vocab, hidden)),
        ("norm", norm_w, (hidden,)),
    ):
        if tuple(t.shape) != tuple(shape):
            raise UserError(
                f"{folder}: tensor '{names[role] or names['embed']}' has shape {tuple(t.shape)}, "
                f"{cfg_path} implies {tuple(shape)}"
            )
    if dtype is not None:
        tied = lm_head is embed
        embed = embed.to(dtype)
        lm_head = embed if tied else lm_head.to(dtype)
        norm_w = norm_w.to(dtype)
    return TargetHead(
        embed=embed,
        lm_head=lm_head,
        norm_weight=norm_w,
        norm_eps=float(eps),
        last_is_post_norm=(last_hidden_state == "post_norm"),
    )


__all__ = ["load_target_head_from_safetensors", "locate_head_tensors", "INDEX_FILE", "SINGLE_FILE"]
