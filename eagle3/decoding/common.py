"""What the batched decoder (:mod:`eagle3.decoding.decode`) and the static one (:mod:`eagle3.decoding.static_decode`)
share: result types, the greedy acceptance rule, the emission cut, the first-mismatch record, the phase timer and
the argument checks, so both decode with one rule set."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from eagle3.errors import UserError


@dataclass
class SpecResult:
    """One prompt's result of :func:`speculative_generate_batch`.

    Attributes:
        tokens: generated ids (prompt excluded), cut at EOS (kept) or ``max_new_tokens``.
        accept_lengths: per verify step the tokens it emitted (accepted + 1, the last cut), so
            ``1 + sum(accept_lengths) == len(tokens)`` when a step ran.
        accepted: per step ``steps`` flags, draft position k accepted and emitted.
        mismatch: first index differing from ``reference`` (None: none or no reference).
        gap: at ``mismatch``, verifier top-1 logit minus the reference token's (>= 0).
        seconds, draft_seconds, verify_seconds: the batch's (single-prompt wrapper; else 0).
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    accepted: list[list[bool]] = field(default_factory=list)
    mismatch: Optional[int] = None
    gap: Optional[float] = None
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def num_verify_steps(self) -> int:
        """Number of verifier verify forwards that emitted tokens of this prompt (the prefill is not counted)."""
        return len(self.accept_lengths)


@dataclass
class BatchGreedy:
    """Result of :func:`greedy_generate_batch`: per-row tokens (cut at EOS / max_new_tokens),
    wall seconds of the whole batch (prefill included, device synchronised) and the number of
    verifier forwards (prefill included)."""

    tokens: list[list[int]]
    seconds: float
    forwards: int


