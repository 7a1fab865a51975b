"""Stage 04's messages about the step count and the data an epoch trains: --max-steps past the epochs' steps,
the --stop-at refusal, samples left out of an epoch, a stopped run's report, the resume position."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.process_group import Dist  # noqa: E402

TRAINER = "eagle3.train"  # the train package's loggers


def test_max_steps_past_the_epochs_warns_and_left_out_samples_are_counted(tmp_path, caplog):
    """7 samples, batch_size 4, 2 epochs: 1 step per epoch, 2 in all; --max-steps 10 trains those 2 and says so;
    the 3 samples that do not fill a second batch are named as left out of each epoch."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, n_train=7, train={"epochs": 2, "batch_size": 4, "ckpt_every": 100})
    )
    with caplog.at_level(logging.INFO, logger=TRAINER):
        r = run(cfg, device="cpu", max_steps=10)
    assert (r["step"], r["total_steps"]) == (2, 2)
    warn = [
        x.getMessage()
        for x in caplog.records
        if x.levelno == logging.WARNING and x.name.startswith(TRAINER)
    ]
    assert (
        "--max-steps 10 is more than the 2 optimizer steps of train.epochs 2; it only caps that schedule, so the "
        "run ends after 2 steps (raise train.epochs for a longer run)"
    ) in warn
    info = [
        x.getMessage()
        for x in caplog.records
        if x.levelno == logging.INFO and x.name.startswith(TRAINER)
    ]
    assert [m for m in info if "left out" in m] == [
        "3 of 7 training samples per epoch do not fill a last optimizer step (batch_size x grad_accum x processes = 4 "
        "samples) and are left out of that epoch; the order is reshuffled each epoch, so other samples are left out "
        "each time"
    ]


def test_no_warning_and_no_left_out_line_when_nothing_is_capped_or_left(tmp_path, caplog):
    """8 samples, batch_size 2: nothing left out; train.max_steps 3 below the epoch's 4 steps: no warning."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path, train={"epochs": 1, "batch_size": 2, "max_steps": 3, "ckpt_every": 100}
        )
    )
    with caplog.at_level(logging.INFO, logger=TRAINER):
        r = run(cfg, device="cpu")
    assert r["total_steps"] == 3
    text = caplog.text
    assert "only caps that schedule" not in text and "left out" not in text


def test_token_budget_left_out_batches_are_counted(tmp_path, caplog):
    """train.batch_tokens with grad_accum 2: an odd number of planned batches leaves the last one's samples out."""
    from eagle3.data.batching import TokenBudgetBatchSampler
    from eagle3.stages.train import run

    lengths = (12, 9, 16, 7)
    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=9,
            lengths=lengths,
            train={"epochs": 1, "batch_tokens": 40, "grad_accum": 2, "ckpt_every": 100},
        )
    )
    plan = TokenBudgetBatchSampler(
        [lengths[i % 4] for i in range(9)], 40, grad_accum=2, seed=cfg.train.seed
    )
    batches = plan.epoch_plan(0)
    assert len(batches) % 2 == 1  # the case under test: one batch does not fill a last step
    with caplog.at_level(logging.INFO, logger=TRAINER):
        run(cfg, device="cpu", stop_after=1)
    want = (
        f"train.batch_tokens: {len(batches[-1])} of 9 training samples are left out of the first epoch (their "
        f"batches do not fill a last optimizer step: processes x grad_accum = 2 batches); the count and which "
        f"samples differ per epoch (the batches are re-planned)"
    )
    assert want in [x.getMessage() for x in caplog.records]


