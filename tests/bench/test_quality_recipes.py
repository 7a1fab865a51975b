"""bench/quality_recipes.py: per-run quality.json with issue 23's keys, the table against the reference
(recipe change, paired deltas), and the headline = the run with the highest mean tau at 3 steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import quality_recipes as qr  # noqa: E402


def _ds(name, tau):
    return {
        "dataset": name,
        "num_prompts": 2,
        "tau": tau,
        "conditional": [0.5, 0.4, 0.3],
        "unconditional": [0.5, 0.2, 0.1],
        "batch_size": 2,
        "speedup": 1.1,
        "drafter_share": 0.2,
        "wall_seconds": 1.0,
        "failures": 0,
        "near_ties": 0,
    }


def _run(root, name, mt, gsm, pp_mt, variant="eagle3", loss="soft_ce", lr=1e-3):
    d = root / name
    d.mkdir(parents=True)
    (d / "bench-steps3.json").write_text(
        json.dumps({"steps": 3, "datasets": [_ds("mtbench", mt), _ds("gsm8k", gsm)]})
    )
    (d / "per_prompt_steps3.json").write_text(
        json.dumps(
            {"per_prompt": {"mtbench": pp_mt, "gsm8k": {"a": [gsm * 10, 10], "b": [gsm * 10, 10]}}}
        )
    )
    (d / "bench-steps7.json").write_text(
        json.dumps({"steps": 7, "datasets": [_ds("mtbench", mt + 0.3)]})
    )
    (d / "train_report.json").write_text(
        json.dumps(
            {
                "step": 100,
                "final_val": {"acc_0": 0.6},
                "drafter_args": {"variant": variant},
                "recipe": {"loss": loss, "lr": lr, "epochs": 6},
                "sim_accept": {
                    "chain": 3,
                    "select_best": "sim_accept",
                    "exported_step": 80,
                    "best": {"step": 80, "tau_sim": 2.2},
                    "rows": [{"step": 80, "tau_sim": 2.2}],
                },
            }
        )
    )
    (d / "prompts_report.json").write_text(json.dumps({"counts": {"kept": 4000}}))


def test_table_deltas_changes_and_headline(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "ref", 2.0, 2.5, {"1": [20, 10], "2": [20, 10]})
    _run(runs, "v31", 2.2, 2.6, {"1": [24, 10], "2": [20, 10]}, variant="eagle3.1")
    _run(runs, "lr2e-3", 1.9, 2.4, {"1": [19, 10], "2": [19, 10]}, lr=2e-3)
    (runs / "broken").mkdir()  # a run whose 05 never finished: left out
    table = qr.summarise(runs, "ref", tmp_path / "out")
    rows = {r["name"]: r for r in table["rows"]}
    assert list(rows) == ["ref", "lr2e-3", "v31"] and rows["ref"]["reference"]
    assert (
        rows["v31"]["change"] == "drafter.variant=eagle3.1"
        and rows["lr2e-3"]["change"] == "train.lr=0.002"
    )
    # paired over the prompts: v31 = (24+20)/20 - (20+20)/20 = +0.2 on MT-bench
    assert rows["v31"]["delta_vs_ref"]["mtbench"]["delta"] == pytest.approx(0.2)
    assert rows["v31"]["tau_steps7"] == {"mtbench": 2.5} and rows["v31"]["sim_accept_best"] == 2.2
    assert table["headline"] == "v31"
    head = json.loads((tmp_path / "out" / "headline" / "quality.json").read_text())
    assert (head["variant"], head["loss"], head["num_train_prompts"], head["headline_run"]) == (
        "eagle3.1",
        "soft_ce",
        4000,
        "v31",
    )
    assert head["goal"]["3"]["mtbench"]["goal"] == 2.8  # issue 23's goals
    assert (tmp_path / "out" / "ref" / "quality.json").is_file()
    md = (tmp_path / "out" / "recipes.md").read_text()
    assert "| v31 | drafter.variant=eagle3.1 | 100 | 0.600 | 2.20 (80) | 2.20 (+0.20 [" in md


def test_cli_refuses_missing_reference(tmp_path):
    _run(tmp_path / "runs", "a", 2.0, 2.5, {"1": [20, 10]})
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "quality_recipes.py"),
            str(tmp_path / "runs"),
            "--ref",
            "ref",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2 and r.stderr.startswith("error:") and "no reference run 'ref'" in r.stderr
    )


def test_headline_only_among_full_benchmarks_and_deadline_runs(tmp_path):
    """An ablation benchmarked on MT-bench alone (the lease's BENCH_ABL) does not win the headline over runs on
    every set, however high its one tau; a run stopped at the deadline (no train_report, only sim_accept.json)
    keeps its curve and last validation step."""
    runs = tmp_path / "runs"
    _run(runs, "ref", 2.0, 2.5, {"1": [20, 10], "2": [20, 10]})
    _run(runs, "full", 2.1, 2.6, {"1": [21, 10], "2": [21, 10]})
    d = runs / "mtonly"
    d.mkdir()
    (d / "bench-steps3.json").write_text(
        json.dumps({"steps": 3, "datasets": [_ds("mtbench", 2.9)]})
    )
    (d / "per_prompt_steps3.json").write_text(
        json.dumps({"per_prompt": {"mtbench": {"1": [29, 10], "2": [29, 10]}}})
    )
    (runs / "full" / "train_report.json").unlink()
    (runs / "full" / "sim_accept.json").write_text(
        json.dumps(
            {
                "chain": 3,
                "best": {"step": 600, "tau_sim": 2.1},
                "rows": [{"step": 400, "tau_sim": 2.0}, {"step": 600, "tau_sim": 2.1}],
            }
        )
    )
    table = qr.summarise(runs, "ref", tmp_path / "out")
    assert (
        table["headline"] == "full"
    )  # mean 2.35 over both sets beats ref's 2.25; mtonly (2.9, one set) is out
    rows = {r["name"]: r for r in table["rows"]}
    assert rows["full"]["optimizer_steps"] == 600 and rows["full"]["sim_accept_best"] == 2.1
    assert rows["full"]["change"].startswith("(no train_report")


def test_a_finished_run_whose_best_came_early_shows_the_scored_weights(tmp_path):
    """select_best sim_accept: a finished run whose best validation came before its last step exports (and 05 scores)
    that validation's weights; the table gave the last step's held-out top-1 (final_val) and step count beside the tau
    of the earlier weights (CPU dry run: `| b | train.lr=0.002 | 900 | ...`, weights of step 20). It now says the
    weights' step and their top-1, as quality_compare's table does for a run stopped at a deadline."""
    runs = tmp_path / "runs"
    _run(runs, "ref", 2.0, 2.5, {"1": [20, 10], "2": [20, 10]})
    _run(runs, "early", 1.9, 2.4, {"1": [19, 10], "2": [19, 10]}, lr=2e-3)
    rep = json.loads((runs / "early" / "train_report.json").read_text())
    rep["sim_accept"]["best"]["alpha"] = [0.7, 0.5, 0.3]
    (runs / "early" / "train_report.json").write_text(json.dumps(rep))
    qr.summarise(runs, "ref", tmp_path / "out")
    md = (tmp_path / "out" / "recipes.md").read_text()
    assert "| early | train.lr=0.002 | 100 (weights of step 80) | 0.700 | 2.20 (80) | 1.90 (" in md
    assert (
        "| ref (ref) | - | 100 | 0.600 | 2.20 (80) | 2.00 |" in md
    )  # no alpha recorded: final_val, as before
    q = json.loads((tmp_path / "out" / "early" / "quality.json").read_text())
    assert q["val_top1_per_position"] == [0.7, 0.5, 0.3] and q["sim_accept"]["exported_step"] == 80
    # the best at the last step: final_val's figures, no weights note
    rep["sim_accept"].update(
        exported_step=100, best={"step": 100, "tau_sim": 2.2, "alpha": [0.7, 0.5, 0.3]}
    )
    (runs / "early" / "train_report.json").write_text(json.dumps(rep))
    qr.summarise(runs, "ref", tmp_path / "out2")
    assert (
        "| early | train.lr=0.002 | 100 | 0.600 | 2.20 (100) |"
        in (tmp_path / "out2" / "recipes.md").read_text()
    )


def test_a_drafter_shape_change_is_named(tmp_path):
    """The change column named only drafter.variant of the drafter's fields: a recipe widening the MLP or adding a
    layer (leases 04d / 04e) was labelled `-`, as if it were the reference."""
    runs = tmp_path / "runs"
    for name, args in (
        ("ref", {"variant": "eagle3.1", "intermediate_size": 1536}),
        ("wide", {"variant": "eagle3.1", "intermediate_size": 6144}),
        ("deep", {"variant": "eagle3.1", "intermediate_size": 1536, "num_layers": 2}),
        ("v30", {"intermediate_size": 1536}),
    ):
        _run(runs, name, 2.0, 2.5, {"1": [20, 10], "2": [20, 10]})
        rep = json.loads((runs / name / "train_report.json").read_text())
        rep["drafter_args"] = {"hidden_size": 576, **args}
        (runs / name / "train_report.json").write_text(json.dumps(rep))
    rows = {r["name"]: r["change"] for r in qr.summarise(runs, "ref", tmp_path / "out")["rows"]}
    assert rows == {
        "ref": "-",
        "wide": "drafter.intermediate_size=6144",
        "deep": "drafter.num_layers=2",
        "v30": "drafter.variant=eagle3",
    }
