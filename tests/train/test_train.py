"""Stage 04: LR schedule, dataset/collate/sampler, target head, and the training loop (resume == uninterrupted)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env

from eagle3.config import load_config  # noqa: E402
from eagle3.data.dataset import ResumableSampler, ShardDataset, collate, read_split  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.shards.write import write_sample  # noqa: E402
from eagle3.stages.export import export_for_run, load_init_drafter  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.train.schedule import build_scheduler, lr_factor, warmup_steps_for  # noqa: E402
from eagle3.verifier.head import TargetHead  # noqa: E402


# ---- schedule ------------------------------------------------------------------------------------
def test_warmup_cosine_values_hand_computed():
    # W = 2, T = 6: warmup 0, 1/2; cosine over 4 steps: 1, (1+cos(pi/4))/2, 1/2, (1-cos(pi/4))/2, 0
    c = math.cos(math.pi / 4)
    want = [0.0, 0.5, 1.0, (1 + c) / 2, 0.5, (1 - c) / 2, 0.0, 0.0]
    got = [lr_factor(s, 2, 6) for s in range(8)]
    assert got == pytest.approx(want, abs=1e-12)
    assert warmup_steps_for(10, 0.25) == 3  # ceil(2.5)
    assert warmup_steps_for(100, 0.0) == 0


def test_scheduler_lr_per_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.2)
    sched = build_scheduler(opt, total_steps=4, warmup_ratio=0.25)  # W = 1
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # s=0: 0 (warmup); s=1..3: cosine over 3 steps: 1, 0.75, 0.25
    assert seen == pytest.approx([0.0, 0.2, 0.2 * 0.75, 0.2 * 0.25], abs=1e-12)
    with pytest.raises(UserError, match="optimizer steps"):
        build_scheduler(opt, total_steps=0, warmup_ratio=0.0)


@pytest.mark.parametrize("total", [1, 7, 40, 640, 7986])
@pytest.mark.parametrize(
    "ratio", [0.0, 0.02, 0.05, 0.1]
)  # the configs' train.warmup_ratio values (and 0)
def test_schedule_is_transformers_cosine_with_warmup_bit_for_bit(total, ratio):
    """The lr of every optimizer step (0..T-1, and the factor 0 after the last) equals transformers'
    get_cosine_schedule_with_warmup exactly (==, not approx). The schedule stays its own object: LambdaLR.state_dict
    saves a callable object's attributes, so a checkpoint records the horizon (warmup, total steps) that --resume
    compares and re-stretches; transformers' lambda is a functools.partial (nothing saved), and past T its factor
    rises again where this one stays 0."""
    from transformers import get_cosine_schedule_with_warmup

    lrs = []
    for make in (
        lambda o: build_scheduler(o, total, ratio),
        lambda o: get_cosine_schedule_with_warmup(o, warmup_steps_for(total, ratio), total),
    ):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
        sched, seen = make(opt), []
        for _ in range(total + 1):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        lrs.append(seen)
    assert lrs[0] == lrs[1]
    assert build_scheduler(opt, total, ratio).state_dict()["lr_lambdas"] == [
        {"warmup_steps": warmup_steps_for(total, ratio), "total_steps": total}
    ]


# ---- dataset -------------------------------------------------------------------------------------
def test_collate_pads_right_with_zero_and_mask_zero():
    a = {
        "input_ids": torch.tensor([5, 6, 7]),
        "aux": torch.ones(3, 6),
        "last": torch.full((3, 2), 2.0),
        "loss_mask": torch.tensor([0, 1, 1]),
    }
    b = {
        "input_ids": torch.tensor([9]),
        "aux": torch.full((1, 6), 3.0),
        "last": torch.ones(1, 2),
        "loss_mask": torch.tensor([1]),
    }
    out = collate([a, b])
    assert out["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert out["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["lengths"].tolist() == [3, 1]
    assert torch.equal(out["aux"][1], torch.cat([torch.full((1, 6), 3.0), torch.zeros(2, 6)]))
    assert torch.equal(out["last"][1, 1:], torch.zeros(2, 2))


def test_dataset_item_concat_and_truncation(tmp_path):
    L, H = 7, 4
    hs = [
        torch.full((L, H), float(k)) + torch.arange(L)[:, None] for k in range(4)
    ]  # distinct per state/pos
    write_sample(tmp_path, 3, 10, torch.arange(L), hs, torch.tensor([0, 0, 1, 1, 1, 1, 1]))
    ds = ShardDataset(tmp_path, [3], max_length=5)
    item = ds[0]
    assert item["input_ids"].tolist() == [0, 1, 2, 3, 4]
    assert item["loss_mask"].tolist() == [0, 0, 1, 1, 1]
    want_aux = torch.cat([hs[0][:5], hs[1][:5], hs[2][:5]], dim=-1).bfloat16()  # [5, 3H]
    assert torch.equal(item["aux"], want_aux)
    assert torch.equal(item["last"], hs[3][:5].bfloat16())
    with pytest.raises(UserError, match=r"split.json: key 'val': sample 4 has no shard"):
        ShardDataset(tmp_path, [3, 4], split_name="val")


def test_read_split_errors_name_key(tmp_path):
    (tmp_path / "split.json").write_text(json.dumps({"train": [1, 2], "val": "x"}))
    with pytest.raises(UserError) as e:
        read_split(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'split.json'}: field 'val' should be a list, got 'x'; re-run 03_prepare_data.py"
    )
    (tmp_path / "split.json").write_text(json.dumps({"train": [1, True], "val": []}))
    with pytest.raises(
        UserError, match=r"split.json: field 'train\[1\]' should be a valid integer"
    ):
        read_split(tmp_path)
    (tmp_path / "split.json").write_text(json.dumps({"train": [1, 2], "val": [3]}))
    assert read_split(tmp_path) == {"train": [1, 2], "val": [3]}


def test_sampler_resume_and_distributed_partition():
    ds = list(range(10))
    full = ResumableSampler(ds, 1, 0, seed=7)
    full.set_epoch(3)
    order = list(full)
    assert sorted(order) == list(range(10))
    again = ResumableSampler(ds, 1, 0, seed=7)
    again.set_epoch(3)
    again.set_start(4)
    assert list(again) == order[4:] and len(again) == 6
    other = ResumableSampler(ds, 1, 0, seed=7)
    other.set_epoch(4)
    assert list(other) != order  # reshuffled per epoch
    # two ranks: rank r takes r, r+2, ... of the same permutation; resuming at 4 global samples skips 2 each
    ranks = []
    for r in range(2):
        s = ResumableSampler(ds, 2, r, seed=7)
        s.set_epoch(3)
        s.set_start(4)
        ranks.append(list(s))
    assert ranks[0] == order[4::2] and ranks[1] == order[5::2]


# ---- target head ---------------------------------------------------------------------------------
def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.model.norm.weight.normal_()
    return m


@pytest.mark.parametrize("tied", [True, False])
def test_target_head_from_model_and_roundtrip(tmp_path, tied):
    m = _tiny_llama(tied)
    head = TargetHead.from_model(m, "pre_norm")
    assert torch.equal(head.embed, m.model.embed_tokens.weight.detach())
    assert torch.equal(head.lm_head, m.lm_head.weight.detach())
    assert torch.equal(head.norm_weight, m.model.norm.weight.detach())
    assert head.norm_eps == 1e-5 and head.last_is_post_norm is False and head.tied is tied
    # the head reproduces the model's logits from the pre-norm last state
    ids = torch.tensor([[1, 5, 7]])
    out = m(ids, output_hidden_states=True)
    # HF hidden_states[-1] is post-norm: lm_head(h) == logits
    assert torch.allclose(out.hidden_states[-1] @ head.lm_head.T, out.logits, atol=1e-5)
    head.save(tmp_path)
    back = TargetHead.load(tmp_path)
    assert torch.equal(back.embed, head.embed) and torch.equal(back.lm_head, head.lm_head)
    assert torch.equal(back.norm_weight, head.norm_weight)
    assert back.norm_eps == head.norm_eps and back.last_is_post_norm is False and back.tied is tied


def test_target_head_load_errors(tmp_path):
    with pytest.raises(UserError, match="target_head.safetensors: file not found"):
        TargetHead.load(tmp_path)
    (tmp_path / "target_head.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt safetensors"):
        TargetHead.load(tmp_path)


# ---- training loop ---------------------------------------------------------------------------------
def _final_model(train_dir: Path) -> dict:
    step, path = ckpt.list_checkpoints(train_dir)[-1]
    return ckpt.load_checkpoint(path)


def _train_rows(train_dir: Path) -> list[dict]:
    return [
        json.loads(x)
        for x in (train_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "train"
    ]


def test_resume_equals_uninterrupted(tmp_path):
    from eagle3.stages.train import run

    a = load_config(
        make_tiny_run(tmp_path / "a", train={"epochs": 2, "batch_size": 2, "ckpt_every": 2})
    )
    b = load_config(
        make_tiny_run(tmp_path / "b", train={"epochs": 2, "batch_size": 2, "ckpt_every": 2})
    )
    ra = run(a, device="cpu", export=export_for_run)
    assert (
        ra["step"] == ra["total_steps"] == 8 and not ra["stopped"]
    )  # 8 samples / 2 = 4 steps x 2 epochs
    # b: stop mid-epoch (step 3: odd, not a ckpt_every multiple), resume, stop at the epoch boundary (4), finish
    r1 = run(b, stop_after=3, device="cpu")
    assert r1["stopped"] and r1["step"] == 3 and r1["export_dir"] is None
    assert [s for s, _ in ckpt.list_checkpoints(b.train_dir)] == [2, 3]
    r2 = run(b, resume=True, stop_after=1, device="cpu")
    assert r2["step"] == 4
    r3 = run(b, resume=True, device="cpu", export=export_for_run)
    assert r3["step"] == 8 and not r3["stopped"]
    sa, sb = _final_model(a.train_dir), _final_model(b.train_dir)
    assert sa["step"] == sb["step"] == 8
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert sa["scheduler"]["last_epoch"] == sb["scheduler"]["last_epoch"] == 8
    # same data order, LR and loss at every step
    rows_a, rows_b = _train_rows(a.train_dir), _train_rows(b.train_dir)
    assert [r["step"] for r in rows_b] == list(range(1, 9))
    for x, y in zip(rows_a, rows_b):
        assert (x["step"], x["lr"], x["loss"], x["acc_0"]) == (
            y["step"],
            y["lr"],
            y["loss"],
            y["acc_0"],
        )
    # outputs of the finished run
    assert (b.export_dir / "model.safetensors").is_file() and (
        b.export_dir / "config.json"
    ).is_file()
    rep = json.loads((b.train_dir / "train_report.json").read_text())
    assert rep["step"] == 8 and "acc_0" in rep["final_val"]
    assert (b.train_dir / "train_report.md").read_text().count("| 0 |") == 1
    assert (b.train_dir / "loss.png").stat().st_size > 0
    assert any((b.train_dir / "tb").iterdir())


def test_a_torn_last_metrics_line_is_cut_on_resume(tmp_path, caplog):
    """A kill while 04 appended a row to metrics.jsonl leaves a torn last line; the resume appended its first row to
    it, so neither parsed and that step's row was lost for good (trial 2026-12-05g). The resume now cuts the file back
    to its last complete line first (one warning): every line parses and every step's row is there once."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path / "r", train={"epochs": 1, "batch_size": 2, "ckpt_every": 2})
    )
    run(cfg, stop_after=2, device="cpu")
    metrics = cfg.train_dir / "metrics.jsonl"
    whole = metrics.read_bytes()
    torn = b'{"kind": "train", "step": 3, "loss": 1.2'  # the step-3 row a kill cut (step 3 was not checkpointed)
    with open(metrics, "ab") as f:
        f.write(torn)
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        run(cfg, resume=True, device="cpu")
    lines = metrics.read_bytes().splitlines()
    assert metrics.read_bytes().startswith(
        whole
    )  # the complete rows before the kill: kept as they were
    rows = [json.loads(ln) for ln in lines]  # every line parses
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [m for m in caplog.messages if "torn" in m] == [
        f"{metrics}: cut a torn last line ({len(torn)} bytes a kill left mid-write) before appending"
    ]
    from eagle3.io import cut_torn_tail

    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": 3')
    assert (
        cut_torn_tail(log, block=4) == 7 and log.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    )  # scanned back in blocks
    assert cut_torn_tail(log) == 0 and cut_torn_tail(tmp_path / "absent.jsonl") == 0
    log.write_bytes(b'{"a"')
    assert cut_torn_tail(log, block=3) == 4 and log.read_bytes() == b""


