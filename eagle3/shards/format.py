"""Hidden-state shards in the vLLM speculators v1 layout, and their ``data_config.json``.

One ``torch.save`` dict per sample (FIELD-NOTES section 5, speculators v1)::

    {shards_dir}/rows_{start}-{end}/data_{idx}.pt     start = idx // rows_per_dir * rows_per_dir
    {
      "input_ids":     int64 [L]            verifier token ids
      "hidden_states": [4 x bf16 [L, H]]    aux1, aux2, aux3 (HF hidden_states indices), last
      "loss_mask":     int64 [L]            1 on assistant-reply tokens
    }

Readers also accept the flat speculators folder ``{dir}/data_{idx}.pt``. Files whose name
contains ``.tmp-`` are unfinished atomic writes (``eagle3.io``) and are ignored. Every shard is
written atomically, so a shard file that exists is complete.

fp8 storage (``extract.storage_dtype: float8_e4m3fn``, format ``eagle3-fp8-v1``; :mod:`eagle3.shards.fp8`)
keeps the same dict, with ``hidden_states`` as 4 x float8_e4m3fn ``[L, H]`` and one more key
``hidden_scales``: 4 x float32 ``[L, nb]`` (``nb`` = 1 per token, or ``H / block_size``), so that
``h = hidden_states[k].float() * scale`` per block. ``data_config.json`` records it
(``storage_dtype``, ``scale_scheme``, ``scale_block_size``, ``scale_dtype``, ``storage_format_version``).

Token-only samples (format ``eagle3-tokens-v1``, ``train.hidden_states: online``): the same file
names and layout, each dict only ``{"input_ids": int64 [L], "loss_mask": int64 [L]}`` (16 bytes per
token): stage 04 computes the hidden states itself (:mod:`eagle3.train.online`). ``data_config.json``
then has ``format: eagle3-tokens-v1``, ``dtype``/``storage_dtype`` ``"none"``, ``bytes_per_token`` 0
(hidden-state bytes), and still the verifier's dims, aux layers and norm convention, which 04 checks
against the verifier it runs.

``data_config.json`` (written last by stage 02) records the verifier and every convention
needed to interpret the tensors; see :func:`write_data_config` for the keys.
"""

from __future__ import annotations

import array
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.errors import UserError
from eagle3.io import TMP_MARK, atomic_torch_save, atomic_write_json, read_json
from eagle3.io.read import safe_torch_load
from eagle3.shards.fp8 import (
    FP8_DTYPE,
    SCALE_DTYPE,
    Storage,
    dequantize,
    has_nan_fp8,
    quantize_unchecked,
    scales_finite,
)

FORMAT = "speculators-v1"
FORMAT_FP8 = "eagle3-fp8-v1"  # speculators-v1 layout + fp8 hidden states + "hidden_scales"
FP8_FORMAT_VERSION = 1
FORMAT_TOKENS = (
    "eagle3-tokens-v1"  # input_ids + loss_mask only: stage 04 computes the states (online training)
)
#: token-only samples from which 02 writes and 03 validates them in worker processes: a token-only file costs its
#: (un)pickler, which holds the GIL (threads: ~750 / ~630 files/s on the 16-core H200 machine, lease 2026-12-02b)
TOKEN_PROCESS_MIN = 2048
TOKEN_SHARD_KEYS = ("input_ids", "loss_mask")
TOKEN_BYTES_PER_TOKEN = 16  # int64 input_ids + int64 loss_mask
DATA_CONFIG = "data_config.json"
#: 02's lock file in the shards folder, held (``flock``) while 02 writes there; 03 stops while it is held.
EXTRACT_LOCK = ".extract.lock"
SHARD_KEYS = ("input_ids", "hidden_states", "loss_mask")
NUM_HIDDEN_STATES = 4  # three aux states + last
LAYER_INDEX_CONVENTION = (
    "HF hidden_states index: 0 = embeddings, i = output of decoder layer i-1 = residual stream "
    "entering decoder layer i; hidden_states[3] is HF hidden_states[-1]"
)
_NAME_RE = re.compile(r"^data_(\d+)\.pt$")
_ROWS_RE = re.compile(r"^rows_(\d+)-(\d+)$")

#: data_config.json keys and their JSON types (bool is checked before int where it matters).
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


