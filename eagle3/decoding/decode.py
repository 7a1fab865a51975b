"""Offline batched decoding with a transformers verifier: greedy (the baseline) and EAGLE-3 chain
speculative decoding at temperature 0; with a :class:`eagle3.decoding.sampling.Sampler`, plain
sampling and chain speculative sampling.

Batching: prompts are left-padded in one HF ``DynamicCache``; a verify round appends ``k+1`` slots
per row and row ``r`` keeps ``a_r + 1``; rejected slots stay as holes hidden by the 2-D
``attention_mask``, and explicit ``position_ids`` keep rotary positions contiguous, so every round
has the same shapes and no host sync. The drafter's cache does the same with its ``valid`` mask.

Round (arXiv 2503.01840; SGLang ``--speculative-eagle-topk 1``): draft ``k`` tokens from the
drafter fed the last round's verified positions, verify ``[x_{t+1}, d_1..d_k]`` in one forward,
accept the longest prefix equal to the verifier's argmax plus one bonus token. Finished rows run
on until all have (checked every ``check_every`` rounds).

Acceptance length of a step = tokens it emitted (accepted + 1, the last step cut at EOS /
``max_new_tokens``). Output equals greedy token for token up to floating-point ties; given
greedy's ``reference``, each row's first difference and its logit gap are recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from eagle3.decoding.common import (
    BatchGreedy,
    BatchSpec,
    PhaseTimer,
    accepted_prefix,
    aux_states,
    check_prompts,
    cut,
    device_of,
    first_mismatch_update,
    forward_params,
    reference_tensor,
    spec_result,
    sync,
)
from eagle3.decoding.sampling import Sampler
from eagle3.drafter.caches import DrafterCache
from eagle3.engines.layers import check_aux_layers
from eagle3.errors import UserError
from eagle3.sdpa import no_cudnn_sdpa


def _returned_cache(out):
    """The KV cache of a model output (field ``cache`` in transformers >= 5.2x, else ``past_key_values``)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


