"""Fault injection: ``04_train.py`` killed with SIGKILL at seeded random points, then resumed, ends with
the same parameters as an uninterrupted run; SIGTERM writes a final checkpoint and exits 143 (128 + SIGTERM) without exporting."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import pythonpath

from eagle3.config import load_config  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN = {
    "epochs": 2,
    "batch_size": 1,
    "ckpt_every": 3,
    "keep_checkpoints": 2,
    "log_every": 1,
    "eval_every": 100,
}
TOTAL = 16  # 8 samples x 2 epochs


def _start(cfg_path: Path, *extra: str) -> subprocess.Popen:
    env = dict(
        os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=pythonpath(ROOT), OMP_NUM_THREADS="1"
    )  # = the in-process reference
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "04_train.py"), "--config", str(cfg_path), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _train_steps(train_dir: Path) -> list[int]:
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("kind") == "train":
            steps.append(row["step"])
    return steps


def _wait_progress(
    proc: subprocess.Popen, train_dir: Path, after: int, timeout: float = 120.0
) -> bool:
    """Wait until metrics.jsonl has a train row with step > ``after``; False if the process ended first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return False
        steps = _train_steps(train_dir)
        if steps and steps[-1] > after:
            return True
        time.sleep(0.05)
    raise AssertionError("no training progress within the timeout")


def _final_model(train_dir: Path) -> dict:
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(train_dir)[-1][1])
    assert state["step"] == TOTAL
    return state["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Final trainable parameters of an uninterrupted run (in-process, CPU)."""
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path_factory.mktemp("ref"), train=TRAIN))
    run(cfg, device="cpu")
    return _final_model(cfg.train_dir)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_uninterrupted(tmp_path, reference):
    ref = reference
    cfg_path = make_tiny_run(tmp_path / "killed", train=TRAIN)
    train_dir = load_config(cfg_path).train_dir
    rng = random.Random(20261129)
    kills = 0
    for _attempt in range(3):
        before = (_train_steps(train_dir) or [0])[-1]
        proc = _start(cfg_path, "--resume")
        if _wait_progress(proc, train_dir, before):
            time.sleep(
                rng.uniform(0.0, 1.0)
            )  # somewhere in a step, a checkpoint write or a log write
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        proc.communicate(timeout=60)
    assert kills >= 2, "the kills should land while training runs"
    proc = _start(cfg_path, "--resume")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    _assert_same(ref, _final_model(train_dir))
    # every step logged exactly once after the dedupe on resume
    assert _train_steps(train_dir) == list(range(1, TOTAL + 1))
    assert not any(".tmp-" in p.name for p in ckpt.ckpt_dir(train_dir).iterdir())
    assert (load_config(cfg_path).export_dir / "model.safetensors").is_file()


@pytest.mark.slow
def test_sigterm_writes_final_checkpoint_and_exits_143(tmp_path, reference):
    ref = reference
    cfg_path = make_tiny_run(tmp_path / "term", train=TRAIN)
    train_dir = load_config(cfg_path).train_dir
    proc = _start(cfg_path)
    assert _wait_progress(proc, train_dir, 1)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[
        -2000:
    ]  # `04 && 05` must not go on to benchmark
    assert "stopped at step" in err
    assert "interrupted by SIGTERM at step" in err and "--resume" in err
    stopped_at = _train_steps(train_dir)[-1]
    assert stopped_at < TOTAL
    newest = ckpt.list_checkpoints(train_dir)[-1][0]
    assert (
        newest == stopped_at
    )  # the final checkpoint is at the step that was running when SIGTERM came
    assert not (load_config(cfg_path).export_dir).exists()  # stopped early: no export
    rep = json.loads((train_dir / "train_report.json").read_text())  # a stopped run is reported too
    assert (
        rep["stopped"]
        and rep["signal"] == signal.SIGTERM
        and rep["step"] == stopped_at
        and not rep["final_val"]
    )
    assert (
        f"**stopped** by signal {int(signal.SIGTERM)} at step {stopped_at}"
        in (train_dir / "train_report.md").read_text()
    )
    proc = _start(cfg_path, "--resume")
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    rep = json.loads((train_dir / "train_report.json").read_text())
    assert not rep["stopped"] and rep["step"] == TOTAL  # the resumed run rewrites it
    _assert_same(ref, _final_model(train_dir))


def test_interrupted_exit_code_and_message(capsys):
    from eagle3.stages import train as cli

    res = {
        "step": 3,
        "total_steps": 10,
        "stopped": True,
        "signal": int(signal.SIGINT),
        "checkpoint": "ck/step_3",
    }
    assert cli.interrupted_exit(res) == 130
    err = capsys.readouterr().err
    assert err.strip() == (
        "interrupted by SIGINT at step 3/10: checkpoint ck/step_3, nothing exported; "
        "continue with the same command plus --resume"
    )
    # a DDP rank that stopped because another rank got the signal exits like that rank (SIGTERM)
    assert cli.interrupted_exit({**res, "signal": None}) == 143
    capsys.readouterr()


