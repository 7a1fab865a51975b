"""The slot engine's scheduling rules and host-side records: slot prefixes, refill deferral, prefill buckets,
common prefixes, the decode-step compile decision, CUDA graph capture, waiting / held requests."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

log = logging.getLogger(__name__)


# Fed tokens per packed prefill forward off CUDA (eager FlexAttention builds the dense [H, Tq, Tq + Tp] scores of a
# layer: SmolLM2's 9 heads at 2,048 + 4,096 positions, fp32, are ~0.3 GB), whatever prompts.regen_prefill_tokens says.
PACK_EAGER_TOKENS = 2048


def synced_seconds(dev: torch.device, fn) -> float:
    """Host seconds of ``fn()`` between two device syncs (CUDA; elsewhere plain host seconds): a compile or a CUDA
    graph capture timed whole, queued work included."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token-id sequences (ids compared one by one: a re-tokenised
    chat template may split the previous answer's last tokens differently, so nothing is assumed)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _pow2_ceil(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


def prefill_bucket(
    rows: int, width: int, kv: int, max_rows: int, cols: int, min_width: int = 16
) -> tuple[int, int, int]:
    """The static shape ``(Pb, Wb, Kwb)`` a bucketed prefill forward runs at: each dimension
    rounded up to a power of two, then capped.

    Args:
        rows: prompts in the forward (``1..max_rows``); width: longest suffix fed (``1..cols``).
        kv: cache columns the offset path attends (0: the causal path).
        max_rows: the engine's slots; cols: cache columns per slot; min_width: smallest ``Wb``.

    Returns:
        ``(min(max_rows, 2^ceil(log2 rows)), min(cols, max(min_width, 2^ceil(log2 width))),
        min(cols, 2^ceil(log2 kv)) or 0)``; e.g. ``(5, 40, 0, 1024, 2560) -> (8, 64, 0)``.

    Raises:
        ValueError: an argument out of range.
    """
    if not (1 <= rows <= max_rows and 1 <= width <= cols and 0 <= kv <= cols and min_width >= 1):
        raise ValueError(
            f"prefill_bucket: 1 <= rows ({rows}) <= max_rows ({max_rows}), 1 <= width ({width}) <= cols "
            f"({cols}), 0 <= kv ({kv}) <= cols, min_width ({min_width}) >= 1"
        )
    return (
        min(max_rows, _pow2_ceil(rows)),
        min(cols, max(min_width, _pow2_ceil(width))),
        min(cols, _pow2_ceil(kv)) if kv else 0,
    )