def test_stop_at_ends_a_finished_run_on_the_longer_schedule_and_resume_equals_uninterrupted(
    tmp_path, caplog
):
    """04 --stop-at: steps 1..5 of an 8-step schedule with the same lr and loss as the whole run; the run ends as a
    finished one (final validation once at step 5, best export, report naming the stop), and --resume from its
    step-5 checkpoint ends with the uninterrupted run's weights."""
    from eagle3.stages.train import run

    tr = {
        "epochs": 2,
        "batch_size": 2,
        "ckpt_every": 2,
        "eval_every": 1,
        "select_best": "sim_accept",
    }
    a = load_config(make_tiny_run(tmp_path / "a", train=tr))
    b = load_config(make_tiny_run(tmp_path / "b", train=tr))
    ra = run(a, device="cpu", export=export_for_run)
    with pytest.raises(UserError, match=r"--stop-at 8: the schedule has 8 optimizer steps"):
        run(b, device="cpu", stop_at=8)
    rb = run(b, device="cpu", export=export_for_run, stop_at=5)
    assert (rb["step"], rb["total_steps"], rb["stop_at"], rb["stopped"]) == (5, 8, 5, False)
    assert (
        rb["export_dir"]
        and (b.export_dir / "model.safetensors").is_file()
        and "acc_0" in rb["final_val"]
    )
    assert [s for s, _ in ckpt.list_checkpoints(b.train_dir)][-1] == 5
    rows_a, rows_b = _train_rows(a.train_dir), _train_rows(b.train_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5]
    for x, y in zip(rows_a, rows_b):  # the lr of the 8-step schedule, not a 5-step one
        assert (x["lr"], x["loss"]) == (y["lr"], y["loss"])
    val = lambda cfg: [
        json.loads(x)["step"]
        for x in (cfg.train_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "val"
    ]
    assert val(b) == [1, 2, 3, 4, 5]  # step 5 validated once (by the end step)
    rep = json.loads((b.train_dir / "train_report.json").read_text())
    assert rep["stop_at"] == 5 and rep["sim_accept"]["exported_step"] in range(1, 6)
    assert (
        "ended at `--stop-at 5` on the 8-step lr schedule"
        in (b.train_dir / "train_report.md").read_text()
    )
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="eagle3.train"),
        pytest.raises(
            UserError, match=r"--stop-at 4: the checkpoint resumed from is at step 5, past it"
        ),
    ):
        run(b, resume=True, device="cpu", stop_at=4)
    assert not [
        x for x in caplog.records if x.getMessage().startswith("resumed from ")
    ]  # refused: no resume line
    rc = run(b, resume=True, device="cpu", export=export_for_run)
    assert (rc["step"], rc["stop_at"]) == (8, None) and val(b) == val(a) == list(range(1, 9))
    sa, sb = _final_model(a.train_dir), _final_model(b.train_dir)
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    assert ra["final_val"] == rc["final_val"]


