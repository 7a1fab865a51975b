"""Benchmark (GPU): stage 01's in-process regeneration speed against the decode-step roofline, engines side by side.

One process, one verifier load:

1. HBM bandwidth, measured by a device-to-device copy of ``--copy-gib`` GiB (read + write bytes / time); CUDA only:
   elsewhere (CPU) ``bandwidth_gb_s`` and ``roofline`` are null in the JSON and the table says the roofline is
   unknown there.
2. The main run: ``--main-engine`` (default ``slots``) over ``--num`` conversations (all by default) through
   :func:`eagle3.regen.regenerate.regenerate`, exactly as ``01_prepare_prompts.py --regenerate`` runs it
   (context cap, chat options, batch size from the config), after an unmeasured warm-up (kernels, allocator): the
   first turn of the first ``min(8, batch size)`` conversations, at most 8 new tokens, uncompiled, printed as
   ``warm-up (not measured): ...`` and in no result. Generated tokens/s (answer tokens, stop tokens
   excluded, as 01's report) and the ratio to the roofline: a decode step must read the weights once and
   every live row's KV cache up to its length, so ``roofline_s = (decode_steps * weight_bytes +
   kv_tokens_needed * kv_bytes_per_token) / bandwidth``; ratio = roofline_s / measured seconds (prefill,
   CUDA-graph capture and host work count against the engine).
3. Bound: decode-step time of the slot engine (``prompts.regen_attention``'s path, every slot live) with
   every row at ~256 columns (weights + launches, little KV) and at the full cache, against the measured
   ms per step: launch-bound when the small step already costs most of a measured step, memory-bound when
   step time follows the bytes read. ``kv_bytes_read`` is what the attention read (flex: the rows' blocks;
   sdpa_groups: every prefix row up to its group's cap); ``prefix_steps`` the decode steps per slot prefix
   (the tail runs on small prefixes). ``bench/regen_step.py`` times single steps per path and setting.
4. Baselines on a subset (``--baseline-num`` conversations spread over the input, in the same process):
   ``static`` (the former path: ``generate`` batches until their longest answer stops), ``hf_continuous``
   (transformers' ContinuousBatchingManager, ``--hf-num`` conversations) and the main engine on the same
   subset; tokens/s and the ratios. Answers of the main engine and static are compared token for token;
   a difference is counted with the logit gap at its first differing token (bf16 near-ties, as 05 counts
   them: ``benchmark.tie_tolerance``, default 0.25 in bf16).

Input: the config's ``prompts.source`` read, deduplicated and sampled as stage 01 does, or ``--prompts``
(a messages/ShareGPT JSONL(.gz), e.g. ../shared/data/train-extra/train_extra_pool.jsonl.gz).

    python bench/regen_speed.py --config configs/smollm2-135m-full.yaml --json bench/results/regen_speed.json \\
        --md bench/results/regen_speed.md
    python bench/regen_speed.py --prompts ../shared/data/train-extra/train_extra_pool.jsonl.gz --num 100000 \\
        --baseline-num 0 --json bench/results/regen_speed_100k.json

5. Prefix reuse A/B (``--reuse-ab N``): the slots engine on N conversations of the main input, cross-turn KV
   prefix reuse on then off (``prompts.regen_prefix_reuse``): seconds, tokens/s, prefill / decode device seconds,
   prompt tokens prefilled and reused, identical answers; differences counted with their logit gap at the first
   differing token, as in 4 (near-ties within ``benchmark.tie_tolerance``, max gap). The main run's prefilled / reused counts are in its
   roofline table (``prompts.regen_prefix_reuse`` as configured).

6. Prefill graphs A/B (``--prefill-graphs-ab N``): the slots engine on N conversations of the main input, bucketed
   prefill forwards captured as CUDA graphs on then off (``prompts.regen_prefill_graphs``): as 5, with the prefill
   forwards, ms per forward, padded prefill tokens (bucket padding included), graphs captured and the host seconds
   of their capture (the first use of each bucket pays it, within the run's seconds).
   Both A/Bs run *on* first; ``--ab-off-first`` swaps the order (recorded as ``order``). Each run's decode seconds
   come with the seconds of its first steps per slot prefix (compile + capture): lease 2026-12-05's prefill-graphs
   A/B spent 42.4 s in decode *on* (run first) against 12.5 s *off*, and the order could not be told from the setting.

7. Decode rows A/B (``--batch-ab ROWS``): after the main run, the main input again at ROWS decode rows, compared with
   the main run as in 5 (tokens/s with and without first steps, answers, near-ties); out of memory at ROWS is
   reported. The 1,024-row decode step was bound by its number of kernels (lease 2026-12-02c), so more rows a step
   may raise tokens/s on the 17K config: ``--batch-ab 2048`` (~112 GiB of KV cache for SmolLM2 at 2,560 columns).

6b. Packed prefill A/B (``--prefill-pack-ab N``): as 6 with ``prompts.regen_prefill_pack`` on then off (off: the
   padded forwards): each forward's prompts back to back in one power-of-two stream, no padding between rows, the
   stream shapes captured as CUDA graphs at their second use (``eagle3/regen/packed_prefill.py``).

8. Prefill probe (``--prefill-probe``): the eager prefill forward timed at fixed rows x width shapes, host dispatch
   against completion, tokens/s and matmul TFLOP/s, beside the main run's own prefill rate: whether the 17K run's
   prefill (15.7 s in 357 forwards, lease 2026-12-04) is bound by launches or by work, i.e. what a cheaper prefill
   (packed, compiled, graphed) could save.

CPU smoke (tests/bench/test_regen_speed.py): ``--set verifier.path=<tiny> --num 6 --baseline-num 4``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from eagle3.cli import non_negative_int, positive_int, run_main  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.data.readers import short_pool_warning  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text  # noqa: E402

log = logging.getLogger(__name__)


def spread(records: list, num: int) -> list:
    """``num`` records at evenly spaced positions (all of them when ``num >= len(records)``)."""
    if num >= len(records):
        return list(records)
    return [records[i * len(records) // num] for i in range(num)]


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_bandwidth(dev, gib: float) -> float | None:
    """Device memory bandwidth in bytes/s: a ``gib`` GiB device-to-device copy (bytes read + written / time),
    best of 5 after a warm-up. None on CPU (no roofline there)."""
    import torch

    if dev.type != "cuda":
        return None
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        _sync(dev)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / best


def read_input(cfg, prompts: Path | None) -> list[dict]:
    """The conversations stage 01 would regenerate (:func:`eagle3.regen.selection.select_conversations` on the
    config's sources, as answered by the verifier: prompt-only records kept, no self-instruct prompts) or a file's
    (``--prompts``: read and deduped, not sampled)."""
    from eagle3.data.readers import dedupe, read_conversations
    from eagle3.regen.selection import select_conversations

    pc = cfg.prompts
    if prompts:
        convs = read_conversations(
            str(prompts),
            "auto",
            hf_split=pc.hf_split,
            keep_prompt_only=True,
            system_prompt=pc.system_prompt,
            think_tags=tuple(cfg.verifier.think_tags),
        )
        return dedupe(convs)[0] if pc.dedupe else convs
    bench_prompts = pc.model_copy(update={"regenerate": True, "self_instruct": None})
    return select_conversations(
        bench_prompts, cfg.verifier.think_tags, cfg.self_instruct_path, None
    )[0]


def timed_run(
    model,
    tok,
    convs,
    engine: str,
    cfg,
    batch_size: int,
    max_new: int,
    opts_kw: dict,
    label: str | None = None,
) -> tuple[list, dict]:
    """One :func:`regenerate` call, synchronised around; returns (conversations, stats with ``seconds``,
    ``tokens_per_s``). Prints one line, ``<label or engine>: N conversations, ...``."""
    from eagle3.chat.template import ChatOptions
    from eagle3.regen.regenerate import regenerate
    from eagle3.stages.prompts_manifest import max_context_tokens

    dev = next(model.parameters()).device
    st: dict = {}
    _sync(dev)
    t0 = time.perf_counter()
    out = regenerate(
        model,
        tok,
        convs,
        max_new,
        batch_size,
        stats=st,
        opts=ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
        max_context=max_context_tokens(cfg),
        schedule=cfg.prompts.gen_schedule,
        engine=engine,
        engine_options=opts_kw.get(engine),
    )
    _sync(dev)
    st["seconds"] = time.perf_counter() - t0
    st["tokens_per_s"] = st["new_tokens"] / st["seconds"]
    if dev.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    print(
        f"{label or engine}: {len(convs)} conversations, {st['answers']} answers, {st['new_tokens']} tokens in "
        f"{st['seconds']:.1f} s ({st['tokens_per_s']:.0f} tokens/s)",
        flush=True,
    )
    return out, st


def first_turns(convs: list[dict]) -> list[dict]:
    """Each conversation cut after its first user turn (a system message before it kept): one answer each."""
    out = []
    for c in convs:
        k = next(
            (i for i, m in enumerate(c["messages"]) if m["role"] == "user"), len(c["messages"]) - 1
        )
        out.append({**c, "messages": c["messages"][: k + 1]})
    return out


def warm_up(
    model, tok, convs, engine: str, cfg, batch_size: int, max_new: int, opts_kw: dict
) -> None:
    """The unmeasured warm-up before the main run (kernels, allocator): the first turn of the first
    ``min(8, batch_size)`` conversations at ``min(8, max_new)`` new tokens, uncompiled (an 8-slot compile would be a
    cold compile no later run reuses). Kept within the run's own batch and answer sizes: on the 2-core CPU an
    8-row, all-turns warm-up cost as long as a 4-conversation main run (61 s), and its line read like a result."""
    warm_kw = {**opts_kw, "slots": {**opts_kw["slots"], "compile_step": False}}
    rows = min(8, batch_size)
    timed_run(
        model,
        tok,
        first_turns(convs[:rows]),
        engine,
        cfg,
        rows,
        min(8, max_new),
        warm_kw,
        label="warm-up (not measured)",
    )


def bandwidth_text(bandwidth_gb_s: float | None, device: str) -> str:
    """The bandwidth clause of a table's title: ``HBM bandwidth 4335 GB/s (device copy)``, or, without a measured
    bandwidth (:func:`measure_bandwidth` is None off CUDA), that it and so the roofline are unknown on ``device``
    (it read ``HBM bandwidth 0 GB/s`` on the CPU)."""
    if not bandwidth_gb_s:
        return (
            f"memory bandwidth unknown on {device} (measured by a device copy on CUDA only), so no roofline: "
            f"not applicable"
        )
    return f"HBM bandwidth {bandwidth_gb_s:.0f} GB/s (device copy)"


def roofline(st: dict, weight_bytes: int, bandwidth: float | None) -> dict | None:
    """The main run's roofline figures (needs the slot engine's ``engine_stats`` and a bandwidth in bytes/s), or None
    (JSON null) without them: no bandwidth known on the device (CPU), or an engine that does not count its KV."""
    es = st.get("engine_stats") or {}
    if not bandwidth or "kv_tokens_needed" not in es:
        return None
    kv = es["kv_tokens_needed"] * es["kv_bytes_per_token"]
    need = st["decode_steps"] * weight_bytes + kv
    return {
        "bytes_needed": need,
        "kv_bytes_needed": kv,
        "kv_bytes_read": es["kv_bytes_read"],
        "kv_read_over_needed": es["kv_bytes_read"] / kv if kv else None,
        "roofline_s": need / bandwidth,
        "ratio_to_roofline": need / bandwidth / st["seconds"],
        "attention": es.get("attention"),
        "prefix_steps": es.get("prefix_steps"),
        "decode_s": es.get("decode_s"),
        "prefill_s": es.get("prefill_s"),
        "seconds": st["seconds"],
        "ms_per_decode_step": 1000 * st["seconds"] / max(1, st["decode_steps"]),
        "roofline_ms_per_step": 1000 * need / bandwidth / max(1, st["decode_steps"]),
        # the first step of each slot prefix (compile + graph capture; host seconds within decode_s): a fixed cost
        # per run (lease 2026-12-03b: 7.30 ms a decode window step at 17K, 5.40 ms at 100K, compiled both)
        "first_step_s": sum((es.get("first_step_s") or {}).values())
        if "first_step_s" in es
        else None,
        # prefill: forwards, prompt tokens and rows x padded width (their ratio: the padding overhead)
        "prefill_calls": es.get("prefill_calls"),
        "prefill_tokens": es.get("prefill_tokens"),
        "prefill_padded_tokens": es.get("prefill_padded_tokens"),
        # cross-turn prefix reuse (prompts.regen_prefix_reuse): prompt tokens whose K/V the previous turn left
        "reused_tokens": es.get("reused_tokens"),
        "prefix_reuse": es.get("prefix_reuse"),
        # bucketed prefill forwards as CUDA graphs (prompts.regen_prefill_graphs)
        "prefill_graphs": es.get("prefill_graphs"),
        "prefill_graph_captures": es.get("prefill_graph_captures"),
    }


def step_ms(
    model,
    slots: int,
    width: int,
    max_new: int,
    graphs: bool,
    reps: int = 20,
    attention: str = "auto",
) -> float:
    """Milliseconds of one slot-engine decode step with every slot live near column ``width`` (sdpa_groups: one
    group reading ``width`` columns; flex: every row reads its blocks up to its length ~ ``width``)."""
    import torch

    from eagle3.regen.slots import SlotEngine

    eng = SlotEngine(
        model,
        slots,
        width,
        min(max_new, width // 2),
        {0},
        width_classes=[],
        cuda_graphs=graphs,
        attention=attention,
    )
    try:
        with torch.inference_mode():
            eng._partition()  # nothing waiting: one group of every slot at the full width
            eng.done.fill_(False)
            eng.lengths.fill_(max(0, width - reps - 2))
            eng._first_step(
                eng.S
            )  # capture / warm-up (an auto engine may leave the flex path here)
            step = eng._graph_step if eng.use_graphs else eng._step
            _sync(eng.dev)
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            _sync(eng.dev)
            return 1000 * (time.perf_counter() - t0) / reps
    finally:
        eng.close()
        if eng.dev.type == "cuda":
            torch.cuda.empty_cache()


def bound(model, st: dict, cfg, batch_size: int, max_new: int, bandwidth: float | None) -> dict:
    """Launch floor (column bound of one width_step) vs a full-cache step vs the measured step. ``verdict``:
    ``launch-bound`` when the floor is at least 0.6 of the measured step, else ``memory-bound`` where a bandwidth is
    known (bytes/s; its share of a full-cache step is given), or ``not launch-bound (memory bandwidth unknown)``."""
    from eagle3.stages.prompts_manifest import max_context_tokens

    es = st.get("engine_stats") or {}
    max_len = max_context_tokens(cfg) + max_new
    graphs = cfg.prompts.regen_cuda_graphs
    att = cfg.prompts.regen_attention
    small = step_ms(model, batch_size, 256, max_new, graphs, attention=att)
    full = step_ms(model, batch_size, max_len, max_new, graphs, attention=att)
    measured = 1000 * st["seconds"] / max(1, st["decode_steps"])
    full_bytes = batch_size * max_len * es.get("kv_bytes_per_token", 0)
    out = {
        "step_ms_launch_floor": small,
        "step_ms_full_cache": full,
        "step_ms_measured": measured,
        "floor_share_of_measured": small / measured,
        "verdict": "launch-bound"
        if small >= 0.6 * measured
        else "memory-bound"
        if bandwidth
        else "not launch-bound (memory bandwidth unknown)",
    }
    if bandwidth and full_bytes:
        out["full_cache_step_bandwidth_share"] = full_bytes / (full / 1000) / bandwidth
    return out


PROBE_SHAPES = ((1, 128), (16, 512), (64, 512), (8, 2048), (32, 2048), (128, 512))


def sync_sites(fn) -> list[str]:
    """The Python lines at which ``fn()`` ran a CUDA operation that synchronises the host with the device
    (``torch.cuda.set_sync_debug_mode("warn")``: torch warns at each one, from the calling line), as sorted unique
    ``file:line`` strings; ``[]`` without CUDA (the mode exists only there). The mode is restored afterwards."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        return []
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})