def test_interrupted_line_is_printed_once_under_torchrun(capsys, monkeypatch):
    """Under torchrun every rank printed `interrupted by SIGINT at step ...`: 2 copies on 2 processes (fresh-user trial
    2026-12-05d; README: one stderr line). Rank 0 prints it; every rank still exits 128 + signal."""
    from eagle3.stages import train as cli

    res = {
        "step": 3,
        "total_steps": 10,
        "stopped": True,
        "signal": int(signal.SIGINT),
        "checkpoint": "ck/step_3",
    }
    monkeypatch.setenv("RANK", "1")
    assert cli.interrupted_exit(res) == 130 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.interrupted_exit(res) == 130 and capsys.readouterr().err.startswith(
        "interrupted by SIGINT at step 3/10"
    )


def _load_cli(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cli_" + Path(script).stem, ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("where", ["prepare_target_head", "init_drafter"])
def test_ctrl_c_during_startup_stops_at_once_leaving_nothing(tmp_path, monkeypatch, capsys, where):
    """Ctrl-C while 04 extracts the verifier head (or builds the drafter), before the first step: exit 130 with the
    one-line message, no checkpoint, no train folder this call made; the same command without --resume then runs."""
    from eagle3.cli import run_main
    from eagle3.stages import train as stage
    from eagle3.train import inputs as trainer
    from eagle3.verifier.head import TargetHead

    path = make_tiny_run(tmp_path, n_train=4, n_val=0, train={"epochs": 1, "batch_size": 2})
    cfg = load_config(path)
    head = TargetHead.load(cfg.train_dir)
    fresh = (
        where == "prepare_target_head"
    )  # this call makes the train folder (else an earlier head is there)
    if fresh:
        (cfg.train_dir / "target_head.safetensors").unlink()
        cfg.train_dir.rmdir()
    real = getattr(trainer, where)

    def interrupted(*a, **k):  # the real step, then Ctrl-C arrives while it runs
        if where == "prepare_target_head":
            head.save(cfg.train_dir)  # what the extraction writes
            out = head
        else:
            out = real(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(trainer, where, interrupted)
    with pytest.raises(SystemExit) as e:
        run_main(
            _load_cli("04_train.py").main, ["--config", str(path), "--set", "verifier.device=cpu"]
        )
    assert e.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted by SIGINT: stopped during start-up, before the first optimizer step: nothing trained, no "
        "checkpoint written; re-run the same command"
    )
    if fresh:
        assert not cfg.train_dir.exists()  # neither a checkpoint nor the head this call wrote
        head.save(cfg.train_dir)
    else:
        assert sorted(p.name for p in cfg.train_dir.iterdir()) == [
            "target_head.safetensors"
        ]  # kept, nothing added
    assert (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )  # the StopFlag handler is gone
    monkeypatch.setattr(trainer, where, real)
    res = stage.run(cfg, device="cpu", stop_after=1)  # not refused: no checkpoint was left behind
    assert res["step"] == 1 and ckpt.list_checkpoints(cfg.train_dir)[-1][0] == 1


def test_a_second_04_on_the_same_train_folder_is_refused(tmp_path):
    """A second 04 (`--resume` started while the first still ran) trained beside the first in one train folder:
    it deleted the first's in-flight checkpoint temp files, appended a second copy of every metrics row and wrote the
    same export (fresh-user trial 2026-12-05d). 04 now holds {train_dir}/.train.lock: the second stops at once with
    one line, writes nothing, and leaves no folder it made; once the first is done, the lock file is gone."""
    from eagle3.errors import UserError
    from eagle3.io import exclusive_lock
    from eagle3.stages.train import run

    TRAIN_LOCK = ".train.lock"

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 1, "batch_size": 2, "ckpt_every": 100})
    )
    other = load_config(make_tiny_run(tmp_path), [f"train.output_dir={tmp_path / 'fresh'}"])
    for c in (cfg, other):
        c.train_dir.mkdir(parents=True, exist_ok=True)
        before = sorted(p.name for p in c.train_dir.iterdir())
        with exclusive_lock(c.train_dir / TRAIN_LOCK, "the first run"):
            with pytest.raises(UserError) as e:
                run(c, device="cpu", resume=True)
            assert str(e.value) == (
                f"{c.train_dir / TRAIN_LOCK}: another 04_train run is training or exporting in "
                f"{c.train_dir}; "
                f"wait for it to end (or stop it) before this one"
            )
            assert sorted(p.name for p in c.train_dir.iterdir()) == sorted(before + [TRAIN_LOCK])
    assert run(cfg, device="cpu")["step"] >= 1
    assert not (cfg.train_dir / TRAIN_LOCK).exists()
    (tmp_path / "fresh").rmdir()
    refused = load_config(
        make_tiny_run(tmp_path),
        [f"train.output_dir={tmp_path / 'fresh2'}", f"data.output_dir={tmp_path / 'nodata'}"],
    )
    with pytest.raises(
        UserError, match="file not found"
    ):  # a refusal leaves no lock file and no folder it made
        run(refused, device="cpu")
    assert not (tmp_path / "fresh2").exists()
