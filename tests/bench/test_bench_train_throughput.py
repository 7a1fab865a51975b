"""bench/train_throughput.py: CPU smoke run of the real training step (subprocess) and the FLOP formula."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "train_throughput.py"


def _load_bench():
    """Import the script as a module (registered in ``sys.modules``, which ``dataclasses`` needs)."""
    name = "bench_train_throughput"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _reference_flops_by_hand() -> int:
    """One 4096-token step of the Kimi-K2.5 drafter (64 KV heads, TTT 7), written out term by term."""
    qkv = (2 * 7168) * (64 * 128 + 64 * 128 + 64 * 128)  # 14336 x 24576 = 352,321,536
    o = (64 * 128) * 7168  # 58,720,256
    mlp = 3 * 7168 * 18432  # 396,361,728
    lm_head = 7168 * 32000  # 229,376,000
    per_ttt_step = qkv + o + mlp + lm_head
    assert per_ttt_step == 1_036_779_520
    fc = 3 * 7168 * 7168  # 154,140,672, once per token
    dense = 6 * 4096 * (7 * per_ttt_step + fc)
    assert dense == 182_147_415_539_712
    causal_fwd_one_step = 2 * 2 * (4096 * 4096 // 2) * 64 * 128  # QK^T + PV over the causal half
    causal = (
        7 * 3 * causal_fwd_one_step
    )  # every TTT step's queries see the step-0 causal keys; fwd + bwd = 3x fwd
    assert causal == 5_772_436_045_824
    diag = 3 * 4 * 4096 * 64 * 128 * (0 + 1 + 2 + 3 + 4 + 5 + 6)  # step i has i diagonal keys
    assert diag == 8_455_716_864
    target = 2 * 7168 * 163840 * 4096  # verifier LM head forward
    assert target == 9_620_726_743_040
    return dense + causal + diag + target


def test_flop_formula_reference_shape():
    bench = _load_bench()
    want = _reference_flops_by_hand()
    assert want == 197_549_034_045_440
    got = bench.train_step_flops(bench.REFERENCE)
    assert got["total"] == want
    assert abs(want / 1.98e14 - 1) < 0.01  # the "about 1.98e14"
    kv8 = bench.train_step_flops(bench.Shape(**{**bench.REFERENCE.__dict__, "kv_heads": 8}))
    # 8 KV heads: k and v projections shrink from 2 x 64 to 2 x 8 heads of 128 (x 2H input), x6 x L x 7
    assert want - kv8["total"] == 6 * 4096 * 7 * (2 * 7168) * (2 * 56 * 128)


def _check_row(row: dict, bench) -> None:
    for k in (
        "seq",
        "kv_heads",
        "ttt",
        "step_ms",
        "step_ms_all",
        "tokens_per_s",
        "peak_mem_gib",
        "flops",
        "tflops_achieved",
        "mfu",
        "first_step_s",
        "compile_s",
        "checkpoint_logits",
        "autocast",
        "loss",
        "oom",
    ):
        assert k in row, k
    assert row["oom"] is False
    assert row["step_ms"] > 0 and len(row["step_ms_all"]) == row["steps"]
    assert math.isclose(row["tokens_per_s"], row["seq"] / (row["step_ms"] / 1e3), rel_tol=1e-9)
    assert row["peak_mem_gib"] > 0
    assert math.isfinite(row["loss"]) and row["loss"] > 0
    shape = bench.Shape(**{f: row[f] for f in bench.Shape.__dataclass_fields__})
    assert row["flops"] == bench.train_step_flops(shape)
    assert row["mfu"] > 0
    assert (
        row["autocast"] is None and row["checkpoint_logits"] is False
    )  # CPU: float32, no checkpointing (as train.py)


def test_tiny_cpu_subprocess(tmp_path):
    out = tmp_path / "tt.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--device",
            "cpu",
            "--kv-heads",
            "8",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| seq | kv heads |" in r.stdout  # the Markdown table
    res = json.loads(out.read_text())
    bench = _load_bench()
    assert res["mode"] == "throughput" and res["tiny"] is True
    assert res["ceiling"]["dtype"] == "float32" and res["ceiling"]["tflops"] > 0
    assert res["reference_flops"]["total"] == _reference_flops_by_hand()
    assert [r["kv_heads"] for r in res["runs"]] == [8, 2]
    for row in res["runs"]:
        _check_row(row, bench)
        assert row["seq"] == bench.TINY.seq and row["ttt"] == bench.TINY.ttt
        assert math.isclose(
            row["mfu"], row["tflops_achieved"] / res["ceiling"]["tflops"], rel_tol=1e-9
        )


def test_max_seq_search_budget(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "s.json"
    assert (
        bench.main(
            [
                "--tiny",
                "--device",
                "cpu",
                "--max-seq-search",
                "--search-seqs",
                "40",
                "--ttt",
                "2",
                "--mem-budget-gib",
                "0.001",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["mode"] == "max_seq_search" and res["mem_budget_gib"] == 0.001
    (row,) = res["runs"]
    assert row["seq"] == 40 and row["ttt"] == 2 and row["steps"] == 1
    assert row["fits"] is False  # any process needs more than 1 MiB
    assert "fits 0.001 GiB" in capsys.readouterr().out


def test_rejects_bad_kv_heads():
    bench = _load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--kv-heads", "3"])


# ---------------------------------------------------------------------------------------------
# DDP mode (torchrun)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_torchrun_env(monkeypatch):
    """The in-process calls below must see a plain (non-torchrun) environment."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_ddp_summary_formulas():
    bench = _load_bench()
    ranks = [
        {"tokens_per_s": 900.0, "timed_wall_s": 0.5, "param_checksum": [1.0, 2.0]},
        {"tokens_per_s": 1100.0, "timed_wall_s": 0.625, "param_checksum": [1.0, 2.0]},
    ]
    q = bench.ddp_summary(
        ranks,
        seq=100,
        steps=5,
        baseline={"tokens_per_s": 1250.0, "source": "b.json"},
        backend="nccl",
    )
    assert q["world_size"] == 2 and q["backend"] == "nccl"
    assert q["per_gpu_tokens_per_s"] == 1000.0 and q["total_tokens_per_s"] == 2000.0
    assert q["min_rank_tokens_per_s"] == 900.0 and q["max_rank_tokens_per_s"] == 1100.0
    assert (
        q["timed_wall_s"] == 0.625 and q["total_tokens_per_s_wall"] == 2 * 100 * 5 / 0.625
    )  # 1600
    assert q["scaling_efficiency"] == 1000.0 / 1250.0  # 0.8
    assert q["scaling_efficiency_wall"] == 1600.0 / 2 / 1250.0  # 0.64
    assert q["meets_goal"] is False and q["goal_efficiency"] == 0.9
    assert q["params_identical_across_ranks"] is True and q["baseline"]["source"] == "b.json"
    ranks[1]["param_checksum"] = [1.0, 2.0000001]
    q = bench.ddp_summary(ranks, seq=100, steps=5, baseline=None, backend="gloo")
    assert q["params_identical_across_ranks"] is False and "scaling_efficiency" not in q


