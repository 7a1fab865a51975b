"""Benchmark: stage-04 training throughput of the SmolLM2 drafter, old fixed-batch loop vs token-budget loop.

Every mode runs the real trainer, ``eagle3.stages.train.run``, on the same shards (data loading, targets,
TTT forward/backward, AdamW, logging), for ``--steps`` optimizer steps each, in one process:

- ``legacy8``: the loop as issue 9 measured it (14K tokens/s on an H200): ``batch_size`` 8 padded to
  the longest sample, 2 loader workers, verifier targets and draft logits at every position
  (``eagle3.losses.ttt.ttt_loss``; the collate output without ``loss_pos``, which selects that path), logit
  checkpointing, and torch's default SDPA backend (cuDNN on Hopper, which builds a plan per new shape;
  ``eagle3.stages.train.run`` now turns it off).
- ``fixed8``: ``batch_size`` 8 with today's loop (host-indexed loss rows, auto loader workers).
- ``tokens``: ``train.batch_tokens`` token-budget micro-batches (``--batch-tokens``, default 16384).

A mode may carry ``+nock`` (``train.checkpoint_logits=off``) or ``+compile`` (``train.compile=true``), e.g.
``--modes legacy8,tokens,tokens+nock``.

``+fp8`` (issue 13: fp8 shards must not train slower): the same mode on the SAME samples stored as fp8
(``eagle3-fp8-v1``, e4m3 + per-token fp32 scales), made from the bf16 shards by the project's converter
(``eagle3.shards.convert.convert``) into ``--fp8-shards`` (default ``WORKDIR/shards-fp8``; a folder that
already holds that conversion, e.g. ``convert_shards.py``'s output, is reused as is). The trainer then
reads 1-byte features + scales and dequantises on the device (``eagle3.shards.fp8.dequantize_batch``); the
split, vocab map, seed and steps are the bf16 mode's. ``--modes tokens,tokens+fp8`` reports each
mode's tokens/s and loader tokens/s, ``fp8_vs_bf16_tokens_per_s`` (fp8 / bf16; issue 13 asks >= 1),
``fp8_vs_bf16_loader_tokens_per_s``, and both first-step losses (equal up to fp8 rounding).
A ``+fp8`` mode without its own ``--steps`` entry runs the steps of its bf16 mode.

``--rounds N`` runs the mode list N times, reversing the order every other round (A B, B A, ...), and
reports per mode the median tokens/s, loader tokens/s and step time (per-round figures under ``rounds``;
``fp8_vs_bf16_tokens_per_s_rounds`` pairs the runs of each round): for machines shared with other jobs.

Throughput = real (non-pad) tokens / seconds over the log windows after the first (``--log-every``
steps each; the first window holds start-up and allocator warm-up), read from ``metrics.jsonl``
(``window_tokens``, ``window_s``). Validation and checkpoint writes are not inside the windows.
It also prints the wall time that the issue-9 run (4 epochs of 1.74M tokens = 6.96M tokens; 498 s
measured, the published trainer 320 s) would take at each mode's rate.

Data: synthetic SmolLM2-shaped shards written to ``--workdir`` (hidden 576, vocab 49152, draft vocab
32000; lengths = a log-normal prompt of median 60 tokens + a reply of 16..256 tokens, cut at
``--max-length`` 1024; mean about 290 tokens like the issue's data), or a real prepared run with
``--config`` (after stages 02 and 03; its ``train`` section is overridden per mode, outputs go to
``--workdir``). Drafter: SmolLM2 shape (H 576, 9 heads, 3 KV heads, head dim 64, I 1536), TTT 7.

H200 (torch 2.11; pydantic from the project's wheels, see bench/train_throughput.py)::

    python3 bench/small_train_speed.py --json $OUT/small_train_speed.json          # ~4 min
    python3 bench/small_train_speed.py --config RUN.yaml --set verifier.path=... --json $OUT/real.json
    python3 bench/small_train_speed.py --modes tokens,tokens+fp8 --steps tokens=150 --json $OUT/fp8.json  # ~3 min

CPU smoke run (tiny shapes, a minute)::

    python bench/small_train_speed.py --tiny --device cpu --json /tmp/sts.json
    python bench/small_train_speed.py --tiny --device cpu --modes tokens,tokens+fp8 --json /tmp/sts-fp8.json
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.cli import ArgumentParser, positive_int, run_main  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_json, make_dirs  # noqa: E402

ISSUE_RUN_TOKENS = 4 * 1.74e6  # issue 9: 4 epochs over 1.74M tokens
ISSUE_OURS_S, ISSUE_REFERENCE_S = 498.0, 320.0
SMOL = {
    "hidden": 576,
    "vocab": 49152,
    "draft_vocab": 32000,
    "heads": 9,
    "kv_heads": 3,
    "head_dim": 64,
    "intermediate": 1536,
    "ttt": 7,
}
TINY = {
    "hidden": 32,
    "vocab": 256,
    "draft_vocab": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "intermediate": 48,
    "ttt": 3,
}


# ---------------------------------------------------------------------------------------------
# synthetic data
# ---------------------------------------------------------------------------------------------
def synthetic_lengths(n: int, max_length: int, seed: int) -> list[tuple[int, int]]:
    """``(prompt, reply)`` token counts: prompt ~ exp(N(ln 60, 1)) clipped to [4, max_length - 16], reply ~ U[16, 256]."""
    g = torch.Generator().manual_seed(seed)
    prompt = (
        torch.exp(torch.randn(n, generator=g) + math.log(60)).clamp(4, max_length - 16).long()
    )  # [n]
    reply = torch.randint(16, 257, (n,), generator=g)  # [n]
    return [(int(p), int(min(r, max_length - p))) for p, r in zip(prompt, reply)]


def _write_many(args) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
    """Write a slice of the synthetic shards: the speculators-v1 dict of ``eagle3.shards.format.write_sample``,
    saved with plain ``torch.save`` (no per-file fsync: benchmark data, not a crash-safe stage output).
    Returns ``([(idx, L, reply tokens)], loss-token counts int64 [vocab])``."""
    from eagle3.shards.format import shard_path

    torch.set_num_threads(1)
    root, jobs, hidden, vocab = args
    out, freq = [], torch.zeros(vocab, dtype=torch.int64)  # [V]
    for idx, prompt, reply in jobs:
        g = torch.Generator().manual_seed(1000 + idx)
        L = prompt + reply
        ids = torch.randint(0, vocab, (L,), generator=g)  # [L]
        mask = torch.cat(
            [torch.zeros(prompt, dtype=torch.long), torch.ones(reply, dtype=torch.long)]
        )  # [L]
        hs = [torch.randn(L, hidden, generator=g).bfloat16() for _ in range(4)]  # 4 x [L, H]
        path = shard_path(root, idx, 2000)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "hidden_states": hs, "loss_mask": mask}, path)
        out.append((idx, L, reply))
        freq += torch.bincount(ids[prompt:], minlength=vocab)  # loss tokens: the reply
    return out, freq


def _record_validated(
    shards: Path, data: Path, done: list[tuple[int, int, int]], freq: torch.Tensor
) -> None:
    """Stage 03's passing validation record for the synthetic set (valid by construction; 04 trains only on a
    shard set with one: ``eagle3.data.validation_record.require_passed``). ``freq``: int64 ``[V]``."""
    from eagle3.data.validation_record import fingerprint_now, write_record

    stats = {
        "num_samples": len(done),
        "num_tokens": sum(L for _, L, _ in done),
        "num_loss_tokens": sum(r for *_, r in done),
        "max_len": max(L for _, L, _ in done),
    }
    write_record([shards, data], fingerprint_now(shards), stats, freq)


def write_synthetic(
    root: Path, n: int, n_val: int, shape: dict, max_length: int, seed: int = 0
) -> Path:
    """Shards + manifest + data_config + vocab map + split + target head + run YAML under ``root``; returns the YAML."""
    import yaml

    from eagle3.data.vocab import save_vocab_map
    from eagle3.shards.format import FORMAT, LAYER_INDEX_CONVENTION, write_data_config
    from eagle3.shards.manifest import MANIFEST
    from eagle3.train.target_head import TargetHead

    shards, data = root / "shards", root / "data"
    H, V, dV = shape["hidden"], shape["vocab"], shape["draft_vocab"]
    lens = synthetic_lengths(n + n_val, max_length, seed)
    workers = max(1, min(16, (os.cpu_count() or 2)))
    todo = [(i, p, r) for i, (p, r) in enumerate(lens)]
    with ProcessPoolExecutor(workers) as ex:
        parts = list(
            ex.map(_write_many, [(shards, todo[k::workers], H, V) for k in range(workers)])
        )
    done = sorted(x for part, _ in parts for x in part)
    (shards / MANIFEST).write_text(
        "".join(
            json.dumps({"idx": i, "id": f"s{i}", "num_tokens": L, "num_loss_tokens": r}) + "\n"
            for i, L, r in done
        )
    )
    write_data_config(
        shards,
        {
            "format": FORMAT,
            "verifier": "synthetic-smollm2",
            "architecture": "LlamaForCausalLM",
            "num_layers": 30,
            "hidden_size": H,
            "vocab_size": V,
            "aux_layers": [2, 15, 27],
            "layer_index_convention": LAYER_INDEX_CONVENTION,
            "last_hidden_state": "post_norm",
            "dtype": "bfloat16",
            "max_length": max_length,
            "rows_per_dir": 2000,
            "chat_template_hash": None,
            "config_fingerprint": "x",
            "prompts_sha256": "x",
            "num_samples": n + n_val,
            "num_tokens": sum(L for _, L, _ in done),
            "num_loss_tokens": sum(r for *_, r in done),
            "bytes_per_token": 8 * H,
            "skipped": {},
        },
    )
    _record_validated(shards, data, done, sum(f for _, f in parts))
    g = torch.Generator().manual_seed(seed)
    data.mkdir(parents=True, exist_ok=True)
    ids = torch.randperm(V, generator=g)[:dV].sort().values  # [dV]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    save_vocab_map(data / "vocab_map.pt", ids - torch.arange(dV), t2d)
    (data / "split.json").write_text(
        json.dumps({"train": list(range(n)), "val": list(range(n, n + n_val))})
    )
    head_dir = root / "head"
    head_dir.mkdir(parents=True, exist_ok=True)
    TargetHead(
        embed=torch.randn(V, H, generator=g) * 0.05,
        lm_head=torch.randn(V, H, generator=g) * 0.05,
        norm_weight=torch.ones(H),
        norm_eps=1e-5,
    ).save(head_dir)
    cfg = {
        "run_name": "small-train-speed",
        "output_root": str(root),
        "verifier": {"path": str(root / "no-verifier"), "name": "synthetic-smollm2"},
        "prompts": {"source": "unused.jsonl"},
        "extract": {"max_length": max_length},
        "drafter": {
            "hidden_size": H,
            "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["kv_heads"],
            "head_dim": shape["head_dim"],
            "intermediate_size": shape["intermediate"],
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
        },
        "data": {"draft_vocab_size": dV},
        "train": {"ttt_length": shape["ttt"], "lr": 1e-3},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------------------------------------
# fp8 copy of the shards (issue 13)
# ---------------------------------------------------------------------------------------------
FP8 = "fp8"  # the mode flag: train on the fp8 copy of the shards


def mode_flags(mode: str) -> list[str]:
    """The ``+`` flags of a mode name (``"tokens+nock+fp8"`` -> ``["nock", "fp8"]``)."""
    return mode.split("+")[1:]


def bf16_mode(mode: str) -> str:
    """The mode without its ``+fp8`` flag (the bf16 run it is compared with)."""
    return "+".join(x for x in mode.split("+") if x != FP8)


def make_fp8_shards(src: Path, dst: Path, overwrite: bool) -> dict:
    """Store the bf16 shard set ``src`` as fp8 in ``dst`` with the project's converter.

    Uses :func:`eagle3.shards.convert.convert` with ``Storage("float8_e4m3fn")`` (per-token fp32 scales,
    the stage-02 default), so the benchmark trains on exactly what ``convert_shards.py`` writes. A
    ``dst`` that already holds this conversion is resumed (nothing to do when complete).

    Args:
        src: bf16 (speculators-v1) stage-02 folder.
        dst: output folder.
        overwrite: redo a different earlier conversion in ``dst`` instead of refusing it.

    Returns:
        the converter's summary (``samples``, ``converted``, ``ratio`` of file bytes, ``seconds``...).

    Raises:
        UserError: ``src`` is already fp8 (nothing to compare against), or the converter's errors
            (a different conversion in ``dst`` without ``overwrite``, corrupt source, disk full).
    """
    from eagle3.shards.convert import convert
    from eagle3.shards.format import read_data_config
    from eagle3.shards.fp8 import Storage

    if Storage.from_meta(read_data_config(src)).is_fp8:
        raise UserError(
            f"{src / 'data_config.json'}: storage_dtype is already float8_e4m3fn; '+{FP8}' modes need "
            "bf16 shards to compare against"
        )
    return convert(src, dst, Storage("float8_e4m3fn"), overwrite=overwrite)


def carry_validation(src: Path, dst: Path, data_dir: Path) -> Path:
    """Give the converted copy ``dst`` of ``src`` 03's passing validation record of ``src`` (same samples: the
    converter checked the source's checksums and keeps ``input_ids`` / ``loss_mask``; only the hidden states'
    storage differs), so 04 trains on it without a second 03 over the data dir's vocab map and split.

    Raises:
        UserError: ``src`` has no passing record of its current shards (run 03 on it first).
    """
    from eagle3.data.validation_record import (
        fingerprint_now,
        load_matching_record,
        require_passed,
        write_record,
    )
    from eagle3.shards.format import read_data_config

    require_passed(src, data_dir)
    hit = load_matching_record(
        [src, data_dir], fingerprint_now(src), int(read_data_config(src)["vocab_size"])
    )
    if hit is None:
        raise UserError(
            f"{src}: no usable validation record of 03 (see the warnings above); run 03_prepare_data.py"
        )
    stats, freq = hit[0], hit[1]
    return write_record([dst, data_dir], fingerprint_now(dst), stats, freq)


# ---------------------------------------------------------------------------------------------
# one mode
# ---------------------------------------------------------------------------------------------
def _legacy_collate(items):
    from eagle3.data.dataset import collate

    out = collate(items)
    out.pop("loss_pos")  # no loss rows: eagle3.stages.train takes the dense ttt_loss path
    return out


def loader_rate(cfg, batches: int) -> dict:
    """Data loading alone, as ``eagle3.stages.train`` sets it up for ``cfg`` (workers, pinning): real tokens/s over
    ``batches`` micro-batches after the first, and one process's ``ShardDataset[i]`` time per sample."""
    from eagle3.data.dataset import ShardDataset, read_split
    from eagle3.shards.format import expect_from_data_config, read_data_config
    from eagle3.train.order import TrainData as _TrainData
    from eagle3.train.ranks import DistInfo

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = read_data_config(cfg.shards_dir)
    ds = ShardDataset(
        cfg.shards_dir,
        read_split(cfg.data_dir)["train"],
        int(meta["max_length"]),
        expect_from_data_config(meta),
    )
    t0 = time.perf_counter()
    n = min(100, len(ds))
    for i in range(n):
        ds[i]
    per_sample_ms = 1e3 * (time.perf_counter() - t0) / n
    t = cfg.train
    data = _TrainData(
        ds,
        DistInfo(rank=0, world=1, local_rank=0, device=dev),
        batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        batch_tokens=t.batch_tokens,
        seed=t.seed,
        epochs=t.epochs,
        num_workers=t.num_workers,
        shards_dir=cfg.shards_dir,
        split_file=cfg.data_dir / "split.json",
    )
    it = data.iterate(0, 0)
    next(it)
    t0, toks, got, feat = time.perf_counter(), 0, 0, None
    for b in it:
        feat = feat or str(b["aux"].dtype).removeprefix(
            "torch."
        )  # what crosses to the device (fp8 shards: 1 byte)
        toks += int(b["lengths"].sum())
        got += 1
        if got >= batches:
            break
    secs = time.perf_counter() - t0
    it = None
    return {
        "loader_tokens_per_s": toks / secs,
        "loader_batches": got,
        "sample_load_ms": per_sample_ms,
        "num_workers": data.loader.num_workers,
        "loader_feature_dtype": feat,
        "storage_dtype": meta.get("storage_dtype", "bfloat16"),
    }


