"""The benchmark's figures and verdicts: acceptance statistics (tau, per-position rates) from accepted-draft flags or
SGLang's histogram, the near-tie tolerance of the lossless check, its verdict, and the speedup-above-tau warning.

``tau`` (acceptance length) = tokens EMITTED by verify steps / verify steps: accepted drafts + 1 (the bonus), the last
step of each prompt counted only up to the cut at EOS / ``max_new_tokens`` (counting the verifier's whole decision
there gives 4.0 instead of 3.0 for a perfect drafter at 3 steps and 10 tokens). SGLang's ``spec_accept_length`` =
completion tokens / verify steps also counts the prefill token. ``conditional[k]`` = P(draft position k+1 accepted |
positions <= k accepted); ``unconditional[k]`` = P(positions 1..k+1 all accepted); tau = 1 + sum(unconditional).
Also: the expected tau of speculative sampling from the draft and target distributions (:func:`expected_tau`) and tau
per context-length bucket of the prompts (:func:`context_buckets`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


# ---------------------------------------------------------------------------------------------
# acceptance bookkeeping
# ---------------------------------------------------------------------------------------------
def rates_from_hist(hist: Sequence[int], steps: int) -> dict:
    """Per-position chain acceptance from a histogram of accepted drafts per verify step.

    Args:
        hist: ``hist[a]`` = verify steps that accepted exactly ``a`` drafts (SGLang's
            ``spec_correct_drafts_histogram``); may be shorter than ``steps + 1``.
        steps: drafted tokens per verify step (k).

    Returns:
        dict ``conditional`` (k floats, P(position k+1 accepted | positions <= k accepted), NaN when no
        step reached position k+1's turn) and ``unconditional`` (k floats, fraction of verify steps that
        accepted position k+1; tau = 1 + sum of these).
    """
    hist = list(hist) + [0] * max(0, steps + 1 - len(hist))
    n = sum(hist)
    reach = [sum(hist[k:]) for k in range(steps + 1)]  # reach[k] = steps with >= k accepted drafts
    nan = float("nan")
    return {
        "conditional": [reach[k + 1] / reach[k] if reach[k] else nan for k in range(steps)],
        "unconditional": [reach[k + 1] / n if n else nan for k in range(steps)],
    }


def acceptance_stats(accepted: Sequence[Sequence[bool]], steps: int) -> dict:
    """Acceptance statistics of chain drafting from per-verify-step flags.

    Args:
        accepted: one entry per verify step, ``steps`` booleans; flag k = draft position k+1 accepted
            (a prefix of True values, as :class:`eagle3.decoding.decode.SpecResult.accepted`).
        steps: drafted tokens per verify step (k).

    Returns:
        dict ``verify_steps`` (int), ``tau`` (float, mean accepted drafts + 1 per verify step; NaN when
        no step), ``accepted_hist`` (k+1 ints: steps with exactly a accepted drafts), and
        ``conditional`` / ``unconditional`` as in :func:`rates_from_hist`.

    Raises:
        ValueError: a flag list of the wrong length or not a prefix of True values (a caller bug).
    """
    hist = [0] * (steps + 1)
    for flags in accepted:
        if len(flags) != steps:
            raise ValueError(
                f"acceptance_stats: expected {steps} flags per verify step, got {len(flags)}"
            )
        a = 0
        while a < steps and flags[a]:
            a += 1
        if any(flags[a:]):
            raise ValueError(
                f"acceptance_stats: flags {list(flags)} are not a prefix of accepted positions"
            )
        hist[a] += 1
    n = len(accepted)
    return {
        "verify_steps": n,
        "tau": (sum(a * c for a, c in enumerate(hist)) / n + 1.0) if n else float("nan"),
        "accepted_hist": hist,
        **rates_from_hist(hist, steps),
    }


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token of two sequences (length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# one dataset
# ---------------------------------------------------------------------------------------------
def default_tie_tolerance(dtype: torch.dtype) -> float:
    """The near-tie tolerance (logit units) used when ``benchmark.tie_tolerance`` is unset: float32 1e-3 (fp32
    rounding is ~1e-5), else 0.25 (two bf16 steps at logit magnitude 16-32)."""
    return 1e-3 if dtype == torch.float32 else 0.25


#: relative slack of :func:`speedup_warning` (timing noise, the prefill, rows ending at different steps)
SPEEDUP_SLACK = 0.05


def speedup_warning(
    label: str, speedup: Optional[float], tau: Optional[float], baseline: str = "greedy decoding"
) -> Optional[str]:
    """One warning line when a measured speedup exceeds what the acceptance length allows (None otherwise): a verify
    step emits ``tau`` tokens for one verifier forward over ``k + 1`` tokens plus ``k`` drafts, so ``speedup <= tau``
    on the same hardware (Leviathan et al. 2023, arXiv 2211.17192, section 3); a ratio above ``tau x (1 +
    SPEEDUP_SLACK)`` means the baseline was slowed or, for two servers, ran on other hardware.

    Args:
        label: the set, named first in the line.
        speedup: tokens/s with the drafter / tokens/s of the baseline (NaN / None: nothing said).
        tau: the acceptance length measured in the same run (NaN / None / <= 0: nothing said).
        baseline: what the speedup is measured against, for the line.

    Returns:
        the line, or None when ``speedup <= tau * (1 + SPEEDUP_SLACK)`` or a value is missing.
    """
    if speedup is None or tau is None or not (math.isfinite(speedup) and math.isfinite(tau)):
        return None
    if tau <= 0 or speedup <= tau * (1 + SPEEDUP_SLACK):
        return None
    return (
        f"{label}: speedup {speedup:.2f}x is above tau {tau:.2f}, which chain speculative decoding cannot "
        f"exceed on the same hardware (each verify step emits tau tokens on average for one verifier forward over "
        f"k+1 tokens, no cheaper than {baseline}'s one-token forward, plus the drafts; Leviathan et al. 2023, "
        f"arXiv 2211.17192): the baseline was slowed (CPU contention, another process) or ran on other hardware, "
        f"so this speedup is not the drafter's; measure again on an otherwise idle machine"
    )


def speedup_warnings(datasets: Sequence[dict]) -> list[str]:
    """:func:`speedup_warning` of each offline ``bench.json`` dataset row (keys ``dataset``, ``speedup``, ``tau``)."""
    lines = (
        speedup_warning(str(d.get("dataset")), d.get("speedup"), d.get("tau")) for d in datasets
    )
    return [w for w in lines if w]


def lossless_verdict(report: dict, tie_tolerance: float, strict: bool) -> Optional[str]:
    """Add the lossless check's warnings to ``report["warnings"]``; return the failure line, None when every
    difference from greedy is a near-tie (logit gap <= ``tie_tolerance``) or there is none.

    The line names the count and the first failing prompt (dataset, id, token index, logit gap); without
    ``strict`` its warning adds the reduced-precision hint.
    """
    bad = [
        (d["dataset"], m) for d in report["datasets"] for m in d["mismatches"] if not m["near_tie"]
    ]
    near = sum(d["near_ties"] for d in report["datasets"])
    if near:
        report["warnings"].append(
            f"{near} prompts differ from greedy at a near-tie (logit gap <= {tie_tolerance}); "
            "listed in mismatches"
        )
    if not bad:
        return None
    gap = bad[0][1]["gap"]
    msg = (
        f"speculative output differs from greedy beyond the tie tolerance {tie_tolerance} on {len(bad)} prompts "
        f"(first: dataset {bad[0][0]}, prompt {bad[0][1]['id']}, token {bad[0][1]['index']}, logit gap "
        f"{'unknown' if gap is None else f'{gap:.4g}'})"
    )
    hint = "; reduced precision: raise benchmark.tie_tolerance only if the gaps are rounding-sized"
    report["warnings"].append(msg if strict else msg + hint)
    return msg


def check_measurement(report: dict, tie_tolerance: float, strict: bool) -> Optional[str]:
    """The checks of a measured ``bench.json`` report, in ``report["warnings"]``: a speedup above tau
    (:func:`speedup_warnings`: the baseline was slowed), then losslessness (:func:`lossless_verdict`, whose failure
    line is returned; None when every token matched greedy or only near-ties differ)."""
    report["warnings"] += speedup_warnings(report["datasets"])
    return lossless_verdict(report, tie_tolerance, strict)


# ---------------------------------------------------------------------------------------------
# simulated acceptance at temperature > 0
# ---------------------------------------------------------------------------------------------
def acceptance_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-position acceptance probability of speculative rejection sampling: ``alpha = sum_x min(p(x), q(x))``.

    Args:
        p: ``[..., V]`` the verifier's processed distribution (temperature / top-p applied).
        q: ``[..., V]`` the drafter's, over the same (verifier) vocabulary: 0 outside the draft vocab.

    Returns:
        float32 ``[...]``, each in [0, 1] (1 - the total-variation distance of ``p`` and ``q``).
    """
    return torch.minimum(p.float(), q.float()).sum(-1)


