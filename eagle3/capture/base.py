"""The capture backend contract of stage 02 (DESIGN.md "Capture backend contract"):
:class:`eagle3.capture.hf.HFCapture` and :class:`eagle3.capture.sglang.SGLangCapture`.
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

    ``capture(batch)``: unpadded token-id lists -> per sample, same order, 4 bf16 CPU ``[L_i, H]``:
    the three aux HF indices, then ``hidden_states[-1]`` (``info()["last_hidden_state"]`` says
    whether post-norm). ``info()`` may run a probe forward the first time.
    """

    aux_layers: Sequence[int]

    def info(self) -> BackendInfo: ...

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]: ...


def check_captured(sample_ids: list[int], states, hidden_size: int, where: str) -> None:
    """Check one sample's output against the contract (4 bf16 CPU ``[L, H]``, or a ``StoredStates``
    of bf16 / float8_e4m3fn ``[L, H]``).

    Raises:
        RuntimeError: wrong count, shape, dtype or device; ``where`` names the sample.
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