def test_stop_at_refusal_names_what_sets_the_schedule_end(tmp_path):
    """--stop-at at the end: train.epochs when the epochs end the schedule (train.max_steps cannot help then),
    --max-steps / train.max_steps when a cap below the epochs' steps ends it."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path / "a", train={"epochs": 1, "batch_size": 2, "max_steps": 9})
    )  # 4 steps
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu", stop_at=4)
    assert str(e.value) == (
        "--stop-at 4: the schedule has 4 optimizer steps; a stop at or after its end is the whole "
        "run (leave --stop-at out, or raise train.epochs (now 1) for a longer schedule)"
    )
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu", stop_at=3, max_steps=3)
    assert str(e.value).endswith(
        "(leave --stop-at out, or raise --max-steps (up to the 4 steps of train.epochs 1; "
        "beyond that, raise train.epochs too))"
    )
    capped = load_config(
        make_tiny_run(tmp_path / "b", train={"epochs": 1, "batch_size": 2, "max_steps": 2})
    )
    with pytest.raises(
        UserError,
        match=r"--stop-at 2: the schedule has 2 optimizer steps; .*or raise "
        r"train\.max_steps \(up to the 4 steps of train\.epochs 1;",
    ):
        run(capped, device="cpu", stop_at=2)


def test_stopped_run_report_says_why_there_is_no_export(tmp_path):
    """A run stopped before its end (signal; here stop_after) exports nothing: train_report.md says so in words."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 1, "batch_size": 2, "ckpt_every": 100})
    )
    r = run(cfg, device="cpu", stop_after=1)
    assert (r["stopped"], r["export_dir"]) == (True, None)
    lines = (cfg.train_dir / "train_report.md").read_text().splitlines()
    assert [x for x in lines if x.startswith("- export:")] == [
        "- export: none (stopped before the end; `04_train.py --resume` goes on, `--export-only` exports the newest "
        "checkpoint)"
    ]


@pytest.mark.parametrize(
    "n_train,batch_size,epochs,stop_after,want",
    [
        (
            7,
            4,
            3,
            2,
            "step 2, at the end of epoch 1",
        ),  # 1 step per epoch: step 2 completes epoch 1 (from 0)
        (8, 2, 1, 1, "step 1, epoch 0, 1 step into it"),
        (8, 2, 1, 2, "step 2, epoch 0, 2 steps into it"),
    ],
)
def test_resume_log_line_names_the_position(
    tmp_path, caplog, n_train, batch_size, epochs, stop_after, want
):
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            n_train=n_train,
            train={"epochs": epochs, "batch_size": batch_size, "ckpt_every": 100},
        )
    )
    run(cfg, device="cpu", stop_after=stop_after)
    with caplog.at_level(logging.INFO, logger=TRAINER):
        run(cfg, resume=True, device="cpu", stop_after=1)
    lines = [x.getMessage() for x in caplog.records if x.getMessage().startswith("resumed from ")]
    assert len(lines) == 1 and lines[0].endswith(f"({want})"), lines


def test_a_verifier_path_to_another_model_is_named_not_a_drafter_field(tmp_path):
    """verifier.path pointed at another model under the shards' verifier.name (a copied config with only the path
    edited): 04 and --export-only said `drafter.hidden_size: 576 differs from the verifier hidden size 64` / named
    drafter fields the user never set (fresh-user trial 2026-12-05d); now one line names the shards' data_config.json,
    the first differing dimension at verifier.path (recorded -> now) and 02. 05 says the same of an export
    (verifier_check)."""
    from transformers import LlamaConfig

    from eagle3.data.vocab import load_run_vocab_map
    from eagle3.decoding.checks import verifier_check
    from eagle3.shards.data_config import read_data_config
    from eagle3.stages.train import run
    from eagle3.train.inputs import build_drafter_args

    path = make_tiny_run(tmp_path / "r")
    null = [
        f"drafter.{k}=null"
        for k in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
        )
    ]
    for name, layers, hidden in (("same", 6, 16), ("other", 30, 64)):
        LlamaConfig(
            vocab_size=48,
            hidden_size=hidden,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        ).save_pretrained(tmp_path / name)
    same = load_config(path, null + [f"verifier.path={tmp_path / 'same'}"])
    dc = read_data_config(same.shards_dir)
    assert (
        build_drafter_args(
            same, dc, load_run_vocab_map(same.data_dir, same.data.draft_vocab_size, 48)
        ).hidden_size
        == 16
    )
    other = load_config(path, null + [f"verifier.path={tmp_path / 'other'}"])
    want = (
        f"{other.shards_dir / 'data_config.json'}: num_layers at verifier.path 6 -> 30; "
        f"re-run 02_extract_hidden.py"
    )
    with pytest.raises(UserError) as e:
        run(other, device="cpu")
    assert str(e.value) == want
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "eagle3_train.json").write_text(
        '{"verifier": {"name": "synthetic", "num_layers": 6, "hidden_size": 16, "vocab_size": 48}}'
    )
    assert (
        verifier_check(
            tmp_path / "d", "synthetic", {"num_layers": 6, "hidden_size": 16, "vocab_size": 48}
        )[0]
        is None
    )
    w, _ = verifier_check(
        tmp_path / "d", "synthetic", {"num_layers": 30, "hidden_size": 64, "vocab_size": 48}
    )
    assert w == (
        f"drafter {tmp_path / 'd' / 'eagle3_train.json'} was exported for verifier 'synthetic' of other "
        f"dimensions than the model at verifier.path (num_layers 6 recorded, 30 at verifier.path; hidden_size 16 "
        f"recorded, 64 at verifier.path)"
    )


