"""train.init_from: a warm start from an exported drafter, its round trip, lm_head rows moved by target token under
another vocab map, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.data.vocab import load_vocab_map  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.shards.data_config import read_data_config  # noqa: E402
from eagle3.stages.export import (
    export_for_run,  # noqa: E402
    load_init_drafter,  # noqa: E402
)
from eagle3.stages.train import run  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.train.inputs import build_drafter_args  # noqa: E402
from eagle3.train.warm_start import init_drafter, warm_start  # noqa: E402
from eagle3.verifier.head import TargetHead  # noqa: E402

F32 = ["export.dtype=float32"]  # an exact round trip (the default export dtype is the verifier's)


def _trained(tmp_path: Path):
    """Run A: 4 steps on the tiny data, exported in float32; returns (config, final checkpoint state)."""
    a = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 1}), F32)
    run(a, device="cpu", export=export_for_run)
    return a, ckpt.load_checkpoint(ckpt.list_checkpoints(a.train_dir)[-1][1])


def _fresh(cfg):
    dc = read_data_config(cfg.shards_dir)
    vocab = load_vocab_map(cfg.data_dir / "vocab_map.pt")
    drafter = init_drafter(
        build_drafter_args(cfg, dc, vocab), TargetHead.load(cfg.train_dir), vocab, seed=1
    )
    return drafter, dc


def test_warm_start_copies_the_exported_weights_exactly(tmp_path):
    a, state = _trained(tmp_path)
    b = load_config(make_tiny_run(tmp_path / "b"), F32 + [f"train.init_from={a.export_dir}"])
    drafter, dc = _fresh(b)
    before = drafter.fc.weight.detach().clone()
    ws = warm_start(
        drafter, load_init_drafter(b, drafter.embed_tokens.weight, dc), str(a.export_dir)
    )
    trained = {
        k: v
        for k, v in state["model"].items()
        if k != "embed_tokens.weight"
        and v.is_floating_point()
        and k in dict(drafter.named_parameters())
    }
    assert (
        ws == {"tensors": len(trained), "lm_head_rows": 24, "lm_head_rows_copied": 24}
        and len(trained) > 3
    )
    assert not torch.equal(before, drafter.fc.weight)
    params = dict(drafter.named_parameters())
    for k, v in trained.items():
        assert torch.equal(params[k].detach(), v), k  # A's final weights, bit for bit
    assert torch.equal(
        drafter.embed_tokens.weight, TargetHead.load(b.train_dir).embed
    )  # the frozen embedding stays


def test_warm_started_run_starts_where_the_init_ended(tmp_path):
    """The same data again: run B's first-step loss from A's weights is below a cold run's (and the report says so)."""
    a, _ = _trained(tmp_path)
    b = load_config(
        make_tiny_run(tmp_path / "b", train={"max_steps": 1}), [f"train.init_from={a.export_dir}"]
    )
    c = load_config(make_tiny_run(tmp_path / "c", train={"max_steps": 1}))
    rb = run(b, device="cpu", init=load_init_drafter)
    run(c, device="cpu")

    def first_loss(cfg):
        rows = [json.loads(x) for x in (cfg.train_dir / "metrics.jsonl").read_text().splitlines()]
        return next(r["loss"] for r in rows if r["kind"] == "train")

    assert first_loss(b) < first_loss(c)
    assert rb["init_from"] == str(a.export_dir)
    assert json.loads((b.train_dir / "train_report.json").read_text())["init_from"] == str(
        a.export_dir
    )
    # without the loader (trainer.run called directly) the setting is refused, not ignored
    d = load_config(make_tiny_run(tmp_path / "d"), [f"train.init_from={a.export_dir}"])
    with pytest.raises(UserError, match="train.init_from: needs the export loader"):
        run(d, device="cpu")


