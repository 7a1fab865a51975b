"""fp8 (e4m3) storage of captured hidden states: scaled quantisation and its inverse.

A hidden state ``h`` ``[L, H]`` is stored as ``q = round_e4m3(h / s)`` (``torch.float8_e4m3fn``,
``[L, H]``) plus fp32 scales ``s`` ``[L, nb]``: the columns of each row are cut into ``nb`` equal
blocks of ``H / nb`` and ``s[t, b] = amax(|h[t, block b]|) / 448`` (448 = the largest finite e4m3
value), so every block uses the full e4m3 range and nothing saturates. ``nb = 1`` is one scale per
token ("per_token", the default); ``nb = H / block_size`` is "per_block" (as DeepSeek-V3's 1x128
activation blocks). A row (block) of zeros gets scale 1. Reading back: ``h ~= q.float() * s``.

e4m3 keeps 3 mantissa bits, so the relative rounding error of a normal value is at most 2^-4; on
real SmolLM2 hidden states the error is 0.5-2.3% relative RMS per tensor with per-token scales and
1.5-1.7% at best with 32-column blocks (docs/results.md "fp8 shard storage"): the
scaling scheme only decides which small values fall into the subnormal range. Rounding is PyTorch's float -> float8 cast (round to nearest even). Bytes per
token and tensor: ``H + 4 * nb`` instead of ``2 H`` in bf16.

Dequantisation is meant to run where the tensors are used (the training GPU): the loader moves the
1-byte values and the scales, :func:`dequantize` expands them there.
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
    """How hidden states are stored in shards (recorded in ``data_config.json``).

    Attributes:
        dtype: ``"bfloat16"`` (speculators-v1, no scales) or ``"float8_e4m3fn"``.
        scale: ``"per_token"`` (one fp32 scale per row) or ``"per_block"`` (one per ``block_size`` columns).
        block_size: columns per scale for ``per_block`` (must divide the hidden size); None otherwise.
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
        """Scales per row for hidden size ``H`` (1 for per_token).

        Raises:
            ValueError: ``block_size`` does not divide ``H``.
        """
        if self.scale == "per_token":
            return 1
        if hidden_size % self.block_size:
            raise ValueError(
                f"per_block scales: block_size {self.block_size} does not divide hidden size {hidden_size}"
            )
        return hidden_size // self.block_size

    def bytes_per_token(self, hidden_size: int, num_states: int = 4) -> int:
        """Hidden-state bytes per token: ``n * 2H`` (bf16) or ``n * (H + 4 nb)`` (fp8 + fp32 scales)."""
        if not self.is_fp8:
            return int(num_states * hidden_size * 2)
        return int(num_states * (hidden_size + SCALE_DTYPE.itemsize * self.num_blocks(hidden_size)))

    def to_meta(self) -> dict:
        """The ``data_config.json`` keys of this storage (``storage_dtype`` and, for fp8, its scales)."""
        meta = {"storage_dtype": self.dtype}
        if self.is_fp8:
            meta.update(
                {
                    "scale_scheme": self.scale,
                    "scale_block_size": self.block_size,
                    "scale_dtype": "float32",
                }
            )
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> "Storage":
        """Inverse of :meth:`to_meta`; a data_config without ``storage_dtype`` is bf16 (speculators-v1)."""
        dtype = meta.get("storage_dtype", "bfloat16")
        if dtype == "bfloat16":
            return cls()
        return cls(
            dtype=dtype,
            scale=meta.get("scale_scheme", "per_token"),
            block_size=meta.get("scale_block_size"),
        )


