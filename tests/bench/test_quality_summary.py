"""bench/quality_summary.py: issue 10's quality.json from a run's reports (values read, never invented)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import quality_summary as qs  # noqa: E402


def _ds(name, n, tau, cond):
    return {
        "dataset": name,
        "num_prompts": n,
        "tau": tau,
        "conditional": cond,
        "unconditional": cond,
        "batch_size": 80,
        "speedup": 1.5,
        "drafter_share": 0.2,
        "wall_seconds": 10.0,
        "failures": 0,
        "near_ties": 3,
    }


def _run(tmp_path, mt3=2.6, gsm3=3.1, mt7=3.2):
    (tmp_path / "bench-steps3.json").write_text(
        json.dumps(
            {
                "dtype": "float32",
                "max_new_tokens": 256,
                "datasets": [
                    _ds("mtbench", 80, mt3, [0.5, 0.4, 0.3]),
                    _ds("gsm8k", 200, gsm3, [0.7, 0.6, 0.5]),
                ],
            }
        )
    )
    (tmp_path / "bench-steps7.json").write_text(
        json.dumps(
            {"datasets": [_ds("mtbench", 80, mt7, [0.5] * 7), _ds("gsm8k", 200, 3.5, [0.7] * 7)]}
        )
    )
    (tmp_path / "train_report.json").write_text(
        json.dumps({"tokens_per_s": 1.0, "final_val": {"acc_0": 0.6, "acc_1": 0.55}})
    )
    (tmp_path / "data_report.json").write_text(
        json.dumps({"num_loss_tokens": 1234, "num_tokens": 2000})
    )
    return tmp_path


def test_collect_tau_goal_and_gap(tmp_path):
    q = qs.collect(_run(tmp_path), "configs/x.yaml", "a=1 b=2")
    assert q["tau"] == {"3": {"mtbench": 2.6, "gsm8k": 3.1}, "7": {"mtbench": 3.2, "gsm8k": 3.5}}
    assert q["num_prompts"] == {"mtbench": 80, "gsm8k": 200} and q["loss_tokens"] == 1234
    assert q["config"] == "configs/x.yaml" and q["overrides"] == ["a=1", "b=2"]
    assert q["goal_met"] is True
    # held-out top-1 at position 1 (0.6) minus each set's conditional acceptance at position 1
    assert q["train_eval_gap_pos1"] == {"mtbench": pytest.approx(0.1), "gsm8k": pytest.approx(-0.1)}
    assert q["val_top1_per_position"] == [0.6, 0.55]
    assert "| 3 | 2.60 (goal 2.5) | 3.10 (goal 3.0) |" in qs.markdown(q)
    q = qs.collect(_run(tmp_path, gsm3=2.99), "c", "")
    assert q["goal_met"] is False and q["goal"]["3"]["gsm8k"] == {
        "goal": 3.0,
        "tau": 2.99,
        "met": False,
    }


def test_variant_loss_train_prompts_sim_accept_and_issue23_goals(tmp_path):
    run = _run(tmp_path)
    (run / "train_report.json").write_text(
        json.dumps(
            {
                "final_val": {"acc_0": 0.6},
                "drafter_args": {"variant": "eagle3.1", "intermediate_size": 6144, "num_layers": 2},
                "recipe": {"loss": "lk_hybrid", "lr": 1e-3, "epochs": 6},
                "sim_accept": {
                    "chain": 3,
                    "select_best": "sim_accept",
                    "exported_step": 20,
                    "best": {"step": 20, "tau_sim": 2.4},
                    "rows": [{"step": 10, "tau_sim": 2.1}, {"step": 20, "tau_sim": 2.4}],
                },
            }
        )
    )
    (run / "prompts_report.json").write_text(json.dumps({"counts": {"kept": 6000}}))
    q = qs.collect(run, "c", "", goals="23")
    assert (q["variant"], q["loss"], q["num_train_prompts"]) == ("eagle3.1", "lk_hybrid", 6000)
    assert q["drafter"] == {"intermediate_size": 6144, "num_layers": 2}
    assert (
        q["sim_accept"]["curve"] == [[10, 2.1], [20, 2.4]]
        and q["sim_accept"]["exported_step"] == 20
    )
    assert (
        q["goal"]["3"]["mtbench"] == {"goal": 2.8, "tau": 2.6, "met": False}
        and q["goal_met"] is False
    )
    # a run folder from before these keys existed: eagle3, soft_ce
    (run / "train_report.json").write_text(json.dumps({"final_val": {"acc_0": 0.6}}))
    q = qs.collect(run, "c", "")
    assert (q["variant"], q["loss"], q["sim_accept"]) == ("eagle3", "soft_ce", None)
    assert q["drafter"] == {
        "intermediate_size": None,
        "num_layers": 1,
    }  # one layer when DrafterArgs.to_json leaves it out


def test_cli_writes_json_md_png_and_refuses_empty_folder(tmp_path):
    run = _run(tmp_path / "run") if (tmp_path / "run").mkdir() is None else None
    out = tmp_path / "q.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quality_summary.py"), str(run), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["tau"]["3"]["mtbench"] == 2.6
    assert out.with_suffix(".md").read_text().startswith("| steps |")
    assert (tmp_path / "q_positions.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty").mkdir()
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "quality_summary.py"),
            str(tmp_path / "empty"),
            "--out",
            str(tmp_path / "e.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error:") and "bench-steps" in r.stderr
    assert not (tmp_path / "e.json").exists()


def test_tau_by_category_from_per_prompt_rows(tmp_path, monkeypatch):
    """Category tau = emitted tokens / verify steps summed over the category's prompts; MT-bench's own
    categories come from its question file in the shared data folder."""
    run = _run(tmp_path / "run") if (tmp_path / "run").mkdir() is None else None
    b = json.loads((run / "bench-steps3.json").read_text())
    b["datasets"][0]["per_prompt"] = [
        {"id": "81", "accept_lengths": [1, 2, 3]},  # writing: 6 / 3
        {"id": "82", "accept_lengths": [1, 1]},  # writing: 2 / 2
        {"id": "91", "accept_lengths": [4]},
    ]  # math: 4 / 1
    b["datasets"][1]["per_prompt"] = [{"id": 0, "accept_lengths": [2, 3]}]  # gsm8k -> math kind
    (run / "bench-steps3.json").write_text(json.dumps(b))
    shared = tmp_path / "shared"
    (shared / "eval").mkdir(parents=True)
    (shared / "eval" / "mt_bench_question.jsonl").write_text(
        "\n".join(
            json.dumps(q)
            for q in [
                {"question_id": 81, "category": "writing"},
                {"question_id": 82, "category": "writing"},
                {"question_id": 91, "category": "math"},
            ]
        )
        + "\n"
    )
    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(shared))
    q = qs.collect(run, "c")
    cat = q["tau_by_category_steps3"]
    assert cat["by_kind"] == {"chat": round(12 / 6, 4), "math": 2.5}
    assert cat["mtbench"] == {
        "math": {"tau": 4.0, "verify_steps": 1},
        "writing": {"tau": 1.6, "verify_steps": 5},
    }
    assert "| writing | 1.60 | 5 |" in qs.markdown(q)


def test_a_run_stopped_before_its_final_validation_reports_the_exported_best(tmp_path):
    """Lease 2026-12-04e's run was stopped at step 6,007 (no final_val, exported_step None in its train report) and
    exported the best validation's weights (step 6,000): its held-out top-1 per position and exported step are that
    validation's, not blanks."""
    run = _run(tmp_path)
    (run / "train_report.json").write_text(
        json.dumps(
            {
                "step": 6007,
                "stopped": True,
                "final_val": {},
                "sim_accept": {
                    "chain": 3,
                    "select_best": "sim_accept",
                    "exported_step": None,
                    "best": {
                        "step": 6000,
                        "tau_sim": 3.41,
                        "alpha": [0.896421, 0.892675, 0.890527],
                    },
                    "rows": [{"step": 5000, "tau_sim": 3.38}, {"step": 6000, "tau_sim": 3.41}],
                },
            }
        )
    )
    q = qs.collect(run, "c", "", goals="23")
    assert (
        q["val_top1_per_position"] == [0.8964, 0.8927, 0.8905]
        and q["sim_accept"]["exported_step"] == 6000
    )
    assert q["train_eval_gap_pos1"]["mtbench"] == pytest.approx(0.8964 - 0.5)
    # select_best off: the export of a stopped run is its last checkpoint, whose top-1 was never measured
    rep = json.loads((run / "train_report.json").read_text())
    rep["sim_accept"]["select_best"] = "last"
    (run / "train_report.json").write_text(json.dumps(rep))
    q = qs.collect(run, "c", "", goals="23")
    assert q["val_top1_per_position"] == [] and q["sim_accept"]["exported_step"] is None