def run_mode(
    mode: str,
    config: Path,
    overrides: list[str],
    workdir: Path,
    steps: int,
    batch_tokens: int,
    log_every: int,
    device: str | None,
    head_dir: Path | None,
    fp8_dir: Path | None = None,
) -> dict:
    """Train ``steps`` optimizer steps in ``mode``; returns throughput figures from its metrics.jsonl.

    A ``+fp8`` mode reads its shards from ``fp8_dir`` (:func:`make_fp8_shards`); everything else is the config's.
    """
    import shutil

    import eagle3.stages.train as train_mod
    from eagle3.config import load_config
    from eagle3.export.from_checkpoint import export_for_run

    out = workdir / f"train-{mode.replace('+', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if head_dir is not None:
        shutil.copy(head_dir / "target_head.safetensors", out / "target_head.safetensors")
    base_mode, *flags = mode.split("+")
    ov = list(overrides) + [
        f"train.output_dir={out}",
        f"export.output_dir={workdir / ('export-' + mode.replace('+', '-'))}",
        f"train.log_every={log_every}",
        "train.ckpt_every=1000000000",
        "train.eval_every=1000000000",
        "train.epochs=1000",
    ]
    if base_mode == "tokens":
        ov += [f"train.batch_tokens={batch_tokens}"]
    else:
        ov += ["train.batch_size=8", "train.batch_tokens=null"]
    if base_mode == "legacy8":
        ov += ["train.num_workers=2", "train.checkpoint_logits='on'"]
    if "nock" in flags:
        ov += ["train.checkpoint_logits='off'"]
    if "compile" in flags:
        ov += ["train.compile=true", "train.checkpoint_logits='off'"]
    if FP8 in flags:
        if fp8_dir is None:
            raise ValueError(f"mode {mode}: needs fp8_dir")
        ov += [f"extract.output_dir={fp8_dir}"]  # same split/vocab map (data dir): same sample ids
    cfg = load_config(config, ov)
    lr = loader_rate(cfg, 30 if base_mode == "tokens" else 100)
    import contextlib

    import eagle3.train.loop as loop_mod
    import eagle3.train.order as order_mod

    saved = order_mod.collate, loop_mod.collate, train_mod.no_cudnn_sdpa
    if base_mode == "legacy8":  # the loaders' collate (train and validation)
        order_mod.collate = loop_mod.collate = _legacy_collate
        # keep torch's default SDPA choice (cuDNN on Hopper)
        train_mod.no_cudnn_sdpa = contextlib.nullcontext
    t0 = time.perf_counter()
    try:
        res = train_mod.run(cfg, max_steps=steps, device=device, export=export_for_run)
    finally:
        order_mod.collate, loop_mod.collate, train_mod.no_cudnn_sdpa = saved
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    steady = rows[1:] if len(rows) > 1 else rows
    toks = sum(r["window_tokens"] for r in steady)
    secs = sum(r["window_s"] for r in steady)
    tps = toks / secs if secs > 0 else float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return {
        "mode": mode,
        "steps": res["step"],
        "tokens_per_s": tps,
        "steady_tokens": toks,
        "steady_s": secs,
        "step_ms": 1e3 * secs / max(1, sum(log_every for _ in steady)),
        "run_wall_s": wall,
        "tokens_per_step": toks / max(1, log_every * len(steady)),
        "peak_mem_gib": peak,
        "first_loss": rows[0].get("loss") if rows else None,
        "final_loss": rows[-1].get("loss") if rows else None,
        **lr,
        "issue_run_projected_s": ISSUE_RUN_TOKENS / tps if tps == tps and tps > 0 else None,
    }