def expected_tau(p: torch.Tensor, q: torch.Tensor) -> float:
    """Expected tau (tokens emitted per verify step) of chain speculative sampling from the draft and target
    distributions at each draft position: ``1 + sum_k prod_{i<=k} alpha_i`` (:func:`acceptance_probs`), averaged
    over the leading dimensions; at temperature 0 (one-hot ``p`` and ``q``) greedy's simulated tau.

    Args:
        p, q: ``[..., k, V]`` probabilities for draft positions ``1..k`` (same shape).

    Returns:
        a float in ``[1, k + 1]``.

    Raises:
        ValueError: shapes differ or fewer than 2 dimensions (a caller bug).
    """
    if p.shape != q.shape or p.dim() < 2:
        raise ValueError(
            f"expected_tau: p and q must share a [..., k, V] shape, got {p.shape}, {q.shape}"
        )
    alpha = acceptance_probs(p, q)  # [..., k]
    return float((1.0 + alpha.cumprod(-1).sum(-1)).mean())


# ---------------------------------------------------------------------------------------------
# acceptance against context length
# ---------------------------------------------------------------------------------------------
def bucket_index(tokens: int, edges: Sequence[int]) -> int:
    """The context-length bucket of a prompt of ``tokens`` tokens: ``j`` with ``edges[j-1] < tokens <= edges[j]``
    (``edges`` ascending; bucket 0 from 1 token), ``len(edges)`` past the last edge."""
    return next((j for j, e in enumerate(edges) if tokens <= e), len(edges))