def quantize(h: torch.Tensor, num_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled e4m3 quantisation of ``h`` ``[..., H]`` (any float dtype) along its last dim.

    Args:
        num_blocks: scales per row; must divide ``H``.

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn ``[..., H]``, ``scale`` float32 ``[..., num_blocks]``
        with ``h ~= dequantize(q, scale)``.

    Raises:
        ValueError: ``num_blocks`` does not divide ``H``, or ``h`` has NaN/Inf.
    """
    q, scale = quantize_unchecked(h, num_blocks)
    if not scales_finite(scale):  # exactly "h is finite": see quantize_unchecked
        raise ValueError("quantize: input has NaN/Inf")
    return q, scale


def quantize_unchecked(
    h: torch.Tensor, num_blocks: int = 1, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` without its NaN/Inf check, so it never synchronises a device (stage 02 runs
    it on the verifier's GPU per captured batch, before the device -> host copy).

    The check is not lost: a block's scale is ``amax(|block|) / 448``, and ``amax`` propagates NaN
    and +-Inf, so the scales are all finite exactly when ``h`` is (:func:`scales_finite`); every
    shard writer checks the scales. Same operations as :func:`quantize`, so the same bytes on any
    device (elementwise IEEE float32 division, round-to-nearest-even e4m3 cast).

    Args:
        h: ``[..., H]`` any float dtype.
        num_blocks: scales per row; must divide ``H``.
        out: optional preallocated ``(q [..., H] float8_e4m3fn, scale [..., num_blocks] float32)``.

    Returns:
        ``(q, scale)`` as :func:`quantize` (``out`` when given).

    Raises:
        ValueError: ``num_blocks`` does not divide ``H``.
    """
    H = h.shape[-1]
    if num_blocks < 1 or H % num_blocks:
        raise ValueError(f"quantize: {num_blocks} blocks do not divide hidden size {H}")
    x = h.float().reshape(*h.shape[:-1], num_blocks, H // num_blocks)  # [..., nb, H/nb]
    amax = x.abs().amax(dim=-1)  # [..., nb]; NaN/Inf propagate
    # amax >= 0, so "== 0" picks the same rows as "not > 0" for finite input, but keeps a NaN amax NaN
    # divide by a 0-dim tensor on amax's device, not by the Python scalar: CUDA divides by a CPU scalar as a
    # multiply by its reciprocal (PyTorch's div_true_kernel_cuda), which rounds some scales one ulp off the
    # CPU's IEEE division, so device-encoded shards would not match shard_convert's
    fp8_max = amax.new_full((), FP8_MAX)  # [] float32, a fill kernel: no host sync
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fp8_max)  # [..., nb]
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [..., nb, H/nb]
    if out is None:
        return q.reshape(h.shape), scale.to(SCALE_DTYPE)
    out[0].copy_(q.reshape(h.shape))
    out[1].copy_(scale)
    return out


def scales_finite(scale: torch.Tensor) -> bool:
    """True iff every scale of :func:`quantize_unchecked` is finite, i.e. iff its input was finite."""
    return bool(torch.isfinite(scale).all())


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``q.float() * scale`` broadcast over blocks, cast to ``dtype``; runs on ``q``'s device.

    Args:
        q: float8_e4m3fn ``[..., H]``.
        scale: float ``[..., nb]`` (same leading dims; ``nb`` divides ``H``).

    Returns:
        ``[..., H]`` in ``dtype``.
    """
    H, nb = q.shape[-1], scale.shape[-1]
    x = q.float().reshape(*q.shape[:-1], nb, H // nb)  # [..., nb, H/nb]
    return (x * scale.float().unsqueeze(-1)).reshape(q.shape).to(dtype)


def is_fp8(t: torch.Tensor) -> bool:
    """True for a float8_e4m3fn tensor."""
    return t.dtype == FP8_DTYPE


def has_nan_fp8(q: torch.Tensor) -> bool:
    """NaN check for e4m3fn (the format has no Inf; NaN is the bit pattern ``S1111111``).

    ``0x7F`` is the largest value of ``bits & 0x7F``, so its max equals ``0x7F`` iff some element is NaN:
    two passes without a bool temporary, ~10x faster on CPU than ``((bits & 0x7F) == 0x7F).any()`` (run by
    the stage-04 loader on every fp8 shard).
    """
    return q.numel() > 0 and int((q.view(torch.uint8) & 0x7F).max()) == 0x7F


def dequantize_batch(batch: dict, dtype: torch.dtype) -> dict:
    """Replace every fp8 entry ``k`` of a (device-side) batch that has a ``k + "_scale"`` partner
    with ``dequantize(batch[k], batch[k + "_scale"], dtype)`` and drop the scale entry.

    Used by stage 04 after the host->device copy, so only 1-byte values and the scales cross PCIe.
    Other entries are returned unchanged.
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
    """The :class:`Storage` of an ``extract`` config section (``storage_dtype``, ``fp8_scale``, ``fp8_block_size``)."""
    if ex.storage_dtype == "bfloat16":
        return Storage()
    return Storage(
        dtype=ex.storage_dtype,
        scale=ex.fp8_scale,
        block_size=ex.fp8_block_size if ex.fp8_scale == "per_block" else None,
    )