def prefill_probe(model, shapes=PROBE_SHAPES, reps: int = 5, seed: int = 0) -> dict:
    """Time the slot engine's eager prefill forward (``SlotEngine._prefill``, fresh prompts, no cached prefix) at
    ``rows x width`` shapes of random prompt tokens: is stage 01's prefill bound by its launches or by its work?

    Per shape, ``reps`` forwards after one warm-up, each after a sync: ``host_ms`` the call's own wall time (the
    host's dispatch; on the CPU the whole forward), ``device_ms`` until a sync after it (the forward's completion).
    A forward whose ``host_ms`` is most of its ``device_ms`` is launch-bound (the GPU waits for the host); one whose
    ``device_ms`` grows with its tokens while ``host_ms`` stays flat is bound by its work.

    Returns:
        ``{"linear_params": N, "rows": [{"rows", "width", "tokens", "host_ms", "device_ms", "tokens_per_s",
        "linear_tflops"}, ...], "sync_sites": [...]}``: medians over the reps; ``linear_tflops`` = 2 x
        ``linear_params`` (the decoder's weights less the embeddings) x tokens/s / 1e12, the matmul work alone
        (attention excluded); ``sync_sites``: where one more forward at the last shape synchronised the host
        (:func:`sync_sites`; lease 2026-12-05b measured host time = device time at every shape, cause unknown).
    """
    import torch

    from eagle3.regen.slot_policy import Waiting
    from eagle3.regen.slots import SlotEngine

    dev = next(model.parameters()).device
    emb = {
        id(p)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        for p in m.parameters()
    }
    linear = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    g = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    out = []
    eng = SlotEngine(
        model,
        max(r for r, _ in shapes),
        max(w for _, w in shapes) + 2,
        1,
        {-1},
        width_classes=[],
        cuda_graphs=False,
        prefill_tokens=max(r * w for r, w in shapes),
    )
    try:
        with torch.inference_mode():
            for rows, width in shapes:
                ids = torch.randint(
                    0, vocab, (rows, width), generator=g
                ).tolist()  # [P, W] random prompts
                reqs = [Waiting((), i, x) for i, x in enumerate(ids)]
                host, device = [], []
                for k in range(reps + 1):
                    _sync(dev)
                    t0 = time.perf_counter()
                    eng._prefill(reqs, list(range(rows)), width)
                    t1 = time.perf_counter()
                    _sync(dev)
                    if k:  # the first forward of a shape warms it up
                        host.append(t1 - t0)
                        device.append(time.perf_counter() - t0)
                eng._timed.clear()
                h, d = statistics.median(host), statistics.median(device)
                out.append(
                    {
                        "rows": rows,
                        "width": width,
                        "tokens": rows * width,
                        "host_ms": 1000 * h,
                        "device_ms": 1000 * d,
                        "tokens_per_s": rows * width / d,
                        "linear_tflops": 2 * linear * rows * width / d / 1e12,
                    }
                )
            sites = sync_sites(
                lambda: eng._prefill(reqs, list(range(rows)), width)
            )  # the last shape's inputs
            eng._timed.clear()
    finally:
        eng.close()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"linear_params": linear, "rows": out, "sync_sites": sites}


