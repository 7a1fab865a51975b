"""A shard folder's ``data_config.json`` (written last by stage 02: present == complete): the verifier and every
convention needed to read the tensors (:data:`DATA_CONFIG_KEYS`), plus the fp8 storage keys
(:func:`storage_meta`); token-only folders (``eagle3-tokens-v1``) record ``dtype``/``storage_dtype`` ``"none"`` and
``bytes_per_token`` 0 but still the verifier's dims, aux layers and norm convention (04 checks them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from eagle3.errors import validated
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

PositiveInt = Annotated[StrictInt, Field(ge=1)]


class DataConfigRecord(BaseModel):
    """``data_config.json``'s keys and JSON types (a bool is never an int here; other keys are kept), and the storage
    keys consistent with ``format`` (:func:`_storage_problem`)."""

    model_config = ConfigDict(extra="allow", strict=True)

    format: Literal[FORMAT, FORMAT_FP8, FORMAT_TOKENS]
    verifier: str
    architecture: str
    num_layers: PositiveInt
    hidden_size: PositiveInt
    vocab_size: PositiveInt
    aux_layers: Annotated[list[StrictInt], Field(min_length=3, max_length=3)]
    layer_index_convention: str
    last_hidden_state: Literal["post_norm", "pre_norm"]
    dtype: str
    max_length: int
    rows_per_dir: int
    chat_template_hash: Optional[str]
    config_fingerprint: str
    prompts_sha256: str
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    bytes_per_token: int
    skipped: dict

    @model_validator(mode="after")
    def _storage_keys(self):
        problem = _storage_problem(self.model_dump())
        if problem:
            raise ValueError(problem)
        return self


def write_data_config(root: str | os.PathLike, meta: dict) -> Path:
    """Validate (:class:`DataConfigRecord`; extra keys are kept) and atomically write ``{root}/data_config.json``;
    ``pydantic.ValidationError`` (a ValueError) on a bad dict (a caller bug).
    """
    path = Path(root) / DATA_CONFIG
    DataConfigRecord.model_validate(meta)
    atomic_write_json(path, meta)
    return path


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
    validated(DataConfigRecord, meta, str(path), "02_extract_hidden.py writes it")
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
