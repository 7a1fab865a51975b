"""Stage 02 under torchrun (2 CPU ranks, gloo) on the tiny random Llama verifier.

The reference is one process in the same thread setting (1 intra-op thread, as torchrun sets),
so the tensors must be bit-identical: the ranks capture batches of the same global batch plan.
Checked: a 2-rank run equals the single-process run (ids, tensors, manifest rows, data_config
counts); a 2-rank run SIGKILLed mid-way, with some shards then deleted, is finished by a
1-process run to the same shard set; a second job on a locked folder is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _paths import pythonpath

from eagle3.config import load_config
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.read import load_sample
from eagle3.stages.extract import run

ROOT = Path(__file__).resolve().parents[2]
N_PROMPTS = 12
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
COUNT_KEYS = (
    "num_samples",
    "num_tokens",
    "num_loss_tokens",
    "skipped",
    "truncated",
    "aux_layers",
    "config_fingerprint",
    "prompts_sha256",
    "rows_per_dir",
)


def _config(base: Path, model_dir: Path) -> Path:
    """Run config + prompts under ``base`` (prompt 5 has no assistant turn: skipped)."""
    base.mkdir(parents=True, exist_ok=True)
    with open(base / "prompts.jsonl", "w") as f:
        for i in range(N_PROMPTS):
            msgs = [{"role": "user", "content": f"Question {i}: list {i % 5 + 1} words."}]
            if i != 5:
                ans = (
                    "Sure: "
                    + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (3 * i) % 9))
                    + "."
                )
                msgs.append({"role": "assistant", "content": ans})
            f.write(json.dumps({"id": f"q{i}", "messages": msgs}) + "\n")
    cfg = {
        "run_name": "dist",
        "output_root": str(base),
        "verifier": {
            "path": str(model_dir),
            "name": "tiny-llama",
            "dtype": "float32",
            "device": "cpu",
        },
        "prompts": {"source": "humaneval"},
        "extract": {
            "aux_layers": [1, 3, 4],
            "max_length": 96,
            "batch_tokens": 60,
            "rows_per_dir": 4,
        },
    }
    p = base / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _env(sleep: float = 0.0) -> dict:
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1",
            "PYTHONPATH": pythonpath(ROOT),
            "EAGLE3_EXTRACT_SLEEP_PER_BATCH": str(sleep),
        }
    )
    return env


def _torchrun(cfg: Path, nproc: int = 2) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "02_extract_hidden.py"),
        "--config",
        str(cfg),
    ]


def _single(cfg: Path) -> dict:
    """One in-process run with 1 intra-op thread (the torchrun ranks' setting)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(load_config(cfg))
    finally:
        torch.set_num_threads(n)


def _children(pid: int) -> list[int]:
    """Direct child pids of ``pid`` (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a zombie has released its files and locks)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _assert_same(root: Path, ref_root: Path) -> None:
    got = {i: load_sample(p) for i, p in list_samples(root)}
    ref = {i: load_sample(p) for i, p in list_samples(ref_root)}
    assert sorted(got) == sorted(ref) == list(range(N_PROMPTS - 1))
    for idx in ref:
        a, b = got[idx], ref[idx]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        assert len(a["hidden_states"]) == 4
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert x.dtype == torch.bfloat16 and torch.equal(x, y), (
                f"sample {idx} differs from one process"
            )
    rows = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["idx"] for r in rows) == list(range(N_PROMPTS - 1))  # each idx exactly once
    assert (
        read_manifest(root / "manifest.jsonl").rows
        == read_manifest(ref_root / "manifest.jsonl").rows
    )
    assert not list(root.glob("manifest.rank*")) and not list(root.rglob("*.tmp-*"))
    meta, ref_meta = read_data_config(root), read_data_config(ref_root)
    for key in COUNT_KEYS:
        assert meta[key] == ref_meta[key], key
    assert meta["num_samples"] == N_PROMPTS - 1 and meta["skipped"] == {"skipped_no_loss_tokens": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_llama_dir) -> Path:
    base = tmp_path_factory.mktemp("ref")
    s = _single(_config(base, tiny_llama_dir))
    assert s["written"] == N_PROMPTS - 1 and "ranks" not in s  # single process: report as before
    return base / "shards"


def test_two_ranks_equal_one_process(tmp_path, tiny_llama_dir, reference):
    cfg = _config(tmp_path, tiny_llama_dir)
    r = subprocess.run(
        _torchrun(cfg), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "shards"
    _assert_same(root, reference)
    report = json.loads((root / "extract_report.json").read_text())
    assert report["world_size"] == 2 and [g["rank"] for g in report["ranks"]] == [0, 1]
    assert all(g["written"] > 0 for g in report["ranks"])  # the batches really were spread
    assert sum(g["written"] for g in report["ranks"]) == report["written"] == N_PROMPTS - 1
    assert report["captured_tokens_per_s"] > 0 and report["samples_per_s"] > 0
    # rank 0 prints per-rank and total samples/s, once
    assert r.stdout.count("rank 0: ") == 1 and r.stdout.count("rank 1: ") == 1
    assert r.stdout.count(f"total (2 ranks): {N_PROMPTS - 1} samples") == 1
    assert r.stdout.count(f"{N_PROMPTS - 1} samples ({N_PROMPTS - 1} written, 0 resumed)") == 1


def test_killed_two_rank_run_finished_by_one_process(tmp_path, tiny_llama_dir, reference):
    cfg = _config(tmp_path, tiny_llama_dir)
    root = tmp_path / "shards"

    def rank_lines() -> int:
        return sum(p.read_bytes().count(b"\n") for p in root.glob("manifest.rank*.jsonl"))

    proc = subprocess.Popen(
        _torchrun(cfg),
        cwd=ROOT,
        env=_env(sleep=0.4),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while rank_lines() < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the 2-rank run finished before it could be killed"
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:  # the ranks die (torchrun starts them in sessions of their own)
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(_alive(pid) for pid in workers)
        proc.wait(timeout=60)  # torchrun sees its workers fail and gives up
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    parts = sorted(p.name for p in root.glob("manifest.rank*.jsonl"))
    assert parts == ["manifest.rank0.jsonl", "manifest.rank1.jsonl"], parts
    assert not (root / "data_config.json").exists()
    on_disk = [i for i, _ in list_samples(root)]
    assert 3 <= len(on_disk) < N_PROMPTS - 1, on_disk
    for idx, p in list_samples(root)[:2]:  # lose two finished shards as well
        p.unlink()
    kept = {i: p.stat().st_mtime_ns for i, p in list_samples(root)}

    s = _single(cfg)  # resumed with a different world size
    assert s["resumed"] == len(kept) and s["written"] == N_PROMPTS - 1 - len(kept)
    _assert_same(root, reference)
    assert all(
        p.stat().st_mtime_ns == kept[i] for i, p in list_samples(root) if i in kept
    )  # not rewritten


def test_second_job_refused_by_folder_lock(tmp_path, tiny_llama_dir):
    cfg = _config(tmp_path, tiny_llama_dir)
    root = tmp_path / "shards"
    root.mkdir()
    with open(root / ".extract.lock", "a+") as f:
        fcntl.flock(
            f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB
        )  # an independent run holds the folder
        r = subprocess.run(
            _torchrun(cfg), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
        )
    assert r.returncode != 0
    assert (
        r.stderr.count("another 02_extract_hidden run is writing") == 1
    )  # one line for the job (was one a rank)
    assert not (root / "extract_state.json").exists() and not list(root.rglob("*.pt"))


RANK1_ARGS = (
    Path(__file__).resolve().parents[1] / "_rank1_args.py"
)  # extra arguments on rank 1 alone


@pytest.mark.slow
def test_a_rank_with_other_settings_is_refused_before_capture(tmp_path, tiny_llama_dir):
    """Each rank reads the config and prompts.jsonl itself; rank 1 with another ``extract.max_length`` (a node with
    another copy of the config; here extra ``--set`` arguments for rank 1 alone) tokenized other samples, and rank 0
    stopped after the capture in a `RuntimeError: stage 02: samples [...] were assigned to no rank (bug)` traceback,
    the per-rank manifests left behind. Now one line names rank 1 and the setting, before anything is written."""
    cfg = _config(tmp_path / "a", tiny_llama_dir)
    wrap = RANK1_ARGS
    env = dict(_env(), RANK1_EXTRA="--set extract.max_length=40")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(wrap),
        *_torchrun(cfg)[5:],
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert p.returncode != 0 and "exitcode  : 2" in out
    assert errors == [
        f"error: {tmp_path / 'a' / 'shards'}: torchrun rank 1 read other 02 settings or prompts than "
        f"rank 0 (differing: extract.max_length); every rank must read the same config and "
        f"{tmp_path / 'a' / 'prompts.jsonl'} (a node with another copy?)"
    ], out[-3000:]
    assert (
        "[rank0]" not in out and "[rank1]" not in out and not (tmp_path / "a" / "shards").exists()
    ), out[-3000:]
