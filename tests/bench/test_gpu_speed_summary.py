"""bench/gpu_speed_summary.py: headline figures read from the bench scripts' JSON, never invented."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_speed_summary as gss  # noqa: E402


def test_collect_reads_present_figures_and_marks_missing(tmp_path):
    (tmp_path / "small_train.json").write_text(
        json.dumps({"small_train_tokens_per_s": 150000.0, "small_train_wall_vs_reference": 0.25})
    )
    # a train_throughput run without step_ms: ms/step = seq / tokens_per_s (batch 1)
    (tmp_path / "kimi_step.json").write_text(
        json.dumps({"runs": [{"seq": 4096, "tokens_per_s": 8192.0, "mfu": 0.5}]})
    )
    figs = gss.collect(tmp_path)
    assert set(figs) == set(gss.FIGURES)
    assert figs["small_train_tokens_per_s"]["value"] == 150000.0
    assert figs["small_train_wall_vs_reference"]["value"] == 0.25
    assert figs["kimi_step_ms"]["value"] == 500.0
    assert figs["kimi_mfu"]["value"] == 0.5
    for k in ("tokenize_conv_per_s", "capture_vs_bare_ratio", "bench_80x256_s"):
        assert figs[k] == {**figs[k], "value": None, "measured": False, "source": None}
    assert all(
        v["command"].startswith("python3 bench/") for v in figs.values()
    )  # no fallback source present
    assert "| `bench_80x256_s` | not measured |" in gss.markdown(figs)


def test_cli_bad_json_is_one_line_error(tmp_path):
    (tmp_path / "capture.json").write_text("{not json")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_speed_summary.py"),
            str(tmp_path),
            "--out",
            str(tmp_path / "o.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip().startswith("error:")
        and "capture.json" in r.stderr
        and "Traceback" not in r.stderr
    )
    assert not (tmp_path / "o.json").exists()


def test_fallbacks_from_stage_reports(tmp_path):
    """Without the dedicated benches: 04's train_report gives the training figures, 05's bench.json the
    80 x 256 wall, but only for the MT-bench 80-prompt, 256-token, 3-step set."""
    (tmp_path / "train_report.json").write_text(json.dumps({"tokens_per_s": 174000.0}))
    bench = {
        "steps": 3,
        "max_new_tokens": 256,
        "datasets": [
            {"dataset": "gsm8k", "num_prompts": 200, "wall_seconds": 30.0},
            {"dataset": "mtbench", "num_prompts": 80, "wall_seconds": 12.5},
        ],
    }
    (tmp_path / "bench-steps3.json").write_text(json.dumps(bench))
    figs = gss.collect(tmp_path)
    assert figs["small_train_tokens_per_s"]["value"] == 174000.0
    assert figs["small_train_wall_vs_reference"]["value"] == 6.96e6 / 174000.0 / 320.0  # 0.125
    assert figs["bench_80x256_s"]["value"] == 12.5
    assert figs["bench_80x256_s"]["source"].endswith("bench-steps3.json")
    (tmp_path / "bench-steps3.json").write_text(json.dumps({**bench, "max_new_tokens": 512}))
    assert gss.collect(tmp_path)["bench_80x256_s"]["value"] is None  # another set: not the figure
    assert gss.collect(tmp_path)["bench_80x256_s"]["command"].startswith(
        "python3 bench/offline_bench_speed.py"
    )


def test_train_fallback_counts_only_the_headline_batches(tmp_path):
    """configs/smollm2-135m-full.yaml trains with 4,096-token batches since lease 2026-12-05g, so a GPU session's own
    04 report (the fallback) held tokens/s at 4,096-token batches, shown as the figure whose command sets
    train.batch_tokens=16384 (a lower throughput read as a regression). Only a report of 16,384-token batches counts."""
    rep = {"tokens_per_s": 120000.0, "recipe": {"batch_tokens": 4096, "lr": 1e-3}}
    (tmp_path / "train_report.json").write_text(json.dumps(rep))
    figs = gss.collect(tmp_path)
    assert figs["small_train_tokens_per_s"]["value"] is None
    assert figs["small_train_wall_vs_reference"]["value"] is None
    (tmp_path / "train_report.json").write_text(
        json.dumps({**rep, "recipe": {"batch_tokens": 16384}})
    )
    assert gss.collect(tmp_path)["small_train_tokens_per_s"]["value"] == 120000.0


def test_several_folders_newest_first_and_capture_disk_fallback(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    # the new session ran only the tail capture bench (shards to disk); the old one had capture.json and tokenize.json
    (new / "capture_disk.json").write_text(json.dumps({"capture_vs_bare_ratio": 0.214}))
    (old / "capture.json").write_text(json.dumps({"capture_vs_bare_ratio": 0.263}))
    (old / "tokenize.json").write_text(json.dumps({"tokenize_conv_per_s": 5754.0}))
    figs = gss.collect([new, old])
    assert figs["capture_vs_bare_ratio"]["value"] == 0.214
    assert figs["capture_vs_bare_ratio"]["source"] == str(new / "capture_disk.json")
    assert "to the run's disk" in figs["capture_vs_bare_ratio"]["baseline"]
    assert figs["tokenize_conv_per_s"]["value"] == 5754.0
    assert figs["tokenize_conv_per_s"]["source"] == str(old / "tokenize.json")
    assert figs["kimi_mfu"]["value"] is None
    # one folder still works, and the old figure wins when the new folder lacks it
    assert gss.collect(old)["capture_vs_bare_ratio"]["value"] == 0.263
