"""fp8 (e4m3) storage of hidden states: ``h`` ``[L, H]`` is stored as ``q = e4m3(h / s)`` plus float32 scales ``s``
``[L, nb]``, ``s[t, b] = amax(|h[t, block b]|) / 448`` over ``nb`` equal column blocks (``nb = 1``: per_token,
default; ``H / block_size``: per_block); a zero block gets scale 1; ``h ~= q.float() * s``. Rounding: PyTorch's
round-to-nearest-even cast. Bytes per token and tensor: ``H + 4 nb`` instead of ``2H``. Accuracy:
docs/results.md "fp8 shard storage". Dequantised where used (the training device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
SCALE_SCHEMES = ("per_token", "per_block")
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class Storage:
    """How shards store hidden states (``data_config.json``): ``dtype`` ``bfloat16`` | ``float8_e4m3fn``, ``scale``
    ``per_token`` | ``per_block``, ``block_size`` (per_block: columns per scale). ValueError for other values.
    """

    dtype: str = "bfloat16"
    scale: str = "per_token"
    block_size: Optional[int] = None

    def __post_init__(self):
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype {self.dtype!r} not in {STORAGE_DTYPES}")
        if self.scale not in SCALE_SCHEMES:
            raise ValueError(f"scale scheme {self.scale!r} not in {SCALE_SCHEMES}")
        if self.scale == "per_block" and (self.block_size is None or self.block_size < 1):
            raise ValueError("per_block scales need block_size >= 1")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    def num_blocks(self, hidden_size: int) -> int:
        """Scales per row for hidden size ``H``; ValueError when ``block_size`` does not divide it."""
        if self.scale == "per_token":
            return 1
        if hidden_size % self.block_size:
            raise ValueError(
                f"per_block scales: block_size {self.block_size} does not divide hidden size {hidden_size}"
            )
        return hidden_size // self.block_size

    def bytes_per_token(self, hidden_size: int, num_states: int = 4) -> int:
        """Hidden-state bytes per token: ``n * 2H`` (bf16) or ``n * (H + 4 nb)`` (fp8)."""
        if not self.is_fp8:
            return int(num_states * hidden_size * 2)
        return int(num_states * (hidden_size + SCALE_DTYPE.itemsize * self.num_blocks(hidden_size)))

    def to_meta(self) -> dict:
        """The ``data_config.json`` keys of this storage."""
        meta = {"storage_dtype": self.dtype}
        if self.is_fp8:
            meta.update(scale_scheme=self.scale, scale_block_size=self.block_size)
            meta["scale_dtype"] = "float32"
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> "Storage":
        """Inverse of :meth:`to_meta`; no ``storage_dtype`` = bf16."""
        dtype = meta.get("storage_dtype", "bfloat16")
        if dtype == "bfloat16":
            return cls()
        return cls(
            dtype=dtype,
            scale=meta.get("scale_scheme", "per_token"),
            block_size=meta.get("scale_block_size"),
        )


def quantize(h: torch.Tensor, num_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [..., H], scale float32 [..., num_blocks])`` of ``h`` ``[..., H]``; ValueError when
    ``num_blocks`` does not divide ``H`` or ``h`` has NaN/Inf.
    """
    q, scale = quantize_unchecked(h, num_blocks)
    if not scales_finite(scale):  # exactly "h is finite": see quantize_unchecked
        raise ValueError("quantize: input has NaN/Inf")
    return q, scale


def quantize_unchecked(
    h: torch.Tensor, num_blocks: int = 1, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` without the NaN/Inf check, so no device sync (02 runs it on the verifier's GPU): ``amax``
    propagates NaN/Inf, so the scales are finite iff ``h`` is (:func:`scales_finite`, checked by every shard writer).
    Same bytes on any device. ``out``: optional preallocated ``(q, scale)``. ValueError as :func:`quantize`.
    """
    H = h.shape[-1]
    if num_blocks < 1 or H % num_blocks:
        raise ValueError(f"quantize: {num_blocks} blocks do not divide hidden size {H}")
    x = h.float().reshape(*h.shape[:-1], num_blocks, H // num_blocks)  # [..., nb, H/nb]
    amax = x.abs().amax(dim=-1)  # [..., nb]; NaN/Inf propagate
    # "== 0" keeps a NaN amax NaN. Divide by a device tensor, not a Python scalar: CUDA multiplies by a
    # scalar's reciprocal, one ulp off the CPU's IEEE division for some scales (shard_convert must match)
    fp8_max = amax.new_full((), FP8_MAX)  # [] float32, a fill kernel: no host sync
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fp8_max)  # [..., nb]
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [..., nb, H/nb]
    if out is None:
        return q.reshape(h.shape), scale.to(SCALE_DTYPE)
    out[0].copy_(q.reshape(h.shape))
    out[1].copy_(scale)
    return out


def scales_finite(scale: torch.Tensor) -> bool:
    """True iff every scale of :func:`quantize_unchecked` is finite, i.e. iff its input was."""
    return bool(torch.isfinite(scale).all())


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``q.float() * scale`` (``[..., H]``, ``[..., nb]``) broadcast over blocks, in ``dtype``, on ``q``'s device."""
    H, nb = q.shape[-1], scale.shape[-1]
    x = q.float().reshape(*q.shape[:-1], nb, H // nb)  # [..., nb, H/nb]
    return (x * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def is_fp8(t: torch.Tensor) -> bool:
    """True for a float8_e4m3fn tensor."""
    return t.dtype == FP8_DTYPE


def has_nan_fp8(q: torch.Tensor) -> bool:
    """NaN check for e4m3fn (no Inf; NaN is ``S1111111``): the max of ``bits & 0x7F`` is ``0x7F`` iff some element is NaN."""
    return q.numel() > 0 and int((q.view(torch.uint8) & 0x7F).max()) == 0x7F


def dequantize_batch(batch: dict, dtype: torch.dtype) -> dict:
    """A device-side batch with each fp8 entry ``k`` that has a ``k + "_scale"`` partner dequantised to ``dtype`` and the
    scale dropped; other entries unchanged.
    """
    out = {}
    for k, v in batch.items():
        if k.endswith("_scale") and k[: -len("_scale")] in batch:
            continue
        if is_fp8(v) and k + "_scale" in batch:
            v = dequantize(v, batch[k + "_scale"], dtype)
        out[k] = v
    return out


def storage_from_config(ex) -> Storage:
    """The :class:`Storage` of an ``extract`` config section."""
    if ex.storage_dtype == "bfloat16":
        return Storage()
    return Storage(
        dtype=ex.storage_dtype,
        scale=ex.fp8_scale,
        block_size=ex.fp8_block_size if ex.fp8_scale == "per_block" else None,
    )
