"""Fault injection: SIGKILL stage 02 at seeded random points, re-run, compare with an uninterrupted run.

Stage 02 runs as a real subprocess on the tiny random Llama verifier. The hidden env var
``EAGLE3_EXTRACT_SLEEP_PER_BATCH`` (see ``eagle3.capture.loop``) slows each batch down so kills land
mid-run: during start-up, between batches, inside a shard write or between a shard's rename and
its manifest line. After the last kill the command is re-run to completion and the result must
equal an uninterrupted run: same sample ids, bit-identical tensors, every idx exactly once in the
manifest, no ``*.tmp-*`` left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.read import load_sample

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from _paths import pythonpath
from _signals import lines_settled, sigterm_when  # noqa: E402

N_PROMPTS = 14
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _prompts(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(N_PROMPTS):
            q = f"Question {i}: list {i % 5 + 1} words."
            a = (
                "Sure: "
                + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + (3 * i) % 9))
                + "."
            )
            f.write(
                json.dumps(
                    {
                        "id": f"q{i}",
                        "messages": [
                            {"role": "user", "content": q},
                            {"role": "assistant", "content": a},
                        ],
                    }
                )
                + "\n"
            )


def _config(base: Path, model_dir: Path) -> Path:
    cfg = {
        "run_name": "fault",
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
    base.mkdir(parents=True, exist_ok=True)
    p = base / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    _prompts(base / "prompts.jsonl")
    return p


def _env(sleep: float) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "EAGLE3_EXTRACT_SLEEP_PER_BATCH": str(sleep),
            "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1",
            "PYTHONPATH": pythonpath(ROOT),
        }
    )
    return env


def _cmd(cfg: Path) -> list[str]:
    return [sys.executable, str(ROOT / "02_extract_hidden.py"), "--config", str(cfg)]


def _manifest_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _load_all(root: Path) -> dict:
    return {idx: load_sample(p) for idx, p in list_samples(root)}


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume(tmp_path, tiny_llama_dir):
    # Uninterrupted reference run (same environment as the faulty runs: 1 thread, same batch plan).
    ref_cfg = _config(tmp_path / "ref", tiny_llama_dir)
    r = subprocess.run(
        _cmd(ref_cfg), cwd=ROOT, env=_env(0.0), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ref = _load_all(tmp_path / "ref" / "shards")
    n = len(ref)
    assert n == N_PROMPTS

    cfg = _config(tmp_path / "run", tiny_llama_dir)
    shards = tmp_path / "run" / "shards"
    manifest = shards / "manifest.jsonl"
    rng = random.Random(20261129)
    kills = []
    for trial in range(3):
        proc = subprocess.Popen(
            _cmd(cfg),
            cwd=ROOT,
            env=_env(0.25),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            start_lines = _manifest_lines(manifest)
            if trial == 0:
                time.sleep(rng.uniform(0.5, 3.0))  # during start-up / tokenization
                target = None
            else:
                target = min(start_lines + rng.randint(1, 3), n - 1)
                deadline = time.monotonic() + 240
                while (
                    _manifest_lines(manifest) < target
                    and proc.poll() is None
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.01)
                time.sleep(
                    rng.uniform(0.0, 0.3)
                )  # anywhere inside the next batch: capture, sleep, write
            proc.send_signal(signal.SIGKILL)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        kills.append((trial, target, _manifest_lines(manifest), rc))
    # every trial was really killed mid-run (not finished on its own), most after some shards landed
    assert all(rc == -signal.SIGKILL for *_, rc in kills), kills
    assert sum(lines > 0 for _, _, lines, _ in kills) >= 2, kills
    assert _manifest_lines(manifest) < n, kills
    assert not (shards / "data_config.json").exists()

    r = subprocess.run(
        _cmd(cfg), cwd=ROOT, env=_env(0.0), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]

    got = _load_all(shards)
    assert sorted(got) == sorted(ref) == list(range(n))
    for idx in range(n):
        a, b = got[idx], ref[idx]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert torch.equal(x, y), f"sample {idx} differs from the uninterrupted run"
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(r["idx"] for r in rows) == list(range(n))  # nothing lost, nothing duplicated
    assert (
        read_manifest(manifest).rows
        == read_manifest(tmp_path / "ref" / "shards" / "manifest.jsonl").rows
    )
    assert not list(shards.rglob("*.tmp-*"))
    meta, ref_meta = read_data_config(shards), read_data_config(tmp_path / "ref" / "shards")
    for key in ("num_samples", "num_tokens", "num_loss_tokens", "aux_layers", "config_fingerprint"):
        assert meta[key] == ref_meta[key]


@pytest.mark.slow
def test_sigterm_prints_the_resume_line_and_the_rerun_finishes(tmp_path, tiny_llama_dir):
    """SIGTERM mid-run: exit 143 and one stderr line (shards kept, re-run the same command), no traceback; the same
    command then finishes with the shards of an uninterrupted run."""
    ref_cfg = _config(tmp_path / "ref", tiny_llama_dir)
    r = subprocess.run(
        _cmd(ref_cfg), cwd=ROOT, env=_env(0.0), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = _config(tmp_path / "run", tiny_llama_dir)
    shards = tmp_path / "run" / "shards"
    manifest = shards / "manifest.jsonl"
    rc, err = sigterm_when(
        _cmd(cfg), lines_settled(manifest, 2, settle_s=0.1), env=_env(0.25), cwd=ROOT, wait_s=240
    )
    kept = _manifest_lines(manifest)
    assert rc == 143, err[-3000:]
    assert 2 <= kept < N_PROMPTS and not (shards / "data_config.json").exists()
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (
        f"interrupted by SIGTERM: {kept} finished shards kept in {shards}; re-run the same command "
        f"(without --overwrite) to resume"
    ), err[-3000:]

    r = subprocess.run(
        _cmd(cfg), cwd=ROOT, env=_env(0.0), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got, ref = _load_all(shards), _load_all(tmp_path / "ref" / "shards")
    assert sorted(got) == sorted(ref) == list(range(N_PROMPTS))
    for idx in range(N_PROMPTS):
        assert torch.equal(got[idx]["input_ids"], ref[idx]["input_ids"])
        for x, y in zip(got[idx]["hidden_states"], ref[idx]["hidden_states"]):
            assert torch.equal(x, y), f"sample {idx} differs from the uninterrupted run"
    assert (
        read_manifest(manifest).rows
        == read_manifest(tmp_path / "ref" / "shards" / "manifest.jsonl").rows
    )
