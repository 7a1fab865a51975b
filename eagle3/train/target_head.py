"""The verifier's token embedding, LM head and final norm: everything training needs from the verifier.

Training computes the verifier's next-token distribution ``p_t = softmax(lm_head(norm?(last_t)))``
from the captured last hidden state, and copies the (frozen) token embedding into the drafter.
Both are a few hundred MB even for Kimi-K2.5 (163840 x 7168), so stage 04 extracts them once into
``{train_dir}/target_head.safetensors`` and never reloads the full verifier on resume.

The final norm is applied only when the capture recorded ``last_hidden_state: "pre_norm"``
(DESIGN.md "Last hidden state"; HF Llama returns the post-norm state as ``hidden_states[-1]``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3.errors import UserError
from eagle3.io import atomic_path
from eagle3.io.read import file_not_found

FILENAME = "target_head.safetensors"


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
        norm = _find_final_norm(hf_model)
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
            from safetensors import safe_open

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


def _find_final_norm(hf_model: torch.nn.Module) -> torch.nn.Module:
    """The verifier's final norm module (searched on the decoder body, then by name)."""
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
        for name in ("norm", "final_layernorm", "ln_f"):
            m = getattr(base, name, None)
            if isinstance(m, torch.nn.Module) and getattr(m, "weight", None) is not None:
                candidates.append(m)
    if not candidates:
        # multimodal wrappers: the last module named '*.norm' outside the layers
        for name, m in hf_model.named_modules():
            if (
                name.split(".")[-1] in ("norm", "final_layernorm", "ln_f")
                and ".layers." not in name
            ):
                candidates.append(m)
    if not candidates:
        raise UserError(
            f"verifier {type(hf_model).__name__}: final norm not found (looked for 'norm', 'final_layernorm', 'ln_f')"
        )
    return candidates[0]
