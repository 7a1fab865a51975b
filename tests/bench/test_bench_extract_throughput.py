"""bench/extract_throughput.py at tiny sizes on CPU: the pipeline run checks that shards encoded on
the capture device are the CPU path's bytes; ``--writer-only`` times the writer without a model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "extract_throughput", ROOT / "bench" / "extract_throughput.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_pipeline_bench_checks_device_encoding_bytes(tmp_path, tiny_llama_dir, dtype):
    out = tmp_path / "r.json"
    rc = _bench().main(
        [
            "--config",
            str(ROOT / "configs" / "tiny-llama.yaml"),
            "--set",
            f"verifier.path={tiny_llama_dir}",
            "--set",
            f"extract.storage_dtype={dtype}",
            "--device",
            "cpu",
            "--batch",
            "3",
            "--seq",
            "16",
            "--batches",
            "2",
            "--repeats",
            "1",
            "--write-threads",
            "2",
            "--no-serial",
            "--no-disk",
            "--out-dir",
            str(tmp_path),
            "--json",
            str(out),
            "--checksums",
            "xxh3_128",
            "sha256",
            "--zip-crc-off",
            "--threads-variants",
            "1",
            "--stream-save",
            "--switch-interval-variants",
            "0.005",
            "--profile",
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["device_encoding_bytes_equal"] is True and res["storage_dtype"] == dtype
    assert res["path_save_bytes_equal"] is True and res["hidden_states_equal_hf"] is True
    assert isinstance(res["profile"], dict)  # the sampler's own behaviour: test_stack_sampler below
    assert res["checksum"] == "xxh3_128"
    for k in (
        "pipeline",
        "capture_copy",
        "pipeline_sha256",
        "pipeline_nozipcrc",
        "pipeline_t1",
        "pipeline_streamsave",
        "pipeline_si0.005",
    ):
        assert res[f"{k}_tokens_per_s"] > 0
    assert res["capture_vs_bare_ratio_sha256"] > 0 and res["capture_copy_vs_bare_ratio"] > 0
    assert torch.serialization.get_crc32_options() is True  # the process-wide setting is restored
    assert res["save_via_path"] is True and res["switch_interval_s"] == 0.0005  # and the writer's
    assert sys.getswitchinterval() == 0.005


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_writer_only_bench(tmp_path, dtype):
    out = tmp_path / "w.json"
    rc = _bench().main(
        [
            "--config",
            str(ROOT / "configs" / "tiny-llama.yaml"),
            "--set",
            f"extract.storage_dtype={dtype}",
            "--writer-only",
            "--hidden",
            "64",
            "--batch",
            "4",
            "--seq",
            "32",
            "--batches",
            "2",
            "--repeats",
            "1",
            "--write-threads",
            "2",
            "--out-dir",
            str(tmp_path),
            "--json",
            str(out),
            "--checksums",
            "xxh3_128",
            "sha256",
            "--zip-crc-off",
            "--stream-save",
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["mode"] == "writer_only" and res["checksum"] == "xxh3_128"
    assert res["writer_stored_sha256_gb_per_s"] > 0 and res["writer_stored_nozipcrc_gb_per_s"] > 0
    assert res["writer_stored_streamsave_gb_per_s"] > 0
    assert res["bytes_per_token"] == (4 * 64 * 2 if dtype == "bfloat16" else 4 * (64 + 4))
    for k in ("writer_list", "writer_stored", "disk"):
        assert res[f"{k}_gb_per_s"] > 0
    assert res["writer_stored_vs_disk_ratio"] > 0
    assert not list(tmp_path.glob("writer-bench-*")) and not list(
        tmp_path.glob("disk-bench-*")
    )  # cleaned up


def test_stack_sampler_attributes_time_to_the_calls_threads_sit_in():
    """A main thread spinning in Python and a named thread sleeping: each group's top stack is its own
    call, with nearly all of its samples (the sampler needs the GIL, so it samples less often than asked)."""
    import threading
    import time

    sys.path.insert(0, str(ROOT / "bench"))
    from stack_sampler import StackSampler

    def spin() -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.4:
            sum(range(100))

    def nap() -> None:
        time.sleep(0.4)

    with StackSampler(interval=0.002, depth=2) as s:
        th = threading.Thread(target=nap, name="napper_0")
        th.start()
        spin()
        th.join()
    tab = s.table(top=20)

    def share(group: str, func: str) -> float:  # over every line of ``func`` (the leaf line varies)
        return sum(
            sh
            for st, sh in tab[group]["top"]
            if st.startswith(f"test_bench_extract_throughput.py:{func}:")
        )

    assert {"main", "napper"} <= set(
        tab
    )  # (other threads of the test process, e.g. tqdm's monitor, too)
    assert tab["main"]["samples"] >= 10 and share("main", "spin") >= 0.8
    assert share("napper", "nap") >= 0.8
