"""04 with ``drafter.num_layers: 2``: a tiny run, resumed mid-way, ends bit-identical to the uninterrupted one; its
export loads back as the final checkpoint's drafter; ``train.init_from`` of a 2-layer export copies every layer; a
resume or warm start with another depth is refused, naming the field."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.data.vocab import load_vocab_map  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.export.reader import load_exported  # noqa: E402
from eagle3.shards.data_config import read_data_config  # noqa: E402
from eagle3.stages.export import (
    export_for_run,  # noqa: E402
    export_from_checkpoint,  # noqa: E402
    load_init_drafter,  # noqa: E402
)
from eagle3.stages.train import run  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.train.inputs import build_drafter_args  # noqa: E402
from eagle3.train.warm_start import init_drafter, warm_start  # noqa: E402
from eagle3.verifier.head import TargetHead  # noqa: E402

DEEP = ["drafter.num_layers=2", "export.dtype=float32"]


def _final(train_dir):
    return ckpt.load_checkpoint(ckpt.list_checkpoints(train_dir)[-1][1])


def test_two_layer_run_resume_export_and_init_from(tmp_path):
    a = load_config(
        make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2, "ckpt_every": 2}), DEEP
    )
    b = load_config(
        make_tiny_run(tmp_path / "b", train={"epochs": 1, "batch_size": 2, "ckpt_every": 2}), DEEP
    )
    run(a, device="cpu", export=export_for_run)
    assert run(b, stop_after=3, device="cpu")["step"] == 3
    run(b, resume=True, device="cpu", export=export_for_run)
    sa, sb = _final(a.train_dir), _final(b.train_dir)
    assert sa["drafter_args"]["num_layers"] == 2
    assert {k for k in sa["model"] if k.startswith("layers.1.")} >= {
        "layers.1.self_attn.q_proj.weight",
        "layers.1.input_layernorm.weight",
    }
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    # the export is the final checkpoint's drafter (float32 export: exact), both norm names for layer 1
    assert (
        "- drafter: eagle3, 2 decoder layers, hidden 16, MLP 32, draft vocab"
        in (a.train_dir / "train_report.md").read_text()
    )
    cfg = json.loads((a.export_dir / "config.json").read_text())
    assert (
        cfg.get(
            "num_hidden_layers",
            (cfg.get("transformer_layer_config") or {}).get("num_hidden_layers"),
        )
        == 2
    )
    head = TargetHead.load(a.train_dir)
    back = load_exported(a.export_dir, head.embed)
    for k, v in sa["model"].items():
        assert torch.equal(back.state_dict()[k], v.float()), k
    # resuming with another depth is refused, naming the field
    c = load_config(
        make_tiny_run(tmp_path / "b", train={"epochs": 2, "batch_size": 2, "ckpt_every": 2}),
        ["drafter.num_layers=3", "export.dtype=float32"],
    )
    with pytest.raises(UserError, match="drafter field 'num_layers' is 2 in the checkpoint but 3"):
        run(c, resume=True, device="cpu")
    # init_from a 2-layer export: every layer copied; into a 1-layer run: refused naming the extra tensor
    for layers, ok in ((2, True), (1, False)):
        w = load_config(
            make_tiny_run(tmp_path / f"w{layers}"),
            [
                f"drafter.num_layers={layers}",
                "export.dtype=float32",
                f"train.init_from={a.export_dir}",
            ],
        )
        dc = read_data_config(w.shards_dir)
        vocab = load_vocab_map(w.data_dir / "vocab_map.pt")
        d = init_drafter(
            build_drafter_args(w, dc, vocab), TargetHead.load(w.train_dir), vocab, seed=1
        )
        src = load_init_drafter(w, d.embed_tokens.weight, dc)
        if ok:
            warm_start(d, src, str(a.export_dir))
            assert torch.equal(
                d.layers["1"].self_attn.q_proj.weight.detach(),
                sa["model"]["layers.1.self_attn.q_proj.weight"],
            )
        else:
            with pytest.raises(UserError, match="train.init_from has tensor 'layers.1."):
                warm_start(d, src, str(a.export_dir))


def test_init_from_of_another_depth_is_refused_before_anything_is_written(tmp_path):
    """A fresh-user trial (2026-12-04e): train.init_from a 1-layer export into a 2-layer run failed only after the
    verifier head had been extracted (25 s on SmolLM2, leaving train-init/target_head.safetensors behind) and named a
    tensor, not the setting. Now the export's recorded drafter_args are compared first, naming the field."""
    a = load_config(
        make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2}),
        ["export.dtype=float32"],
    )
    run(a, device="cpu", export=export_for_run)
    for extra, msg in (
        (
            ["drafter.num_layers=2"],
            "holds a drafter with num_layers 1, this run trains 2 (drafter.num_layers)",
        ),
        (
            ["drafter.intermediate_size=40"],
            "holds a drafter with intermediate_size 32, this run trains 40 "
            "(drafter.intermediate_size)",
        ),
        (
            ["drafter.variant=eagle3.1"],
            "holds a drafter with variant 'eagle3', this run trains 'eagle3.1'",
        ),
    ):
        w = load_config(make_tiny_run(tmp_path / "w"), [*extra, f"train.init_from={a.export_dir}"])
        root = Path(w.output_root)
        before = sorted(p.relative_to(root) for p in root.rglob("*"))
        with pytest.raises(UserError, match=re.escape(f"train.init_from: '{a.export_dir}' {msg}")):
            run(w, device="cpu", export=export_for_run, init=load_init_drafter)
        assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written


def test_export_only_refuses_a_config_of_another_drafter_shape(tmp_path):
    """`04 --export-only` with drafter.num_layers (or the width) changed since training re-exported the checkpoint's
    drafter silently, rc 0 (fresh-user trial 2026-12-04e). It is refused as --resume refuses it, naming the field;
    the context length alone may still change at export."""
    a = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2}), DEEP)
    run(a, device="cpu", export=export_for_run)
    for extra, field, was, now in (
        (["drafter.num_layers=3"], "num_layers", 2, 3),
        (["drafter.num_layers=2", "drafter.intermediate_size=40"], "intermediate_size", 32, 40),
    ):
        c = load_config(
            make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2}),
            ["export.dtype=float32", *extra],
        )
        with pytest.raises(
            UserError,
            match=f"drafter field '{field}' is {was} in the checkpoint but {now} in the config",
        ):
            export_from_checkpoint(c)
    ok = load_config(
        make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2}),
        [*DEEP, "drafter.max_position_embeddings=512"],
    )
    out = export_from_checkpoint(ok)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 512
