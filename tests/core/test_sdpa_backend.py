"""Every loop whose attention shapes change call to call runs with cuDNN SDPA off.

cuDNN's SDPA backend builds an execution plan per new input shape (~40 ms of host time per call on
an H200, torch 2.11: eagle3.sdpa.no_cudnn_sdpa). Stage 04 training, stage 02 capture (padded
length changes per batch), stage 01 regeneration and stage 05 decoding (the KV cache grows every
step) must all run their verifier/drafter forwards with it off, and restore the caller's setting.
"""

import torch
from test_capture_hf import SAMPLES, _llama

from eagle3.capture.hf import HFCapture
from eagle3.regen.regenerate import generate_greedy


def _record_backend(model) -> list[bool]:
    seen: list[bool] = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(
        lambda mod, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled())
    )
    return seen


def test_capture_forward_runs_without_cudnn_sdpa():
    model = _llama()
    seen = _record_backend(model)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    HFCapture(model, [1, 3, 4], batch_tokens=10_000, pad_id=0).capture(SAMPLES)
    # probes at construction/first use may run outside; the capture forwards themselves must not use cuDNN
    assert seen and seen[-1] is False
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored


def test_regeneration_runs_without_cudnn_sdpa():
    model = _llama()
    seen = _record_backend(model)
    generate_greedy(model, [[5, 17, 3], [8, 1, 2, 9]], 4, set(), pad_id=0)
    assert len(seen) >= 4 and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_offline_benchmark_decoding_runs_without_cudnn_sdpa():
    from test_decode import AUX, BATCH_PROMPTS, make_drafter, make_verifier

    from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch

    verifier = make_verifier()
    drafter = make_drafter(verifier, [1, 2, 3])
    seen = _record_backend(verifier)
    seen_d: list[bool] = []
    drafter.lm_head.register_forward_pre_hook(
        lambda mod, args: seen_d.append(torch.backends.cuda.cudnn_sdp_enabled())
    )
    greedy_generate_batch(verifier, BATCH_PROMPTS, 6)
    speculative_generate_batch(verifier, drafter, BATCH_PROMPTS, AUX, steps=2, max_new_tokens=6)
    assert len(seen) >= 6 and not any(seen)
    assert seen_d and not any(seen_d)
    assert torch.backends.cuda.cudnn_sdp_enabled()
