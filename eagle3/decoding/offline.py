"""Stage 05's offline benchmark: each batch decoded greedily (the baseline) and speculatively
with greedy's tokens as the reference, same run and cache machinery, every emitted token checked.

Prompts are sorted longest first and cut into batches (``batched`` decoder, or ``static`` at batch
1). A difference from greedy with a logit gap <= ``tie_tolerance`` is a near-tie, larger ones are
failures (:func:`eagle3.decoding.metrics.lossless_verdict`). At ``temperature`` > 0 the baseline is
plain sampling and no token-by-token verdict is made.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from tqdm import tqdm

from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch
from eagle3.decoding.metrics import acceptance_stats, first_mismatch
from eagle3.decoding.sampling import make_sampler
from eagle3.decoding.static_decode import StaticDecoder, capacity_for, resolve_decoder
from eagle3.errors import UserError


def bench_prompts(
    verifier,
    drafter,
    prompts_ids: Sequence[tuple[str, list[int]]],
    aux_layers: Sequence[int],
    steps: int,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    label: str = "prompts",
    batch_size: int = 32,
    tie_tolerance: float = 0.0,
    progress: bool = True,
    decoder: str = "auto",
    temperature: float = 0.0,
    top_p: float = 1.0,
    rejection_sample_method: str = "standard",
) -> dict:
    """Greedy vs speculative decoding of tokenised prompts, batch by batch (longest first).

    Args:
        verifier, drafter: see :func:`eagle3.decoding.decode.speculative_generate_batch`.
        prompts_ids: ``(id, prompt ids)`` pairs.
        aux_layers, steps, max_new_tokens, eos_ids: decoding settings.
        label, batch_size, tie_tolerance: the set's name; prompts a batch; the near-tie logit gap.
        decoder: ``batched`` | ``static`` | ``auto`` (:func:`resolve_decoder`).
        temperature, top_p: 0 = greedy; > 0 = sampling with a freshly seeded sampler.
        rejection_sample_method: ``standard`` | ``block`` at temperature > 0 (:mod:`eagle3.decoding.sampling`).

    Returns:
        the set's ``bench.json`` row plus ``decoder`` and ``warm_up_seconds``.

    Raises:
        UserError: ``static`` at temperature > 0 or at a batch size other than 1.
    """
    sampler = make_sampler(temperature, top_p, method=rejection_sample_method)
    device = next(verifier.parameters()).device
    mode = resolve_decoder(decoder, batch_size, device, getattr(sampler, "temperature", None))
    effective = effective_batch_size(batch_size, len(prompts_ids))
    settings = (aux_layers, steps, max_new_tokens, eos_ids)
    static, warm_s = None, 0.0
    if mode == "static":
        static, warm_s = _open_static(verifier, drafter, [p for _, p in prompts_ids], settings)
    t_wall = time.perf_counter()
    models = (verifier, drafter, sampler)
    with tqdm(total=len(prompts_ids), desc=f"bench {label} (batch {effective}, {mode})",
              unit="prompt", disable=not progress) as bar:  # fmt: skip
        try:
            tally = _decode_all(
                static, models, prompts_ids, settings, batch_size, tie_tolerance, bar
            )
        finally:
            if static is not None:
                static.close()
    row = tally.summary(label, effective, steps, time.perf_counter() - t_wall, tie_tolerance)
    row.update(decoder=mode, warm_up_seconds=warm_s, temperature=temperature, top_p=top_p)
    if temperature > 0:
        row["rejection_sample_method"] = rejection_sample_method
    if static is not None:
        row.update(cuda_graphs=static.use_graphs, graph_error=static.graph_error)
    return row


def _decode_all(static, models, prompts_ids, settings, batch_size, tie_tolerance, bar):
    """Every batch of ``prompts_ids`` (longest first) decoded greedily (plain sampling with a sampler), then
    speculatively with greedy's tokens as the reference: through ``static`` (a
    :class:`~eagle3.decoding.static_decode.StaticDecoder`, batch 1) when given, else the batched decoders.
    ``models`` = ``(verifier, drafter, sampler or None)``, ``settings`` = ``(aux_layers, steps, max_new_tokens,
    eos_ids)``; returns the :class:`_BenchTally`."""
    verifier, drafter, sampler = models
    order = sorted(range(len(prompts_ids)), key=lambda i: (-len(prompts_ids[i][1]), i))
    tally = _BenchTally(len(prompts_ids), sampled=sampler is not None)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        ids = [prompts_ids[i][1] for i in idx]
        if static is not None:
            g = static.greedy(ids[0])
            s = static.speculative(ids[0], reference=g.tokens[0])
        else:
            g = greedy_generate_batch(verifier, ids, *settings[2:], sampler=sampler)
            ref = g.tokens if sampler is None else None
            s = speculative_generate_batch(verifier, drafter, ids, *settings, ref, sampler=sampler)
        tally.add_batch(idx, prompts_ids, g, s, tie_tolerance)
        bar.update(len(idx))
    return tally


def effective_batch_size(batch_size: int, num_prompts: int) -> int:
    """The batch size a run of ``num_prompts`` prompts decodes at with ``benchmark.batch_size`` = ``batch_size``:
    ``min(batch_size, num_prompts)`` (1 prompt at batch 10 is decoded, and reported, as batch 1); at least 1."""
    return max(1, min(batch_size, num_prompts))


def _open_static(verifier, drafter, prompts: Sequence[list[int]], settings):
    """A :class:`~eagle3.decoding.static_decode.StaticDecoder` sized for ``prompts`` (``settings`` as in
    :func:`_decode_all`), its graphs captured by an untimed warm-up on the longest one: ``(decoder, warm-up
    seconds)``."""
    aux_layers, steps, max_new_tokens, eos_ids = settings
    t0 = time.perf_counter()
    capacity = capacity_for(prompts, max_new_tokens, steps)
    dec = StaticDecoder(verifier, capacity, max_new_tokens, eos_ids, drafter, aux_layers, steps)
    dec.warm_up(max(prompts, key=len))
    return dec, time.perf_counter() - t0


class _BenchTally:
    """Sums of :func:`bench_prompts` over its batches: tokens and seconds of both decoders, draft/verify time,
    rounds, accepted draft tokens (emitted ones), first mismatches and one row per prompt (input order)."""

    def __init__(self, n_prompts: int, sampled: bool = False):
        self.per_prompt: list[Optional[dict]] = [None] * n_prompts
        self.accepted: list[list[bool]] = []
        self.g_tok = self.g_sec = self.s_tok = self.s_sec = self.d_sec = self.v_sec = 0.0
        self.rounds = 0
        self.mismatches: list[dict] = []
        self.sampled = sampled  # temperature > 0: no token-by-token comparison

    def add_batch(self, idx: list[int], prompts_ids, g, s, tie_tolerance: float) -> None:
        """Fold one batch: ``g`` greedy and ``s`` speculative results (:mod:`eagle3.decoding.decode`) of prompts ``idx``."""
        self.g_sec += g.seconds
        self.s_sec += s.seconds
        self.d_sec += s.draft_seconds
        self.v_sec += s.verify_seconds
        self.rounds += s.rounds
        for i, g_tokens, res in zip(idx, g.tokens, s.rows):
            pid = prompts_ids[i][0]
            diff = None if self.sampled else first_mismatch(g_tokens, res.tokens)
            if diff is not None:
                gap = res.gap if res.mismatch == diff else None
                self.mismatches.append(
                    {
                        "id": pid,
                        "index": diff,
                        "gap": gap,
                        "near_tie": gap is not None and gap <= tie_tolerance,
                    }
                )
            self.accepted.extend(res.accepted)
            self.g_tok += len(g_tokens)
            self.s_tok += len(res.tokens)
            self.per_prompt[i] = {
                "id": pid,
                "prompt_tokens": len(prompts_ids[i][1]),
                "greedy_tokens": len(g_tokens),
                "spec_tokens": len(res.tokens),
                "accept_lengths": res.accept_lengths,
                "lossless": None if self.sampled else diff is None,
            }

    def summary(
        self, label: str, batch_size: int, steps: int, wall: float, tie_tolerance: float
    ) -> dict:
        """The result dict of :func:`bench_prompts`: ``dataset``, ``num_prompts``, ``batch_size``
        (effective), acceptance stats, greedy and speculative tokens / seconds / tokens per second,
        ``speedup``, ``draft_seconds``, ``verify_seconds``, ``drafter_share``, ``rounds``,
        ``wall_seconds``, ``tie_tolerance``, ``mismatches`` (``{id, index, gap, near_tie}``),
        ``near_ties``, ``failures``, ``per_prompt``.
        """
        g_tok, g_sec, s_tok, s_sec = self.g_tok, self.g_sec, self.s_tok, self.s_sec
        d_sec, v_sec = self.d_sec, self.v_sec
        stats = acceptance_stats(self.accepted, steps)
        g_tps = g_tok / g_sec if g_sec > 0 else float("nan")
        s_tps = s_tok / s_sec if s_sec > 0 else float("nan")
        near = sum(1 for m in self.mismatches if m["near_tie"])
        return {
            "dataset": label,
            "num_prompts": len(self.per_prompt),
            "batch_size": batch_size,
            **stats,
            "greedy_tokens": int(g_tok),
            "greedy_seconds": g_sec,
            "greedy_tokens_per_s": g_tps,
            "spec_tokens": int(s_tok),
            "spec_seconds": s_sec,
            "spec_tokens_per_s": s_tps,
            "speedup": s_tps / g_tps if g_sec > 0 and s_sec > 0 else float("nan"),
            "draft_seconds": d_sec,
            "verify_seconds": v_sec,
            "drafter_share": d_sec / (d_sec + v_sec) if d_sec + v_sec > 0 else float("nan"),
            "rounds": self.rounds,
            "wall_seconds": wall,
            "tie_tolerance": tie_tolerance,
            "mismatches": self.mismatches,
            "near_ties": near,
            "failures": len(self.mismatches) - near,
            "per_prompt": self.per_prompt,
        }


def warm_up(
    verifier,
    drafter,
    prompt: list[int],
    aux_layers: Sequence[int],
    steps: int,
    eos: Sequence[int],
    batch_size: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    rejection_sample_method: str = "standard",
) -> None:
    """Untimed runs of both decoders at ``batch_size`` (allocator, kernels and their heuristics), sampling at
    ``temperature`` > 0 as the timed runs will."""
    batch = [list(prompt)] * batch_size
    sampler = make_sampler(temperature, top_p, method=rejection_sample_method)
    greedy_generate_batch(verifier, batch, 8, eos, sampler=sampler)
    speculative_generate_batch(verifier, drafter, batch, aux_layers, steps, 8, eos, sampler=sampler)


def check_context(
    sets: Sequence[tuple[str, list[tuple[str, list[int]]]]],
    max_new_tokens: int,
    steps: int,
    verifier_config,
) -> None:
    """Refuse a prompt whose tokens + ``max_new_tokens`` + ``steps`` exceed the verifier's
    ``max_position_embeddings``. ``sets``: ``[(label, [(id, ids), ...]), ...]``.

    Raises:
        UserError: the first such prompt (set, id, tokens, limit, what to change).
    """
    limit = getattr(verifier_config, "max_position_embeddings", None)
    if not limit:
        return
    for label, ids in sets:
        for pid, toks in ids:
            if len(toks) + max_new_tokens + steps > limit:
                fix = (
                    "leave the prompt out"
                    if len(toks) + 1 + steps > limit
                    else "lower --max-new-tokens (benchmark.max_new_tokens) or leave the prompt out"
                )
                raise UserError(
                    f"dataset {label}, prompt {pid}: {len(toks)} prompt tokens + {max_new_tokens} new tokens + {steps} "
                    f"drafts exceed the verifier's context of {limit} positions (max_position_embeddings); {fix}"
                )