def test_stop_at_after_a_stop_on_its_step_resumes_to_the_end_only(tmp_path):
    """A run stopped (signal; here stop_after) on its --stop-at step, then resumed with the same command, trains
    nothing and ends there as a finished run (final validation once, export, report); it was refused."""
    from eagle3.stages.train import run

    tr = {
        "epochs": 2,
        "batch_size": 2,
        "ckpt_every": 100,
        "eval_every": 2,
        "select_best": "sim_accept",
    }
    b = load_config(make_tiny_run(tmp_path / "b", train=tr))
    r1 = run(b, device="cpu", export=export_for_run, stop_at=5, stop_after=5)
    assert (r1["step"], r1["stopped"], r1["export_dir"]) == (5, True, None)
    r2 = run(b, resume=True, device="cpu", export=export_for_run, stop_at=5)
    assert (
        (r2["step"], r2["stopped"], r2["stop_at"]) == (5, False, 5)
        and r2["export_dir"]
        and r2["final_val"]
    )
    rows = [json.loads(x) for x in (b.train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [2, 4, 5]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert json.loads((b.train_dir / "train_report.json").read_text())["stopped"] is False


def test_training_reduces_loss_and_trains_only_drafter_params(tmp_path):
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=4,
            lengths=(10,),
            pre_norm=True,
            train={
                "epochs": 15,
                "batch_size": 4,
                "warmup_ratio": 0.0,
                "lr": 3e-2,
                "eval_every": 100,
                "ckpt_every": 100,
            },
        )
    )
    run(cfg, device="cpu")
    rows = _train_rows(cfg.train_dir)
    assert len(rows) == 15
    assert (
        rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    )  # same 4 samples every step: the drafter fits them
    state = _final_model(cfg.train_dir)
    assert (
        "embed_tokens.weight" not in state["model"]
    )  # frozen verifier embedding is not a trainable param
    assert {"fc.weight", "lm_head.weight", "norm.weight"} <= set(state["model"])


