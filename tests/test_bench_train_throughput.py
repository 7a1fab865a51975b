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

ROOT = Path(__file__).resolve().parents[1]
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
    causal = 7 * 3 * causal_fwd_one_step  # every TTT step's queries see the step-0 causal keys; fwd + bwd = 3x fwd
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
    for k in ("seq", "kv_heads", "ttt", "step_ms", "step_ms_all", "tokens_per_s", "peak_mem_gib", "flops",
              "tflops_achieved", "mfu", "first_step_s", "compile_s", "checkpoint_logits", "autocast", "loss", "oom"):
        assert k in row, k
    assert row["oom"] is False
    assert row["step_ms"] > 0 and len(row["step_ms_all"]) == row["steps"]
    assert math.isclose(row["tokens_per_s"], row["seq"] / (row["step_ms"] / 1e3), rel_tol=1e-9)
    assert row["peak_mem_gib"] > 0
    assert math.isfinite(row["loss"]) and row["loss"] > 0
    shape = bench.Shape(**{f: row[f] for f in bench.Shape.__dataclass_fields__})
    assert row["flops"] == bench.train_step_flops(shape)
    assert row["mfu"] > 0
    assert row["autocast"] is None and row["checkpoint_logits"] is False  # CPU: float32, no checkpointing (as train.py)


def test_tiny_cpu_subprocess(tmp_path):
    out = tmp_path / "tt.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--kv-heads", "8", "2",
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
        assert math.isclose(row["mfu"], row["tflops_achieved"] / res["ceiling"]["tflops"], rel_tol=1e-9)


def test_max_seq_search_budget(tmp_path, capsys):
    bench = _load_bench()
    out = tmp_path / "s.json"
    assert bench.main(["--tiny", "--device", "cpu", "--max-seq-search", "--search-seqs", "40", "--ttt", "2",
                       "--mem-budget-gib", "0.001", "--json", str(out)]) == 0
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