def shard_path(root: str | os.PathLike, idx: int, rows_per_dir: int) -> Path:
    """Path of sample ``idx``: ``{root}/rows_{start}-{start+rows_per_dir}/data_{idx}.pt``.

    ``start = idx // rows_per_dir * rows_per_dir`` (SpecForge/speculators folder sharding, which
    keeps directories small enough for network file systems).

    Raises:
        ValueError: ``idx < 0`` or ``rows_per_dir < 1`` (a caller bug).
    """
    if idx < 0 or rows_per_dir < 1:
        raise ValueError(f"shard_path: idx={idx} rows_per_dir={rows_per_dir}")
    start = idx // rows_per_dir * rows_per_dir
    return Path(root) / f"rows_{start}-{start + rows_per_dir}" / f"data_{idx}.pt"


def _as_int64(x: Any) -> torch.Tensor:
    if isinstance(x, list) and x:
        try:  # ~20x faster than torch.as_tensor on a list of Python ints; same int64 values
            return torch.frombuffer(array.array("q", x), dtype=torch.int64)  # [L]
        except (TypeError, OverflowError):
            pass  # floats and the like: as_tensor below gives the error
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise ValueError(f"expected integer ids, got {t.dtype}")
    t = t.to(torch.int64).reshape(-1)  # [L]
    return t.clone() if isinstance(x, torch.Tensor) else t  # a list gave a fresh tensor already


@dataclass(frozen=True)
class StoredStates:
    """One sample's hidden states already in their stored form (what :func:`encode_batch` gives the
    HF capture backend per batch on the device, sliced per sample on the host).

    Attributes:
        hidden_states: 4 x ``[L, H]``: bf16 (speculators-v1) or float8_e4m3fn (fp8 storage); may be
            views into a larger batch buffer (:func:`shard_object` copies them out).
        hidden_scales: fp8 only: 4 x float32 ``[L, nb]`` (:func:`eagle3.shards.fp8.quantize_unchecked`); None for bf16.
        source_finite: bf16 only: True when the producer has checked every value finite (one device
            reduction per batch), so the writer skips its own check; False = the writer checks.
            fp8 shards are always checked through their scales (finite exactly when the source was).
    """

    hidden_states: list
    hidden_scales: Optional[list] = None
    source_finite: bool = False