def test_warm_start_refusals(tmp_path):
    a, _ = _trained(tmp_path)
    b = load_config(make_tiny_run(tmp_path / "b"), [f"train.init_from={a.export_dir}"])
    drafter, dc = _fresh(b)
    src = load_init_drafter(b, drafter.embed_tokens.weight, dc)
    src.args.target_vocab_size = 64  # a drafter for another tokenizer
    with pytest.raises(
        UserError,
        match=r"drafter-sglang: train.init_from drafts for a verifier vocab of 64 tokens, this",
    ):
        warm_start(drafter, src, str(a.export_dir))
    with pytest.raises(
        UserError, match=r"trained on HF aux layers \[2, 3, 4\], this run's shards hold \[1, 3, 4\]"
    ):
        load_init_drafter(b, drafter.embed_tokens.weight, dict(dc, aux_layers=[1, 3, 4]))
    missing = load_config(
        make_tiny_run(tmp_path / "m"), [f"train.init_from={tmp_path / 'nowhere'}"]
    )
    with pytest.raises(UserError, match="train.init_from: folder .*nowhere' not found"):
        load_init_drafter(missing, drafter.embed_tokens.weight, dc)
    v31 = load_config(
        make_tiny_run(tmp_path / "v"),
        [f"train.init_from={a.export_dir}", "drafter.variant=eagle3.1"],
    )
    d31, dc31 = _fresh(v31)
    with pytest.raises(UserError, match="is a eagle3 drafter but this run trains eagle3.1"):
        warm_start(d31, load_init_drafter(v31, d31.embed_tokens.weight, dc31), str(a.export_dir))
    wide = load_config(
        make_tiny_run(tmp_path / "w"),
        [f"train.init_from={a.export_dir}", "drafter.intermediate_size=40"],
    )
    dw, dcw = _fresh(wide)
    with pytest.raises(
        UserError,
        match=r"train.init_from's '.*mlp.gate_proj.weight' is \[32, 16\], this run's drafter needs \[40, 16\]",
    ):
        warm_start(dw, load_init_drafter(wide, dw.embed_tokens.weight, dcw), str(a.export_dir))


