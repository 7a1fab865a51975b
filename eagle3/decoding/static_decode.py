"""Batch-1 static decoding for stage 05: greedy and EAGLE-3 chain decoding over preallocated
caches, each decode step and each phase of a speculative round captured once as a CUDA graph (at
batch 1 a small verifier's step is host-bound; graphs make the speedup measure the algorithm).

Same results as :mod:`eagle3.decoding.decode` at batch 1 (tests/benchmark/test_static_decode.py):
the same verify rule, emission cut and mismatch record (:mod:`eagle3.decoding.common`).

The verifier's K/V live in a :class:`eagle3.drafter.model.StaticKVCache` (column = position) read by
:func:`static_attention` (``AttentionInterface["eagle3_static"]``); a rejected draft's columns are
overwritten by the next verify. A round is three graphs: draft, verify, chunk (the drafter's step 0
over the verified positions). State stays on the device; the host checks "done" every
``check_every`` steps. Prefill runs eagerly; graphs are captured in :meth:`StaticDecoder.warm_up`.
"""

from __future__ import annotations

import logging
import time
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
    first_mismatch_update,
    forward_params,
    reference_tensor,
    spec_result,
    sync,
)
from eagle3.drafter.attention import _sdpa
from eagle3.drafter.caches import StaticKVCache
from eagle3.engines.layers import check_aux_layers
from eagle3.errors import UserError
from eagle3.regen.slot_attention import AttentionSwap
from eagle3.sdpa import no_cudnn_sdpa

log = logging.getLogger(__name__)

ATTN_NAME = "eagle3_static"


def resolve_decoder(
    decoder: str, batch_size: int, device: torch.device, sampled: Optional[float] = None
) -> str:
    """``batched`` or ``static`` for ``benchmark.decoder`` (``auto``: static at batch 1 on CUDA). ``sampled``: the
    ``benchmark.temperature`` of a sampled run (None at temperature 0), which runs batched (``auto`` too).

    Raises:
        UserError: ``static`` at temperature > 0, or at a batch size other than 1.
    """
    if decoder == "auto":
        cuda_one = batch_size == 1 and device.type == "cuda" and sampled is None
        return "static" if cuda_one else "batched"
    if decoder == "static" and (sampled is not None or batch_size != 1):
        why = (
            f"decodes at temperature 0 only; use 'batched' or 'auto' with benchmark.temperature {sampled}"
            if sampled is not None
            else f"decodes one prompt at a time; benchmark.batch_size is {batch_size}"
        )
        raise UserError(f"benchmark.decoder: 'static' {why}")
    return decoder


def static_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    static_kv: Optional[StaticKVCache] = None,
    **kwargs,
):
    """:class:`StaticDecoder`'s attention (``AttentionInterface["eagle3_static"]``, the signature of
    ``sdpa_attention_forward``): query ``[1, H, T, Dk]``, key/value of positions ``static_kv.pos``
    written to those columns, then SDPA over all columns under ``static_kv.attn_mask``
    ``[1, 1, T, C]``. Returns ``(out [1, T, H, Dv], None)``.

    Raises:
        RuntimeError: called without ``static_kv``.
    """
    c = static_kv
    if c is None:
        raise RuntimeError(
            f"attention '{ATTN_NAME}' needs the static_kv keyword (only StaticDecoder calls it)"
        )
    kc, vc = c.write(module.layer_idx, key, value, c.pos)  # [1, Hkv, C, Dk], [1, Hkv, C, Dv]
    out = _sdpa(query, kc, vc, scaling, attn_mask=c.attn_mask)  # [1, H, T, Dv]
    return out.transpose(1, 2), None