def test_find_baseline_row_matches_settings():
    bench = _load_bench()
    s = bench.TINY
    row = {
        **s.__dict__,
        "compile": False,
        "checkpoint_logits": False,
        "autocast": None,
        "oom": False,
        "tokens_per_s": 123.0,
    }
    base = {"mode": "throughput", "runs": [{**row, "kv_heads": 2, "tokens_per_s": 7.0}, row]}
    want = {**s.__dict__, "compile": False, "checkpoint_logits": False, "autocast": None}
    got = bench.find_baseline_row(base, want, "b.json")
    assert got["tokens_per_s"] == 123.0 and got["source"] == "b.json"
    for bad in (
        {**want, "compile": True},
        {**want, "seq": 96},
        {**want, "checkpoint_logits": True},
    ):
        with pytest.raises(ValueError, match="no run matches"):
            bench.find_baseline_row(base, bad, "b.json")
    with pytest.raises(ValueError, match="1-GPU run"):
        bench.find_baseline_row({**base, "world_size": 2}, want, "b.json")
    with pytest.raises(ValueError, match="not a throughput result"):
        bench.find_baseline_row({"mode": "max_seq_search", "runs": []}, want, "b.json")
    with pytest.raises(ValueError, match="no successful runs"):
        bench.find_baseline_row(
            {"mode": "throughput", "runs": [{**row, "oom": True}]}, want, "b.json"
        )


def test_baseline_json_needs_torchrun(tmp_path, no_torchrun_env):
    bench = _load_bench()
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--device", "cpu", "--baseline-json", str(tmp_path / "b.json")])


