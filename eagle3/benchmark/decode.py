"""Offline decoding with a transformers verifier, batched: plain greedy (the baseline) and EAGLE-3
chain speculative decoding at temperature 0.

Batching with rows that advance at different speeds (one path for every batch size, 1 included).
Both decoders keep the verifier's HF KV cache (``DynamicCache``) with ONE slot count for all rows:
prompts are LEFT-padded; a greedy step appends one slot per row; a verify round appends ``k+1``
slots per row (the last emitted token and the ``k`` drafts), of which row ``r`` keeps the first
``a_r + 1`` (``a_r`` accepted drafts). The rejected slots stay in the cache as holes: a 2-D
``attention_mask`` over slots (0 = pad or rejected) hides them from every later query, and explicit
``position_ids`` (row ``r``'s next position = its count of kept tokens) keep rotary positions
contiguous per row. transformers builds the 4-D mask from the 2-D one by slot index (causal) and by
``attention_mask[b, slot]`` (padding), which is exactly what holes need, for Llama and DeepseekV3
alike; nothing is cropped, so every round has the same shapes and needs no host sync.
The drafter's :class:`eagle3.drafter.model.DrafterCache` does the same with its ``valid`` mask.

Speculative round (EAGLE-3 paper arXiv 2503.01840; same chain shape as SGLang ``--speculative-num-steps k
--speculative-eagle-topk 1 --speculative-num-draft-tokens k+1``), for every row at once:

1. Draft. The drafter's cache holds step-0 keys of verified positions. The positions verified in
   the last round, ``t0..t``, are fed at step 0 (DESIGN.md TTT indexing: position ``s`` takes token
   ``x_{s+1}`` and ``fc(f_s)``, rotary position ``s``); in a batch this chunk always has ``k+1``
   slots, those after the row's accepted ones marked invalid. The output at ``t`` gives draft 1;
   drafted step ``i`` (1..k-1) feeds the previous draft and the drafter's own previous output at
   rotary position ``t+i``. Draft ids map to verifier ids with ``target = draft + d2t[draft]``.
   Afterwards the ``k-1`` drafted slots are cropped (only verified positions keep step-0 keys).
2. Verify. The verifier runs ``[x_{t+1}, d_1..d_k]`` (``x_{t+1}`` = last emitted token, not yet in
   its cache) in one forward with ``output_hidden_states=True``. Greedy acceptance: the longest
   prefix of drafts equal to the verifier's argmax, plus one bonus token (the verifier's argmax
   after the accepted prefix). The aux states of the kept positions (``hidden_states[i]`` for the
   configured HF indices) are the drafter's next step-0 input.

Rows that finished (EOS or ``max_new_tokens``) keep running until every row has (their extra
work is discarded); finishing is checked on the host every ``check_every`` rounds/steps.

Acceptance length of a verify step = the tokens it EMITTED: accepted drafts + 1 (the bonus), the
last step counted only up to the cut at EOS / ``max_new_tokens`` (a drafter that proposes the
verifier's own tokens at 3 steps and ``max_new_tokens`` 10 emits 1 + 4 + 4 + 1 tokens: tau 9/3 = 3.0,
not 12/3). SGLang's ``spec_accept_length = completion_tokens / spec_verify_ct`` also counts the
prefill token (10/3 there).

Losslessness: output equals greedy decoding token for token up to floating-point ties: the verify
forward (``k+1`` tokens per row) and greedy's one-token forwards may round differently, which can
flip an argmax between two near-equal logits. Given greedy's tokens as ``reference``, the
speculative decoder finds each row's first difference and its logit gap (the verify logits'
top-1 minus the logit of the token greedy chose there): a near-tie has a gap within the rounding
of the dtype. In float32 this does not happen in practice; in bf16/fp16 (GPU) it can
(:mod:`eagle3.benchmark.offline` counts both kinds against an explicit tolerance).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from eagle3.drafter.caches import DrafterCache
from eagle3.errors import UserError
from eagle3.sdpa import no_cudnn_sdpa


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class SpecResult:
    """One prompt's result of :func:`speculative_generate_batch`.

    Attributes:
        tokens: generated verifier token ids (prompt excluded), cut at EOS (kept) or max_new_tokens.
        accept_lengths: per verify step, the tokens it EMITTED: accepted drafts + 1 bonus, except
            that the last step counts only the tokens before the cut at EOS / ``max_new_tokens``
            (so ``1 + sum(accept_lengths) == len(tokens)`` whenever a verify step ran; the first
            token comes from the prefill).
        accepted: per verify step, ``steps`` flags; flag k = draft position k (0-based) accepted
            and emitted (``accept_lengths - 1`` leading True values).
        mismatch: index of the first token that differs from ``reference`` (None if none or no reference).
        gap: at ``mismatch``, verify logit of the verifier's top-1 minus that of the reference's
            token (>= 0; None when the row has no mismatch).
        seconds, draft_seconds, verify_seconds: those of the whole batch (set by the single-prompt
            wrapper :func:`speculative_generate`; 0 in batch results).
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
    """Result of :func:`speculative_generate_batch`.

    Attributes:
        rows: one :class:`SpecResult` per prompt, in input order.
        seconds: wall seconds of the whole batch (prefill included), device synchronised.
        draft_seconds: part spent in the drafter (device time between events on CUDA, wall on CPU).
        verify_seconds: part spent in verifier verify forwards and acceptance (prefill excluded).
        rounds: verify rounds run (the batch runs until its last row finishes).
    """

    rows: list[SpecResult]
    seconds: float
    draft_seconds: float
    verify_seconds: float
    rounds: int


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PhaseTimer:
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


