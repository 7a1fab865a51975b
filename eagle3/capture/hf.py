"""HF transformers capture backend: batched prefill with ``output_hidden_states=True``.

Implements the contract of ``eagle3.capture.base`` on any transformers causal LM, including
DeepseekV3 (MLA + MoE; Kimi-K2's text model) and multimodal wrappers whose language model
settings live in ``config.text_config`` (Kimi-K2.5, Llava-style).

Batching: samples are RIGHT-padded (pad id arbitrary, masked by ``attention_mask``), so real
tokens keep positions ``0..L-1`` and, under causal attention, never see the padding; padding
rows are sliced off before returning. :func:`plan_batches` groups samples by length so the
padded token count of a batch stays under ``batch_tokens``.

Last hidden state: HF returns ``hidden_states[-1]`` post-norm for Llama/DeepseekV3 (the final
norm is applied before it is appended); other code may not. On the first use the backend runs a
short probe forward and compares ``lm_head(hidden_states[-1])`` with the logits; a match means
``"post_norm"``, else it checks ``lm_head(norm(hidden_states[-1]))`` (``"pre_norm"``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Sequence

import torch

from eagle3.capture.base import BackendInfo, LastHiddenState
from eagle3.verifier import text_config

log = logging.getLogger(__name__)


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group sample positions into prefill batches of at most ``batch_tokens`` padded tokens.

    Samples are sorted by length, longest first (ties: lower position first), and packed greedily;
    a batch costs ``len(batch) * max_len`` padded tokens. A sample longer than ``batch_tokens``
    forms a batch on its own. The plan depends only on ``lengths`` and ``batch_tokens``, so a
    resumed run reproduces exactly the batches (hence bit-identical tensors) of the first run.

    Args:
        lengths: token count of each sample (>= 1).
        batch_tokens: padded-token budget per batch (>= 1).

    Returns:
        list of batches, each a list of positions into ``lengths``.
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


def _architecture(model) -> str:
    archs = getattr(model.config, "architectures", None)
    return archs[0] if archs else type(model).__name__


class HFCapture:
    """Capture backend over an in-process transformers model.

    Args:
        model: a causal LM (``...ForCausalLM`` or a multimodal ``...ForConditionalGeneration``)
            in eval mode, on any device; its ``forward`` must accept ``input_ids``,
            ``attention_mask``, ``output_hidden_states`` and return ``hidden_states`` with N+1
            entries (HF convention: index 0 = embeddings, i = input of decoder layer i).
        aux_layers: three HF ``hidden_states`` indices (validate with
            ``eagle3.layers.check_aux_layers`` first).
        batch_tokens: padded-token budget when :meth:`capture` gets more than fits in one forward.
        pad_id: id written into padded positions (never attended to, never returned).
    """

    def __init__(self, model, aux_layers: Sequence[int], batch_tokens: int = 16384, pad_id: int = 0):
        self.model = model
        self.aux_layers = [int(i) for i in aux_layers]
        self.batch_tokens = int(batch_tokens)
        self.pad_id = int(pad_id)
        tc = text_config(model.config)  # multimodal wrappers (Kimi-K2.5): the language model's config
        self.num_layers = int(tc.num_hidden_layers)
        self.hidden_size = int(tc.hidden_size)
        self.vocab_size = int(getattr(tc, "vocab_size", None) or model.config.vocab_size)
        params = inspect.signature(model.forward).parameters
        self._fwd_kw = {"output_hidden_states": True, "use_cache": False}
        # Only the hidden states are needed: keep 1 logit row instead of [B, L, V] (10 GB for Kimi).
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._last: LastHiddenState | None = None

    # ---- contract ------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        """Verifier dims and the last-hidden-state convention (runs the probe forward once)."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "architecture": _architecture(self.model),
            "last_hidden_state": self.last_hidden_state(),
        }

    def capture(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        """Prefill ``batch`` and return per sample ``[aux1, aux2, aux3, last]``, each bf16 CPU ``[L_i, H]``.

        Samples are split into forwards of at most ``batch_tokens`` padded tokens
        (:func:`plan_batches`); the output order matches the input order.

        Raises:
            ValueError: an empty sample.
            RuntimeError: the model returned a number of hidden states other than N+1.
        """
        if any(len(s) == 0 for s in batch):
            raise ValueError("HFCapture.capture: empty sample")
        out: list[list[torch.Tensor] | None] = [None] * len(batch)
        for group in plan_batches([len(s) for s in batch], self.batch_tokens):
            states = self._forward([batch[i] for i in group])
            for i, st in zip(group, states):
                out[i] = st
        return out  # type: ignore[return-value]

    # ---- internals -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the input embeddings (where input ids go; ``device_map`` models included)."""
        return self.model.get_input_embeddings().weight.device

    def _pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        B, Lmax = len(batch), max(len(s) for s in batch)
        ids = torch.full((B, Lmax), self.pad_id, dtype=torch.long)  # [B, Lmax]
        att = torch.zeros((B, Lmax), dtype=torch.long)  # [B, Lmax]
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            att[b, : len(s)] = 1
        return ids.to(self.device), att.to(self.device)

    @torch.inference_mode()
    def _forward(self, batch: list[list[int]]) -> list[list[torch.Tensor]]:
        ids, att = self._pad(batch)  # [B, Lmax] right-padded
        out = self.model(input_ids=ids, attention_mask=att, **self._fwd_kw, **self._keep_kw)
        hs = out.hidden_states  # (N+1) x [B, Lmax, H]
        if hs is None or len(hs) != self.num_layers + 1:
            n = None if hs is None else len(hs)
            raise RuntimeError(f"verifier returned {n} hidden states, expected num_hidden_layers + 1 = {self.num_layers + 1}")
        picks = [hs[i].to(torch.bfloat16) for i in self.aux_layers + [-1]]  # 4 x [B, Lmax, H], cast on device
        # One copy per sample and layer, straight from the device into an exact-size CPU tensor: padding
        # is never copied and no returned tensor keeps the padded batch's storage alive.
        return [[p[b, : len(s)].to("cpu", copy=True) for p in picks] for b, s in enumerate(batch)]  # B x 4 x [L_b, H]

    def last_hidden_state(self) -> LastHiddenState:
        """``"post_norm"`` if ``lm_head(hidden_states[-1])`` reproduces the logits, else ``"pre_norm"``.

        Detected once with an 8-token probe forward (full logits). When the logits match neither
        ``lm_head(h)`` nor ``lm_head(final_norm(h))`` (e.g. logit scaling or soft-capping) the
        result is ``"pre_norm"`` only if no final norm module was found, else RuntimeError.
        """
        if self._last is None:
            self._last = self._detect_last_norm()
            log.info("verifier hidden_states[-1] is %s", self._last)
        return self._last

    @torch.inference_mode()
    def _detect_last_norm(self) -> LastHiddenState:
        n = min(8, self.vocab_size)
        ids = (torch.arange(n, dtype=torch.long) * 7919 % self.vocab_size).unsqueeze(0).to(self.device)  # [1, n]
        out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **self._fwd_kw)
        last = out.hidden_states[-1]  # [1, n, H]
        logits = out.logits.float()  # [1, n, V]
        head = self.model.get_output_embeddings()

        def close(h: torch.Tensor) -> bool:
            pred = head(h).float()  # [1, n, V]
            if pred.shape != logits.shape:
                return False
            err = (pred - logits).abs().max().item()
            return err <= 1e-2 * logits.abs().max().item() + 1e-4

        if close(last):
            return "post_norm"
        norm = self._final_norm()
        if norm is None:
            log.warning("lm_head(hidden_states[-1]) != logits and no final norm found; recording pre_norm")
            return "pre_norm"
        if close(norm(last)):
            return "pre_norm"
        raise RuntimeError(
            "cannot tell whether the verifier's hidden_states[-1] is post- or pre-norm: lm_head(h) matches the "
            "logits neither with nor without the final norm (logit scaling/soft-capping are not supported)"
        )

    def _final_norm(self):
        decoder = None
        get_decoder = getattr(self.model, "get_decoder", None)
        if callable(get_decoder):
            try:
                decoder = get_decoder()
            except (AttributeError, NotImplementedError):
                decoder = None
        for cand in (decoder, getattr(self.model, "model", None)):
            norm = getattr(cand, "norm", None) if cand is not None else None
            if isinstance(norm, torch.nn.Module):
                return norm
        return None
