"""The slot engine's admission and prefill: waiting prompts into free (or retained) slots, prefilled padded,
bucketed (``prefill_graphs``) or packed (``prefill_pack``), at column offsets after a reused prefix."""

from __future__ import annotations

import heapq
import logging
import time
from typing import Optional

import torch

from eagle3.regen.packed_prefill import (
    PackedBuffers,
    packed_layout,
)
from eagle3.regen.slot_attention import offset_prefill_layout
from eagle3.regen.slot_policy import (
    PrefillBuffers,
    Waiting,
    capture_graph,
    common_prefix,
    defer_refill,
    prefill_bucket,
    synced_seconds,
)

log = logging.getLogger(__name__)


class SlotPrefill:
    """:class:`eagle3.regen.slots.SlotEngine`'s admission and prefill (a mixin: the state is the engine's)."""

    def _class_of(self, n_prompt: int) -> int:
        """Index of the narrowest width class holding a prompt of ``n_prompt`` tokens and its answer."""
        return next(c for c, cap in enumerate(self.caps) if cap >= n_prompt + self.max_new)

    def _partition(self) -> None:
        """Slot groups per width class, sized by the waiting prompts' classes (the widest keeps >= S/16, >= 1)."""
        need = [0] * len(self.caps)
        for w in self.waiting:
            need[self._class_of(len(w.ids))] += 1
        total = max(1, sum(need))
        share = [int(self.S * n / total) for n in need]
        share[-1] = max(share[-1], max(1, self.S // 16))
        while sum(share) > self.S:  # take the excess from the largest group
            share[share.index(max(share))] -= 1
        share[share.index(max(share))] += self.S - sum(share)
        self.groups, start = [], 0
        for n, cap in zip(share, self.caps):
            if n:
                self.groups.append((start, start + n, cap))
                start += n

    def _free_slot(self, s: int) -> bool:
        """Slot ``s`` holds no request, running or retained."""
        return self.key[s] is None and self.hold[s] is None

    def _release_delivered(self) -> None:
        """Free the retained slots whose answer was yielded and whose successor did not come (stage 01: the next turn
        is over the context cap, or the conversation is done)."""
        for key in [
            k
            for k, s in self.retained.items()
            if self.hold[s].delivered and k not in self.successors
        ]:
            self.hold[self.retained.pop(key)] = None

    def _claim(self, w: Waiting) -> Optional[tuple[Waiting, int, int]]:
        """Successor ``w`` takes its parent's retained slot: ``(w, slot, offset)``, ``offset`` the cached columns it
        keeps (the longest common prefix of the cached ids and its prompt, at most ``len - 1``: the last prompt token
        is always prefilled, for the first answer token's logits; 0 below ``reuse_min_tokens``: a full prefill into
        the slot). None when the slot's width class is too narrow for it (the slot is freed, ``w`` queued)."""
        s = self.retained.pop(w.parent)
        held, self.hold[s] = self.hold[s], None
        cap = next(cap for a, b, cap in self.groups if a <= s < b)
        if cap < len(w.ids) + self.max_new:
            heapq.heappush(self.waiting, w)
            self.stats["reuse_full_prefills"] += 1
            return None
        off = min(common_prefix(held.ids, w.ids), len(w.ids) - 1)
        if off < self.reuse_min_tokens:
            off = 0
            self.stats["reuse_full_prefills"] += 1
        return w, s, off

    def _admit(self) -> None:
        """Prefill waiting prompts into free slots of their class or a wider one, and successors into their parents'
        retained slots (right-padded batches of <= ``prefill_tokens`` tokens of prompt suffixes)."""
        if self.groups is None:
            self._partition()
        self._release_delivered()
        free = [
            [s for s in range(a, b) if self._free_slot(s)] for a, b, _ in self.groups
        ]  # per group
        n_free = sum(map(len, free)) + len(self.successors)  # a successor's slot is ready for it
        # refill in bulk: a prefill forward costs a launch-bound pass however few rows it has
        if (
            not n_free
            or not (self.waiting or self.successors)
            or defer_refill(
                n_free, self.S, len(self.waiting) + len(self.successors), self.refill_free
            )
        ):
            return
        claimed = [self._claim(w) for w in self.successors.values()]
        self.successors.clear()
        placed = [c for c in claimed if c is not None]  # (request, slot, cached columns kept)
        self._place_waiting(placed)
        self._prefill_in_batches(placed)

    def _place_waiting(self, placed: list) -> None:
        """Append to ``placed`` (``(request, slot, cached columns kept)``) waiting prompts popped from the heap into
        free slots of their class or a wider one (lowest free slot first: the live rows stay in a short prefix);
        one that only a narrower slot could take waits for one of its class."""
        taken = {s for _, s, _ in placed}
        free = [
            [s for s in range(a, b) if self._free_slot(s) and s not in taken]
            for a, b, _ in self.groups
        ]  # with the slots of successors _claim queued
        n_heap = sum(map(len, free))
        from_heap, deferred = 0, []
        for _ in range(min(len(self.waiting), 4 * n_heap)):
            if from_heap == n_heap:
                break
            w = heapq.heappop(self.waiting)
            need = self.caps[self._class_of(len(w.ids))]
            g = next(
                (g for g, (_, _, cap) in enumerate(self.groups) if cap >= need and free[g]), None
            )
            if g is None:
                deferred.append(w)  # only narrower slots are free: it waits for one of its class
            else:
                placed.append(
                    (w, free[g].pop(0), 0)
                )  # lowest free slot first: the live rows stay in a short prefix
                from_heap += 1
        for w in deferred:
            heapq.heappush(self.waiting, w)

    def _prefill_in_batches(self, placed: list) -> None:
        """Prefill ``placed`` by suffix length (the width a forward pads to) in forwards of at most
        ``prefill_tokens`` tokens (:meth:`_fits`)."""
        placed.sort(
            key=lambda x: len(x[0].ids) - x[2]
        )  # by suffix length: the width a forward pads to
        suffix = [len(w.ids) - o for w, _, o in placed]  # tokens each row feeds
        i = 0
        while i < len(placed):
            j, width, total = i, 0, 0
            while j < len(placed) and self._fits(
                j - i + 1, max(width, suffix[j]), suffix[j], total + suffix[j]
            ):
                width, total = max(width, suffix[j]), total + suffix[j]
                j += 1
            self._prefill(
                [w for w, _, _ in placed[i:j]],
                [s for _, s, _ in placed[i:j]],
                width,
                [o for _, _, o in placed[i:j]],
            )
            i = j

    def _fits(self, rows: int, width: int, last: int, total: int) -> bool:
        """Whether a prefill forward of ``rows`` prompts padded to ``width`` tokens stays within ``prefill_tokens``
        (a single prompt of ``last`` tokens always fits); with ``prefill_graphs`` at its bucketed shape
        (:func:`prefill_bucket`); with ``prefill_pack`` its ``total`` fed tokens (the rows' suffixes back to back)."""
        if self.prefill_pack:
            return total <= max(self._pack_budget, last)
        if not self.prefill_graphs:
            return width * rows <= max(self.prefill_tokens, last)
        cols = self.cache.k[0].shape[2]
        pb, wb, _ = prefill_bucket(rows, width, 0, self.S, cols)
        return pb * wb <= max(self.prefill_tokens, prefill_bucket(1, last, 0, self.S, cols)[1])

    def _prefill(
        self,
        reqs: list[Waiting],
        slots: list[int],
        width: int,
        offsets: Optional[list[int]] = None,
    ) -> None:
        """One right-padded prefill forward; each row's first answer token goes to its slot.

        ``offsets[r]``: columns of slot ``slots[r]`` already holding ``reqs[r].ids[:offsets[r]]``; only the
        suffix is fed, at positions and columns ``offsets[r] + j`` (:func:`offset_prefill_attention`); all
        offsets 0 or None: the causal path. ``width``: the longest suffix.
        """
        p = len(reqs)
        offsets = offsets if offsets is not None else [0] * p
        if self.prefill_pack and self._prefill_packed(reqs, slots, offsets):
            return
        if self.prefill_graphs:
            t0 = self._mark()
            rows, lens, tok = self._prefill_bucketed(
                reqs, slots, width, offsets
            )  # [P] each, on device
            self._prefill_state(rows, lens, tok)
            self._timed.append(("prefill_s", t0, self._mark()))
            self._prefill_host(reqs, slots, offsets)
            return
        ids = torch.zeros(p, width, dtype=torch.long)  # [P, Wp]
        for r, (w, o) in enumerate(zip(reqs, offsets)):
            ids[r, : len(w.ids) - o] = torch.tensor(w.ids[o:], dtype=torch.long)
        lens = torch.tensor(
            [len(w.ids) for w in reqs], device=self.dev
        )  # [P] prompt lengths (cached + fed)
        off = torch.tensor(offsets, device=self.dev)  # [P]
        rows = torch.tensor(slots, device=self.dev)  # [P]
        self.cache.rows = rows
        if any(offsets):
            self.cache.prefill_cols, self.cache.prefill_mask = offset_prefill_layout(
                off, width, self.cache.k[0].shape[2]
            )  # [P, Wp], [P, 1, Wp, Kw]
        t0 = self._mark()
        pos = off[:, None] + torch.arange(
            width, device=self.dev
        )  # [P, Wp] RoPE positions after the cached prefix
        hid = self.model.base_model(
            input_ids=ids.to(self.dev), position_ids=pos, slot_cache=self.cache, use_cache=False
        ).last_hidden_state  # [P, Wp, hidden]
        self.cache.rows = self.cache.prefill_cols = self.cache.prefill_mask = None
        last = hid[
            torch.arange(p, device=self.dev), lens - off - 1
        ]  # [P, hidden] the last prompt token of each row
        tok = self.model.get_output_embeddings()(last).argmax(-1)  # [P]
        self._prefill_state(rows, lens, tok)
        self._timed.append(("prefill_s", t0, self._mark()))
        self._prefill_host(reqs, slots, offsets)
        self.stats["prefill_padded_tokens"] += p * width

    def _prefill_state(self, rows: torch.Tensor, lens: torch.Tensor, tok: torch.Tensor) -> None:
        """Decode state of freshly prefilled slots (device ops): ``rows`` int64 ``[P]`` the slots, ``lens`` int64 ``[P]``
        their prompt lengths (cached + fed), ``tok`` int64 ``[P]`` the first answer token of each."""
        self.last[rows] = tok
        self.out[rows, 0] = tok
        self.n_gen[rows] = 1
        self.lengths[rows] = lens
        self.stopped[rows] = torch.isin(tok, self.stop_t)
        self.done[rows] = self.stopped[rows] | (self.max_new <= 1)

    def _prefill_host(self, reqs: list[Waiting], slots: list[int], offsets: list[int]) -> None:
        """Host bookkeeping of a prefill forward: the slots' requests and the prefill counters."""
        for s, w in zip(slots, reqs):
            self.key[s], self.host_len[s], self.host_ids[s], self.retain[s] = (
                w.key,
                len(w.ids),
                w.ids,
                w.retain,
            )
        self.stats["prefill_calls"] += 1
        self.stats["prefill_tokens"] += sum(len(w.ids) - o for w, o in zip(reqs, offsets))
        self.stats["reused_tokens"] += sum(offsets)
        self.stats["reuse_rows"] += sum(o > 0 for o in offsets)

    # ------------------------------------------------------------------ bucketed prefill (prefill_graphs)
    def _prefill_bucketed(
        self, reqs: list[Waiting], slots: list[int], width: int, offsets: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One prefill forward at its bucketed shape (:func:`prefill_bucket`), replayed from the
        bucket's CUDA graph when captured, else eager over the same static buffers. Rows ``[P, Pb)`` pad
        into slot ``S`` (the scratch row).

        Returns:
            ``(rows, lens, tok)``: int64 ``[P]`` device views (slots, prompt lengths, first answer
            tokens), valid until the bucket's next forward.
        """
        p, cols = len(reqs), self.cache.k[0].shape[2]
        kv = max(len(w.ids) for w in reqs) if any(offsets) else 0
        key = prefill_bucket(p, width, kv, self.S, cols)
        pb, wb, _ = key
        ids = torch.zeros(pb, wb, dtype=torch.long)  # [Pb, Wb] host
        for r, (w, o) in enumerate(zip(reqs, offsets)):
            ids[r, : len(w.ids) - o] = torch.tensor(w.ids[o:], dtype=torch.long)
        pad = [0] * (pb - p)
        meta = torch.tensor(
            [
                list(slots) + [self.S] * (pb - p),  # padded rows: the scratch cache row
                list(offsets) + pad,
                [len(w.ids) - o - 1 for w, o in zip(reqs, offsets)] + pad,
                [len(w.ids) for w in reqs] + pad,
            ],
            dtype=torch.long,
        )  # [4, Pb] host
        buf = self._prefill_bufs.get(key)
        if buf is None:
            buf = self._prefill_bufs[key] = PrefillBuffers.make(key, self.dev)
        cuda = self.dev.type == "cuda"
        buf.ids.copy_(ids.pin_memory() if cuda else ids, non_blocking=cuda)
        buf.meta.copy_(meta.pin_memory() if cuda else meta, non_blocking=cuda)
        if self._prefill_capture and buf.graph is None:
            self._prefill_graph(buf)
        if buf.graph is not None:
            buf.graph.replay()
        else:
            self._prefill_forward(buf)
        nb = self.stats["prefill_buckets"]
        name = "x".join(map(str, key if key[2] else key[:2]))
        nb[name] = nb.get(name, 0) + 1
        self.stats["prefill_padded_tokens"] += pb * wb
        return buf.meta[0, :p], buf.meta[3, :p], buf.tok[:p]

    def _prefill_forward(self, buf: "PrefillBuffers") -> None:
        """The forward of a bucketed prefill over ``buf``'s static tensors (the function a prefill graph captures;
        device ops only, static shapes): K/V of every row written to the cache (padded rows to the scratch row),
        ``buf.tok`` [Pb] = the greedy token after each row's last prompt token."""
        pb, wb, kw = buf.key
        c = self.cache
        rows, off, last = buf.meta[0], buf.meta[1], buf.meta[2]  # [Pb] each
        c.rows = rows
        if kw:
            c.prefill_cols, c.prefill_mask = offset_prefill_layout(
                off, wb, c.k[0].shape[2], kw=kw
            )  # [Pb, Wb], [Pb, 1, Wb, Kwb]
        try:
            pos = off[:, None] + torch.arange(
                wb, device=self.dev
            )  # [Pb, Wb] RoPE positions after the cached prefix
            hid = self.model.base_model(
                input_ids=buf.ids, position_ids=pos, slot_cache=c, use_cache=False
            ).last_hidden_state  # [Pb, Wb, hidden]
        finally:
            c.rows = c.prefill_cols = c.prefill_mask = None
        h = hid[
            torch.arange(pb, device=self.dev), last
        ]  # [Pb, hidden] the last prompt token of each row
        buf.tok.copy_(self.model.get_output_embeddings()(h).argmax(-1))  # [Pb]

    def _prefill_graph(self, buf, fn=None) -> None:
        """Capture ``fn`` (default :meth:`_prefill_forward` over ``buf``) as a CUDA graph in the shared
        prefill pool; on a failure one warning and eager prefill from then on.
        """
        t0 = time.perf_counter()
        try:
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            g = capture_graph(fn or (lambda: self._prefill_forward(buf)), self._prefill_pool)
        except Exception as e:  # noqa: BLE001 - any capture failure: prefill eagerly (same results)
            log.warning(
                "prefill CUDA graph capture failed at bucket %s (%s: %s); prefill forwards run eagerly",
                buf.key,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            self._prefill_capture = False
            for b in [*self._prefill_bufs.values(), *self._packed_bufs.values()]:
                b.graph = None
            return
        finally:
            self.stats["prefill_capture_s"] += time.perf_counter() - t0
        buf.graph = g
        self.stats["prefill_graph_captures"] += 1

    # ------------------------------------------------------------------ packed prefill (prefill_pack)
    def _prefill_packed(self, reqs: list[Waiting], slots: list[int], offsets: list[int]) -> bool:
        """One packed prefill forward (:mod:`eagle3.regen.packed_prefill`); the shape's CUDA graph is
        captured at its second use. Returns False when it failed on CUDA (one warning, the engine leaves
        the packed path and the caller prefills these rows padded).
        """
        lay = packed_layout(
            [w.ids[o:] for w, o in zip(reqs, offsets)],
            offsets,
            slots,
            self.S,
            self.cache.k[0].shape[2],
            self.block,
        )
        key = (lay.q.shape[1], lay.prefix.shape[1])  # (Tq, Tp)
        buf = self._packed_bufs.get(key)
        if buf is None:
            buf = self._packed_bufs[key] = PackedBuffers.like(lay, self.dev)
        t0 = self._mark()
        buf.fill(lay)
        buf.uses += 1
        try:
            self._run_packed(buf)
        except Exception as e:  # noqa: BLE001 - on CUDA: leave the packed path (padded prefill gives the same tokens)
            if not self._pack_fallback:
                raise
            if self._next_packed_compile(key, e):  # the forward rewrites the same K/V
                return self._prefill_packed(reqs, slots, offsets)
            self._leave_packed(key, e)
            return False
        p = len(reqs)
        self._prefill_state(
            buf.t.rows[0, :p], buf.t.rows[2, :p], buf.tok[:p]
        )  # [P] slots, prompt lengths, tokens
        self._timed.append(("prefill_s", t0, self._mark()))
        self._prefill_host(reqs, slots, offsets)
        nb, name = self.stats["prefill_buckets"], f"q{key[0]}" + (f"+p{key[1]}" if key[1] else "")
        nb[name] = nb.get(name, 0) + 1
        self.stats["prefill_padded_tokens"] += key[0]
        return True

    def _run_packed(self, buf: PackedBuffers) -> None:
        """The packed forward of ``buf``: its first use compiles (timed between two syncs), the second captures its
        CUDA graph (``cuda_graphs`` on CUDA), later ones replay it (or run eagerly without a graph)."""
        if (
            buf.uses == 1
        ):  # a new shape: its first forward (compile on CUDA) timed between two syncs
            self._first_packed(buf)
        elif self._prefill_capture and buf.graph is None:
            self._prefill_graph(buf, lambda: self._packed_forward(buf))
        if buf.graph is not None:
            buf.graph.replay()
        elif buf.uses > 1:
            self._packed_forward(buf)

    def _next_packed_compile(self, key: tuple, e: Exception) -> bool:
        """After a failed packed forward: switch to the next compile setting of the packed attention (static shapes;
        every shape's graph dropped), with a warning; False when none is left."""
        if not self._packed_flexes:
            return False
        log.warning(
            "packed prefill attention failed at stream shape %s (%s: %s); retrying with static-shape "
            "compiles",
            key,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        self._packed_flex = self._packed_flexes.pop(0)
        for b in self._packed_bufs.values():
            b.graph, b.uses = None, 0
        return True

    def _leave_packed(self, key: tuple, e: Exception) -> None:
        """Leave the packed path for good (one warning): later prefill forwards are padded."""
        log.warning(
            "packed prefill failed at stream shape %s (%s: %s); prefill forwards go on padded",
            key,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        self.prefill_pack = self.stats["prefill_pack"] = False
        self._packed_bufs.clear()

    def _first_packed(self, buf: PackedBuffers) -> None:
        """The first forward at a packed shape (on CUDA its attention's compile), its host seconds between two syncs
        added to ``stats["prefill_first_s"]`` (keys ``"q<Tq>"`` / ``"q<Tq>+p<Tp>"``)."""
        tq, tp = buf.key
        self.stats["prefill_first_s"][f"q{tq}" + (f"+p{tp}" if tp else "")] = synced_seconds(
            self.dev, lambda: self._packed_forward(buf)
        )

    def _packed_forward(self, buf: PackedBuffers) -> None:
        """The forward of a packed prefill over ``buf``'s static tensors (device ops only, static shapes: what a
        graph captures): K/V of every fed token written to its slot (padding to column ``L - 1`` of slot 0),
        ``buf.tok`` [S] = the greedy token after each row's last prompt token (padding rows: unused)."""
        c = self.cache
        c.packed = buf.routing(self._packed_flex, self.block)
        try:
            hid = self.model.base_model(
                input_ids=buf.t.ids, position_ids=buf.t.q[1:2], slot_cache=c, use_cache=False
            ).last_hidden_state  # [1, Tq, hidden]
        finally:
            c.packed = None
        h = hid[0, buf.t.rows[1]]  # [S, hidden] the last fed token of each row
        buf.tok.copy_(self.model.get_output_embeddings()(h).argmax(-1))  # [S]