def _left_pad(prompts: list[list[int]], device: torch.device):
    """``(ids [B, P], mask [B, P] bool, positions [B, P], lengths [B])`` for left-padded prompts
    (pads: token 0 at position 0, masked).
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
    # the KV cache under the forward's name for it (``cache`` in transformers >= 5.24)
    key = "cache" if "cache" in forward_params(verifier) else "past_key_values"
    kw = {} if cache is None else {key: cache}
    if last_only and "logits_to_keep" in forward_params(verifier):
        kw["logits_to_keep"] = 1
    return verifier(
        input_ids=ids,
        attention_mask=mask.long(),
        position_ids=pos,
        use_cache=True,
        output_hidden_states=hidden,
        **kw,
    )


@torch.inference_mode()
@no_cudnn_sdpa()  # the KV caches grow every step: no per-shape cuDNN plans (eagle3.sdpa)
def greedy_generate_batch(
    verifier: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    check_every: int = 8,
    sampler: Optional[Sampler] = None,
) -> BatchGreedy:
    """Plain batched greedy decoding (the baseline); with ``sampler``, plain sampling.

    Args:
        verifier: HF causal LM (eval) taking ``attention_mask``, ``position_ids`` and a KV cache.
        prompts: B prompts (id lists or 1-D tensors). max_new_tokens: per prompt (>= 1).
        eos_ids: a row stops after emitting one (kept). check_every: steps between host checks.

    Returns:
        :class:`BatchGreedy`.

    Raises:
        UserError: an empty prompt.
    """
    rows = check_prompts(prompts)
    device = device_of(verifier)
    eos = {int(e) for e in eos_ids}
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)  # [E]
    sync(device)
    t0 = time.perf_counter()
    ids, mask, pos, n = _left_pad(rows, device)
    out = _forward(verifier, ids, mask, pos, None, hidden=False, last_only=True)
    cache = _returned_cache(out)
    pick = (lambda lg: lg.argmax(-1)) if sampler is None else sampler.sample
    tok = pick(out.logits[:, -1])  # [B]
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
        tok = pick(out.logits[:, -1])  # [B]
        toks.append(tok)
        done = done | torch.isin(tok, eos_t)
        forwards += 1
    all_tok = torch.stack(toks, dim=1).cpu()  # [B, steps]
    sync(device)
    seconds = time.perf_counter() - t0
    return BatchGreedy([cut(r, eos, max_new_tokens) for r in all_tok.tolist()], seconds, forwards)


@dataclass
class _Chain:
    """Device state of a speculative batch between rounds (``B`` rows, ``k`` drafts a round):
    last emitted token, kept positions, emitted counts, ``done``, the output (column ``W-1`` =
    discard), the verifier slot mask, the drafter's next step-0 chunk, first mismatch and gap,
    accepted drafts per round; sampling: ``q [B, k, Vd]`` and ``targets [Vd]``.
    """

    cache: object
    vmask: torch.Tensor
    last: torch.Tensor
    n: torch.Tensor
    e: torch.Tensor
    done: torch.Tensor
    out_tok: torch.Tensor
    mm_idx: torch.Tensor
    mm_gap: torch.Tensor
    d_ids: torch.Tensor
    d_aux: torch.Tensor
    d_pos: torch.Tensor
    d_valid: torch.Tensor
    d_last: torch.Tensor
    jj: torch.Tensor
    ones: torch.Tensor
    dcache: DrafterCache = field(default_factory=DrafterCache)
    accepted: list = field(default_factory=list)
    q: Optional[torch.Tensor] = None
    targets: Optional[torch.Tensor] = None


def _spec_prefill(verifier, rows, aux_layers, k, max_new_tokens, eos_t, ref, sampler) -> _Chain:
    """The prompts' forward: the first new token of each row (argmax, or sampled by ``sampler``) and the
    drafter's first step-0 chunk."""
    B = len(rows)
    device = device_of(verifier)
    ids, vmask, pos, n = _left_pad(rows, device)  # [B, P] x3, [B]
    out = _forward(verifier, ids, vmask, pos, None, hidden=True, last_only=True)
    plogits = out.logits[:, -1:]  # [B, 1, V]
    # [B] x_n: the first new token, not yet in the verifier cache
    last = plogits[:, 0].argmax(-1) if sampler is None else sampler.sample(plogits[:, 0])
    mm_idx = torch.full((B,), -1, dtype=torch.long, device=device)
    mm_gap = torch.zeros(B, dtype=torch.float32, device=device)
    if ref is not None:
        zero = torch.zeros(B, 1, dtype=torch.long, device=device)
        one = torch.ones(B, 1, dtype=torch.bool, device=device)
        mm_idx, mm_gap = first_mismatch_update(
            plogits, last[:, None], ref, zero, one, mm_idx, mm_gap
        )
    out_tok = torch.full((B, max_new_tokens + k + 2), -1, dtype=torch.long, device=device)
    out_tok[:, 0] = last
    e = torch.ones(B, dtype=torch.long, device=device)  # [B] tokens emitted so far
    return _Chain(
        cache=_returned_cache(out),
        vmask=vmask,
        last=last,
        n=n,
        e=e,
        done=torch.isin(last, eos_t) | (e >= max_new_tokens),
        out_tok=out_tok,
        mm_idx=mm_idx,
        mm_gap=mm_gap,
        # step-0 input of the prompt positions t: token x_{t+1} (the next prompt token, or the first new one)
        d_ids=torch.cat([ids[:, 1:], last[:, None]], dim=1),  # [B, P]
        d_aux=aux_states(out.hidden_states, aux_layers),
        d_pos=pos,
        d_valid=vmask,
        d_last=torch.full((B,), ids.shape[1] - 1, dtype=torch.long, device=device),
        jj=torch.arange(k + 1, device=device),
        ones=torch.ones(B, k + 1, dtype=torch.bool, device=device),
    )


