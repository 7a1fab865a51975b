"""End to end, 01 -> 05, with an MLA draft layer (``drafter.attention: mla``) on the tiny random Llama verifier
(configs/tiny-llama.yaml): the MLA sizes are set in the config (a Llama verifier has none), 04 trains and exports
the ``Eagle3DeepseekV2ForCausalLM`` folders for both engines, and 05 benchmarks the SGLang one (KV-cached decode):
lossless, and trained above chance (an untrained drafter gets tau = 1.0 on this verifier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TAU_MARGIN = 0.3
MLA_SET = [
    "drafter.attention=mla",
    "drafter.mla.q_lora_rank=32",
    "drafter.mla.kv_lora_rank=16",
    "drafter.mla.qk_nope_head_dim=16",
    "drafter.mla.qk_rope_head_dim=8",
    "drafter.mla.v_head_dim=12",
]


def _run(script: str, overrides: list[str], env: dict, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(ROOT / script),
        "--config",
        str(ROOT / "configs/tiny-llama.yaml"),
        *extra,
    ]
    for o in overrides:
        cmd += ["--set", o]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_tiny_pipeline_mla_end_to_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "run"
    ov = [f"verifier.path={tiny_llama_dir}", f"output_root={out}", *MLA_SET]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for script in ("01_prepare_prompts.py", "02_extract_hidden.py", "03_prepare_data.py"):
        _run(script, ov, env)
    printed = _run("04_train.py", ov, env).stdout
    assert printed.splitlines()[-3].startswith("drafter: eagle3, 1 decoder layer, MLA attention, ")

    # 04's SGLang folder: the MLA draft class, DeepSeek-V3 sizes, SGLang ids (Llama family: HF - 1).
    cfg = json.loads((out / "drafter-sglang" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_hidden_layers"] == 1
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_nope_head_dim"]) == (32, 16, 16)
    assert (cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["rope_interleave"]) == (8, 12, True)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    # the vLLM folder of the same checkpoint: plain HF config, top-level HF ids, the same weights
    _run("04_train.py", ov, env, "--export-only", "--engine", "vllm")
    vcfg = json.loads((out / "drafter-vllm" / "config.json").read_text())
    assert vcfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert vcfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert vcfg["norm_before_residual"] is False and "speculators_config" not in vcfg

    from safetensors.torch import load_file

    from eagle3.export.reader import load_exported
    from eagle3.verifier.head import TargetHead

    w = load_file(str(out / "drafter-vllm" / "model.safetensors"))
    assert list(w["layers.0.self_attn.kv_b_proj.weight"].shape) == [4 * (16 + 12), 16]
    assert list(w["layers.0.self_attn.q_b_proj.weight"].shape) == [4 * (16 + 8), 32]
    emb = TargetHead.load(out / "train").embed.float()
    a, b = load_exported(out / "drafter-sglang", emb), load_exported(out / "drafter-vllm", emb)
    assert a.args.is_mla and a.args == b.args
    for (ka, va), (kb, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        assert ka == kb and torch.equal(va, vb), ka

    # 05: lossless speculative decoding with the MLA drafter's caches, trained above tau 1 + margin.
    _run("05_benchmark.py", ov, env)
    bench = json.loads((out / "bench" / "bench.json").read_text())
    for d in bench["datasets"]:
        assert d.get("failures", len(d["mismatches"])) == 0, (
            d
        )  # the verdict bench.md prints as "lossless"
        assert d["tau"] >= 1.0 + TAU_MARGIN, d
