"""bench/regen_step.py on CPU with --tiny: every path and setting times a step, the byte figures are consistent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import regen_step as rst  # noqa: E402


def test_settings_pick_the_small_prefix():
    st = {s["setting"]: s for s in rst.settings(1024, 2560, 8)}
    assert st["bulk"]["live"] == 1024 and st["bulk"]["lengths"] == (100, 700)
    assert st["tail, full step"]["prefix"] == 1024 and st["tail, small prefix"]["prefix"] == 8
    assert st["long"]["lengths"] == (1280, 2496)


def test_regen_step_tiny_on_cpu(tmp_path):
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert rst.main(["--tiny", "--reps", "2", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["attention"], r["setting"]): r for r in res["rows"]}
    assert len(rows) == 8 and not [r for r in res["rows"] if "error" in r]
    bpt = res["kv_bytes_per_token"]
    assert bpt == 2 * 2 * 2 * 16 * 4  # 2 (K, V) x 2 layers x 2 KV heads x head_dim 16 x fp32
    for (att, name), r in rows.items():
        assert (
            r["ms_median"] > 0 and r["roofline_ms"] is None and r["ratio_to_roofline"] is None
        )  # no bandwidth
        assert r["kv_bytes_needed"] <= r["kv_bytes_read"]
        assert r["bytes_needed"] == res["weight_bytes"] + r["kv_bytes_needed"]
    assert (
        res["bandwidth_gb_s"] is None
    )  # on CPU: null, and the table says so (it read "bandwidth 0 GB/s")
    assert "memory bandwidth unknown on cpu" in md.read_text() and "GB/s" not in md.read_text()
    # sdpa_groups (one full-cache group) reads every prefix row's 256 columns
    assert rows[("sdpa_groups", "bulk")]["kv_bytes_read"] == 16 * 256 * bpt
    assert rows[("sdpa_groups", "tail, small prefix")]["kv_bytes_read"] == 8 * 256 * bpt
    # flex reads whole 128-column blocks of the live rows, one block per finished slot of the prefix
    full, small = rows[("flex", "tail, full step")], rows[("flex", "tail, small prefix")]
    assert (
        small["prefix"] == 8
        and full["prefix"] == 16
        and full["mean_length"] == small["mean_length"]
    )
    assert full["kv_bytes_read"] - small["kv_bytes_read"] == 8 * 128 * bpt
    assert rows[("flex", "bulk")]["kv_bytes_read"] < rows[("sdpa_groups", "bulk")]["kv_bytes_read"]
    k = res["profile"]["kernels"]
    assert k[-1]["kernel"] == "(all)" and len(k) >= 2 and all(x["us"] > 0 for x in k)
    text = md.read_text()
    assert "| flex | tail, small prefix | 8 | 8 |" in text and "Top kernels" in text


def test_regen_step_compiled_path_tiny_on_cpu(tmp_path):
    """--compile adds flex+compile: the same settings and byte counts as flex, its own profile of the compiled step."""
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert (
        rst.main(
            [
                "--tiny",
                "--reps",
                "1",
                "--attention",
                "flex",
                "--compile",
                "--budget-s",
                "600",
                "--json",
                str(out),
                "--md",
                str(md),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert not [r for r in res["rows"] if "error" in r]
    by = {}
    for r in res["rows"]:
        by.setdefault(r["attention"], {})[r["setting"]] = r
    assert set(by) == {"flex", "flex+compile"} and by["flex"].keys() == by["flex+compile"].keys()
    for name, r in by["flex+compile"].items():
        assert r["ms_median"] > 0 and r["kv_bytes_read"] == by["flex"][name]["kv_bytes_read"]
        assert r["first_step_s"] > 0 and r["compile_dropped"] is False
        # the full prefix (16) runs compiled, as 01 does; the small prefix steps eagerly
        assert r["compiled"] is (r["prefix"] == 16), name
    assert all(r["compiled"] is False for r in by["flex"].values())
    # the compile is paid once per slot prefix: the second setting on prefix 16 replays what the first compiled
    assert by["flex+compile"]["long"]["first_step_s"] < by["flex+compile"]["bulk"]["first_step_s"]
    assert (
        res["profile"]["attention"] == "flex"
        and res["profile_compiled"]["attention"] == "flex+compile"
    )
    assert "Top kernels of one compiled `bulk` step (flex+compile" in md.read_text()
    assert (
        "flex+compile (eager: prefix < compile_min_prefix) | tail, small prefix" in md.read_text()
    )


def test_kernel_rows_count_device_events_once():
    """A CUDA profile lists a kernel twice (its launcher record on the CPU, the kernel on the device) and a CPU op
    (aten::mm) with its kernels' time as self device time: only device-side events count (the compiled step's table of
    lease 2026-12-03b summed 9.98 ms for a 5.3 ms step)."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    cpu, dev = DeviceType.CPU, DeviceType.CUDA
    evs = [
        E(
            key="triton_flex",
            count=30,
            device_type=cpu,
            self_device_time_total=3000.0,
            self_cpu_time_total=50.0,
        ),
        E(
            key="triton_flex",
            count=30,
            device_type=dev,
            self_device_time_total=3000.0,
            self_cpu_time_total=0.0,
        ),
        E(
            key="aten::mm",
            count=4,
            device_type=cpu,
            self_device_time_total=1000.0,
            self_cpu_time_total=80.0,
        ),
        E(
            key="nvjet_gemm",
            count=4,
            device_type=dev,
            self_device_time_total=1000.0,
            self_cpu_time_total=0.0,
        ),
        E(
            key="aten::argmax",
            count=1,
            device_type=cpu,
            self_device_time_total=0.0,
            self_cpu_time_total=9.0,
        ),
    ]
    rows = rst.kernel_rows(evs, cuda=True)
    assert [(r["kernel"], r["calls"], r["us"]) for r in rows] == [
        ("triton_flex", 30, 3000.0),
        ("nvjet_gemm", 4, 1000.0),
        ("(all)", 34, 4000.0),
    ]
    assert rows[0]["share"] == 0.75 and rows[1]["share"] == 0.25
    # on the CPU the ops' own CPU time is the figure (device events have none)
    rows = rst.kernel_rows(evs, cuda=False, rows=2)
    assert [(r["kernel"], r["us"]) for r in rows] == [
        ("aten::mm", 80.0),
        ("triton_flex", 50.0),
        ("(all)", 139.0),
    ]