def probe_markdown(pp: dict, rf: dict) -> list[str]:
    """Lines of the prefill probe's table, and the main run's own prefill rate beside it (``rf``: :func:`roofline`)."""
    lines = [
        "",
        f"Prefill probe: the eager prefill forward at fixed shapes (random prompts; matmul work = 2 x "
        f"{pp['linear_params'] / 1e6:.1f}M decoder weights a token):",
        "",
        "| rows x width | tokens | host ms (dispatch) | device ms | host / device | tokens/s | matmul TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in pp["rows"]:
        lines.append(
            f"| {r['rows']} x {r['width']} | {r['tokens']} | {r['host_ms']:.1f} | {r['device_ms']:.1f} | "
            f"{r['host_ms'] / r['device_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['linear_tflops']:.1f} |"
        )
    if pp.get("sync_sites"):
        lines += [
            "",
            "Host syncs in one prefill forward (`torch.cuda.set_sync_debug_mode`): "
            + ", ".join(f"`{x}`" for x in pp["sync_sites"])
            + ".",
        ]
    if rf.get("prefill_padded_tokens") and rf.get("prefill_s"):
        lines += [
            "",
            f"The main run's prefill: {rf['prefill_padded_tokens']} padded tokens in {rf['prefill_s']:.1f} s "
            f"of {rf['prefill_calls']} forwards = {rf['prefill_padded_tokens'] / rf['prefill_s']:.0f} tokens/s, "
            f"{1000 * rf['prefill_s'] / max(1, rf['prefill_calls']):.1f} ms a forward.",
        ]
    return lines


def tie_tolerance(cfg, model) -> float:
    """The logit gap under which a differing token counts as a near-tie: ``benchmark.tie_tolerance``, by default
    the verifier dtype's (0.25 in bf16, as 05 counts them)."""
    from eagle3.decoding.metrics import default_tie_tolerance

    t = cfg.benchmark.tie_tolerance
    return t if t is not None else default_tie_tolerance(next(model.parameters()).dtype)


def compare(model, tok, cfg, ours: list, theirs: list, tie_tol: float, limit: int = 200) -> dict:
    """Answers of two runs on the same conversations: identical turns, and for each conversation's first
    differing turn the logit gap between the two tokens at the first differing position."""
    import torch

    from eagle3.chat.template import ChatOptions, generation_prompt
    from eagle3.regen.regenerate import stop_token_ids

    opts, stops, dev = (
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
        sorted(stop_token_ids(tok)),
        next(model.parameters()).device,
    )
    same = total = 0
    gaps = []
    for c, d in zip(ours, theirs):
        for j, (m, n) in enumerate(zip(c["messages"], d["messages"])):
            if "tokens" not in m or "tokens" not in n:
                continue
            total += 1
            if m["tokens"] == n["tokens"]:
                same += 1
                continue
            if len(gaps) < limit:
                a, b = m["tokens"], n["tokens"]
                k = next(
                    i
                    for i in range(min(len(a), len(b)) + 1)
                    if i == min(len(a), len(b)) or a[i] != b[i]
                )
                ids = tok(
                    generation_prompt(tok, c["messages"][:j], opts, c.get("tools")),
                    add_special_tokens=False,
                )["input_ids"]
                with torch.inference_mode():
                    logits = (
                        model(torch.tensor([ids + a[:k]], device=dev), logits_to_keep=1)
                        .logits[0, -1]
                        .float()
                    )
                pick = lambda t, k=k: logits[t[k]] if k < len(t) else logits[stops].max()  # noqa: E731
                gaps.append(abs(float(pick(a) - pick(b))))
            break  # later turns see different histories
    return {
        "answers_compared": total,
        "identical": same,
        "differing_first_turns_checked": len(gaps),
        "near_ties": sum(g <= tie_tol for g in gaps),
        "tie_tolerance": tie_tol,
        "max_gap": max(gaps, default=None),
        "gaps": sorted(gaps)[-20:],
    }


def _steady_ratio(on: dict, off: dict) -> Optional[float]:
    """on/off tokens/s without each run's first decode steps per slot prefix (their compile + capture): an engine whose
    cache has other shapes (``prefill_graphs`` adds a scratch row) compiles its decode step anew, cold in Inductor's
    cache, while the other run may find the main run's kernels warm. None where a run recorded no first steps."""
    if on.get("first_step_s") is None or off.get("first_step_s") is None:
        return None
    a, b = on["seconds"] - on["first_step_s"], off["seconds"] - off["first_step_s"]
    return (on["new_tokens"] / a) / (off["new_tokens"] / b) if a > 0 and b > 0 else None


def ab_summary(ab: dict, names: str = "on/off") -> str:
    """The line under an A/B table (:func:`ab_compare`'s keys; ``names`` says which run is over which): the tokens/s
    and prefill-seconds ratios and how many answers were identical, with the near-ties among the first differences
    when they were checked."""
    ratio = f"{ab['prefill_s_ratio']:.3f}x" if ab["prefill_s_ratio"] is not None else "n/a"
    steady = (
        f" ({ab['steady_speed_ratio']:.3f}x without each run's first decode steps)"
        if ab.get("steady_speed_ratio") is not None
        else ""
    )
    return (
        f"{names}: tokens/s {ab['speed_ratio']:.3f}x{steady}, prefill seconds {ratio}; "
        f"{ab['identical']} of {ab['answers_compared']} answers identical"
        + (
            f"; {ab['near_ties']} of {ab['differing_first_turns_checked']} first differences are near-ties "
            f"(logit gap <= {ab['tie_tolerance']}), max gap {ab['max_gap']}."
            if "near_ties" in ab
            else "."
        )
    )


def markdown(res: dict) -> str:
    """The figures as Markdown tables."""
    m, rf = res["main"], res.get("roofline") or {}
    lines = [
        f"Stage 01 regeneration, {res['verifier']} ({res['dtype']}) on {res['device']}: {m['conversations']} "
        f"conversations, batch {res['batch_size']}, max_new_tokens {res['max_new_tokens']}, context cap "
        f"{res['max_context']}; {bandwidth_text(res['bandwidth_gb_s'], res['device'])}.",
        "",
        "| run | engine | conversations | answers | tokens | seconds | tokens/s | decode steps |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [("main", m)] + [
        (f"subset {k}", v) for k, v in res.get("baseline", {}).get("runs", {}).items()
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['engine']} | {r['conversations']} | {r['answers']} | {r['new_tokens']} | "
            f"{r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {r['decode_steps']} |"
        )
    if rf:
        lines += [
            "",
            "| roofline | value |",
            "|---|---:|",
            f"| ratio to roofline | {rf['ratio_to_roofline']:.3f} |",
            f"| ms / decode step (measured, all work) | {rf['ms_per_decode_step']:.2f} |",
            f"| ms / decode step (roofline) | {rf['roofline_ms_per_step']:.2f} |",
            f"| KV read / KV needed ({rf.get('attention', 'column bound')}) | {rf['kv_read_over_needed']:.2f} |",
        ]
        if rf.get("decode_s") is not None:
            lines.append(
                f"| seconds: decode steps / prefill forwards / rest of the run (device time) | "
                f"{rf['decode_s']:.1f} / {rf['prefill_s']:.1f} / {rf['seconds'] - rf['decode_s'] - rf['prefill_s']:.1f} |"
            )
        if rf.get("prefill_tokens"):
            lines.append(
                f"| prefill: forwards / prompt tokens / padded tokens (padding overhead) | {rf['prefill_calls']} / "
                f"{rf['prefill_tokens']} / {rf['prefill_padded_tokens']} "
                f"({rf['prefill_padded_tokens'] / rf['prefill_tokens']:.2f}x) |"
            )
        if rf.get("reused_tokens") is not None:
            lines.append(
                f"| prompt tokens: prefilled / reused from the previous turn's KV (prefix reuse "
                f"{'on' if rf['prefix_reuse'] else 'off'}) | {rf['prefill_tokens']} / {rf['reused_tokens']} |"
            )
        if rf.get("first_step_s") is not None:
            rest = rf["seconds"] - rf["first_step_s"]
            lines.append(
                f"| seconds of first steps per prefix (compile + capture, within decode) / tokens/s without "
                f"them | {rf['first_step_s']:.1f} / {m['new_tokens'] / rest if rest > 0 else 0:.0f} |"
            )
        if rf.get("prefix_steps"):
            lines += [
                "",
                "Decode steps per slot prefix: "
                + ", ".join(
                    f"{n}: {c}"
                    for n, c in sorted(rf["prefix_steps"].items(), key=lambda x: -int(x[0]))
                )
                + ".",
            ]
    ab = res.get("prefix_reuse_ab")
    if ab:
        lines += [
            "",
            f"Prefix reuse on / off, slots engine, {ab['conversations']} conversations:",
            "",
            "| prefix reuse | seconds | tokens/s | prefill s | decode s (first steps) | prompt tokens prefilled | "
            "reused |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ab.get("order", ("on", "off")):
            r = ab[name]
            lines.append(
                f"| {name} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {r['prefill_s']:.2f} | "
                f"{r['decode_s']:.2f}{_first(r)} | {r['prefill_tokens']} | {r['reused_tokens']} |"
            )
        lines += ["", ab_summary(ab)]
    for key, (title, what) in PREFILL_ABS.items():
        if res.get(key):
            lines += prefill_ab_markdown(res[key], title, what)
    ba = res.get("batch_ab")
    if ba:
        small, big = ba["sizes"]
        lines += [
            "",
            f"Decode rows {big} against the main run's {small} (`--batch-ab {big}`), slots engine, the main "
            f"input ({ba['conversations']} conversations):",
            "",
        ]
        if "error" in ba:
            lines.append(f"{big} rows: {ba['error']}")
        else:
            lines += [
                "| decode rows | seconds | tokens/s | decode steps | prefill s | decode s (first steps) |",
                "|---:|---:|---:|---:|---:|---:|",
            ]
            for size in (small, big):
                r = ba["runs"][str(size)]
                lines.append(
                    f"| {size} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {r['decode_steps']} | "
                    f"{r['prefill_s']:.2f} | {r['decode_s']:.2f}{_first(r)} |"
                )
            lines += ["", ab_summary(ba, f"{big}/{small} rows")]
    if res.get("prefill_probe"):
        lines += probe_markdown(res["prefill_probe"], rf)
    b = res.get("bound")
    if b:
        lines += [
            "",
            f"Bound: **{b['verdict']}** (decode step {b['step_ms_launch_floor']:.2f} ms at a 256-column "
            f"bound, {b['step_ms_full_cache']:.2f} ms over the full cache, {b['step_ms_measured']:.2f} ms "
            "measured per step).",
        ]
    bl = res.get("baseline", {})
    if bl.get("ratios"):
        lines += [
            "",
            "Speed ratios on the subset: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in bl["ratios"].items())
            + ".",
        ]
    if bl.get("equality"):
        e = bl["equality"]
        lines += [
            "",
            f"{res['main_engine']} vs static: {e['identical']} of {e['answers_compared']} answers identical; "
            f"{e['near_ties']} of {e['differing_first_turns_checked']} first differences are near-ties "
            f"(logit gap <= {e['tie_tolerance']}), max gap {e['max_gap']}.",
        ]
    return "\n".join(lines) + "\n"


def _row(st: dict, engine: str, n: int) -> dict:
    keep = (
        "answers",
        "new_tokens",
        "truncated",
        "seconds",
        "tokens_per_s",
        "decode_steps",
        "batches",
        "engine_stats",
    )
    return {"engine": engine, "conversations": n, **{k: st[k] for k in keep if k in st}}


def baselines(model, tok, cfg, convs, a, batch_size, max_new, opts_kw) -> dict:
    """The subset runs: main engine, static, hf_continuous; ratios and the main-vs-static answer comparison."""
    import torch

    sub = spread(convs, a.baseline_num)
    runs, outs = {}, {}
    for eng in dict.fromkeys([a.main_engine, "static"]):
        outs[eng], st = timed_run(model, tok, sub, eng, cfg, batch_size, max_new, opts_kw)
        runs[eng] = _row(st, eng, len(sub))
    if a.hf_num:
        hf_sub = spread(sub, a.hf_num)
        try:
            _, st = timed_run(
                model,
                tok,
                hf_sub,
                "hf_continuous",
                cfg,
                min(batch_size, len(hf_sub)),
                max_new,
                opts_kw,
            )
            runs["hf_continuous"] = _row(st, "hf_continuous", len(hf_sub))
        except Exception as e:  # noqa: BLE001 - a library failure is a result too; the bench goes on
            runs["hf_continuous"] = {
                "engine": "hf_continuous",
                "error": f"{type(e).__name__}: {e}"[:500],
            }
            print(f"hf_continuous failed: {runs['hf_continuous']['error']}", flush=True)
    ratios = {
        f"{a.main_engine}/static": runs[a.main_engine]["tokens_per_s"]
        / runs["static"]["tokens_per_s"]
    }
    if "tokens_per_s" in runs.get("hf_continuous", {}):
        ratios[f"{a.main_engine}/hf_continuous"] = (
            runs[a.main_engine]["tokens_per_s"] / runs["hf_continuous"]["tokens_per_s"]
        )
    eq = (
        compare(model, tok, cfg, outs[a.main_engine], outs["static"], tie_tolerance(cfg, model))
        if a.main_engine != "static"
        else None
    )
    del outs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"conversations": len(sub), "runs": runs, "ratios": ratios, "equality": eq}


