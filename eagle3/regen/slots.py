"""Continuous-batching greedy decoders for stage 01's in-process regeneration.

Contract (:class:`Engine`): :meth:`Engine.submit` queues prompt ids under a key and a priority
(``retain`` / ``parent``: cross-turn prefix-reuse hints); :meth:`Engine.results` yields
``(key, answer_ids, stop)`` as answers finish (``stop``: the stop token's id, None when
``max_new_tokens`` ran out) while the caller may submit more. Answers are greedy, as
:func:`eagle3.regen.regenerate.generate_greedy` returns them.

* :class:`SlotEngine` (``prompts.regen_engine: slots``): fixed decode slots over a preallocated KV
  cache ``[slots, kv_heads, max_len, head_dim]`` per layer, refilled every ``check_every`` steps (the
  only host syncs), attention registered in transformers' ``AttentionInterface``. Decode attention:
  ``flex`` (FlexAttention, a per-step ``BlockMask`` of each row's live blocks), ``sdpa_groups``
  (slot groups by width class, SDPA over the group's columns), ``auto`` (flex on CUDA when it
  compiles and graph-captures, else sdpa_groups). Decode windows run over the smallest slot prefix
  ``[:n]`` holding every live row, each prefix captured once as a CUDA graph. Cross-turn prefix reuse
  keeps a retained slot's K/V for the next turn and prefills only the suffix after the longest common
  prefix (:func:`offset_prefill_attention`). Prefill forwards run at bucketed shapes
  (:func:`prefill_bucket`, CUDA graphs) or packed (:mod:`eagle3.regen.packed_prefill`).
* :class:`HFContinuousEngine` (``prompts.regen_engine: hf_continuous``): transformers'
  ``ContinuousBatchingManager``, the library baseline ``bench/regen_speed.py`` measures.

Greedy tokens equal plain transformers greedy decoding in float32 (tests/test_continuous.py).
Design and measurements: DESIGN.md.
"""

from __future__ import annotations

import functools
import heapq
import logging
from typing import Iterator, Optional, Sequence

import torch

from eagle3.process_group import rank_tag
from eagle3.regen.flex_compat import kv_blocks_params, raise_recompile_limit
from eagle3.regen.kv_cache import SlotCache, check_kv_fits, host_available_bytes
from eagle3.regen.packed_prefill import PackedBuffers, compiled_packed_flex, eager_packed_flex
from eagle3.regen.slot_attention import AttentionSwap, flex_decode
from eagle3.regen.slot_decode import SlotDecode
from eagle3.regen.slot_policy import (
    PACK_EAGER_TOKENS,
    Held,
    PrefillBuffers,
    Waiting,
    compile_decision,
    prefix_sizes,
)
from eagle3.regen.slot_prefill import SlotPrefill
from eagle3.sdpa import no_cudnn_sdpa
from eagle3.verifier.arch import kv_head_dims

log = logging.getLogger(__name__)


class Engine:
    """Shared submit/results contract (module docstring).

    ``submit(key, ids, priority, parent=None, retain=False)``: ``key`` unique among queued, running
    or retained requests (a successor may reuse its parent's); ``retain`` / ``parent`` are hints an
    engine may ignore (:class:`HFContinuousEngine` does): answers are the same either way.
    """

    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        raise NotImplementedError

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine's resources (cache, threads, attention switch)."""