def bucket_label(j: int, edges: Sequence[int]) -> str:
    """``<=1024``, ``1025-2048``, ... ``>8192``: the prompt tokens bucket ``j`` of ``edges`` holds."""
    if j == 0:
        return f"<={edges[0]}"
    return f">{edges[-1]}" if j == len(edges) else f"{edges[j - 1] + 1}-{edges[j]}"


def context_buckets(per_prompt: Sequence[dict], edges: Sequence[int]) -> list[dict]:
    """tau per context-length bucket of one set's ``per_prompt`` rows (``prompt_tokens``, ``accept_lengths``).

    Returns:
        one row per bucket, the one past the last edge only when a prompt is there: ``bucket`` (label),
        ``max_tokens`` (its edge; None past the last), ``prompts``, ``verify_steps``, ``tau`` (emitted tokens per
        verify step over the bucket's prompts, as the set's tau; NaN without a verify step).
    """
    n = len(edges) + 1
    prompts, steps, emitted = [0] * n, [0] * n, [0] * n
    for p in per_prompt:
        j = bucket_index(int(p["prompt_tokens"]), edges)
        prompts[j] += 1
        steps[j] += len(p["accept_lengths"])
        emitted[j] += sum(p["accept_lengths"])
    return [
        {
            "bucket": bucket_label(j, edges),
            "max_tokens": edges[j] if j < len(edges) else None,
            "prompts": prompts[j],
            "verify_steps": steps[j],
            "tau": emitted[j] / steps[j] if steps[j] else float("nan"),
        }
        for j in range(n)
        if j < len(edges) or prompts[j]
    ]


def add_context_buckets(report: dict, edges: Sequence[int]) -> None:
    """With ``edges`` (``benchmark.context_lengths`` as capped): ``report["context_edges"]`` and each dataset row's
    ``context_buckets`` (:func:`context_buckets`); nothing without edges."""
    if not edges:
        return
    report["context_edges"] = list(edges)
    for d in report["datasets"]:
        d["context_buckets"] = context_buckets(d["per_prompt"], edges)
