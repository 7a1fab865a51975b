"""Checkpoints: atomic files, newest-complete lookup, corrupt fallback, pruning, RNG round trip, shape guard."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.train import resume_checks  # noqa: E402


def _state(step: int, **kw) -> dict:
    s = {
        "step": step,
        "epoch": 0,
        "samples_in_epoch": 2 * step,
        "model": {"w": torch.full((2,), float(step))},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "rng": [ckpt.capture_rng()],
        "drafter_args": {"hidden_size": 8},
        "config_fingerprint": "abc",
        "world_size": 1,
    }
    s.update(kw)
    return s


def test_save_list_prune_and_tmp_ignored(tmp_path):
    for s in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, _state(s), keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    # a half-written newer checkpoint (killed during the atomic write) is invisible
    tmp = ckpt.ckpt_dir(tmp_path) / "step_00000009.pt.tmp-abc123"
    tmp.write_bytes(b"PK\x03\x04 half")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    path, state = ckpt.find_latest_checkpoint(tmp_path)
    assert path.name == "step_00000003.pt" and state["step"] == 3
    assert torch.equal(state["model"]["w"], torch.full((2,), 3.0))
    assert ckpt.remove_stale_tmp(tmp_path) == 1 and not tmp.exists()


def test_corrupt_newest_falls_back_with_warning(tmp_path, caplog):
    ckpt.save_checkpoint(tmp_path, _state(4), keep=5)
    ckpt.save_checkpoint(tmp_path, _state(6), keep=5)
    newest = ckpt.ckpt_path(tmp_path, 6)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated (e.g. copied by a non-atomic tool)
    with caplog.at_level(logging.WARNING, logger="eagle3.train.checkpoint"):
        path, state = ckpt.find_latest_checkpoint(tmp_path)
    assert state["step"] == 4 and path.name == "step_00000004.pt"
    assert "step_00000006.pt" in caplog.text and "skipping" in caplog.text


def test_missing_key_and_no_checkpoint(tmp_path):
    assert ckpt.find_latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="missing keys"):
        ckpt.save_checkpoint(tmp_path, {"step": 1}, keep=1)
    from eagle3.io import atomic_torch_save

    bad = _state(5)
    bad["format"] = ckpt.FORMAT
    del bad["optimizer"]
    atomic_torch_save(bad, ckpt.ckpt_path(tmp_path, 5))
    with pytest.raises(UserError, match="step_00000005.pt: field 'optimizer' is missing"):
        ckpt.load_checkpoint(ckpt.ckpt_path(tmp_path, 5))
    bad["optimizer"], bad["format"] = {}, "eagle3-train-ckpt-v0"
    atomic_torch_save(bad, ckpt.ckpt_path(tmp_path, 5))
    with pytest.raises(
        UserError,
        match="step_00000005.pt: field 'format' should be 'eagle3-train-ckpt-v1', got 'eagle3-train-ckpt-v0'",
    ):
        ckpt.load_checkpoint(ckpt.ckpt_path(tmp_path, 5))
    atomic_torch_save([1, 2], ckpt.ckpt_path(tmp_path, 5))
    with pytest.raises(
        UserError, match="step_00000005.pt: the record should be a JSON object, got list"
    ):
        ckpt.load_checkpoint(ckpt.ckpt_path(tmp_path, 5))


def test_rng_round_trip():
    state = ckpt.capture_rng()
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    ckpt.restore_rng(state)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and want[2] == got[2]


def test_rng_state_survives_weights_only_save(tmp_path):
    from eagle3.io import atomic_torch_save
    from eagle3.io.read import safe_torch_load

    state = ckpt.capture_rng()
    want = torch.rand(2)
    atomic_torch_save({"rng": state}, tmp_path / "r.pt")
    ckpt.restore_rng(safe_torch_load(tmp_path / "r.pt")["rng"])
    assert torch.equal(torch.rand(2), want)


def test_drafter_config_keys_are_the_config_fields():
    """resume_checks.DRAFTER_CONFIG_KEYS (the train package does not read the config) is DrafterConfig's fields."""
    from eagle3.config import DrafterConfig

    assert resume_checks.DRAFTER_CONFIG_KEYS == set(DrafterConfig.model_fields)