def test_lm_head_initialised_from_verifier_draft_rows(tmp_path):
    from eagle3.data.vocab import load_vocab_map
    from eagle3.shards.data_config import read_data_config
    from eagle3.train.inputs import build_drafter_args
    from eagle3.train.warm_start import init_drafter

    cfg = load_config(make_tiny_run(tmp_path))
    dc = read_data_config(cfg.shards_dir)
    vocab = load_vocab_map(cfg.data_dir / "vocab_map.pt")
    head = TargetHead.load(cfg.train_dir)
    drafter = init_drafter(build_drafter_args(cfg, dc, vocab), head, vocab, seed=0)
    assert torch.equal(
        drafter.lm_head.weight, head.lm_head[0::2][:24]
    )  # draft ids = every 2nd target id
    assert torch.equal(drafter.embed_tokens.weight, head.embed)
    assert not drafter.embed_tokens.weight.requires_grad


def test_existing_checkpoints_without_resume_is_user_error(tmp_path):
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path, train={"epochs": 1}))
    r = run(cfg, stop_after=1, max_steps=3, device="cpu")
    assert (r["step"], r["total_steps"], r["stopped"]) == (
        1,
        3,
        True,
    )  # max_steps caps the 4 steps of the epoch
    with pytest.raises(UserError, match="pass --resume"):
        run(cfg, device="cpu")
    # a draft vocab changed without re-running 03: that is the first error, before "holds checkpoints" ...
    changed = cfg.model_copy(update={"data": cfg.data.model_copy(update={"draft_vocab_size": 16})})
    with pytest.raises(UserError, match="data.draft_vocab_size") as e:
        run(changed, device="cpu")
    assert "holds checkpoints" not in str(e.value)
    # ... and in a fresh train folder it leaves nothing behind
    fresh = changed.model_copy(
        update={"train": changed.train.model_copy(update={"output_dir": str(tmp_path / "t2")})}
    )
    with pytest.raises(UserError, match="data.draft_vocab_size"):
        run(fresh, device="cpu")
    assert not (tmp_path / "t2").exists()