def _first(row: dict) -> str:
    """`` (x.x)``: an A/B row's seconds of first decode steps per slot prefix, or nothing where not recorded."""
    return f" ({row['first_step_s']:.1f})" if row.get("first_step_s") is not None else ""


def reuse_ab(
    model, tok, cfg, convs, batch_size: int, max_new: int, opts_kw: dict, off_first: bool = False
) -> dict:
    """The slots engine on ``convs`` twice, cross-turn prefix reuse on then off (``prompts.regen_prefix_reuse``),
    same process: seconds, tokens/s, device seconds of prefill and decode, prompt tokens prefilled and reused, the
    on/off ratios, and how many answers are identical (fp32: all; bf16: batch compositions differ, so near-ties may
    flip). Differences are counted as :func:`compare` counts them: for each conversation's first differing turn,
    the logit gap between the two runs' tokens at the first differing position, teacher-forced on the verifier
    (``near_ties``: gaps within ``tie_tolerance``; ``max_gap``; ``gaps``: the 20 largest)."""
    return setting_ab(
        model, tok, cfg, convs, batch_size, max_new, opts_kw, "prefix_reuse", off_first
    )


def prefill_graphs_ab(
    model, tok, cfg, convs, batch_size: int, max_new: int, opts_kw: dict, off_first: bool = False
) -> dict:
    """The slots engine on ``convs`` twice, bucketed prefill forwards captured as CUDA graphs on then off
    (``prompts.regen_prefill_graphs``), same process: as :func:`reuse_ab`, with the prefill forwards (``prefill_calls``),
    the prefill graphs captured and the host seconds their capture took (``prefill_graph_captures``,
    ``prefill_capture_s``; 0 on the CPU, where the bucketed forwards run eagerly), the padded prefill tokens
    (bucket padding included) and the forwards per bucket (``prefill_buckets``) of each run."""
    return setting_ab(
        model, tok, cfg, convs, batch_size, max_new, opts_kw, "prefill_graphs", off_first
    )


