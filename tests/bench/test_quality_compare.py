"""bench/quality_compare.py: 05's per-prompt rows split off, tau deltas with paired bootstrap intervals,
values read from the runs' reports (hand-computed here), never invented."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import quality_compare as qc  # noqa: E402


def test_paired_bootstrap_by_hand():
    a = {"1": [4, 2], "2": [2, 2]}
    b = {"1": [6, 2], "2": [2, 2], "3": [9, 1]}  # prompt 3 only in b: not paired, ignored
    d = qc.paired_bootstrap(a, b)
    # tau(a) = 6/4 = 1.5, tau(b) = 8/4 = 2.0; resamples {1,1}: 12/4 - 8/4 = 1.0, {2,2}: 0, {1,2}: 0.5
    assert d == {"delta": 0.5, "lo": 0.0, "hi": 1.0, "prompts": 2}
    assert qc.paired_bootstrap(a, a) == {"delta": 0.0, "lo": 0.0, "hi": 0.0, "prompts": 2}
    assert qc.paired_bootstrap(a, {"9": [1, 1]}) is None


def _bench(datasets):
    return {
        "steps": 3,
        "dtype": "float32",
        "max_new_tokens": 256,
        "datasets": [
            {
                "dataset": name,
                "tau": sum(sum(r) for r in rows.values()) / sum(len(r) for r in rows.values()),
                "num_prompts": len(rows),
                "per_prompt": [
                    {"id": i, "accept_lengths": r, "lossless": True} for i, r in rows.items()
                ],
            }
            for name, rows in datasets.items()
        ],
    }


def _runs(tmp_path):
    """Two runs in the layout ``bench/quality_session.sh pack`` leaves: 05's bench.json split by ``split_bench``
    (the reference flat, ``bench-steps3.json`` + ``per_prompt_steps3.json``; a run folder ``runs/curve-6000``)."""
    out = tmp_path / "out"
    (out / "runs" / "curve-6000").mkdir(parents=True)
    for bench, slim_path, pp_path in (
        (
            _bench({"mtbench": {"81": [1, 3, 2], "82": [2, 2]}}),
            out / "bench-steps3.json",
            out / "per_prompt_steps3.json",
        ),
        (
            _bench({"mtbench": {"81": [1, 1, 1], "82": [2, 1]}}),
            out / "runs" / "curve-6000" / "bench.json",
            out / "runs" / "curve-6000" / "per_prompt.json",
        ),
    ):
        slim, pp = qc.split_bench(bench)
        slim_path.write_text(json.dumps(slim))
        pp_path.write_text(json.dumps(pp))
    (out / "train_report.json").write_text(
        json.dumps({"step": 10, "final_val": {"acc_0": 0.8, "acc_1": 0.7}})
    )
    (out / "runs" / "curve-6000" / "data_report.json").write_text(
        json.dumps({"train_samples": 6000, "coverage": 1.0})
    )
    return out


def test_split_bench_then_compare(tmp_path):
    out = _runs(tmp_path)
    slim = json.loads((out / "bench-steps3.json").read_text())
    assert "per_prompt" not in slim["datasets"][0] and slim["datasets"][0]["num_prompts"] == 2
    pp = json.loads((out / "per_prompt_steps3.json").read_text())
    assert pp == {"steps": 3, "per_prompt": {"mtbench": {"81": [6, 3], "82": [4, 2]}}}
    assert json.loads((out / "runs" / "curve-6000" / "per_prompt.json").read_text())[
        "per_prompt"
    ] == {"mtbench": {"81": [3, 3], "82": [3, 2]}}  # [emitted, verify steps]

    rows = qc.compare(
        qc.load_run(f"17K={out / 'bench-steps3.json'}"),
        [qc.load_run(f"6K={out / 'runs' / 'curve-6000'}")],
    )
    ref, run = rows
    assert (
        ref["reference"]
        and ref["tau"] == {"mtbench": 2.0}
        and ref["val_top1"] == [0.8, 0.7]
        and ref["optimizer_steps"] == 10
    )
    assert run["tau"] == {"mtbench": 1.2} and run["train_samples"] == 6000 and run["val_top1"] == []
    # tau 6/5 - 10/5 = -0.8; resamples {81,81}: 1 - 2 = -1.0, {82,82}: 1.5 - 2 = -0.5
    assert run["delta_vs_ref"]["mtbench"] == {"delta": -0.8, "lo": -1.0, "hi": -0.5, "prompts": 2}
    md = qc.markdown(rows, "T")
    assert "| 6K | 6000 | - | - | 1.20 (-0.80 [-1.00, -0.50]) |" in md


def test_cli_curve_png_and_bad_spec(tmp_path):
    out = _runs(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "quality_compare.py"),
            "--ref",
            f"17K={out / 'bench-steps3.json'}",
            "--run",
            f"6K={out / 'runs' / 'curve-6000'}",
            "--curve",
            "--out",
            str(tmp_path / "c.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.png").stat().st_size > 0 and (tmp_path / "c.md").is_file()
    saved = json.loads((tmp_path / "c.json").read_text())
    assert (
        saved["command"].startswith("python bench/quality_compare.py --ref 17K=")
        and "--curve" in saved["command"]
    )
    assert [r["name"] for r in saved["rows"]] == ["17K", "6K"]
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "quality_compare.py"),
            "--ref",
            "no-equals-sign",
            "--out",
            str(tmp_path / "d.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.startswith("error:") and "NAME=PATH" in r.stderr
    assert not (tmp_path / "d.json").exists()


def test_footnote_reads_the_validation_sizes(tmp_path):
    """The table's footnote gives each run's validation split size from its data_report.json (it once printed a
    fixed "324 samples" whatever the runs held)."""
    for name, val in (("a", 1997), ("b", 1997), ("c", 40)):
        d = tmp_path / name
        d.mkdir()
        (d / "bench.json").write_text(json.dumps(_bench({"mtbench": {"81": [1, 2]}})))
        (d / "data_report.json").write_text(json.dumps({"train_samples": 10, "val_samples": val}))
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "bench.json").write_text(json.dumps(_bench({"mtbench": {"81": [1, 2]}})))
    same = qc.markdown(
        qc.compare(qc.load_run(f"a={tmp_path / 'a'}"), [qc.load_run(f"b={tmp_path / 'b'}")]), "T"
    )
    assert "(1997 samples in every run)" in same and "324" not in same
    mixed = qc.markdown(
        qc.compare(
            qc.load_run(f"a={tmp_path / 'a'}"),
            [qc.load_run(f"c={tmp_path / 'c'}"), qc.load_run(f"n={tmp_path / 'n'}")],
        ),
        "T",
    )
    assert "(a: 1997 samples; c: 40 samples; n: no data_report.json)" in mixed


def test_footnote_says_how_each_run_was_served(tmp_path):
    """The footnote reads temperature and verification method from each bench.json: a greedy 05 (no
    ``temperature``) is T=0; a sampled one names its method (block vs standard at T=1 are compared this way)."""
    for name, extra in (
        ("g", {}),
        ("s", {"temperature": 1.0, "rejection_sample_method": "standard"}),
    ):
        (tmp_path / name).mkdir()
        bench = _bench({"mtbench": {"81": [1, 2]}}) | extra
        (tmp_path / name / "bench.json").write_text(json.dumps(bench))
    b = {"temperature": 1.0, "rejection_sample_method": "block"}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text(json.dumps(_bench({"mtbench": {"81": [2, 2]}}) | b))

    def note(ref, *runs):
        rows = qc.compare(
            qc.load_run(f"{ref}={tmp_path / ref}"),
            [qc.load_run(f"{r}={tmp_path / r}") for r in runs],
        )
        return qc.markdown(rows, "T").splitlines()[-1]

    assert note("g").startswith("tau: 05, chain, T=0; (delta")
    assert note("s", "b").startswith(
        "tau: 05, chain, s: T=1, standard verification; b: T=1, block verification;"
    )


def test_a_run_stopped_before_its_final_validation_reports_its_exported_weights(tmp_path):
    """A run stopped at a lease's deadline has no final_val; its export holds the best validated weights
    (select_best: sim_accept), so the table gives that validation's top-1 and names its step (lease 2026-12-04e's
    run showed "-" while its weights' top-1 was in train_report.json)."""
    for name, report in (
        (
            "stopped",
            {
                "step": 6007,
                "stopped": True,
                "final_val": {},
                "sim_accept": {
                    "select_best": "sim_accept",
                    "best": {"step": 6000, "alpha": [0.896421, 0.892675, 0.890527]},
                },
            },
        ),
        (
            "stopped-last",
            {
                "step": 6007,
                "stopped": True,
                "final_val": {},  # exports its last, never validated
                "sim_accept": {"select_best": "last", "best": {"step": 6000, "alpha": [0.9]}},
            },
        ),
        (
            "finished",
            {
                "step": 7986,
                "final_val": {"acc_0": 0.893, "acc_1": 0.88},
                "sim_accept": {"best": {"step": 7000, "alpha": [0.5, 0.4]}},
            },
        ),
    ):
        d = tmp_path / name
        d.mkdir()
        (d / "bench.json").write_text(json.dumps(_bench({"mtbench": {"81": [1, 2]}})))
        (d / "train_report.json").write_text(json.dumps(report))
    rows = qc.compare(
        qc.load_run(f"finished={tmp_path / 'finished'}"),
        [
            qc.load_run(f"stopped={tmp_path / 'stopped'}"),
            qc.load_run(f"last={tmp_path / 'stopped-last'}"),
        ],
    )
    fin, stop, last = rows
    assert last["val_top1"] == [] and last["weights_step"] is None
    assert (
        fin["val_top1"] == [0.893, 0.88] and fin["weights_step"] is None
    )  # the final validation wins when present
    assert stop["val_top1"] == [0.8964, 0.8927, 0.8905] and stop["weights_step"] == 6000
    md = qc.markdown(rows, "T")
    assert "| stopped | - | 6007 (weights of step 6000) | 0.896 |" in md
    assert "| finished (ref) | - | 7986 | 0.893 |" in md