def test_drafter_args_problem_names_field():
    same = {"hidden_size": 8, "rms_norm_eps": 1e-6}
    assert resume_checks.drafter_args_problem(same, dict(same)) is None
    got = resume_checks.drafter_args_problem({"hidden_size": 8}, {"hidden_size": 16})
    assert got.startswith(
        "drafter field 'hidden_size' is 8 in the checkpoint but 16 in the config ("
    )


def test_resume_with_different_drafter_shape_is_user_error(tmp_path):
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1})
    run(load_config(path), stop_after=1, device="cpu")
    with pytest.raises(
        UserError,
        match=r"step_00000001.pt: drafter field 'intermediate_size' is 32 in the checkpoint but 48",
    ):
        run(load_config(path, ["drafter.intermediate_size=48"]), resume=True, device="cpu")


def test_a_resume_removes_half_written_files_of_the_train_folder(tmp_path):
    """A hard kill while 04 wrote best_drafter.pt (or sim_accept.json, train_report.json) left its temp file in the
    train folder, as large as the drafter's weights for the best file, and no later run removed it: only the
    checkpoints folder was cleaned. The resume now removes them there too (not in other folders)."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 1, "select_best": "sim_accept"})
    )
    run(cfg, stop_after=2, device="cpu")
    stale = [
        cfg.train_dir / "best_drafter.pt.tmp-k1ll3d",
        cfg.train_dir / "sim_accept.json.tmp-abc",
    ]
    for p in stale:
        p.write_bytes(b"PK\x03\x04 half")
    elsewhere = (
        cfg.train_dir / "tb" / "keep.tmp-x"
    )  # not 04's temp name in the train folder itself: left alone
    elsewhere.parent.mkdir(exist_ok=True)
    elsewhere.write_bytes(b"x")
    run(cfg, resume=True, stop_after=1, device="cpu")
    assert [p.name for p in stale if p.exists()] == [] and elsewhere.exists()
    assert ckpt.remove_stale_tmp(cfg.train_dir) == 0


def test_resume_ignores_half_written_and_corrupt_newest(tmp_path):
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 1, "keep_checkpoints": 3})
    cfg = load_config(path)
    run(cfg, stop_after=2, device="cpu")
    (ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt.tmp-xyz").write_bytes(b"half")
    p2 = ckpt.ckpt_path(cfg.train_dir, 2)
    p2.write_bytes(p2.read_bytes()[:64])
    r = run(cfg, resume=True, stop_after=1, device="cpu")
    assert r["step"] == 2  # resumed from step 1 (step 2 corrupt), did one step
    assert not (
        ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt.tmp-xyz"
    ).exists()  # stale temp cleaned
    assert ckpt.load_checkpoint(ckpt.ckpt_path(cfg.train_dir, 2))["step"] == 2  # rewritten, valid


def _rec(world=None, **groups):
    """A ResumeRecord of checkpoint groups (``data_order=``, ``recipe=``) and a process count."""
    return resume_checks.ResumeRecord.of_state({**groups, "world_size": world})


def _order(saved, now, worlds=(None, None)):
    return resume_checks.data_order_problem(
        _rec(worlds[0], data_order=saved), _rec(worlds[1], data_order=now)
    )


def _batch_change(saved, now, worlds):
    return resume_checks.global_batch_change(
        _rec(worlds[0], data_order=saved), _rec(worlds[1], data_order=now)
    )


def _recipe(saved, now):
    return resume_checks.recipe_changes(_rec(recipe=saved), _rec(recipe=now))


def test_data_order_problem_names_every_changed_key():
    same = {
        "train.seed": 0,
        "train.batch_tokens": None,
        "train.batch_size": 2,
        "train.grad_accum": 1,
    }
    assert _order(dict(same), dict(same)) is None
    # checkpoint from before the key: not checked
    assert _order(None, dict(same)) is None
    assert _order(same, {**same, "train.grad_accum": 2, "train.seed": 5}).startswith(
        "written with train.grad_accum=1, train.seed=0 but the config has train.grad_accum=2, train.seed=5;"
    )


def test_resume_with_changed_batching_is_user_error(tmp_path):
    """Trained with a token budget, resumed without it: used to warn about the LR schedule only and go on
    with batch_size batches (epoch 10 of 8); now refused naming the keys. epochs/max_steps stay allowed."""
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 2})
    run(load_config(path, ["train.batch_tokens=64"]), stop_after=1, device="cpu")
    with pytest.raises(
        UserError,
        match=r"step_00000001.pt: written with train.batch_size=None, train.batch_tokens=64 "
        r"but the config has train.batch_size=\d+, train.batch_tokens=None",
    ):
        run(load_config(path), resume=True, device="cpu")
    with pytest.raises(
        UserError, match=r"written with train.grad_accum=1 but the config has train.grad_accum=2"
    ):
        run(
            load_config(path, ["train.batch_tokens=64", "train.grad_accum=2"]),
            resume=True,
            device="cpu",
        )
    r = run(
        load_config(path, ["train.batch_tokens=64", "train.epochs=1"]),
        resume=True,
        stop_after=1,
        device="cpu",
    )
    assert r["step"] == 2


def test_all_checkpoints_corrupt_is_one_line_error_naming_the_newest(tmp_path, caplog):
    """Checkpoint files that all fail to load are an error, not "no checkpoint": --resume used to warn, train
    from step 0 and overwrite the export; --export-only (same lookup) is refused the same way. Only the newest
    bad: the older one is used, with a warning naming the skipped file."""
    from eagle3.stages.export import export_for_run, export_from_checkpoint
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 2, "keep_checkpoints": 2})
    )
    run(cfg, device="cpu", export=export_for_run)  # checkpoints 2, 4; export written
    p2, p4 = ckpt.ckpt_path(cfg.train_dir, 2), ckpt.ckpt_path(cfg.train_dir, 4)
    p4.write_bytes(p4.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="eagle3.train.checkpoint"):
        path, state = ckpt.find_latest_checkpoint(cfg.train_dir)
    assert (
        state["step"] == 2
        and "step_00000004.pt" in caplog.text
        and "using step_00000002.pt" in caplog.text
    )
    p2.write_bytes(p2.read_bytes()[:100])
    before = {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    for call in (
        lambda: run(cfg, resume=True, device="cpu", export=export_for_run),
        lambda: export_from_checkpoint(cfg, engine="vllm"),
    ):
        with pytest.raises(UserError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(
            f"{ckpt.ckpt_dir(cfg.train_dir)}: none of its 2 checkpoint file(s) loads"
        )
        assert "step_00000004.pt: truncated or corrupt torch file" in msg
    assert {
        p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()
    } == before  # nothing written
    assert not (tmp_path / "drafter-vllm").exists()


def test_a_loss_change_refusal_says_how_to_get_the_export_it_advises():
    """The refusal of a changed loss definition advised a warm start from "this one's export", which a run stopped
    before its end (the usual --resume) does not have: it now says that --export-only writes it from the checkpoint."""
    problem, notes = _recipe({"train.ttt_length": 3}, {"train.ttt_length": 2})
    assert notes == [] and problem == (
        "--resume with another loss definition (train.ttt_length 3 -> 2); set them back, or start a new run from this "
        "one's export with train.init_from in a new train.output_dir (a run stopped before its end has none yet: "
        "04_train.py --export-only writes it from the checkpoint)"
    )


def test_resume_with_changed_recipe_names_fields_and_reports_what_was_used(tmp_path, caplog):
    """--resume with another train.lr: the checkpoint's optimizer keeps its lr; the warning says the config's value is
    NOT used and which one is; the checkpoints written after it record the lr in use (0.001), so a second resume with
    the original config warns nothing (it used to warn "train.lr 0.05 -> 0.001", a value never used); train_report's
    recipe records the lr actually used. A changed loss definition is refused."""
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1, "lr": 1e-3})
    run(load_config(path), stop_after=2, device="cpu")
    for over, field in (
        ("train.ttt_length=2", "train.ttt_length 3 -> 2"),
        ("train.loss=lk_hybrid", "train.loss soft_ce -> lk_hybrid"),
    ):
        with pytest.raises(
            UserError, match=rf"step_00000002.pt: --resume with another loss definition \({field}\)"
        ):
            run(load_config(path, [over]), resume=True, device="cpu")
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        run(
            load_config(path, ["train.lr=0.05", "train.weight_decay=0.5"]),
            resume=True,
            stop_after=1,
            device="cpu",
        )
    note = (
        "train.lr: the config's 0.05 is not used; the checkpoint's 0.001 is kept with its optimizer state and lr "
        "schedule"
    )
    assert (
        note in caplog.text
        and "train.weight_decay: the config's 0.5 is not used; the checkpoint's 0.0 is kept"
        in caplog.text
    )
    train_dir = load_config(path).train_dir
    recipe = ckpt.load_checkpoint(ckpt.ckpt_path(train_dir, 3))["recipe"]
    assert (
        recipe["train.lr"] == 0.001 and recipe["train.weight_decay"] == 0.0
    )  # the values in use, not the config's
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.train"):
        r = run(
            load_config(path), resume=True, device="cpu"
        )  # the original config: nothing changed
    assert "training settings" not in caplog.text and "train.lr" not in caplog.text, caplog.text
    rep = json.loads((train_dir / "train_report.json").read_text())
    assert rep["recipe"]["lr"] == 0.001 and r["recipe"]["lr"] == 0.001
    assert not any("other training settings" in w for w in rep["warnings"])
    lrs = [
        json.loads(x)["lr"]
        for x in (train_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "train"
    ]
    assert max(lrs) <= 0.001  # the schedule of lr 0.001 went on


def test_warnings_logged_during_a_resume_are_listed_in_the_report(tmp_path, caplog):
    """A resume's warnings were in the log only: train_report.json's `warnings` listed the few a call site appended
    there (the changed-settings line), not the skipped unusable newest checkpoint, the older one used instead, or the
    re-stretched lr schedule. Now every warning logged during the call is listed, each text once."""
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 2, "ckpt_every": 1, "keep_checkpoints": 5})
    run(load_config(path), stop_after=3, device="cpu")
    cfg = load_config(path, ["train.epochs=3", "train.lr=0.05"])
    ckpt.ckpt_path(cfg.train_dir, 3).write_bytes(b"broken")  # the newest checkpoint does not load
    with caplog.at_level(logging.WARNING):
        run(cfg, resume=True, device="cpu")
    logged = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("eagle3")
    ]
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())["warnings"]
    assert len(logged) == len(rep) == 4 and all(w in caplog.text for w in rep), (
        rep
    )  # (caplog.text: as logged then)
    assert rep[0].startswith("skipping unusable checkpoint: ") and "step_00000003.pt" in rep[0]
    assert (
        rep[1]
        == "using step_00000002.pt (step 2), not the newest checkpoint file step_00000003.pt, which does not load"
    )
    assert rep[2].endswith(
        "step_00000002.pt: resumed from step_00000002.pt with other training settings: train.epochs "
        "2 -> 3 (the lr schedule is re-stretched to the new horizon); train.lr: the config's "
        "0.05 is not used; the checkpoint's 0.01 is kept with its optimizer state and lr schedule"
    )
    assert (
        "LR schedule {'warmup_steps': 2, 'total_steps': 8} in the checkpoint, now {'warmup_steps': 3, "
        "'total_steps': 12} (train.epochs 2 -> 3)" in rep[3]
    )
    md = (cfg.train_dir / "train_report.md").read_text()
    assert "- **warning**: using step_00000002.pt (step 2), not the newest checkpoint file" in md


def test_recipe_changes_say_which_value_is_used():
    saved = {"train.lr": 0.001, "train.grad_clip": 1.0, "train.step_weight": 1.0}
    problem, notes = _recipe(saved, {**saved, "train.lr": 0.05, "train.grad_clip": 0.5})
    assert problem is None and notes == [
        "train.grad_clip 1.0 -> 0.5 (the new value applies from here on)",
        "train.lr: the config's 0.05 is not used; the checkpoint's 0.001 is kept with its optimizer state "
        "and lr schedule",
    ]


def test_resume_refusal_names_every_changed_field_in_one_line(tmp_path):
    """train.seed (data order) and train.step_weight (loss) changed together: the refusal used to name train.seed only
    (the data-order check raised first); now one line names both, and a changed drafter field as well."""
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 1})
    run(load_config(path), stop_after=1, device="cpu")
    with pytest.raises(UserError) as e:
        run(
            load_config(
                path, ["train.seed=5", "train.step_weight=0.5", "drafter.intermediate_size=48"]
            ),
            resume=True,
            device="cpu",
        )
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(ckpt.ckpt_path(load_config(path).train_dir, 1)))
    for part in (
        "drafter field 'intermediate_size' is 32 in the checkpoint but 48",
        "train.seed=0 but the config has train.seed=5",
        "another loss definition (train.step_weight 0.8 -> 0.5)",
    ):
        assert part in msg, msg


def test_resume_after_03_resplit_is_refused_naming_split_json(tmp_path):
    """03 re-run with another data.seed re-split the samples; --resume went on silently, validating on samples the
    checkpoint had trained on. Now refused in one line naming the checkpoint and split.json; the same split written
    again (other formatting) resumes; a checkpoint from before the key is not checked; a vocab map of the same size
    with other tokens is refused too."""
    from eagle3.data.vocab import load_vocab_map, save_vocab_map
    from eagle3.stages.train import run

    path = make_tiny_run(tmp_path, train={"epochs": 2})
    cfg = load_config(path)
    run(cfg, stop_after=1, device="cpu")
    split_path = cfg.data_dir / "split.json"
    split = json.loads(split_path.read_text())
    split_path.write_text(json.dumps(split, indent=2))  # same content, other bytes: allowed
    assert run(cfg, resume=True, stop_after=1, device="cpu")["step"] == 2
    moved = {
        "train": split["train"][:-1] + split["val"][:1],
        "val": split["train"][-1:] + split["val"][1:],
    }
    split_path.write_text(json.dumps(moved))
    before = {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(UserError) as e:
        run(cfg, resume=True, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"{ckpt.ckpt_path(cfg.train_dir, 2)}: {split_path} is not the split "
        "this checkpoint was trained on: the validation split changed"
    ), msg
    assert "validate on trained samples" in msg
    assert {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    split_path.write_text(json.dumps(split))
    vm = load_vocab_map(cfg.data_dir / "vocab_map.pt")
    target_ids = (vm["d2t"] + torch.arange(24)).tolist()  # [dV] every 2nd target id: 0, 2, ..., 46
    assert target_ids[0] == 0
    other = torch.tensor([1] + target_ids[1:])  # the same size, target id 1 instead of 0
    t2d = torch.zeros(48, dtype=torch.bool)
    t2d[other] = True
    save_vocab_map(cfg.data_dir / "vocab_map.pt", other - torch.arange(24), t2d)
    with pytest.raises(
        UserError, match=r"vocab_map.pt is not the draft vocab map this checkpoint was trained with"
    ):
        run(cfg, resume=True, device="cpu")
    save_vocab_map(cfg.data_dir / "vocab_map.pt", vm["d2t"], vm["t2d"])
    # a checkpoint from before the key: no check
    p2 = ckpt.ckpt_path(cfg.train_dir, 2)
    state = ckpt.load_checkpoint(p2)
    del state["data_inputs"]
    torch.save(state, p2)
    split_path.write_text(json.dumps(moved))
    assert run(cfg, resume=True, stop_after=1, device="cpu")["step"] == 3


def test_export_only_and_resume_refuse_shards_of_other_aux_layers(tmp_path):
    """A checkpoint trained on the states of aux layers [2, 3, 4], exported with `04 --export-only` from a config
    whose shards (another run's extract.output_dir, or 02 re-run with another extract.aux_layers) hold [1, 3, 4] and
    the same vocab map: the export named layers [1, 3, 4], exit 0, so an engine would feed the drafter states it was
    not trained on (trial 2026-12-05g). Checkpoints now record the shards' aux layers (`data_inputs.aux_layers`);
    --export-only and --resume refuse other ones in one line; a checkpoint without the record is not checked."""
    from safetensors.torch import load_file

    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    a = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 2}))
    run(a, stop_after=2, device="cpu")
    assert ckpt.load_checkpoint(ckpt.ckpt_path(a.train_dir, 2))["data_inputs"]["aux_layers"] == [
        2,
        3,
        4,
    ]
    b_yaml = make_tiny_run(
        tmp_path / "b", train={"epochs": 2}, aux_layers=(1, 3, 4)
    )  # same shards, other layers
    b = load_config(
        b_yaml, [f"train.output_dir={a.train_dir}", f"export.output_dir={tmp_path / 'exp'}"]
    )
    want = (
        f"{ckpt.ckpt_path(a.train_dir, 2)}: the shards' aux layers [1, 3, 4] (data_config.json) are not the "
        f"[2, 3, 4] this checkpoint was trained on: the drafter would be fed (and its export would name) other "
        f"layers' states; use the shards it was trained on (extract.output_dir), or train a new run (a new "
        f"train.output_dir)"
    )
    with pytest.raises(UserError) as e:
        export_from_checkpoint(b)
    assert str(e.value) == want and not (tmp_path / "exp").exists()
    with pytest.raises(UserError) as e:
        run(b, resume=True, device="cpu")
    assert want.split(": ", 1)[1] in str(e.value)
    out = export_from_checkpoint(a)  # its own shards: exported, naming its layers
    assert json.loads((out / "eagle3_train.json").read_text())["aux_layers_hf"] == [2, 3, 4]
    assert "d2t" in load_file(out / "model.safetensors")
    p2 = ckpt.ckpt_path(a.train_dir, 2)  # a checkpoint from before the record: not checked
    state = ckpt.load_checkpoint(p2)
    del state["data_inputs"]["aux_layers"]
    torch.save(state, p2)
    assert export_from_checkpoint(b) == tmp_path / "exp"


def test_export_only_and_resume_refuse_shards_of_another_verifiers_weights(tmp_path):
    """A checkpoint trained on shards of one verifier, exported or resumed with the shards of another verifier of the
    same shapes (base vs instruct: same dims, same vocab map size) went through (trial 2026-12-05g): nothing in the
    checkpoint named the weights its states came from. Checkpoints now record data_config.json's `verifier_weights`
    in `data_inputs`; --export-only and --resume refuse another fingerprint in one line; a checkpoint without the
    record is not checked."""
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    wa, wb = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    a = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 2}, verifier_weights=wa))
    run(a, stop_after=2, device="cpu")
    p2 = ckpt.ckpt_path(a.train_dir, 2)
    assert ckpt.load_checkpoint(p2)["data_inputs"]["verifier_weights"] == wa
    b_yaml = make_tiny_run(
        tmp_path / "b", train={"epochs": 2}, verifier_weights=wb
    )  # same shapes, other weights
    b = load_config(
        b_yaml, [f"train.output_dir={a.train_dir}", f"export.output_dir={tmp_path / 'exp'}"]
    )
    want = (
        f"{p2}: the shards' verifier weights {wb[:19]}... (data_config.json verifier_weights) are not the "
        f"{wa[:19]}... this checkpoint was trained on: the shards were captured from another verifier of the same "
        f"shapes; use the shards it was trained on (extract.output_dir), or train a new run (a new "
        f"train.output_dir)"
    )
    with pytest.raises(UserError) as e:
        export_from_checkpoint(b)
    assert str(e.value) == want and not (tmp_path / "exp").exists()
    before = sorted(p.name for p in ckpt.ckpt_dir(a.train_dir).iterdir())
    with pytest.raises(UserError) as e:
        run(b, resume=True, device="cpu")
    assert want.split(": ", 1)[1] in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in ckpt.ckpt_dir(a.train_dir).iterdir()) == before
    assert export_from_checkpoint(a).is_dir()  # its own shards: exported
    state = ckpt.load_checkpoint(p2)  # a checkpoint from before the record: not checked
    del state["data_inputs"]["verifier_weights"]
    torch.save(state, p2)
    assert export_from_checkpoint(b) == tmp_path / "exp"


def test_inputs_a_checkpoint_did_not_record_are_said_at_resume_and_export(tmp_path, caplog):
    """--resume and --export-only compared the checkpoint's data_inputs (split, vocab map, aux layers, verifier
    weights) with the run's only where both sides had them: a checkpoint of before the record, or shards that gained a
    weights fingerprint since, passed without a word. One warning line now names what was not compared (in
    train_report.json's warnings on a resume); both sides without a fingerprint is check_verifier's to say."""
    from eagle3.stages.export import export_from_checkpoint
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path / "a", train={"epochs": 2, "ckpt_every": 1}))
    run(cfg, stop_after=2, device="cpu")
    p2 = ckpt.ckpt_path(cfg.train_dir, 2)
    state = ckpt.load_checkpoint(p2)
    assert (
        state["data_inputs"]["verifier_weights"] is None
    )  # shards without one: nothing said (both sides)
    assert (
        resume_checks.data_inputs_unchecked(
            p2, state["data_inputs"], {"verifier_weights": None}, "--resume"
        )
        is None
    )
    del state["data_inputs"]
    torch.save(state, p2)
    for p in ckpt.list_checkpoints(cfg.train_dir):  # only step 2 left: the one without the record
        if p[1] != p2:
            p[1].unlink()
    with caplog.at_level(logging.WARNING):
        export_from_checkpoint(cfg)
    want = (
        f"{p2}: records no data_inputs (a checkpoint of before the record): --export-only did not check "
        f"vocab_map.pt (the draft vocab), the shards' aux layers against what it was trained on; check that 02 and "
        f"03 were not re-run with other settings since that checkpoint"
    )
    assert caplog.messages.count(want) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(cfg, resume=True, device="cpu", stop_after=3)
    want = (
        f"{p2}: records no data_inputs (a checkpoint of before the record): --resume did not check split.json "
        f"(the validation split), vocab_map.pt (the draft vocab), the shards' aux layers against what it was "
        f"trained on; check that 02 and 03 were not re-run with other settings since that checkpoint"
    )
    assert caplog.messages.count(want) == 1
    assert want in json.loads((cfg.train_dir / "train_report.json").read_text())["warnings"]
    assert resume_checks.data_inputs_unchecked(
        p2,
        {
            "vocab_map.pt": "x",
            "aux_layers": [2, 3, 4],
            "split.json": "y",
            "verifier_weights": "sha256:a",
        },
        {"verifier_weights": None},
        "--resume",
    ) == (
        f"{p2}: records data_inputs.verifier_weights but the shards' data_config.json has none: --resume did not check "
        f"the shards' verifier weights against what it was trained on; check that 02 and 03 were not re-run with "
        f"other settings since that checkpoint"
    )


def test_resume_past_the_requested_total_is_refused_before_writing(tmp_path, caplog):
    """A checkpoint at step 6 resumed with max_steps 3 used to print "trained: 6/3", re-export and rewrite the
    report; now one line naming --max-steps, and no file written; refused before the "LR schedule ... continuing with
    the new one" line, which it used to log first."""
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path, train={"epochs": 2}))
    run(cfg, stop_after=6, device="cpu")
    before = {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with (
        caplog.at_level(logging.INFO, logger="eagle3.train"),
        pytest.raises(
            UserError,
            match=r"^--max-steps 3: the run ends after 3 optimizer steps, but the checkpoint "
            r"resumed from \(.*step_00000006.pt\) is at step 6 already",
        ),
    ):
        run(cfg, resume=True, max_steps=3, device="cpu")
    assert "LR schedule" not in caplog.text and "continuing with the new one" not in caplog.text, (
        caplog.text
    )
    assert {p: p.stat().st_mtime_ns for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    assert (
        run(cfg, resume=True, max_steps=6, device="cpu")["step"] == 6
    )  # at the total: the run's end, allowed
    cfg.train.epochs = (
        1  # the config's `epochs: 1`, read as the float 1.0: was named `train.epochs 1.0`
    )
    with pytest.raises(
        UserError,
        match=r"^train\.epochs 1: the run ends after \d optimizer steps, but the checkpoint",
    ):
        run(cfg, resume=True, device="cpu")


def test_export_only_refuses_a_broken_newest_checkpoint_and_leaves_the_export(tmp_path):
    """--export-only whose newest checkpoint does not load used to warn and replace the export with the older
    checkpoint's weights (exit 0). With the weights from the checkpoint (select_best: last) it is now one line naming
    the broken file and the older step, and the export is left byte-identical; with the broken file deleted, that
    step is exported. (sim_accept with a best file exports the best weights whatever checkpoint loads:
    tests/train/test_sim_accept.py::test_export_only_keeps_best_drafter_and_exports_it_after_a_checkpoint_fallback.)"""
    from eagle3.stages.export import export_for_run, export_from_checkpoint
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            train={"epochs": 1, "ckpt_every": 2, "keep_checkpoints": 2, "select_best": "last"},
        )
    )
    run(cfg, device="cpu", export=export_for_run)  # checkpoints 2, 4; export of step 4
    p4 = ckpt.ckpt_path(cfg.train_dir, 4)
    p4.write_bytes(p4.read_bytes()[:100])
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(UserError) as e:
        export_from_checkpoint(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"the newest checkpoint does not load: {p4}: truncated or corrupt"
    ), msg
    assert (
        "the newest that loads is step_00000002.pt (step 2): delete step_00000004.pt to use step 2, or "
        "04_train.py --resume to train on from it"
    ) in msg
    assert {
        p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()
    } == before  # export untouched
    p4.unlink()
    out = export_from_checkpoint(cfg)
    from safetensors.torch import load_file

    ref = ckpt.load_checkpoint(ckpt.ckpt_path(cfg.train_dir, 2))["model"]["fc.weight"]
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["fc.weight"], ref.to(torch.bfloat16)
    )


