"""An output folder that cannot be made (``/proc/x``, a file in the way) or that takes no file (``/proc``, read-only
storage) stops every stage with one line naming the config field (or flag) and the path, before anything is written
(``eagle3.io.make_dirs`` / ``probe_dirs``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run, single_thread  # noqa: E402,F401  (autouse fixture)
from _paths import child_env

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402
from eagle3.io import atomic_write_text, make_dirs, probe_dirs  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
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
    assert (
        _error(make_dirs, PROC, "output_root")
        == f"output_root: cannot create the output folder {PROC}: {NO}"
    )
    assert _error(make_dirs, tmp_path / "f" / "x", "train.output_dir") == (
        f"train.output_dir: cannot create the output folder {tmp_path / 'f' / 'x'}: {tmp_path / 'f'} is a file, "
        "not a folder"
    )
    assert _error(make_dirs, tmp_path / "f", "--dst") == (
        f"--dst: cannot create the output folder {tmp_path / 'f'}: {tmp_path / 'f'} is a file, not a folder"
    )
    assert (
        _error(atomic_write_text, f"{PROC}/a/out.json", "{}")
        == f"{PROC}/a: cannot create the folder: {NO}"
    )
    assert make_dirs(tmp_path / "a" / "b") == [tmp_path / "a" / "b", tmp_path / "a"]
    probe_dirs(tmp_path / "c" / "d", "x")
    assert not (tmp_path / "c").exists()


def test_output_field_names_the_setting_behind_each_folder(tmp_path):
    cfg = load_config(make_tiny_run(tmp_path))
    assert cfg.output_field("data") == "output_root"
    cfg = load_config(tmp_path / "run.yaml", ["output_root=null", "data.output_dir=/d"])
    assert (cfg.output_field("data"), cfg.output_field("bench")) == (
        "data.output_dir",
        "output_root (default outputs/tiny)",
    )


def test_01_names_output_root(tmp_path):
    from eagle3.stages.prepare_prompts import run

    src = tmp_path / "p.jsonl"
    src.write_text(
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {PROC}\nverifier: {{path: {tmp_path}}}\nprompts: {{source: {src}}}\n"
    )
    assert (
        _error(run, load_config(cfg))
        == f"output_root: cannot create the output folder {PROC}: {NO}"
    )


def test_02_names_extract_output_dir(tmp_path):
    from eagle3.stages.extract import run

    cfg = load_config(make_tiny_run(tmp_path), [f"extract.output_dir={PROC}/shards"])
    assert (
        _error(run, cfg)
        == f"extract.output_dir: cannot create the output folder {PROC}/shards: {NO}"
    )


def test_03_names_data_output_dir_before_validating(tmp_path, monkeypatch):
    from eagle3.stages import prepare_data

    monkeypatch.setattr(
        prepare_data, "shard_stats", lambda *a: pytest.fail("validated before the folder check")
    )
    cfg = load_config(make_tiny_run(tmp_path), [f"data.output_dir={PROC}"])
    assert (
        _error(prepare_data.run, cfg, plot=False)
        == f"data.output_dir: cannot create the output folder {PROC}: {NO}"
    )


def test_04_names_train_and_export_output_dir(tmp_path):
    from eagle3.stages.export import check_export_destination
    from eagle3.stages.train import run

    cfg = load_config(make_tiny_run(tmp_path), [f"train.output_dir={PROC}/train"])
    assert (
        _error(run, cfg, device="cpu")
        == f"train.output_dir: cannot create the output folder {PROC}/train: {NO}"
    )
    assert _error(
        check_export_destination, Path(f"{PROC}/drafter"), "sglang", "export.output_dir"
    ) == (f"export.output_dir: cannot create the output folder {PROC}: {NO}")


@pytest.mark.parametrize("server", [False, True])
def test_05_names_benchmark_output_dir_before_anything_loads(tmp_path, server):
    from eagle3.stages import benchmark

    cfg = load_config(make_tiny_run(tmp_path), [f"benchmark.output_dir={PROC}/bench"])
    call = (
        (lambda: benchmark.run_server(cfg, ["http://127.0.0.1:9"]))
        if server
        else (lambda: benchmark.run(cfg))
    )
    assert (
        _error(call) == f"benchmark.output_dir: cannot create the output folder {PROC}/bench: {NO}"
    )


def test_convert_shards_names_dst(tmp_path):
    from eagle3.shards.convert import convert
    from eagle3.shards.fp8 import Storage

    make_tiny_run(tmp_path)
    err = _error(convert, tmp_path / "shards", f"{PROC}/fp8", Storage(dtype="float8_e4m3fn"))
    assert err == f"--dst: cannot create the output folder {PROC}/fp8: {NO}"


def test_a_bench_script_names_its_output_flag(tmp_path):
    """The bench scripts that make a folder from a flag (``--out``, ``--workdir``, ``--profile``) name the flag."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import online_train_speed

    assert _error(online_train_speed.main, ["--tiny", "--workdir", f"{PROC}/s"]) == (
        f"--workdir: cannot create the output folder {PROC}/s: {NO}"
    )


# ---- an existing folder that takes no file (read-only storage) ---------------------------------------------------
# /proc exists, but no file can be created in it, also by root (mkstemp: ENOENT): the folder check used to pass there
# and on a read-only file system, so 03 validated and 05 benchmarked to the end, then failed writing their outputs.
PROC_DIR = "/proc"


def test_probe_dirs_refuses_an_existing_folder_that_takes_no_file(tmp_path):
    assert _error(probe_dirs, PROC_DIR, "benchmark.output_dir") == (
        f"benchmark.output_dir: cannot write to the output folder {PROC_DIR}: {NO}"
    )
    assert _error(probe_dirs, PROC_DIR) == f"{PROC_DIR}: cannot write to the folder: {NO}"
    probe_dirs(tmp_path, "x")  # a writable folder: passes, and keeps nothing of the probe
    assert list(tmp_path.iterdir()) == []


