"""One prompt through the batched decoders of :mod:`eagle3.decoding.decode` (a batch of one)."""

from __future__ import annotations

from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch


def greedy_generate(verifier, prompt, max_new_tokens, eos_ids=()):
    """``(tokens, seconds)`` of greedy decoding of ``prompt`` (ids)."""
    res = greedy_generate_batch(verifier, [prompt], max_new_tokens, eos_ids)
    return res.tokens[0], res.seconds


def speculative_generate(
    verifier, drafter, prompt, aux_layers, steps=3, max_new_tokens=256, eos_ids=()
):
    """The :class:`~eagle3.decoding.common.SpecResult` of ``prompt`` (ids)."""
    res = speculative_generate_batch(
        verifier, drafter, [prompt], aux_layers, steps, max_new_tokens, eos_ids
    )
    return res.rows[0]
