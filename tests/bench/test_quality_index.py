"""bench/quality_index.py: every run under a results tree listed once, its figures read from the committed files
(a 05 file wins over a comparison row naming it; a run known only from a comparison is listed from that row)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import quality_index as qi  # noqa: E402


def _write(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


def _tree(repo: Path) -> None:
    lease = repo / "bench" / "results" / "lease-a"
    _write(
        lease / "bench-steps3.json",
        {
            "steps": 3,
            "dtype": "float32",
            "datasets": [{"dataset": "mtbench", "tau": 2.8049}, {"dataset": "gsm8k", "tau": 3.1}],
        },
    )
    _write(
        lease / "bench-steps7.json",
        {"steps": 7, "dtype": "float32", "datasets": [{"dataset": "mtbench", "tau": 3.41}]},
    )
    _write(
        lease / "train_report.json",
        {
            "step": 1200,
            "stopped": True,
            "sim_accept": {
                "select_best": "sim_accept",
                "best": {"step": 1000, "alpha": [0.8, 0.7]},
            },
            "drafter_args": {"variant": "eagle3.1", "num_layers": 2, "intermediate_size": 6144},
        },
    )
    _write(lease / "data_report.json", {"train_samples": 97000, "val_samples": 2000})
    # a comparison naming the run above twice (under two names) and one run whose 05 file is not in git
    _write(
        repo / "bench" / "results" / "cmp.json",
        {
            "title": "t",
            "rows": [
                {
                    "name": "deep",
                    "path": "bench/results/lease-a/bench-steps3.json",
                    "tau": {"mtbench": 9.9},
                    "steps": 3,
                },
                {
                    "name": "deep again",
                    "path": "bench/results/lease-a/bench-steps3.json",
                    "tau": {"mtbench": 9.9},
                },
                {
                    "name": "early",
                    "path": "bench/results/old/runs/x",
                    "tau": {"mtbench": 1.6849, "humaneval": 1.5},
                    "steps": 3,
                    "dtype": "float32",
                    "optimizer_steps": 430,
                    "train_samples": 6000,
                    "variant": "eagle3",
                },
            ],
        },
    )
    _write(repo / "bench" / "results" / "other.json", {"rows": [1, 2]})  # neither kind: ignored
    (repo / "bench" / "results" / "broken.json").write_text("{not json")


def test_every_run_once_with_the_figures_of_its_files(tmp_path):
    _tree(tmp_path)
    runs = qi.collect(tmp_path / "bench" / "results", tmp_path)
    assert [r["file"] for r in runs] == [
        "bench/results/lease-a/bench-steps3.json",
        "bench/results/old/runs/x",
        "bench/results/lease-a/bench-steps7.json",
    ]
    a3, old, a7 = runs
    assert a3["tau"] == {"mtbench": 2.8, "gsm8k": 3.1} and a3["names"] == [
        "deep",
        "deep again",
    ]  # 05 file wins
    assert a3["optimizer_steps"] == 1200 and a3["weights_step"] == 1000 and a3["stopped"] is True
    assert a3["train_samples"] == 97000 and a3["drafter"] == "eagle3.1, 2 layers, MLP 6144"
    assert (
        old["tau"] == {"mtbench": 1.68, "humaneval": 1.5}
        and old["from"] == "comparison bench/results/cmp.json"
    )
    assert (
        old["names"] == ["early"] and old["optimizer_steps"] == 430 and old["drafter"] == "eagle3"
    )
    assert a7["tau"] == {"mtbench": 3.41} and a7["names"] == []
    md = qi.markdown(runs)
    # bold where issue 23's goal is met: MT-bench 2.80 >= 2.8 at 3 steps, 3.41 >= 3.4 at 7; GSM8K 3.10 < 3.2
    assert (
        "| `bench/results/lease-a/bench-steps3.json` | deep; deep again | 3 | float32 | **2.80** | - | 3.10 | - | "
        "1200 (weights of 1000) | 97000 | eagle3.1, 2 layers, MLP 6144 |"
    ) in md
    assert (
        "| `bench/results/lease-a/bench-steps7.json` | - | 7 | float32 | **3.41** | - | - |" in md
    )
    assert (
        "| `bench/results/old/runs/x` | early | 3 | float32 | 1.68 | 1.50 | - | - | 430 | 6000 | eagle3 |"
        in md
    )


def test_cli_writes_json_and_markdown(tmp_path):
    _tree(tmp_path)
    out = tmp_path / "idx.json"
    assert (
        qi.main(
            [
                "--root",
                str(tmp_path / "bench" / "results"),
                "--repo",
                str(tmp_path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    obj = json.loads(out.read_text())
    assert obj["goals"] == {
        "3": {"mtbench": 2.8, "humaneval": 2.8, "gsm8k": 3.2},
        "7": {"mtbench": 3.4},
    }
    assert len(obj["runs"]) == 3 and out.with_suffix(".md").read_text() == qi.markdown(obj["runs"])


def test_files_git_ignores_are_not_read(tmp_path):
    """A lease's runs/ folders are kept out of git (.gitignore: runs/) but lie beside its committed comparison in the
    working tree that made the index: their 05 files were listed as the rows' source ("05 file", with the drafter of
    their train_report), figures no clone has; regenerated from a clean checkout, the committed table came out
    otherwise. Ignored files are not read: the comparison's row is the run's."""
    import subprocess

    repo = tmp_path / "repo"
    lease = repo / "bench" / "results" / "lease-b"
    _write(
        lease / "runs" / "ref" / "bench-steps3.json",
        {"steps": 3, "dtype": "float32", "datasets": [{"dataset": "mtbench", "tau": 2.07}]},
    )
    _write(
        lease / "runs" / "ref" / "train_report.json",
        {"step": 912, "drafter_args": {"variant": "eagle3.1"}},
    )
    _write(
        lease / "recipe_ab_steps3.json",
        {
            "rows": [
                {
                    "name": "ref",
                    "path": "bench/results/lease-b/runs/ref/bench-steps3.json",
                    "tau": {"mtbench": 2.07},
                    "steps": 3,
                    "dtype": "float32",
                    "optimizer_steps": 912,
                    "variant": "eagle3.1",
                }
            ]
        },
    )
    (repo / ".gitignore").write_text("runs/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    rows = qi.collect(repo / "bench" / "results", repo)
    assert [(r["file"], r["names"], r["from"]) for r in rows] == [
        (
            "bench/results/lease-b/runs/ref/bench-steps3.json",
            ["ref"],
            "comparison bench/results/lease-b/recipe_ab_steps3.json",
        )
    ]
    assert rows[0]["drafter"] == "eagle3.1" and rows[0]["tau"] == {"mtbench": 2.07}
