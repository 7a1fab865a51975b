"""The verifier's token embedding, LM head and final norm: everything training needs from the verifier.

Training computes the verifier's next-token distribution ``p_t = softmax(lm_head(norm?(last_t)))``
from the captured last hidden state, and copies the (frozen) token embedding into the drafter.
Both are a few hundred MB even for Kimi-K2.5 (163840 x 7168), so stage 04 extracts them once into
``{train_dir}/target_head.safetensors`` and never reloads the full verifier on resume.

The final norm is applied only when the capture recorded ``last_hidden_state: "pre_norm"``
(DESIGN.md "Last hidden state"; HF Llama returns the post-norm state as ``hidden_states[-1]``).

Two sources: a loaded HF model (:meth:`TargetHead.from_model`), or the checkpoint folder's safetensors
(:func:`load_target_head_from_safetensors`). For Kimi-K2.5 the checkpoint is ~600 GB in 64 shards; the latter
reads ``model.safetensors.index.json`` (or a single ``model.safetensors``), opens only the shard(s) holding the
three tensors with ``safetensors.safe_open`` (memory-mapped) and materialises only those, so peak memory is about
their size. Tensor names follow the HF layout under a wrapper prefix (:data:`eagle3.verifier.arch.WRAPPER_PREFIXES`);
when no ``lm_head`` tensor exists the embeddings are tied (``tie_word_embeddings``, e.g. SmolLM2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3.errors import UserError
from eagle3.io import atomic_path, file_not_found, read_json
from eagle3.verifier.arch import (
    EMBED_TENSORS,
    LM_HEAD_TENSORS,
    NORM_TENSORS,
    WRAPPER_PREFIXES,
    cfg_get,
    find_final_norm,
    text_config,
)

FILENAME = "target_head.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class TargetHead:
    """Frozen verifier tensors used by the trainer.

    Attributes:
        embed: ``[V, Ht]`` input token embedding of the verifier.
        lm_head: ``[V, Ht]`` output projection (may be the same tensor as ``embed`` when tied).
        norm_weight: ``[Ht]`` final RMSNorm weight of the verifier.
        norm_eps: RMSNorm epsilon of that norm.
        last_is_post_norm: True when the captured last hidden state already went through the
            final norm (then ``norm_weight`` is not applied again).
    """

    embed: torch.Tensor
    lm_head: torch.Tensor
    norm_weight: torch.Tensor
    norm_eps: float
    last_is_post_norm: bool = True

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    @property
    def tied(self) -> bool:
        """True when ``lm_head`` and ``embed`` are the same storage (tied embeddings; saved once)."""
        return (
            self.lm_head.data_ptr() == self.embed.data_ptr()
            and self.lm_head.shape == self.embed.shape
        )

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_model(
        cls, hf_model: torch.nn.Module, last_hidden_state: str = "post_norm"
    ) -> "TargetHead":
        """Extract the head from a loaded HF causal LM (Llama, DeepSeek-V3, multimodal wrappers).

        Tied embeddings (``tie_word_embeddings``, e.g. SmolLM2) give one tensor for both fields.
        The final norm is the decoder's ``norm`` (HF Llama/DeepSeek naming) or ``final_layernorm``/``ln_f``.

        Args:
            hf_model: e.g. ``LlamaForCausalLM``; weights are detached and copied to CPU.
            last_hidden_state: ``"post_norm"`` or ``"pre_norm"`` as recorded by the capture.

        Raises:
            UserError: no input/output embeddings or final norm can be found.
        """
        if last_hidden_state not in ("post_norm", "pre_norm"):
            raise UserError(
                f"data_config.json: last_hidden_state must be 'post_norm' or 'pre_norm', got {last_hidden_state!r}"
            )
        emb_mod = hf_model.get_input_embeddings()
        out_mod = hf_model.get_output_embeddings()
        if emb_mod is None or out_mod is None:
            raise UserError(f"verifier {type(hf_model).__name__}: no input/output embeddings found")
        embed = emb_mod.weight.detach().to("cpu")  # [V, Ht]
        lm_head = (
            embed if out_mod.weight is emb_mod.weight else out_mod.weight.detach().to("cpu")
        )  # [V, Ht]
        norm = find_final_norm(hf_model)
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
        if eps is None:
            cfg = getattr(hf_model, "config", None)
            cfg = getattr(cfg, "text_config", None) or cfg
            eps = getattr(cfg, "rms_norm_eps", 1e-6)
        return cls(
            embed=embed,
            lm_head=lm_head,
            norm_weight=norm.weight.detach().to("cpu"),  # [Ht]
            norm_eps=float(eps),
            last_is_post_norm=(last_hidden_state == "post_norm"),
        )

    # ---- persistence ---------------------------------------------------------------------
    def save(self, train_dir: str | os.PathLike) -> Path:
        """Write ``{train_dir}/target_head.safetensors`` atomically (lm_head omitted when tied).

        Returns:
            The file path.
        """
        path = Path(train_dir) / FILENAME
        tensors = {"embed": self.embed.contiguous(), "norm_weight": self.norm_weight.contiguous()}
        tied = self.tied
        if not tied:
            tensors["lm_head"] = self.lm_head.contiguous()
        meta = {
            "norm_eps": repr(float(self.norm_eps)),
            "last_is_post_norm": str(bool(self.last_is_post_norm)),
            "tied": str(tied),
        }
        with atomic_path(
            path, needed=sum(t.numel() * t.element_size() for t in tensors.values())
        ) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(
        cls,
        train_dir: str | os.PathLike,
        device: str | torch.device = "cpu",
        dtype: Optional[torch.dtype] = None,
    ) -> "TargetHead":
        """Read ``{train_dir}/target_head.safetensors`` (or a direct file path).

        Args:
            device: where the tensors go.
            dtype: cast floating tensors to this dtype (None = as stored).

        Raises:
            UserError: missing, corrupt, or missing keys/metadata.
        """
        path = Path(train_dir)
        if path.is_dir() or path.suffix != ".safetensors":
            path = path / FILENAME
        if not path.is_file():
            raise file_not_found(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path), device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(
                f"{path}: corrupt safetensors file: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from e
        for key in ("embed", "norm_weight"):
            if key not in tensors:
                raise UserError(f"{path}: missing tensor '{key}'")
        for key in ("norm_eps", "last_is_post_norm", "tied"):
            if key not in meta:
                raise UserError(f"{path}: missing metadata key '{key}'")
        tied = meta["tied"] == "True"
        if not tied and "lm_head" not in tensors:
            raise UserError(
                f"{path}: missing tensor 'lm_head' (metadata says the head is not tied)"
            )
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        embed = cast(tensors["embed"])  # [V, Ht]
        lm_head = embed if tied else cast(tensors["lm_head"])  # [V, Ht]
        return cls(
            embed=embed,
            lm_head=lm_head,
            norm_weight=cast(tensors["norm_weight"]),  # [Ht]
            norm_eps=float(meta["norm_eps"]),
            last_is_post_norm=meta["last_is_post_norm"] == "True",
        )


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
    found = _find(wm, EMBED_TENSORS, WRAPPER_PREFIXES)
    if found is None:
        raise UserError(
            f"{folder}: no token embedding tensor (looked for {[p + EMBED_TENSORS[0] for p in WRAPPER_PREFIXES]})"
        )
    prefix, embed = found
    norm = _find(wm, NORM_TENSORS, (prefix,))
    if norm is None:
        raise UserError(
            f"{folder}: no final norm tensor '{prefix}{NORM_TENSORS[0]}' next to '{embed}'"
        )
    # transformers-5 wrappers keep lm_head at the top level, K2.5 under its prefix.
    head = _find(wm, LM_HEAD_TENSORS, (prefix, "") if prefix else ("",))
    return {"embed": embed, "norm": norm[1], "lm_head": head[1] if head else None}


def load_target_head_from_safetensors(
    folder: str | os.PathLike,
    last_hidden_state: str = "post_norm",
    dtype: Optional[torch.dtype] = None,
) -> TargetHead:
    """Build a :class:`TargetHead` from a checkpoint folder without loading the model.

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
    hidden, vocab, eps = _head_shape(cfg_path)
    names = locate_head_tensors(folder)
    if names["lm_head"] is None:
        _require_tied(folder, cfg_path)
    tensors = _read_tensors(folder, [n for n in names.values() if n is not None])
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


