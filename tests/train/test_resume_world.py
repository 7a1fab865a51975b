"""Issue 26 item 2: resuming on another number of processes trains each sample once per epoch.

10 training samples, batch 1; a run on ``a`` gloo processes stops after some steps (checkpoint
``samples_in_epoch``), the resume on ``b`` processes finishes epoch 0. Every sample the two runs load
is recorded (tests/_ddp_worker.py ``record_loads``): no sample twice, none skipped except the tail that
does not fill all ``b`` ranks (``drop_last``), for fixed-size batches and token-budget batches
(``train.batch_tokens``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, record_loads, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env

from eagle3.config import load_config  # noqa: E402
from eagle3.data.batching import TokenBudgetBatchSampler  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/ (the _ddp_worker.py helper)
N_TRAIN, LENGTHS, BUDGET = 10, (12, 9, 16, 7), 20


def _train(
    yaml: Path, nproc: int, record: Path, stop_after: int, resume: bool, monkeypatch
) -> None:
    extra = ["--stop-after", str(stop_after), "--record", str(record)] + (
        ["--resume"] if resume else []
    )
    if nproc == 1:  # in-process (RANK unset: one process, no process group)
        from eagle3.data.dataset import ShardDataset
        from eagle3.stages.train import run

        monkeypatch.setattr(
            ShardDataset, "__getitem__", ShardDataset.__getitem__
        )  # restored after the test
        record_loads(Path(f"{record}.0"))
        run(load_config(yaml), resume=resume, stop_after=stop_after, device="cpu")
        return
    env = child_env(HERE.parent)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(HERE / "_ddp_worker.py"),
        "--config",
        str(yaml),
        *extra,
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


def _seen(record: Path) -> list[int]:
    ids = []
    for f in sorted(record.parent.glob(record.name + ".*")):
        ids += [int(x) for x in f.read_text().split()]
    return [i for i in ids if i < N_TRAIN]  # validation samples (ids 10, 11) are not training


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["batch_size", "batch_tokens"])
@pytest.mark.parametrize("a,b", [(2, 1), (1, 2)])
def test_resume_on_another_process_count_trains_each_sample_once(
    tmp_path, monkeypatch, a, b, budget
):
    train = {"batch_size": 1, "grad_accum": 1, "epochs": 1, "ckpt_every": 1, "batch_tokens": budget}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    cfg = load_config(yaml)
    first = (
        2 if a == 2 else 3
    )  # steps before the stop: 4 samples on 2 processes, 3 on 1 (odd: not a multiple of b)
    _train(yaml, a, tmp_path / "A", first, False, monkeypatch)
    seen_a = _seen(tmp_path / "A")
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(cfg.train_dir)[-1][1])
    assert (
        state["world_size"] == a
        and state["samples_in_epoch"] == len(seen_a)
        and len(set(seen_a)) == len(seen_a)
    )

    # the rest of epoch 0 on b processes, by an independent count of what is left
    if budget is None:
        perm = torch.randperm(
            N_TRAIN, generator=torch.Generator().manual_seed(0)
        ).tolist()  # seed + epoch 0
        assert sorted(seen_a) == sorted(
            perm[: len(seen_a)]
        )  # steps consumed a prefix of the epoch's permutation
        left = (N_TRAIN - len(seen_a)) // b
        expect = perm[: len(seen_a) + left * b]
    else:
        lengths = [LENGTHS[i % len(LENGTHS)] for i in range(N_TRAIN)]
        plan = TokenBudgetBatchSampler(lengths, budget, seed=0).epoch_batches(
            0
        )  # 1 process: the uncut plan
        done = first * a  # global batches of the first run
        assert sorted(seen_a) == sorted(i for bt in plan[:done] for i in bt)
        left = (len(plan) - done) // b
        expect = [i for bt in plan[: done + left * b] for i in bt]
    _train(yaml, b, tmp_path / "B", left, True, monkeypatch)
    seen = seen_a + _seen(tmp_path / "B")
    assert len(seen) == len(set(seen)), (
        f"replayed: {sorted(i for i in set(seen) if seen.count(i) > 1)}"
    )
    assert sorted(seen) == sorted(expect)  # nothing skipped but the tail that does not fill b ranks
    assert N_TRAIN - len(seen) < b * (1 if budget is None else max(len(x) for x in plan))
    last = ckpt.load_checkpoint(ckpt.list_checkpoints(cfg.train_dir)[-1][1])
    assert (last["epoch"], last["samples_in_epoch"], last["world_size"]) == (0, len(seen), b)
    assert last["steps_in_epoch"] == first + left


def test_resume_on_another_process_count_names_it_as_the_schedule_change(
    tmp_path, monkeypatch, caplog
):
    """The lr schedule's horizon follows the new process count on a resume; its warning said "(max_steps/epochs
    changed)" when neither had (fresh-user trial 2026-12-05d): it now names the process counts, and a changed
    train.epochs by its values."""
    import logging

    train = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 1}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    _train(yaml, 2, tmp_path / "A", 2, False, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        _train(yaml, 1, tmp_path / "B", 3, True, monkeypatch)
    lines = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert len(lines) == 1 and "max_steps/epochs" not in lines[0], lines
    assert lines[0].endswith(
        "(2 processes then, 1 now: the steps of train.epochs follow the new split); "
        "continuing with the new one"
    ), lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        run_cfg = load_config(yaml, ["train.epochs=3"])
        from eagle3.stages.train import run

        run(run_cfg, resume=True, stop_after=4, device="cpu")
    lines = [r.getMessage() for r in caplog.records if "LR schedule" in r.getMessage()]
    assert len(lines) == 1 and "(train.epochs 2 -> 3); continuing" in lines[0], lines


@pytest.mark.slow
def test_resume_warnings_under_torchrun_are_logged_by_rank_0_only(tmp_path, monkeypatch):
    """A resume on 2 gloo processes of a 1-process checkpoint, with a changed setting and a broken newest checkpoint
    file: each of its warnings (the skipped file, the older one used, the changed settings, RNG reseeded, the lr
    schedule re-stretched) was logged by every rank; now once, by rank 0 (whose warnings train_report collects)."""
    train = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 1}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    _train(yaml, 1, tmp_path / "A", 2, False, monkeypatch)
    cfg = load_config(yaml)
    ckpt.ckpt_path(cfg.train_dir, 3).write_bytes(b"PK\x03\x04 torn")  # an unusable newest file
    env = child_env(HERE.parent)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_ddp_worker.py"),
        "--config",
        str(yaml),
        "--set",
        "train.grad_clip=0.25",
        "--resume",
        "--stop-after",
        "1",
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if " WARNING " in ln]
    for marker in (
        "skipping unusable checkpoint",
        "using step_00000002.pt (step 2), not the newest checkpoint file",
        "with other training settings: train.grad_clip 0.5 -> 0.25",
        "RNG states reseeded",
        "LR schedule",
    ):
        said = [ln.split(" ", 1)[0] for ln in lines if marker in ln]
        assert said == ["rank0"], (marker, lines)


@pytest.mark.slow
def test_resume_on_more_processes_steps_every_rank_with_the_same_lr(tmp_path, monkeypatch):
    """A 1-process checkpoint resumed on 2 gloo processes: the new process count gives the run another step horizon
    (11 steps, against 10 for a fresh 2-process run), and the lr schedule was re-stretched to it on rank 0 only (the
    update sat under the rank-0 log line), so rank 1 stepped with the fresh run's lr and the DDP replicas drifted
    apart. Every rank now steps with the same lr, the re-stretched schedule's."""
    train = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 1, "warmup_ratio": 0.25}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    _train(yaml, 1, tmp_path / "A", 3, False, monkeypatch)
    env = child_env(HERE.parent)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_ddp_worker.py"),
        "--config",
        str(yaml),
        "--resume",
        "--record-lr",
        str(tmp_path / "lr"),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lrs = [(tmp_path / f"lr.{r}").read_text().split() for r in (0, 1)]
    assert len(lrs[0]) == 11 - 3 and lrs[0] == lrs[1], lrs
    report = __import__("json").loads(
        (load_config(yaml).train_dir / "train_report.json").read_text()
    )
    assert report["step"] == report["total_steps"] == 11


