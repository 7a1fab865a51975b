"""Which scaled-dot-product-attention backend the stages use (core: stages 01, 02, 04 and 05 take it from here).

:func:`no_cudnn_sdpa` keeps torch's SDPA off cuDNN where shapes change call to call (training batches,
KV-cached decoding, regeneration, padded capture batches); :func:`resolve_attn_impl` names the drafter's
TTT attention implementation (``eager`` | ``sdpa``, :mod:`eagle3.drafter.attention`).
"""

from __future__ import annotations

import contextlib

import torch

from eagle3.errors import UserError

ATTN_IMPLS = ("auto", "eager", "sdpa")


@contextlib.contextmanager
def no_cudnn_sdpa():
    """Keep ``scaled_dot_product_attention`` off cuDNN's backend inside the block (restored after).

    cuDNN's SDPA backend, torch's first choice on Hopper, builds an execution plan for every new input
    shape: about 40 ms of host time per call (H200, torch 2.11: 91 TTT attention calls of distinct
    lengths took 3.6 s of CPU forward and 4.0 s backward). Wherever shapes change from call to call
    (training batches, KV-cached decoding with a growing cache), that dominates; the flash /
    memory-efficient kernels cost the same whatever the shape. At one repeated shape cuDNN was ~3%
    faster (Kimi-size step, bench/train_throughput.py), so this is not a global setting.
    """
    prev = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(prev)


def resolve_attn_impl(attn_impl: str) -> str:
    """Map ``auto`` to ``sdpa``; validate the name.

    Raises:
        UserError: unknown implementation name.
    """
    if attn_impl not in ATTN_IMPLS:
        raise UserError(f"attn_impl '{attn_impl}' is not one of {list(ATTN_IMPLS)}")
    return "sdpa" if attn_impl == "auto" else attn_impl