def test_batch_speed_names_how_its_prompts_were_picked(tmp_path):
    """bench_speed.json's subset pick and its category warning reach quality.json and the table; a file from before
    offline_bench_speed recorded the pick took the first N prompts."""
    run = _run(tmp_path)
    row = {
        "batch_size": 1,
        "num_prompts": 8,
        "greedy_tokens_per_s": 270.0,
        "spec_tokens_per_s": 432.0,
        "speedup": 1.6,
        "tau": 2.13,
        "drafter_share": 0.16,
    }
    warn = "mtbench: the 8 prompts benchmarked (of 80) cover 1 of 8 categories (writing); ..."
    (run / "bench_speed.json").write_text(
        json.dumps(
            {
                "dataset": "mtbench",
                "steps": 3,
                "dtype": "bfloat16",
                "prompt_pick": "first",
                "warnings": [warn],
                "rows": [row],
            }
        )
    )
    q = qs.collect(run, "c", "")
    assert (q["speed_by_batch"]["prompt_pick"], q["speed_by_batch"]["warnings"]) == (
        "first",
        [warn],
    )
    md = qs.markdown(q)
    assert (
        "prompts picked first" in md
        and f"Warning: {warn}" in md
        and "| 1 | 8 | 270 | 432 | 1.60x | 2.13 | 0.16 |" in md
    )
    (run / "bench_speed.json").write_text(
        json.dumps({"dataset": "mtbench", "steps": 3, "dtype": "bfloat16", "rows": [row]})
    )
    q = qs.collect(run, "c", "")
    assert (q["speed_by_batch"]["prompt_pick"], q["speed_by_batch"]["warnings"]) == ("first", [])