@pytest.mark.slow
def test_resume_on_fewer_processes_keeps_the_global_batch_with_grad_accum(
    tmp_path, monkeypatch, caplog
):
    """2 gloo ranks x batch 1 stopped at step 3, resumed on 1 process: keeping the global batch (2) needs
    train.grad_accum=2, which was refused (`written with train.grad_accum=1 ...`), so the only resume allowed halved
    the global batch, with no word of it. grad_accum (and batch_size) may now change where they keep the global
    batch: the resumed run ends with the weights of an uninterrupted run of that global batch. A resume that does
    change it names it, and the grad_accum that keeps it."""
    import logging

    from eagle3.stages.train import run

    train = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 1}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    ref_yaml = make_tiny_run(
        tmp_path / "ref", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train
    )
    ref = run(
        load_config(ref_yaml, ["train.grad_accum=2"]), device="cpu"
    )  # uninterrupted, global batch 2
    _train(yaml, 2, tmp_path / "A", 3, False, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        got = run(load_config(yaml, ["train.grad_accum=2"]), resume=True, device="cpu")
    assert not [r for r in caplog.records if "global batch" in r.getMessage()]
    assert got["step"] == ref["step"] == 10
    a = ckpt.load_checkpoint(ckpt.ckpt_path(load_config(ref_yaml).train_dir, 10))["model"]
    b = ckpt.load_checkpoint(ckpt.ckpt_path(load_config(yaml).train_dir, 10))["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    assert abs(got["final_val"]["loss"] - ref["final_val"]["loss"]) < 1e-4

    other = make_tiny_run(
        tmp_path / "other", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train
    )
    _train(other, 2, tmp_path / "B", 3, False, monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        run(load_config(other), resume=True, stop_after=1, device="cpu")
    said = [r.getMessage() for r in caplog.records if "global batch" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        "with other training settings: global batch 2 -> 1 samples per optimizer step (train.batch_size x "
        "train.grad_accum x processes: 1 x 1 x 2 then, 1 x 1 x 1 now); --set train.grad_accum=2 keeps the "
        "checkpoint's"
    ), said
    report = __import__("json").loads(
        (load_config(other).train_dir / "train_report.json").read_text()
    )
    assert any("global batch 2 -> 1" in w for w in report["warnings"])


@pytest.mark.slow
def test_resume_where_a_rank_sees_no_checkpoint_is_refused(tmp_path, monkeypatch):
    """Each rank looks for the newest checkpoint itself; a rank that saw none (a node-local train.output_dir; here rank
    1's lookup is made to find nothing) started from step 0 while rank 0 resumed at step 3, the DDP replicas training
    on from different weights and data positions. Every rank now compares what it found first: one UserError naming
    rank 1, nothing trained."""
    train = {"batch_size": 1, "grad_accum": 1, "epochs": 2, "ckpt_every": 1}
    yaml = make_tiny_run(tmp_path / "run", n_train=N_TRAIN, n_val=2, lengths=LENGTHS, train=train)
    _train(yaml, 2, tmp_path / "A", 3, False, monkeypatch)
    env = child_env(
        HERE.parent,
        HIDE_CHECKPOINTS_FROM_RANK="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_ddp_worker.py"),
        "--config",
        str(yaml),
        "--resume",
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    train_dir = load_config(yaml).train_dir
    assert p.returncode != 0
    assert (
        f"UserError: {ckpt.ckpt_dir(train_dir)}: --resume: torchrun rank 1 found no checkpoint, rank 0 "
        f"step_00000003.pt (step 3); every rank must see the same train.output_dir (a node-local folder?)"
    ) in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in ckpt.ckpt_dir(train_dir).iterdir()) == [
        "step_00000002.pt",
        "step_00000003.pt",
    ]
