"""The continuous-batching engines of a regeneration by name (``prompts.regen_engine``): :func:`make_engine` builds
:class:`eagle3.regen.slots.SlotEngine` (``slots``) or :class:`eagle3.regen.hf_engine.HFContinuousEngine`
(``hf_continuous``); :func:`engine_options` maps the ``prompts:`` section to their keyword arguments."""

from __future__ import annotations

from typing import Optional

from eagle3.regen.hf_engine import HFContinuousEngine
from eagle3.regen.slots import SlotEngine
from eagle3.verifier.load import stop_token_ids

ENGINES = ("slots", "hf_continuous", "static")


def make_engine(
    name: str,
    model,
    tokenizer,
    max_new_tokens: int,
    batch_size: int,
    max_context: Optional[int],
    options: Optional[dict] = None,
    planned_answers: Optional[int] = None,
):
    """A continuous-batching engine by name (``slots`` | ``hf_continuous``) with ``options`` (its
    keyword arguments); the cache holds prompts under ``max_context`` (None: the model's
    ``max_position_embeddings`` less ``max_new_tokens``) plus the answer; ``planned_answers`` sizes
    ``compile_step="auto"``.
    """
    stop_ids = stop_token_ids(tokenizer)
    cfg = model.config.get_text_config()
    max_len = (
        (max_context + max_new_tokens) if max_context is not None else cfg.max_position_embeddings
    )
    if name == "slots":
        return SlotEngine(
            model,
            batch_size,
            max_len,
            max_new_tokens,
            stop_ids,
            **{"planned_answers": planned_answers, **(options or {})},
        )
    if name == "hf_continuous":
        return HFContinuousEngine(
            model, batch_size, max_new_tokens, stop_ids, max_len=max_len, **(options or {})
        )
    raise ValueError(f"regen engine: one of {ENGINES}, not {name!r}")


def engine_options(pc) -> Optional[dict]:
    """The continuous engine's keyword arguments from the ``prompts`` config's ``regen_*`` keys."""
    if pc.regen_engine == "slots":
        return {
            "check_every": pc.regen_check_every,
            "prefill_tokens": pc.regen_prefill_tokens,
            "cuda_graphs": pc.regen_cuda_graphs,
            "attention": pc.regen_attention,
            "compile_step": pc.regen_compile,
            "prefix_reuse": pc.regen_prefix_reuse,
            "refill_free": pc.regen_refill_free,
            "prefill_graphs": pc.regen_prefill_graphs,
            "prefill_pack": pc.regen_prefill_pack,
        }
    if pc.regen_engine == "hf_continuous":
        return {"use_cuda_graph": pc.regen_cuda_graphs}
    return None