# the prefill-layout A/Bs: result key -> (table title, what the setting does)
PREFILL_ABS = {
    "prefill_graphs_ab": ("Prefill graphs", "bucketed prefill forwards as CUDA graphs"),
    "prefill_pack_ab": (
        "Packed prefill",
        "each forward's prompts back to back in one stream, FlexAttention "
        "document mask, stream shapes captured as CUDA graphs at their second use",
    ),
}
PREFILL_FIELDS = (
    "prefill_padded_tokens",
    "prefill_graph_captures",
    "prefill_capture_s",
    "prefill_buckets",
    "prefill_first_s",
)


def prefill_ab_markdown(pg: dict, title: str, what: str) -> list[str]:
    """Markdown lines of a prefill-layout A/B (:data:`PREFILL_ABS`): per run seconds, tokens/s, prefill seconds,
    forwards, ms a forward, decode seconds (first steps), prompt tokens prefilled / padded (fed with padding), graphs
    captured (capture seconds), then the answer comparison."""
    lines = [
        "",
        f"{title} on / off ({what}), slots engine, {pg['conversations']} conversations:",
        "",
        f"| {title.lower()} | seconds | tokens/s | prefill s | prefill forwards | ms / forward | "
        "decode s (first steps) | prompt tokens prefilled / padded | graphs captured (capture s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in pg.get("order", ("on", "off")):
        r = pg[name]
        lines.append(
            f"| {name} | {r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {r['prefill_s']:.2f} | "
            f"{r['prefill_calls']} | {1000 * r['prefill_s'] / max(1, r['prefill_calls']):.1f} | "
            f"{r['decode_s']:.2f}{_first(r)} | {r['prefill_tokens']} / {r['prefill_padded_tokens']} | "
            f"{r['prefill_graph_captures']} ({r['prefill_capture_s']:.2f}) |"
        )
    first = {
        name: sum((pg[name].get("prefill_first_s") or {}).values())
        for name in pg.get("order", ("on", "off"))
    }
    if any(first.values()):
        lines += [
            "",
            "First forward at each packed shape (compile on CUDA; inside prefill s): "
            + ", ".join(
                f"{name} {len(pg[name]['prefill_first_s'])} shapes in {v:.2f} s"
                for name, v in first.items()
                if v
            )
            + ".",
        ]
    if pg.get("on", {}).get("prefill_pack") is False:
        lines += ["", "The packed path failed in the *on* run and it went on padded (see its log)."]
    return lines + ["", ab_summary(pg)]


def prefill_pack_ab(
    model, tok, cfg, convs, batch_size: int, max_new: int, opts_kw: dict, off_first: bool = False
) -> dict:
    """The slots engine on ``convs`` twice, packed prefill on then off (``prompts.regen_prefill_pack``; off: the
    padded forwards), same process: as :func:`prefill_graphs_ab`, and ``prefill_pack`` per run (False where the
    packed path failed and the run went on padded). Both runs share the decode cache's shape (packing needs no
    scratch row), so the compiled decode step of the first serves the second."""
    return setting_ab(
        model, tok, cfg, convs, batch_size, max_new, opts_kw, "prefill_pack", off_first
    )


def setting_ab(
    model,
    tok,
    cfg,
    convs,
    batch_size: int,
    max_new: int,
    opts_kw: dict,
    option: str,
    off_first: bool = False,
) -> dict:
    """The slots engine on ``convs`` with its keyword ``option`` (a speed setting: ``prefix_reuse``,
    ``prefill_graphs``, ``prefill_pack``) True, then False (``off_first``: False, then True; the order is recorded as ``order``); the
    runs' figures under ``on`` / ``off``, the on/off ratios and the answer comparison (:func:`reuse_ab` describes
    them). Each run's ``first_step_s`` is the seconds of its decode steps that were the first at a slot prefix
    (compile + CUDA graph capture, inside ``decode_s``): lease 2026-12-05's prefill-graphs A/B, *on* first, spent
    42.4 s in decode against 12.5 s, and the order could not be told from the setting."""
    rows, outs = {}, {}
    order = (("off", False), ("on", True)) if off_first else (("on", True), ("off", False))
    for name, on in order:
        kw = {**opts_kw, "slots": {**opts_kw["slots"], option: on}}
        outs[name], st = timed_run(model, tok, convs, "slots", cfg, batch_size, max_new, kw)
        es = st["engine_stats"]
        rows[name] = ab_row(st)
        if option in ("prefill_graphs", "prefill_pack"):
            rows[name].update({k: es.get(k) for k in PREFILL_FIELDS + (option,)})
        print(
            f"{option} {name}: prompt tokens prefilled {es['prefill_tokens']}, reused {es['reused_tokens']}, "
            f"prefill forwards {es['prefill_calls']} in {es['prefill_s']:.2f} s, decode {es['decode_s']:.2f} s"
            + (
                f", {es.get('prefill_graph_captures')} prefill graphs captured in {es.get('prefill_capture_s', 0):.2f} s"
                if option != "prefix_reuse"
                else ""
            ),
            flush=True,
        )
    return {
        "conversations": len(convs),
        "order": [name for name, _ in order],
        **rows,
        **ab_compare(model, tok, cfg, outs["on"], outs["off"], rows["on"], rows["off"]),
    }


def ab_row(st: dict) -> dict:
    """One A/B run's figures from :func:`timed_run`'s stats (slots engine): seconds, tokens/s, new tokens, prefill /
    decode device seconds, prefill forwards and tokens, reused tokens, decode steps, and ``first_step_s``: the
    seconds of its decode steps that were the first at a slot prefix (compile + CUDA graph capture, inside
    ``decode_s``; None where the engine records none)."""
    es = st["engine_stats"]
    return {
        "seconds": st["seconds"],
        "tokens_per_s": st["tokens_per_s"],
        "new_tokens": st["new_tokens"],
        "prefill_s": es["prefill_s"],
        "decode_s": es["decode_s"],
        "prefill_calls": es["prefill_calls"],
        "prefill_tokens": es["prefill_tokens"],
        "reused_tokens": es["reused_tokens"],
        "decode_steps": st["decode_steps"],
        "first_step_s": sum((es.get("first_step_s") or {}).values())
        if "first_step_s" in es
        else None,
    }


def ab_compare(model, tok, cfg, out_a: list, out_b: list, row_a: dict, row_b: dict) -> dict:
    """Run A against run B on the same conversations: every answer pair (``answers_compared``, ``identical``), each
    conversation's first differing turn with the logit gap at its first differing token (:func:`compare`; its own
    counts stop at that turn, as later turns see different histories: kept under ``*_to_first_difference``), and
    the A/B ratios of tokens/s (``speed_ratio``), of tokens/s without first steps (``steady_speed_ratio``) and of
    prefill seconds (``prefill_s_ratio``)."""
    pairs = [
        (m.get("tokens"), n.get("tokens"))
        for c, d in zip(out_a, out_b)
        for m, n in zip(c["messages"], d["messages"])
        if "tokens" in m and "tokens" in n
    ]
    eq = compare(model, tok, cfg, out_a, out_b, tie_tolerance(cfg, model))
    eq["answers_compared_to_first_difference"] = eq.pop("answers_compared")
    eq["identical_to_first_difference"] = eq.pop("identical")
    return {
        **eq,
        "answers_compared": len(pairs),
        "identical": sum(a == b for a, b in pairs),
        "speed_ratio": row_a["tokens_per_s"] / row_b["tokens_per_s"],
        "steady_speed_ratio": _steady_ratio(row_a, row_b),
        "prefill_s_ratio": row_a["prefill_s"] / row_b["prefill_s"] if row_b["prefill_s"] else None,
    }


def batch_ab(
    model,
    tok,
    cfg,
    convs,
    main_out: list,
    main_st: dict,
    batch_size: int,
    other: int,
    max_new: int,
    opts_kw: dict,
) -> dict:
    """The main input again at ``other`` decode rows (``prompts.gen_batch_size``), after the main run at
    ``batch_size`` (slots engine, same process; each size compiles its own decode step, cold for a size the Inductor
    cache has not seen). Lease 2026-12-02c found the 1,024-row step bound by its number of kernels, not its bytes, so
    more rows a step may be more tokens a second, until the KV cache (rows x context x 2 x layers x KV width x 2
    bytes: ~112 GiB for SmolLM2 at 2,048 rows x 2,560 columns) fills the GPU. Returns ``{"sizes": [batch_size,
    other], "conversations", "runs": {str(size): ab_row}, ...}`` with :func:`ab_compare` of ``other`` against
    ``batch_size``; an out-of-memory at ``other`` is a result (``error``), not a crash."""
    import torch

    from eagle3.regen.kv_cache import KVCacheTooLarge

    res = {"sizes": [batch_size, other], "conversations": len(convs)}
    try:
        out, st = timed_run(model, tok, convs, "slots", cfg, other, max_new, opts_kw)
    except (
        torch.OutOfMemoryError,
        KVCacheTooLarge,
    ) as e:  # the engine's own check, or the allocator's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {
            **res,
            "error": f"{type(e).__name__} at {other} rows: {str(e).splitlines()[0][:300]}",
        }
    rows = {str(batch_size): ab_row(main_st), str(other): ab_row(st)}
    return {
        **res,
        "runs": rows,
        **ab_compare(model, tok, cfg, out, main_out, rows[str(other)], rows[str(batch_size)]),
    }


