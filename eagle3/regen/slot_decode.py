"""The slot engine's decode: the attention path's choice and probe, decode windows over slot prefixes, the
(compiled) step, its CUDA graphs, device timers and the harvest of finished rows."""

from __future__ import annotations

import functools
import logging
import time
import warnings
from typing import Optional

import torch

from eagle3.regen.kv_cache import repeat_kv
from eagle3.regen.slot_attention import compiled_flex_decode, flex_decode, kv_num_blocks
from eagle3.regen.slot_policy import Held, capture_graph, choose_prefix, synced_seconds

log = logging.getLogger(__name__)


class SlotDecode:
    """:class:`eagle3.regen.slots.SlotEngine`'s decode (a mixin: the state is the engine's)."""

    def _pick_attention(
        self,
        attention: str,
        slots: int,
        h: int,
        hkv: int,
        d: int,
        dtype,
        cols: int,
        dv: Optional[int] = None,
    ):
        """The flex decode function, or None for sdpa_groups. On CUDA the compiled kernel is probed
        (compiled, run, graph-captured): ``flex`` raises on failure, ``auto`` warns and takes
        sdpa_groups; on CPU ``flex`` is eager, ``auto`` sdpa_groups.
        """
        if attention == "sdpa_groups" or (attention == "auto" and self.dev.type != "cuda"):
            return None
        if self.dev.type != "cuda":
            # eager FlexAttention is the point here (tests); its advice to compile is noise
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return functools.partial(flex_decode, block=self.block)
        fn = compiled_flex_decode()

        def call(q, k, v, attn_len, kv_indices, scale, num_blocks=None):
            return fn(q, k, v, attn_len, kv_indices, scale, self.block, num_blocks)

        try:
            self._probe_flex(call, slots, h, hkv, d, dtype, cols, dv)
        except Exception as e:  # noqa: BLE001 - any compile/capture failure: the SDPA path gives the same tokens
            if attention == "flex":
                raise RuntimeError(
                    f"SlotEngine: FlexAttention decode failed on {self.dev} "
                    f"({type(e).__name__}: {str(e)[:300]})"
                ) from e
            log.warning(
                "FlexAttention decode unavailable (%s: %s); regen attention falls back to sdpa_groups",
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            return None
        return call

    def _probe_flex(
        self, call, slots: int, h: int, hkv: int, d: int, dtype, cols: int, dv: Optional[int] = None
    ) -> None:
        """Compile and run the flex decode at ``[slots, h, 1, d]`` (values ``dv`` wide, default ``d``: MLA's differ,
        :func:`kv_head_dims`) against a ``cols``-column cache (and capture it
        in a CUDA graph when graphs are on); raises on any failure or a wrong result."""
        nb, dv = cols // self.block, d if dv is None else dv
        # K/V and block indices made as the cache is (the constructor's grad mode), the rest as a step makes them
        # (inference mode), so the compiled graph's guards match the engine's calls
        g = torch.Generator(device=self.dev).manual_seed(0)
        k = torch.randn(
            slots, hkv, cols, d, generator=g, device=self.dev, dtype=dtype
        )  # [S, Hkv, L, D]
        v = torch.randn(slots, hkv, cols, dv, generator=g, device=self.dev, dtype=dtype)
        idx = (
            torch.arange(nb, dtype=torch.int32, device=self.dev)
            .expand(slots, 1, 1, nb)
            .contiguous()
        )
        with torch.inference_mode():
            q = torch.randn(
                slots, h, 1, d, generator=g, device=self.dev, dtype=dtype
            )  # [S, H, 1, D]
            attn_len = torch.arange(slots, device=self.dev) % cols  # [S]
            nbk = kv_num_blocks(attn_len, self.block)  # [S, 1, 1], as _step passes it
            scale = (
                d**-0.5
            )  # as the Llama-family modules pass it (the same compiled graph serves the engine)
            out = call(q, k, v, attn_len, idx, scale, num_blocks=nbk)  # [S, H, 1, D]
            if self.use_graphs:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    call(q, k, v, attn_len, idx, scale, num_blocks=nbk)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = call(q, k, v, attn_len, idx, scale, num_blocks=nbk)
                graph.replay()
            for r in sorted(
                {0, min(3, slots - 1), slots - 1}
            ):  # rows of 1, 4 and the most columns against SDPA
                n = int(attn_len[r]) + 1
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[r : r + 1].float(),
                    repeat_kv(k[r : r + 1, :, :n].float(), h // hkv),
                    repeat_kv(v[r : r + 1, :, :n].float(), h // hkv),
                    scale=scale,
                )  # [1, H, 1, D]
                err = float(
                    (out[r : r + 1].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-3)
                )
                if not err < (1e-4 if dtype == torch.float32 else 3e-2):
                    raise RuntimeError(
                        f"flex decode differs from SDPA by {err:.3g} (relative) at row {r}"
                    )

    def _decode_window(self) -> None:
        """``check_every`` decode steps over the smallest slot prefix holding every live slot (graph replays on CUDA)."""
        n = choose_prefix(self.prefixes, [s for s, k in enumerate(self.key) if k is not None])
        t0 = self._mark()
        for i in range(self.check_every):
            if i == 0 and n not in self._tried:
                self._first_step(n)
            elif self.use_graphs:
                self._graph_step(n)
            else:
                self._step(n)
        self._timed.append(("decode_s", t0, self._mark()))
        self.stats["decode_steps"] += self.check_every
        ps = self.stats["prefix_steps"]
        ps[str(n)] = ps.get(str(n), 0) + self.check_every
        if self.flex is None:
            self.stats["kv_bytes_read"] += (
                self.check_every
                * sum((min(b, n) - a) * cap for a, b, cap in self.groups if a < n)
                * self.kv_bytes_per_token
            )

    def _compiled_at(self, n: int) -> bool:
        """Whether a step over prefix ``n`` runs the compiled step (``compile_step`` held and ``n >= compile_min_prefix``)."""
        return self._compiled is not None and n >= self._compile_min

    def _step(self, n: Optional[int] = None) -> None:
        """One decode step of the slots ``[:n]``: the compiled step where :meth:`_compiled_at`, else :meth:`_step_eager`
        (the cache's flex call is set to match: traced inline when compiled, compiled alone when eager)."""
        n = self.S if n is None else n
        if self._compiled_at(n):
            self.cache.flex = (
                self._flex_inline if self.flex is not None else None
            )  # None: flex dropped (sdpa_groups)
            self._compiled(n)
        else:
            if self.flex is not None:
                self.cache.flex = self._flex_alone
            self._step_eager(n)

    def _step_eager(self, n: int) -> None:
        """One decode step of the slots ``[:n]`` (device-only: no host sync; finished and empty slots of the prefix
        compute, unchanged)."""
        c = self.cache
        lengths, done, n_gen = (
            self.lengths[:n],
            self.done[:n],
            self.n_gen[:n],
        )  # [n] views: in-place ops write the state
        c.lengths = lengths
        if self.flex is not None:
            c.attn_len = torch.where(
                done, torch.zeros_like(lengths), lengths
            )  # [n] finished/empty: column 0 only
            c.kv_blocks = kv_num_blocks(c.attn_len, self.block)  # [n, 1, 1]
            self.kv_cols += c.kv_blocks.sum() * self.block
        else:
            c.groups = [
                (
                    a,
                    min(b, n),
                    (self.col[:cap] <= lengths[a : min(b, n), None]).view(min(b, n) - a, 1, 1, cap),
                )
                for a, b, cap in self.groups
                if a < n
            ]  # [S_g, 1, 1, cap] per group in the prefix
        logits = self.model(
            input_ids=self.last[:n, None],
            position_ids=lengths[:, None],
            slot_cache=c,
            use_cache=False,
        ).logits  # [n, 1, V]
        tok = logits[:, -1].argmax(-1)  # [n]
        active = ~done  # [n]
        ar, out = self.ar[:n], self.out[:n]
        idx = n_gen.clamp(max=self.max_new - 1)  # [n]
        out[ar, idx] = torch.where(active, tok, out[ar, idx])
        n_gen += active
        hit = torch.isin(tok, self.stop_t) & active
        self.stopped[:n] |= hit
        done |= hit | (n_gen >= self.max_new)
        lengths += active
        self.last[:n].copy_(torch.where(active, tok, self.last[:n]))

    def _first_step(self, n: int) -> None:
        """The first step over prefix ``n`` (where flex compiles and is captured for that shape): a flex failure
        raises for ``attention="flex"``; for ``auto`` the engine logs it, switches to sdpa_groups and redoes the step.
        Its host seconds (compile + capture; one sync before and after) go to ``stats["first_step_s"][str(n)]``."""
        fs = self.stats["first_step_s"]  # a prefix retried after a dropped path adds up
        fs[str(n)] = fs.get(str(n), 0.0) + synced_seconds(
            self.dev, lambda: self._first_step_tries(n)
        )
        self._tried.add(n)

    def _first_step_tries(self, n: int) -> None:
        """:meth:`_first_step`'s step: retried uncompiled after a failed compile, then on sdpa_groups after a failed
        flex (``auto``), the decode state restored before each retry; any other failure raises."""
        while True:
            state = (
                [t.clone() for t in self._state()]
                if self.flex is not None or self._compiled_at(n)
                else None
            )
            try:
                self._graph_step(n) if self.use_graphs else self._step(n)
                return
            except Exception as e:  # noqa: BLE001 - re-raised below unless the compiled step or flex can be dropped
                if state is None:
                    raise
                for t, v in zip(self._state(), state):
                    t.copy_(v)
                if self._compiled_at(n):
                    self._drop_compile(
                        n, e
                    )  # then the step is retried uncompiled (a flex failure next drops flex)
                else:
                    self._drop_flex(n, e)

    def _drop_compile(self, n: int, e: Exception) -> None:
        """Leave the compiled step after a failure at prefix ``n``: one warning, then eager steps (and graphs)."""
        log.warning(
            "compiled decode step failed at slot prefix %d (%s: %s); regeneration goes on uncompiled",
            n,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        self._compiled = None
        self.flex = self.cache.flex = self._flex_alone
        self.graphs.clear()
        self._tried.clear()
        self.stats["compiled_step"] = False

    def _drop_flex(self, n: int, e: Exception) -> None:
        """Leave the flex path after a failure at prefix ``n`` (``auto``), or raise (``flex``)."""
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if self.attention_mode == "flex":
            raise RuntimeError(
                f"SlotEngine: FlexAttention decode failed at slot prefix {n} ({msg})"
            ) from e
        log.warning(
            "FlexAttention decode failed at slot prefix %d (%s); regen attention falls back to sdpa_groups",
            n,
            msg,
        )
        self.stats["kv_bytes_read"] = (
            int(self.kv_cols) * self.kv_bytes_per_token
        )  # flex's reads so far (one sync)
        self.flex = self.cache.flex = None
        self.graphs.clear()  # recaptured on the SDPA path (self.groups: one group over the whole cache)
        self.stats["attention"] = "sdpa_groups"

    def _graph_step(self, n: Optional[int] = None) -> None:
        n = self.S if n is None else n
        if n not in self.graphs and self._capture(n) is None:
            self._step(n)
            return
        self.graphs[n].replay()

    def _state(self) -> tuple:
        return self.last, self.lengths, self.n_gen, self.done, self.stopped, self.out, self.kv_cols

    def _capture(self, n: int):
        """Capture ``_step(n)`` as a CUDA graph (state is restored after the warm-up run); None on failure."""
        state = [t.clone() for t in self._state()]
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # the warm-up (allocator, lazy init, flex compile) advances the state: restored before the capture; the
            # K/V it writes are rewritten identically
            g = capture_graph(
                lambda: self._step(n),
                self._pool,
                after_warmup=lambda: [t.copy_(v) for t, v in zip(self._state(), state)],
            )
        except Exception as e:  # noqa: BLE001 - any capture failure: decode eagerly (same results)
            for t, v in zip(self._state(), state):
                t.copy_(v)
            if self.flex is not None or self._compiled_at(n):
                raise  # _first_step leaves the compiled step, then the flex path (auto), first
            log.warning(
                "CUDA graph capture failed (%s: %s); decoding without graphs", type(e).__name__, e
            )
            self.use_graphs = False
            return None
        self.graphs[n] = g
        self.stats["graph_captures"] += 1
        return g

    def _mark(self):
        """A timestamp of the work queued so far: a recorded CUDA event on CUDA (no sync), else the host clock."""
        if self.dev.type != "cuda":
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _read_timers(self) -> None:
        """Add the device time of the prefills and decode windows recorded so far to ``stats`` (``prefill_s``,
        ``decode_s``; on the CPU host seconds); after a sync, so every event has completed."""
        for key, a, b in self._timed:
            self.stats[key] += (b - a) if isinstance(a, float) else a.elapsed_time(b) / 1000.0
        self._timed.clear()

    def _harvest(self) -> list[tuple[object, list[int], Optional[int]]]:
        """One host sync: finished slots' answers come back and the slots are freed."""
        flags = torch.cat(
            [
                torch.stack([self.done.long(), self.stopped.long(), self.n_gen]).flatten(),
                self.kv_cols.view(1),
            ]
        ).cpu()  # [3 S + 1]
        self._read_timers()
        done, stopped, n_gen = flags[:-1].view(3, self.S).tolist()
        if self.flex is not None:
            self.stats["kv_bytes_read"] = int(flags[-1]) * self.kv_bytes_per_token
        fin = [s for s in range(self.S) if self.key[s] is not None and done[s]]
        if not fin:
            return []
        rows = self.out[torch.tensor(fin, device=self.dev)].cpu().tolist()  # [F, T]
        out = []
        for s, row in zip(fin, rows):
            steps = (
                n_gen[s] - 1
            )  # decode steps after the prefill's token; step j attends prompt + j columns
            self.stats["kv_tokens_needed"] += steps * self.host_len[s] + steps * (steps + 1) // 2
            stop = (
                row[n_gen[s] - 1] if stopped[s] else None
            )  # the stop token is the last generated one
            out.append((self.key[s], row[: n_gen[s] - int(bool(stopped[s]))], stop))
            if self.retain[
                s
            ]:  # K/V of the prompt and of every answer token but the last (fed back, never computed)
                if (
                    self.key[s] in self.retained
                ):  # the key's earlier retained slot was never claimed: free it
                    self.hold[self.retained[self.key[s]]] = None
                self.hold[s] = Held(self.key[s], self.host_ids[s] + row[: n_gen[s] - 1])
                self.retained[self.key[s]] = s
            self.key[s], self.host_ids[s], self.retain[s] = None, None, False
        return out