def test_warm_start_moves_lm_head_rows_by_target_token(tmp_path):
    """A's map drafts every 2nd target id (24 of 48), B's every 3rd (16): B's draft id i names target 3i, which A
    drafts as id 3i/2 when i is even. Those 8 rows come from A, the other 8 keep B's verifier init (target 3i's row)."""
    a, state = _trained(tmp_path)
    b = load_config(
        make_tiny_run(tmp_path / "b", draft_vocab=16), F32 + [f"train.init_from={a.export_dir}"]
    )
    drafter, dc = _fresh(b)
    d2t_b = drafter.d2t.clone()
    ws = warm_start(
        drafter, load_init_drafter(b, drafter.embed_tokens.weight, dc), str(a.export_dir)
    )
    assert ws["lm_head_rows"] == 16 and ws["lm_head_rows_copied"] == 8
    head = TargetHead.load(b.train_dir).lm_head  # [48, 16]
    lm_a = state["model"]["lm_head.weight"]  # [24, 16]
    for i in range(16):
        want = lm_a[3 * i // 2] if i % 2 == 0 else head[3 * i]
        assert torch.equal(drafter.lm_head.weight[i].detach(), want), i
    assert torch.equal(drafter.d2t, d2t_b)  # the run keeps its own vocab map
    assert torch.equal(drafter.fc.weight.detach(), state["model"]["fc.weight"])


def test_04_cli_passes_the_export_loader(tmp_path):
    """04_train.py wires train.init_from to the export loader; a missing folder is one line on stderr, exit 2."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    a, _ = _trained(tmp_path)
    yb = make_tiny_run(tmp_path / "b", train={"max_steps": 1})
    r = subprocess.run(
        [
            sys.executable,
            str(root / "04_train.py"),
            "--config",
            str(yb),
            "--set",
            f"train.init_from={a.export_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((tmp_path / "b" / "train" / "train_report.json").read_text())
    assert rep["init_from"] == str(a.export_dir) and rep["step"] == 1
    yc = make_tiny_run(tmp_path / "c", train={"max_steps": 1})
    r = subprocess.run(
        [
            sys.executable,
            str(root / "04_train.py"),
            "--config",
            str(yc),
            "--set",
            f"train.init_from={tmp_path / 'gone'}",
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x]
    assert r.returncode == 2 and lines[-1].endswith(
        f"train.init_from: folder '{tmp_path / 'gone'}' not found (an exported "
        "drafter folder: 04's drafter-sglang)"
    ), r.stderr[-2000:]
    assert not (tmp_path / "c" / "train" / "checkpoints").exists()  # nothing half-written
    # a checkpoint file for the folder: it said "folder '...step_*.pt' not found" of a file that exists (trial 2026-12-05d)
    pt = sorted((a.train_dir / "checkpoints").glob("step_*.pt"))[-1]
    r = subprocess.run(
        [
            sys.executable,
            str(root / "04_train.py"),
            "--config",
            str(yc),
            "--set",
            f"train.init_from={pt}",
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x]
    assert r.returncode == 2 and lines[-1] == (
        f"error: train.init_from: '{pt}' is a file, not an exported drafter folder; give the folder (04's drafter-sglang "
        f"or drafter-vllm) (a checkpoint: export it with 04_train.py --export-only, or continue its run with --resume "
        f"and its train.output_dir)"
    ), r.stderr[-2000:]
    assert not (tmp_path / "c" / "train" / "checkpoints").exists()


def test_init_from_with_resume_bad_folders_and_empty(tmp_path):
    """A --resume checkpoint wins (the folder is not even needed), the report keeps the run's first warm start; a folder
    that is not an export is refused before anything is written; errors of the export loader name train.init_from."""
    a, _ = _trained(tmp_path)
    yb = make_tiny_run(tmp_path / "b", train={"epochs": 1})
    b = load_config(yb, [f"train.init_from={a.export_dir}"])
    r1 = run(b, device="cpu", init=load_init_drafter, stop_after=2)
    assert r1["stopped"] and r1["init_from"] == str(a.export_dir)
    gone = load_config(yb, [f"train.init_from={tmp_path / 'gone'}"])
    r2 = run(
        gone, device="cpu", init=load_init_drafter, resume=True
    )  # continues its checkpoint: the folder is unused
    assert r2["step"] == 4 and r2["init_from"] == str(
        a.export_dir
    )  # recorded by the warm-started first call
    cold = load_config(make_tiny_run(tmp_path / "c", train={"epochs": 1}))
    run(cold, device="cpu", stop_after=2)
    r3 = run(
        load_config(Path(cold.output_root) / "run.yaml", [f"train.init_from={a.export_dir}"]),
        device="cpu",
        init=load_init_drafter,
        resume=True,
    )
    assert r3["init_from"] is None  # resumed a cold run: no warm start happened, none is reported
    not_export = load_config(make_tiny_run(tmp_path / "n"), [f"train.init_from={a.train_dir}"])
    with pytest.raises(
        UserError,
        match=r"train.init_from: '.*/a/train' is not an exported drafter folder \(no config.json",
    ):
        run(not_export, device="cpu", init=load_init_drafter)
    assert not (not_export.train_dir / "checkpoints").exists()
    wide = load_config(
        make_tiny_run(tmp_path / "w"), [f"train.init_from={a.export_dir}", "drafter.hidden_size=32"]
    )
    with pytest.raises(UserError, match=r"^train.init_from: "):
        load_init_drafter(wide, torch.zeros(48, 32), read_data_config(wide.shards_dir))
    with pytest.raises(UserError, match="train.init_from"):
        load_config(yb, ["train.init_from=''"])  # an empty string (YAML null = unset stays allowed)