def test_without_resume_the_advice_says_whether_a_resume_would_be_taken(tmp_path):
    """04 without --resume in a folder with checkpoints advised `pass --resume` also when that resume would be refused
    (here: another train.seed, a data-order change, and another train.step_weight, a loss change), costing one more
    refused run. The resume's checks now run first: the refusal names why and what 04 offers instead (a new
    train.output_dir, or deleting the checkpoints: 04 has no --overwrite); with the checkpoint's settings it still
    says `pass --resume` (from the newest step that loads when the newest file does not)."""
    from eagle3.stages.train import run
    from eagle3.train import checkpoint as ckpt

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 1, "keep_checkpoints": 5})
    )
    run(cfg, stop_after=2, max_steps=3, device="cpu")
    where = ckpt.ckpt_dir(cfg.train_dir)
    before = sorted(p.name for p in cfg.train_dir.rglob("*"))
    t = cfg.train.model_copy(update={"seed": cfg.train.seed + 1, "step_weight": 0.5})
    changed = cfg.model_copy(update={"train": t})
    with pytest.raises(UserError) as e:
        run(changed, device="cpu")
    msg = str(e.value)
    assert msg.startswith(
        f"{where}: holds checkpoints (newest step 2), and --resume would refuse them: "
        f"{ckpt.ckpt_path(cfg.train_dir, 2)}: "
    )
    assert (
        "train.seed=1" in msg
        and "train.step_weight 0.8 -> 0.5" in msg
        and "pass --resume" not in msg
    )
    assert msg.endswith(
        f"; so train into a new folder (--set train.output_dir=...), or delete {where} to start this "
        f"one over (04 has no --overwrite)"
    )
    assert "\n" not in msg
    with pytest.raises(
        UserError
    ) as r:  # the advice is right: --resume is refused for the same reasons
        run(changed, resume=True, device="cpu")
    assert "train.seed=1" in str(r.value) and "train.step_weight 0.8 -> 0.5" in str(r.value)
    assert sorted(p.name for p in cfg.train_dir.rglob("*")) == before  # nothing written by either
    with pytest.raises(UserError) as ok:
        run(cfg, device="cpu")
    assert (
        str(ok.value)
        == f"{where}: holds checkpoints (newest step 2); pass --resume to continue, or set "
        f"train.output_dir to a new folder"
    )
    ckpt.ckpt_path(cfg.train_dir, 2).write_bytes(
        b"torn"
    )  # the newest does not load: a resume takes step 1
    with pytest.raises(UserError) as ok:
        run(cfg, device="cpu")
    assert (
        str(ok.value)
        == f"{where}: holds checkpoints (newest step 2); pass --resume to continue from step 1, "
        f"the newest that loads, or set train.output_dir to a new folder"
    )