def _head_shape(cfg_path: Path) -> tuple[int, int, float]:
    """``(hidden_size, vocab_size, rms_norm_eps)`` of the text model in ``cfg_path`` (``text_config`` unwrapped).

    Raises:
        UserError: a key is missing, naming it and the file.
    """
    cfg = text_config(read_json(cfg_path))
    hidden = cfg_get(cfg, "hidden_size")
    vocab = cfg_get(cfg, "vocab_size")
    eps = cfg_get(cfg, "rms_norm_eps")
    for key, val in (("hidden_size", hidden), ("vocab_size", vocab), ("rms_norm_eps", eps)):
        if val is None:
            raise UserError(f"{cfg_path}: key '{key}' missing (also looked in 'text_config')")
    return hidden, vocab, eps


def _require_tied(folder: Path, cfg_path: Path) -> None:
    """A checkpoint without an ``lm_head`` tensor must not say ``tie_word_embeddings: false`` (text config first,
    then the top level).

    Raises:
        UserError: it does.
    """
    root = read_json(cfg_path)
    tie = cfg_get(text_config(root), "tie_word_embeddings")
    if tie is None:
        tie = cfg_get(root, "tie_word_embeddings")
    if tie is False:
        raise UserError(
            f"{folder}: no 'lm_head.weight' tensor but {cfg_path} says tie_word_embeddings: false"
        )


def _read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint in ``folder``, each shard opened once (memory-mapped, on CPU).

    Raises:
        UserError: a shard file is missing or cannot be read.
    """
    wm = _weight_map(folder)
    by_shard: dict[str, list[str]] = {}
    for name in names:
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
    return tensors