def prefix_sizes(slots: int, min_prefix: int = 8) -> list[int]:
    """Slot prefixes a decode window may run over, ascending: ``slots``, ``ceil(slots / 2)``, ... while >= ``min_prefix``
    (``slots`` alone when ``slots <= min_prefix``). E.g. ``prefix_sizes(1024) == [8, 16, ..., 512, 1024]``."""
    if slots < 1 or min_prefix < 1:
        raise ValueError("prefix_sizes: slots and min_prefix >= 1")
    sizes = [slots]
    while -(-sizes[-1] // 2) >= min_prefix and sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // 2))
    return sorted(set(sizes))


def choose_prefix(sizes: Sequence[int], live: Sequence[int]) -> int:
    """The smallest prefix of ``sizes`` (ascending, as :func:`prefix_sizes`) holding every slot index in ``live``
    (the smallest prefix when nothing is live). ValueError when a live slot lies beyond the largest prefix."""
    top = max(live, default=-1)
    for n in sizes:
        if n > top:
            return n
    raise ValueError(f"choose_prefix: live slot {top} beyond the largest prefix {sizes[-1]}")


def defer_refill(n_free: int, slots: int, queued: int, refill_free: float) -> bool:
    """Whether the engine leaves its free slots empty at this check: while fewer than
    ``refill_free * slots`` are free, at least half are busy and more prompts are queued than slots
    are free (a prefill forward costs about the same whatever it carries).

    Args:
        n_free: free slots (a successor's retained slot counts). slots: the engine's slots.
        queued: prompts waiting. refill_free: ``prompts.regen_refill_free``.
    """
    return n_free < refill_free * slots and 2 * (slots - n_free) >= slots and queued > n_free


@dataclass(order=True)
class Waiting:
    priority: tuple
    key: object = field(compare=False)
    ids: list = field(compare=False)
    # key of the retained request this prompt continues
    parent: object = field(compare=False, default=None)
    # keep the slot's K/V for a successor when it finishes
    retain: bool = field(compare=False, default=False)


@dataclass
class Held:
    """A finished request's slot kept for its successor: ``ids`` are the tokens whose K/V fill columns
    ``[0, len(ids))`` (prompt + answer less its last token, whose K/V were never written); ``delivered``: its answer
    has been yielded, so the caller has had its chance to submit the successor."""

    key: object
    ids: list
    delivered: bool = False


def capture_graph(fn, pool, after_warmup=None):
    """``fn`` (device work, static shapes, no host sync) captured as a CUDA graph allocating from
    ``pool``: warmed up once on a side stream, then ``after_warmup()``, then captured.

    Returns:
        the ``torch.cuda.CUDAGraph``. Raises whatever warm-up or capture raises.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    if after_warmup is not None:
        after_warmup()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        fn()
    return g


@dataclass
class PrefillBuffers:
    """Static tensors of one prefill bucket ``key = (Pb, Wb, Kwb)`` (:func:`prefill_bucket`; ``Kwb`` 0: the causal
    path): what its forward reads (filled by ``copy_`` before each forward) and writes, and its CUDA graph (None:
    not captured, run eagerly)."""

    key: tuple
    ids: torch.Tensor  # int64 [Pb, Wb] token ids, right-padded with 0
    meta: torch.Tensor  # int64 [4, Pb]: slot (padded rows: the scratch row S), offset, last prompt index, prompt length
    tok: torch.Tensor  # int64 [Pb] output: first answer token of each row
    graph: Optional[object] = None

    @classmethod
    def make(cls, key: tuple, dev) -> "PrefillBuffers":
        pb, wb, _ = key
        z = dict(dtype=torch.long, device=dev)
        return cls(key, torch.zeros(pb, wb, **z), torch.zeros(4, pb, **z), torch.zeros(pb, **z))


# prompts.regen_compile: auto. Decode-step costs measured on one H200, SmolLM2-135M-Instruct bf16, 1,024
# slots, flex, CUDA graphs, 512 new tokens; `auto` applies them as they are to any other setup.
# Cold-cache compile + capture of the full-prefix step (s): bench/results/h200-20261204/regen_speed_cold.json.
COMPILE_COLD_S = 41.4
# Eager full-prefix step (ms): bench/results/h200-20261203/prompts_report.json, 203.68 s / 26,928 steps.
EAGER_STEP_MS = 7.56
# Compiled full-prefix step in steady state (ms): bench/results/h200-20261204/regen_speed_{cold,warm}.json.
COMPILED_STEP_MS = 5.65


def estimate_decode_steps(answers: int, max_new_tokens: int, slots: int) -> int:
    """Decode steps expected for ``answers`` turns: ``ceil(answers * max_new_tokens / slots)``, a
    high-side estimate (every answer at full budget, every row busy).
    """
    if answers < 0 or max_new_tokens < 1 or slots < 1:
        raise ValueError("estimate_decode_steps: answers >= 0, max_new_tokens >= 1 and slots >= 1")
    return -(-answers * max_new_tokens // slots)


def compile_decision(
    setting,
    device_type: str,
    attention: str,
    answers: Optional[int],
    max_new_tokens: int,
    slots: int,
) -> dict:
    """Whether the slot engine compiles its decode step (``prompts.regen_compile``), and why.

    ``True`` / ``False`` as given; ``"auto"`` compiles only on CUDA with flex attention when
    ``estimate_decode_steps(...) * (EAGER_STEP_MS - COMPILED_STEP_MS) / 1000 > COMPILE_COLD_S``.

    Args:
        setting: ``True``, ``False`` or ``"auto"``. device_type: the verifier's device type.
        attention: ``"flex"`` or ``"sdpa_groups"``. answers: turns to answer (None: unknown, no compile).
        max_new_tokens: answer budget per turn. slots: decode rows.

    Returns:
        ``{"setting", "compile", "reason"}``; ``auto`` adds its inputs and estimates.

    Raises:
        ValueError: an unknown ``setting``.
    """
    if setting is True or setting is False:
        return {
            "setting": setting,
            "compile": setting,
            "reason": f"prompts.regen_compile: {str(setting).lower()}",
        }
    if setting != "auto":
        raise ValueError(f"compile_step: one of true, false, 'auto', not {setting!r}")
    out = {
        "setting": "auto",
        "compile": False,
        "device": device_type,
        "attention": attention,
        "answers": answers,
        "max_new_tokens": max_new_tokens,
        "slots": slots,
    }
    why = _auto_refusal(device_type, attention, answers)
    if why:
        return {**out, "reason": why}
    return _auto_estimate(out, answers, max_new_tokens, slots)


def _auto_refusal(device_type: str, attention: str, answers: Optional[int]) -> Optional[str]:
    """Why ``auto`` does not compile before any estimate (not CUDA, not flex, answers unknown), or None."""
    if device_type != "cuda":
        return f"auto: the verifier is on {device_type}, not CUDA (never compiled there)"
    if attention != "flex":
        return f"auto: {attention} decode attention (the step saving was measured with flex only)"
    if answers is None:
        return "auto: the number of answers is not known"
    return None


def _auto_estimate(out: dict, answers: int, max_new_tokens: int, slots: int) -> dict:
    """``auto``'s decision on CUDA with flex attention: ``out`` with ``compile`` set when the estimated saving beats
    the cold compile (:func:`compile_decision`), the reason and the estimate's figures."""
    steps = estimate_decode_steps(answers, max_new_tokens, slots)
    saving_ms = EAGER_STEP_MS - COMPILED_STEP_MS
    saving_s = steps * saving_ms / 1000.0
    on = saving_s > COMPILE_COLD_S
    reason = (
        f"auto: ~{steps} decode steps x {saving_ms:.2f} ms saved = {saving_s:.1f} s "
        f"{'>' if on else '<='} {COMPILE_COLD_S} s cold compile"
    )
    return {
        **out,
        "compile": on,
        "reason": reason,
        "estimated_steps": steps,
        "saving_ms_per_step": round(saving_ms, 3),
        "estimated_saving_s": round(saving_s, 2),
        "compile_cost_s": COMPILE_COLD_S,
    }
