"""Offline decoding with a transformers verifier: plain greedy (baseline) and EAGLE-3 chain
speculative decoding at temperature 0, batch size 1.

Speculative round (EAGLE-3 paper arXiv 2503.01840; same chain shape as SGLang ``--speculative-num-steps k
--speculative-eagle-topk 1 --speculative-num-draft-tokens k+1``):

1. Draft. The drafter's KV cache holds step-0 keys of every verified position ``s < t0``. The
   positions verified in the last round, ``t0..t``, are fed at step 0 (DESIGN.md TTT indexing:
   position ``s`` takes token ``x_{s+1}`` and ``fc(f_s)``, rotary position ``s``). The output at ``t``
   gives draft 1; drafted step ``i`` (1..k-1) feeds the previous draft and the drafter's own previous
   midlayer output at rotary position ``t+i``, attending to the step-0 keys ``<= t`` plus the earlier
   drafted steps (exactly the TTT attention pattern). Draft ids map to verifier ids with
   ``target = draft + d2t[draft]``. Afterwards the drafted keys are cropped: only verified positions
   keep step-0 keys.
2. Verify. The verifier runs ``[x_{t+1}, d_1..d_k]`` (``x_{t+1}`` = last emitted token, not yet in its
   cache) in one forward with its HF KV cache and ``output_hidden_states=True``. Greedy acceptance:
   the longest prefix of drafts equal to the verifier's argmax, plus one bonus token (the verifier's
   argmax after the accepted prefix). Rejected entries are cropped from the verifier cache. The aux
   states of the accepted positions (``hidden_states[i]`` for the configured HF indices) are the
   drafter's next step-0 input.

Acceptance length of a verify step = accepted drafts + 1 (the bonus), as SGLang's
``spec_accept_length = completion_tokens / spec_verify_ct``. Output equals greedy decoding token for
token up to floating-point ties: the batched verify forward and greedy's one-token forwards may
round differently, which can flip an argmax between two near-equal logits. In float32 this does not
happen in practice, so the benchmark runs float32 on CPU and treats any difference as a bug; in
bf16/fp16 (GPU) differences are reported, see :mod:`eagle3.benchmark`. Measured on an H200 (torch
2.11, transformers 5.17) with a random-weight 30-layer verifier (near-uniform logits, the worst
case): float32 0/12 prompts diverged over 128 tokens, bf16 12/12.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from eagle3.errors import UserError
from eagle3.model import DrafterCache


@dataclass
class SpecResult:
    """Result of :func:`speculative_generate`.

    Attributes:
        tokens: generated verifier token ids (prompt excluded), trimmed at EOS (kept) or max_new_tokens.
        accept_lengths: per verify step, accepted draft tokens + 1 bonus (untrimmed verifier decision).
        accepted: per verify step, ``steps`` flags; flag k = draft position k (0-based) accepted.
            Flags form a prefix of True values.
        seconds: wall time of the whole call (prefill included), device synchronised.
        draft_seconds: part of ``seconds`` spent in the drafter.
        verify_seconds: part of ``seconds`` spent in verifier verify forwards (prefill excluded).
    """

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    accepted: list[list[bool]] = field(default_factory=list)
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def num_verify_steps(self) -> int:
        """Number of verifier verify forwards (the prefill is not counted)."""
        return len(self.accept_lengths)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _as_ids(input_ids, device: torch.device) -> torch.Tensor:
    """Prompt ids as a ``[1, n]`` int64 tensor on ``device``; UserError if empty or batched."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise UserError(f"input_ids: expected one prompt ([n] or [1, n]), got shape {list(ids.shape)}")
    if ids.shape[1] == 0:
        raise UserError("input_ids: the prompt is empty")
    return ids  # [1, n]