def encode_batch(
    pack: torch.Tensor, storage: Storage | None = None
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The stored form of a whole captured batch, on ``pack``'s device, without any host sync.

    Stage 02's HF backend calls this on the GPU before the device -> host copy, so the writer
    threads get finished tensors: no per-shard float conversion, NaN/Inf scan or fp8 quantisation
    on the CPU, and for fp8 half the bytes cross PCIe. Per row the same operations as
    :func:`shard_object`'s own path, so the shard bytes are the same.

    Args:
        pack: bf16 ``[4, T, H]`` (the batch's samples back to back, padding removed).
        storage: None/bf16 or fp8 (:mod:`eagle3.shards.fp8`).

    Returns:
        ``(values, scales, finite)``: bf16: ``(pack, None, finite)`` with ``finite`` a 0-dim bool
        tensor (every value finite); fp8: ``(q float8_e4m3fn [4, T, H], scales float32 [4, T, nb],
        finite)``, where ``finite`` is also what the scales say (non-finite input gives non-finite scales).
    """
    if storage is None or not storage.is_fp8:
        return pack, None, torch.isfinite(pack).all()  # [4, T, H] -> 0-dim bool
    n, T, H = pack.shape
    nb = storage.num_blocks(H)
    q = torch.empty((n, T, H), dtype=FP8_DTYPE, device=pack.device)  # [4, T, H]
    sc = torch.empty((n, T, nb), dtype=SCALE_DTYPE, device=pack.device)  # [4, T, nb]
    for k in range(n):  # one state at a time: the float32 temporaries stay [T, H]
        quantize_unchecked(pack[k], nb, out=(q[k], sc[k]))
    return q, sc, torch.isfinite(sc).all()


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, contiguous, as a tensor whose storage is exactly its own bytes.

    ``torch.save`` stores a view's WHOLE storage (e.g. the pinned batch buffer a capture slice
    points into), so a view is re-wrapped: a tensor over just its byte range of the same memory
    (``torch.frombuffer``, which keeps the buffer alive), not a copy. Copying would cost a fresh
    allocation and its page faults per shard, the largest single cost of the writer thread after
    sha256 (``bench/extract_throughput.py --writer-only``). Same values, same ``torch.save`` bytes.
    """
    t = t.detach().to("cpu").contiguous()
    nbytes = t.numel() * t.element_size()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    if nbytes == 0:
        return t.clone()
    whole = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())  # [storage bytes]
    start = t.storage_offset() * t.element_size()
    return torch.frombuffer(memoryview(whole.numpy())[start : start + nbytes], dtype=t.dtype).view(
        t.shape
    )


def _check_shape(
    idx: int, k: int, h: torch.Tensor, L: int, what: str = "hidden_states", cols=None
) -> None:
    if h.dim() != 2 or h.shape[0] != L or (cols is not None and h.shape[1] != cols):
        want = f"[{L}, {'H' if cols is None else cols}]"
        raise ValueError(f"sample {idx}: {what}[{k}] has shape {tuple(h.shape)}, expected {want}")


NONFINITE_FIX = (
    "the verifier overflows in this dtype (float16 is the usual cause): run it in bfloat16 or float32 "
    "(verifier.dtype) and re-run"
)


def hf_layer_name(k: int, aux_layers: Optional[Sequence[int]]) -> str:
    """Which verifier state stored hidden state ``k`` is: ``HF hidden_states[i]`` for an aux layer
    (the capture convention, DESIGN.md "Aux layers"), ``the last hidden state`` for ``k == len(aux)``."""
    if aux_layers is not None and k < len(aux_layers):
        return f"HF hidden_states[{int(aux_layers[k])}]"
    return "the last hidden state" if aux_layers is not None else f"hidden state {k}"


class NonFiniteStates(UserError, ValueError):
    """Captured hidden states with NaN/Inf: one line naming the sample (idx, conversation id), the
    state (stored index and HF ``hidden_states`` index / last), the verifier dtype and the fix.

    Raised by :func:`shard_object` (before any byte of the shard is written) with what it knows
    (``idx``, ``k``); stage 02 adds the rest with :meth:`explained`. A ``UserError``: the CLIs print
    ``error: ...`` and exit 2 (bad numbers from the verifier are an input problem, not a crash).
    """

    def __init__(
        self,
        idx: int,
        k: int,
        sample_id: Optional[str] = None,
        aux_layers: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
    ):
        self.idx, self.k, self.sample_id, self.aux_layers, self.dtype = (
            int(idx),
            int(k),
            sample_id,
            aux_layers,
            dtype,
        )
        conv = f" (conversation '{sample_id}')" if sample_id is not None else ""
        where = f" = {hf_layer_name(self.k, aux_layers)}" if aux_layers is not None else ""
        dt = f" with verifier.dtype {dtype}" if dtype else ""
        super().__init__(
            f"sample {self.idx}{conv}: hidden_states[{self.k}]{where} has NaN/Inf{dt}; {NONFINITE_FIX}"
        )

    def explained(
        self,
        sample_id: Optional[str] = None,
        aux_layers: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
    ) -> "NonFiniteStates":
        """The same error with the fields the caller knows filled in (those already set are kept)."""
        return NonFiniteStates(
            self.idx,
            self.k,
            self.sample_id if self.sample_id is not None else sample_id,
            self.aux_layers if self.aux_layers is not None else aux_layers,
            self.dtype or dtype,
        )


def _nonfinite(idx: int, k: int) -> NonFiniteStates:
    return NonFiniteStates(idx, k)


def shard_object(
    input_ids: Sequence[int] | torch.Tensor,
    hidden_states: Sequence[torch.Tensor] | StoredStates | None,
    loss_mask: Sequence[int] | torch.Tensor,
    storage: Storage | None = None,
    idx: int = 0,
) -> dict:
    """The dict :func:`write_sample` saves for one sample (validated and converted; nothing written).

    Args:
        input_ids: ``[L]`` token ids (any integer dtype; stored int64).
        hidden_states: 4 tensors ``[L, H]`` (aux1, aux2, aux3, last); stored bf16 (fp8 storage:
            quantised here with :func:`eagle3.shards.fp8.quantize_unchecked`, plus ``hidden_scales``).
            Or a :class:`StoredStates` already in the stored form of ``storage`` (from
            :func:`encode_batch`): only checked (shapes, dtypes, NaN/Inf through the scales or,
            unless ``source_finite``, the values) and copied out of their batch buffer. A tensor
            that is a view into a larger storage is re-wrapped over its own bytes (:func:`_own`),
            because ``torch.save`` stores a view's whole storage. None: a token-only sample
            (``eagle3-tokens-v1``: ``{"input_ids", "loss_mask"}`` only; ``storage`` is ignored).
        loss_mask: ``[L]`` 0/1 (stored int64).
        storage: ``None``/bf16 = speculators-v1; fp8 = float8_e4m3fn values + ``hidden_scales``.
        idx: the sample's idx (named in errors).

    Raises:
        NonFiniteStates: NaN/Inf in a state (``sample {idx}: hidden_states[{k}] has NaN/Inf; ...``,
            a UserError: the verifier overflowed, see :class:`NonFiniteStates`).
        ValueError: wrong count, shape or dtype (a caller bug).
    """
    ids = _as_int64(input_ids)  # [L]
    mask = _as_int64(loss_mask)  # [L]
    L = ids.numel()
    if mask.numel() != L:
        raise ValueError(f"sample {idx}: loss_mask has {mask.numel()} entries, input_ids {L}")
    if hidden_states is None:
        return {"input_ids": ids, "loss_mask": mask}
    fp8 = storage is not None and storage.is_fp8
    if isinstance(hidden_states, StoredStates):
        return _stored_object(ids, mask, hidden_states, storage, idx)
    if len(hidden_states) != NUM_HIDDEN_STATES:
        raise ValueError(
            f"sample {idx}: {len(hidden_states)} hidden states, expected {NUM_HIDDEN_STATES}"
        )
    hs = []
    for k, h in enumerate(hidden_states):
        _check_shape(idx, k, h, L)
        hb = _own(h.detach().to(torch.bfloat16))  # [L, H]
        if not all_finite(hb):  # one float32 sum; the exact scan only when that sum is not finite
            raise _nonfinite(idx, k)
        hs.append(hb)
    obj = {"input_ids": ids, "hidden_states": hs, "loss_mask": mask}
    if fp8:
        nb = storage.num_blocks(hs[0].shape[1])
        pairs = [
            quantize_unchecked(h, nb) for h in hs
        ]  # [L, H] fp8, [L, nb] fp32 (input checked above)
        obj["hidden_states"] = [q for q, _ in pairs]
        obj["hidden_scales"] = [sc for _, sc in pairs]
    return obj


def _stored_object(
    ids: torch.Tensor, mask: torch.Tensor, st: StoredStates, storage: Storage | None, idx: int
) -> dict:
    """:func:`shard_object` for states already in stored form: check, copy out of the batch buffer."""
    L = ids.numel()
    fp8 = storage is not None and storage.is_fp8
    hs, scs = list(st.hidden_states), st.hidden_scales
    if len(hs) != NUM_HIDDEN_STATES:
        raise ValueError(f"sample {idx}: {len(hs)} hidden states, expected {NUM_HIDDEN_STATES}")
    want = FP8_DTYPE if fp8 else torch.bfloat16
    if (scs is not None) != fp8 or (fp8 and len(scs) != len(hs)):
        raise ValueError(
            f"sample {idx}: stored states {'without' if fp8 else 'with'} scales for "
            f"{'fp8' if fp8 else 'bf16'} storage"
        )
    H = hs[0].shape[-1]
    nb = storage.num_blocks(H) if fp8 else None
    out_h, out_s = [], []
    for k, h in enumerate(hs):
        _check_shape(idx, k, h, L, cols=H)
        if h.dtype != want:
            raise ValueError(f"sample {idx}: hidden_states[{k}] is {h.dtype}, storage wants {want}")
        if fp8:
            sc = scs[k]
            _check_shape(idx, k, sc, L, what="hidden_scales", cols=nb)
            if sc.dtype != SCALE_DTYPE:
                raise ValueError(
                    f"sample {idx}: hidden_scales[{k}] is {sc.dtype}, expected {SCALE_DTYPE}"
                )
            sc = _own(sc)  # [L, nb]
            if not scales_finite(
                sc
            ):  # finite scales <=> finite source (eagle3.shards.fp8.quantize_unchecked)
                raise _nonfinite(idx, k)
            out_s.append(sc)
        hb = _own(h)  # [L, H]
        if not fp8 and not st.source_finite and not all_finite(hb):
            raise _nonfinite(idx, k)
        out_h.append(hb)
    obj = {"input_ids": ids, "hidden_states": out_h, "loss_mask": mask}
    if fp8:
        obj["hidden_scales"] = out_s
    return obj


#: Shards are written by torch's C++ writer straight to their temporary file
#: (:func:`eagle3.io.atomic_torch_save` ``via_path=True``: few GIL round trips, so stage 02's writer
#: threads are not starved by the capture loop); False streams them through a Python file object
#: (the writer before; ``bench/extract_throughput.py --stream-save`` times both in one run). Same bytes.
SAVE_VIA_PATH = True


def write_sample(
    root: str | os.PathLike,
    idx: int,
    rows_per_dir: int,
    input_ids: Sequence[int] | torch.Tensor,
    hidden_states: Sequence[torch.Tensor] | StoredStates | None,
    loss_mask: Sequence[int] | torch.Tensor,
    storage: Storage | None = None,
    hasher=None,
) -> Path:
    """Write one sample atomically (:func:`shard_object` saved with ``torch.save``) and return its path.

    Args:
        input_ids, hidden_states, loss_mask, storage: see :func:`shard_object`.
        hasher: e.g. ``xxhash.xxh3_128()``, updated with the file's bytes.

    Raises:
        ValueError: wrong count, shape or non-finite values (a caller bug: capture must
            never produce them).
    """
    obj = shard_object(input_ids, hidden_states, loss_mask, storage, idx=idx)
    path = shard_path(root, idx, rows_per_dir)
    atomic_torch_save(obj, path, hasher=hasher, via_path=SAVE_VIA_PATH)
    return path


def hidden_states_bf16(sample: dict) -> list[torch.Tensor]:
    """The 4 hidden states of a :func:`load_sample` result as bf16 ``[L, H]`` (fp8 dequantised on CPU)."""
    hs = sample["hidden_states"]
    if "hidden_scales" not in sample:
        return list(hs)
    return [dequantize(q, sc, torch.bfloat16) for q, sc in zip(hs, sample["hidden_scales"])]


def list_samples(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """All finished samples under ``root`` as ``(idx, path)`` sorted by idx.

    Accepts the nested layout (``rows_*/data_{idx}.pt``) and the flat speculators layout
    (``data_{idx}.pt``), even mixed. Unfinished atomic writes (``*.tmp-*``) are ignored.

    Raises:
        UserError: ``root`` is not a folder, or the same idx appears twice.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root}: shards folder not found")
    found: dict[int, Path] = {}

    def visit(folder: Path) -> None:
        for entry in os.scandir(folder):
            name = entry.name
            if TMP_MARK in name:
                continue
            m = _NAME_RE.match(name)
            if m and entry.is_file():
                idx = int(m.group(1))
                if idx in found:
                    raise UserError(f"{entry.path}: sample {idx} also stored as {found[idx]}")
                found[idx] = Path(entry.path)

    visit(root)
    for entry in os.scandir(root):
        if entry.is_dir() and _ROWS_RE.match(entry.name):
            visit(Path(entry.path))
    return sorted(found.items())


def all_finite(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite.

    Fast path: a float32 sum of finite values can only be non-finite by overflow, and any NaN or
    +-Inf makes the sum NaN or Inf; so a finite sum proves every element finite (one reduction, ~10x
    faster than ``isfinite(t).all()`` on bf16). A non-finite sum falls back to the exact check.
    """
    if bool(torch.isfinite(t.float().sum())):  # [L, H] -> scalar
        return True
    return bool(torch.isfinite(t).all())


def is_token_only(meta: dict) -> bool:
    """Whether a validated ``data_config.json`` dict describes token-only samples (``eagle3-tokens-v1``)."""
    return meta.get("format") == FORMAT_TOKENS


def tokens_meta() -> dict:
    """The ``data_config.json`` storage keys of token-only samples (the counterpart of :func:`storage_meta`)."""
    return {"format": FORMAT_TOKENS, "dtype": "none", "storage_dtype": "none"}


def expect_from_data_config(meta: dict) -> dict:
    """The ``expect`` dict for :func:`load_sample` from a validated ``data_config.json`` dict."""
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
    """Load one shard with ``weights_only=True`` and validate it.

    Args:
        path: a ``data_{idx}.pt`` file.
        expect: optional ``{"hidden_size": H, "num_hidden_states": 4, "vocab_size": V,
            "storage_dtype": "bfloat16"|"float8_e4m3fn", "scale_blocks": nb, "tokens_only": bool}``
            (any subset; see :func:`expect_from_data_config`) checked against the tensors.
            ``tokens_only`` True: the shard must be token-only (no ``hidden_states``); False or
            absent: it must hold hidden states.

    Returns:
        ``{"input_ids": int64 [L], "hidden_states": [4 x bf16 [L, H]], "loss_mask": int64 [L]}``;
        fp8 shards: ``hidden_states`` are float8_e4m3fn ``[L, H]`` and ``hidden_scales``
        (4 x float32 ``[L, nb]``) is added (:func:`hidden_states_bf16` dequantises); token-only
        shards: ``{"input_ids", "loss_mask"}`` only.

    Raises:
        UserError: naming the file and key: unreadable/truncated/unsafe pickle, not a dict,
            missing key, wrong type/dtype/rank, unequal lengths, empty sample, wrong number of
            hidden states or hidden size, NaN/Inf, token id outside the vocab, mask not 0/1;
            fp8: storage dtype other than data_config's, missing/misshaped/non-finite/non-positive scales.
    """
    path = Path(path)
    obj = safe_torch_load(path)
    if not isinstance(obj, dict):
        raise UserError(
            f"{path}: not a speculators shard (top level is {type(obj).__name__}, expected dict)"
        )
    expect = expect or {}
    tokens_only = bool(expect.get("tokens_only", False))
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
    if tokens_only:
        V = expect.get("vocab_size")
        if V is not None and int(ids.max()) >= V:
            raise _bad(path, "input_ids", f"token id {int(ids.max())} >= vocab_size {V}")
        return {"input_ids": ids, "loss_mask": mask}
    hs = obj["hidden_states"]
    if not isinstance(hs, (list, tuple)) or not all(isinstance(h, torch.Tensor) for h in hs):
        raise _bad(path, "hidden_states", f"expected a list of tensors, got {type(hs).__name__}")
    n_expected = int(expect.get("num_hidden_states", NUM_HIDDEN_STATES))
    if len(hs) != n_expected:
        raise _bad(
            path, "hidden_states", f"{len(hs)} tensors, expected {n_expected} (3 aux layers + last)"
        )
    H = expect.get("hidden_size")
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
        key = f"hidden_states[{k}]"
        if h.dtype != want_dtype:
            raise _bad(path, key, f"dtype {h.dtype}, expected {want_dtype}")
        if h.dim() != 2 or h.shape[0] != L:
            raise _bad(
                path, key, f"shape {tuple(h.shape)}, expected [{L}, H] (L = input_ids length)"
            )
        if H is not None and h.shape[1] != H:
            raise _bad(path, key, f"hidden size {h.shape[1]}, data_config says {H}")
        if h.shape[1] != hs[0].shape[1]:
            raise _bad(
                path, key, f"hidden size {h.shape[1]} != hidden_states[0]'s {hs[0].shape[1]}"
            )
        if has_nan_fp8(h) if fp8 else not all_finite(h):
            aux = expect.get("aux_layers")
            what = (
                f" ({hf_layer_name(k, aux)} of the verifier"
                if aux is not None
                else " (of the verifier"
            )
            dt = expect.get("verifier_dtype")
            raise _bad(
                path,
                key,
                f"contains NaN/Inf{what}{', captured in ' + dt if dt else ''}): {NONFINITE_FIX} "
                f"(02 with --overwrite), then 03",
            )
    V = expect.get("vocab_size")
    if V is not None and int(ids.max()) >= V:
        raise _bad(path, "input_ids", f"token id {int(ids.max())} >= vocab_size {V}")
    out = {"input_ids": ids, "hidden_states": list(hs), "loss_mask": mask}
    if fp8:
        out["hidden_scales"] = _check_scales(path, obj, hs, expect.get("scale_blocks"))
    return out


def _check_scales(path: Path, obj: dict, hs: list, nb_expected: int | None) -> list[torch.Tensor]:
    """Validate ``hidden_scales`` of an fp8 shard: one float32 ``[L, nb]`` per hidden state, ``nb``
    dividing H (and equal to data_config's when given), finite and > 0."""
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


def write_data_config(root: str | os.PathLike, meta: dict) -> Path:
    """Validate and atomically write ``{root}/data_config.json``.

    Keys (all required; see :data:`DATA_CONFIG_KEYS`): ``format`` ("speculators-v1"),
    ``verifier`` (id = ``verifier.display_name()``), ``architecture``, ``num_layers``,
    ``hidden_size``, ``vocab_size``, ``aux_layers`` (HF indices), ``layer_index_convention``,
    ``last_hidden_state`` ("post_norm"|"pre_norm"), ``dtype`` ("bfloat16"), ``max_length``,
    ``rows_per_dir``, ``chat_template_hash``, ``config_fingerprint``, ``prompts_sha256``,
    ``num_samples``, ``num_tokens``, ``num_loss_tokens``, ``bytes_per_token``
    (= 4 * H * 2 for bf16), ``skipped`` (reason -> count). Extra keys are kept.

    Raises:
        ValueError: a key is missing or has the wrong type (a caller bug).
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
    """Consistency of ``format`` / ``dtype`` / ``storage_dtype`` and the fp8 scale keys."""
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
    """The ``data_config.json`` keys that describe ``storage``: ``format``, ``dtype`` and, for fp8,
    ``storage_dtype``, ``scale_scheme``, ``scale_block_size``, ``scale_dtype``, ``storage_format_version``.
    bf16 gives exactly the speculators-v1 keys (``format``, ``dtype``)."""
    if not storage.is_fp8:
        return {"format": FORMAT, "dtype": "bfloat16"}
    return {
        "format": FORMAT_FP8,
        "dtype": storage.dtype,
        **storage.to_meta(),
        "storage_format_version": FP8_FORMAT_VERSION,
    }


def read_data_config(root: str | os.PathLike) -> dict:
    """Read and validate ``{root}/data_config.json`` (``root`` may also be the file itself).

    Raises:
        UserError: missing file, malformed JSON, or a missing/wrongly typed key (named).
    """
    path = Path(root)
    if path.is_dir() or not path.name.endswith(".json"):
        path = path / DATA_CONFIG
    meta = read_json(path)
    problem = _data_config_problem(meta)
    if problem:
        raise UserError(f"{path}: {problem}")
    return meta


def bytes_per_token(
    hidden_size: int, num_states: int = NUM_HIDDEN_STATES, storage: Storage | None = None
) -> int:
    """Hidden-state bytes per token: bf16 ``num_states * H * 2`` (H = 7168 -> 57344); fp8
    ``num_states * (H + 4 nb)`` (per-token scales, H = 7168 -> 28688)."""
    return (storage or Storage()).bytes_per_token(hidden_size, num_states)


def check_verifier(verifier: Any, meta: dict, root: str | os.PathLike) -> Optional[str]:
    """Refuse a config whose verifier is not the one the shards were captured with (03, 04, 04 --export-only).

    Checked before any shape: a config pointing at another verifier otherwise fails later on a symptom (a hidden
    size, an aux layer out of range) that names a setting the user never changed. Then, when 02 recorded it, the
    content fingerprint of the weight files (``verifier_weights``, :func:`eagle3.verifier.load.weights_fingerprint`): a
    ``verifier.path`` pointed at another model of the same shapes under the old ``verifier.name`` trained without
    an error, against the other model's lm_head (fresh-user trial 2026-12-05f: val top-1 0.000, exit 0).

    Args:
        verifier: the config's ``verifier`` section (its ``display_name()`` is what 02 records).
        meta: the shards' ``data_config.json``.
        root: the shards folder (or the file itself), for the message.

    Returns:
        None when the weights were compared, or there is nothing here to compare (``verifier.path`` holds no weight
        file on this machine; ``verifier`` is no config section); else (the shards record no ``verifier_weights``:
        captured before 2026-12-05f) the one warning line saying they were not compared and how to check by hand:
        that skip was silent. The caller logs it (rank 0).

    Raises:
        UserError: ``<data_config.json>: key 'verifier' is 'a' but the config's verifier is 'b' (verifier.name /
            verifier.path); re-run 02 for this verifier``.
    """
    path = Path(root)
    if path.is_dir() or not path.name.endswith(".json"):
        path = path / DATA_CONFIG
    want = verifier.display_name()
    if meta.get("verifier") != want:
        raise UserError(
            f"{path}: key 'verifier' is {meta.get('verifier')!r} but the config's verifier is {want!r} "
            "(verifier.name / verifier.path); re-run 02 for this verifier"
        )
    recorded = meta.get("verifier_weights")
    if not hasattr(verifier, "resolved_path"):
        return None
    from eagle3.verifier.load import weights_differ, weights_fingerprint

    now = weights_fingerprint(verifier)
    if (
        now is None
    ):  # the verifier's files are not on this machine (03 needs none): nothing here to compare
        return None
    if (
        not recorded
    ):  # shard sets of before 2026-12-05f: the weights here cannot be compared (said, not silent)
        return (
            f"{path}: records no verifier_weights (shards captured before 2026-12-05f): the weights at "
            f"verifier.path '{verifier.path}' were not checked against the model the shards were captured from, "
            f"only the name {want!r}; a verifier.path pointed at another model of the same shapes would train "
            f"against its lm_head without an error: check that it is the model 02 captured from, or re-run 02 to "
            f"record its fingerprint"
        )
    if weights_differ(recorded, now):
        raise UserError(
            f"verifier.path: '{verifier.path}' holds other weights than the model the shards in "
            f"{path.parent} were captured from ({path.name}: key 'verifier_weights'; the name "
            f"{want!r} is the same): its lm_head would score another model's hidden states; set "
            f"verifier.path back to that model, or re-run 02 for this one (with a verifier.name of "
            f"its own)"
        )
    return None


VERIFIER_DIMS = (
    "num_layers",
    "hidden_size",
    "vocab_size",
)  # what data_config.json / eagle3_train.json record of it


def verifier_dims_differ(dims: dict, recorded: dict) -> Optional[str]:
    """``num_layers 6 recorded, 30 at verifier.path; ...`` for each of :data:`VERIFIER_DIMS` that the verifier the
    config loads (``dims``: :func:`eagle3.verifier.load.verifier_dims`) has other than ``recorded`` (the shards'
    ``data_config.json`` or an export's ``verifier`` block), or None. :func:`check_verifier` compares names only: a
    config whose ``verifier.path`` was pointed at another model under the old ``verifier.name`` otherwise fails on a
    drafter field the user never set (fresh-user trial 2026-12-05d)."""
    diffs = [
        f"{k} {recorded[k]} recorded, {dims[k]} at verifier.path"
        for k in VERIFIER_DIMS
        if recorded.get(k) is not None
        and dims.get(k) is not None
        and int(recorded[k]) != int(dims[k])
    ]
    return "; ".join(diffs) or None


def check_verifier_dims(verifier: Any, dims: dict, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a verifier (loaded from ``verifier.path``) of other dimensions than the shards' (``meta``).

    Raises:
        UserError: ``verifier.path: '<path>' is another model than the shards in <root> were captured from ('<name>':
            num_layers 6 recorded, 30 at verifier.path; ...); set verifier.path back, or re-run 02 for this model ...``.
    """
    diff = verifier_dims_differ(dims, meta)
    if diff:
        raise UserError(
            f"verifier.path: '{verifier.path}' is another model than the shards in {root} were captured "
            f"from ({meta.get('verifier')!r}, {DATA_CONFIG}: {diff}); set verifier.path back to that model, "
            f"or re-run 02 for this one (with a verifier.name of its own)"
        )


def check_extract_settings(extract: Any, meta: dict, root: str | os.PathLike) -> None:
    """Refuse a config whose ``extract.aux_layers`` / ``extract.max_length`` differ from the shards'.

    Stages 03, 04 and 05 read the shards' values from ``data_config.json`` (``meta``); a config that says
    otherwise would silently be ignored. Only a key the config sets (pydantic ``model_fields_set`` of
    ``extract``) is compared; ``aux_layers: null`` set explicitly means the EAGLE default ``[2, N//2, N-3]``
    of the shards' ``num_layers`` (named so in the message). Keys missing from ``meta`` are not compared.

    Raises:
        UserError: one line naming every differing key, both values, the shards folder and the fixes.
    """
    from eagle3.engines.layers import default_aux_layers

    set_keys = getattr(extract, "model_fields_set", set())
    diffs = []
    for key in ("aux_layers", "max_length"):
        if key not in set_keys or meta.get(key) is None:
            continue
        want, have = getattr(extract, key), meta[key]
        shown = want
        if key == "aux_layers":
            if want is None:
                try:
                    want = default_aux_layers(int(meta["num_layers"]))
                except (KeyError, TypeError, ValueError, UserError):
                    continue  # no default to compare with
                shown = f"null (the EAGLE default {want})"
            want, have = [int(i) for i in want], [int(i) for i in have]
        elif int(want) == int(have):
            continue
        if want != have:
            diffs.append((key, shown, have))
    if len(diffs) == 1:
        ((k, s, h),) = diffs
        raise UserError(
            f"extract.{k} {s} but the shards in {root} were captured with {h}: re-run 02 or set "
            f"extract.{k} to the shards' value"
        )
    if diffs:
        raise UserError(
            "; ".join(f"extract.{k} {s}" for k, s, _ in diffs)
            + f" but the shards in {root} were captured "
            "with "
            + "; ".join(f"{k} {h}" for k, _, h in diffs)
            + ": re-run 02 or set "
            + " and ".join(f"extract.{k}" for k, _, _ in diffs)
            + " to the shards' values"
        )
