"""A loaded verifier written as a plain Hugging Face folder an engine loads (``config.json``, ``model.safetensors``,
tokenizer files): what a GGUF-loaded model (the embedded SmolLM2), whose ``save_pretrained`` refuses, needs before
vLLM or SGLang can serve it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.errors import UserError
from eagle3.io import atomic_write_json, disk_full_guard

#: the folder's record of the weights it was written from (``{"verifier_weights": fingerprint}``)
SOURCE_FILE = "eagle3_source.json"

#: config keys of the loaded model that describe how it was loaded, not the model (the GGUF quantizer's record)
LOAD_ONLY_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")


def hf_config_dict(model, dtype: torch.dtype) -> dict:
    """``model.config`` as the ``config.json`` of a plain folder: load-only keys dropped, ``architectures`` set to the
    model's class (a GGUF load leaves it None, and engines pick the model class from it), ``dtype`` and
    ``torch_dtype`` (the older transformers key engines read) set to ``dtype``."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in LOAD_ONLY_KEYS}
    name = str(dtype).replace("torch.", "")
    cfg.update(architectures=[type(model).__name__], dtype=name, torch_dtype=name)
    return cfg


def write_hf_folder(
    model,
    tokenizer,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    source_weights: str | None = None,
) -> Path:
    """Write ``model`` (a transformers causal LM) and ``tokenizer`` to ``out_dir`` as an HF folder, weights in ``dtype``.

    ``source_weights``: the ``verifier_weights`` fingerprint of the files ``model`` was loaded from
    (:func:`eagle3.verifier.load.weights_fingerprint`), recorded in :data:`SOURCE_FILE` so that a server of this
    folder is known to serve those weights (05 ``--server``'s served-model check).

    Tied weights are written once (``lm_head.weight`` is left out when ``tie_word_embeddings``), as safetensors
    requires. The folder is written beside ``out_dir`` as ``.{name}.tmp`` and renamed into place; an earlier folder
    is first renamed to ``.{name}.old`` and removed after, so a crash never leaves a half-written ``out_dir``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        UserError: ``out_dir`` exists and holds no ``config.json`` (never replace what is not a model folder).
    """
    out = Path(out_dir)
    if out.exists() and not (out / "config.json").is_file():
        raise UserError(
            f"{out}: exists and is not a model folder (no config.json); choose another folder"
        )
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    with disk_full_guard(tmp / "model.safetensors"):
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
    atomic_write_json(tmp / "config.json", hf_config_dict(model, dtype))
    if source_weights:
        atomic_write_json(tmp / SOURCE_FILE, {"verifier_weights": source_weights})
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        atomic_write_json(tmp / "generation_config.json", gen.to_diff_dict())
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def source_weights(folder: str | os.PathLike) -> str | None:
    """The ``verifier_weights`` fingerprint :func:`write_hf_folder` recorded in ``folder``, or None (no record)."""
    try:
        rec = json.loads((Path(folder) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    fp = rec.get("verifier_weights") if isinstance(rec, dict) else None
    return fp if isinstance(fp, str) else None