def _draft(drafter, c: _Chain, k: int, sampler: Optional[Sampler] = None) -> torch.Tensor:
    """``k`` chain drafts of every row (verifier ids ``[B, k]``): the argmax, or sampled by ``sampler`` (their
    distributions in ``c.q``, the draft-to-verifier id map in ``c.targets``); the drafter's cache keeps verified
    positions only."""
    B = c.d_ids.shape[0]
    h = drafter.decode(c.d_ids, drafter.project(c.d_aux), c.d_pos, c.dcache, valid=c.d_valid)
    h_prev = h.gather(1, c.d_last[:, None, None].expand(B, 1, h.shape[-1]))  # [B, 1, H] output at t
    t = c.n - 1  # [B] last verified position (x_{t+1} = last)
    drafts, qs = [], []
    for i in range(k):
        dl = drafter.compute_logits(h_prev)[:, -1]  # [B, Vd]
        if sampler is None:
            d = dl.argmax(-1)  # [B] draft-vocab ids
        else:
            d, q = sampler.draft(dl)  # [B], [B, Vd]
            qs.append(q)
        tok = drafter.draft_to_target(d)  # [B] verifier ids = d + d2t[d]
        drafts.append(tok)
        if i + 1 < k:
            h_prev = drafter.decode(tok[:, None], h_prev, (t + i + 1)[:, None], c.dcache)
    if k > 1:
        c.dcache.crop(c.dcache.length - (k - 1))  # keep step-0 keys of verified positions only
    if qs:
        c.q = torch.stack(qs, dim=1)  # [B, k, Vd]
        if c.targets is None:
            c.targets = drafter.draft_to_target(torch.arange(qs[0].shape[-1], device=d.device))
    return torch.stack(drafts, dim=1)  # [B, k]


def _verify(
    verifier, c: _Chain, D: torch.Tensor, aux_layers, max_new_tokens, eos_t, ref, sampler=None
) -> None:
    """The verifier on ``[last, d_1..d_k]``: greedy acceptance (or rejection sampling by ``sampler``), emission,
    holes for the rejected slots, and the kept positions' step-0 inputs for the next draft (updates ``c``)."""
    k, jj = D.shape[1], c.jj  # [k+1]
    vin = torch.cat([c.last[:, None], D], dim=1)  # [B, k+1]
    vpos = c.n[:, None] + jj  # [B, k+1]
    # [B, S+k+1] every new slot real during this forward
    c.vmask = torch.cat([c.vmask, c.ones], dim=1)
    out = _forward(verifier, vin, c.vmask, vpos, c.cache, hidden=True)
    c.cache = _returned_cache(out)
    logits = out.logits  # [B, k+1, V]
    if sampler is None:
        pred = logits.argmax(-1)  # [B, k+1]
        a = accepted_prefix(D, pred)  # [B]
    else:  # pred[:, :a] = accepted drafts, pred[:, a] = residual or bonus token
        a, pred = sampler.verify(D, c.q, c.targets, logits)
    keep = jj[None] <= a[:, None]  # [B, k+1] x_{t+1} and the accepted drafts stay
    c.vmask[:, -(k + 1) :] = keep  # rejected slots become holes
    live = ~c.done  # [B]
    emit_idx = c.e[:, None] + jj  # [B, k+1] output indices of pred[:, j]
    write = keep & live[:, None] & (emit_idx < max_new_tokens)  # [B, k+1]
    if ref is not None:
        c.mm_idx, c.mm_gap = first_mismatch_update(
            logits, pred, ref, emit_idx, write, c.mm_idx, c.mm_gap
        )
    discard = torch.full_like(emit_idx, c.out_tok.shape[1] - 1)
    c.out_tok.scatter_(1, torch.where(write, emit_idx, discard), pred)
    c.e = torch.where(live, c.e + a + 1, c.e)
    c.done = c.done | (torch.isin(pred, eos_t) & write).any(1) | (c.e >= max_new_tokens)
    c.last = pred.gather(1, a[:, None]).squeeze(1)  # [B] bonus token
    c.n = c.n + a + 1
    c.accepted.append(a)
    # the kept positions' step-0 inputs for the next round: token pred[j] = x_{t'+1} at t' = vpos[j]
    c.d_ids, c.d_aux, c.d_pos, c.d_valid, c.d_last = (
        pred,
        aux_states(out.hidden_states, aux_layers),
        vpos,
        keep,
        a,
    )