def _forward_params(model: torch.nn.Module) -> frozenset:
    """Names of ``model.forward``'s parameters (cached per model class: read on every forward)."""
    cls = type(model)
    if cls not in _PARAMS:
        try:
            _PARAMS[cls] = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            _PARAMS[cls] = frozenset()
    return _PARAMS[cls]


def _cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """Pass the KV cache under the forward's name for it.

    transformers 5.17 (and remote-code models such as Kimi's) call it ``past_key_values``;
    transformers 5.24 renamed it ``cache`` (``past_key_values`` deprecated).
    """
    if cache is None:
        return {}
    return {"cache": cache} if "cache" in _forward_params(model) else {"past_key_values": cache}


def _returned_cache(out):
    """The KV cache of a model output (field ``cache`` in transformers >= 5.2x, else ``past_key_values``)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


def _check_prompts(prompts) -> list[list[int]]:
    """Prompts as lists of ints; UserError when there is none or one is empty."""
    rows = [[int(t) for t in (p.tolist() if torch.is_tensor(p) else p)] for p in prompts]
    if not rows:
        raise UserError("prompts: the batch is empty")
    for i, p in enumerate(rows):
        if not p:
            raise UserError(f"prompts: prompt {i} is empty")
    return rows


def _left_pad(prompts: list[list[int]], device: torch.device):
    """``(ids [B, P], mask [B, P] bool, positions [B, P], lengths [B])`` for left-padded prompts.

    Pads hold token 0 at position 0 and are masked out; each row's last prompt token sits in the
    last column, so one forward continues every row.
    """
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long)  # [B, P]
    mask = torch.zeros(B, P, dtype=torch.bool)  # [B, P]
    for r, p in enumerate(prompts):
        ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, P - len(p) :] = True
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)  # [B, P] rotary positions, 0 on pads
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)  # [B]
    return ids.to(device), mask.to(device), pos.to(device), lengths.to(device)


def _forward(verifier, ids, mask, pos, cache, hidden: bool, last_only: bool = False):
    """One verifier forward over new slots ``ids [B, T]`` at ``pos [B, T]``; ``mask [B, S+T]`` covers
    the cached slots and the new ones (bool, True = real token). The ONE call both decoders use,
    so greedy and verify differ only in how many tokens they feed."""
    kw = _cache_kwargs(verifier, cache)
    if last_only and "logits_to_keep" in _forward_params(verifier):
        kw["logits_to_keep"] = 1
    return verifier(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=pos,
        use_cache=True,
        output_hidden_states=hidden,
        **kw,
    )


def _cut(row: Sequence[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """``row`` up to and including its first EOS, at most ``max_new_tokens`` tokens."""
    out: list[int] = []
    for t in row[:max_new_tokens]:
        out.append(int(t))
        if t in eos:
            break
    return out


def emitted_lengths(accepted: Sequence[int], num_tokens: int) -> list[int]:
    """Tokens each verify round emitted for one row, given the verifier's raw decisions.

    Args:
        accepted: per round, drafts the verifier accepted (``a``: the round would emit ``a + 1``).
        num_tokens: the row's final output length after the cut at EOS / max_new_tokens (the
            first token comes from the prefill).

    Returns:
        per round that emitted anything, ``min(a + 1, remaining)``: the last round is cut, later
        rounds (run while other rows of the batch were unfinished) are dropped.
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