def median_of_rounds(runs: list[dict]) -> dict:
    """One mode's row from its runs (one per ``--rounds`` round): a single run is returned as is; several give
    the first run's row with ``tokens_per_s``, ``loader_tokens_per_s``, ``step_ms`` replaced by their medians
    (``issue_run_projected_s`` recomputed) and the per-round figures under ``rounds``."""
    import statistics

    if len(runs) == 1:
        return runs[0]
    keys = ("tokens_per_s", "loader_tokens_per_s", "step_ms")
    out = {k: v for k, v in runs[0].items() if k != "round"}
    out.update({k: statistics.median(r[k] for r in runs) for k in keys})
    tps = out["tokens_per_s"]
    out["issue_run_projected_s"] = ISSUE_RUN_TOKENS / tps if tps == tps and tps > 0 else None
    out["rounds"] = [{k: r[k] for k in ("round",) + keys} for r in runs]
    return out


def fp8_comparison(out: dict, results: list[dict], by: dict, fp8_summary: dict | None) -> list[str]:
    """Pair each ``+fp8`` result with its bf16 mode: adds ``fp8_vs_bf16_tokens_per_s`` (fp8 / bf16),
    ``fp8_vs_bf16_loader_tokens_per_s`` and ``first_loss_rel_diff`` (``|fp8 - bf16| / bf16`` of the step-1
    loss) to the fp8 row, the first pair's figures to ``out``; returns Markdown lines (none without pairs)."""
    if fp8_summary is not None:
        out["fp8_convert"] = fp8_summary
    pairs = [
        (by[bf16_mode(r["mode"])], r)
        for r in results
        if FP8 in mode_flags(r["mode"]) and bf16_mode(r["mode"]) in by
    ]
    if not pairs:
        return []
    lines = [
        "",
        "| storage | mode | tokens/s | loader tokens/s | loader ships | step-1 loss | fp8 / bf16 tokens/s "
        "| fp8 / bf16 loader |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]

    def row(r: dict, ratio: str = "", loader_ratio: str = "") -> str:
        loss = "" if r["first_loss"] is None else f"{r['first_loss']:.5f}"
        return (
            f"| {r['storage_dtype']} | {r['mode']} | {r['tokens_per_s']:.0f} | {r['loader_tokens_per_s']:.0f} "
            f"| {r['loader_feature_dtype']} | {loss} | {ratio} | {loader_ratio} |"
        )

    for b, f in pairs:
        f["fp8_vs_bf16_tokens_per_s"] = f["tokens_per_s"] / b["tokens_per_s"]
        f["fp8_vs_bf16_loader_tokens_per_s"] = f["loader_tokens_per_s"] / b["loader_tokens_per_s"]
        if (
            "rounds" in f and "rounds" in b
        ):  # paired: the two runs of one round saw the same machine load
            f["fp8_vs_bf16_tokens_per_s_rounds"] = [
                x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(f["rounds"], b["rounds"])
            ]
        f["first_loss_rel_diff"] = (
            abs(f["first_loss"] - b["first_loss"]) / abs(b["first_loss"])
            if f["first_loss"] is not None and b["first_loss"]
            else None
        )
        lines += [
            row(b),
            row(
                f,
                f"{f['fp8_vs_bf16_tokens_per_s']:.3f}x",
                f"{f['fp8_vs_bf16_loader_tokens_per_s']:.3f}x",
            ),
        ]
    b, f = pairs[0]
    out.update(
        {
            "fp8_vs_bf16_tokens_per_s": f["fp8_vs_bf16_tokens_per_s"],
            "fp8_vs_bf16_loader_tokens_per_s": f["fp8_vs_bf16_loader_tokens_per_s"],
            "fp8_tokens_per_s": f["tokens_per_s"],
            "bf16_tokens_per_s": b["tokens_per_s"],
            "fp8_loader_tokens_per_s": f["loader_tokens_per_s"],
            "bf16_loader_tokens_per_s": b["loader_tokens_per_s"],
            "fp8_first_loss_rel_diff": f["first_loss_rel_diff"],
        }
    )
    if "fp8_vs_bf16_tokens_per_s_rounds" in f:
        out["fp8_vs_bf16_tokens_per_s_rounds"] = f["fp8_vs_bf16_tokens_per_s_rounds"]
    return lines


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        type=Path,
        help="a prepared run (stages 02-03 done): real shards instead of synthetic",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="override for --config (repeatable)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(
            "/dev/shm/small_train_speed" if Path("/dev/shm").is_dir() else "/tmp/small_train_speed"
        ),
        help="synthetic shards and train outputs (default: RAM disk /dev/shm)",
    )
    p.add_argument("--samples", type=int, default=2000, help="synthetic training samples")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--modes", default="legacy8,fixed8,tokens")
    p.add_argument(
        "--steps", default="legacy8=120,fixed8=120,tokens=150", help="optimizer steps per mode"
    )
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--fp8-shards",
        type=Path,
        help="'+fp8' modes: folder of the fp8 copy of the shards (default "
        "WORKDIR/shards-fp8); converted from the bf16 shards unless it already holds that conversion",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the modes this many times, order reversed "
        "every other round (A B, B A, ...); each mode reports the median over rounds (a shared machine)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--device", default=None, help="'cpu' forces CPU")
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--profile",
        type=Path,
        help="also write torch.profiler tables (top ops by CPU and device time) "
        "of 12 steps of each mode to this folder",
    )
    a = p.parse_args(argv)
    if (
        a.config is not None
    ):  # bad --config / --set: one error line before any work (eagle3.cli contract)
        from eagle3.config import load_config

        load_config(a.config, a.overrides)
    logging.basicConfig(level=logging.WARNING)
    steps = {k: int(v) for k, v in (x.split("=") for x in a.steps.split(","))}
    modes = a.modes.split(",")
    steps = {
        m: steps.get(m, steps.get(bf16_mode(m), 100)) for m in modes
    }  # '+fp8': its bf16 mode's steps
    make_dirs(a.workdir, "--workdir")
    head_dir = None
    if a.config is None:
        shape = TINY if a.tiny else SMOL
        t0 = time.perf_counter()
        config = write_synthetic(a.workdir / "data", a.samples, 16, shape, a.max_length)
        head_dir = a.workdir / "data" / "head"
        print(
            f"synthetic shards: {a.samples} samples in {time.perf_counter() - t0:.1f} s", flush=True
        )
    else:
        config = a.config
    fp8_dir, fp8_summary = None, None
    if any(FP8 in mode_flags(m) for m in modes):
        from eagle3.config import load_config

        fp8_dir = a.fp8_shards or a.workdir / "shards-fp8"
        # synthetic shards are rewritten by every run: redo their conversion; a real run's is resumed/reused
        src_cfg = load_config(config, a.overrides)
        fp8_summary = make_fp8_shards(
            src_cfg.shards_dir, fp8_dir, overwrite=a.config is None and a.fp8_shards is None
        )
        carry_validation(src_cfg.shards_dir, fp8_dir, src_cfg.data_dir)
        print(
            f"fp8 shards: {fp8_dir} ({fp8_summary['converted']} converted, {fp8_summary['resumed']} reused, "
            f"file bytes x{fp8_summary.get('ratio')}, {fp8_summary['seconds']} s)",
            flush=True,
        )
    results = []
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        make_dirs(a.profile, "--profile")
        acts = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        )
        for m in modes:
            with profile(activities=acts) as prof:
                run_mode(
                    m,
                    config,
                    a.overrides,
                    a.workdir,
                    12,
                    a.batch_tokens,
                    4,
                    a.device,
                    head_dir,
                    fp8_dir,
                )
            ka = prof.key_averages()
            dev_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            text = (
                ka.table(sort_by=dev_key, row_limit=30)
                + "\n\n"
                + ka.table(sort_by="cpu_time_total", row_limit=30)
            )
            (a.profile / f"profile_{m}.txt").write_text(text)
            print(f"profile of {m}: {a.profile / f'profile_{m}.txt'}", flush=True)
    runs = []
    for k in range(a.rounds):
        for m in (
            modes if k % 2 == 0 else modes[::-1]
        ):  # ABBA...: drift of a shared machine hits both alike
            r = run_mode(
                m,
                config,
                a.overrides,
                a.workdir,
                steps[m],
                a.batch_tokens,
                a.log_every,
                a.device,
                head_dir,
                fp8_dir,
            )
            runs.append({**r, "round": k} if a.rounds > 1 else r)
            print(json.dumps(runs[-1]), flush=True)
            if (
                head_dir is None
            ):  # real data: the first run extracted the verifier head; the others reuse a copy
                import shutil

                head_dir = a.workdir / "head"
                head_dir.mkdir(exist_ok=True)
                shutil.copy(
                    a.workdir / f"train-{m.replace('+', '-')}" / "target_head.safetensors", head_dir
                )
    results = [median_of_rounds([r for r in runs if r["mode"] == m]) for m in modes]
    by = {r["mode"]: r for r in results}
    base = by.get("legacy8") or results[0]
    out = {
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available() and a.device != "cpu"
        else "cpu",
        "torch": torch.__version__,
        "data": str(a.config) if a.config else f"synthetic x{a.samples}",
        "batch_tokens": a.batch_tokens,
        "rounds": a.rounds,
        "results": results,
    }
    for r in results:
        r["speedup_vs_" + base["mode"]] = r["tokens_per_s"] / base["tokens_per_s"]
    if "tokens" in by:
        out["small_train_tokens_per_s"] = by["tokens"]["tokens_per_s"]
        out["small_train_wall_vs_reference"] = (
            by["tokens"]["issue_run_projected_s"] / ISSUE_REFERENCE_S
        )
    lines = [
        "| mode | tokens/s | step ms | tokens/step | vs "
        + base["mode"]
        + " | issue run (6.96M tokens) s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {r['tokens_per_step']:.0f} | "
            f"{r['speedup_vs_' + base['mode']]:.2f}x | {r['issue_run_projected_s'] or float('nan'):.0f} |"
        )
    lines.append("(issue 9: ours 498 s, published trainer 320 s)")
    lines += fp8_comparison(out, results, by, fp8_summary)
    print("\n".join(lines))
    out["table_md"] = "\n".join(lines)
    if a.json:
        atomic_write_json(a.json, out)
    return 0


if __name__ == "__main__":
    run_main(main)