def _forward_params(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _prefill_kwargs(model: torch.nn.Module) -> dict:
    """``logits_to_keep=1`` when the verifier's forward accepts it (skips lm_head over the prompt)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}


def _cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """Pass the KV cache under the forward's name for it.

    transformers 5.17 (and remote-code models such as Kimi's) call it ``past_key_values``;
    transformers 5.24 renamed it ``cache`` (``past_key_values`` deprecated).
    """
    return {"cache": cache} if "cache" in _forward_params(model) else {"past_key_values": cache}


def _returned_cache(out):
    """The KV cache of a model output (field ``cache`` in transformers >= 5.2x, else ``past_key_values``)."""
    return out["cache"] if "cache" in out.keys() else out["past_key_values"]


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of an HF cache.

    Uses ``crop(-n)`` (remove n tokens), the only form every supported transformers accepts (5.24
    rejects positive absolute lengths; ``crop(0)`` is skipped since older versions read it as length 0).
    """
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _append(tokens: list[int], new: Iterable[int], eos: set[int], max_new_tokens: int) -> bool:
    """Append ``new`` one by one; return True once EOS was appended or ``max_new_tokens`` reached."""
    for tok in new:
        tokens.append(int(tok))
        if tok in eos or len(tokens) >= max_new_tokens:
            return True
    return False


@torch.inference_mode()
def greedy_generate(
    verifier: torch.nn.Module, input_ids, max_new_tokens: int, eos_ids: Sequence[int] = ()
) -> tuple[list[int], float]:
    """Plain greedy decoding with the verifier's HF KV cache (the benchmark baseline).

    Args:
        verifier: HF causal LM (eval mode).
        input_ids: prompt ids, list or int64 tensor ``[n]`` / ``[1, n]``.
        max_new_tokens: generate at most this many tokens (>= 1).
        eos_ids: stop after emitting any of these ids (the EOS token is kept in the output).

    Returns:
        ``(tokens, seconds)``: generated ids (prompt excluded) and wall seconds incl. prefill.

    Raises:
        UserError: empty or batched prompt, ``max_new_tokens < 1``.
    """
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    device = _device(verifier)
    ids = _as_ids(input_ids, device)  # [1, n]
    eos = {int(e) for e in eos_ids}
    _sync(device)
    t0 = time.perf_counter()
    out = verifier(input_ids=ids, use_cache=True, **_prefill_kwargs(verifier))
    cache = _returned_cache(out)
    nxt = out.logits[:, -1].argmax(-1)  # [1]
    tokens: list[int] = []
    while not _append(tokens, [int(nxt)], eos, max_new_tokens):
        out = verifier(input_ids=nxt.view(1, 1), use_cache=True, **_cache_kwargs(verifier, cache))
        cache = _returned_cache(out)
        nxt = out.logits[:, -1].argmax(-1)  # [1]
    _sync(device)
    return tokens, time.perf_counter() - t0


def _aux(hidden_states: Sequence[torch.Tensor], aux_layers: Sequence[int]) -> torch.Tensor:
    """``cat(hidden_states[i] for i in aux_layers)`` -> ``[1, T, 3Ht]`` (HF index convention)."""
    return torch.cat([hidden_states[i] for i in aux_layers], dim=-1)  # [1, T, 3Ht]


def accepted_prefix(drafts: torch.Tensor, verifier_argmax: torch.Tensor) -> int:
    """Number of leading drafts equal to the verifier's argmax (greedy acceptance at T=0).

    Args:
        drafts: int64 ``[k]`` drafted verifier ids d_1..d_k.
        verifier_argmax: int64 ``[k]`` or ``[k+1]``; entry j = verifier argmax after the prefix
            ending at d_j (entry 0 = after the last verified token).

    Returns:
        a in 0..k.
    """
    k = drafts.shape[0]
    match = (drafts == verifier_argmax[:k]).long()  # [k]
    return int(match.cumprod(0).sum())


@torch.inference_mode()
def speculative_generate(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module,
    input_ids,
    aux_layers: Sequence[int],
    steps: int = 3,
    max_new_tokens: int = 256,
    eos_ids: Sequence[int] = (),
) -> SpecResult:
    """EAGLE-3 chain speculative decoding at temperature 0 (lossless w.r.t. :func:`greedy_generate`).

    Args:
        verifier: HF causal LM; must accept ``output_hidden_states=True`` and return a croppable KV
            cache (``Cache.crop``, e.g. ``DynamicCache``).
        drafter: :class:`eagle3.model.Eagle3Drafter` on the verifier's device (``project``, ``decode``,
            ``compute_logits``, ``draft_to_target``); aux states are cast to its dtype.
        input_ids: prompt ids, list or int64 ``[n]`` / ``[1, n]``.
        aux_layers: three HF ``hidden_states`` indices (0 = embeddings, i = input of layer i), as in
            ``data_config.json`` / the export's ``eagle3_train.json``.
        steps: drafted tokens per verify step (k >= 1); the verifier checks k+1 tokens per forward.
        max_new_tokens: generate at most this many tokens (>= 1).
        eos_ids: stop after emitting any of these ids (kept in the output, like greedy).

    Returns:
        :class:`SpecResult`.

    Raises:
        UserError: bad ``steps``/``max_new_tokens``/``aux_layers``, empty or batched prompt.
    """
    if steps < 1:
        raise UserError(f"steps: must be >= 1, got {steps}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    aux_layers = [int(i) for i in aux_layers]
    if len(aux_layers) != 3:
        raise UserError(f"aux_layers: EAGLE-3 needs exactly 3 HF hidden_states indices, got {aux_layers}")
    device = _device(verifier)
    ids = _as_ids(input_ids, device)  # [1, n]
    eos = {int(e) for e in eos_ids}
    res = SpecResult(tokens=[])

    _sync(device)
    t_start = time.perf_counter()
    out = verifier(input_ids=ids, use_cache=True, output_hidden_states=True, **_prefill_kwargs(verifier))
    n_hidden = len(out.hidden_states)
    if max(aux_layers) >= n_hidden - 1 or min(aux_layers) < 1:
        raise UserError(f"aux_layers: {aux_layers} outside 1..{n_hidden - 2} for this {n_hidden - 1}-layer verifier")
    cache = _returned_cache(out)
    first = out.logits[:, -1].argmax(-1)  # [1]  x_n, from the prefill as in greedy
    if _append(res.tokens, [int(first)], eos, max_new_tokens):
        _sync(device)
        res.seconds = time.perf_counter() - t_start
        return res

    verified = ids.shape[1]  # verifier cache length: x_0..x_{n-1}
    dcache = DrafterCache()
    # step-0 input of the newly verified positions t0..t: tokens x_{t0+1..t+1}, features f_{t0..t}
    new_ids = torch.cat([ids[:, 1:], first.view(1, 1)], dim=1)  # [1, n]
    new_aux = _aux(out.hidden_states, aux_layers)  # [1, n, 3Ht]
    t0 = 0
    while True:
        # ---------------- draft ----------------
        ta = time.perf_counter()
        T = new_ids.shape[1]
        pos = torch.arange(t0, t0 + T, device=device).unsqueeze(0)  # [1, T]
        h = drafter.decode(new_ids, drafter.project(new_aux), pos, dcache)  # [1, T, H]
        t = t0 + T - 1  # last verified position
        h_prev = h[:, -1:]  # [1, 1, H]
        drafts = []
        for i in range(steps):
            d = drafter.compute_logits(h_prev)[:, -1].argmax(-1)  # [1] draft-vocab id
            tok = drafter.draft_to_target(d)  # [1] verifier id = d + d2t[d]
            drafts.append(tok)
            if i + 1 < steps:
                p = torch.full((1, 1), t + i + 1, dtype=torch.long, device=device)  # [1, 1]
                h_prev = drafter.decode(tok.view(1, 1), h_prev, p, dcache)  # [1, 1, H]
        dcache.crop(t + 1)  # keep step-0 keys of verified positions only
        drafts_t = torch.cat(drafts)  # [k]
        _sync(device)
        tb = time.perf_counter()
        res.draft_seconds += tb - ta

        # ---------------- verify ----------------
        last = torch.tensor([[res.tokens[-1]]], dtype=torch.long, device=device)  # [1, 1]
        vin = torch.cat([last, drafts_t.view(1, -1)], dim=1)  # [1, k+1]
        out = verifier(input_ids=vin, use_cache=True, output_hidden_states=True, **_cache_kwargs(verifier, cache))
        cache = _returned_cache(out)
        pred = out.logits[0].argmax(-1)  # [k+1]
        a = accepted_prefix(drafts_t, pred)
        emitted = torch.cat([drafts_t[:a], pred[a : a + 1]])  # [a+1]
        _crop(cache, verified + 1 + a)  # keep x_{t+1} and the accepted drafts
        emitted_list = emitted.tolist()
        res.accept_lengths.append(a + 1)
        res.accepted.append([j < a for j in range(steps)])
        res.verify_seconds += time.perf_counter() - tb
        if _append(res.tokens, emitted_list, eos, max_new_tokens):
            break
        new_aux = _aux(out.hidden_states, aux_layers)[:, : a + 1]  # [1, a+1, 3Ht]
        new_ids = emitted.view(1, -1)  # [1, a+1]
        t0 = verified
        verified += a + 1
    _sync(device)
    res.seconds = time.perf_counter() - t_start
    return res
