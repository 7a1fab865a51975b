"""Checkpoints: atomic files, newest-complete lookup, corrupt fallback, pruning, RNG round trip, shape guard."""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.train import checkpoint as ckpt  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402


def _state(step: int, **kw) -> dict:
    s = {"step": step, "epoch": 0, "samples_in_epoch": 2 * step, "model": {"w": torch.full((2,), float(step))},
         "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step}, "rng": [ckpt.capture_rng()],
         "drafter_args": {"hidden_size": 8}, "config_fingerprint": "abc", "world_size": 1}
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
    with pytest.raises(UserError, match="step_00000005.pt: missing key 'optimizer'"):
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
    from eagle3.io import atomic_torch_save, safe_torch_load

    state = ckpt.capture_rng()
    want = torch.rand(2)
    atomic_torch_save({"rng": state}, tmp_path / "r.pt")
    ckpt.restore_rng(safe_torch_load(tmp_path / "r.pt")["rng"])
    assert torch.equal(torch.rand(2), want)


def test_check_drafter_args_names_field():
    ckpt.check_drafter_args("c.pt", {"hidden_size": 8, "rms_norm_eps": 1e-6}, {"hidden_size": 8, "rms_norm_eps": 1e-6})
    with pytest.raises(UserError, match=r"c.pt: drafter field 'hidden_size' is 8 in the checkpoint but 16"):
        ckpt.check_drafter_args("c.pt", {"hidden_size": 8}, {"hidden_size": 16})


def test_resume_with_different_drafter_shape_is_user_error(tmp_path):
    from eagle3.train.trainer import run

    path = make_tiny_run(tmp_path, train={"epochs": 1})
    run(load_config(path), stop_after=1, device="cpu")
    with pytest.raises(UserError, match=r"step_00000001.pt: drafter field 'intermediate_size' is 32 in the checkpoint but 48"):
        run(load_config(path, ["drafter.intermediate_size=48"]), resume=True, device="cpu")


def test_resume_ignores_half_written_and_corrupt_newest(tmp_path):
    from eagle3.train.trainer import run

    path = make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 1, "keep_checkpoints": 3})
    cfg = load_config(path)
    run(cfg, stop_after=2, device="cpu")
    (ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt.tmp-xyz").write_bytes(b"half")
    p2 = ckpt.ckpt_path(cfg.train_dir, 2)
    p2.write_bytes(p2.read_bytes()[:64])
    r = run(cfg, resume=True, stop_after=1, device="cpu")
    assert r["step"] == 2  # resumed from step 1 (step 2 corrupt), did one step
    assert not (ckpt.ckpt_dir(cfg.train_dir) / "step_00000003.pt.tmp-xyz").exists()  # stale temp cleaned
    assert ckpt.load_checkpoint(ckpt.ckpt_path(cfg.train_dir, 2))["step"] == 2  # rewritten, valid


def test_check_data_order_names_every_changed_key():
    same = {"train.seed": 0, "train.batch_tokens": None, "train.batch_size": 2, "train.grad_accum": 1}
    ckpt.check_data_order("c.pt", dict(same), dict(same))
    ckpt.check_data_order("c.pt", None, dict(same))  # checkpoint from before the key: not checked
    with pytest.raises(UserError, match=r"c.pt: written with train.grad_accum=1, train.seed=0 but the config has "
                                        r"train.grad_accum=2, train.seed=5;"):
        ckpt.check_data_order("c.pt", same, {**same, "train.grad_accum": 2, "train.seed": 5})


def test_resume_with_changed_batching_is_user_error(tmp_path):
    """Trained with a token budget, resumed without it: used to warn about the LR schedule only and go on
    with batch_size batches (epoch 10 of 8); now refused naming the keys. epochs/max_steps stay allowed."""
    from eagle3.train.trainer import run

    path = make_tiny_run(tmp_path, train={"epochs": 2})
    run(load_config(path, ["train.batch_tokens=64"]), stop_after=1, device="cpu")
    with pytest.raises(UserError, match=r"step_00000001.pt: written with train.batch_size=None, train.batch_tokens=64 "
                                        r"but the config has train.batch_size=\d+, train.batch_tokens=None"):
        run(load_config(path), resume=True, device="cpu")
    with pytest.raises(UserError, match=r"written with train.grad_accum=1 but the config has train.grad_accum=2"):
        run(load_config(path, ["train.batch_tokens=64", "train.grad_accum=2"]), resume=True, device="cpu")
    r = run(load_config(path, ["train.batch_tokens=64", "train.epochs=1"]), resume=True, stop_after=1, device="cpu")
    assert r["step"] == 2