def test_without_resume_the_advice_takes_a_split_that_keeps_the_global_batch(tmp_path):
    """A checkpoint of 2 processes x batch 1 x grad_accum 1 (global batch 2), 04 now on 1 process with
    train.grad_accum=2: --resume takes it (the global batch is kept), but 04 without --resume said `--resume would
    refuse them: ... batching`: the advice judged the checkpoint without this run's process count. It now passes it,
    as the resume does: `pass --resume to continue`."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path, train={"epochs": 1, "ckpt_every": 1, "batch_size": 1, "grad_accum": 2}
        )
    )
    run(cfg, stop_after=2, max_steps=3, device="cpu")
    path = ckpt.ckpt_path(cfg.train_dir, 2)
    state = torch.load(path, weights_only=True)  # as 2 processes of grad_accum 1 wrote it
    state["world_size"] = 2
    state["data_order"]["train.grad_accum"] = 1
    torch.save(state, path)
    where = ckpt.ckpt_dir(cfg.train_dir)
    with pytest.raises(UserError) as ok:
        run(cfg, device="cpu")
    assert (
        str(ok.value)
        == f"{where}: holds checkpoints (newest step 2); pass --resume to continue, or set "
        f"train.output_dir to a new folder"
    )


def test_cli_bad_config_exits_2(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[2]
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_name: x\nverifier: {path: y}\nprompts: {source: z}\ntrain: {lr: -1}\n")
    p = subprocess.run(
        [sys.executable, str(root / "04_train.py"), "--config", str(bad)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert "train.lr" in p.stderr and p.stderr.startswith("error:")


def test_cli_stop_at_passes_through_and_its_errors_are_one_line(tmp_path):
    """04_train.py --stop-at reaches the trainer (a stop at the schedule's end: its one-line error, exit 2, no
    checkpoint written); --stop-at 0 is refused by the parser."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    cfg = make_tiny_run(tmp_path, train={"epochs": 1, "batch_size": 2})  # 4 steps
    p = subprocess.run(
        [
            sys.executable,
            str(root / "04_train.py"),
            "--config",
            str(cfg),
            "--stop-at",
            "4",
            "--set",
            "verifier.device=cpu",
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        "error: --stop-at 4: the schedule has 4 optimizer steps; a stop at or after its end is the whole run (leave "
        "--stop-at out, or raise train.epochs (now 1) for a longer schedule)"
    )
    assert not ckpt.list_checkpoints(load_config(cfg).train_dir)
    p = subprocess.run(
        [sys.executable, str(root / "04_train.py"), "--config", str(cfg), "--stop-at", "0"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "--stop-at" in p.stderr


# ---- drafter shape and verifier head from the verifier ------------------------------------------------
def _save_tiny_verifier(folder: Path, tied: bool):
    m = _tiny_llama(tied)
    m.config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    m.save_pretrained(folder)
    return m


def test_drafter_args_nulls_come_from_verifier_config(tmp_path):
    from eagle3.data.vocab import load_vocab_map
    from eagle3.shards.data_config import read_data_config
    from eagle3.train.inputs import build_drafter_args

    _save_tiny_verifier(tmp_path / "verifier", tied=True)
    path = make_tiny_run(tmp_path / "run", hidden=16, vocab=40, draft_vocab=20)
    nulls = [
        f"drafter.{k}=null"
        for k in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
        )
    ]
    cfg = load_config(
        path, nulls + [f"verifier.path={tmp_path / 'verifier'}", "drafter.intermediate_size=24"]
    )
    dc = dict(
        read_data_config(cfg.shards_dir), num_layers=1
    )  # the shards of this 1-layer verifier (04 checks it)
    args = build_drafter_args(cfg, dc, load_vocab_map(cfg.data_dir / "vocab_map.pt"))
    # verifier: hidden 16, 2 heads, 1 KV head, eps 1e-5, rope 50000, 2048 positions (LlamaConfig default)
    assert (
        args.hidden_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.head_dim,
    ) == (16, 2, 1, 8)
    assert args.intermediate_size == 24  # set in the config: wins over the verifier's 32
    assert (args.rms_norm_eps, args.rope_theta, args.max_position_embeddings) == (
        1e-5,
        50000.0,
        2048,
    )
    assert (args.draft_vocab_size, args.target_vocab_size, args.target_hidden_size) == (20, 40, 16)


def test_target_head_extracted_once_from_safetensors_verifier(tmp_path):
    from eagle3.process_group import Dist
    from eagle3.shards.data_config import read_data_config
    from eagle3.train.inputs import prepare_target_head

    m = _save_tiny_verifier(tmp_path / "verifier", tied=False)
    path = make_tiny_run(tmp_path / "run", hidden=16, vocab=40, draft_vocab=20, pre_norm=True)
    cfg = load_config(path, [f"verifier.path={tmp_path / 'verifier'}"])
    (
        cfg.train_dir / "target_head.safetensors"
    ).unlink()  # the helper's random head: force extraction
    single = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    head = prepare_target_head(cfg, read_data_config(cfg.shards_dir), single)
    assert torch.equal(head.lm_head, m.lm_head.weight.detach()) and torch.equal(
        head.embed, m.model.embed_tokens.weight.detach()
    )
    assert (
        torch.equal(head.norm_weight, m.model.norm.weight.detach())
        and head.last_is_post_norm is False
    )
    assert (cfg.train_dir / "target_head.safetensors").is_file()
    # a head that disagrees with data_config.json is refused, naming the file
    with pytest.raises(UserError, match=r"target_head.safetensors: metadata 'last_is_post_norm'"):
        prepare_target_head(
            cfg, dict(read_data_config(cfg.shards_dir), last_hidden_state="post_norm"), single
        )


@pytest.mark.slow
def test_target_head_of_smollm2_gguf_reproduces_logits():
    from conftest import SMOLLM_GGUF, smollm_dir

    from eagle3.config import VerifierConfig
    from eagle3.verifier.load import load_verifier

    model, tok = load_verifier(
        VerifierConfig(path=str(smollm_dir()), gguf_file=SMOLLM_GGUF, dtype="float32"), device="cpu"
    )
    head = TargetHead.from_model(model, "post_norm")
    assert (
        head.tied
        and tuple(head.embed.shape) == (49152, 576)
        and head.norm_eps == model.config.rms_norm_eps
    )
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(
        out.hidden_states[-1] @ head.lm_head.T, out.logits, atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--resume"], "--resume"),
        (["--max-steps", "3"], "--max-steps"),
        (["--stop-at", "2", "--resume"], "--resume, --stop-at"),
    ],
)
def test_cli_export_only_refuses_training_flags(tmp_path, flags, named):
    """--export-only trains nothing: --resume / --max-steps / --stop-at with it were silently ignored; now the
    parser refuses them in one line naming the flags, before anything is read or written."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import importlib

    cli = importlib.import_module("04_train")
    cfg = make_tiny_run(tmp_path, train={"epochs": 1})
    with pytest.raises(UserError) as e:
        cli.main(["--config", str(cfg), "--export-only", *flags])
    assert str(e.value).startswith(
        f"--export-only exports the newest checkpoint without training; it cannot be "
        f"combined with {named}"
    )
    assert not (tmp_path / "drafter-sglang").exists()


def test_sigterm_during_export_only_is_one_line_and_leaves_no_temporary_folder(tmp_path):
    """`04 --export-only` ran without a signal handler: SIGTERM while the weights were written (seconds at Kimi scale,
    1.97 GB) killed it silently, leaving `drafter-sglang.tmp-*` with the partial weights beside the export (trial
    2026-12-05g). Now one line `interrupted by SIGTERM: ...`, exit 143, the earlier export as it was, no temporary
    folder."""

    from _signals import sigterm_when

    from eagle3.stages.train import run

    run_yaml = make_tiny_run(tmp_path, train={"epochs": 1})
    cfg = load_config(run_yaml)
    run(cfg, device="cpu", export=export_for_run)
    before = (cfg.export_dir / "model.safetensors").read_bytes()
    marker = tmp_path / "weights-written"
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, time, runpy\nimport safetensors.torch as st\nsave = st.save_file\n"
        "def slow(*a, **k):\n    save(*a, **k)\n"
        f"    open({str(marker)!r}, 'w').close()\n    time.sleep(60)\n"
        "st.save_file = slow\n"
        f"sys.argv = ['04_train.py', '--config', {str(run_yaml)!r}, '--export-only', '--set', 'export.dtype=float32']\n"
        f"runpy.run_path({str(root / '04_train.py')!r}, run_name='__main__')\n"
    )
    env = child_env(root)
    rc, err = sigterm_when(
        [sys.executable, "-c", code], marker.exists, env=env, cwd=tmp_path, wait_s=120
    )
    assert rc == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"interrupted by SIGTERM: nothing is half-written: {cfg.export_dir} is replaced only by a whole export (its "
        "temporary folder was removed), and the checkpoints are only read; re-run the same command to export"
    )
    assert sorted(
        p.name for p in cfg.export_dir.parent.iterdir() if p.name.startswith("drafter")
    ) == ["drafter-sglang"]
    assert (cfg.export_dir / "model.safetensors").read_bytes() == before


def _tree(folder: Path) -> dict:
    return (
        {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}
        if folder.exists()
        else {}
    )


def test_refused_run_leaves_the_train_folder_as_it_was(tmp_path):
    """A refusal after the verifier head was extracted (a missing shard, a truncated train.init_from export) used to
    leave train/target_head.safetensors (57 MB for SmolLM2) behind. Now: a fresh train folder is not left at all, and
    an earlier run's folder keeps exactly its files. drafter.hidden_size is refused before the extraction."""
    from eagle3.stages.train import run

    _save_tiny_verifier(tmp_path / "verifier", tied=False)
    path = make_tiny_run(tmp_path / "run", hidden=16, vocab=40, draft_vocab=20, train={"epochs": 1})
    cfg = load_config(path, [f"verifier.path={tmp_path / 'verifier'}"])
    (
        cfg.train_dir / "target_head.safetensors"
    ).unlink()  # the helper's random head: force extraction
    cfg.train_dir.rmdir()
    (
        cfg.shards_dir / "rows_0-4" / "data_3.pt"
    ).unlink()  # a missing shard: refused by 03's record (no shard read)
    with pytest.raises(UserError, match="changed since 03 last validated them"):
        run(cfg, device="cpu")
    assert not cfg.train_dir.exists()
    # the same set recorded as validated (03 passes what the manifest holds) while split.json still lists sample 3:
    # refused by the data step, after the head was extracted
    from _ddp_worker import mark_validated

    mark_validated(
        cfg.shards_dir,
        cfg.data_dir,
        {"num_samples": 9, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 16},
        torch.zeros(40, dtype=torch.int64),
    )
    with pytest.raises(UserError, match=r"/data/split\.json: key 'train': sample 3 has no shard"):
        run(cfg, device="cpu")
    assert not cfg.train_dir.exists()
    # the line says what to set (it only said why: rehearsal 2026-12-05g)
    with pytest.raises(
        UserError,
        match=r"drafter.hidden_size: 32 differs from the verifier hidden size 16 \(.*"
        r"data_config\.json\); the drafter reuses the verifier's token embedding: set "
        r"drafter.hidden_size: 16 \(or null, the verifier's\)$",
    ):
        run(
            load_config(
                path,
                [
                    f"verifier.path={tmp_path / 'verifier'}",
                    "drafter.hidden_size=32",
                    "drafter.head_dim=8",
                ],
            ),
            device="cpu",
        )
    assert not cfg.train_dir.exists()
    # an export truncated on copy, as train.init_from (fresh folder): refused after the head; nothing left behind
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\x08\x00")
    good = load_config(
        make_tiny_run(tmp_path / "run2", hidden=16, vocab=40, draft_vocab=20, train={"epochs": 1}),
        [f"verifier.path={tmp_path / 'verifier'}", f"train.init_from={src}"],
    )
    (good.train_dir / "target_head.safetensors").unlink()
    good.train_dir.rmdir()
    with pytest.raises(UserError, match="train.init_from"):
        run(good, device="cpu", init=load_init_drafter)
    assert not good.train_dir.exists()
    # a folder an earlier call wrote (its head, a stopped run's checkpoint): a refusal keeps its files as they were
    earlier = load_config(
        make_tiny_run(tmp_path / "run3", hidden=16, vocab=40, draft_vocab=20, train={"epochs": 1})
    )
    run(earlier, stop_after=1, device="cpu")
    before = _tree(earlier.train_dir)
    assert "target_head.safetensors" in before and "checkpoints/step_00000001.pt" in before
    (earlier.shards_dir / "rows_0-4" / "data_3.pt").unlink()
    mark_validated(
        earlier.shards_dir,
        earlier.data_dir,
        {"num_samples": 9, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 16},
        torch.zeros(40, dtype=torch.int64),
    )
    with pytest.raises(UserError, match=r"/data/split\.json: key 'train': sample 3 has no shard"):
        run(earlier, resume=True, device="cpu")
    assert _tree(earlier.train_dir) == before


def test_extract_settings_other_than_the_shards_refused_before_anything_is_written(tmp_path):
    """04 refuses a config whose extract.aux_layers / max_length differ from data_config.json's (one line)."""
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1})
    cfg = load_config(path)
    before = _tree(cfg.train_dir)
    for over, msg in (
        (
            ["extract.aux_layers=[1, 3, 4]"],
            f"{cfg.shards_dir / 'data_config.json'}: extract.aux_layers [2, 3, 4] -> [1, 3, 4]; "
            "re-run 02_extract_hidden.py",
        ),
        (
            ["extract.max_length=64"],
            f"{cfg.shards_dir / 'data_config.json'}: extract.max_length 16 -> 64; "
            "re-run 02_extract_hidden.py",
        ),
    ):
        with pytest.raises(UserError) as e:
            run(load_config(path, over), device="cpu")
        assert str(e.value) == msg
        assert _tree(cfg.train_dir) == before
    r = run(
        load_config(path, ["extract.aux_layers=[2, 3, 4]", "extract.max_length=16"]),
        stop_after=1,
        device="cpu",
    )
    assert r["step"] == 1
    from eagle3.stages.export import (
        export_from_checkpoint,  # 04 --export-only checks the same
    )

    with pytest.raises(UserError) as e:
        export_from_checkpoint(load_config(path, ["extract.aux_layers=[1, 3, 4]"]))
    assert str(e.value).endswith(
        ": extract.aux_layers [2, 3, 4] -> [1, 3, 4]; re-run 02_extract_hidden.py"
    )
    assert not load_config(path).export_dir.exists()