def test_03_and_05_refuse_an_unwritable_output_folder_before_the_long_work(tmp_path, monkeypatch):
    from eagle3.stages import benchmark, prepare_data

    monkeypatch.setattr(
        prepare_data, "shard_stats", lambda *a: pytest.fail("validated before the folder check")
    )
    cfg = load_config(
        make_tiny_run(tmp_path), [f"data.output_dir={PROC_DIR}", f"benchmark.output_dir={PROC_DIR}"]
    )
    assert _error(prepare_data.run, cfg, plot=False) == (
        f"data.output_dir: cannot write to the output folder {PROC_DIR}: {NO}"
    )
    assert (
        _error(benchmark.run, cfg)
        == f"benchmark.output_dir: cannot write to the output folder {PROC_DIR}: {NO}"
    )


def _run_read_only(folder: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` (Python) run with ``folder`` bind-mounted read-only (a user + mount namespace); skipped where the
    namespace or the mount is not allowed."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare not installed")
    env = child_env(ROOT, ROOT / "tests")
    r = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"mount --bind {folder} {folder} && mount -o remount,bind,ro "
            f'{folder} && exec {sys.executable} -c "$0"',
            code,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if r.returncode != 0 and ("mount" in r.stderr or "unshare" in r.stderr):
        pytest.skip(f"cannot bind-mount read-only here: {r.stderr.strip()[:200]}")
    return r


def test_05_on_a_read_only_bench_folder_stops_at_once(tmp_path):
    """A real read-only file system (EROFS): 05 names benchmark.output_dir before it looks for the drafter."""
    run_yaml = make_tiny_run(tmp_path)
    bench = tmp_path / "bench"
    bench.mkdir()
    r = _run_read_only(
        bench,
        (
            "from eagle3.config import load_config\nfrom eagle3.errors import UserError\n"
            "from eagle3.stages import benchmark\n"
            f"cfg = load_config('{run_yaml}', ['benchmark.output_dir={bench}'])\n"
            "try:\n    benchmark.run(cfg)\nexcept UserError as e:\n    print(e)\n"
        ),
    )
    assert (
        r.stdout.strip()
        == f"benchmark.output_dir: cannot write to the output folder {bench}: Read-only file system"
    )


def test_export_only_from_a_read_only_train_folder_exports_and_leaves_the_report(tmp_path):
    """`04 --export-only` of checkpoints on read-only storage wrote the export, then stopped with exit 2 on
    train_report.json: now the export stands, the report is left as it was, with one warning."""
    from eagle3.stages.train import run

    run_yaml = make_tiny_run(tmp_path, train={"epochs": 1, "ckpt_every": 1})
    cfg = load_config(run_yaml)
    r = run(cfg, device="cpu", stop_after=2)
    assert r["stopped"]
    before = (cfg.train_dir / "train_report.json").read_bytes()
    out = tmp_path / "exported"
    res = _run_read_only(
        cfg.train_dir,
        (
            "import logging\nlogging.basicConfig()\nfrom eagle3.config import load_config\n"
            "from eagle3.stages.export import export_from_checkpoint\n"
            f"print(export_from_checkpoint(load_config('{run_yaml}', ['export.output_dir={out}'])))\n"
        ),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(out) and (out / "model.safetensors").is_file()
    assert (
        f"train_report.json: not updated after --export-only ({cfg.train_dir}: cannot write to the folder: "
        f"Read-only file system); the export in {out} stands"
    ) in res.stderr
    assert (cfg.train_dir / "train_report.json").read_bytes() == before


# ---- one 03 per data folder, one 05 per bench folder ----------------------------------------------------------
@pytest.mark.parametrize("stage", ["03", "05", "05 --server"])
def test_a_second_run_on_the_same_output_folder_stops_at_once(tmp_path, stage):
    """Two 05 runs on one bench folder (`--datasets humaneval` and `--datasets mt3.json` side by side) both exited 0,
    each measuring under the other's load, and the last one's reports replaced the first one's (trial 2026-12-05g);
    two 03 runs of a draft-vocab sweep wrote over each other the same way. Each now holds a lock on its folder: the
    second one stops with one line, before it reads anything; a refused run leaves no folder it made."""
    from eagle3.io import exclusive_lock
    from eagle3.stages import benchmark, prepare_data

    cfg = load_config(make_tiny_run(tmp_path))
    folder, lock, call, words = {
        "03": (
            cfg.data_dir,
            ".data.lock",
            lambda: prepare_data.run(cfg, plot=False),
            f"another 03_prepare_data run is writing to {cfg.data_dir}; wait for it, or set data.output_dir for a "
            "second data folder",
        ),
        "05": (cfg.bench_dir, ".bench.lock", lambda: benchmark.run(cfg), None),
        "05 --server": (
            cfg.bench_dir,
            ".bench.lock",
            lambda: benchmark.run_server(cfg, ["http://127.0.0.1:9"]),
            None,
        ),
    }[stage]
    words = words or (
        f"another 05_benchmark run is benchmarking into {cfg.bench_dir} (its reports would replace "
        "this one's, and two runs side by side measure each other's load); wait for it, or set "
        "benchmark.output_dir"
    )
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(folder / lock, "the first run"):
        assert _error(call) == f"{folder / lock}: {words}"
    if (
        stage != "03"
    ):  # 05 without an export is refused after taking the lock: the folder it made is gone again
        folder.rmdir()
        assert "not found" in _error(call) and not folder.exists()