def _host_copies(c: _Chain, max_new_tokens: int) -> tuple:
    """``(tokens [B, max_new_tokens], accepted [B, R], mismatch indices, gaps)`` copied to the host."""
    B = c.out_tok.shape[0]
    tokens = c.out_tok[:, :max_new_tokens].cpu()
    acc = (
        torch.stack(c.accepted, dim=1) if c.accepted else torch.zeros(B, 0, dtype=torch.long)
    ).cpu()  # [B, R]
    return tokens, acc, c.mm_idx.cpu().tolist(), c.mm_gap.cpu().tolist()


def _spec_rows(host: tuple, k: int, eos: set[int], max_new_tokens: int, with_ref: bool):
    """One :class:`SpecResult` per row of :func:`_host_copies` (cut at EOS / ``max_new_tokens``)."""
    tokens, acc, mm_i, mm_g = host
    refs = zip(mm_i, mm_g) if with_ref else [None] * len(mm_i)
    rows = zip(tokens.tolist(), acc.tolist(), refs)
    return [spec_result(t, a, k, eos, max_new_tokens, m) for t, a, m in rows]


def _rounds(verifier, drafter, c: _Chain, steps: int, settings, timer, check_every: int) -> int:
    """Draft and verify rounds until every row of ``c`` finished; ``settings`` = ``(aux_layers, max_new_tokens,
    eos_t, ref, sampler)`` of :func:`_verify`. Returns the rounds run."""
    max_new_tokens, rounds = settings[1], 0
    while not (rounds % check_every == 0 and bool(c.done.all())):
        if rounds >= max_new_tokens:  # every row emits >= 1 token per round: all finished by now
            break
        timer.start("draft")
        D = _draft(drafter, c, steps, settings[-1])
        timer.stop("draft")
        timer.start("verify")
        _verify(verifier, c, D, *settings)
        timer.stop("verify")
        rounds += 1
    return rounds


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
    sampler: Optional[Sampler] = None,
) -> BatchSpec:
    """EAGLE-3 chain speculative decoding of a batch at temperature 0 (lossless w.r.t.
    :func:`greedy_generate_batch`); with ``sampler``, chain speculative sampling.

    Args:
        verifier: HF causal LM accepting ``attention_mask``, ``position_ids``, a KV cache and
            ``output_hidden_states``.
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter` on the verifier's device.
        prompts: B prompts. aux_layers: three HF ``hidden_states`` indices.
        steps: drafts per verify step (>= 1). max_new_tokens: per prompt (>= 1).
        eos_ids: a row stops after emitting one (kept).
        reference: greedy's per-prompt tokens: first difference and gap recorded in
            :attr:`SpecResult.mismatch` / :attr:`SpecResult.gap`.
        check_every: rounds between host checks. sampler: temperature > 0 (no ``reference``).

    Raises:
        UserError: bad ``aux_layers``, an empty prompt, a ``reference`` with a ``sampler``.
    """
    if sampler is not None and reference is not None:
        raise UserError(
            "reference: sampled output (temperature > 0) has no token-by-token reference"
        )
    num_layers = verifier.config.get_text_config().num_hidden_layers
    aux_layers = check_aux_layers(aux_layers, num_layers, field="aux_layers")
    rows = check_prompts(prompts)
    device = device_of(verifier)
    eos = {int(e) for e in eos_ids}
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=device)  # [E]
    shape = (len(rows), max_new_tokens)
    ref = None if reference is None else reference_tensor(reference, shape, device)
    timer = PhaseTimer(device)
    sync(device)
    t_start = time.perf_counter()
    c = _spec_prefill(verifier, rows, aux_layers, steps, max_new_tokens, eos_t, ref, sampler)
    settings = (aux_layers, max_new_tokens, eos_t, ref, sampler)
    rounds = _rounds(verifier, drafter, c, steps, settings, timer, check_every)
    host = _host_copies(c, max_new_tokens)
    sync(device)
    seconds = time.perf_counter() - t_start
    results = _spec_rows(host, steps, eos, max_new_tokens, ref is not None)
    return BatchSpec(results, seconds, timer.seconds("draft"), timer.seconds("verify"), rounds)
