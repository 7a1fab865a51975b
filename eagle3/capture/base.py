"""The capture backend contract of stage 02 (DESIGN.md "Capture backend contract").

A capture backend runs the verifier's prefill over token-id sequences and returns, for each
sequence, the three aux hidden states (HF ``hidden_states`` indices, see ``eagle3.engines.layers``)
and the last hidden state, with padding removed. Two implementations:
``eagle3.capture.hf.HFCapture`` (transformers forward) and ``eagle3.capture.sglang.SGLangCapture``
(patched SGLang server).
"""

from __future__ import annotations

from typing import Literal, Protocol, Sequence, TypedDict, runtime_checkable

import torch

LastHiddenState = Literal["post_norm", "pre_norm"]

#: Number of tensors per sample: aux1, aux2, aux3 (low, mid, high), then the last hidden state.
NUM_CAPTURED = 4


class BackendInfo(TypedDict):
    """What a backend reports about the verifier it captures from."""

    num_layers: int  # decoder layers N of the (text) verifier
    hidden_size: int  # H
    vocab_size: int  # target vocab V
    architecture: str  # e.g. "LlamaForCausalLM", "DeepseekV3ForCausalLM"
    last_hidden_state: LastHiddenState  # whether hidden_states[-1] already has the final norm


@runtime_checkable
class CaptureBackend(Protocol):
    """Verifier prefill that returns EAGLE-3 features.

    ``capture(batch)`` takes token-id lists (one per sample, unpadded, any lengths) and returns,
    in the same order, for each sample a list of 4 bf16 CPU tensors ``[L_i, H]``: the residual
    stream at the three configured aux HF indices, then the last hidden state (whatever HF
    returns as ``hidden_states[-1]``; ``info()["last_hidden_state"]`` says if it is post-norm).
    Padding is never returned. ``info()`` may run a forward pass the first time (to detect the
    norm convention).
    """

    aux_layers: Sequence[int]

    def info(self) -> BackendInfo: ...

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]: ...


def check_captured(sample_ids: list[int], states, hidden_size: int, where: str) -> None:
    """Assert a backend's output for one sample honours the contract (4 bf16 ``[L, H]`` CPU tensors,
    or an ``eagle3.shards.write.StoredStates`` whose 4 ``hidden_states`` are bf16 or float8_e4m3fn
    ``[L, H]`` on the CPU; its scales are checked by the shard writer).

    Raises:
        RuntimeError: a backend bug (wrong count, shape, dtype or device); ``where`` names the sample.
    """
    L = len(sample_ids)
    stored = getattr(states, "hidden_states", None)
    tensors = list(stored) if stored is not None else states
    dtypes = (torch.bfloat16, torch.float8_e4m3fn) if stored is not None else (torch.bfloat16,)
    if len(tensors) != NUM_CAPTURED:
        raise RuntimeError(
            f"{where}: capture backend returned {len(tensors)} tensors, expected {NUM_CAPTURED}"
        )
    for k, t in enumerate(tensors):
        if tuple(t.shape) != (L, hidden_size) or t.dtype not in dtypes or t.device.type != "cpu":
            raise RuntimeError(
                f"{where}: capture tensor {k} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                f"expected ({L}, {hidden_size}) {' or '.join(map(str, dtypes))} on cpu"
            )
