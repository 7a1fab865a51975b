"""DDP equivalence: 2 gloo processes on CPU (torchrun) == 1 process on the same global batch.

Several optimizer steps over two epochs (data order, LR schedule, checkpoint state across ranks). The
loss is normalised over the tokens of the whole optimizer step on all ranks (DESIGN.md "Loss
normalisation"), so the ranks need not count equal numbers of tokens; unequal counts are tested on the
first step's gradient in ``tests/train/test_loss_norm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env

from eagle3.config import load_config  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/ (the _ddp_worker.py helper)


def _final(train_dir: Path) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(train_dir)[-1][1])


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tmp_path):
    from eagle3.stages.train import run

    common = dict(n_train=8, n_val=2, lengths=(10,), equal_lengths=True, vocab=32, draft_vocab=32)
    # global batch 4 per optimizer step in both: 1 x (2 samples x 2 accum) vs 2 ranks x (1 sample x 2 accum);
    # validation at temperature 1: the sampled acceptance is summed over the ranks' val samples
    sel = {"grad_accum": 2, "epochs": 2, "select_temperature": 1.0}
    one = load_config(make_tiny_run(tmp_path / "one", train={"batch_size": 2, **sel}, **common))
    two_yaml = make_tiny_run(tmp_path / "two", train={"batch_size": 1, **sel}, **common)
    r = run(one, device="cpu")
    assert r["step"] == 4  # 8 samples / 4 per step x 2 epochs

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
        str(two_yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]

    two = load_config(two_yaml)
    s1, s2 = _final(one.train_dir), _final(two.train_dir)
    assert s1["step"] == s2["step"] == 4 and s2["world_size"] == 2 and len(s2["rng"]) == 2
    assert s1["samples_in_epoch"] == s2["samples_in_epoch"]
    for k, v in s1["model"].items():
        torch.testing.assert_close(s2["model"][k], v, atol=1e-5, rtol=1e-5, msg=k)
    c1, c2 = (json.loads((c.train_dir / "sim_accept.json").read_text()) for c in (one, two))
    assert c1["temperature"] == c2["temperature"] == 1.0 and [r["step"] for r in c2["rows"]] == [
        2,
        4,
    ]
    a1, a2 = ([a for r in c["rows"] for a in r["alpha"]] for c in (c1, c2))
    assert len(a1) == 6 and a2 == pytest.approx(a1, abs=1e-5)  # 2 validations x 3 TTT steps
    # the run moved the weights (so equality is not trivially the init)
    init = load_config(make_tiny_run(tmp_path / "init", **common))
    from eagle3.data.vocab import load_vocab_map
    from eagle3.shards.data_config import read_data_config
    from eagle3.train.inputs import build_drafter_args
    from eagle3.train.warm_start import init_drafter
    from eagle3.verifier.head import TargetHead

    vocab = load_vocab_map(init.data_dir / "vocab_map.pt")
    d0 = init_drafter(
        build_drafter_args(init, read_data_config(init.shards_dir), vocab),
        TargetHead.load(init.train_dir),
        vocab,
        seed=0,
    )
    assert (d0.fc.weight - s1["model"]["fc.weight"]).abs().max() > 1e-3


RANK1_ARGS = (
    Path(__file__).resolve().parents[1] / "_rank1_args.py"
)  # extra arguments on rank 1 alone


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,said",
    [
        ("--set train.lr=0.02", "train.lr: 0.01 on rank 0, 0.02 on rank 1"),
        ("--set train.batch_size=1", "train.batch_size: 2 on rank 0, 1 on rank 1"),
        ("--resume", "--resume: False on rank 0, True on rank 1"),
    ],
    ids=["lr", "batch_size", "resume"],
)
def test_a_rank_with_another_config_is_refused_in_one_line(tmp_path, extra, said):
    """Each rank reads the YAML and the command line itself; rank 1 with another one (a node with another copy; here
    extra arguments for rank 1 alone): another train.lr trained to the end, its DDP replica stepping with its own lr
    and drifting from rank 0's without a word; another train.batch_size aborted rank 0 (SIGABRT) with no message.
    Now every rank compares first: one line naming rank 1 and the key, every rank exits 2, no train folder."""
    yaml = make_tiny_run(tmp_path / "run")
    wrap = RANK1_ARGS
    env = child_env(HERE.parent, RANK1_EXTRA=extra)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(wrap),
        str(HERE.parent / "04_train.py"),
        "--config",
        str(yaml),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert p.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    assert errors == [
        f"error: torchrun rank 1 runs 04 with another config or command line than rank 0 ({said}); "
        f"every rank must read the same YAML, --set overrides and flags (a node with another copy?)"
    ]
    assert "[rank0]" not in out and not (tmp_path / "run" / "train" / "checkpoints").exists(), out[
        -3000:
    ]


@pytest.mark.slow
def test_a_rank_with_another_split_is_refused(tmp_path):
    """Each rank reads 03's split.json (and vocab map) itself; rank 1 on a node with another copy of the data folder
    (here its split is read from another folder) trained other samples than the one-process order says, without a
    word. Every rank now compares the data inputs' sha256 first: one UserError naming rank 1 and split.json."""
    import json

    yaml = make_tiny_run(tmp_path / "run")
    other = tmp_path / "other-data"
    other.mkdir()
    split = json.loads((tmp_path / "run" / "data" / "split.json").read_text())
    (other / "split.json").write_text(
        json.dumps({"train": split["train"][::-1], "val": split["val"]})
    )
    env = child_env(
        HERE.parent,
        SPLIT_DIR_FOR_RANK_1=str(other),
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
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert (
        f"UserError: {tmp_path / 'run' / 'data'}: torchrun rank 1 read other data than rank 0 (differing: "
        f"split.json); every rank must read the same data folder and shards (a node with another copy?)"
    ) in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()