def _aux(hidden_states: Sequence[torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor:
    """``cat(hidden_states[i] for i in aux_layers)`` -> ``[B, T, 3Ht]`` (HF index convention)."""
    return torch.cat([hidden_states[i] for i in aux_layers], dim=-1)  # [B, T, 3Ht]


def accepted_prefix(drafts: torch.Tensor, verifier_argmax: torch.Tensor) -> torch.Tensor | int:
    """Number of leading drafts equal to the verifier's argmax (greedy acceptance at T=0).

    Args:
        drafts: int64 ``[k]`` or ``[B, k]`` drafted verifier ids d_1..d_k.
        verifier_argmax: int64 ``[(B,) k]`` or ``[(B,) k+1]``; entry j = verifier argmax after the
            prefix ending at d_j (entry 0 = after the last verified token).

    Returns:
        a in 0..k: an int for 1-D input, int64 ``[B]`` for batched input.
    """
    k = drafts.shape[-1]
    match = (drafts == verifier_argmax[..., :k]).long()  # [(B,) k]
    a = match.cumprod(-1).sum(-1)
    return int(a) if drafts.dim() == 1 else a


def _check_common(max_new_tokens: int, steps: Optional[int] = None) -> None:
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if steps is not None and steps < 1:
        raise UserError(f"steps: must be >= 1, got {steps}")


# ---------------------------------------------------------------------------------------------
# greedy baseline
# ---------------------------------------------------------------------------------------------
@torch.inference_mode()
@no_cudnn_sdpa()  # the KV caches grow every step: no per-shape cuDNN plans (eagle3.sdpa)
def greedy_generate_batch(
    verifier: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    check_every: int = 8,
) -> BatchGreedy:
    """Plain batched greedy decoding (the benchmark baseline), same cache machinery as the verify.

    Args:
        verifier: HF causal LM (eval mode) taking ``attention_mask``, ``position_ids`` and a KV cache.
        prompts: B prompts (lists of ids or 1-D tensors).
        max_new_tokens: generate at most this many tokens per prompt (>= 1).
        eos_ids: a row stops after emitting any of these ids (kept in its output).
        check_every: steps between host checks of "every row finished" (each check is one sync).

    Returns:
        :class:`BatchGreedy`.

    Raises:
        UserError: an empty prompt or batch, ``max_new_tokens < 1``.
    """
    _check_common(max_new_tokens)
    rows = _check_prompts(prompts)
    device = _device(verifier)
    eos = {int(e) for e in eos_ids}
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)  # [E]
    _sync(device)
    t0 = time.perf_counter()
    ids, mask, pos, n = _left_pad(rows, device)
    out = _forward(verifier, ids, mask, pos, None, hidden=False, last_only=True)
    cache = _returned_cache(out)
    tok = out.logits[:, -1].argmax(-1)  # [B]
    toks = [tok]
    done = torch.isin(tok, eos_t)  # [B]
    ones = torch.ones(len(rows), 1, dtype=torch.bool, device=device)  # [B, 1]
    forwards = 1
    for step in range(1, max_new_tokens):
        if step % check_every == 0 and bool(done.all()):
            break
        mask = torch.cat([mask, ones], dim=1)  # [B, S+1]
        out = _forward(verifier, tok[:, None], mask, n[:, None], cache, hidden=False)
        cache = _returned_cache(out)
        n = n + 1
        tok = out.logits[:, -1].argmax(-1)  # [B]
        toks.append(tok)
        done = done | torch.isin(tok, eos_t)
        forwards += 1
    all_tok = torch.stack(toks, dim=1).cpu()  # [B, steps]
    _sync(device)
    seconds = time.perf_counter() - t0
    return BatchGreedy([_cut(r, eos, max_new_tokens) for r in all_tok.tolist()], seconds, forwards)


def _one_prompt(input_ids) -> list[int]:
    """One prompt as ``list[int]`` from ``[n]`` or ``[1, n]`` ids (list or LongTensor).

    Raises:
        UserError: a batch of several prompts, or an empty prompt.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise UserError(
                f"input_ids: expected one prompt ([n] or [1, n]), got shape {list(ids.shape)}"
            )
        ids = ids[0]  # [n]
    if ids.numel() == 0:
        raise UserError("input_ids: the prompt is empty")
    return ids.tolist()


def greedy_generate(
    verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_ids: Sequence[int] = ()
) -> tuple[list[int], float]:
    """One prompt through :func:`greedy_generate_batch`: ``(tokens, seconds)``.

    Raises:
        UserError: empty prompt, ``max_new_tokens < 1``.
    """
    res = greedy_generate_batch(verifier, [_one_prompt(input_ids)], max_new_tokens, eos_ids)
    return res.tokens[0], res.seconds


# ---------------------------------------------------------------------------------------------
# speculative decoding
# ---------------------------------------------------------------------------------------------
def _reference_tensor(
    reference: Optional[Sequence[Sequence[int]]], B: int, width: int, device
) -> Optional[torch.Tensor]:
    """Reference tokens ``[B, width]`` padded with -1 (no token there), or None."""
    if reference is None:
        return None
    if len(reference) != B:
        raise UserError(
            f"reference: expected {B} token lists (one per prompt), got {len(reference)}"
        )
    ref = torch.full((B, width), -1, dtype=torch.long)
    for r, toks in enumerate(reference):
        toks = list(toks)[:width]
        if toks:
            ref[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    return ref.to(device)


def _first_mismatch_update(logits, chosen, ref, idx, live, mm_idx, mm_gap):
    """Record each row's first position where ``chosen`` differs from the reference (no host sync).

    Args:
        logits: ``[B, T, V]`` verifier logits of the T emitted candidates; chosen: int64 ``[B, T]`` (their argmax);
        ref: ``[B, W]`` reference tokens (-1 = none); idx: int64 ``[B, T]`` output indices of the candidates;
        live: bool ``[B, T]`` which candidates are really emitted; mm_idx ``[B]`` (-1 = none yet), mm_gap ``[B]`` float32.
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


@torch.inference_mode()
@no_cudnn_sdpa()  # the KV caches grow every step: no per-shape cuDNN plans (eagle3.sdpa)
def speculative_generate_batch(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    aux_layers: Sequence[int],
    steps: int = 3,
    max_new_tokens: int = 256,
    eos_ids: Sequence[int] = (),
    reference: Optional[Sequence[Sequence[int]]] = None,
    check_every: int = 4,
) -> BatchSpec:
    """EAGLE-3 chain speculative decoding at temperature 0 of a batch of prompts (lossless w.r.t.
    :func:`greedy_generate_batch`; see the module docstring for the batching).

    Args:
        verifier: HF causal LM; must accept ``attention_mask``, ``position_ids``, a KV cache and
            ``output_hidden_states=True``.
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter` on the verifier's device (``project``, ``decode``
            with ``valid``, ``compute_logits``, ``draft_to_target``).
        prompts: B prompts (lists of ids or 1-D tensors).
        aux_layers: three HF ``hidden_states`` indices (0 = embeddings, i = input of layer i), as in
            ``data_config.json`` / the export's ``eagle3_train.json``.
        steps: drafted tokens per verify step (k >= 1); the verifier checks k+1 tokens per forward.
        max_new_tokens: generate at most this many tokens per prompt (>= 1).
        eos_ids: a row stops after emitting any of these ids (kept, like greedy).
        reference: optional per-prompt token lists (greedy's output): each row's first difference
            and its logit gap are recorded in :attr:`SpecResult.mismatch` / :attr:`SpecResult.gap`.
        check_every: rounds between host checks of "every row finished".

    Returns:
        :class:`BatchSpec`.

    Raises:
        UserError: bad ``steps``/``max_new_tokens``/``aux_layers``/``reference``, an empty prompt or batch.
    """
    _check_common(max_new_tokens, steps)
    aux_layers = [int(i) for i in aux_layers]
    if len(aux_layers) != 3:
        raise UserError(
            f"aux_layers: EAGLE-3 needs exactly 3 HF hidden_states indices, got {aux_layers}"
        )
    rows = _check_prompts(prompts)
    B, k = len(rows), steps
    device = _device(verifier)
    eos = {int(e) for e in eos_ids}
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)  # [E]
    ref = _reference_tensor(reference, B, max_new_tokens, device)
    timer = _PhaseTimer(device)

    _sync(device)
    t_start = time.perf_counter()
    # ---------------- prefill ----------------
    ids, vmask, pos, n = _left_pad(rows, device)  # [B, P] x3, [B]
    out = _forward(verifier, ids, vmask, pos, None, hidden=True, last_only=True)
    n_hidden = len(out.hidden_states)
    if max(aux_layers) >= n_hidden - 1 or min(aux_layers) < 1:
        raise UserError(
            f"aux_layers: {aux_layers} outside 1..{n_hidden - 2} for this {n_hidden - 1}-layer verifier"
        )
    cache = _returned_cache(out)
    plogits = out.logits[:, -1:]  # [B, 1, V]
    last = plogits[:, 0].argmax(-1)  # [B] x_n: the first new token, not yet in the verifier cache
    jj = torch.arange(k + 1, device=device)  # [k+1]
    mm_idx = torch.full((B,), -1, dtype=torch.long, device=device)
    mm_gap = torch.zeros(B, dtype=torch.float32, device=device)
    if ref is not None:
        mm_idx, mm_gap = _first_mismatch_update(
            plogits,
            last[:, None],
            ref,
            torch.zeros(B, 1, dtype=torch.long, device=device),
            torch.ones(B, 1, dtype=torch.bool, device=device),
            mm_idx,
            mm_gap,
        )
    width = max_new_tokens + k + 2
    out_tok = torch.full(
        (B, width), -1, dtype=torch.long, device=device
    )  # [B, W]; column W-1 = discard
    out_tok[:, 0] = last
    e = torch.ones(B, dtype=torch.long, device=device)  # [B] tokens emitted so far
    done = torch.isin(last, eos_t) | (e >= max_new_tokens)  # [B]
    # step-0 input of the prompt positions t: token x_{t+1} (the next prompt token, or the first new one)
    d_ids = torch.cat([ids[:, 1:], last[:, None]], dim=1)  # [B, P]
    d_aux, d_pos, d_valid = _aux(out.hidden_states, aux_layers), pos, vmask
    d_last = torch.full(
        (B,), ids.shape[1] - 1, dtype=torch.long, device=device
    )  # slot of each row's last verified position
    dcache = DrafterCache()
    accepted_rounds: list[torch.Tensor] = []
    rounds = 0
    ones_k1 = torch.ones(B, k + 1, dtype=torch.bool, device=device)

    while True:
        if rounds % check_every == 0 and bool(done.all()):
            break
        if rounds >= max_new_tokens:  # every row emits >= 1 token per round: all finished by now
            break
        # ---------------- draft ----------------
        timer.start("draft")
        h = drafter.decode(d_ids, drafter.project(d_aux), d_pos, dcache, valid=d_valid)  # [B, T, H]
        h_prev = h.gather(
            1, d_last[:, None, None].expand(B, 1, h.shape[-1])
        )  # [B, 1, H] output at t
        t = n - 1  # [B] last verified position (x_{t+1} = last)
        drafts = []
        for i in range(k):
            d = drafter.compute_logits(h_prev)[:, -1].argmax(-1)  # [B] draft-vocab ids
            tok = drafter.draft_to_target(d)  # [B] verifier ids = d + d2t[d]
            drafts.append(tok)
            if i + 1 < k:
                h_prev = drafter.decode(
                    tok[:, None], h_prev, (t + i + 1)[:, None], dcache
                )  # [B, 1, H]
        if k > 1:
            dcache.crop(dcache.length - (k - 1))  # keep step-0 keys of verified positions only
        D = torch.stack(drafts, dim=1)  # [B, k]
        timer.stop("draft")

        # ---------------- verify ----------------
        timer.start("verify")
        vin = torch.cat([last[:, None], D], dim=1)  # [B, k+1]
        vpos = n[:, None] + jj  # [B, k+1]
        vmask = torch.cat(
            [vmask, ones_k1], dim=1
        )  # [B, S+k+1] every new slot real during this forward
        out = _forward(verifier, vin, vmask, vpos, cache, hidden=True)
        cache = _returned_cache(out)
        logits = out.logits  # [B, k+1, V]
        pred = logits.argmax(-1)  # [B, k+1]
        a = accepted_prefix(D, pred)  # [B]
        keep = jj[None] <= a[:, None]  # [B, k+1] x_{t+1} and the accepted drafts stay
        vmask[:, -(k + 1) :] = keep  # rejected slots become holes
        live = ~done  # [B]
        emit_idx = e[:, None] + jj  # [B, k+1] output indices of pred[:, j]
        write = keep & live[:, None] & (emit_idx < max_new_tokens)  # [B, k+1]
        if ref is not None:
            mm_idx, mm_gap = _first_mismatch_update(
                logits, pred, ref, emit_idx, write, mm_idx, mm_gap
            )
        out_tok.scatter_(
            1, torch.where(write, emit_idx, torch.full_like(emit_idx, width - 1)), pred
        )
        e = torch.where(live, e + a + 1, e)
        done = done | (torch.isin(pred, eos_t) & write).any(1) | (e >= max_new_tokens)
        last = pred.gather(1, a[:, None]).squeeze(1)  # [B] bonus token
        n = n + a + 1
        accepted_rounds.append(a)
        # the kept positions' step-0 inputs for the next round: token pred[j] = x_{t'+1} at t' = vpos[j]
        d_ids, d_aux, d_pos, d_valid, d_last = (
            pred,
            _aux(out.hidden_states, aux_layers),
            vpos,
            keep,
            a,
        )
        timer.stop("verify")
        rounds += 1

    tokens = out_tok[:, :max_new_tokens].cpu()
    acc = (
        torch.stack(accepted_rounds, dim=1)
        if accepted_rounds
        else torch.zeros(B, 0, dtype=torch.long)
    ).cpu()  # [B, R]
    mm_i, mm_g = mm_idx.cpu().tolist(), mm_gap.cpu().tolist()
    _sync(device)
    seconds = time.perf_counter() - t_start
    results = []
    for r in range(B):
        toks = _cut([x for x in tokens[r].tolist() if x >= 0], eos, max_new_tokens)
        lens = emitted_lengths(acc[r].tolist(), len(toks))
        res = SpecResult(
            tokens=toks, accept_lengths=lens, accepted=[[j < L - 1 for j in range(k)] for L in lens]
        )
        if ref is not None and mm_i[r] >= 0 and mm_i[r] < len(toks):
            res.mismatch, res.gap = mm_i[r], mm_g[r]
        results.append(res)
    return BatchSpec(results, seconds, timer.seconds("draft"), timer.seconds("verify"), rounds)


def speculative_generate(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module,
    input_ids,
    aux_layers: Sequence[int],
    steps: int = 3,
    max_new_tokens: int = 256,
    eos_ids: Sequence[int] = (),
) -> SpecResult:
    """One prompt through :func:`speculative_generate_batch`; the batch timings are copied into the result.

    Raises:
        UserError: see :func:`speculative_generate_batch`; a batched ``input_ids``.
    """
    res = speculative_generate_batch(
        verifier, drafter, [_one_prompt(input_ids)], aux_layers, steps, max_new_tokens, eos_ids
    )
    row = res.rows[0]
    row.seconds, row.draft_seconds, row.verify_seconds = (
        res.seconds,
        res.draft_seconds,
        res.verify_seconds,
    )
    return row