def test_an_unusable_export_folder_is_refused_before_training(tmp_path):
    """export.output_dir at a file, under a file, at a folder of other files or at the other engine's export was refused
    only by the export at the END of training: the whole run, then exit 2 with no export and no report (fresh-user
    trial 2026-12-05d). 04_train.py now checks it before anything is written."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[2]
    path = make_tiny_run(tmp_path, train={"max_steps": 2})
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("x")
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "eagle3_train.json").write_text(json.dumps({"engine": "vllm"}))
    cases = {
        tmp_path / "notes.txt": "export.output_dir is a file; choose an empty or new folder",
        tmp_path
        / "notes.txt"
        / "x": f"export.output_dir is under {tmp_path / 'notes.txt'}, which is a file, not a "
        f"folder",
        tmp_path
        / "other": "export.output_dir holds files that are not an eagle3-train export; choose an empty "
        "or new folder",
        tmp_path / "vl": "holds the vllm export; exporting for sglang there would replace it (set "
        "export.output_dir to another folder, e.g. drafter-sglang)",
    }
    for out, want in cases.items():
        r = subprocess.run(
            [
                sys.executable,
                str(root / "04_train.py"),
                "--config",
                str(path),
                "--set",
                f"export.output_dir={out}",
            ],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=300,
        )
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {out}: {want}", (
            r.stderr[-2000:]
        )
        assert not (tmp_path / "train" / "checkpoints").exists()
    # --export-only checks the same (under a file it said '<file>: File exists'), before reading any checkpoint
    out, want = tmp_path / "notes.txt" / "x", cases[tmp_path / "notes.txt" / "x"]
    r = subprocess.run(
        [
            sys.executable,
            str(root / "04_train.py"),
            "--config",
            str(path),
            "--export-only",
            "--set",
            f"export.output_dir={out}",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {out}: {want}", (
        r.stderr[-2000:]
    )


def test_a_refused_stop_at_on_resume_logs_nothing_about_the_schedule_first(tmp_path, caplog):
    """`04 --resume --stop-at 22 --max-steps 21` over a checkpoint of a longer schedule logged `LR schedule ... in the
    checkpoint, now ...; continuing with the new one` and then refused the --stop-at (fresh-user trial 2026-12-05e):
    the check ran after the checkpoint was loaded. It now comes with the other resume checks, before anything is
    loaded or logged about the schedule, as the --max-steps refusal does."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, train={"epochs": 4, "batch_size": 2, "ckpt_every": 1})
    )  # 16 steps
    assert run(cfg, device="cpu", stop_after=3)["step"] == 3
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=TRAINER), pytest.raises(UserError) as e:
        run(cfg, device="cpu", resume=True, max_steps=6, stop_at=7)
    assert str(e.value).startswith(
        "--stop-at 7: the schedule has 6 optimizer steps; a stop at or after its end"
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "resumed from" not in caplog.text


def test_04_warns_when_it_runs_in_another_number_of_processes_than_the_config_plans(tmp_path):
    """configs/kimi-k2.5.yaml plans `train.nproc_per_node: 8`, but the key was documentation only: a plain
    `python 04_train.py` trained in one process with an eighth of the planned global batch, without a word. Now the
    run's warnings (log and train_report.json) name the key, both batches and the torchrun command; a run in the
    planned number of processes, or a config that leaves the key at its default, gets none."""
    import json

    import torch

    from eagle3.stages.train import run
    from eagle3.train.inputs import warn_world_size

    path = make_tiny_run(
        tmp_path, train={"epochs": 1, "nproc_per_node": 8, "batch_size": 2, "grad_accum": 2}
    )
    cfg = load_config(path)
    run(cfg, device="cpu")
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())["warnings"]
    want = (
        "train.nproc_per_node: the config plans 8 processes but 04 runs in 1 (WORLD_SIZE): 2 x 2 x 1 = 4 samples "
        "per optimizer step instead of 32; start it with `torchrun --nproc_per_node 8 04_train.py ...`, or set "
        "train.nproc_per_node: 1 if this is intended"
    )
    assert want in rep
    two = Dist(rank=1, world=2, local_rank=1, device=torch.device("cpu"))
    assert warn_world_size(load_config(path, ["train.nproc_per_node=2"]), two) is None  # as planned
    unset = make_tiny_run(tmp_path / "unset", train={"epochs": 1})
    assert warn_world_size(load_config(unset), two) is None  # the default 1 is no plan
    tok = load_config(path, ["train.batch_tokens=64"])
    assert "1/8 of the planned tokens per optimizer step" in warn_world_size(
        tok, Dist(0, 1, 0, torch.device("cpu"))
    )