def test_another_verifier_than_the_shards_is_named_first(tmp_path):
    """A config whose verifier is not the shards' (data_config.json) is refused with that, as 03 does, before the
    drafter.hidden_size check it would otherwise trip over (hidden_size never set by the user); --export-only too."""
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1})
    cfg = load_config(
        path, ["verifier.name=org/other-model", "drafter.hidden_size=32", "drafter.head_dim=8"]
    )
    want = (
        f"{cfg.shards_dir / 'data_config.json'}: verifier (verifier.name / verifier.path) 'synthetic' -> "
        f"'org/other-model'; re-run 02_extract_hidden.py"
    )
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu")
    assert str(e.value) == want and not (cfg.train_dir / "checkpoints").exists()
    run(load_config(path), device="cpu", stop_after=1)  # a checkpoint of the right verifier
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    assert str(e.value) == want


def test_loss_png_draws_a_single_train_row(monkeypatch):
    """A run shorter than `train.log_every` logs one train row (its last step): loss.png drew it as a line of one
    point, invisible, so the plot showed a `train` legend entry and no train loss (8 steps, log_every 10)."""
    import matplotlib.pyplot as plt

    from eagle3.train.report import _loss_png

    axes = []
    real = plt.subplots

    def spy(*a, **k):
        fig, ax = real(*a, **k)
        axes.append(ax)
        return fig, ax

    monkeypatch.setattr(plt, "subplots", spy)
    rows = [{"kind": "val", "step": s, "loss": 30.0 - s} for s in (2, 4, 6, 8)] + [
        {"kind": "train", "step": 8, "loss": 17.1}
    ]
    assert _loss_png(rows)
    train = [ln for ln in axes[0].lines if ln.get_label() == "train"][0]
    assert list(train.get_xdata()) == [8] and train.get_marker() not in ("None", "", None)