class StaticDecoder:
    """Greedy and EAGLE-3 chain decoding of one prompt at a time over static caches.

    Args:
        verifier: HF causal LM (eval) whose attention modules carry ``layer_idx``; switched to
            ``eagle3_static`` until :meth:`close`.
        capacity: cache columns (>= longest prompt + ``max_new_tokens`` + ``2 * steps + 2``).
        max_new_tokens, eos_ids: decoding settings (a row stops after an EOS id, kept).
        drafter: :class:`eagle3.drafter.model.Eagle3Drafter`, None for greedy only.
        aux_layers: the drafter's three HF indices. steps: drafts per round (>= 1).
        cuda_graphs: capture on CUDA. check_every: steps / rounds between host checks.

    Raises:
        UserError: bad ``aux_layers``.
    """

    def __init__(
        self,
        verifier,
        capacity: int,
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        drafter=None,
        aux_layers: Sequence[int] = (),
        steps: int = 3,
        cuda_graphs: bool = True,
        check_every: int = 4,
    ):
        cfg = verifier.config.get_text_config()
        if drafter is not None:
            check_aux_layers(aux_layers, cfg.num_hidden_layers, field="aux_layers")
        self.verifier, self.drafter, self.k, self.max_new = verifier, drafter, steps, max_new_tokens
        self.aux_layers, self.check_every = [int(i) for i in aux_layers], check_every
        self.dev = next(verifier.parameters()).device
        self.use_graphs = cuda_graphs and self.dev.type == "cuda"
        self.capacity = int(capacity)
        self.kv = StaticKVCache(self.capacity, cfg.num_hidden_layers, self.dev)
        self.dkv = StaticKVCache(
            self.capacity, getattr(getattr(drafter, "args", None), "num_layers", 1), self.dev
        )
        self._alloc_state(eos_ids)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.graph_error: Optional[str] = None  # why capture failed (then every phase runs eagerly)
        self._pool = None
        self._logits_to_keep = "logits_to_keep" in forward_params(verifier)
        self._swap = AttentionSwap(verifier, ATTN_NAME, static_attention).__enter__()

    def _alloc_state(self, eos_ids: Sequence[int]) -> None:
        """The device tensors every call reuses (graphs read and write them in place)."""
        z = dict(dtype=torch.long, device=self.dev)
        k, max_new_tokens, check_every = self.k, self.max_new, self.check_every
        self.eos = {int(e) for e in eos_ids}
        self.eos_t = torch.tensor(sorted(self.eos), **z)  # [E]
        self.jj = torch.arange(k + 1, **z)  # [k+1]
        self.width = max_new_tokens + k + 2  # output buffer; column width-1 = discard
        self.n = torch.zeros(1, **z)  # [1] verifier positions cached (= position of `last`)
        self.last = torch.zeros(1, **z)  # [1] last emitted token, not yet in the verifier cache
        self.e = torch.zeros(1, **z)  # [1] tokens emitted
        self.done = torch.ones(1, dtype=torch.bool, device=self.dev)  # [1]
        self.out_tok = torch.full((1, self.width), -1, **z)  # [1, W]
        self.ref = torch.full((1, max_new_tokens), -1, **z)  # [1, T] reference tokens (-1 = none)
        self.mm_idx = torch.full((1,), -1, **z)  # [1]
        self.mm_gap = torch.zeros(1, dtype=torch.float32, device=self.dev)  # [1]
        self.acc = torch.full((max_new_tokens + check_every + 2,), -1, **z)  # [R] accepted drafts
        self.r = torch.zeros(1, **z)  # [1] round counter
        self.drafts = torch.zeros(1, k, **z)  # [1, k] hand-off draft -> verify
        self.pred = torch.zeros(1, k + 1, **z)  # [1, k+1] hand-off verify -> chunk: verifier argmax
        self.vpos = torch.zeros(1, k + 1, **z)  # [1, k+1] verified positions
        self.a = torch.zeros(1, **z)  # [1] accepted drafts of the last verify
        self.aux: Optional[torch.Tensor] = None  # [1, k+1, 3Ht] verified positions' aux
        self.h_prev: Optional[torch.Tensor] = None  # [1, 1, H] step output drafting the next token
        self.live = torch.zeros(1, dtype=torch.bool, device=self.dev)  # [1] live at the last verify

    def _vforward(
        self, ids: torch.Tensor, pos: torch.Tensor, hidden: bool, last_only: bool = False
    ):
        """Verifier forward of ``ids [1, T]`` at positions ``pos [1, T]`` through the static cache."""
        self.kv.set_forward(pos[0])
        kw = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        return self.verifier(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            output_hidden_states=hidden,
            static_kv=self.kv,
            **kw,
        )

    def _prompt_inputs(self, row: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's ``input_ids`` and ``position_ids``, both ``[1, P]`` int64 on the decoder's device."""
        ids = torch.tensor([row], dtype=torch.long, device=self.dev)  # [1, P]
        return ids, torch.arange(len(row), device=self.dev)[None]  # [1, P]

    def _row(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of ints (:func:`eagle3.decoding.common.check_prompts`); ValueError when it does
        not fit :attr:`capacity`."""
        row = check_prompts([prompt])[0]
        need = len(row) + self.max_new + 2 * self.k + 2
        if need > self.capacity:
            raise ValueError(
                f"StaticDecoder: a prompt of {len(row)} tokens needs {need} cache columns, capacity {self.capacity}"
            )
        return row

    def _reset(self, first: torch.Tensor, P: int, reference: Optional[Sequence[int]]) -> None:
        """State after the prefill: ``first`` ``[1]`` the prefill's token, ``P`` prompt positions cached."""
        self.n.fill_(P)
        self.last.copy_(first)
        self.e.fill_(1)
        self.done.copy_(torch.isin(first, self.eos_t) | (self.e >= self.max_new))
        self.out_tok.fill_(-1)
        self.out_tok[:, 0] = first
        self.acc.fill_(-1)
        self.r.zero_()
        self.ref.copy_(
            reference_tensor([] if reference is None else [reference], self.ref.shape, self.dev)
        )
        self.mm_idx.fill_(-1)
        self.mm_gap.zero_()

    def _greedy_step(self) -> None:
        """One greedy token (graph body): the verifier on ``last`` at position ``n``."""
        logits = self._vforward(
            self.last[:, None], self.n[:, None], hidden=False
        ).logits  # [1, 1, V]
        tok = logits[:, -1].argmax(-1)  # [1]
        live = ~self.done  # [1]
        idx = torch.where(
            live & (self.e < self.max_new), self.e, torch.full_like(self.e, self.width - 1)
        )  # [1]
        self.out_tok.scatter_(1, idx[:, None], tok[:, None])
        self.e.add_(live.long())
        self.done.copy_(self.done | torch.isin(tok, self.eos_t) | (self.e >= self.max_new))
        self.n.add_(live.long())
        self.last.copy_(torch.where(live, tok, self.last))

    def _draft(self) -> None:
        """``k`` chain drafts from ``h_prev`` (graph body); drafted step ``i`` at position ``n - 1 + i``."""
        d, h = self.drafter, self.h_prev
        t = self.n - 1  # [1] last verified position
        for i in range(self.k):
            # [1] verifier ids = draft + d2t[draft]
            tok = d.draft_to_target(d.compute_logits(h)[:, -1].argmax(-1))
            self.drafts[:, i] = tok
            if i + 1 < self.k:
                h = d.decode_static(tok[:, None], h, (t + i + 1)[:, None], self.dkv)  # [1, 1, H]

    def _verify(self) -> None:
        """The verifier on ``[last, d_1..d_k]`` (graph body): acceptance, emission, the hand-off to :meth:`_chunk`."""
        D = self.drafts
        vin = torch.cat([self.last[:, None], D], dim=1)  # [1, k+1]
        vpos = self.n[:, None] + self.jj  # [1, k+1]
        out = self._vforward(vin, vpos, hidden=True)
        logits = out.logits  # [1, k+1, V]
        pred = logits.argmax(-1)  # [1, k+1]
        a = accepted_prefix(D, pred)  # [1]
        keep = self.jj[None] <= a[:, None]  # [1, k+1]
        live = ~self.done  # [1]
        emit_idx = self.e[:, None] + self.jj  # [1, k+1]
        write = keep & live[:, None] & (emit_idx < self.max_new)  # [1, k+1]
        self._mismatch(logits, pred, emit_idx, write)
        self.out_tok.scatter_(
            1, torch.where(write, emit_idx, torch.full_like(emit_idx, self.width - 1)), pred
        )
        self.acc.scatter_(0, self.r.clamp(max=self.acc.shape[0] - 1), a)
        self.r.add_(1)
        self.e.copy_(torch.where(live, self.e + a + 1, self.e))
        self.done.copy_(
            self.done | (torch.isin(pred, self.eos_t) & write).any(1) | (self.e >= self.max_new)
        )
        self.last.copy_(torch.where(live, pred.gather(1, a[:, None]).squeeze(1), self.last))
        self.n.copy_(torch.where(live, self.n + a + 1, self.n))
        self.pred.copy_(pred)
        self.vpos.copy_(vpos)
        self.a.copy_(a)
        self.live.copy_(live)
        self.aux.copy_(aux_states(out.hidden_states, self.aux_layers))  # [1, k+1, 3Ht]

    def _mismatch(self, logits, chosen, idx, live) -> None:
        """:func:`first_mismatch_update` of ``mm_idx`` / ``mm_gap`` in place against ``ref``."""
        mi, mg = first_mismatch_update(
            logits, chosen, self.ref, idx, live, self.mm_idx, self.mm_gap
        )
        self.mm_idx.copy_(mi)
        self.mm_gap.copy_(mg)

    def _chunk(self) -> None:
        """The drafter's step 0 over the verified positions (graph body): position ``vpos[j]`` takes token
        ``pred[j]`` (= x at ``vpos[j] + 1``) and its aux state; the output at the last kept one is the next ``h_prev``."""
        d = self.drafter
        h = d.decode_static(self.pred, d.project(self.aux), self.vpos, self.dkv)  # [1, k+1, H]
        h_a = h.gather(1, self.a[:, None, None].expand(1, 1, h.shape[-1]))  # [1, 1, H]
        self.h_prev.copy_(torch.where(self.live[:, None, None], h_a, self.h_prev))

    def _run(self, name: str, fn) -> None:
        """``fn`` as the CUDA graph ``name`` (captured at its first call; eager without graphs)."""
        if not self.use_graphs:
            fn()
            return
        g = self.graphs.get(name)
        if g is None:
            state = [t.clone() for t in self._state()]
            try:
                g = self._capture(fn)
            except Exception as e:  # noqa: BLE001 - any capture failure: the same functions eagerly (same results)
                for t, v in zip(self._state(), state):
                    t.copy_(v)
                self.graph_error = (
                    f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                )
                log.warning(
                    "StaticDecoder: CUDA graph capture of '%s' failed (%s); decoding without graphs",
                    name,
                    self.graph_error,
                )
                self.use_graphs = False
                self.graphs.clear()
                fn()
                return
            self.graphs[name] = g
        g.replay()

    def _capture(self, fn) -> "torch.cuda.CUDAGraph":
        """Capture ``fn``: one warm-up run on a side stream (its writes are redone by the replay that follows: every
        input it reads is restored first), then the capture, in one memory pool shared by the decoder's graphs."""
        state = [t.clone() for t in self._state()]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        for t, v in zip(self._state(), state):
            t.copy_(v)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            fn()
        for t, v in zip(self._state(), state):  # capture records without running, but be exact
            t.copy_(v)
        return g

    #: the device tensors the graphs read and write in place (``aux`` / ``h_prev`` once the first prefill made them)
    _STATE = "n last e done out_tok mm_idx mm_gap acc r drafts pred vpos a live aux h_prev".split()

    def _state(self) -> list:
        return [t for t in (getattr(self, n) for n in self._STATE) if t is not None]

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int]) -> BatchGreedy:
        """Greedy decoding of one prompt (the baseline); result as :func:`eagle3.decoding.decode.greedy_generate_batch`'s.

        Raises:
            UserError: an empty prompt. ValueError: the prompt does not fit :attr:`capacity`.
        """
        row = self._row(prompt)
        with no_cudnn_sdpa():
            sync(self.dev)
            t0 = time.perf_counter()
            P = len(row)
            ids, pos = self._prompt_inputs(row)  # [1, P], [1, P]
            first = (
                self._vforward(ids, pos, hidden=False, last_only=True).logits[:, -1].argmax(-1)
            )  # [1]
            self._reset(first, P, None)
            forwards = 1
            for step in range(1, self.max_new):
                if step % self.check_every == 0 and bool(self.done):
                    break
                self._run("greedy", self._greedy_step)
                forwards += 1
            toks = self.out_tok[0, : self.max_new].cpu().tolist()
            sync(self.dev)
            seconds = time.perf_counter() - t0
        return BatchGreedy(
            [cut([t for t in toks if t >= 0], self.eos, self.max_new)], seconds, forwards
        )

    def _spec_prefill(self, row: list[int], reference: Optional[Sequence[int]], timer) -> None:
        """The prompt's forward: the first token, its mismatch record, and the drafter's step 0 over the prompt
        (``h_prev`` at its last position; drafter time in ``timer``'s ``draft``)."""
        d = self.drafter
        ids, pos = self._prompt_inputs(row)  # [1, P], [1, P]
        out = self._vforward(ids, pos, hidden=True, last_only=True)
        plogits = out.logits[:, -1:]  # [1, 1, V]
        first = plogits[:, 0].argmax(-1)  # [1]
        self._reset(first, len(row), reference)
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.dev)  # [1, 1] output index 0
        self._mismatch(plogits, first[:, None], zero, zero == 0)
        aux = aux_states(out.hidden_states, self.aux_layers)  # [1, P, 3Ht]
        if self.aux is None:
            self.aux = aux.new_zeros(1, self.k + 1, aux.shape[-1])
        timer.start("draft")
        d_ids = torch.cat([ids[:, 1:], first[:, None]], dim=1)  # [1, P] step 0 at t takes x_{t+1}
        h = d.decode_static(d_ids, d.project(aux), pos, self.dkv)  # [1, P, H]
        if self.h_prev is None:
            self.h_prev = h[:, -1:].clone()
        else:
            self.h_prev.copy_(h[:, -1:])
        timer.stop("draft")

    def _rounds(self, timer) -> int:
        """Draft, verify and chunk rounds until the sequence is done; returns the rounds run."""
        rounds = 0
        while rounds < self.max_new:  # every round emits >= 1 token
            if rounds % self.check_every == 0 and bool(self.done):
                break
            timer.start("draft")
            self._run("draft", self._draft)
            timer.stop("draft")
            timer.start("verify")
            self._run("verify", self._verify)
            timer.stop("verify")
            timer.start("draft")
            self._run("chunk", self._chunk)
            timer.stop("draft")
            rounds += 1
        return rounds

    @torch.inference_mode()
    def speculative(
        self, prompt: Sequence[int], reference: Optional[Sequence[int]] = None
    ) -> BatchSpec:
        """EAGLE-3 chain decoding of one prompt; result as :func:`speculative_generate_batch`'s.

        Raises:
            UserError: an empty prompt, no drafter.
            ValueError: the prompt does not fit :attr:`capacity`.
        """
        if self.drafter is None:
            raise UserError("StaticDecoder.speculative: built without a drafter")
        row = self._row(prompt)
        timer = PhaseTimer(self.dev)
        with no_cudnn_sdpa():
            sync(self.dev)
            t0 = time.perf_counter()
            self._spec_prefill(row, reference, timer)
            rounds = self._rounds(timer)
            toks = self.out_tok[0, : self.max_new].cpu().tolist()
            acc = self.acc[: min(rounds, self.acc.shape[0])].cpu().tolist()
            mm_i, mm_g = int(self.mm_idx), float(self.mm_gap)
            sync(self.dev)
            seconds = time.perf_counter() - t0
        mismatch = (mm_i, mm_g) if reference is not None else None
        res = spec_result(toks, acc, self.k, self.eos, self.max_new, mismatch)
        return BatchSpec([res], seconds, timer.seconds("draft"), timer.seconds("verify"), rounds)

    def warm_up(self, prompt: Sequence[int]) -> None:
        """Untimed greedy and speculative runs of ``prompt`` (at most 8 new tokens are enough: the graphs are
        captured at their first call, kernels and allocator warmed)."""
        self.greedy(prompt)
        if self.drafter is not None:
            self.speculative(prompt)

    def close(self) -> None:
        """Drop the graphs and caches; the verifier's former attention implementation comes back."""
        if self._swap is not None:
            self._swap.__exit__(None, None, None)
            self._swap = None
        self.graphs.clear()
        for cache in (self.kv, self.dkv):
            cache.k.clear()
            cache.v.clear()

    def __enter__(self) -> "StaticDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def capacity_for(prompts: Sequence[Sequence[int]], max_new_tokens: int, steps: int) -> int:
    """Cache columns a :class:`StaticDecoder` needs for ``prompts``: the longest + ``max_new_tokens`` + ``2 * steps + 2``,
    rounded up to a multiple of 64."""
    need = max(len(p) for p in prompts) + max_new_tokens + 2 * steps + 2
    return -(-need // 64) * 64
