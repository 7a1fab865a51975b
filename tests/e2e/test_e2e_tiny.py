"""End to end, 01 -> 05, on a tiny random-initialised Llama verifier (configs/tiny-llama.yaml).

Each stage runs as its own process exactly as a user runs it. The drafter is trained on the
verifier's own regenerated answers and then benchmarked on prompts it was trained on: a random
verifier's greedy continuations are deterministic and repetitive, so a trained drafter must
predict them well above chance (an untrained one gets tau = 1.0 on this verifier; see
tests/benchmark/test_decode.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.shards.format import list_samples
from eagle3.shards.read import load_sample

ROOT = Path(__file__).resolve().parents[2]
TAU_MARGIN = 0.3  # trained drafter must reach tau >= 1.3 (untrained: 1.0)


def _stage(script: str, overrides: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / script), "--config", str(ROOT / "configs/tiny-llama.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    ov = [f"verifier.path={tiny_llama_dir}", f"output_root={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    printed = {
        script: _stage(script, ov, env).stdout
        for script in (
            "01_prepare_prompts.py",
            "02_extract_hidden.py",
            "03_prepare_data.py",
            "04_train.py",
        )
    }

    # 01: 12 regenerated conversations, each user turn answered.
    rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)

    # 02: one shard per conversation, metadata in the project's convention.
    meta = json.loads((out / "shards" / "data_config.json").read_text())
    assert meta["aux_layers"] == [1, 3, 4]
    assert meta["hidden_size"] == 64 and meta["num_layers"] == 6
    samples = list_samples(out / "shards")
    assert len(samples) == 12
    s = load_sample(samples[0][1])
    assert len(s["hidden_states"]) == 4 and s["hidden_states"][0].dtype == torch.bfloat16
    assert int(s["loss_mask"].sum()) > 0

    # 03: draft vocab of 512 ids with offsets that map into the target vocab.
    vm = torch.load(out / "data" / "vocab_map.pt", weights_only=True)
    d2t, t2d = vm["d2t"], vm["t2d"]
    assert d2t.shape == (512,) and t2d.sum() == 512
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(512) + d2t)

    # 04: exported SGLang folder with the Llama-family ids (HF [1,3,4] -> SGLang [0,2,3]).
    cfg = json.loads((out / "drafter-sglang" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert (
        cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    )  # export.dtype; 05 below benchmarks this bf16 export
    assert cfg["eagle3_train"]["engine"] == "sglang" and cfg["eagle3_train"]["aux_layers_hf"] == [
        1,
        3,
        4,
    ]

    # 04 --export-only --engine vllm: the same weights in the speculators format (vLLM ids = HF ids).
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "04_train.py"),
            "--config",
            str(ROOT / "configs/tiny-llama.yaml"),
            "--export-only",
            "--engine",
            "vllm",
        ]
        + [a for o in ov for a in ("--set", o)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    vcfg = json.loads((out / "drafter-vllm" / "config.json").read_text())
    assert vcfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    from eagle3.export.reader import load_exported
    from eagle3.verifier.head import TargetHead

    emb = TargetHead.load(out / "train").embed.float()
    a, b = load_exported(out / "drafter-sglang", emb), load_exported(out / "drafter-vllm", emb)
    for (ka, va), (kb, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert ka == kb and torch.equal(va, vb), ka

    # 05: lossless speculative decoding and a trained drafter above tau 1 + margin.
    printed["05_benchmark.py"] = _stage("05_benchmark.py", ov, env).stdout
    bench = json.loads((out / "bench" / "bench.json").read_text())
    assert (out / "bench" / "bench.md").is_file() and (out / "bench" / "acceptance.png").is_file()
    text = json.dumps(bench)
    assert "tau" in text
    taus = _find_numbers(bench, "tau")
    assert taus, bench
    assert min(taus) >= 1.0 + TAU_MARGIN, f"acceptance length {taus} below 1 + {TAU_MARGIN}"

    # 04 and 05 end with their headline; the demo summary reads the same figures from the stages' reports
    train_rep = json.loads((out / "train" / "train_report.json").read_text())
    assert (
        printed["04_train.py"]
        .splitlines()[-4]
        .startswith(f"trained: {train_rep['step']}/{train_rep['total_steps']} ")
    )
    assert printed["04_train.py"].splitlines()[-3].startswith("drafter: eagle3")
    assert printed["04_train.py"].splitlines()[-1] == f"export: {out / 'drafter-sglang'}"
    d0 = bench["datasets"][0]
    assert (
        printed["05_benchmark.py"]
        .splitlines()[-2]
        .startswith(f"{d0['dataset']}: tau {d0['tau']:.2f}, ")
    )
    assert printed["05_benchmark.py"].splitlines()[-1] == f"report: {out / 'bench' / 'bench.md'}"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "demo_summary.py"),
            "--config",
            str(ROOT / "configs/tiny-llama.yaml"),
            *[a for o in ov for a in ("--set", o)],
            "--seconds",
            "04_train=7",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "demo_summary.json").read_text())
    fig = {s["stage"]: s["figures"] for s in summary["stages"]}
    assert fig["01_prepare_prompts"]["prompts"] == 12 and fig["02_extract_hidden"]["samples"] == 12
    assert fig["03_prepare_data"]["draft_vocab_size"] == 512
    acc = train_rep["final_val"]
    assert fig["04_train"]["val_top1"] == [
        acc[f"acc_{i}"] for i in range(len(fig["04_train"]["val_top1"]))
    ]
    assert fig["04_train"]["val_top1"] and fig["04_train"]["steps"] == train_rep["step"]
    assert (
        fig["05_benchmark"]["datasets"][0]["tau"] == d0["tau"]
        and fig["05_benchmark"]["datasets"][0]["lossless"]
    )
    assert summary["stages_seconds"] == 7 and summary["export_dir"] == str(out / "drafter-sglang")
    assert f"export (serve this folder): {out / 'drafter-sglang'}" in r.stdout

    # Serving-side layer ablation: the drafter is fed other aux layers than it was trained on,
    # and the report says so.
    shifted = out / "bench-shifted"
    cmd = [
        sys.executable,
        str(ROOT / "05_benchmark.py"),
        "--config",
        str(ROOT / "configs/tiny-llama.yaml"),
        "--serve-aux-layers",
        "2",
        "4",
        "5",
    ]
    for o in ov + [f"benchmark.output_dir={shifted}"]:
        cmd += ["--set", o]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((shifted / "bench.json").read_text())
    assert rep["aux_layers"] == [2, 4, 5]
    assert any("trained on [1, 3, 4]" in w for w in rep["warnings"])
    assert r.stderr.count("although the drafter was trained on [1, 3, 4]") == 1, r.stderr[
        -3000:
    ]  # logged once


def _find_numbers(obj, key: str) -> list[float]:
    """All numeric values stored under ``key`` anywhere in a JSON tree."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, (int, float)):
                found.append(float(v))
            else:
                found += _find_numbers(v, key)
    elif isinstance(obj, list):
        for v in obj:
            found += _find_numbers(v, key)
    return found
