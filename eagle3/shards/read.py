"""Reading one sample's shard back: safe load, every key, dtype, shape and value checked (:func:`load_sample`, whose
refusals name the file and key); :func:`hidden_states_bf16` gives bf16 states whatever the storage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from eagle3.errors import UserError
from eagle3.io.read import safe_torch_load
from eagle3.shards.format import (
    FORMAT_TOKENS,
    NONFINITE_FIX,
    NUM_HIDDEN_STATES,
    SHARD_KEYS,
    TOKEN_SHARD_KEYS,
    all_finite,
    hf_layer_name,
)
from eagle3.shards.fp8 import FP8_DTYPE, dequantize, has_nan_fp8


def _bad(path: Path, key: str, msg: str) -> UserError:
    return UserError(f"{path}: key '{key}': {msg}")


def _check_1d_int64(path: Path, obj: dict, key: str) -> torch.Tensor:
    t = obj[key]
    if not isinstance(t, torch.Tensor):
        raise _bad(path, key, f"expected a tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise _bad(path, key, f"dtype {t.dtype}, expected torch.int64")
    if t.dim() != 1:
        raise _bad(path, key, f"shape {tuple(t.shape)}, expected [L]")
    return t


def load_sample(path: str | os.PathLike, expect: dict | None = None) -> dict:
    """Load one ``data_{idx}.pt`` with ``weights_only=True`` and validate it against ``expect`` (any subset of
    :func:`eagle3.shards.data_config.expect_from_data_config`: ``hidden_size``, ``num_hidden_states``, ``vocab_size``,
    ``storage_dtype``, ``scale_blocks``, ``tokens_only``, ``aux_layers``, ``verifier_dtype``).

    Returns:
        ``{"input_ids": int64 [L], "hidden_states": 4 x [L, H], "loss_mask": int64 [L]}`` (bf16, or float8_e4m3fn plus
        ``hidden_scales`` 4 x float32 ``[L, nb]``); token-only: ``input_ids`` and ``loss_mask``.

    Raises:
        UserError (file and key): unreadable or unsafe file, missing key, wrong type, dtype or shape, unequal
        lengths, empty sample, NaN/Inf, id outside the vocab, mask not 0/1, bad fp8 scales.
    """
    path = Path(path)
    obj = safe_torch_load(path)
    if not isinstance(obj, dict):
        raise UserError(
            f"{path}: not a speculators shard (top level is {type(obj).__name__}, expected dict)"
        )
    expect = expect or {}
    tokens_only = bool(expect.get("tokens_only", False))
    _check_keys(path, obj, tokens_only)
    ids, mask = _check_tokens(path, obj)
    if tokens_only:
        _check_vocab(path, ids, expect.get("vocab_size"))
        return {"input_ids": ids, "loss_mask": mask}
    hs, fp8 = _check_hidden_states(path, obj["hidden_states"], ids.numel(), expect)
    _check_vocab(path, ids, expect.get("vocab_size"))
    out = {"input_ids": ids, "hidden_states": list(hs), "loss_mask": mask}
    if fp8:
        out["hidden_scales"] = _check_scales(path, obj, hs, expect.get("scale_blocks"))
    return out


def _check_keys(path: Path, obj: dict, tokens_only: bool) -> None:
    """Every key of the shard's kind is there (token-only: no ``hidden_states``)."""
    if tokens_only and "hidden_states" in obj:
        raise _bad(
            path,
            "hidden_states",
            f"present, but data_config.json says {FORMAT_TOKENS!r} (token-only samples; "
            "shards of another run mixed in?)",
        )
    for key in TOKEN_SHARD_KEYS if tokens_only else SHARD_KEYS:
        if key not in obj:
            raise _bad(path, key, "missing")