def test_distinct_batches_diverge_without_ddp():
    """The cross-rank weight check has teeth: two single-process replicas on different batches drift
    apart after a step, on the same batch they stay bit-identical."""
    bench = _load_bench()
    s = bench.Shape(**{**bench.TINY.__dict__, "seq": 16, "ttt": 2})
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sums = []
        for bs in (1, 1, 2):
            step, info, checksum = bench.build_step(
                s, torch.device("cpu"), False, None, total_steps=3, batch_seed=bs
            )
            assert info["ddp_wrapped"] is False
            for _ in range(3):  # LR warm-up starts at 0: step 1 leaves the weights unchanged
                step()
            sums.append(checksum())
    finally:
        torch.set_num_threads(n)
    assert sums[0] == sums[1]
    assert sums[0] != sums[2]


def test_torchrun_two_gloo_ranks(tmp_path, no_torchrun_env):
    """``torchrun --nproc_per_node 2`` of the tiny CPU mode (gloo, DDP-wrapped, logits checkpointed as on
    GPU) against a 1-process baseline JSON: fields, per-rank rates and the efficiency formula."""
    bench = _load_bench()
    base_json, out = tmp_path / "tt1.json", tmp_path / "tt2.json"
    common = ["--tiny", "--device", "cpu", "--checkpoint-logits", "--steps", "3", "--warmup", "1"]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bench.main(common + ["--json", str(base_json)]) == 0
    finally:
        torch.set_num_threads(n)
    base = json.loads(base_json.read_text())
    assert base["world_size"] == 1 and base["torchrun"] is False and "ddp" not in base["runs"][0]

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(SCRIPT),
        *common,
        "--baseline-json",
        str(base_json),
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| world | seq | kv heads |" in r.stdout  # the DDP Markdown table (rank 0 only)
    assert r.stdout.count("| world | seq | kv heads |") == 1
    res = json.loads(out.read_text())
    assert (
        res["world_size"] == 2
        and res["torchrun"] is True
        and res["baseline_json"] == str(base_json)
    )
    assert res["env"]["NCCL_NVLS_ENABLE"] == "0"  # forced off even when set to 1
    (row,) = res["runs"]
    _check_row({**row, "checkpoint_logits": False}, bench)
    assert row["ddp_wrapped"] is True and row["checkpoint_logits"] is True and row["steps"] == 3

    q = row["ddp"]
    assert q["world_size"] == 2 and q["backend"] == "gloo"
    assert [p["rank"] for p in q["per_rank"]] == [0, 1]
    rates = []
    for p in q["per_rank"]:
        assert len(p["step_ms_all"]) == 3 and p["timed_wall_s"] > 0
        assert math.isclose(p["tokens_per_s"], row["seq"] / (p["step_ms"] / 1e3), rel_tol=1e-9)
        rates.append(p["tokens_per_s"])
    assert q["per_rank"][0]["tokens_per_s"] == row["tokens_per_s"]  # the row is rank 0's
    assert math.isclose(q["per_gpu_tokens_per_s"], sum(rates) / 2, rel_tol=1e-12)
    assert math.isclose(q["total_tokens_per_s"], sum(rates), rel_tol=1e-12)
    assert q["min_rank_tokens_per_s"] == min(rates) and q["max_rank_tokens_per_s"] == max(rates)
    wall = max(p["timed_wall_s"] for p in q["per_rank"])
    assert math.isclose(q["total_tokens_per_s_wall"], 2 * row["seq"] * 3 / wall, rel_tol=1e-12)
    # each rank trained on its own batch, and DDP kept the weights identical
    assert q["per_rank"][0]["loss"] != q["per_rank"][1]["loss"]
    assert q["params_identical_across_ranks"] is True
    assert q["per_rank"][0]["param_checksum"] == q["per_rank"][1]["param_checksum"]
    # efficiency from the given baseline
    base_rate = base["runs"][0]["tokens_per_s"]
    assert q["baseline"]["tokens_per_s"] == base_rate and q["baseline"]["source"] == str(base_json)
    assert math.isclose(
        q["scaling_efficiency"], q["per_gpu_tokens_per_s"] / base_rate, rel_tol=1e-12
    )
    assert math.isclose(
        q["scaling_efficiency_wall"], q["total_tokens_per_s_wall"] / 2 / base_rate, rel_tol=1e-12
    )
    assert q["meets_goal"] == (q["scaling_efficiency"] >= 0.9)
