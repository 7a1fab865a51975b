"""The demo's last lines (scripts/demo_summary.py), README's generated table (scripts/demo_table.py) and
the headlines 04 and 05 print at their end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _fake_run(root: Path) -> None:
    """The report files of a finished run, with the keys each stage writes (values chosen by hand)."""
    _write(
        root / "prompts_report.json",
        {
            "counts": {"kept": 164, "regenerated": 164},
            "regeneration": {"new_tokens": 41_234, "tokens_per_s": 134.7},
        },
    )
    _write(
        root / "shards" / "extract_report.json",
        {"samples": 164, "num_tokens": 60_123, "num_loss_tokens": 27_360, "disk_gb": 0.2},
    )
    _write(root / "shards" / "data_config.json", {"aux_layers": [2, 15, 27]})
    _write(
        root / "data" / "data_report.json",
        {"draft_vocab_size": 8000, "coverage": 1.0, "train_samples": 148, "val_samples": 16},
    )
    _write(
        root / "train" / "train_report.json",
        {
            "step": 74,
            "total_steps": 74,
            "export_dir": str(root / "drafter-sglang"),
            "final_val": {"loss": 5.4321, "acc_1": 0.25, "acc_0": 0.5, "acc_2": 0.125},
        },
    )
    (root / "drafter-sglang").mkdir()
    _write(
        root / "bench" / "bench.json",
        {
            "device": "cpu",
            "dtype": "float32",
            "steps": 3,
            "datasets": [
                {
                    "dataset": "humaneval",
                    "num_prompts": 10,
                    "tau": 1.375,
                    "greedy_tokens_per_s": 60.1,
                    "spec_tokens_per_s": 41.5,
                    "speedup": 41.5 / 60.1,
                    "mismatches": [],
                    "failures": 0,
                    "near_ties": 0,
                }
            ],
        },
    )
    (root / "bench" / "bench.md").write_text("x")


def _cfg(tmp_path: Path):
    from eagle3.config import load_config

    return load_config(
        ROOT / "configs" / "tiny-llama.yaml", [f"output_root={tmp_path}", "verifier.path=unused"]
    )


def test_summary_reads_each_stage_report(tmp_path):
    ds = _load("demo_summary")
    _fake_run(tmp_path)
    secs = ds.parse_seconds(
        [
            "setup=112",
            "01_prepare_prompts=306",
            "02_extract_hidden=55",
            "03_prepare_data=3",
            "04_train=156",
            "05_benchmark=66",
        ]
    )
    s = ds.collect(_cfg(tmp_path), secs, "configs/tiny-llama.yaml")
    heads = {x["stage"]: x["headline"] for x in s["stages"]}
    assert heads == {
        "01_prepare_prompts": "164 prompts, 164 answers regenerated (41.2K new tokens, 135 tok/s)",
        "02_extract_hidden": "164 samples, 60.1K tokens (27.4K loss-masked), aux layers [2, 15, 27]",
        "03_prepare_data": "draft vocab 8000 (coverage 100.0%), split 148/16",
        "04_train": "74 steps, val loss 5.432, val top-1 0.50 / 0.25 / 0.12 (TTT steps 0..2)",
        "05_benchmark": "humaneval: tau 1.38, 60.1 tok/s greedy vs 41.5 with the drafter (0.69x), lossless",
    }
    assert s["stages_seconds"] == 306 + 55 + 3 + 156 + 66 and s["setup_seconds"] == 112
    assert s["stages"][3]["figures"]["val_top1"] == [
        0.5,
        0.25,
        0.125,
    ]  # ordered by TTT step, not by key order
    assert s["stages"][4]["figures"]["datasets"][0]["lossless"] is True
    assert s["export_dir"] == str(tmp_path / "drafter-sglang")
    assert s["stages"][4]["reports"] == [
        str(tmp_path / "bench" / "bench.md")
    ]  # acceptance.png absent: not listed

    text = ds.terminal_text(s)
    assert text.splitlines()[0].split() == ["stage", "wall", "time", "result"]
    import re

    rows = {
        re.split(r"\s{2,}", ln)[0]: re.split(r"\s{2,}", ln)[1:] for ln in text.splitlines()[2:9]
    }
    assert rows["01 -> 05"] == ["586 s (9.8 min)"] and rows["setup"] == [
        "112 s (1.9 min)",
        ".venv ready (scripts/setup.sh)",
    ]
    assert rows["05_benchmark"] == ["66 s (1.1 min)", heads["05_benchmark"]]
    assert text.splitlines()[-1] == f"export (serve this folder): {tmp_path / 'drafter-sglang'}"

    table = ds.markdown_table(s)
    assert table.splitlines()[:3] == [
        "| stage | result | wall time |",
        "|---|---|---:|",
        "| 01 | 164 prompts, 164 answers regenerated (41.2K new tokens, 135 tok/s) | 306 s (5.1 min) |",
    ]
    assert "| **01 -> 05** | | **586 s (9.8 min)** |" in table
    assert table.rstrip().endswith("112 s (1.9 min).")


def test_missing_stage_says_not_run_and_lossless_failure_is_shown(tmp_path):
    ds = _load("demo_summary")
    _fake_run(tmp_path)
    (tmp_path / "train" / "train_report.json").unlink()
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    bench["datasets"][0].update(failures=2, mismatches=[{}, {}])
    _write(tmp_path / "bench" / "bench.json", bench)
    s = ds.collect(_cfg(tmp_path), {}, "")
    heads = {x["stage"]: x["headline"] for x in s["stages"]}
    assert heads["04_train"] == "not run"
    assert heads["05_benchmark"].endswith("NOT lossless")
    assert s["stages_seconds"] == 0 and s["setup_seconds"] is None


def test_demo_table_command_prints_the_table_of_the_json(tmp_path):
    ds = _load("demo_summary")
    _fake_run(tmp_path)
    summary = ds.collect(_cfg(tmp_path), {"05_benchmark": 66.0}, "")
    path = tmp_path / "demo_summary.json"
    path.write_text(json.dumps(summary))
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo_table.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == ds.markdown_table(summary)
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo_table.py"), str(tmp_path / "nope.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip().splitlines()[-1].startswith("error: ")
        and "demo.sh" in r.stderr
    )


def test_bad_seconds_item():
    ds = _load("demo_summary")
    with pytest.raises(ValueError, match="expected STAGE=SECONDS, got '306'"):
        ds.parse_seconds(["306"])


def test_train_and_benchmark_headlines(tmp_path):
    from eagle3.decoding.report import headline as bench_headline
    from eagle3.train.report import headline as train_headline

    res = {
        "step": 74,
        "total_steps": 74,
        "export_dir": "out/drafter-sglang",
        "final_val": {"loss": 5.43219, "acc_0": 0.5, "acc_10": 0.0625, "acc_2": 0.125},
    }
    assert train_headline(res, tmp_path).splitlines() == [
        "trained: 74/74 optimizer steps; final validation loss 5.4322, top-1 0.500 / 0.125 / 0.062 (TTT steps 0..2)",
        f"report: {tmp_path / 'train_report.md'}",
        "export: out/drafter-sglang",
    ]
    from types import SimpleNamespace

    args = SimpleNamespace(
        variant="eagle3.1", num_layers=2, intermediate_size=6144, draft_vocab_size=32000
    )
    assert (
        train_headline(res, tmp_path, args).splitlines()[1]
        == "drafter: eagle3.1, 2 decoder layers, MLP 6144, draft vocab 32000"
    )
    assert train_headline(dict(res, final_val={}), tmp_path).splitlines()[0] == (
        "trained: 74/74 optimizer steps; no validation split (data.val_fraction is 0: stage 03's split.json has no "
        "'val' samples), so no validation loss, accuracy or simulated acceptance (tau); the export holds the last "
        "step's weights (step 74); set data.val_fraction > 0 and re-run 03 and 04 to measure them"
    )
    rep = {
        "device": "cpu",
        "dtype": "float32",
        "datasets": [
            {
                "dataset": "humaneval",
                "num_prompts": 10,
                "tau": 1.375,
                "greedy_tokens_per_s": 60.1,
                "spec_tokens_per_s": 41.5,
                "speedup": 0.6905,
                "mismatches": [{}],
                "failures": 0,
                "near_ties": 1,
            }
        ],
    }
    assert bench_headline(rep, tmp_path / "bench").splitlines() == [
        "humaneval: tau 1.38, greedy 60.1 tok/s vs EAGLE-3 41.5 tok/s = 0.69x, lossless yes (1 near-ties) "
        "(10 prompts, cpu float32)",
        f"report: {tmp_path / 'bench' / 'bench.md'}",
    ]
    one = dict(rep, datasets=[dict(rep["datasets"][0], num_prompts=1)])
    assert (
        bench_headline(one, tmp_path / "bench").splitlines()[0].endswith("(1 prompt, cpu float32)")
    )


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_demo_table_on_a_wrong_file_is_one_line_naming_it(tmp_path):
    """A stage report given instead of demo_summary.json, bad JSON, a stage without its headline: one line each."""
    rep = tmp_path / "prompts_report.json"
    rep.write_text(json.dumps({"counts": {"kept": 3}}))
    r = _script("demo_table", str(rep))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        f"error: {rep}: not a demo summary (no 'stages' list; "
        "scripts/demo_summary.py writes outputs/<run_name>/demo_summary.json)"
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"stages":\n[\n')
    r = _script("demo_table", str(bad))
    assert (
        r.returncode == 2
        and r.stderr.strip() == f"error: {bad}:3: malformed JSON: Expecting value (column 1)"
    )
    part = tmp_path / "part.json"
    part.write_text(
        json.dumps({"stages": [{"stage": "01_prepare_prompts", "seconds": 1}], "stages_seconds": 1})
    )
    r = _script("demo_table", str(part))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(
        f"error: {part}: not a demo summary (stages[0] has no 'headline'"
    )


def test_demo_summary_with_no_stage_outputs_errors_and_writes_nothing(tmp_path):
    root = tmp_path / "none"
    r = _script(
        "demo_summary",
        "--config",
        str(ROOT / "configs" / "tiny-llama.yaml"),
        "--set",
        f"output_root={root}",
        "--set",
        "verifier.path=unused",
        "--seconds",
        "setup=1",
    )
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(
        f"error: output_root {root} (no such folder): no stage outputs to summarise"
    )
    assert not root.exists()
    root.mkdir()  # an existing but empty folder: the same error, no demo_summary.json in it
    r = _script(
        "demo_summary",
        "--config",
        str(ROOT / "configs" / "tiny-llama.yaml"),
        "--set",
        f"output_root={root}",
        "--set",
        "verifier.path=unused",
    )
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: output_root {root}: no stage outputs to summarise"
    )
    assert list(root.iterdir()) == []


def test_demo_summary_names_a_malformed_stage_report(tmp_path):
    ds = _load("demo_summary")
    from eagle3.errors import UserError

    _fake_run(tmp_path)
    (tmp_path / "data" / "data_report.json").write_text(
        '{"draft_vocab_size": 8000 "coverage": 1}\n'
    )
    with pytest.raises(
        UserError,
        match=r"data_report\.json:1: malformed JSON: Expecting ',' delimiter \(column 27\)$",
    ):
        ds.collect(_cfg(tmp_path), {}, "")


def test_the_01_headline_counts_answers_not_conversations(tmp_path):
    """'N answers regenerated' is the answers (turns) the verifier wrote, which multi-turn conversations outnumber:
    6 ShareGPT conversations of the 127K config took 26 answers (before, the headline said '6 answers regenerated')."""
    ds = _load("demo_summary")
    _write(
        tmp_path / "prompts_report.json",
        {
            "counts": {"kept": 6, "regenerated": 6},
            "regeneration": {"answers": 26, "new_tokens": 208, "tokens_per_s": 4.7},
        },
    )
    fig, text, _ = ds._prompts(_cfg(tmp_path))
    assert (
        text == "6 prompts, 26 answers regenerated (208 new tokens, 5 tok/s)"
        and fig["regenerated"] == 26
    )


def test_demo_table_help_prints_usage_not_a_missing_file():
    """`demo_table.py --help` was read as the summary's path ('error: --help: not found'); it prints the usage."""
    r = _script("demo_table", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: demo_table.py") and "demo_summary.json" in r.stdout
    r = _script("demo_table")
    assert r.returncode == 2 and "required: summary" in r.stderr