def test_target_head_file_lacking_a_tensor_or_key_is_refused_naming_it(tmp_path):
    """``target_head.safetensors`` is read as :class:`eagle3.verifier.head.HeadFile`: a missing tensor, metadata key
    or an untied head without ``lm_head`` is refused naming the file and the field."""
    from safetensors.torch import save_file

    path = tmp_path / "target_head.safetensors"
    meta = {"norm_eps": "1e-06", "last_is_post_norm": "True", "tied": "True"}
    save_file({"embed": torch.zeros(4, 2)}, str(path), metadata=meta)
    with pytest.raises(UserError) as e:
        TargetHead.load(tmp_path)
    assert (
        str(e.value)
        == f"{path}: field 'norm_weight' is missing; 04 writes it: remove it and re-run 04"
    )
    save_file(
        {"embed": torch.zeros(4, 2), "norm_weight": torch.ones(2)},
        str(path),
        metadata={**meta, "tied": "False"},
    )
    with pytest.raises(
        UserError, match=r"the record lacks tensor 'lm_head' \(metadata says the head is not tied\)"
    ):
        TargetHead.load(tmp_path)
    save_file(
        {"embed": torch.zeros(4, 2), "norm_weight": torch.ones(2)},
        str(path),
        metadata={"tied": "True"},
    )
    with pytest.raises(UserError, match="field 'norm_eps' is missing"):
        TargetHead.load(tmp_path)
    save_file({"embed": torch.zeros(4, 2), "norm_weight": torch.ones(2)}, str(path), metadata=meta)
    head = TargetHead.load(tmp_path)
    assert head.tied and head.norm_eps == 1e-6 and head.last_is_post_norm is True
