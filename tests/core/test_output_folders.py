"""An output folder that cannot be made (``/proc/x``, a file in the way) stops every stage with one line naming the
config field (or flag) and the path, before anything is written (``eagle3.io.make_dirs`` / ``probe_dirs``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_text, make_dirs, probe_dirs  # noqa: E402

PROC = "/proc/eagle3-no-such-folder"  # mkdir there fails (ENOENT), also for root
NO = "No such file or directory"


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_make_dirs_names_the_field_and_why(tmp_path):
    """The unit: /proc, a file in the way above the folder or at it; no field: the path alone (a writer's own parent
    folder, e.g. a flag's output file); probe_dirs leaves nothing behind."""
    (tmp_path / "f").write_text("x")
    assert _error(make_dirs, PROC, "output_root") == f"output_root: cannot create the output folder {PROC}: {NO}"
    assert _error(make_dirs, tmp_path / "f" / "x", "train.output_dir") == (
        f"train.output_dir: cannot create the output folder {tmp_path / 'f' / 'x'}: {tmp_path / 'f'} is a file, "
        "not a folder")
    assert _error(make_dirs, tmp_path / "f", "--dst") == (
        f"--dst: cannot create the output folder {tmp_path / 'f'}: {tmp_path / 'f'} is a file, not a folder")
    assert _error(atomic_write_text, f"{PROC}/a/out.json", "{}") == f"{PROC}/a: cannot create the folder: {NO}"
    assert make_dirs(tmp_path / "a" / "b") == [tmp_path / "a" / "b", tmp_path / "a"]
    probe_dirs(tmp_path / "c" / "d", "x")
    assert not (tmp_path / "c").exists()


def test_output_field_names_the_setting_behind_each_folder(tmp_path):
    cfg = load_config(make_tiny_run(tmp_path))
    assert cfg.output_field("data") == "output_root"
    cfg = load_config(tmp_path / "run.yaml", ["output_root=null", "data.output_dir=/d"])
    assert (cfg.output_field("data"), cfg.output_field("bench")) == ("data.output_dir",
                                                                      "output_root (default outputs/tiny)")


def test_01_names_output_root(tmp_path):
    from eagle3.prompts.prepare_prompts import run

    src = tmp_path / "p.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_name: t\noutput_root: {PROC}\nverifier: {{path: {tmp_path}}}\nprompts: {{source: {src}}}\n")
    assert _error(run, load_config(cfg)) == f"output_root: cannot create the output folder {PROC}: {NO}"


def test_02_names_extract_output_dir(tmp_path):
    from eagle3.capture.extract import run

    cfg = load_config(make_tiny_run(tmp_path), [f"extract.output_dir={PROC}/shards"])
    assert _error(run, cfg) == f"extract.output_dir: cannot create the output folder {PROC}/shards: {NO}"


def test_03_names_data_output_dir_before_validating(tmp_path, monkeypatch):
    from eagle3.data import prepare_data

    monkeypatch.setattr(prepare_data, "_shard_stats", lambda *a: pytest.fail("validated before the folder check"))
    cfg = load_config(make_tiny_run(tmp_path), [f"data.output_dir={PROC}"])
    assert _error(prepare_data.run, cfg, plot=False) == f"data.output_dir: cannot create the output folder {PROC}: {NO}"


def test_04_names_train_and_export_output_dir(tmp_path):
    from eagle3.export.serving import check_export_destination
    from eagle3.train.trainer import run

    cfg = load_config(make_tiny_run(tmp_path), [f"train.output_dir={PROC}/train"])
    assert _error(run, cfg, device="cpu") == f"train.output_dir: cannot create the output folder {PROC}/train: {NO}"
    assert _error(check_export_destination, Path(f"{PROC}/drafter"), "sglang", "export.output_dir") == (
        f"export.output_dir: cannot create the output folder {PROC}: {NO}")


@pytest.mark.parametrize("server", [False, True])
def test_05_names_benchmark_output_dir_before_anything_loads(tmp_path, server):
    from eagle3.benchmark import offline, server as server_bench

    cfg = load_config(make_tiny_run(tmp_path), [f"benchmark.output_dir={PROC}/bench"])
    call = (lambda: server_bench.run(cfg, ["http://127.0.0.1:9"])) if server else (lambda: offline.run(cfg))
    assert _error(call) == f"benchmark.output_dir: cannot create the output folder {PROC}/bench: {NO}"


def test_convert_shards_names_dst(tmp_path):
    from eagle3.shards.convert import convert
    from eagle3.shards.fp8 import Storage

    make_tiny_run(tmp_path)
    err = _error(convert, tmp_path / "shards", f"{PROC}/fp8", Storage(dtype="float8_e4m3fn"))
    assert err == f"--dst: cannot create the output folder {PROC}/fp8: {NO}"


def test_a_bench_script_names_its_output_flag(tmp_path):
    """The bench scripts that make a folder from a flag (``--out``, ``--workdir``, ``--profile``) name the flag."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import collect_session

    (tmp_path / "res").mkdir()
    assert _error(collect_session.main, [str(tmp_path), "--out", f"{PROC}/s"]) == (
        f"--out: cannot create the output folder {PROC}/s: {NO}")