def test_stopped_sim_accept_run_report_says_export_only_exports_the_best(tmp_path):
    """A `train.select_best: sim_accept` run stopped after its best validation: train_report.md said `--export-only
    exports the newest checkpoint` / `exports this checkpoint` (step 3) beside the tau_sim heading's `--export-only
    exports step 2, the best`, and --export-only exports best_drafter.pt (fresh-user trial 2026-12-05h)."""
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(
            tmp_path,
            train={
                "epochs": 2,
                "batch_size": 2,
                "ckpt_every": 100,
                "eval_every": 2,
                "select_best": "sim_accept",
            },
        )
    )
    r = run(cfg, device="cpu", stop_after=3)
    best = r["sim_accept"]["best"]["step"]
    assert (r["stopped"], r["step"], best) == (True, 3, 2)
    text = (cfg.train_dir / "train_report.md").read_text()
    assert (
        "- export: none (stopped before the end; `04_train.py --resume` goes on, `--export-only` exports step 2, "
        "the best validation's weights (best_drafter.pt))"
    ) in text
    assert (
        "`--export-only` exports step 2, the best validation's weights (best_drafter.pt)\n" in text
    )
    assert "exports this checkpoint" not in text and "exports the newest checkpoint" not in text


def test_a_train_output_dir_that_is_a_file_is_named_not_hidden_by_the_cleanup(tmp_path):
    """`train.output_dir` pointing at a file: the refusal (`train.output_dir: cannot create the output folder ...`) was
    replaced by the refusal cleanup's own `NotADirectoryError` on `<file>/target_head.safetensors`, which 04 printed
    as `README.md/target_head.safetensors: Not a directory` (fresh-user trial 2026-12-05h)."""
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path, train={"epochs": 1, "batch_size": 2}))
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder\n")
    cfg.train.output_dir = str(notes)
    with pytest.raises(UserError) as e:
        run(cfg, device="cpu")
    assert (
        str(e.value)
        == f"train.output_dir: cannot create the output folder {notes}: {notes} is a file, not a folder"
    )
    assert notes.read_text() == "not a folder\n"
