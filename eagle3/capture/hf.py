"""HF transformers capture backend: batched right-padded prefill (``eagle3.capture.base`` contract).

Works on any transformers causal LM, DeepseekV3 and multimodal wrappers (``config.text_config``)
included. Samples are right-padded (real tokens keep positions ``0..L-1``) and grouped by
:func:`plan_batches`. Forward pre-hooks on the aux decoder layers and a hook on the decoder's output
keep only the four states; the first capture checks on a padded probe that they equal
``output_hidden_states`` exactly, else falls back to it. :meth:`HFCapture.capture_async` slices,
casts (or encodes, :func:`eagle3.shards.write.encode_batch`) and copies the states to pinned host
memory with one non-blocking copy on a side stream, overlapping the next forward. The
last-hidden-state convention (``post_norm`` / ``pre_norm``) is detected with a probe forward.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from eagle3.capture.base import BackendInfo, LastHiddenState
from eagle3.errors import UserError
from eagle3.process_group import is_rank0
from eagle3.sdpa import no_cudnn_sdpa
from eagle3.shards.format import NONFINITE_FIX
from eagle3.shards.fp8 import Storage
from eagle3.shards.write import StoredStates, encode_batch
from eagle3.verifier.arch import last_hidden_state_kind, text_config

log = logging.getLogger(__name__)


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample positions into prefill batches of at most ``batch_tokens`` padded tokens.

    Longest first (ties: lower position), packed greedily; a batch costs ``len(batch) * max_len``;
    a longer sample forms its own batch. Deterministic in ``lengths`` and ``batch_tokens`` (a resumed
    run reproduces the batches, hence the tensors).

    Returns:
        batches of positions into ``lengths``.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        L = lengths[i]
        new_max = max(cur_max, L)
        if cur and (len(cur) + 1) * new_max > batch_tokens:
            batches.append(cur)
            cur, new_max = [], L
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


class HFCapture:
    """Capture backend over an in-process transformers model.

    Args:
        model: causal LM (or multimodal wrapper) in eval mode whose ``forward`` takes ``input_ids``,
            ``attention_mask``, ``output_hidden_states`` and returns N+1 ``hidden_states``.
        aux_layers: three HF ``hidden_states`` indices (checked by the caller).
        batch_tokens: padded-token budget per forward.
        pad_id: id written into padded positions (never attended, never returned).
    """

    def __init__(
        self, model, aux_layers: Sequence[int], batch_tokens: int = 16384, pad_id: int = 0
    ):
        self.model = model
        self.aux_layers = [int(i) for i in aux_layers]
        self.batch_tokens = int(batch_tokens)
        self.pad_id = int(pad_id)
        # multimodal wrappers (Kimi-K2.5): the language model's config
        tc = text_config(model.config)
        self.num_layers = int(tc.num_hidden_layers)
        self.hidden_size = int(tc.hidden_size)
        self.vocab_size = int(getattr(tc, "vocab_size", None) or model.config.vocab_size)
        params = inspect.signature(model.forward).parameters
        self._fwd_kw = {"output_hidden_states": True, "use_cache": False}
        # Only the hidden states are needed: keep 1 logit row instead of [B, L, V] (10 GB for Kimi).
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._last: LastHiddenState | None = None
        self._hooks_ok: Optional[bool] = None  # None = not yet checked (first capture)
        self._copy_stream = None  # CUDA side stream of the device -> host copies (lazy)

    def info(self) -> BackendInfo:
        """Verifier dims and the last-hidden-state convention (runs the probe forward once)."""
        archs = getattr(self.model.config, "architectures", None)
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "architecture": archs[0] if archs else type(self.model).__name__,
            "last_hidden_state": self.last_hidden_state(),
        }

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        """Prefill ``batch``; per sample (input order) ``[aux1, aux2, aux3, last]``, bf16 CPU
        ``[L_i, H]`` each owning exactly its storage. Synchronous :meth:`capture_async`.

        Raises:
            ValueError: an empty sample. RuntimeError: other than N+1 hidden states.
        """
        return self.capture_async(batch).result(own_storage=True)

    def capture_async(
        self, batch: list[list[int]], storage: Optional[Storage] = None
    ) -> "PendingCapture":
        """Launch the prefill of ``batch`` and the device -> host copy of its states; return at once.

        Args:
            storage: the shards' storage (stage 02): states also encoded on the device
                (:func:`eagle3.shards.write.encode_batch`), read with :meth:`PendingCapture.stored`;
                None: bf16 states for :meth:`PendingCapture.result`.

        Raises:
            ValueError: an empty sample. RuntimeError: other than N+1 hidden states.
        """
        if any(len(s) == 0 for s in batch):
            raise ValueError("HFCapture.capture: empty sample")
        parts = [
            (group, self._forward([batch[i] for i in group], storage))
            for group in plan_batches([len(s) for s in batch], self.batch_tokens)
        ]
        return PendingCapture(len(batch), parts)

    @torch.no_grad()
    @no_cudnn_sdpa()  # padded lengths change per batch: no per-shape cuDNN plans (~40 ms/call on H200)
    def prefill_states(
        self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> list[torch.Tensor]:
        """The 4 states of a padded batch, left on the device (online training), under ``no_grad``.

        Args:
            ids: int64 ``[B, L]`` on :attr:`device`, right-padded.
            attention_mask: int64 ``[B, L]`` (1 = real) or None.

        Returns:
            ``[aux1, aux2, aux3, last]``, each ``[B, L, H]`` in the model's dtype (padded rows: garbage).
        """
        return self._states(ids, attention_mask)

    @property
    def device(self) -> torch.device:
        """Device of the input embeddings (where input ids go; ``device_map`` models included)."""
        return self.model.get_input_embeddings().weight.device

    def _pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(ids [B, Lmax], attention_mask [B, Lmax] or None)`` right-padded on the model's device,
        copied non-blocking from pinned memory; no mask when nothing is padded.
        """
        B, Lmax = len(batch), max(len(s) for s in batch)
        dev = self.device
        pin = dev.type == "cuda"
        ids = torch.full((B, Lmax), self.pad_id, dtype=torch.long, pin_memory=pin)  # [B, Lmax]
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        att = None
        if any(len(s) != Lmax for s in batch):
            att = torch.zeros((B, Lmax), dtype=torch.long, pin_memory=pin)  # [B, Lmax]
            for b, s in enumerate(batch):
                att[b, : len(s)] = 1
            att = att.to(dev, non_blocking=pin)
        return ids.to(dev, non_blocking=pin), att

    def _hook_targets(self):
        """``(decoder, layers)``: the module whose output is ``hidden_states[-1]`` and its decoder
        layer list, or None when the model does not expose them (``get_decoder().layers``)."""
        get_decoder = getattr(self.model, "get_decoder", None)
        if not callable(get_decoder):
            return None
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError):
            return None
        layers = getattr(decoder, "layers", None)
        if (
            not isinstance(decoder, torch.nn.Module)
            or not isinstance(layers, torch.nn.ModuleList)
            or len(layers) != self.num_layers
        ):
            return None
        return decoder, layers

    def _states(self, ids: torch.Tensor, att: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """The 4 states ``[B, Lmax, H]``: by hooks once :meth:`_check_hooks` (first call) found them exact."""
        if self._hooks_ok is None:
            self._hooks_ok = self._check_hooks()
        return (self._states_hooked if self._hooks_ok else self._states_all)(ids, att)

    def _probe(self) -> list[int]:
        """The probe forwards' token ids: ``min(8, vocab)`` ids spread over the vocab."""
        return [i * 7919 % self.vocab_size for i in range(min(8, self.vocab_size))]

    def _states_hooked(self, ids: torch.Tensor, att: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """The 4 states via hooks: input of decoder layer i for each aux i, then the decoder output."""
        decoder, layers = self._hook_targets()
        got: dict[int, torch.Tensor] = {}

        def pre_hook(i):
            def fn(_mod, args, kwargs):
                # [B, Lmax, H] residual entering layer i
                got[i] = args[0] if args else kwargs["hidden_states"]

            return fn

        def out_hook(_mod, _args, out):
            h = getattr(out, "last_hidden_state", None)
            got[-1] = h if h is not None else out[0]  # [B, Lmax, H]

        with contextlib.ExitStack() as stack:
            for i in self.aux_layers:
                stack.enter_context(
                    layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
                )
            stack.enter_context(decoder.register_forward_hook(out_hook))
            self.model(input_ids=ids, attention_mask=att, use_cache=False, **self._keep_kw)
        return [got[i] for i in self.aux_layers + [-1]]

    def _states_all(self, ids: torch.Tensor, att: Optional[torch.Tensor]) -> list[torch.Tensor]:
        """The 4 states picked from ``output_hidden_states=True`` (all N+1 materialised)."""
        out = self.model(input_ids=ids, attention_mask=att, **self._fwd_kw, **self._keep_kw)
        hs = out.hidden_states  # (N+1) x [B, Lmax, H]
        if hs is None or len(hs) != self.num_layers + 1:
            n = None if hs is None else len(hs)
            raise RuntimeError(
                f"verifier returned {n} hidden states, expected num_hidden_layers + 1 = {self.num_layers + 1}"
            )
        return [hs[i] for i in self.aux_layers + [-1]]

    def _check_hooks(self) -> bool:
        """Whether the hooks reproduce ``output_hidden_states`` exactly, on a padded 2-sample probe."""
        if self._hook_targets() is None:
            return False
        seq = self._probe()
        ids, att = self._pad([seq, seq[: max(1, len(seq) // 2)]])  # [2, n], second row padded
        try:
            hooked = self._states_hooked(ids, att)
        except (KeyError, IndexError, TypeError) as e:
            log.info(
                "capture hooks unavailable (%s: %s); using output_hidden_states",
                type(e).__name__,
                e,
            )
            return False
        full = self._states_all(ids, att)
        # exact equality with NaN == NaN: an overflowing verifier is reported by the writer, not blamed on the hooks
        ok = all(
            a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
            for a, b in zip(hooked, full)
        )
        if not ok:
            log.warning(
                "decoder hooks do not reproduce output_hidden_states on this model; using output_hidden_states"
            )
        return ok

    @torch.inference_mode()
    @no_cudnn_sdpa()  # padded lengths change per batch: no per-shape cuDNN plans (~40 ms/call on H200)
    def _forward(self, batch: list[list[int]], storage: Optional[Storage] = None) -> "_Part":
        ids, att = self._pad(batch)  # [B, Lmax] right-padded; att None when nothing is padded
        picks = self._states(ids, att)  # 4 x [B, Lmax, H]
        B, Lmax = ids.shape
        lengths = [len(s) for s in batch]
        H = picks[0].shape[-1]
        T = sum(lengths)
        dev = picks[0].device
        pack = torch.empty((len(picks), T, H), dtype=torch.bfloat16, device=dev)  # [4, T, H]
        rows = None  # no padding: every row is real
        if T != B * Lmax:
            # Real (unpadded) rows of the flattened batch, sample by sample: built on the host, copied
            # from pinned memory without a sync (the forward just launched keeps running meanwhile).
            keep = (torch.arange(Lmax).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).reshape(
                -1
            )  # [B*Lmax]
            rows = keep.nonzero().squeeze(1)  # [T]
            if dev.type == "cuda":
                rows = rows.pin_memory().to(dev, non_blocking=True)
            else:
                rows = rows.to(dev)
        for k, p in enumerate(picks):
            flat = p.reshape(B * Lmax, H).to(device=dev, dtype=torch.bfloat16)  # cast on the device
            if rows is None:
                pack[k].copy_(flat)  # [T, H]
            else:
                torch.index_select(flat, 0, rows, out=pack[k])  # [T, H] real rows only
        # what goes to the host: bf16 states, or fp8 values + scales, + the finite flag
        dev_t = [pack]
        if storage is not None:
            # no sync: checked on the host later
            values, scales, finite = encode_batch(pack, storage)
            dev_t = [values] + ([scales] if scales is not None else []) + [finite.reshape(1)]
        if dev.type != "cuda":
            return _Part(lengths, None, *self._unpack(dev_t, storage))
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=dev)
        cs = self._copy_stream
        host_t = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in dev_t]
        cs.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(cs):
            for h, t in zip(host_t, dev_t):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(cs)
        for t in dev_t:
            t.record_stream(cs)  # keep the device buffers from reuse until the copy is done
        return _Part(lengths, event, *self._unpack(host_t, storage))

    @staticmethod
    def _unpack(ts: list[torch.Tensor], storage: Optional[Storage]):
        """``(host, scales, finite)`` of :class:`_Part` from the list :meth:`_forward` copies."""
        if storage is None:
            return ts[0], None, None
        return ts[0], (ts[1] if len(ts) == 3 else None), ts[-1]

    def last_hidden_state(self) -> LastHiddenState:
        """``"post_norm"`` if ``lm_head(hidden_states[-1])`` reproduces the logits, else ``"pre_norm"``,
        detected once with an 8-token probe.

        Raises:
            RuntimeError: the logits match neither, and a final norm module exists.
        """
        if self._last is None:
            self._last = self._detect_last_norm()
            # every torchrun rank probes its replica alike (02, online 04): said once
            if is_rank0():
                log.info("verifier hidden_states[-1] is %s", self._last)
        return self._last

    @torch.inference_mode()
    def _detect_last_norm(self) -> LastHiddenState:
        ids = torch.tensor([self._probe()], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **self._fwd_kw)
        check_probe_finite(out.hidden_states, out.logits, self.model)
        return last_hidden_state_kind(self.model, out.hidden_states[-1], out.logits)


def check_probe_finite(hidden_states: Sequence[torch.Tensor], logits: torch.Tensor, model) -> None:
    """Refuse a probe forward with NaN/Inf before the norm convention is concluded from it.

    Args:
        hidden_states: the probe's N+1 ``[B, n, H]``; logits: ``[B, n, V]``; model: the verifier.

    Raises:
        UserError: naming the first non-finite index (or the logits), the dtype and the fix.
    """
    bad = next((i for i, h in enumerate(hidden_states) if not bool(torch.isfinite(h).all())), None)
    if bad is None and bool(torch.isfinite(logits).all()):
        return
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    last = " (the last hidden state)" if bad == len(hidden_states) - 1 else ""
    where = "the logits" if bad is None else f"HF hidden_states[{bad}]{last}"
    raise UserError(
        f"verifier probe forward (8 tokens, before any sample): {where} has NaN/Inf with verifier.dtype "
        f"{dtype}; {NONFINITE_FIX}"
    )


@dataclass(slots=True)
class _Part:
    """One forward's states in host memory (or on their way): ``host`` ``[4, T, H]`` (bf16, or fp8
    values when ``scales`` ``[4, T, nb]`` float32 is set), samples back to back (``lengths``),
    ``finite`` a 1-element bool tensor (every state value finite; None when no storage was asked
    for), ``event`` = the CUDA event after the copies (None: already there)."""

    lengths: list[int]
    event: Optional[torch.cuda.Event]
    host: torch.Tensor
    scales: Optional[torch.Tensor] = None
    finite: Optional[torch.Tensor] = None


@dataclass
class PendingCapture:
    """The result of :meth:`HFCapture.capture_async`: per-sample states once the copies have landed
    (``_n`` samples; ``_parts``: per forward, the sample positions and their :class:`_Part`)."""

    _n: int
    _parts: list[tuple[list[int], _Part]]

    def ready(self) -> bool:
        """True when every device -> host copy has finished (never blocks)."""
        return all(p.event is None or p.event.query() for _, p in self._parts)

    def _wait(self) -> None:
        for _, part in self._parts:
            if part.event is not None:
                part.event.synchronize()

    def result(self, own_storage: bool = False) -> list[list[torch.Tensor]]:
        """Wait for the copies; per sample ``[aux1, aux2, aux3, last]`` bf16 CPU ``[L_i, H]``.

        Args:
            own_storage: clone each tensor (default: views into the batch's pinned buffer).

        Raises:
            RuntimeError: launched with fp8 storage (use :meth:`stored`).
        """
        self._wait()
        out: list = [None] * self._n
        for group, part in self._parts:
            if part.scales is not None:
                raise RuntimeError(
                    "PendingCapture.result: states were quantised to fp8 on the device; use stored()"
                )
            for i, views in zip(group, _split(part.host, part.lengths)):
                out[i] = [v.clone() for v in views] if own_storage else views
        return out

    def stored(self) -> list[StoredStates]:
        """Wait for the copies; per sample its :class:`eagle3.shards.write.StoredStates` (views into
        pinned buffers; bf16 ``source_finite`` is the whole batch's device NaN/Inf check).
        """
        self._wait()
        out: list = [None] * self._n
        for group, part in self._parts:
            if part.finite is None:
                raise RuntimeError(
                    "PendingCapture.stored: capture_async was called without a storage"
                )
            finite = bool(part.finite.item())
            scales = (
                _split(part.scales, part.lengths)
                if part.scales is not None
                else [None] * len(group)
            )
            for i, views, sc in zip(group, _split(part.host, part.lengths), scales):
                out[i] = StoredStates(views, sc, source_finite=finite and sc is None)
        return out


def _split(buf: torch.Tensor, lengths: list[int]) -> list[list[torch.Tensor]]:
    """Per sample, the views ``buf[k, off:off + L]`` for every k (``buf`` ``[n, T, C]``, samples back to back)."""
    out, off = [], 0
    for L in lengths:
        out.append([buf[k, off : off + L] for k in range(buf.shape[0])])  # n x [L, C]
        off += L
    return out