@dataclass
class BatchSpec:
    """Result of :func:`speculative_generate_batch`: ``rows`` (one :class:`SpecResult` per prompt),
    ``seconds`` (whole batch), ``draft_seconds``, ``verify_seconds`` (prefill excluded), ``rounds``.
    """

    rows: list[SpecResult]
    seconds: float
    draft_seconds: float
    verify_seconds: float
    rounds: int


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates the time of named phases without host syncs: CUDA events on GPU (read once at
    the end), ``perf_counter`` on CPU (where every op is synchronous anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list] = {}
        self.open: dict[str, object] = {}

    def start(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.open[name] = ev
        else:
            self.open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        begin = self.open.pop(name)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.setdefault(name, []).append((begin, ev))
        else:
            self.marks.setdefault(name, []).append(time.perf_counter() - begin)

    def seconds(self, name: str) -> float:
        """Total seconds of ``name`` (call after a device sync)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.marks.get(name, [])) / 1000.0
        return float(sum(self.marks.get(name, [])))


_PARAMS: dict[type, frozenset] = {}


def forward_params(model: torch.nn.Module) -> frozenset:
    """Names of ``model.forward``'s parameters (cached per model class: read on every forward)."""
    cls = type(model)
    if cls not in _PARAMS:
        try:
            _PARAMS[cls] = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            _PARAMS[cls] = frozenset()
    return _PARAMS[cls]


def check_prompts(prompts) -> list[list[int]]:
    """Prompts (a batch of at least one: 05 decodes its prompt sets in non-empty batches) as lists of ints;
    UserError when one is empty."""
    rows = [[int(t) for t in (p.tolist() if torch.is_tensor(p) else p)] for p in prompts]
    for i, p in enumerate(rows):
        if not p:
            raise UserError(f"prompts: prompt {i} is empty")
    return rows


def cut(row: Sequence[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """``row`` up to and including its first EOS, at most ``max_new_tokens`` tokens."""
    out: list[int] = []
    for t in row[:max_new_tokens]:
        out.append(int(t))
        if t in eos:
            break
    return out


def emitted_lengths(accepted: Sequence[int], num_tokens: int) -> list[int]:
    """Tokens each verify round emitted for one row: ``min(a + 1, remaining)`` per round that
    emitted anything, given the accepted drafts ``accepted`` and the row's final ``num_tokens``
    (the first comes from the prefill).
    """
    left = max(0, num_tokens - 1)
    out: list[int] = []
    for a in accepted:
        if left <= 0:
            break
        e = min(int(a) + 1, left)
        out.append(e)
        left -= e
    return out


def spec_result(
    raw: Sequence[int],
    accepted: Sequence[int],
    k: int,
    eos: set[int],
    max_new_tokens: int,
    mismatch,
) -> SpecResult:
    """One row's :class:`SpecResult` from its output buffer ``raw`` (-1 = no token), accepted drafts per round and
    recorded ``mismatch`` ``(index, gap)`` (index -1 or None: none), cut at EOS / ``max_new_tokens``."""
    toks = cut([x for x in raw if x >= 0], eos, max_new_tokens)
    lens = emitted_lengths(accepted, len(toks))
    res = SpecResult(toks, lens, [[j < n - 1 for j in range(k)] for n in lens])
    if mismatch is not None and 0 <= mismatch[0] < len(toks):
        res.mismatch, res.gap = mismatch
    return res


def aux_states(hidden_states: Sequence[torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor:
    """``cat(hidden_states[i] for i in aux_layers)`` -> ``[B, T, 3Ht]`` (HF index convention)."""
    return torch.cat([hidden_states[i] for i in aux_layers], dim=-1)  # [B, T, 3Ht]


def accepted_prefix(drafts: torch.Tensor, verifier_argmax: torch.Tensor) -> torch.Tensor | int:
    """Leading drafts equal to the verifier's argmax (greedy acceptance).

    Args:
        drafts: int64 ``[k]`` or ``[B, k]``.
        verifier_argmax: int64 ``[(B,) k]`` or ``[(B,) k+1]``; entry j = argmax after ``d_j``.

    Returns:
        0..k: an int for 1-D input, int64 ``[B]`` batched.
    """
    k = drafts.shape[-1]
    match = (drafts == verifier_argmax[..., :k]).long()  # [(B,) k]
    a = match.cumprod(-1).sum(-1)
    return int(a) if drafts.dim() == 1 else a


def reference_tensor(reference: Sequence[Sequence[int]], shape, device) -> torch.Tensor:
    """Reference tokens as an int64 tensor of ``shape`` ``(B, W)`` on ``device``: row ``r`` = ``reference[r]`` cut to ``W``,
    padded with -1 (no token there)."""
    ref = torch.full(tuple(shape), -1, dtype=torch.long)
    for r, toks in enumerate(reference):
        toks = list(toks)[: shape[1]]
        if toks:
            ref[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    return ref.to(device)


def first_mismatch_update(logits, chosen, ref, idx, live, mm_idx, mm_gap):
    """Record each row's first position where ``chosen`` differs from ``ref`` (no host sync).

    ``logits [B, T, V]``, ``chosen``/``idx`` int64 ``[B, T]``, ``ref [B, W]`` (-1 = none),
    ``live`` bool ``[B, T]``; updates ``mm_idx [B]`` (-1 = none yet) and ``mm_gap [B]`` float32.
    """
    W = ref.shape[1]
    refj = ref.gather(1, idx.clamp(max=W - 1))  # [B, T]
    refj = torch.where(idx < W, refj, torch.full_like(refj, -1))
    bad = live & (refj >= 0) & (chosen != refj)  # [B, T]
    j = bad.long().argmax(1, keepdim=True)  # [B, 1] first bad candidate (0 when none)
    top = logits.gather(2, chosen[..., None]).squeeze(-1).float()  # [B, T]
    at_ref = logits.gather(2, refj.clamp(min=0)[..., None]).squeeze(-1).float()  # [B, T]
    gap = (top - at_ref).gather(1, j).squeeze(1)  # [B]
    new = bad.any(1) & (mm_idx < 0)  # [B]
    mm_idx = torch.where(new, idx.gather(1, j).squeeze(1), mm_idx)
    mm_gap = torch.where(new, gap, mm_gap)
    return mm_idx, mm_gap
