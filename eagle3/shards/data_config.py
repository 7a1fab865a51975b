"""A shard folder's ``data_config.json`` (written last by stage 02: present == complete): the verifier and every
convention needed to read the tensors (:data:`DATA_CONFIG_KEYS`), plus the fp8 storage keys
(:func:`storage_meta`); token-only folders (``eagle3-tokens-v1``) record ``dtype``/``storage_dtype`` ``"none"`` and
``bytes_per_token`` 0 but still the verifier's dims, aux layers and norm convention (04 checks them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from eagle3.errors import UserError
from eagle3.io import atomic_write_json, read_json
from eagle3.shards.format import (
    DATA_CONFIG,
    FORMAT,
    FORMAT_FP8,
    FORMAT_TOKENS,
    FP8_FORMAT_VERSION,
    NUM_HIDDEN_STATES,
)
from eagle3.shards.fp8 import Storage

# data_config.json keys and their JSON types (a bool is never an int here)
DATA_CONFIG_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "verifier": str,
    "architecture": str,
    "num_layers": int,
    "hidden_size": int,
    "vocab_size": int,
    "aux_layers": list,
    "layer_index_convention": str,
    "last_hidden_state": str,
    "dtype": str,
    "max_length": int,
    "rows_per_dir": int,
    "chat_template_hash": (str, type(None)),
    "config_fingerprint": str,
    "prompts_sha256": str,
    "num_samples": int,
    "num_tokens": int,
    "num_loss_tokens": int,
    "bytes_per_token": int,
    "skipped": dict,
}


def write_data_config(root: str | os.PathLike, meta: dict) -> Path:
    """Validate (every key of :data:`DATA_CONFIG_KEYS` with its type and allowed values; extra keys are kept) and
    atomically write ``{root}/data_config.json``; ValueError on a bad dict (a caller bug).
    """
    path = Path(root) / DATA_CONFIG
    problem = _data_config_problem(meta)
    if problem:
        raise ValueError(f"write_data_config: {problem}")
    atomic_write_json(path, meta)
    return path


def _data_config_problem(meta: Any) -> str | None:
    if not isinstance(meta, dict):
        return "top level must be a JSON object"
    for key, typ in DATA_CONFIG_KEYS.items():
        if key not in meta:
            return f"missing key '{key}'"
        v = meta[key]
        if isinstance(v, bool) or not isinstance(v, typ):
            return f"key '{key}' has type {type(v).__name__}"
    if meta["format"] not in (FORMAT, FORMAT_FP8, FORMAT_TOKENS):
        return f"key 'format' is {meta['format']!r}, expected {FORMAT!r}, {FORMAT_FP8!r} or {FORMAT_TOKENS!r}"
    problem = _storage_problem(meta)
    if problem:
        return problem
    if meta["last_hidden_state"] not in ("post_norm", "pre_norm"):
        return f"key 'last_hidden_state' is {meta['last_hidden_state']!r}, expected post_norm or pre_norm"
    aux = meta["aux_layers"]
    if len(aux) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        return f"key 'aux_layers' must be 3 integers, got {aux!r}"
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if meta[key] < 1:
            return f"key '{key}' must be >= 1"
    return None


def _storage_problem(meta: dict) -> str | None:
    """Consistency of ``format``, ``dtype``, ``storage_dtype`` and the fp8 scale keys."""
    dtype = meta.get("storage_dtype", "bfloat16")
    if meta["format"] == FORMAT_TOKENS:
        if dtype != "none" or meta["dtype"] != "none" or meta["bytes_per_token"] != 0:
            return (
                f"key 'storage_dtype': format {FORMAT_TOKENS!r} stores no hidden states (dtype and storage_dtype "
                f"'none', bytes_per_token 0), got {dtype!r}, {meta['dtype']!r}, {meta['bytes_per_token']!r}"
            )
        return None
    if meta["format"] == FORMAT:
        if dtype != "bfloat16" or meta["dtype"] != "bfloat16":
            return f"key 'storage_dtype': format {FORMAT!r} stores bfloat16, got {dtype!r} (dtype {meta['dtype']!r})"
        return None
    if dtype != "float8_e4m3fn" or meta["dtype"] != dtype:
        return f"key 'storage_dtype' is {dtype!r} (dtype {meta['dtype']!r}); format {FORMAT_FP8!r} stores float8_e4m3fn"
    if meta.get("storage_format_version") != FP8_FORMAT_VERSION:
        return f"key 'storage_format_version' is {meta.get('storage_format_version')!r}, this version reads {FP8_FORMAT_VERSION}"
    if meta.get("scale_dtype") != "float32":
        return f"key 'scale_dtype' is {meta.get('scale_dtype')!r}, expected 'float32'"
    try:
        Storage.from_meta(meta).num_blocks(int(meta["hidden_size"]))
    except (ValueError, TypeError) as e:
        return f"key 'scale_scheme'/'scale_block_size': {e}"
    return None


def storage_meta(storage: Storage) -> dict:
    """The ``data_config.json`` storage keys of ``storage`` (bf16: the speculators-v1 ``format`` and ``dtype``)."""
    if not storage.is_fp8:
        return {"format": FORMAT, "dtype": "bfloat16"}
    return {
        "format": FORMAT_FP8,
        "dtype": storage.dtype,
        **storage.to_meta(),
        "storage_format_version": FP8_FORMAT_VERSION,
    }


def tokens_meta() -> dict:
    """The ``data_config.json`` storage keys of token-only samples."""
    return {"format": FORMAT_TOKENS, "dtype": "none", "storage_dtype": "none"}


def is_token_only(meta: dict) -> bool:
    """Whether a validated ``data_config.json`` dict describes token-only samples."""
    return meta.get("format") == FORMAT_TOKENS


def read_data_config(root: str | os.PathLike) -> dict:
    """Read and validate ``{root}/data_config.json`` (``root`` may be the file); UserError naming the problem."""
    path = Path(root)
    if path.is_dir() or not path.name.endswith(".json"):
        path = path / DATA_CONFIG
    meta = read_json(path)
    problem = _data_config_problem(meta)
    if problem:
        raise UserError(f"{path}: {problem}")
    return meta


def expect_from_data_config(meta: dict) -> dict:
    """The ``expect`` of :func:`eagle3.shards.read.load_sample` for a validated ``data_config.json``."""
    if is_token_only(meta):
        return {"vocab_size": int(meta["vocab_size"]), "tokens_only": True}
    st = Storage.from_meta(meta)
    return {
        "hidden_size": int(meta["hidden_size"]),
        "num_hidden_states": len(meta["aux_layers"]) + 1,
        "vocab_size": int(meta["vocab_size"]),
        "storage_dtype": st.dtype,
        **({"scale_blocks": st.num_blocks(int(meta["hidden_size"]))} if st.is_fp8 else {}),
        "aux_layers": [int(i) for i in meta["aux_layers"]],  # named in NaN/Inf errors
        **({"verifier_dtype": str(meta["verifier_dtype"])} if meta.get("verifier_dtype") else {}),
    }


def bytes_per_token(
    hidden_size: int, num_states: int = NUM_HIDDEN_STATES, storage: Storage | None = None
) -> int:
    """Hidden-state bytes per token (:meth:`eagle3.shards.fp8.Storage.bytes_per_token`; default bf16)."""
    return (storage or Storage()).bytes_per_token(hidden_size, num_states)