def emit(a, res: dict, md: str) -> int:
    """Print the Markdown table; write ``--json`` / ``--md`` when given (atomically). Returns 0."""
    print(md, end="")
    if a.json:
        atomic_write_json(a.json, res)
    if a.md:
        atomic_write_text(a.md, md)
    return 0


def main(argv=None) -> int:
    from eagle3.cli import ArgumentParser

    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", default=str(ROOT / "configs" / "smollm2-135m-full.yaml"))
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="a conversations file instead of the config's sources",
    )
    p.add_argument(
        "--num",
        type=positive_int,
        default=None,
        help="conversations of the main run, spread (default: all)",
    )
    p.add_argument(
        "--baseline-num",
        type=non_negative_int,
        default=1024,
        help="subset for the baselines (0 = none)",
    )
    p.add_argument(
        "--hf-num", type=non_negative_int, default=128, help="hf_continuous subset (0 = skip it)"
    )
    p.add_argument("--main-engine", default="slots", choices=("slots", "hf_continuous", "static"))
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="default: prompts.gen_batch_size"
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=None, help="default: prompts.max_new_tokens"
    )
    p.add_argument(
        "--reuse-ab",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also run the slots engine on N conversations of the main input (spread) with cross-turn "
        "prefix reuse on, then off (0 = skip)",
    )
    p.add_argument(
        "--prefill-graphs-ab",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also run the slots engine on N conversations of the main input (spread) with bucketed prefill "
        "forwards captured as CUDA graphs (prompts.regen_prefill_graphs) on, then off (0 = skip)",
    )
    p.add_argument(
        "--prefill-pack-ab",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="also run the slots engine on N conversations of the main input (spread) with packed prefill "
        "(prompts.regen_prefill_pack) on, then off (0 = skip)",
    )
    p.add_argument(
        "--batch-ab",
        type=positive_int,
        default=None,
        metavar="ROWS",
        help="after the main run, the main input again at ROWS decode rows (prompts.gen_batch_size), "
        "compared with the main run (tokens/s, answers); out of memory is reported, not raised",
    )
    p.add_argument(
        "--ab-off-first",
        action="store_true",
        help="the A/B runs (--reuse-ab, --prefill-graphs-ab, --prefill-pack-ab) run the setting off first, "
        "then on",
    )
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth probe copy")
    p.add_argument("--no-bound", action="store_true", help="skip the decode-step bound probe")
    p.add_argument(
        "--prefill-probe",
        action="store_true",
        help="also time the eager prefill forward at fixed rows x width shapes (host dispatch vs device)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    a = p.parse_args(argv)
    if a.batch_ab and a.main_engine != "slots":
        p.error(
            "--batch-ab compares the slots engine at two batch sizes: use it with --main-engine slots"
        )
    cfg = load_config(a.config, a.overrides)

    import torch

    from eagle3.regen.engine_choice import engine_options
    from eagle3.stages.prompts_manifest import max_context_tokens
    from eagle3.verifier.load import load_verifier

    batch_size, max_new = (
        a.batch_size or cfg.prompts.gen_batch_size,
        a.max_new_tokens or cfg.prompts.max_new_tokens,
    )
    convs = read_input(cfg, a.prompts)
    main_convs = spread(convs, a.num) if a.num else convs
    short = short_pool_warning("--num", a.num, len(convs), "conversations in the input")
    if short:
        log.warning("%s", short)
    model, tok = load_verifier(cfg.verifier)
    dev = next(model.parameters()).device
    opts_kw = {
        e: engine_options(cfg.prompts.model_copy(update={"regen_engine": e}))
        for e in ("slots", "hf_continuous")
    }
    bw = measure_bandwidth(dev, a.copy_gib)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    warm_up(model, tok, main_convs, a.main_engine, cfg, batch_size, max_new, opts_kw)
    main_out, st = timed_run(
        model, tok, main_convs, a.main_engine, cfg, batch_size, max_new, opts_kw
    )
    res = {
        "verifier": cfg.verifier.display_name(),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "source": str(a.prompts or cfg.prompts.source),
        "batch_size": batch_size,
        "max_new_tokens": max_new,
        "max_context": max_context_tokens(cfg),
        "main_engine": a.main_engine,
        "bandwidth_gb_s": bw / 1e9 if bw else None,
        "weight_bytes": weight_bytes,
        "main": _row(st, a.main_engine, len(main_convs)),
        "roofline": roofline(st, weight_bytes, bw),
    }
    if a.main_engine == "slots" and not a.no_bound:
        res["bound"] = bound(model, st, cfg, batch_size, max_new, bw)
    if a.prefill_probe:
        res["prefill_probe"] = prefill_probe(model)
    if a.batch_ab:
        res["batch_ab"] = batch_ab(
            model, tok, cfg, main_convs, main_out, st, batch_size, a.batch_ab, max_new, opts_kw
        )
    if a.reuse_ab:
        res["prefix_reuse_ab"] = reuse_ab(
            model,
            tok,
            cfg,
            spread(main_convs, a.reuse_ab),
            batch_size,
            max_new,
            opts_kw,
            a.ab_off_first,
        )
    if a.prefill_graphs_ab:
        res["prefill_graphs_ab"] = prefill_graphs_ab(
            model,
            tok,
            cfg,
            spread(main_convs, a.prefill_graphs_ab),
            batch_size,
            max_new,
            opts_kw,
            a.ab_off_first,
        )
    if a.prefill_pack_ab:
        res["prefill_pack_ab"] = prefill_pack_ab(
            model,
            tok,
            cfg,
            spread(main_convs, a.prefill_pack_ab),
            batch_size,
            max_new,
            opts_kw,
            a.ab_off_first,
        )
    if a.baseline_num:
        res["baseline"] = baselines(model, tok, cfg, convs, a, batch_size, max_new, opts_kw)
    return emit(a, res, markdown(res))


if __name__ == "__main__":
    run_main(main)
