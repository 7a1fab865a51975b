"""transformers' continuous batching (``prompts.regen_engine: hf_continuous``) behind the :class:`Engine`
contract: the library baseline that ``bench/regen_speed.py`` measures beside the slot engine."""

from __future__ import annotations

import logging
from typing import Iterator, Optional, Sequence

from transformers import ContinuousBatchingConfig, GenerationConfig

from eagle3.regen.slots import Engine

log = logging.getLogger(__name__)


class HFContinuousEngine(Engine):
    """transformers' continuous batching (``model.init_continuous_batching``) behind :class:`Engine`
    (FIFO: priorities only as submission order; the stop token is cut off).

    Args:
        model: HF causal LM (attention switched to ``paged|<impl>`` until :meth:`close`).
        slots: ``max_requests_per_batch``. max_new_tokens, stop_ids: answer budget and stop set.
        max_len: longest prompt + answer, sizing the paged cache in transformers' default 256-token
            blocks as the slot engine's (None: transformers' sizing).
        use_cuda_graph: transformers' switch (None: its choice).
    """

    def __init__(
        self,
        model,
        slots: int,
        max_new_tokens: int,
        stop_ids: set[int],
        max_len: Optional[int] = None,
        use_cuda_graph: Optional[bool] = None,
    ):
        self.stop_ids, self.max_new = set(stop_ids), max_new_tokens
        pad = model.config.get_text_config().pad_token_id
        gcfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=sorted(stop_ids),
            pad_token_id=pad if pad is not None else sorted(stop_ids)[0],
        )
        cb = ContinuousBatchingConfig(
            max_requests_per_batch=slots,
            use_cuda_graph=use_cuda_graph,
            num_blocks=-(-slots * max_len // 256) if max_len else None,
        )
        self.mgr = model.init_continuous_batching(
            generation_config=gcfg, continuous_batching_config=cb
        )
        self.mgr.start()
        self.keys: dict[str, object] = {}
        self._n = 0
        self.stats = {"decode_steps": 0, "prefill_calls": 0}

    def submit(
        self, key, ids: Sequence[int], priority: tuple = (), parent=None, retain: bool = False
    ) -> None:
        """Queue ``ids`` under ``key``; ``priority``, ``parent`` and ``retain`` are ignored (transformers' manager is
        FIFO and prefills every request in full: no cross-turn prefix reuse here)."""
        rid = f"r{self._n}"
        self._n += 1
        self.keys[rid] = key
        self.mgr.add_request(
            list(ids),
            request_id=rid,
            max_new_tokens=self.max_new,
            eos_token_id=sorted(self.stop_ids),
        )

    def results(self) -> Iterator[tuple[object, list[int], Optional[int]]]:
        while self.keys:
            r = self.mgr.get_result(timeout=1.0)
            if r is None:
                if not self.mgr.is_running():
                    raise RuntimeError(
                        "transformers' continuous batching manager stopped with requests in flight"
                    )
                continue
            if not r.is_finished() or r.request_id not in self.keys:
                continue
            key = self.keys.pop(r.request_id)
            toks = list(r.generated_tokens)
            stopped = bool(toks) and toks[-1] in self.stop_ids
            yield key, toks[:-1] if stopped else toks, (toks[-1] if stopped else None)
        self.stats["decode_steps"] = int(getattr(self.mgr, "current_batch", 0))

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.stop(block=True)
            self.mgr = None