class SlotEngine(SlotPrefill, SlotDecode, Engine):
    """Continuous batching over ``slots`` decode rows with a preallocated KV cache (module docstring).

    Args:
        model: HF causal LM (eval) whose attention layers carry ``layer_idx`` and call the attention
            interface (Llama family).
        slots: decode rows (``prompts.gen_batch_size``).
        max_len: cache columns per slot (longest prompt + ``max_new_tokens``); longer: ValueError.
        max_new_tokens: answer budget.
        stop_ids: token ids that end an answer.
        check_every: decode steps between host checks (harvest finished rows, refill free slots).
        prefill_tokens: padded tokens per prefill forward (``rows x width``).
        width_classes: ``sdpa_groups`` only: ascending column caps of the slot groups (``max_len``
            last; default ``max_new_tokens`` + 128, + 512, + 1024); a prompt takes a slot of the
            narrowest class holding it and its answer.
        cuda_graphs: capture each slot prefix's decode step as a CUDA graph (eager if capture fails).
        attention: ``auto`` | ``flex`` | ``sdpa_groups``; ``flex`` raises when FlexAttention fails
            to compile or capture on CUDA, ``auto`` falls back with a warning.
        flex_block: KV block size of the flex path (columns).
        min_prefix: smallest slot prefix a decode window runs over (:func:`prefix_sizes`).
        compile_step: ``torch.compile`` the whole decode step per slot prefix from
            ``compile_min_prefix`` up; ``"auto"``: where :func:`compile_decision` expects it to pay.
            A failed compile warns once and runs uncompiled.
        compile_min_prefix: smallest prefix the compiled step runs over (default ``slots``).
        planned_answers: turns the caller will submit (sizes ``"auto"``; None: do not compile).
        prefix_reuse: honour ``retain`` / ``parent`` (False: every prompt prefilled in full).
        reuse_min_tokens: shortest common prefix worth reusing (tokens).
        refill_free: while half the slots are busy, wait for this share free (:func:`defer_refill`).
        prefill_graphs: bucketed prefill shapes (:func:`prefill_bucket`), padded rows into one
            scratch cache row after the slots, each bucket a CUDA graph at first use (eager on CPU).
        prefill_pack: packed prefill (:mod:`eagle3.regen.packed_prefill`), each ``(Tq, Tp)`` a CUDA
            graph at its second use; a failed packed forward on CUDA falls back to padded.
            Exclusive with ``prefill_graphs``.

    Memory: ``2 * layers * slots * max_len * kv_heads * head_dim`` elements of the model dtype
    (``slots + 1`` rows with ``prefill_graphs``) plus a ``[slots, max_new_tokens]`` int64 answer buffer.
    Priorities: lower tuples are admitted first. ``stats``: counters and timings of the run (decode
    steps, prefill calls and tokens fed / padded, graph captures, KV bytes read / needed, steps per
    prefix, device seconds of prefill and decode, first-step seconds, the compile decision, reused
    tokens and rows, prefill buckets used; keys as the code sets them).
    """

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        max_new_tokens: int,
        stop_ids: set[int],
        check_every: int = 16,
        prefill_tokens: int = 65536,
        width_classes: Optional[Sequence[int]] = None,
        cuda_graphs: bool = True,
        attention: str = "auto",
        flex_block: int = 128,
        min_prefix: int = 8,
        compile_step=False,
        compile_min_prefix: Optional[int] = None,
        planned_answers: Optional[int] = None,
        prefix_reuse: bool = True,
        reuse_min_tokens: int = 16,
        refill_free: float = 1 / 32,
        prefill_graphs: bool = False,
        prefill_pack: bool = False,
    ):
        self._init_options(model, slots, max_len, max_new_tokens, check_every)
        self.prefill_tokens = prefill_tokens
        self.prefix_reuse, self.reuse_min_tokens = bool(prefix_reuse), max(1, int(reuse_min_tokens))
        if not 0 < refill_free <= 1:
            raise ValueError(f"SlotEngine: refill_free in (0, 1], not {refill_free!r}")
        self.refill_free = float(refill_free)
        p = next(model.parameters())
        self.dev, dtype = p.device, p.dtype
        self.use_graphs = cuda_graphs and self.dev.type == "cuda"
        self._init_prefill_layout(prefill_graphs, prefill_pack, flex_block)
        dims = self._init_attention(attention, flex_block, dtype, compile_step, compile_min_prefix)
        self._setup_compile(compile_step, planned_answers)
        # the flex call the compiled step traces (== _flex_alone uncompiled)
        self._flex_inline = self.flex
        self._init_cache(width_classes, dims, dtype)
        self.prefixes = prefix_sizes(slots, min_prefix)
        # flex: KV columns read so far
        self.kv_cols = torch.zeros((), dtype=torch.long, device=self.dev)
        n_layers, hkv, d, dv = dims
        self.kv_bytes_per_token = n_layers * hkv * (d + dv) * p.element_size()
        self._init_slots(slots, max_len, max_new_tokens, stop_ids)
        self.stats = self._initial_stats()
        self._timed: list[
            tuple[str, object, object]
        ] = []  # (stat, start, end): read at the next sync
        self._swap = AttentionSwap(model).__enter__()

    def _init_options(
        self, model, slots: int, max_len: int, max_new_tokens: int, check_every: int
    ) -> None:
        """Checked sizes (ValueError naming the argument) and the engine's fixed sizes."""
        if slots < 1 or max_new_tokens < 1 or check_every < 1 or max_len <= max_new_tokens:
            raise ValueError(
                "SlotEngine: slots, max_new_tokens, check_every >= 1 and max_len > max_new_tokens"
            )
        self.model, self.S, self.max_len, self.max_new = model, slots, max_len, max_new_tokens
        self.check_every = check_every

    def _init_attention(
        self, attention: str, flex_block: int, dtype, compile_step, compile_min_prefix
    ) -> tuple[int, int, int, int]:
        """The decode attention path (:meth:`_pick_attention`) for the verifier's shapes; returns
        ``(layers, kv_heads, key width, value width)`` (MLA: keys and values of different widths)."""
        cfg = self.model.config.get_text_config()
        n_layers = cfg.num_hidden_layers
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d, dv = kv_head_dims(cfg)
        self.block, self.attention_mode = flex_block, attention
        self._tried: set = set()  # prefixes stepped once
        cols = -(-self.max_len // flex_block) * flex_block
        self.flex = self._pick_attention(
            attention, self.S, cfg.num_attention_heads, hkv, d, dtype, cols, dv
        )
        self._flex_alone = self.flex  # the flex call to go back to if the compiled step is dropped
        self._compile_min = (
            self.S if compile_min_prefix is None else max(1, int(compile_min_prefix))
        )
        return n_layers, hkv, d, dv

    def _init_cache(
        self, width_classes: Optional[Sequence[int]], dims: tuple[int, int, int, int], dtype
    ) -> None:
        """The width classes of ``sdpa_groups`` and the KV cache (checked against free memory:
        :func:`eagle3.regen.kv_cache.check_kv_fits`), ``[rows, kv_heads, cols, d]`` per layer; flex: the
        per-slot KV block indices ``[S, 1, 1, cols / block]``."""
        n_layers, hkv, d, dv = dims
        max_len, max_new, block = self.max_len, self.max_new, self.block
        if self.flex is not None:
            width_classes = []
        elif width_classes is None:
            width_classes = [max_new + extra for extra in (128, 512, 1024)]
        self.caps = sorted({c for c in width_classes if max_new < c < max_len} | {max_len})
        # (first, end slot, cap): set later
        self.groups: Optional[list[tuple[int, int, int]]] = None
        cols = -(-max_len // block) * block if self.flex is not None else max_len
        # prefill_graphs: one scratch row after the slots, where a bucketed prefill's padded rows write (decode runs
        # over slot prefixes [:n], n <= slots, so it never reads it)
        rows = self.S + int(self.prefill_graphs)
        on_gpu = self.dev.type == "cuda"
        free = torch.cuda.mem_get_info(self.dev)[0] if on_gpu else host_available_bytes()
        if free is not None:
            where = "the GPU has free" if on_gpu else "this machine has available (MemAvailable)"
            size = torch.empty((), dtype=dtype).element_size()
            check_kv_fits(rows, cols, n_layers, hkv, d, size, free, where, v_head_dim=dv)
        z = dict(dtype=dtype, device=self.dev)
        self.cache = SlotCache(
            k=[torch.zeros(rows, hkv, cols, d, **z) for _ in range(n_layers)],
            v=[torch.zeros(rows, hkv, cols, dv, **z) for _ in range(n_layers)],
        )
        if self.flex is not None:
            self.cache.flex = self.flex
            nb = cols // block
            ar = torch.arange(nb, dtype=torch.int32, device=self.dev)
            self.cache.kv_indices = ar.expand(self.S, 1, 1, nb).contiguous()  # [S, 1, 1, L / block]

    def _initial_stats(self) -> dict:
        """``stats`` at construction (the class docstring lists them). ``kv_tokens_needed``: the live rows' attended
        columns summed over decode steps; ``kv_bytes_read``: what the attention reads (flex: the blocks;
        sdpa_groups: every prefix slot up to its cap)."""
        return {
            "decode_steps": 0,
            "prefill_calls": 0,
            "prefill_tokens": 0,
            "prefill_padded_tokens": 0,
            "kv_bytes_read": 0,
            "kv_tokens_needed": 0,
            "graph_captures": 0,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefix_steps": {},
            "attention": "flex" if self.flex is not None else "sdpa_groups",
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "compiled_step": self._compiled is not None,
            "compile_min_prefix": self._compile_min,
            "first_step_s": {},
            "compile_decision": self.compile_decision,
            "prefix_reuse": self.prefix_reuse,
            "reused_tokens": 0,
            "reuse_rows": 0,
            "reuse_full_prefills": 0,
            "prefill_graphs": self.prefill_graphs,
            "prefill_graph_captures": 0,
            "prefill_capture_s": 0.0,
            "prefill_buckets": {},
            "prefill_pack": self.prefill_pack,
            "prefill_first_s": {},
        }

    def _init_prefill_layout(
        self, prefill_graphs: bool, prefill_pack: bool, flex_block: int
    ) -> None:
        """The prefill layout switches (padded, bucketed ``prefill_graphs`` or packed ``prefill_pack``; ValueError for
        both, or packing with a block size that is not a power of two), whether prefill forwards are captured, and
        the packed path's attention function."""
        self.prefill_graphs, self.prefill_pack = bool(prefill_graphs), bool(prefill_pack)
        if self.prefill_graphs and self.prefill_pack:
            raise ValueError(
                "SlotEngine: prefill_graphs and prefill_pack are exclusive (choose one prefill layout)"
            )
        if self.prefill_pack and (flex_block < 1 or flex_block & (flex_block - 1)):
            raise ValueError(
                f"SlotEngine: prefill_pack needs flex_block a power of two, not {flex_block}"
            )
        # bucketed / packed prefill forwards captured as CUDA graphs (else, and after a failed capture, run eagerly)
        self._prefill_capture = (self.prefill_graphs or self.prefill_pack) and self.use_graphs
        # packed prefill attention: compiled FlexAttention on CUDA (eager flex would build dense scores), eager on CPU
        cuda = self.dev.type == "cuda"
        # on CUDA: automatic dynamic shapes first (two compiles), static shapes (one compile per shape) if that fails
        self._packed_flexes = (
            (
                [compiled_packed_flex(None), compiled_packed_flex(False)]
                if cuda
                else [eager_packed_flex]
            )
            if self.prefill_pack
            else []
        )
        self._packed_flex = self._packed_flexes.pop(0) if self._packed_flexes else None
        self._pack_fallback = cuda  # a failed packed forward: warn and prefill padded (CPU: raise)
        # eager flex (off CUDA) materialises [H, Tq, Tq + Tp] scores per layer: its streams are kept short there
        self._pack_budget = (
            self.prefill_tokens if cuda else min(self.prefill_tokens, PACK_EAGER_TOKENS)
        )

    def _init_slots(
        self, slots: int, max_len: int, max_new_tokens: int, stop_ids: set[int]
    ) -> None:
        """The per-slot decode state on the device (``[S]`` tensors, the ``[S, T]`` answer buffer) and its host
        mirror (request key, prompt, retention per slot), all slots empty; the waiting queue; no graph yet."""
        z = dict(device=self.dev, dtype=torch.long)
        self.last = torch.zeros(slots, **z)  # [S] token fed to the next step
        self.lengths = torch.zeros(slots, **z)  # [S] cached tokens
        self.n_gen = torch.zeros(slots, **z)  # [S] answer tokens so far (stop token included)
        self.done = torch.ones(slots, dtype=torch.bool, device=self.dev)  # [S] finished or empty
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=self.dev)  # [S]
        self.out = torch.zeros(slots, max_new_tokens, **z)  # [S, T] answer tokens
        self.stop_t = torch.tensor(sorted(stop_ids), **z)
        self.col = torch.arange(max_len, **z)
        self.ar = torch.arange(slots, **z)
        self.key: list = [None] * slots  # host: request key per slot (None = free)
        self.host_len = [0] * slots  # host: prompt length of the slot's request
        self.host_ids: list = [None] * slots  # host: prompt ids of the slot's request
        self.retain = [
            False
        ] * slots  # host: keep the slot's K/V for a successor when its request finishes
        self.hold: list[Optional[Held]] = [
            None
        ] * slots  # host: a finished request's K/V kept for its successor
        self.retained: dict = {}  # key of a finished request -> its held slot
        self.successors: dict = {}  # parent key -> the waiting request that continues it
        self.waiting: list[Waiting] = []
        self._seq = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # per slot prefix
        self._pool = None  # one memory pool shared by the prefix graphs (replayed one at a time)
        # prefill_graphs: buffers per bucket (Pb, Wb, Kwb); prefill_pack: per stream shape (Tq, Tp)
        self._prefill_bufs: dict[tuple, PrefillBuffers] = {}
        self._packed_bufs: dict[tuple, PackedBuffers] = {}
        self._prefill_pool = None  # one memory pool shared by the prefill graphs

    def _setup_compile(self, compile_step, planned_answers: Optional[int]) -> None:
        """Decide (:func:`compile_decision`, once the attention path is known) and, if so, wrap the decode step in
        ``torch.compile`` (compiled lazily at its first call); the decision goes to ``self.compile_decision``."""
        self._compiled = None
        self.compile_decision = compile_decision(
            compile_step,
            self.dev.type,
            "flex" if self.flex is not None else "sdpa_groups",
            planned_answers,
            self.max_new,
            self.S,
        )
        if compile_step == "auto":
            log.info(
                "%sprompts.regen_compile: %s (%s)",
                rank_tag(suffix=": "),
                "compiling the decode step"
                if self.compile_decision["compile"]
                else "decode step not compiled",
                self.compile_decision["reason"],
            )
        if self.compile_decision["compile"]:
            kv_blocks_params()
            raise_recompile_limit()
            if self.flex is not None:  # traced inside the compiled step (no nested compile)
                self.flex = functools.partial(flex_decode, block=self.block)
            self._compiled = torch.compile(self._step_eager, dynamic=False)

    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        """Queue prompt ``ids`` (non-empty, ``len < max_len - max_new_tokens + 1``) under ``key``.

        With ``prefix_reuse``: ``retain=True`` keeps the slot and the K/V written (prompt + answer less
        its last token) until the check after the answer is yielded; a prompt submitted by then with
        ``parent=key`` takes that slot ahead of the priority order and prefills only the tokens after
        the longest common prefix. A ``parent`` not retained means a full prefill.
        """
        if not 0 < len(ids) <= self.max_len - self.max_new:
            raise ValueError(
                f"SlotEngine: prompt of {len(ids)} tokens (cache holds prompts of 1..{self.max_len - self.max_new})"
            )
        if key is None:
            raise ValueError("SlotEngine: a request key cannot be None (None marks a free slot)")
        w = Waiting((*priority, self._seq), key, list(ids), retain=self.prefix_reuse and retain)
        self._seq += 1
        if (
            self.prefix_reuse
            and parent is not None
            and parent in self.retained
            and parent not in self.successors
        ):
            w.parent = parent
            self.successors[parent] = w  # admitted into the parent's slot (not through the heap)
        else:
            heapq.heappush(self.waiting, w)

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        """Decode until nothing is waiting or live; yield answers as they are harvested (the next
        window is launched first, so the caller's host work overlaps the GPU).
        """
        ready: list = []
        # no cuDNN SDPA: its per-shape plans cost ~40 ms of host time per new prefill shape (eagle3.sdpa)
        with torch.inference_mode(), no_cudnn_sdpa():
            while True:
                self._admit()
                live = any(k is not None for k in self.key)
                if live:
                    self._decode_window()  # asynchronous on CUDA (graph replays)
                yield from ready
                for (
                    key,
                    _,
                    _,
                    # their successors had their chance: unclaimed slots are freed at the next check
                ) in ready:
                    if key in self.retained:
                        self.hold[self.retained[key]].delivered = True
                if not live and not self.waiting and not self.successors:
                    return
                ready = self._harvest() if live else []

    def close(self) -> None:
        if self._swap is not None:
            self._swap.__exit__(None, None, None)
            self._swap = None
        self.graphs.clear()
        self._prefill_bufs.clear()
        self._packed_bufs.clear()
        self.cache.k.clear()
        self.cache.v.clear()
