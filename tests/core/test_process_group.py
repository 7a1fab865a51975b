"""Process-group teardown (``eagle3.process_group``): the order of calls, the error path, the callers'
choice of barrier, and, on 2 real gloo ranks with a DDP step, that no gloo thread is left running when
the process reaches interpreter exit (the cause of the rare SIGABRT at exit of a finished torchrun run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _paths import child_env, pythonpath

from eagle3 import process_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def calls(monkeypatch):
    """Record barrier / destroy / gc calls instead of making them; a process group 'is initialised'."""
    log: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda group=None: log.append(("barrier", group)))
    monkeypatch.setattr(
        dist, "destroy_process_group", lambda group=None: log.append(("destroy", group))
    )
    monkeypatch.setattr(process_group.gc, "collect", lambda: log.append(("gc", None)))
    return log


def test_require_agreement_names_the_first_replica_that_differs_and_reads_no_further():
    from eagle3.errors import UserError

    read = []

    def values():
        for v in ["a", "a", "b", "c"]:
            read.append(v)
            yield v

    with pytest.raises(UserError) as e:
        process_group.require_agreement(values(), lambda i, first, v: f"#{i}: {v} != {first}")
    assert str(e.value) == "#2: b != a" and read == ["a", "a", "b"]
    process_group.require_agreement(iter([1, 1, 1]), lambda *a: "never")
    process_group.Dist().agree({"x": 1}, lambda *a: "never")  # a world of 1: nothing to compare


def test_a_rank_past_the_machine_s_gpus_is_refused_in_one_line(monkeypatch):
    """Two torchrun ranks on a one-GPU machine: rank 1 would ask for ``cuda:1`` (CUDA's "invalid device ordinal"
    traceback); it is refused naming LOCAL_RANK and the torchrun flag, and the ranks that fit get their GPU."""
    from eagle3.errors import UserError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert process_group.rank_cuda_device(0) == "cuda:0"
    with pytest.raises(UserError) as e:
        process_group.rank_cuda_device(1)
    assert str(e.value) == (
        "LOCAL_RANK=1: this machine has 1 GPU(s), one rank per GPU; "
        "start torchrun with --nproc_per_node 1 or fewer"
    )


def test_close_waits_at_the_barrier_then_destroys_then_collects(calls):
    group = object()
    process_group.close_process_group(group)
    assert calls == [("barrier", group), ("destroy", None), ("gc", None)]


def test_close_destroys_even_when_the_barrier_raises(calls, monkeypatch):
    def dead_peer(group=None):
        calls.append(("barrier", group))
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(dist, "barrier", dead_peer)
    with pytest.raises(RuntimeError, match="closed by peer"):
        process_group.close_process_group()
    assert calls == [("barrier", None), ("destroy", None), ("gc", None)]


def test_close_on_an_error_path_skips_the_barrier(calls):
    process_group.close_process_group(object(), barrier=False)
    assert calls == [("destroy", None), ("gc", None)]


def test_close_without_a_process_group_does_nothing(calls, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    process_group.close_process_group()
    assert calls == []


@pytest.mark.parametrize("fails", [False, True])
def test_trainer_run_closes_with_a_barrier_only_on_success(monkeypatch, fails):
    from eagle3.process_group import Dist
    from eagle3.stages import train as trainer

    ctrl = object()
    seen: list = []
    monkeypatch.setattr(
        trainer,
        "init_distributed",
        lambda device=None: Dist(
            rank=0, world=2, local_rank=0, device=None, ctrl_group=ctrl, initialized_here=True
        ),
    )

    def fake_run(*args, **kwargs):
        if fails:
            raise ValueError("boom")
        return {"step": 1}

    monkeypatch.setattr(trainer, "_run", fake_run)
    # the trainer tears down through process_group_scope, which calls this module attribute
    monkeypatch.setattr(
        process_group,
        "close_process_group",
        lambda group=None, *, barrier=True: seen.append((group, barrier)),
    )
    if fails:
        with pytest.raises(ValueError, match="boom"):
            trainer.run(cfg=None, device="cpu")
    else:
        assert trainer.run(cfg=None, device="cpu") == {"step": 1}
    assert seen == [(ctrl, not fails)]


def test_scope_barriers_when_the_block_finishes(calls):
    group = object()

    def work():
        with process_group.process_group_scope(group):
            return 7  # a return inside the block is a clean finish

    assert work() == 7
    assert calls == [("barrier", group), ("destroy", None), ("gc", None)]


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyboardInterrupt(), SystemExit(143)])
def test_scope_skips_the_barrier_when_an_exception_leaves_the_block(calls, exc):
    """An error, Ctrl-C or a signal's SystemExit: the group is destroyed without a barrier, the exception kept."""
    with pytest.raises(type(exc)):
        with process_group.process_group_scope(object()):
            calls.append(("work", None))
            raise exc
    assert calls == [("work", None), ("destroy", None), ("gc", None)]