def _check_tokens(path: Path, obj: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, loss_mask)``: int64 ``[L]`` each, ``L > 0``, mask 0/1, ids >= 0."""
    ids = _check_1d_int64(path, obj, "input_ids")  # [L]
    mask = _check_1d_int64(path, obj, "loss_mask")  # [L]
    L = ids.numel()
    if L == 0:
        raise _bad(path, "input_ids", "empty sample")
    if mask.numel() != L:
        raise _bad(path, "loss_mask", f"length {mask.numel()} != input_ids length {L}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise _bad(path, "loss_mask", "values must be 0 or 1")
    if bool((ids < 0).any()):
        raise _bad(path, "input_ids", "negative token id")
    return ids, mask


def _check_vocab(path: Path, ids: torch.Tensor, V: int | None) -> None:
    if V is not None and int(ids.max()) >= V:
        raise _bad(path, "input_ids", f"token id {int(ids.max())} >= vocab_size {V}")


def _check_hidden_states(path: Path, hs: Any, L: int, expect: dict) -> tuple[Any, bool]:
    """``(hidden_states, fp8)`` after checking their count, storage dtype, shapes ``[L, H]`` and values."""
    if not isinstance(hs, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hs):
        raise _bad(path, "hidden_states", f"expected a list of tensors, got {type(hs).__name__}")
    n_expected = int(expect.get("num_hidden_states", NUM_HIDDEN_STATES))
    if len(hs) != n_expected:
        raise _bad(
            path, "hidden_states", f"{len(hs)} tensors, expected {n_expected} (3 aux layers + last)"
        )
    fp8 = bool(hs) and hs[0].dtype == FP8_DTYPE
    want_dtype = FP8_DTYPE if fp8 else torch.bfloat16
    if "storage_dtype" in expect and str(want_dtype).split(".")[-1] != expect["storage_dtype"]:
        raise _bad(
            path,
            "hidden_states[0]",
            f"dtype {hs[0].dtype}, but data_config.json says storage_dtype "
            f"{expect['storage_dtype']!r} (shards of another run mixed in, or converted halfway?)",
        )
    for k, h in enumerate(hs):
        _check_state(path, k, h, hs[0], L, want_dtype, expect)
    return hs, fp8


def _check_state(
    path: Path,
    k: int,
    h: torch.Tensor,
    first: torch.Tensor,
    L: int,
    want_dtype: torch.dtype,
    expect: dict,
) -> None:
    """Hidden state ``k``: ``want_dtype``, ``[L, H]`` (``H`` = data_config's and ``first``'s), finite."""
    key = f"hidden_states[{k}]"
    H = expect.get("hidden_size")
    if h.dtype != want_dtype:
        raise _bad(path, key, f"dtype {h.dtype}, expected {want_dtype}")
    if h.dim() != 2 or h.shape[0] != L:
        raise _bad(path, key, f"shape {tuple(h.shape)}, expected [{L}, H] (L = input_ids length)")
    if H is not None and h.shape[1] != H:
        raise _bad(path, key, f"hidden size {h.shape[1]}, data_config says {H}")
    if h.shape[1] != first.shape[1]:
        raise _bad(path, key, f"hidden size {h.shape[1]} != hidden_states[0]'s {first.shape[1]}")
    if has_nan_fp8(h) if want_dtype == FP8_DTYPE else not all_finite(h):
        aux = expect.get("aux_layers")
        what = (
            f" ({hf_layer_name(k, aux)} of the verifier" if aux is not None else " (of the verifier"
        )
        dt = expect.get("verifier_dtype")
        raise _bad(
            path,
            key,
            f"contains NaN/Inf{what}{', captured in ' + dt if dt else ''}): {NONFINITE_FIX} "
            f"(02 with --overwrite), then 03",
        )


def _check_scales(path: Path, obj: dict, hs: list, nb_expected: int | None) -> list[torch.Tensor]:
    """An fp8 shard's ``hidden_scales``: float32 ``[L, nb]`` each, ``nb`` dividing H (data_config's), finite, > 0."""
    sc = obj.get("hidden_scales")
    if sc is None:
        raise _bad(path, "hidden_scales", "missing (fp8 hidden states need their scales)")
    if (
        not isinstance(sc, (list, tuple))
        or len(sc) != len(hs)
        or not all(isinstance(s, torch.Tensor) for s in sc)
    ):
        raise _bad(path, "hidden_scales", f"expected a list of {len(hs)} tensors")
    L, H = hs[0].shape
    for k, s in enumerate(sc):
        key = f"hidden_scales[{k}]"
        if s.dtype != torch.float32:
            raise _bad(path, key, f"dtype {s.dtype}, expected torch.float32")
        nb = s.shape[-1] if s.dim() == 2 else -1
        if s.dim() != 2 or s.shape[0] != L or nb < 1 or H % nb:
            raise _bad(
                path, key, f"shape {tuple(s.shape)}, expected [{L}, nb] with nb dividing {H}"
            )
        if nb_expected is not None and nb != nb_expected:
            raise _bad(path, key, f"{nb} scales per token, data_config.json implies {nb_expected}")
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise _bad(path, key, "scales must be finite and > 0")
    return list(sc)


def hidden_states_bf16(sample: dict) -> list[torch.Tensor]:
    """The 4 hidden states of a :func:`load_sample` result as bf16 ``[L, H]`` (fp8 dequantised on CPU)."""
    hs = sample["hidden_states"]
    if "hidden_scales" not in sample:
        return list(hs)
    return [dequantize(q, sc, torch.bfloat16) for q, sc in zip(hs, sample["hidden_scales"])]