def test_data_order_lets_the_split_change_only_with_the_global_batch():
    """batch_size / grad_accum may change on a resume where batch_size x grad_accum x processes stays the checkpoint's
    (8 ranks resumed on 4 with twice the grad_accum); otherwise the refusal names the global batch."""
    saved = {
        "train.seed": 0,
        "train.batch_tokens": None,
        "train.batch_size": 2,
        "train.grad_accum": 1,
    }
    assert _order(saved, {**saved, "train.grad_accum": 2}, (8, 4)) is None
    assert _order(saved, {**saved, "train.batch_size": 1, "train.grad_accum": 4}, (8, 4)) is None
    assert _batch_change(saved, {**saved, "train.grad_accum": 2}, (8, 4)) is None
    msg = _order(saved, {**saved, "train.grad_accum": 3}, (8, 4))
    assert msg.startswith(
        "written with train.grad_accum=1 but the config has train.grad_accum=3; resume keeps the "
        "data order only with the same seed and batching (train.batch_size and train.grad_accum may "
        "change only where they keep the global batch of 16: 2 x 1 x 8 then, 2 x 3 x 4 now)"
    ), msg
    assert _batch_change(saved, saved, (8, 4)) == (
        "global batch 16 -> 8 samples per optimizer step (train.batch_size x train.grad_accum x processes: 2 x 1 x 8 "
        "then, 2 x 1 x 4 now); --set train.grad_accum=2 keeps the checkpoint's"
    )
    budget = {**saved, "train.batch_tokens": 4096, "train.batch_size": None}
    assert _order(budget, {**budget, "train.grad_accum": 2}, (2, 1)) is None
    assert _batch_change(budget, budget, (2, 1)).startswith(
        "global batch 2 -> 1 token-budget batches per optimizer step (train.grad_accum x processes: 1 x 2 then, 1 x 1 now)"
    )
    assert _order(saved, {**saved, "train.grad_accum": 2}) is not None  # process counts unknown


def test_a_malformed_checkpoint_record_is_one_line_naming_the_key():
    """A checkpoint's data_order / recipe / data_inputs value of the wrong type is refused naming the key."""
    with pytest.raises(UserError) as e:
        resume_checks.ResumeRecord.of_state({"data_order": {"train.seed": "x"}}, "c.pt")
    assert str(e.value).startswith("c.pt: key 'train.seed': Input should be a valid integer")
    assert _rec(recipe={"train.lr": 0.1}).model_fields_set == {"train_lr", "written_by", "version"}
