"""The verifier's token embedding, LM head and final norm: everything training needs from the verifier.

Training computes the verifier's next-token distribution ``p_t = softmax(lm_head(norm?(last_t)))`` from the captured
last hidden state (the final norm only when the capture recorded ``last_hidden_state: "pre_norm"``, DESIGN.md "Last
hidden state") and copies the frozen token embedding into the drafter. Stage 04 extracts them once into
``{train_dir}/target_head.safetensors``, from a loaded model (:meth:`TargetHead.from_model`) or from the checkpoint's
safetensors (:func:`load_target_head_from_safetensors`: only the shards holding the three tensors are opened,
memory-mapped; names under :data:`eagle3.verifier.arch.WRAPPER_PREFIXES`; no ``lm_head`` tensor = tied embeddings).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from eagle3.errors import UserError, validated
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
    """Frozen verifier tensors: ``embed`` ``[V, Ht]``, ``lm_head`` ``[V, Ht]`` (the same tensor when tied),
    ``norm_weight`` ``[Ht]`` and ``norm_eps`` of the final RMSNorm, applied only when ``last_is_post_norm`` is False."""

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
        """``lm_head`` and ``embed`` share storage (saved once)."""
        return (
            self.lm_head.data_ptr() == self.embed.data_ptr()
            and self.lm_head.shape == self.embed.shape
        )

    @classmethod
    def from_model(
        cls, hf_model: torch.nn.Module, last_hidden_state: str = "post_norm"
    ) -> "TargetHead":
        """The head of a loaded HF causal LM (Llama, DeepSeek-V3, multimodal wrappers: an ``AutoModelForCausalLM``,
        which has input and output embeddings), copied to CPU; the final norm is
        :func:`eagle3.verifier.arch.find_final_norm`'s. ``last_hidden_state``: ``data_config.json``'s ``post_norm`` /
        ``pre_norm`` (checked by its reader).

        Raises:
            UserError: no final norm.
        """
        emb_mod = hf_model.get_input_embeddings()
        out_mod = hf_model.get_output_embeddings()
        embed = emb_mod.weight.detach().to("cpu")  # [V, Ht]
        lm_head = (
            embed if out_mod.weight is emb_mod.weight else out_mod.weight.detach().to("cpu")
        )  # [V, Ht]
        norm = find_final_norm(hf_model)
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None)
        if eps is None:
            eps = cfg_get(text_config(getattr(hf_model, "config", None)), "rms_norm_eps", 1e-6)
        post_norm = last_hidden_state == "post_norm"
        return cls(embed, lm_head, norm.weight.detach().to("cpu"), float(eps), post_norm)

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
        """Read ``{train_dir}/target_head.safetensors`` (or that file's path) onto ``device``, floating tensors cast
        to ``dtype`` (None: as stored).

        Raises:
            UserError: missing or corrupt file, or a tensor or metadata key :class:`HeadFile` lacks.
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
            raise _unreadable(path, "corrupt safetensors file", e) from e
        rec = validated(
            HeadFile, {**meta, **tensors}, str(path), "04 writes it: remove it and re-run 04"
        )
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        embed = cast(rec.embed)  # [V, Ht]
        lm_head = embed if rec.tied else cast(rec.lm_head)  # [V, Ht]
        return cls(embed, lm_head, cast(rec.norm_weight), rec.norm_eps, rec.last_is_post_norm)


class HeadFile(BaseModel):
    """The tensors and metadata of ``target_head.safetensors`` (:meth:`TargetHead.save`)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    embed: torch.Tensor
    norm_weight: torch.Tensor
    lm_head: Optional[torch.Tensor] = None
    norm_eps: float
    last_is_post_norm: bool
    tied: bool

    @model_validator(mode="after")
    def _untied_has_lm_head(self):
        if not self.tied and self.lm_head is None:
            raise ValueError("lacks tensor 'lm_head' (metadata says the head is not tied)")
        return self


class SafetensorsIndex(BaseModel):
    """``model.safetensors.index.json``: tensor name -> shard file name (relative to the folder)."""

    weight_map: Annotated[dict[str, str], Field(min_length=1)]


class HeadConfig(BaseModel):
    """The text model's ``config.json`` keys the head tensors must agree with (``text_config`` unwrapped)."""

    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: Optional[bool] = None


def _unreadable(path: Path, what: str, e: Exception) -> UserError:
    """``<path>: <what>: <the first line of e>``."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"{path}: {what}: {first}")


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> shard file name (relative to ``folder``).

    Raises:
        UserError: neither an index nor a single ``model.safetensors`` exists; the index is malformed.
    """
    index = folder / INDEX_FILE
    if index.is_file():
        return validated(
            SafetensorsIndex,
            read_json(index),
            str(index),
            "the checkpoint's index maps tensor names to shard files",
        ).weight_map
    single = folder / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: SINGLE_FILE for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise _unreadable(single, "not a readable safetensors file", e) from e
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


def locate_head_tensors(
    folder: str | os.PathLike, wm: Optional[dict[str, str]] = None
) -> dict[str, Optional[str]]:
    """Names of the embedding, final norm and LM head tensors in a checkpoint folder.

    Returns:
        ``{"embed": name, "norm": name, "lm_head": name or None (tied)}``.

    Raises:
        UserError: the folder is not a safetensors checkpoint, or the embedding / final norm is absent.
    """
    folder = Path(folder)
    wm = wm if wm is not None else _weight_map(folder)
    # The prefix is fixed by where the embedding lives, so a vision tower's own
    # ``*.norm.weight`` or embedding can never be picked for the language model.
    prefix, embed = _find(wm, EMBED_TENSORS, WRAPPER_PREFIXES) or (None, None)
    norm = _find(wm, NORM_TENSORS, (prefix,)) if embed else None
    if norm is None:
        raise UserError(
            f"{folder}: no final norm tensor '{prefix}{NORM_TENSORS[0]}' next to '{embed}'"
            if embed
            else f"{folder}: no token embedding tensor (looked for "
            f"{[p + EMBED_TENSORS[0] for p in WRAPPER_PREFIXES]})"
        )
    # transformers-5 wrappers keep lm_head at the top level, K2.5 under its prefix.
    head = _find(wm, LM_HEAD_TENSORS, (prefix, "") if prefix else ("",))
    return {"embed": embed, "norm": norm[1], "lm_head": head[1] if head else None}


def load_target_head_from_safetensors(
    folder: str | os.PathLike,
    last_hidden_state: str = "post_norm",
    dtype: Optional[torch.dtype] = None,
) -> TargetHead:
    """A :class:`TargetHead` read from a checkpoint folder (``config.json`` + ``model.safetensors[.index.json]``)
    without loading the model: only the shards holding the three tensors are opened.

    Args:
        last_hidden_state: ``"post_norm"`` | ``"pre_norm"``, as the capture backend recorded it (``data_config.json``,
            checked by its reader).
        dtype: cast the tensors to this dtype (None = as stored, usually bf16).

    Raises:
        UserError: missing/malformed ``config.json`` or index, a missing or unreadable tensor or shard, an untied
            config without ``lm_head``, or tensor shapes that disagree with the config.
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    root = read_json(cfg_path)
    cfg = validated(
        HeadConfig,
        text_config(root),
        str(cfg_path),
        "the checkpoint's config.json needs it (in 'text_config' when it nests one)",
    )
    wm = _weight_map(folder)
    names = locate_head_tensors(folder, wm)
    tensors = _read_tensors(folder, wm, [n for n in names.values() if n is not None])
    # by role; no lm_head tensor: the embedding (tied)
    roles = {r: tensors[names[r] or names["embed"]] for r in ("embed", "lm_head", "norm")}
    fault = _config_disagreement(names, roles, cfg_path, cfg, root)
    if fault is not None:
        raise UserError(f"{folder}: {fault}")
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    embed = cast(roles["embed"])  # [V, Ht]
    lm_head = embed if names["lm_head"] is None else cast(roles["lm_head"])  # [V, Ht]
    post_norm = last_hidden_state == "post_norm"
    return TargetHead(embed, lm_head, cast(roles["norm"]), cfg.rms_norm_eps, post_norm)


def _config_disagreement(
    names: dict[str, Optional[str]],
    tensors: dict[str, torch.Tensor],
    cfg_path: Path,
    cfg: HeadConfig,
    root: dict,
) -> Optional[str]:
    """Where the head tensors (``names`` / ``tensors`` by role: ``embed``, ``lm_head`` (the embedding when the
    checkpoint has none), ``norm``) disagree with the checkpoint's ``config.json`` (``cfg_path``; ``cfg``: its text
    config; ``root``: the whole file): no ``lm_head`` tensor though the config says the head is not tied, or a tensor
    shape other than the config's ``[vocab_size, hidden_size]`` / ``[hidden_size]``. None when they agree."""
    tie = cfg.tie_word_embeddings
    if names["lm_head"] is None and (
        tie is False or (tie is None and cfg_get(root, "tie_word_embeddings") is False)
    ):
        return f"no 'lm_head.weight' tensor but {cfg_path} says tie_word_embeddings: false"
    for role, shape in (
        ("embed", (cfg.vocab_size, cfg.hidden_size)),
        ("lm_head", (cfg.vocab_size, cfg.hidden_size)),
        ("norm", (cfg.hidden_size,)),
    ):
        got = tuple(tensors[role].shape)
        if got != shape:
            return f"tensor '{names[role] or names['embed']}' has shape {got}, {cfg_path} implies {shape}"
    return None


def _read_tensors(folder: Path, wm: dict[str, str], names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint in ``folder``, each shard opened once (memory-mapped, on CPU).

    Raises:
        UserError: a shard file is missing or cannot be read (naming it).
    """
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(wm[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for shard, wanted in by_shard.items():
        path = folder / shard
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in wanted:
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise _unreadable(path, f"shard '{shard}' (holding {wanted})", e) from e
    return tensors
