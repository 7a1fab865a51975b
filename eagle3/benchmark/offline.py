"""Stage 05: offline benchmark of an exported EAGLE-3 drafter against its verifier (transformers).

For each dataset, every prompt is decoded twice in the same run, greedy (baseline) and with chain
speculative decoding (:mod:`eagle3.benchmark.decode`), and the outputs must agree token for token.

Metrics (names as in SGLang/SpecForge reports):

- ``tau`` (acceptance length): tokens EMITTED by verify steps / verify steps, i.e. mean of
  accepted draft tokens + 1 (the bonus) where the last step of each prompt counts only the tokens
  before the cut at EOS / max_new_tokens (issue 11 item 2: counting the verifier's whole decision
  there inflates tau, e.g. 4.0 instead of 3.0 for a perfect drafter at 3 steps and 10 tokens).
  SGLang's ``spec_accept_length`` = completion tokens / verify steps also counts the prefill token.
- ``conditional[k]`` = P(draft position k+1 accepted | positions <= k accepted), the chain
  acceptance rate of each position; ``unconditional[k]`` = P(positions 1..k+1 all accepted).
  tau = 1 + sum(unconditional).
- tokens/s with and without the drafter (generated tokens / wall seconds incl. prefill) and
  ``speedup`` = their ratio.

Batching (``benchmark.batch_size``): prompts are decoded in batches, greedy and speculative alike
with the same KV-cache machinery (:mod:`eagle3.benchmark.decode`), so the speedup is batched EAGLE-3 against
batched greedy at the same batch size, measured in the same run. ``drafter_share`` = drafter time /
(drafter + verify time) of the speculative steps: where it is large, the drafter does not pay.

Losslessness: every emitted token is compared with greedy's. A difference comes with its logit
gap (verify logits: top-1 minus the logit of greedy's token at the first differing index). A gap
<= ``benchmark.tie_tolerance`` (default :func:`default_tie_tolerance`: 1e-3 in float32, 0.25 in
bf16/fp16) is a near-tie: rounding of the ``k+1``-token verify vs the one-token greedy forward, counted
as ``near_ties``. Larger gaps are ``failures``: in float32 (CPU default) they fail the run
(``UserError`` after the reports are written); in bf16/fp16 they are listed and warned about.

Outputs in ``cfg.bench_dir``: ``bench.json``, ``bench.md`` and ``acceptance.png`` (atomic).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm import tqdm

from eagle3.benchmark.eval_prompts import (
    EvalPrompt,
    check_dataset_names,
    dataset_labels,
    load_eval_subset,
)
from eagle3.config import RunConfig
from eagle3.errors import UserError
from eagle3.io import atomic_write_files, probe_dirs, read_json
from eagle3.io.read import relative_hint
from eagle3.shards.format import check_extract_settings
from eagle3.train.draft_config import EXPORT_META_FILE, untrained_positions

log = logging.getLogger(__name__)

TRAIN_META = EXPORT_META_FILE
DATA_CONFIG = "data_config.json"


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
            (a prefix of True values, as :class:`eagle3.benchmark.decode.SpecResult.accepted`).
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
    """The near-tie tolerance (logit units) used when ``benchmark.tie_tolerance`` is unset.

    float32: 1e-3 (shape-dependent rounding of a 30-layer fp32 forward is ~1e-5; a larger gap is a
    bug). bfloat16/float16: 0.25, two bf16 steps at logit magnitude 16-32 (8 significant bits), the
    size of the rounding differences between a ``k+1``-token verify and a one-token greedy forward.
    """
    return 1e-3 if dtype == torch.float32 else 0.25


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
) -> dict:
    """Batched greedy vs batched speculative decoding of tokenised prompts; lossless check per prompt.

    Prompts are sorted by length (longest first, least padding) and cut into batches of
    ``batch_size``; each batch is decoded greedily (timed), then speculatively (timed) with greedy's
    tokens as the reference, so every emitted token is checked and each prompt's first difference
    comes with its logit gap (:func:`eagle3.benchmark.decode.speculative_generate_batch`).

    Args:
        verifier, drafter: see :func:`eagle3.benchmark.decode.speculative_generate_batch`.
        prompts_ids: ``(id, chat-rendered prompt ids)`` pairs.
        aux_layers: HF ``hidden_states`` indices of the drafter's aux features.
        steps, max_new_tokens, eos_ids: decoding settings (temperature 0).
        label: dataset label (tqdm and report).
        batch_size: prompts decoded together (>= 1).
        tie_tolerance: a difference whose logit gap is <= this is a near-tie (counted, not a failure).
        decoder: ``benchmark.decoder`` (:func:`eagle3.benchmark.static_decode.resolve_decoder`): ``batched``
            (:mod:`eagle3.benchmark.decode`), ``static`` (batch 1: :class:`~eagle3.benchmark.static_decode.StaticDecoder`,
            static caches and CUDA graphs for the greedy baseline and EAGLE-3 alike; its graphs are captured on the
            longest prompt before the timed set, ``warm_up_seconds``) or ``auto`` (static at batch 1 on CUDA).

    Returns:
        dict: ``dataset``, ``num_prompts``, ``batch_size`` (the effective one: ``min(batch_size, num_prompts)``,
        what the largest batch held), acceptance stats (:func:`acceptance_stats`,
        emitted tokens only), ``greedy_tokens``, ``greedy_seconds``, ``greedy_tokens_per_s``,
        ``spec_tokens``, ``spec_seconds``, ``spec_tokens_per_s``, ``speedup``, ``draft_seconds``,
        ``verify_seconds``, ``drafter_share`` (draft / (draft + verify) of the speculative step time),
        ``rounds``, ``wall_seconds`` (the whole set, both decoders and the checks), ``tie_tolerance``,
        ``mismatches`` (list of ``{id, index, gap, near_tie}``: first differing output token, gap =
        verify top-1 logit minus the logit of greedy's token, None if unknown), ``near_ties`` and
        ``failures`` (counts of mismatches within / beyond ``tie_tolerance``), ``per_prompt``, ``decoder`` (the one
        that ran) and ``warm_up_seconds`` (static: graph capture, untimed otherwise; 0 for batched).

    Raises:
        UserError: ``batch_size < 1``, a bad ``decoder`` (:func:`~eagle3.benchmark.static_decode.resolve_decoder`).
    """
    from eagle3.benchmark.static_decode import resolve_decoder

    if batch_size < 1:
        raise UserError(f"benchmark.batch_size: must be >= 1, got {batch_size}")
    mode = resolve_decoder(decoder, batch_size, next(verifier.parameters()).device)
    effective = effective_batch_size(batch_size, len(prompts_ids))
    order = sorted(range(len(prompts_ids)), key=lambda i: (-len(prompts_ids[i][1]), i))
    tally = _BenchTally(len(prompts_ids))
    static, warm_s = None, 0.0
    if mode == "static":
        static, warm_s = _open_static(
            verifier,
            drafter,
            [p for _, p in prompts_ids],
            aux_layers,
            steps,
            max_new_tokens,
            eos_ids,
        )
    t_wall = time.perf_counter()
    bar = tqdm(
        total=len(prompts_ids),
        desc=f"bench {label} (batch {effective}, {mode})",
        unit="prompt",
        disable=not progress,
    )
    try:
        for b0 in range(0, len(order), batch_size):
            idx = order[b0 : b0 + batch_size]
            ids = [prompts_ids[i][1] for i in idx]
            g, s = _decode_batch(
                static, verifier, drafter, ids, aux_layers, steps, max_new_tokens, eos_ids
            )
            tally.add_batch(idx, prompts_ids, g, s, tie_tolerance)
            bar.update(len(idx))
    finally:
        if static is not None:
            static.close()
    bar.close()
    wall = time.perf_counter() - t_wall
    extra = {"decoder": mode, "warm_up_seconds": warm_s}
    if static is not None:
        extra["cuda_graphs"] = static.use_graphs
        extra["graph_error"] = static.graph_error
    return {**tally.summary(label, effective, steps, wall, tie_tolerance), **extra}


def effective_batch_size(batch_size: int, num_prompts: int) -> int:
    """The batch size a run of ``num_prompts`` prompts decodes at with ``benchmark.batch_size`` = ``batch_size``:
    ``min(batch_size, num_prompts)`` (1 prompt at batch 10 is decoded, and reported, as batch 1); at least 1."""
    return max(1, min(batch_size, num_prompts))


def _decode_batch(
    static,
    verifier,
    drafter,
    ids: list[list[int]],
    aux_layers,
    steps: int,
    max_new_tokens: int,
    eos_ids,
):
    """Greedy then speculative decoding of one batch (greedy's tokens as the reference): through ``static`` (a
    :class:`~eagle3.benchmark.static_decode.StaticDecoder`, batch 1) when given, else the batched decoders."""
    from eagle3.benchmark.decode import greedy_generate_batch, speculative_generate_batch

    if static is not None:
        g = static.greedy(ids[0])
        return g, static.speculative(ids[0], reference=g.tokens[0])
    g = greedy_generate_batch(verifier, ids, max_new_tokens, eos_ids)
    return g, speculative_generate_batch(
        verifier, drafter, ids, aux_layers, steps, max_new_tokens, eos_ids, reference=g.tokens
    )


def _open_static(
    verifier,
    drafter,
    prompts: Sequence[list[int]],
    aux_layers,
    steps: int,
    max_new_tokens: int,
    eos_ids,
):
    """A :class:`~eagle3.benchmark.static_decode.StaticDecoder` sized for ``prompts``, its graphs captured by an untimed
    warm-up on the longest one: ``(decoder, warm-up seconds)``."""
    from eagle3.benchmark.static_decode import StaticDecoder, capacity_for

    t0 = time.perf_counter()
    dec = StaticDecoder(
        verifier,
        capacity_for(prompts, max_new_tokens, steps),
        max_new_tokens,
        eos_ids,
        drafter=drafter,
        aux_layers=aux_layers,
        steps=steps,
    )
    dec.warm_up(max(prompts, key=len))
    return dec, time.perf_counter() - t0


class _BenchTally:
    """Sums of :func:`bench_prompts` over its batches: tokens and seconds of both decoders, draft/verify time,
    rounds, accepted draft tokens (emitted ones), first mismatches and one row per prompt (input order)."""

    def __init__(self, n_prompts: int):
        self.per_prompt: list[Optional[dict]] = [None] * n_prompts
        self.accepted: list[list[bool]] = []
        self.g_tok = self.g_sec = self.s_tok = self.s_sec = self.d_sec = self.v_sec = 0.0
        self.rounds = 0
        self.mismatches: list[dict] = []

    def add_batch(self, idx: list[int], prompts_ids, g, s, tie_tolerance: float) -> None:
        """Fold one batch: ``g`` greedy and ``s`` speculative results (:mod:`eagle3.benchmark.decode`) of prompts ``idx``."""
        self.g_sec += g.seconds
        self.s_sec += s.seconds
        self.d_sec += s.draft_seconds
        self.v_sec += s.verify_seconds
        self.rounds += s.rounds
        for i, g_tokens, res in zip(idx, g.tokens, s.rows):
            pid = prompts_ids[i][0]
            diff = first_mismatch(g_tokens, res.tokens)
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
                "lossless": diff is None,
            }

    def summary(
        self, label: str, batch_size: int, steps: int, wall: float, tie_tolerance: float
    ) -> dict:
        """The result dict of :func:`bench_prompts` (see there)."""
        g_tok, g_sec, s_tok, s_sec, d_sec, v_sec = (
            self.g_tok,
            self.g_sec,
            self.s_tok,
            self.s_sec,
            self.d_sec,
            self.v_sec,
        )
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


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------
def _f(x: Optional[float], nd: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def json_safe(obj):
    """``obj`` with NaN/inf floats replaced by None (strict JSON; NaN marks an undefined rate)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def md_cell(value) -> str:
    """``value`` as one Markdown table cell: ``|`` escaped and line breaks made spaces (a prompt file named ``my|set``
    or a prompt id with a ``|`` split its row into extra columns; trial 2026-12-05g)."""
    return " ".join(str(value).splitlines()).replace("|", "\\|")


def render_markdown(report: dict) -> str:
    """The Markdown tables of ``bench.md`` from a ``bench.json`` report dict."""
    steps = report["steps"]
    lines = [
        f"# EAGLE-3 offline benchmark: {report['verifier']}",
        "",
        f"drafter `{report['drafter']}`, chain of {steps} draft tokens, temperature 0, "
        f"max_new_tokens {report['max_new_tokens']}, {report['device']} {report['dtype']}, "
        f"aux layers (HF hidden_states indices) {report['aux_layers']}",
        "",
        *(
            [
                f"prompts picked: {report['prompt_pick']} (benchmark.prompt_pick; ids per set in bench.json, "
                f"datasets[].prompt_ids)",
                "",
            ]
            if report.get("prompt_pick")
            else []
        ),
        "| dataset | prompts | batch | tau | greedy tok/s | EAGLE-3 tok/s | speedup | drafter share | wall s | lossless |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in report["datasets"]:
        lines.append(
            f"| {md_cell(d['dataset'])} | {d['num_prompts']} | {d.get('batch_size', 1)} | {_f(d['tau'])} | "
            f"{_f(d['greedy_tokens_per_s'], 1)} | {_f(d['spec_tokens_per_s'], 1)} | {_f(d['speedup'])}x | "
            f"{_f(d.get('drafter_share'))} | {_f(d.get('wall_seconds'), 1)} | {_lossless_cell(d)} |"
        )
    head = " | ".join(f"pos {k + 1}" for k in range(steps))
    lines += [
        "",
        "Per-position acceptance: conditional P(k accepted | 1..k-1 accepted) / unconditional P(1..k accepted)",
        "",
        f"| dataset | verify steps | {head} |",
        "|---|---:|" + "---:|" * steps,
    ]
    for d in report["datasets"]:
        cells = " | ".join(
            f"{_f(c)} / {_f(u)}" for c, u in zip(d["conditional"], d["unconditional"])
        )
        lines.append(f"| {md_cell(d['dataset'])} | {d['verify_steps']} | {cells} |")
    mism = [(d["dataset"], m) for d in report["datasets"] for m in d["mismatches"]]
    if mism:
        lines += [
            "",
            f"Differences from greedy (first differing token per prompt; gap = verify top-1 logit minus "
            f"the logit of greedy's token; near-tie tolerance {report['datasets'][0].get('tie_tolerance')}):",
            "",
            "| dataset | prompt | token index | logit gap | near-tie |",
            "|---|---|---:|---:|---|",
        ]
        for name, m in mism:
            lines.append(
                f"| {md_cell(name)} | {md_cell(m['id'])} | {m['index']} | {_f(m.get('gap'), 4)} | {'yes' if m.get('near_tie') else 'no'} |"
            )
    for w in report.get("warnings", []):
        lines += ["", f"**warning**: {w}"]
    return "\n".join(lines) + "\n"


def headline(report: dict, out_dir: str | Path) -> str:
    """The lines stage 05 prints at its end: per dataset tau, tokens/s greedy vs with the drafter (both
    measured in this run), the speedup and the lossless verdict (as in ``bench.md``), then the report path."""
    lines = []
    for d in report["datasets"]:
        lines.append(
            f"{d['dataset']}: tau {_f(d['tau'])}, greedy {_f(d['greedy_tokens_per_s'], 1)} tok/s vs "
            f"EAGLE-3 {_f(d['spec_tokens_per_s'], 1)} tok/s = {_f(d['speedup'])}x, "
            f"lossless {_lossless_cell(d)} ({d['num_prompts']} prompt{'s' if d['num_prompts'] != 1 else ''}, "
            f"{report['device']} {report['dtype']})"
        )
    lines.append(f"report: {Path(out_dir) / 'bench.md'}")
    return "\n".join(lines)


#: relative slack of :func:`speedup_warning`: the bound speedup <= tau holds per verify step; timing noise, the
#: prefill (in both tokens/s, outside tau) and batched rows ending at different steps move a measured ratio a few
#: percent around it
SPEEDUP_SLACK = 0.05


def speedup_warning(
    label: str,
    speedup: Optional[float],
    tau: Optional[float],
    baseline: str = "greedy decoding",
    slack: float = SPEEDUP_SLACK,
) -> Optional[str]:
    """One warning line when a measured speedup exceeds what the acceptance length allows (None otherwise).

    Chain speculative decoding emits ``tau`` tokens per verify step on average, and a verify step costs one verifier
    forward over ``k + 1`` tokens (never cheaper than greedy's one-token forward on the same hardware) plus ``k``
    drafter forwards; greedy spends one forward per token. So ``speedup = t_greedy / t_spec <= tau * c(1) / (c(k+1)
    + k c_draft) <= tau``: the walltime improvement factor of Leviathan et al. 2023 (arXiv 2211.17192, section 3),
    ``(1 - a^(k+1)) / ((1 - a)(k c + 1))``, where ``(1 - a^(k+1)) / (1 - a)`` is the expected tokens per step (tau)
    and ``k c + 1 >= 1`` a step's cost in one-token verifier forwards. A measured ratio above ``tau x (1 + slack)``
    (e.g. 1.4x at tau 1.02: the drafter saved nothing) means the baseline was slowed (CPU contention, another
    process, clocks) or, for two servers, ran on other hardware; it is not the drafter's speedup.

    Args:
        label: the set, named first in the line.
        speedup: tokens/s with the drafter / tokens/s of the baseline (NaN / None: nothing said).
        tau: the acceptance length measured in the same run (NaN / None / <= 0: nothing said).
        baseline: what the speedup is measured against, for the line.
        slack: the relative tolerance (default :data:`SPEEDUP_SLACK`).

    Returns:
        the line, or None when ``speedup <= tau * (1 + slack)`` or a value is missing.
    """
    if (
        speedup is None
        or tau is None
        or not (math.isfinite(speedup) and math.isfinite(tau))
        or tau <= 0
    ):
        return None
    if speedup <= tau * (1 + slack):
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


def _lossless_cell(d: dict) -> str:
    """``yes``, ``yes (n near-ties)`` or ``NO (n prompts)`` for one dataset row."""
    fails = d.get("failures", len(d["mismatches"]))
    near = d.get("near_ties", 0)
    if fails:
        return f"NO ({fails} prompts)" + (f" + {near} near-ties" if near else "")
    return "yes" if not near else f"yes ({near} near-ties)"


def plot_acceptance(datasets: Sequence[dict], steps: int, title: str = "") -> bytes:
    """PNG bytes: grouped bars of conditional and unconditional acceptance per draft position per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    width = 0.8 / max(1, len(datasets))
    for ax, key, name in (
        (axes[0], "conditional", "conditional"),
        (axes[1], "unconditional", "unconditional"),
    ):
        for j, d in enumerate(datasets):
            xs = [k + 1 + (j - (len(datasets) - 1) / 2) * width for k in range(steps)]
            vals = [0.0 if v is None or v != v else v for v in d[key]]
            ax.bar(xs, vals, width=width, label=f"{d['dataset']} (tau {_f(d['tau'])})")
        ax.set_xticks(range(1, steps + 1))
        ax.set_xlabel("draft position")
        ax.set_title(f"{name} acceptance")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("rate")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def write_reports(
    out_dir: str | Path, report: dict, stem: str = "bench", plot_name: str = "acceptance.png"
) -> list[Path]:
    """Write ``{stem}.json``, ``{stem}.md`` and the acceptance plot into ``out_dir`` as one set
    (:func:`eagle3.io.atomic_write_files`: a full disk leaves the earlier run's three files, never a mix)."""
    out = Path(out_dir)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / plot_name]
    png = plot_acceptance(report["datasets"], report["steps"], str(report.get("verifier", "")))
    atomic_write_files(list(zip(paths, report_bytes(report) + [png])))
    return paths


def report_bytes(report: dict) -> list[bytes]:
    """``[JSON, Markdown]`` of a benchmark report as the files hold them (UTF-8; the JSON indented, one trailing
    newline, as :func:`eagle3.io.atomic_write_json` writes it)."""
    text = json.dumps(json_safe(report), indent=2, ensure_ascii=False) + "\n"
    return [text.encode("utf-8"), render_markdown(report).encode("utf-8")]


# ---------------------------------------------------------------------------------------------
# aux layers: drafter metadata vs shards metadata
# ---------------------------------------------------------------------------------------------
def _aux_from_meta(meta: dict, path: Path) -> Optional[list[int]]:
    if not isinstance(meta, dict):
        raise UserError(f"{path}: expected a JSON object")
    for key in ("aux_layers_hf", "aux_layers"):
        if key in meta:
            val = meta[key]
            if (
                not isinstance(val, list)
                or len(val) != 3
                or not all(isinstance(i, int) for i in val)
            ):
                raise UserError(f"{path}: key '{key}' must be a list of 3 integers, got {val!r}")
            return val
    return None


def resolve_aux_layers(
    drafter_dir: Path, shards_dir: Optional[Path], fallback: Optional[list[int]]
) -> tuple[list[int], list[str]]:
    """The aux layers (HF indices) to feed the drafter, and warnings.

    Priority: the drafter's ``eagle3_train.json`` (``aux_layers_hf``/``aux_layers``), then the shards'
    ``data_config.json``, then ``fallback``. A warning is returned when the drafter's and the
    shards' lists differ (the FIELD-NOTES off-by-one failure: near-zero acceptance).

    Raises:
        UserError: no source names the aux layers, or a malformed metadata file.
    """
    warnings: list[str] = []
    drafter_aux = data_aux = None
    meta_path = Path(drafter_dir) / TRAIN_META
    if meta_path.is_file():
        drafter_aux = _aux_from_meta(read_json(meta_path), meta_path)
    if shards_dir is not None and (Path(shards_dir) / DATA_CONFIG).is_file():
        dc = Path(shards_dir) / DATA_CONFIG
        data_aux = _aux_from_meta(read_json(dc), dc)
    if drafter_aux is not None and data_aux is not None and list(drafter_aux) != list(data_aux):
        warnings.append(
            f"aux layers differ: drafter {meta_path} records {drafter_aux} but shards {Path(shards_dir) / DATA_CONFIG} "
            f"record {data_aux} (HF hidden_states indices); using the drafter's"
        )
    aux = drafter_aux or data_aux or fallback
    if aux is None:
        raise UserError(
            f"{meta_path}: no aux layers recorded (and no data_config.json / extract.aux_layers)"
        )
    return [int(i) for i in aux], warnings


def verifier_warnings(
    drafter_dir: Path,
    verifier_name: str,
    dims: Optional[dict] = None,
    weights: Optional[str] = None,
) -> list[str]:
    """A warning when the drafter's ``eagle3_train.json`` names another verifier than the run config, or records
    other dimensions than ``dims`` (the loaded verifier's, :func:`eagle3.verifier.verifier_dims`: a ``verifier.path``
    pointed at another model under the same ``verifier.name``), or another weights fingerprint than ``weights``
    (:func:`eagle3.verifier.weights_fingerprint` of ``verifier.path``; exports of shards 02 fingerprinted)."""
    from eagle3.shards.format import verifier_dims_differ
    from eagle3.verifier import weights_differ

    meta_path = Path(drafter_dir) / TRAIN_META
    if not meta_path.is_file():
        return []
    meta = read_json(meta_path)
    rec = (meta.get("verifier") or {}) if isinstance(meta, dict) else {}
    rec = rec if isinstance(rec, dict) else {}
    name = rec.get("name")
    if name and name != verifier_name:
        return [
            f"drafter {meta_path} was exported for verifier '{name}', benchmarking it with '{verifier_name}'"
        ]
    diff = verifier_dims_differ(dims or {}, rec)
    if diff:
        return [
            f"drafter {meta_path} was exported for verifier '{name or verifier_name}' of other dimensions than the "
            f"model at verifier.path ({diff})"
        ]
    if weights_differ(rec.get("weights"), weights):
        return [
            f"drafter {meta_path} was exported for verifier '{name or verifier_name}' with other weights than the "
            f"model at verifier.path (key 'verifier.weights': {str(rec['weights'])[:19]}... recorded, {weights[:19]}... "
            f"at verifier.path): tau measures the drafter against another model"
        ]
    return []


def ttt_length_warning(
    drafter_dir: Path, steps: int, steps_field: str, fix: Optional[str] = None
) -> Optional[str]:
    """One warning line when 05 drafts more tokens a step (``steps``, from ``steps_field``: ``--steps`` or
    ``benchmark.steps``; ``05 --server``: the server's ``speculative_num_steps``) than the drafter was trained for: its
    ``eagle3_train.json`` key ``ttt_length`` (``train.ttt_length``). Draft positions past it were never trained, so
    their acceptance (and tau) says little about the drafter. None when ``steps`` is within it, or the export records
    no ``ttt_length`` (an export of before the key, or none of this project's). A malformed metadata file is left to
    the checks that read it. ``fix``: how to draft fewer, ``{k}`` = the ``ttt_length`` (default ``benchmark with
    {field} {k}``, ``{field}`` = ``steps_field``).
    """
    meta_path = Path(drafter_dir) / TRAIN_META
    k = recorded_ttt_length(meta_path)
    if k is None or steps <= k:
        return None
    fix = (fix or "benchmark with {field} {k}").format(field=steps_field, k=k)
    return (
        f"{steps_field} {steps} drafts more tokens a step than the drafter was trained for: {meta_path} records "
        f"ttt_length {k} (train.ttt_length); {untrained_positions(k, steps, verb=True)} never trained, so the "
        f"acceptance there is low and tau understates a {k}-step chain: {fix}, or train with train.ttt_length {steps}"
    )


def recorded_ttt_length(meta_path: Path) -> Optional[int]:
    """``ttt_length`` of an export's ``eagle3_train.json`` (None: no file, unreadable, or no integer key)."""
    try:
        meta = read_json(meta_path) if meta_path.is_file() else None
    except UserError:
        return None
    k = meta.get("ttt_length") if isinstance(meta, dict) else None
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def ttt_length_unchecked(drafter_dir: Path, steps: int, steps_field: str) -> Optional[str]:
    """The line saying :func:`ttt_length_warning` could not be made: the drafter's ``eagle3_train.json`` is missing
    (a drafter not exported by this project) or records no integer ``ttt_length`` (an export of before the key).
    None when it records one. Before, 05 said nothing and a chain longer than the trained one went unnoticed.

    Args:
        drafter_dir: the exported folder.
        steps: the draft tokens a step 05 (or the server) drafts.
        steps_field: where ``steps`` came from (``--steps``, ``benchmark.steps``, the server's
            ``--speculative-num-steps``).
    """
    meta_path = Path(drafter_dir) / TRAIN_META
    if recorded_ttt_length(meta_path) is not None:
        return None
    why = (
        "records no ttt_length"
        if meta_path.is_file()
        else "not found (a drafter not exported by eagle3-train)"
    )
    return (
        f"{meta_path} {why}: 05 did not check {steps_field} {steps} against the draft positions the drafter was "
        f"trained for; check that its training's TTT length (train.ttt_length, SpecForge --ttt-length) is at "
        f"least {steps}"
    )


def shards_unchecked(cfg: RunConfig, drafter_dir: Path) -> Optional[str]:
    """The line saying which of 05's checks against the shards' ``data_config.json`` could not be made because the
    file is gone (shards deleted after training, or a drafter benchmarked without its run's shards): the config's
    ``extract.aux_layers`` / ``extract.max_length`` (:func:`eagle3.shards.format.check_extract_settings`, only keys
    the config sets), the drafter's recorded aux layers (:func:`resolve_aux_layers`) and the chat template
    (:func:`template_check`). None when the file exists."""
    dc = Path(cfg.shards_dir) / DATA_CONFIG
    if dc.is_file():
        return None
    what = ["the chat template (and verifier.chat_template_kwargs)"] + [
        f"the config's extract.{k}"
        for k in ("aux_layers", "max_length")
        if k in getattr(cfg.extract, "model_fields_set", set())
    ]
    meta_path = Path(drafter_dir) / TRAIN_META
    try:
        has_aux = (
            meta_path.is_file() and _aux_from_meta(read_json(meta_path), meta_path) is not None
        )
    except UserError:
        has_aux = False  # resolve_aux_layers refuses it
    if has_aux:
        what.append(f"the drafter's aux layers ({meta_path})")
    return (
        f"{dc} not found: 05 did not check {', '.join(what)} against the template, layers and length the shards "
        f"were made with; check them against the data_config.json of the shards the drafter was trained on"
    )


def verifier_unchecked(
    drafter_dir: Path, verifier_name: str, weights: Optional[str], dims_checked: bool = True
) -> Optional[str]:
    """The line saying which part of :func:`verifier_warnings` could not be made: the drafter's ``eagle3_train.json``
    is missing or names no verifier (its name, dimensions and weights not compared), or one side has no weights
    fingerprint (``verifier.weights``: an export of shards captured before fingerprints; ``weights`` None: no weight
    file at ``verifier.path`` here). None when every comparison was made. ``dims_checked`` False (``--server``, which
    loads no verifier): the line does not claim the dimensions were compared."""
    meta_path = Path(drafter_dir) / TRAIN_META
    try:
        meta = read_json(meta_path) if meta_path.is_file() else None
    except UserError:
        meta = None  # verifier_warnings refuses it
    rec = meta.get("verifier") if isinstance(meta, dict) else None
    if not isinstance(rec, dict) or not rec.get("name"):
        why = (
            "names no verifier"
            if meta_path.is_file()
            else "not found (a drafter not exported by eagle3-train)"
        )
        at_load = (
            "; only the embedding and vocab shapes are checked at load" if dims_checked else ""
        )
        return (
            f"{meta_path} {why}: 05 did not check that the drafter was trained for the verifier '{verifier_name}' "
            f"(name, dimensions, weights{at_load}); check which verifier its training used"
        )
    if rec.get("weights") and weights:
        return None
    side = (
        f"{meta_path} records no verifier.weights (an export of shards captured before weight fingerprints)"
        if not rec.get("weights")
        else "verifier.path holds no weight file on this machine"
    )
    return (
        f"{side}: 05 did not check that the drafter was trained on the weights at verifier.path, only the name "
        f"'{rec['name']}'{' and dimensions' if dims_checked else ''}; check that verifier.path is the model its "
        f"shards were captured from"
    )


def vocab_map_unchecked(cfg: RunConfig, drafter_dir: Path) -> Optional[str]:
    """The line saying :func:`check_drafter_vocab` compared only the draft vocab size: the run's stage-03
    ``vocab_map.pt`` is not there, so the drafter's ``d2t`` was not compared with it. None when it exists, or when
    the drafter's ``config.json`` records a full vocab (``draft_vocab_size`` = ``vocab_size``: its ``d2t`` is the
    identity, absent from a vLLM folder, so there is nothing but the size to compare)."""
    from eagle3.data.vocab import VOCAB_MAP

    vm = Path(cfg.data_dir) / VOCAB_MAP
    if vm.is_file() or _full_vocab_export(Path(drafter_dir)):
        return None
    return (
        f"{vm} not found: 05 did not check {Path(drafter_dir) / 'model.safetensors'} d2t (its draft vocabulary) "
        f"against the run's stage-03 vocab map, only its size against data.draft_vocab_size; run 03 for this "
        f"config, or compare d2t with the vocab_map.pt of the data it was trained on"
    )


def _full_vocab_export(drafter_dir: Path) -> bool:
    """Whether the export's ``config.json`` records ``draft_vocab_size`` equal to ``vocab_size`` (False when it is
    missing, unreadable, or either is not an integer)."""
    try:
        c = (
            read_json(drafter_dir / "config.json")
            if (drafter_dir / "config.json").is_file()
            else None
        )
    except UserError:
        return False
    d, v = (c.get("draft_vocab_size"), c.get("vocab_size")) if isinstance(c, dict) else (None, None)
    return isinstance(d, int) and not isinstance(d, bool) and d == v


def template_check(
    cfg: RunConfig, tokenizer, say_missing: bool = False
) -> tuple[Optional[str], Optional[str]]:
    """The chat template 05 renders the prompts with (``verifier.chat_template``, else ``verifier.path``'s tokenizer's)
    against the one the shards were rendered with (``data_config.json`` ``chat_template_hash``, written by 02 and
    compared nowhere before): a drafter trained on conversations rendered otherwise is scored on prompts it never saw
    in that form, and its tau understates it.

    Returns:
        ``(warning, not_checked)``: the line for another template, or the line saying the check could not be made (the
        shards record no hash); both None when the hashes agree, the template is unusable (05's rendering says so), or
        the shards' ``data_config.json`` is gone (offline :func:`shards_unchecked` says that; ``say_missing``, for
        ``--server``: the not-checked line names the missing file).
    """
    from eagle3.prompts.chat import ChatOptions, chat_template_hash, template_name

    dc = Path(cfg.shards_dir) / DATA_CONFIG
    try:
        rec = read_json(dc).get("chat_template_hash") if dc.is_file() else False
        now = chat_template_hash(tokenizer, cfg.verifier.chat_template)
    except (UserError, AttributeError):
        return None, None
    if (rec is False and not say_missing) or rec == now:
        return None, None
    used = template_name(tokenizer, ChatOptions.from_config(cfg))
    if not isinstance(rec, str) or not rec:
        return None, (
            f"{dc} {'not found' if rec is False else 'records no chat_template_hash'}: 05 did not check that "
            f"the prompts it renders with {used} are in the template the drafter's data was rendered with; "
            f"check verifier.chat_template against the template the shards were made with"
        )
    return (
        f"{dc}: the shards were rendered with chat template sha256 {rec[:12]} (chat_template_hash) but 05 renders "
        f"the prompts with {used}: the drafter was trained on conversations rendered otherwise, so tau "
        f"understates it; set verifier.chat_template back to the shards' template, or re-run 02-04 with this "
        f"one"
    ), None


def template_kwargs_check(cfg: RunConfig) -> tuple[Optional[str], Optional[str]]:
    """The ``verifier.chat_template_kwargs`` 05 renders the prompts with (e.g. ``{thinking: false}``) against those
    the shards were rendered with (``data_config.json`` ``chat_template_kwargs``, written by 02 and compared nowhere
    before): the same template hash renders a thinking-mode conversation otherwise than a plain one, so a drafter
    trained on one is scored on prompts it never saw in that form (:func:`template_check` compares only the template).

    Returns:
        ``(warning, not_checked)``: the line for other kwargs, or the line saying the check could not be made (the
        shards record none); both None when they agree or the shards' ``data_config.json`` is gone or unreadable
        (:func:`shards_unchecked` / :func:`template_check` say that).
    """
    dc = Path(cfg.shards_dir) / DATA_CONFIG
    now = dict(cfg.verifier.chat_template_kwargs)
    try:
        meta = read_json(dc) if dc.is_file() else None
    except UserError:
        return None, None
    if not isinstance(meta, dict):
        return None, None
    rec = meta.get("chat_template_kwargs")
    if not isinstance(rec, dict):
        return None, (
            f"{dc} records no chat_template_kwargs: 05 did not check that the verifier.chat_template_kwargs "
            f"it renders the prompts with ({now}) are those the drafter's data was rendered with (e.g. "
            f"thinking on or off); check them against the settings the shards were made with"
        )
    if json.dumps(rec, sort_keys=True, default=str) == json.dumps(now, sort_keys=True, default=str):
        return None, None
    return (
        f"{dc}: the shards were rendered with chat_template_kwargs {rec} but 05 renders the prompts with "
        f"verifier.chat_template_kwargs {now}: the drafter was trained on conversations rendered otherwise (e.g. "
        f"thinking on or off), so tau understates it; set verifier.chat_template_kwargs back to the shards' value, "
        f"or re-run 02-04 with this one"
    ), None


def _logged(warning: Optional[str]) -> list[str]:
    """``[warning]`` after logging it (05 says it at once and records it in ``bench.json``), ``[]`` for None."""
    if warning is None:
        return []
    log.warning("%s", warning)
    return [warning]


@contextlib.contextmanager
def verifier_named_first(mismatch: list[str]):
    """Around 05's checks of the drafter against the loaded verifier: when ``mismatch`` (:func:`verifier_warnings`)
    says the drafter was exported for another verifier, a UserError of the block (an aux layer out of range, an
    embedding that does not fit) is re-raised with the mismatch first, the cause before its symptom.

    Raises:
        UserError: ``<mismatch> (verifier.name / verifier.path): <the original message>``.
    """
    try:
        yield
    except UserError as e:
        if not mismatch:
            raise
        raise UserError(f"{mismatch[0]} (verifier.name / verifier.path): {e}") from e


def export_folder_warnings(
    drafter_dir: Path, aux_layers: Sequence[int], verifier_architecture: str
) -> list[str]:
    """Warnings when the exported folder's ``config.json`` makes its engine capture other verifier
    layers than ``aux_layers`` (the HF indices this benchmark feeds the drafter).

    Raises:
        UserError: the folder's layer ids contradict its recorded engine / HF layers
            (:func:`eagle3.export.serving.check_export_folder`).
    """
    from eagle3.export.serving import check_export_folder

    if not (Path(drafter_dir) / "config.json").is_file():
        return []
    info = check_export_folder(drafter_dir, verifier_architecture=verifier_architecture)
    out = list(info["warnings"])
    if info["aux_layers_hf"] is not None and list(info["aux_layers_hf"]) != list(aux_layers):
        out.append(
            f"{Path(drafter_dir) / 'config.json'}: {info['engine']} would capture HF layers {info['aux_layers_hf']} "
            f"(ids {info['engine_layer_ids']}), this benchmark feeds HF layers {list(aux_layers)}"
        )
    return out


# ---------------------------------------------------------------------------------------------
# stage 05
# ---------------------------------------------------------------------------------------------
def resolve_drafter_dir(cfg: RunConfig, drafter_dir: Optional[str | Path]) -> Path:
    """The drafter folder stage 05 benchmarks: ``--drafter`` when given, else the config's ``export_dir``.

    Raises:
        UserError: the folder is missing; the message names where it came from (``--drafter`` or the config's
            export dir), since a user who never passed ``--drafter`` would not know the default.
    """
    if drafter_dir:
        path = Path(drafter_dir)
        if (
            path.is_file()
        ):  # it said "folder not found" of a checkpoint that exists (fresh-user trial 2026-12-05d)
            raise UserError(
                f"--drafter: '{path}' is a file, not an exported drafter folder; pass the folder 04 "
                f"exported (drafter-sglang), or export a checkpoint first with 04_train.py --export-only"
            )
        if not path.is_dir():
            raise UserError(
                f"--drafter: folder '{path}' not found (export a trained drafter first"
                + (f"; {relative_hint(path)})" if relative_hint(path) else ")")
            )
        if not (path / "config.json").is_file() and (path / "checkpoints").is_dir():
            raise UserError(
                f"--drafter: '{path}' is 04's train folder, not an exported drafter; pass the export "
                f"folder (drafter-sglang beside it, or export.output_dir), or write it with 04_train.py "
                f"--export-only"
            )
        _require_export_config(path, f"--drafter: '{path}'")
        return path
    path = Path(cfg.export_dir)
    if not path.is_dir():
        raise UserError(missing_export_advice(cfg, path))
    _require_export_config(path, f"the config's export dir '{path}'")
    return path


def missing_export_advice(cfg: RunConfig, path: Path) -> str:
    """The line refusing a missing config export dir (``path``), with advice that works for the train folder as it is:
    ``run 04_train.py first`` was given also when ``train.output_dir`` held checkpoints (a stopped run, a refused
    export), where a plain 04 is refused (``holds checkpoints``), and ``--export-only --engine ...`` also when no
    checkpoint was left to export from. The checkpoints are listed first: with some, ``--export-only`` (the newest,
    or for the other engine's existing export, the same checkpoint) or ``--resume``; without, train (or pass
    ``--drafter``)."""
    from eagle3.train.checkpoint import ckpt_dir, list_checkpoints

    found = list_checkpoints(cfg.train_dir)
    other = "vllm" if cfg.export.engine == "sglang" else "sglang"
    have = cfg.root / f"drafter-{other}"
    if (
        cfg.export.output_dir is None and (have / "config.json").is_file()
    ):  # trained, exported for the other one
        head = (
            f"the exported drafter '{path}' (the config's export dir, export.engine: {cfg.export.engine}) not "
            f"found, but {have} is there"
        )
        if found:
            return (
                f"{head}: 04_train.py --export-only --engine {cfg.export.engine} writes it from the same "
                f"checkpoint (or pass --drafter)"
            )
        return (
            f"{head}; {ckpt_dir(cfg.train_dir)} holds no checkpoint to export it from (04_train.py --export-only "
            f"needs one): benchmark {have} with --set export.engine={other}, or train again for {cfg.export.engine}"
        )
    head = f"the exported drafter '{path}' (the config's export dir) not found"
    if found:
        return (
            f"{head}, but {ckpt_dir(cfg.train_dir)} holds checkpoints (newest step {found[-1][0]}): "
            f"04_train.py --export-only exports it, 04_train.py --resume trains on to the run's end and exports "
            f"(or pass --drafter)"
        )
    return f"{head}: run 04_train.py first or pass --drafter" + (
        f" ({relative_hint(path)})" if relative_hint(path) else ""
    )


def _require_export_config(path: Path, what: str) -> None:
    """Refuse a folder without the ``config.json`` every export holds, naming it and what it holds instead.

    Before, the shards, data or output-root folder given to ``--drafter`` stopped 05 with a bare
    ``<folder>/config.json: file not found`` (fresh-user trial 2026-12-05e); an output root that holds an
    export is pointed at it.

    Raises:
        UserError: ``<what> is not an exported drafter folder (no config.json) ...``.
    """
    if (path / "config.json").is_file():
        return
    inside = sorted(
        p.name
        for p in path.iterdir()
        if p.is_dir() and (p / "config.json").is_file() and (p / TRAIN_META).is_file()
    )
    hint = (
        f"it holds the export{'s' if len(inside) > 1 else ''} {', '.join(inside)}: pass "
        f"{' or '.join(str(path / n) for n in inside)}"
        if inside
        else "pass the folder 04 exported (drafter-sglang, or export.output_dir), or write it with "
        "04_train.py --export-only"
    )
    raise UserError(f"{what} is not an exported drafter folder (no config.json); {hint}")


def _load_drafter(drafter_dir: Path, verifier, device, dtype):
    from eagle3.export.serving import load_exported

    embed = verifier.get_input_embeddings().weight
    drafter = load_exported(drafter_dir, embed_weight=embed)
    return drafter.to(device=device, dtype=dtype).eval()


def check_drafter_vocab(cfg, drafter, drafter_dir: Path, own_export: bool) -> list[str]:
    """The benchmarked drafter's draft vocab against the run config and the run's ``vocab_map.pt``.

    The export carries its own ``d2t`` (int64 ``[draft_V]``); a run's own export (no ``--drafter``)
    must have ``draft_V == data.draft_vocab_size`` and, when stage 03's ``{data_dir}/vocab_map.pt``
    exists, the same ``d2t`` (a stale export after re-running 03 is refused). A drafter passed with
    ``--drafter`` may come from another run: a difference is a warning.

    Returns:
        warning lines (also logged).

    Raises:
        UserError: own export whose draft vocab differs from ``data.draft_vocab_size`` or from
            ``vocab_map.pt``; a malformed ``vocab_map.pt`` (as :func:`eagle3.data.vocab.load_vocab_map`).
    """
    from eagle3.data.vocab import VOCAB_MAP, load_vocab_map

    warnings: list[str] = []
    got, want = int(drafter.args.draft_vocab_size), int(cfg.data.draft_vocab_size)
    problem, fix = None, None
    # a plain re-run of 04 into the same train folder is refused (its checkpoints hold the old vocab): name the ways
    # that work (fresh-user trial 2026-12-05g)
    new_run = "or train a drafter for it with 04_train.py into a new train.output_dir"
    if got != want:
        problem = (
            f"{drafter_dir}: drafter has draft_vocab_size {got} but the config's data.draft_vocab_size is "
            f"{want}"
        )
        fix = f"set data.draft_vocab_size back to {got}, {new_run}"
    else:
        vm_path = cfg.data_dir / VOCAB_MAP
        if vm_path.is_file():
            vm = load_vocab_map(vm_path, target_vocab_size=int(drafter.args.target_vocab_size))
            if not torch.equal(vm["d2t"].to(drafter.d2t.device), drafter.d2t):
                problem = f"{drafter_dir}: drafter's d2t differs from {vm_path} (export from an older stage-03 run?)"
                fix = f"re-run 03_prepare_data.py with the data settings the drafter was trained under, {new_run}"
    if problem is None:
        return warnings
    if own_export:
        raise UserError(f"{problem} ({fix}, or pass --drafter to benchmark another drafter)")
    log.warning(problem)
    warnings.append(problem)
    return warnings


def check_drafter_shape(cfg, drafter, drafter_dir: Path, own_export: bool) -> list[str]:
    """The benchmarked drafter's shape against the config's ``drafter:`` section (its non-null fields, ``variant``
    and ``num_layers``; ``max_position_embeddings`` excepted: a re-export may change it alone).

    05 scores the export, whatever the config says: a config edited after training (e.g. ``drafter.num_layers``)
    would otherwise label the results with a drafter that was not measured. A run's own export (no ``--drafter``)
    that differs is stale and refused; a drafter passed with ``--drafter`` may come from another run: a difference is
    a warning.

    Returns:
        warning lines (also logged).

    Raises:
        UserError: the run's own export differs from the config, naming every differing field.
    """
    want = {
        k: getattr(cfg.drafter, k)
        for k in type(cfg.drafter).model_fields
        if k != "max_position_embeddings"
    }
    diffs = [
        f"{key} {getattr(drafter.args, key)!r} but the config's drafter.{key} is {value!r}"
        for key, value in want.items()  # None: copied from the verifier at training, nothing to compare
        if value is not None and getattr(drafter.args, key) != value
    ]
    if not diffs:
        return []
    problem = f"{drafter_dir}: the drafter has " + "; ".join(diffs)
    if own_export:
        raise UserError(
            problem
            + " (set those drafter fields back to the trained values, or train a drafter of this "
            "shape with 04_train.py into a new train.output_dir, or pass --drafter to benchmark another "
            "drafter)"
        )
    log.warning(problem)
    return [problem]


def warm_up(
    verifier,
    drafter,
    prompt: list[int],
    aux_layers: Sequence[int],
    steps: int,
    eos: Sequence[int],
    batch_size: int,
) -> None:
    """Untimed runs of both decoders at ``batch_size`` (allocator, kernels and their heuristics)."""
    from eagle3.benchmark.decode import greedy_generate_batch, speculative_generate_batch

    batch = [list(prompt)] * batch_size
    greedy_generate_batch(verifier, batch, 8, eos)
    speculative_generate_batch(verifier, drafter, batch, aux_layers, steps, 8, eos)


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
    report["warnings"].append(
        msg
        + (
            ""
            if strict
            else "; reduced precision: raise benchmark.tie_tolerance only if "
            "the gaps are rounding-sized"
        )
    )
    return msg


def check_measurement(report: dict, tie_tolerance: float, strict: bool) -> Optional[str]:
    """The checks of a measured ``bench.json`` report, in ``report["warnings"]``: a speedup above tau
    (:func:`speedup_warnings`: the baseline was slowed), then losslessness (:func:`lossless_verdict`, whose failure
    line is returned; None when every token matched greedy or only near-ties differ)."""
    report["warnings"] += speedup_warnings(report["datasets"])
    return lossless_verdict(report, tie_tolerance, strict)


def load_sets(
    datasets: Sequence[str], num_prompts: Optional[int], pick: str
) -> tuple[list[tuple[str, list[EvalPrompt]]], list[str]]:
    """Each dataset's ``num_prompts`` prompts picked by ``pick`` (:func:`eagle3.benchmark.eval_prompts.load_eval_subset`),
    under a label unique within the run (:func:`eagle3.benchmark.eval_prompts.dataset_labels`).

    Returns:
        ``([(label, prompts), ...], subset warnings)``.

    Raises:
        UserError: a prompt set that cannot be loaded (file, line, key).
    """
    sets, notes = [], []
    for name, label in zip(datasets, dataset_labels(datasets)):
        chosen, more = load_eval_subset(name, num_prompts, pick)
        sets.append((label, chosen))
        notes += more
    return sets, notes


def check_context(
    sets: Sequence[tuple[str, list[tuple[str, list[int]]]]],
    max_new_tokens: int,
    steps: int,
    verifier_config,
) -> None:
    """Refuse a prompt whose decode would run past the verifier's context (``max_position_embeddings``): its tokens
    plus ``max_new_tokens`` plus the ``steps`` drafts of the last verify step. Such a prompt was benchmarked without a
    word (a 2,500-token prompt file line on a 2,048-position verifier, trial 2026-12-05g): positions the verifier was
    never trained at, whose greedy output and tau mean nothing, and which a server refuses.

    Args:
        sets: ``[(label, [(prompt id, prompt token ids), ...]), ...]``.

    Raises:
        UserError: the first such prompt: set, id, its tokens, the limit and what to change.
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


def run_offline(
    cfg: RunConfig,
    verifier,
    tokenizer,
    drafter,
    aux_layers: list[int],
    sets: Sequence[tuple[str, list[EvalPrompt]]],
    steps: int,
    max_new_tokens: int,
    strict: bool,
    drafter_name: str = "",
    warnings: Sequence[str] = (),
    out_dir: Optional[Path] = None,
    batch_size: Optional[int] = None,
    tie_tolerance: Optional[float] = None,
    logged: Sequence[str] = (),
    not_checked: Sequence[str] = (),
) -> dict:
    """Benchmark loaded models on ``sets`` (``(label, prompts)`` of :func:`load_sets`); write the reports; enforce
    losslessness.

    ``batch_size`` / ``tie_tolerance`` default to ``cfg.benchmark`` (tolerance None:
    :func:`default_tie_tolerance` of the verifier's dtype). ``warnings`` are recorded in the report and logged at the
    end; ``logged`` (the prompt-subset notes :func:`run` logs before the long work) are recorded after them, not
    logged again. ``not_checked`` (some of those lines: checks not made for want of metadata) also as ``not_checked``.
    Returns the report dict written to ``bench.json``.

    Raises:
        UserError: (``strict``) speculative output differs from
            greedy by more than the tie tolerance (raised after the reports are written, naming
            dataset, prompt, token index and gap).
    """
    from eagle3.prompts.chat import ChatOptions, end_of_turn_ids, prompt_ids

    eos = sorted(end_of_turn_ids(tokenizer))
    param = next(verifier.parameters())
    batch_size = batch_size or cfg.benchmark.batch_size
    if tie_tolerance is None:
        tie_tolerance = cfg.benchmark.tie_tolerance
    if tie_tolerance is None:
        tie_tolerance = default_tie_tolerance(param.dtype)
    largest = effective_batch_size(batch_size, max(len(p) for _, p in sets))
    report = {
        "verifier": cfg.verifier.display_name(),
        "drafter": drafter_name,
        "device": str(param.device),
        "dtype": str(param.dtype).replace("torch.", ""),
        "steps": steps,
        "max_new_tokens": max_new_tokens,
        "batch_size": largest,  # effective: the largest batch any set decodes (each set records its own)
        "tie_tolerance": tie_tolerance,
        "aux_layers": list(aux_layers),
        "eos_ids": eos,
        "prompt_pick": cfg.benchmark.prompt_pick,
        "warnings": list(warnings) + list(logged),
        "not_checked": list(not_checked),
        "datasets": [],
    }
    chat = ChatOptions.from_config(cfg)
    tokenized = [
        (label, [(p.id, prompt_ids(tokenizer, p.messages, chat)) for p in prompts])
        for label, prompts in sets
    ]
    check_context(tokenized, max_new_tokens, steps, verifier.config)  # before any set is decoded
    warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], chat)
    warm_up(verifier, drafter, warm, aux_layers, steps, eos, largest)
    for label, ids in tokenized:
        row = bench_prompts(
            verifier,
            drafter,
            ids,
            aux_layers,
            steps,
            max_new_tokens,
            eos,
            label,
            batch_size=batch_size,
            tie_tolerance=tie_tolerance,
            decoder=cfg.benchmark.decoder,
        )
        report["datasets"].append(
            {**row, "prompt_ids": [i for i, _ in ids]}
        )  # which prompts prompt_pick chose
    msg = check_measurement(report, tie_tolerance, strict)
    out = Path(out_dir or cfg.bench_dir)
    write_reports(out, report)
    said = list(logged)
    for w in report["warnings"]:
        if w in said:  # logged at the start already
            said.remove(w)
        else:
            log.warning("%s", w)
    if msg and strict:
        raise UserError(f"{out / 'bench.json'}: lossless check failed: {msg}")
    print(headline(report, out))
    return report


BENCH_LOCK = ".bench.lock"  # in bench_dir while a 05 benchmarks into it (one 05 per bench folder)
#: 05's disk-full advice (:func:`eagle3.io.rerun_hint`): a benchmark keeps no partial state to resume from.
REDO_HINT = "re-run the same command (05 does not resume: it benchmarks every set again)"


def holds_bench_lock(fn):
    """Run the stage-05 entry point ``fn(cfg, ...)`` holding ``{bench_dir}/.bench.lock``
    (:func:`eagle3.io.output_folder_lock`, made and checked first): a second 05 on the same folder (``--datasets
    mtbench`` and ``--datasets gsm8k`` started side by side) measured its tokens/s under the first one's load and then
    replaced its reports, both exiting 0 (trial 2026-12-05g); now it stops at once with one line. A full disk meanwhile
    says to re-run (:data:`REDO_HINT`), not to resume."""
    import functools

    from eagle3.io import output_folder_lock, rerun_hint

    @functools.wraps(fn)
    def locked(cfg, *args, **kwargs):
        holder = (
            f"another 05_benchmark run is benchmarking into {cfg.bench_dir} (its reports would replace this "
            f"one's, and two runs side by side measure each other's load); wait for it, or set "
            f"benchmark.output_dir"
        )
        with (
            rerun_hint(REDO_HINT),
            output_folder_lock(cfg.bench_dir, BENCH_LOCK, holder, cfg.output_field("bench")),
        ):
            return fn(cfg, *args, **kwargs)

    return locked


@holds_bench_lock
def run(
    cfg: RunConfig,
    drafter_dir: Optional[str] = None,
    datasets: Optional[Sequence[str]] = None,
    steps: Optional[int] = None,
    num_prompts: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    serve_aux_layers: Optional[Sequence[int]] = None,
    batch_size: Optional[int] = None,
    tie_tolerance: Optional[float] = None,
) -> int:
    """Stage 05 (offline): load verifier + exported drafter and benchmark (see :func:`run_offline`).

    ``serve_aux_layers`` (HF indices) replaces the aux layers the drafter was trained on, to
    measure what a serving-side layer-convention error costs (ablation); a warning is recorded.

    On CPU the verifier and drafter run in float32 (lossless check strict); on GPU in
    ``verifier.dtype`` (mismatches reported, not fatal unless the dtype is float32).
    ``batch_size`` / ``tie_tolerance`` override ``benchmark.batch_size`` / ``benchmark.tie_tolerance``.

    Returns:
        0 on success.

    Raises:
        UserError: missing drafter folder or metadata, unloadable verifier, bad prompts, lossless failure.
    """
    from eagle3.verifier import load_verifier, resolve_device

    bc = cfg.benchmark
    steps, steps_field = (steps, "--steps") if steps else (bc.steps, "benchmark.steps")
    max_new_tokens = max_new_tokens or bc.max_new_tokens
    num_prompts = num_prompts or bc.num_prompts
    check_dataset_names(
        datasets or bc.datasets, "--datasets" if datasets else "benchmark.datasets", not datasets
    )
    datasets = list(datasets or bc.datasets)
    probe_dirs(
        cfg.bench_dir, cfg.output_field("bench")
    )  # the reports come at the end: a bad folder fails now
    drafter_dir = resolve_drafter_dir(cfg, drafter_dir)
    sets, subset_notes = load_sets(
        datasets, num_prompts, bc.prompt_pick
    )  # a bad set fails before the verifier loads
    for w in (
        subset_notes
    ):  # (more prompts asked than a set has, categories left out) said before the long work
        log.warning("%s", w)
    from eagle3.export.serving import preflight_export

    preflight_export(
        drafter_dir
    )  # a bad export fails before the verifier loads (minutes at Kimi scale); its
    # warnings are logged once, by load_exported below
    notes, not_checked = check_before_load(cfg, drafter_dir, steps, steps_field)  # each logged
    subset_notes += notes
    device = resolve_device(cfg.verifier.device)
    vcfg = cfg.verifier
    if device.type == "cpu" and vcfg.dtype != "float32":
        log.info(
            "CPU run: using float32 instead of %s so that the lossless check is exact", vcfg.dtype
        )
        vcfg = vcfg.model_copy(update={"dtype": "float32"})
    verifier, tokenizer = load_verifier(vcfg, device)
    drafter, aux, warnings, unchecked = load_checked_drafter(
        cfg, drafter_dir, verifier, tokenizer, device, serve_aux_layers
    )
    dtype = next(verifier.parameters()).dtype
    run_offline(
        cfg,
        verifier,
        tokenizer,
        drafter,
        aux,
        sets,
        steps,
        max_new_tokens,
        strict=dtype == torch.float32,
        drafter_name=str(drafter_dir),
        warnings=warnings,
        batch_size=batch_size,
        tie_tolerance=tie_tolerance,
        logged=subset_notes,
        not_checked=not_checked + unchecked,
    )
    return 0


def load_checked_drafter(
    cfg: RunConfig,
    drafter_dir: Path,
    verifier,
    tokenizer,
    device,
    serve_aux_layers: Optional[Sequence[int]] = None,
) -> tuple[Any, list[int], list[str], list[str]]:
    """Load the exported drafter beside a loaded verifier with every check 05 makes once the verifier is there: the
    drafter's recorded verifier (:func:`verifier_warnings`), its aux layers against the shards'
    (:func:`resolve_aux_layers`), the export folder's engine block (:func:`export_folder_warnings`), its vocab map and
    shape against the config's (:func:`check_drafter_vocab`, :func:`check_drafter_shape`), and :func:`_after_load`'s
    (chat template, what could not be checked). Shared by :func:`run` and ``bench/offline_bench_speed.py``, which
    dropped the aux-layer warning and said nothing of the checks it could not make. Not logged here.

    Returns:
        ``(drafter, aux_layers, warnings, not_checked)``: ``warnings`` holds every line, ``not_checked`` those of them
        that say a check was not made for want of metadata.

    Raises:
        UserError: an aux layer past the verifier's layers, a bad ``serve_aux_layers``, a drafter that does not load
            or contradicts the run's own vocab map or shape.
    """
    from eagle3.layers import check_aux_layers, default_aux_layers
    from eagle3.verifier import verifier_dims, weights_fingerprint

    dims = verifier_dims(verifier.config)
    fallback = cfg.extract.aux_layers
    if fallback is None:
        try:
            fallback = default_aux_layers(dims["num_layers"])
        except UserError:  # too few layers for the default: the drafter's metadata must say
            fallback = None
    mismatch = verifier_warnings(
        drafter_dir, cfg.verifier.display_name(), dims, weights_fingerprint(cfg.verifier)
    )
    with verifier_named_first(
        mismatch
    ):  # another verifier: say so rather than an aux-layer / shape symptom
        aux, warnings = resolve_aux_layers(drafter_dir, cfg.shards_dir, fallback)
        warnings += mismatch
        warnings += export_folder_warnings(drafter_dir, aux, dims["architecture"])
        aux = check_aux_layers(
            aux, dims["num_layers"], field=f"{drafter_dir / TRAIN_META}: aux_layers"
        )
        if serve_aux_layers is not None and list(serve_aux_layers) != list(aux):
            serve = check_aux_layers(
                serve_aux_layers, dims["num_layers"], field="--serve-aux-layers"
            )
            warnings.append(
                f"serving with aux layers {serve} although the drafter was trained on {aux} "
                "(--serve-aux-layers)"
            )
            aux = serve
        drafter = _load_drafter(drafter_dir, verifier, device, next(verifier.parameters()).dtype)
    warnings += check_drafter_vocab(
        cfg, drafter, drafter_dir, own_export=drafter_dir == cfg.export_dir
    )
    warnings += check_drafter_shape(
        cfg, drafter, drafter_dir, own_export=drafter_dir == cfg.export_dir
    )
    late, unchecked = _after_load(cfg, drafter_dir, mismatch, tokenizer)
    return drafter, aux, warnings + late, unchecked


def _after_load(
    cfg: RunConfig, drafter_dir: Path, mismatch: list[str], tokenizer
) -> tuple[list[str], list[str]]:
    """05's checks once the verifier's tokenizer is loaded: the chat template and its kwargs against the shards'
    (:func:`template_check`, :func:`template_kwargs_check`), and which checks could not be made: the drafter's verifier record
    (:func:`verifier_unchecked`; not when ``mismatch`` already names another verifier), its ``d2t`` against the run's
    vocab map (:func:`vocab_map_unchecked`), the template. Not logged here.

    Returns:
        ``(lines, not_checked)``: every warning line, and those of them that say a check was not made.
    """
    from eagle3.verifier import weights_fingerprint

    name = cfg.verifier.display_name()
    other_template, template_unchecked = template_check(cfg, tokenizer)
    other_kwargs, kwargs_unchecked = template_kwargs_check(cfg)
    unchecked = [
        w
        for w in (
            None
            if mismatch
            else verifier_unchecked(drafter_dir, name, weights_fingerprint(cfg.verifier)),
            vocab_map_unchecked(cfg, drafter_dir),
            template_unchecked,
            kwargs_unchecked,
        )
        if w
    ]
    return [w for w in (other_template, other_kwargs) if w] + unchecked, unchecked


def check_before_load(
    cfg: RunConfig, drafter_dir: Path, steps: int, steps_field: str
) -> tuple[list[str], list[str]]:
    """05's checks of the drafter's and the shards' metadata that need no verifier, run before it loads: a config
    whose ``extract`` settings differ from the shards' ``data_config.json`` is refused
    (:func:`eagle3.shards.format.check_extract_settings`); ``steps`` past the trained ``ttt_length`` is warned about
    (:func:`ttt_length_warning`).

    Returns:
        ``(lines, not_checked)``: every warning line (each logged here), and those of them that say which checks could
        not be made for want of metadata (:func:`ttt_length_unchecked`, :func:`shards_unchecked`).

    Raises:
        UserError: the config's extract settings differ from the shards'.
    """
    if (
        cfg.shards_dir / DATA_CONFIG
    ).is_file():  # a config whose extract settings differ from the shards' is refused
        check_extract_settings(cfg.extract, read_json(cfg.shards_dir / DATA_CONFIG), cfg.shards_dir)
    lines = [
        ttt_length_unchecked(drafter_dir, steps, steps_field),
        shards_unchecked(cfg, drafter_dir),
    ]
    not_checked = [w for w in lines if w]
    return _logged(ttt_length_warning(drafter_dir, steps, steps_field)) + [
        w for w in not_checked if _logged(w)
    ], not_checked
