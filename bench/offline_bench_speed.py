"""Benchmark: wall time of the batched offline benchmark (05) and EAGLE-3 vs greedy tokens/s per batch size.

For one prompt set (default MT-bench, ``benchmark.num_prompts`` or 80 prompts x 256 new tokens, chain of 3 draft
tokens) and each
``--batch-sizes`` value, runs exactly what ``05_benchmark.py`` runs (:func:`eagle3.decoding.offline.bench_prompts`:
batched greedy baseline, batched EAGLE-3 checked token for token against it, both in the same run)
and prints:

- ``wall_s``: seconds for the whole set at that batch size (greedy + EAGLE-3 + checks), the figure
  of issue 9 item 4 (goal <= 60 s for 80 x 256 on one H200, SmolLM2-135M, 3 steps);
- greedy and EAGLE-3 tokens/s and their ratio (``speedup``), ``tau``, per-position acceptance;
- ``drafter_share``: drafter time / (drafter + verify time) of the EAGLE-3 steps (device time
  between CUDA events): where EAGLE-3 does not pay for a small verifier, this says why;
- lossless check: differences from greedy within / beyond the near-tie tolerance, with logit gaps.

The headline batch size (``--headline-batch-size``; default ``benchmark.batch_size`` when listed,
else the largest) decodes the whole set: its ``wall_s`` is ``bench_{N}x{T}_s``. Every other batch
size decodes only ``max(batch, --prompts-per-batch-size)`` prompts (tokens/s needs no
80 prompts, and one prompt at a time is the slow case). Which prompts a subset holds is ``--pick`` (default
``benchmark.prompt_pick``): ``spread`` takes them evenly over the set, ``first`` the first N. MT-bench is stored in
category order, so its first 8 prompts are all *writing*: the batch-1 figures of leases 2026-12-03d..04e (8 first
prompts) are writing-only; the JSON records ``prompt_pick`` and ``prompt_ids``. Without a trained drafter,
``--random-drafter`` measures the machinery alone (tau ~1, speedup not meaningful). ``--decoder`` picks
``benchmark.decoder`` per row: ``--batch-sizes 1 --decoder static batched`` measures batch 1 with the static
decoder (static caches, CUDA graphs: :mod:`eagle3.decoding.static_decode`) and the batched one in the same run.

    python bench/offline_bench_speed.py --config configs/smollm2-135m-full.yaml --set verifier.path=$EAGLE3_GGUF_DIR \\
        --drafter outputs/smollm2-135m-full/drafter-sglang --batch-sizes 1 8 32 80 --json bench/results/offline_bench_speed.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, run_main  # noqa: E402
from eagle3.config import add_config_args, load_config  # noqa: E402
from eagle3.decoding.checks import TRAIN_META  # noqa: E402
from eagle3.decoding.metrics import default_tie_tolerance, speedup_warning  # noqa: E402
from eagle3.decoding.offline import bench_prompts, effective_batch_size, warm_up  # noqa: E402
from eagle3.decoding.report import json_safe  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json  # noqa: E402
from eagle3.stages.benchmark import (  # noqa: E402
    check_before_load,
    load_checked_drafter,
    resolve_drafter_dir,
)

log = logging.getLogger("offline_bench_speed")


def _random_drafter(verifier, device, dtype, drafter_cfg=None):
    """An untrained drafter of the verifier's shape (identity draft vocab of min(32000, V) ids), with the run config's
    ``drafter`` section applied when given (``drafter_cfg``: :class:`eagle3.settings.drafter.DrafterConfig`; its non-null shape
    fields, ``variant`` and ``num_layers``), so a speed figure is of the drafter the config trains: a second layer
    or a wider MLP costs draft time (lease 2026-12-04e: a second layer took the drafter's share of a batch-80 step from
    0.15 to 0.21)."""
    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.mla import mla_drafter_fields
    from eagle3.drafter.model import Eagle3Drafter

    cfg = (
        verifier.config.get_text_config()
        if hasattr(verifier.config, "get_text_config")
        else verifier.config
    )
    # every drafter.* field that is set (variant and num_layers always are); null ones come from the verifier; an
    # MLA layer's sizes as 04 resolves them (eagle3.drafter.mla)
    over = (
        {}
        if drafter_cfg is None
        else {
            f: getattr(drafter_cfg, f)
            for f in type(drafter_cfg).model_fields
            if getattr(drafter_cfg, f) is not None and f != "mla"
        }
    )
    if over.get("attention") == "mla":
        heads = over.get("num_attention_heads") or cfg.num_attention_heads
        over.update(mla_drafter_fields(drafter_cfg.mla.model_dump(), heads, cfg))
    args = DrafterArgs.from_hf_config(cfg, draft_vocab_size=min(32000, int(cfg.vocab_size)), **over)
    torch.manual_seed(0)
    d = Eagle3Drafter(args, verifier.get_input_embeddings().weight.detach().float().cpu())
    return d.to(device=device, dtype=dtype).eval()


def _row(d: dict) -> dict:
    """One row of the sweep from a :func:`~eagle3.decoding.offline.bench_prompts` result; ``batch_size`` is the
    effective one (``min(--batch-sizes entry, prompts)``)."""
    keys = (
        "num_prompts",
        "wall_seconds",
        "greedy_tokens",
        "greedy_seconds",
        "greedy_tokens_per_s",
        "spec_tokens",
        "spec_seconds",
        "spec_tokens_per_s",
        "speedup",
        "tau",
        "verify_steps",
        "conditional",
        "unconditional",
        "accepted_hist",
        "draft_seconds",
        "verify_seconds",
        "drafter_share",
        "rounds",
        "near_ties",
        "failures",
        "mismatches",
        "tie_tolerance",
        "decoder",
        "warm_up_seconds",
    )
    return {"batch_size": d["batch_size"], **{k: d[k] for k in keys}}


def markdown(res: dict) -> str:
    def f(x, nd=2):
        return "n/a" if x is None or x != x else f"{x:.{nd}f}"

    lines = [
        f"# Offline benchmark speed: {res['verifier']} on {res['device_name']} ({res['dtype']})",
        "",
        f"{res['dataset']}, {res['max_new_tokens']} new tokens, chain of {res['steps']}, drafter `{res['drafter']}`",
        "",
        "| batch | decoder | prompts | wall s | greedy tok/s | EAGLE-3 tok/s | speedup | tau | drafter share | near-ties | failures |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['batch_size']} | {r['decoder']} | {r['num_prompts']} | failed: {r['error'][:120]} |"
                + " |" * 7
            )
            continue
        lines.append(
            f"| {r['batch_size']} | {r.get('decoder', 'batched')} | {r['num_prompts']} | {f(r['wall_seconds'], 1)} | {f(r['greedy_tokens_per_s'], 1)} | "
            f"{f(r['spec_tokens_per_s'], 1)} | {f(r['speedup'])}x | {f(r['tau'])} | {f(r['drafter_share'])} | "
            f"{r['near_ties']} | {r['failures']} |"
        )
    lines += [
        "",
        f"bench_{res['num_prompts']}x{res['max_new_tokens']}_s (batch {res['headline_batch_size']}): "
        f"**{f(res['bench_set_s'], 1)} s**",
    ]
    return "\n".join(lines) + "\n"


def _row_subset(
    label: str, everything: list, prompts: list, ids: list, n: int, pick: str
) -> tuple[list, list[str]]:
    """The ``n`` prompts a batch size below the headline decodes (``pick`` over the headline's ``prompts`` / their
    ``ids``), and the warning when they leave out categories of the whole set ``everything`` (``--pick``'s hint)."""
    from eagle3.data.eval_prompts import pick_prompts, subset_warnings

    chosen = pick_prompts(list(zip(prompts, ids)), n, pick)
    notes = subset_warnings(label, everything, [p for p, _ in chosen], pick, "--pick")
    for w in notes:
        log.warning("%s", w)
    return [i for _, i in chosen], notes


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--drafter", help="exported drafter folder (default: cfg.export_dir)")
    p.add_argument(
        "--random-drafter", action="store_true", help="untrained drafter: machinery speed only"
    )
    p.add_argument(
        "--dataset", default="mtbench", help="mtbench, humaneval, gsm8k or a JSONL prompt file"
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        help="prompts of the set (default: benchmark.num_prompts, else 80)",
    )
    p.add_argument(
        "--prompts-per-batch-size",
        type=int,
        default=8,
        help="batch sizes other than the headline decode max(batch, this) prompts, picked by --pick",
    )
    p.add_argument(
        "--pick",
        choices=["first", "spread"],
        help="which prompts a subset holds: 'spread' = evenly over the set (MT-bench: every category), "
        "'first' = the first N (default: benchmark.prompt_pick)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 80])
    p.add_argument(
        "--headline-batch-size",
        type=int,
        help="batch size of the 'whole set' figure (default: benchmark.batch_size if listed, else the largest)",
    )
    p.add_argument(
        "--tie-tolerance",
        type=float,
        help="near-tie tolerance in logits (default: benchmark.tie_tolerance or the dtype's)",
    )
    p.add_argument(
        "--decoder",
        nargs="+",
        choices=["auto", "batched", "static"],
        help="benchmark.decoder, one row per batch size and decoder (default: the config's); 'static' = batch-1 "
        "static caches + CUDA graphs (batch sizes > 1 skip it); e.g. --batch-sizes 1 --decoder static batched",
    )
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if a.json and Path(a.json).is_dir():  # found before minutes of measuring, not at the write
        p.error(f"--json {a.json}: is a folder; give a file path")
    if a.headline_batch_size is not None and a.headline_batch_size < 1:
        p.error("--headline-batch-size must be >= 1")
    if (
        min(a.batch_sizes) < 1
        or min(
            1 if a.num_prompts is None else a.num_prompts,
            a.max_new_tokens,
            a.steps,
            a.prompts_per_batch_size,
        )
        < 1
    ):
        p.error(
            "--batch-sizes, --num-prompts, --prompts-per-batch-size, --max-new-tokens and --steps must be >= 1"
        )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(a.config, a.overrides)
    asked = (
        a.num_prompts or cfg.benchmark.num_prompts
    )  # None: the default 80, not warned about on a smaller set
    a.num_prompts = asked or 80

    from eagle3.chat.template import ChatOptions, end_of_turn_ids, prompt_ids
    from eagle3.data.eval_prompts import (
        check_dataset_names,
        dataset_label,
        load_eval_prompts,
        pick_prompts,
        subset_warnings,
        too_few_note,
    )
    from eagle3.engines.layers import check_aux_layers, default_aux_layers
    from eagle3.verifier.load import load_verifier, resolve_device, verifier_dims

    check_dataset_names([a.dataset], "--dataset", indexed=False)  # before the verifier loads
    ddir = None if a.random_drafter else resolve_drafter_dir(cfg, a.drafter)
    # 05's checks of the drafter's and the shards' metadata (each logged), then those that need the verifier
    drafter_notes, not_checked = (
        ([], []) if ddir is None else check_before_load(cfg, ddir, a.steps, "--steps")
    )

    device = resolve_device(cfg.verifier.device)
    vcfg = cfg.verifier
    if device.type == "cpu" and vcfg.dtype != "float32":
        vcfg = vcfg.model_copy(update={"dtype": "float32"})
    verifier, tok = load_verifier(vcfg, device)
    dtype = next(verifier.parameters()).dtype
    n_layers = verifier_dims(verifier.config)["num_layers"]
    if ddir is None:
        drafter, drafter_name = (
            _random_drafter(verifier, device, dtype, cfg.drafter),
            "random (untrained)",
        )
        aux = cfg.extract.aux_layers or default_aux_layers(n_layers)
    else:  # as 05 loads it: aux layers against the shards', the recorded verifier, vocab map, shape, chat template
        drafter, aux, late, unchecked = load_checked_drafter(cfg, ddir, verifier, tok, device)
        for w in late:
            log.warning("%s", w)
        drafter_notes, not_checked = drafter_notes + late, not_checked + unchecked
        drafter_name = str(ddir)
    aux = check_aux_layers(aux, n_layers, field=f"{TRAIN_META}: aux_layers")
    tol = a.tie_tolerance if a.tie_tolerance is not None else cfg.benchmark.tie_tolerance
    tol = default_tie_tolerance(dtype) if tol is None else tol
    eos = sorted(end_of_turn_ids(tok))
    pick = a.pick or cfg.benchmark.prompt_pick
    everything = load_eval_prompts(
        a.dataset
    )  # the whole set, read once: the subsets and their warnings
    prompts = pick_prompts(everything, a.num_prompts, pick)
    subset_notes = subset_warnings(dataset_label(a.dataset), everything, prompts, pick, "--pick")
    short = too_few_note(dataset_label(a.dataset), asked, len(everything), verb="measured")
    subset_notes = ([short] if short else []) + subset_notes
    for w in subset_notes:
        log.warning("%s", w)
    chat = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    ids = [(q.id, prompt_ids(tok, q.messages, chat)) for q in prompts]
    headline = a.headline_batch_size or (
        cfg.benchmark.batch_size
        if cfg.benchmark.batch_size in a.batch_sizes
        else max(a.batch_sizes)
    )
    if headline not in a.batch_sizes:
        raise UserError(
            f"--headline-batch-size {headline} is not one of --batch-sizes {a.batch_sizes}"
        )
    res = {
        "verifier": cfg.verifier.display_name(),
        "drafter": drafter_name,
        "dataset": dataset_label(a.dataset),
        "num_prompts": len(ids),
        "max_new_tokens": a.max_new_tokens,
        "steps": a.steps,
        "aux_layers": list(aux),
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tie_tolerance": tol,
        "headline_batch_size": headline,
        "prompt_pick": pick,
        "prompt_ids": [i for i, _ in ids],
        "warnings": drafter_notes + subset_notes,
        "not_checked": not_checked,
        "command": " ".join(
            [Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))
        ),
        "rows": [],
    }
    warm = ids[0][1]
    from eagle3.decoding.static_decode import resolve_decoder

    for b in a.batch_sizes:
        subset, row_notes = (
            (ids, [])
            if b == headline
            else _row_subset(
                res["dataset"], everything, prompts, ids, max(b, a.prompts_per_batch_size), pick
            )
        )
        warm_up(verifier, drafter, warm, aux, a.steps, eos, min(b, len(subset)))
        ran = []
        for dec in a.decoder or [cfg.benchmark.decoder]:
            if dec == "static" and b != 1:
                continue
            mode = resolve_decoder(dec, b, device)
            if mode in ran:
                continue
            ran.append(mode)
            t0 = time.perf_counter()
            try:
                d = bench_prompts(
                    verifier,
                    drafter,
                    subset,
                    aux,
                    a.steps,
                    a.max_new_tokens,
                    eos,
                    res["dataset"],
                    batch_size=b,
                    tie_tolerance=tol,
                    decoder=mode,
                )
            except (
                RuntimeError,
                ValueError,
            ) as e:  # one decoder failing (e.g. on a new device) keeps the others' rows
                eff = effective_batch_size(b, len(subset))
                log.error("batch %d (%s decoder) failed: %s: %s", eff, mode, type(e).__name__, e)
                row = {
                    "batch_size": eff,
                    "decoder": mode,
                    "num_prompts": len(subset),
                    "error": f"{type(e).__name__}: {e}",
                }
            else:
                log.info(
                    "batch %d (%s decoder): %d prompts in %.1f s (greedy %.1f tok/s, EAGLE-3 %.1f tok/s, speedup "
                    "%.2fx, tau %.2f, drafter share %.2f, near-ties %d, failures %d)",
                    d["batch_size"],
                    mode,
                    len(subset),
                    time.perf_counter() - t0,
                    d["greedy_tokens_per_s"],
                    d["spec_tokens_per_s"],
                    d["speedup"],
                    d["tau"],
                    d["drafter_share"],
                    d["near_ties"],
                    d["failures"],
                )
                row = _row(d)
                above = speedup_warning(
                    f"{res['dataset']} batch {d['batch_size']} ({mode} decoder)",
                    d["speedup"],
                    d["tau"],
                )  # a ratio tau cannot give: the greedy baseline was slowed
                if above:
                    log.warning("%s", above)
                    row_notes = [*row_notes, above]
            row.update(prompt_ids=[i for i, _ in subset], warnings=row_notes)
            res["rows"].append(row)
            if a.json:  # after every row: a run cut short keeps what it measured
                atomic_write_json(a.json, json_safe(res))
    head_b = effective_batch_size(headline, len(ids))
    head = next((r for r in res["rows"] if r["batch_size"] == head_b and "error" not in r), None)
    res["bench_set_s"] = (
        head["wall_seconds"] if head is not None and head["num_prompts"] == len(ids) else None
    )
    res[f"bench_{len(ids)}x{a.max_new_tokens}_s"] = res["bench_set_s"]
    print(markdown(res))
    print(json.dumps(json_safe({k: v for k, v in res.items() if k != "rows"}), indent=1))
    if a.json:
        atomic_write_json(a.json, json_safe(res))
    failed = [f"batch {r['batch_size']} {r['decoder']}" for r in res["rows"] if "error" in r]
    if failed:
        log.error("rows that failed: %s (their errors are in the rows)", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