def test_a_set_scored_at_one_chain_length_only(tmp_path):
    """A set benchmarked at 7 steps but not at 3 (05 on the config's sets at 3 steps, SETS7=mtbench at 7: a CPU
    dry run of the lease driver on configs/tiny-llama.yaml, whose only set is humaneval) is "-" in the 3-step
    per-position table; the summary raised KeyError: 'mtbench', and the lease's whole recipe table was lost."""
    (tmp_path / "bench-steps3.json").write_text(
        json.dumps({"datasets": [_ds("humaneval", 3, 3.75, [0.9, 0.8, 0.7])]})
    )
    (tmp_path / "bench-steps7.json").write_text(
        json.dumps({"datasets": [_ds("mtbench", 3, 7.5, [0.95] * 7)]})
    )
    (tmp_path / "train_report.json").write_text(
        json.dumps({"final_val": {"acc_0": 1.0, "acc_1": 0.5, "acc_2": 0.25}})
    )
    md = qs.markdown(qs.collect(tmp_path, "c", "", goals="23"))
    assert "| position | held-out train | humaneval | mtbench |" in md
    assert "| 1 | 1.00 | 0.90 | - |" in md and "| 3 | 0.25 | 0.70 | - |" in md
    assert "| 3 | 3.75 (goal 2.8) | - |" in md and "| 7 | - | 7.50 (goal 3.4) |" in md
