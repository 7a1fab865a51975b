"""Writing one sample's shard (layout: :mod:`eagle3.shards.format`): :func:`encode_batch` (stored form on the
device), :func:`shard_object` (the checked dict), :func:`write_sample` (atomic ``torch.save``).
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from eagle3.errors import UserError
from eagle3.io import atomic_torch_save
from eagle3.shards.format import (
    NONFINITE_FIX,
    NUM_HIDDEN_STATES,
    all_finite,
    hf_layer_name,
    shard_path,
)
from eagle3.shards.fp8 import FP8_DTYPE, SCALE_DTYPE, Storage, quantize_unchecked, scales_finite


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
    """One sample's states already in stored form (:func:`encode_batch`, sliced per sample): ``hidden_states`` 4 x
    ``[L, H]`` bf16 or float8_e4m3fn (may be views of a batch buffer); ``hidden_scales`` 4 x float32 ``[L, nb]`` (fp8
    only); ``source_finite``: bf16 values already checked finite by the producer (fp8 is checked through its scales).
    """

    hidden_states: list
    hidden_scales: Optional[list] = None
    source_finite: bool = False


def encode_batch(
    pack: torch.Tensor, storage: Storage | None = None
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The stored form of a captured batch ``pack`` bf16 ``[4, T, H]`` on its device, no host sync, the same operations
    per row as :func:`shard_object` (same bytes).

    Returns:
        bf16: ``(pack, None, finite)``; fp8: ``(q float8_e4m3fn [4, T, H], scales float32 [4, T, nb], finite)``;
        ``finite`` a 0-dim bool tensor.
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
    """``t`` on the CPU, contiguous, over exactly its own bytes: ``torch.save`` stores a view's whole storage, so a view
    is re-wrapped with ``torch.frombuffer`` over its byte range (no copy). Same values, same saved bytes.
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


class NonFiniteStates(UserError, ValueError):
    """NaN/Inf in captured hidden states (a UserError: the CLIs print it and exit 2): the sample (idx, conversation
    id), the state (stored and HF index), the verifier dtype and the fix; :meth:`explained` adds what stage 02 knows.
    """

    def __init__(
        self,
        idx: int,
        k: int,
        sample_id: Optional[str] = None,
        aux_layers: Optional[Sequence[int]] = None,
        dtype: Optional[str] = None,
    ):
        self.idx, self.k, self.sample_id = int(idx), int(k), sample_id
        self.aux_layers, self.dtype = aux_layers, dtype
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
        """The same error with the unset fields filled in."""
        return NonFiniteStates(
            self.idx,
            self.k,
            self.sample_id if self.sample_id is not None else sample_id,
            self.aux_layers if self.aux_layers is not None else aux_layers,
            self.dtype or dtype,
        )


def shard_object(
    input_ids: Sequence[int] | torch.Tensor,
    hidden_states: Sequence[torch.Tensor] | StoredStates | None,
    loss_mask: Sequence[int] | torch.Tensor,
    storage: Storage | None = None,
    idx: int = 0,
) -> dict:
    """The checked dict :func:`write_sample` saves for one sample (nothing written).

    Args:
        input_ids, loss_mask: ``[L]`` integers (stored int64; the mask 0/1).
        hidden_states: 4 x ``[L, H]`` (aux1, aux2, aux3, last), stored bf16 or quantised for fp8 ``storage``
            (plus ``hidden_scales``); a :class:`StoredStates` is only checked and re-wrapped (:func:`_own`);
            None: a token-only sample (``storage`` ignored).
        idx: named in errors.

    Raises:
        NonFiniteStates: NaN/Inf in a state.
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
        if not all_finite(hb):
            raise NonFiniteStates(idx, k)
        hs.append(hb)
    obj = {"input_ids": ids, "hidden_states": hs, "loss_mask": mask}
    if fp8:
        nb = storage.num_blocks(hs[0].shape[1])
        pairs = [quantize_unchecked(h, nb) for h in hs]  # [L, H] fp8, [L, nb] fp32
        obj["hidden_states"] = [q for q, _ in pairs]
        obj["hidden_scales"] = [sc for _, sc in pairs]
    return obj


def _stored_object(
    ids: torch.Tensor, mask: torch.Tensor, st: StoredStates, storage: Storage | None, idx: int
) -> dict:
    """:func:`shard_object` for a :class:`StoredStates`: checked, out of the batch buffer."""
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
            if not scales_finite(sc):  # finite scales <=> finite source
                raise NonFiniteStates(idx, k)
            out_s.append(sc)
        hb = _own(h)  # [L, H]
        if not fp8 and not st.source_finite and not all_finite(hb):
            raise NonFiniteStates(idx, k)
        out_h.append(hb)
    obj = {"input_ids": ids, "hidden_states": out_h, "loss_mask": mask}
    if fp8:
        obj["hidden_scales"] = out_s
    return obj


# torch's C++ writer straight to the temporary file (few GIL round trips for 02's writer threads); False
# streams through a Python file object (bench/extract_throughput.py --stream-save). Same bytes.
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
    """Write :func:`shard_object` of one sample atomically to :func:`eagle3.shards.format.shard_path`; ``hasher`` (e.g.
    ``xxhash.xxh3_128()``) is updated with the file's bytes. Raises as :func:`shard_object`.
    """
    obj = shard_object(input_ids, hidden_states, loss_mask, storage, idx=idx)
    path = shard_path(root, idx, rows_per_dir)
    atomic_torch_save(obj, path, hasher=hasher, via_path=SAVE_VIA_PATH)
    return path