@pytest.mark.parametrize("fails", [False, True])
def test_scope_not_owned_tears_nothing_down(calls, fails):
    """A group this process did not make (or a world of 1) is left alone on both paths."""
    try:
        with process_group.process_group_scope(object(), owned=False):
            if fails:
                raise ValueError("boom")
    except ValueError:
        pass
    assert calls == []


WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from eagle3.process_group import close_process_group, init_process_group

    init_process_group(backend="gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()  # gloo all-reduce of the gradients
    del model
    close_process_group()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    out = os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json")
    json.dump(sorted(n for n in names if "gloo" in n), open(out, "w"))
""")


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="needs Linux /proc to list threads"
)
def test_no_gloo_thread_outlives_close_on_two_ranks(tmp_path):
    """DDP's first ``import torch._dynamo`` pins a group made before it; ``init_process_group`` imports
    it first, so ``close_process_group`` really ends the gloo threads (3 are left without that)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = child_env(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(tmp_path),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    left = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert left == {0: [], 1: []}, f"gloo threads still running after close_process_group: {left}"


ONE_ERROR = textwrap.dedent("""
    import sys
    from eagle3.cli import Terminated, run_main
    from eagle3.errors import UserError

    def main(argv):
        if sys.argv[1] == "sigterm":
            raise Terminated()
        raise UserError(f"run.yaml:3: field 'train.lr': {sys.argv[1]}")

    run_main(main)
""")


def _rank(
    script: Path, what: str, rank: int, port: int, agent_store: bool = True
) -> tuple[int, str]:
    env = dict(
        os.environ,
        PYTHONPATH=pythonpath(ROOT),
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    p = subprocess.run(
        [sys.executable, str(script), what], env=env, capture_output=True, text=True, timeout=120
    )
    return p.returncode, p.stderr


def test_a_user_error_is_printed_by_the_first_rank_only(tmp_path):
    """Under torchrun every rank met the same bad config and printed the same ``error:`` line (N ranks, N lines). The
    ranks now claim one counter in torchrun's agent store (a TCPStore this test hosts, as the agent does): the first
    rank to stop prints, whichever it is (rank 1 here: rank 0 may never meet an error only rank 1 meets), the
    others print nothing, every rank exits 2; a rank torchrun then stops with SIGTERM does not add an
    ``interrupted by SIGTERM`` line. Without the agent's store every rank prints (nothing is hidden)."""
    script = tmp_path / "worker.py"
    script.write_text(ONE_ERROR)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    line = "error: run.yaml:3: field 'train.lr': bad\n"
    assert _rank(script, "bad", 1, agent.port) == (2, line)
    assert _rank(script, "bad", 0, agent.port) == (2, "")
    assert _rank(script, "other", 0, agent.port) == (
        2,
        "",
    )  # a different error after the first: still one line
    assert _rank(script, "sigterm", 0, agent.port) == (143, "")
    assert _rank(script, "bad", 0, agent.port, agent_store=False) == (2, line)
    assert _rank(script, "bad", 1, agent.port, agent_store=False) == (2, line)


@pytest.mark.slow
def test_a_bad_config_under_torchrun_prints_one_error_line(tmp_path):
    """The real thing: 04 under ``torchrun --nproc_per_node 2`` with a bad ``--set``: one ``error:`` line (was two),
    and torchrun reports the job failed."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path}\nverifier: {{path: {tmp_path}}}\nprompts: {{source: x}}\n"
    )
    env = child_env(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "04_train.py"),
        "--config",
        str(cfg),
        "--set",
        "train.lr=x",
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error: ")]
    assert p.returncode != 0
    assert errors == [
        "error: --set train.lr=x: field 'train.lr': Input should be a valid number, unable to parse "
        "string as a number (got 'x')"
    ], p.stderr[-3000:]


INTERRUPTED = textwrap.dedent("""
    import sys
    from eagle3.cli import resume_on_interrupt, run_main

    def main(argv):
        with resume_on_interrupt(lambda: "3 finished shards kept; re-run the same command to resume"):
            raise KeyboardInterrupt  # Ctrl-C
    run_main(main)
""")


def test_a_ctrl_c_is_reported_by_the_first_rank_only(tmp_path):
    """A Ctrl-C under torchrun reaches every rank (the terminal signals the whole foreground process group), and each
    printed ``interrupted by SIGINT: ...``, one copy a rank. The ranks now claim a counter in torchrun's agent store
    (a TCPStore this test hosts, as the agent does), as for a user error but under its own key: the first rank to stop
    prints, the others print nothing, every rank exits 130; a user error met afterwards is still printed once. Without
    the agent's store every rank prints (nothing is hidden)."""
    script = tmp_path / "worker.py"
    script.write_text(INTERRUPTED)
    errors = tmp_path / "errors.py"
    errors.write_text(ONE_ERROR)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    line = "interrupted by SIGINT: 3 finished shards kept; re-run the same command to resume\n"
    assert _rank(script, "x", 1, agent.port) == (130, line)
    assert _rank(script, "x", 0, agent.port) == (130, "")
    assert _rank(errors, "bad", 0, agent.port) == (2, "error: run.yaml:3: field 'train.lr': bad\n")
    assert _rank(script, "x", 0, agent.port, agent_store=False) == (130, line)
    assert _rank(script, "x", 1, agent.port, agent_store=False) == (130, line)


INTERRUPTED_IN_TORCH_IMPORT = textwrap.dedent("""
    import signal, sys, time
    from eagle3.cli import run_main

    def ctrl_c(signum, frame):
        raise KeyboardInterrupt

    def main(argv):
        signal.signal(signal.SIGALRM, ctrl_c)
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # a Ctrl-C 50 ms into torch's import (it takes ~1 s)
        import torch  # noqa: F401
        time.sleep(5)  # (a machine importing it faster: the Ctrl-C lands here)
    run_main(main)
""")


def test_a_ctrl_c_during_torch_s_import_prints_the_interrupted_line_not_a_traceback(tmp_path):
    """A Ctrl-C in a stage's first second under torchrun lands inside ``import torch``; the interrupt path then
    imported torch again to ask the agent's store, which fails on the half-registered operators: each rank printed a
    ``RuntimeError: Only a single TORCH_LIBRARY ...`` traceback and exited 1. Every rank now exits 130 with the line
    printed once for the job (below)."""
    script = tmp_path / "worker.py"
    script.write_text(INTERRUPTED_IN_TORCH_IMPORT)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _rank(script, "x", 1, agent.port) == (130, "interrupted by SIGINT\n")
    assert _rank(script, "x", 0, agent.port) == (130, "")


def test_a_rank_cut_in_torch_s_import_and_one_past_it_print_one_line(tmp_path):
    """``timeout -s INT 3 torchrun --nproc_per_node 2 04_train.py ...`` printed ``interrupted by SIGINT`` twice: rank
    0 was cut inside ``import torch`` and, unable to import it again to ask the agent's store, printed as "rank 0";
    rank 1, past its import, claimed the store's counter and printed too. The cut rank now claims the same counter
    from a child interpreter: whichever rank claims it first prints, the other nothing (both orders here)."""
    cut = tmp_path / "cut.py"
    cut.write_text(INTERRUPTED_IN_TORCH_IMPORT)
    past = tmp_path / "past.py"
    past.write_text(INTERRUPTED)
    line = "interrupted by SIGINT: 3 finished shards kept; re-run the same command to resume\n"
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert _rank(past, "x", 1, agent.port) == (130, line)
    assert _rank(cut, "x", 0, agent.port) == (
        130,
        "",
    )  # was "interrupted by SIGINT": the second line
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a new job
    assert _rank(cut, "x", 0, agent.port) == (130, "interrupted by SIGINT\n")
    assert _rank(past, "x", 1, agent.port) == (130, "")


SLEEPER = textwrap.dedent("""
    import os, sys, time
    from eagle3.cli import resume_on_interrupt, run_main

    def main(argv):
        with resume_on_interrupt(lambda: "re-run the same command to resume"):
            open(os.path.join(sys.argv[1], "ready" + os.environ["RANK"]), "w").close()
            time.sleep(120)
    run_main(main)
""")


@pytest.mark.slow
def test_ctrl_c_under_torchrun_prints_one_interrupted_line(tmp_path):
    """The real thing: ``torchrun --nproc_per_node 2`` and a Ctrl-C (SIGINT to the whole process group, as a terminal
    sends it) once both ranks run: one ``interrupted by SIGINT`` line (was two)."""
    import signal
    import time

    script = tmp_path / "worker.py"
    script.write_text(SLEEPER)
    env = child_env(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own process group: the test's Ctrl-C goes to it alone
    try:
        deadline = time.monotonic() + 120
        while (
            not all((tmp_path / f"ready{r}").exists() for r in (0, 1))
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [ln for ln in out.splitlines() if "interrupted by" in ln]
    assert lines == ["interrupted by SIGINT: re-run the same command to resume"], out[-3000:]


PEER_GONE = textwrap.dedent("""
    import sys
    import torch.distributed  # noqa: F401  (a rank in a collective has it imported)
    from eagle3.cli import run_main

    def main(argv):
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:22452. This is typically caused by a remote worker crashing.")
    run_main(main)
""")


def test_a_collective_broken_by_the_rank_that_reported_ends_quietly(tmp_path):
    """A rank that stopped on bad input exits at once; a peer blocked in a collective with it met gloo's ``Connection
    closed by peer`` before torchrun's SIGTERM and printed that traceback under the job's one ``error:`` line. Once a
    rank has reported the job's error, such a rank now exits 2 silently; with no report the traceback stays (a real
    failure is never hidden)."""
    script = tmp_path / "worker.py"
    script.write_text(PEER_GONE)
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rc, err = _rank(script, "x", 0, agent.port)
    assert rc == 1 and "Connection closed by peer" in err  # nobody reported: a failure of its own
    errors = tmp_path / "errors.py"
    errors.write_text(ONE_ERROR)
    assert _rank(errors, "bad", 1, agent.port) == (2, "error: run.yaml:3: field 'train.lr': bad\n")
    assert _rank(script, "x", 0, agent.port) == (2, "")


RANK1_SHARDS = textwrap.dedent("""
    import os, runpy, sys
    from pathlib import Path
    script, *args = sys.argv[1:]
    if os.environ.get("RANK") == "1":  # this rank's node has no shards folder where rank 0's has it
        from eagle3.stages import train as trainer

        real = trainer.read_data_config
        trainer.read_data_config = lambda shards_dir, *a, **k: real(Path(os.environ["RANK1_SHARDS"]), *a, **k)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
""")


@pytest.mark.slow
def test_a_shards_folder_only_rank_0_reads_gives_one_error_line_and_no_traceback(tmp_path):
    """The real thing: ``torchrun --nproc_per_node 2 04_train.py`` where rank 1 cannot read the shards folder (a node
    without the shared disk: here rank 1 reads its shards' data_config.json from elsewhere). Rank 1 stops with one line;
    rank 0, waiting in the start-up check for it, printed a ``RuntimeError: ... Connection closed by peer`` traceback
    too. Now the job prints the one line, and every rank exits 2."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _ddp_worker import make_tiny_run

    yaml = make_tiny_run(tmp_path / "run")
    wrap = tmp_path / "rank1_args.py"
    wrap.write_text(RANK1_SHARDS)
    env = child_env(
        ROOT,
        RANK1_SHARDS=str(tmp_path / "elsewhere"),
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(wrap),
        str(ROOT / "04_train.py"),
        "--config",
        str(yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert p.returncode != 0
    assert errors == [
        f"error: {tmp_path / 'elsewhere' / 'data_config.json'}: file not found (02_extract_hidden.py "
        f"writes it: run that stage first)"
    ], out[-3000:]
    assert "[rank0]" not in out and "Connection closed" not in out, out[-3000:]
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()
