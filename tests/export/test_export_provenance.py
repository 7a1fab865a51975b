"""An export records where its weights come from (``trained_from`` in ``eagle3_train.json``: train dir, checkpoint,
step, select_best, selected step), leaves ``config.json`` (what SGLang / vLLM read) unchanged, and warns when it
replaces the export of another training folder (still replacing it: re-exports are on purpose)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.export.reader import load_exported  # noqa: E402
from eagle3.stages.export import export_for_run, export_from_checkpoint  # noqa: E402
from eagle3.stages.train import run  # noqa: E402
from eagle3.train import checkpoint as ckpt  # noqa: E402

TRAIN = {"epochs": 1, "batch_size": 2, "eval_every": 1, "ckpt_every": 100}


def _meta(folder: Path) -> dict:
    return json.loads((folder / "eagle3_train.json").read_text())


def test_export_records_provenance_and_warns_when_another_run_replaces_it(tmp_path, caplog):
    a = load_config(
        make_tiny_run(
            tmp_path / "a", n_train=4, n_val=2, train={**TRAIN, "select_best": "sim_accept"}
        )
    )
    ra = run(a, device="cpu", export=export_for_run)
    prov = _meta(a.export_dir)["trained_from"]
    best = json.loads((a.train_dir / "sim_accept.json").read_text())["best"]["step"]
    assert prov == {
        "train_dir": str(a.train_dir.resolve()),
        "checkpoint": str(Path(ra["checkpoint"]).resolve()),
        "step": 2,
        "select_best": "sim_accept",
        "selected_step": best,
    }
    assert ckpt.ckpt_path(a.train_dir, 2).resolve() == Path(prov["checkpoint"])
    assert (
        "trained_from" not in (a.export_dir / "config.json").read_text()
    )  # the engines' file: unchanged
    assert load_exported(a.export_dir, embed_weight=torch.zeros(48, 16)).args.variant == "eagle3"

    # a second run (another train dir) exporting into the first run's folder: replaced, with a warning
    b = load_config(
        make_tiny_run(tmp_path / "b", n_train=4, n_val=2, train=TRAIN),
        [f"export.output_dir={a.export_dir}"],
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.export.folder"):
        run(b, device="cpu", export=export_for_run)
    warned = [
        r.getMessage()
        for r in caplog.records
        if "replacing the export of another training run" in r.getMessage()
    ]
    assert (
        len(warned) == 1
        and str(a.train_dir.resolve()) in warned[0]
        and str(b.train_dir.resolve()) in warned[0]
    )
    prov_b = _meta(a.export_dir)["trained_from"]
    assert prov_b["train_dir"] == str(b.train_dir.resolve()) and prov_b["select_best"] == "last"
    assert prov_b["selected_step"] == prov_b["step"] == 2

    # --export-only of the same run into it again: no warning; the checkpoint it read is recorded
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.export.folder"):
        out = export_from_checkpoint(b)
    assert not [r for r in caplog.records if "another training run" in r.getMessage()]
    again = _meta(out)["trained_from"]
    assert again == {**prov_b, "checkpoint": str(ckpt.ckpt_path(b.train_dir, 2).resolve())}


def test_vllm_export_drafts_the_benchmarked_chain(tmp_path):
    """The vLLM folder's speculators_config says to draft benchmark.steps tokens (it said 3 whatever the run
    benchmarked: `vllm serve` with only the model in --speculative-config drafted another chain; trial 05e)."""
    cfg = load_config(
        make_tiny_run(tmp_path / "r", n_train=4, n_val=2, train=TRAIN),
        ["export.engine=vllm", "benchmark.steps=2"],
    )
    run(cfg, device="cpu", export=export_for_run)
    sc = json.loads((cfg.export_dir / "config.json").read_text())["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 2
    # --export-only follows the config it is given
    again = export_from_checkpoint(
        load_config(tmp_path / "r" / "run.yaml", ["export.engine=vllm", "benchmark.steps=3"])
    )
    methods = json.loads((again / "config.json").read_text())["speculators_config"][
        "proposal_methods"
    ]
    assert methods[0]["speculative_tokens"] == 3


def test_layers_sglang_cannot_serve_refused_before_training(tmp_path):
    """Shards of a DeepSeek-family verifier at HF [1, 3, 4]: 04 for SGLang refuses at start (nothing trained, no
    checkpoint), naming data_config.json and export.engine; it trained for the whole run and then had its export
    refused, with a message promising that --export-only would do after a fix (trial 05e). For vLLM it trains."""
    import pytest

    from eagle3.errors import UserError

    path = make_tiny_run(
        tmp_path / "r",
        n_train=4,
        n_val=2,
        train=TRAIN,
        architecture="DeepseekV3ForCausalLM",
        aux_layers=(1, 3, 4),
    )
    cfg = load_config(path)
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu", export=export_for_run)
    assert str(e.value).startswith(
        f"{cfg.shards_dir / 'data_config.json'}: export.engine sglang cannot serve"
    )
    assert not ckpt.ckpt_path(cfg.train_dir, 2).exists() and not cfg.export_dir.exists()
    cfg_v = load_config(path, ["export.engine=vllm"])
    run(cfg_v, device="cpu", export=export_for_run)
    assert json.loads((cfg_v.export_dir / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 3, 4]


def test_export_records_the_ttt_length_it_was_trained_for(tmp_path):
    """05 could not tell how many draft positions an export was trained for (trial 2026-12-05g): `eagle3_train.json`
    now records `ttt_length`, train.ttt_length at the end of training, and the checkpoint's under `--export-only`
    (whatever the config says now: --resume refuses another one, so the checkpoint's is the trained one)."""
    cfg = load_config(
        make_tiny_run(tmp_path, n_train=4, n_val=2, train=TRAIN)
    )  # train.ttt_length 3
    run(cfg, device="cpu", export=export_for_run)
    assert _meta(cfg.export_dir)["ttt_length"] == 3
    other = load_config(
        make_tiny_run(tmp_path, n_train=4, n_val=2, train=TRAIN),
        ["train.ttt_length=5", f"export.output_dir={tmp_path / 'again'}"],
    )
    assert _meta(export_from_checkpoint(other))["ttt_length"] == 3


def test_a_second_export_only_on_the_same_train_or_export_folder_stops_at_once(tmp_path):
    """`04 --export-only` took no lock: two of them into one export folder (trial 2026-12-05g) raced on the final
    rename of the folder. It now holds 04's own `{train_dir}/.train.lock` (one 04 per train folder, training or
    exporting), and every export holds `.{export folder}.lock` beside its folder (two train folders exporting into
    one). A second one stops at once with one line naming the lock; the export already there stays as it was, no
    temporary folder is left, and once the first is done the lock files are gone."""
    from eagle3.errors import UserError
    from eagle3.export.folder import export_lock_path
    from eagle3.io import exclusive_lock

    cfg = load_config(make_tiny_run(tmp_path / "a", n_train=4, n_val=2, train=TRAIN))
    run(cfg, device="cpu", export=export_for_run)
    before = {p.name: p.read_bytes() for p in cfg.export_dir.iterdir()}
    lock = cfg.train_dir / ".train.lock"
    with exclusive_lock(lock, "the first --export-only"):
        with pytest.raises(UserError) as e:
            export_from_checkpoint(cfg)
    assert str(e.value) == (
        f"{lock}: another 04_train run is training or exporting in {cfg.train_dir}; wait for it "
        f"to end (or stop it) before this one"
    )
    other = load_config(
        make_tiny_run(tmp_path / "b", n_train=4, n_val=2, train=TRAIN),
        [f"export.output_dir={cfg.export_dir}"],
    )  # another train folder, the same export folder
    run(other, device="cpu")
    elock = export_lock_path(cfg.export_dir)
    assert elock == cfg.export_dir.parent / ".drafter-sglang.lock"
    with exclusive_lock(elock, "the first export"):
        with pytest.raises(UserError) as e:
            export_from_checkpoint(other)
    assert str(e.value) == (
        f"{elock}: another 04_train run is exporting to {cfg.export_dir}; wait for it to end, or "
        f"set export.output_dir for a second export folder"
    )
    assert {
        p.name: p.read_bytes() for p in cfg.export_dir.iterdir()
    } == before  # the first one's export, whole
    assert (
        not list(cfg.export_dir.parent.glob("*.tmp-*")) and not lock.exists() and not elock.exists()
    )
    assert export_from_checkpoint(other) == cfg.export_dir  # the locks released: it exports
    assert (
        not lock.exists() and not elock.exists() and not (other.train_dir / ".train.lock").exists()
    )
