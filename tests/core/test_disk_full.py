"""Disk full (ENOSPC) and quota exceeded (EDQUOT) in stages 02 and 04: one line, exit 2, no partial
file, and a re-run resumes to the result of an uninterrupted run.

The fault is injected at the one place where :mod:`eagle3.io` hands bytes to the OS
(``eagle3.io._write_all``): after a byte budget is spent, the write that crosses it writes what still
fits and raises ``OSError(ENOSPC)``, and so does every later write (the disk stays full), exactly
what a real full filesystem does. One test also fills a real 64 KiB tmpfs (in a user+mount
namespace; skipped where that is not allowed).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import child_env

import eagle3.io as eio
from eagle3.errors import UserError
from eagle3.shards.manifest import ManifestWriter, read_manifest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class DiskBudget:
    """Stand-in for ``eagle3.io._write_all`` on a disk with ``budget`` free bytes.

    Only writes to files whose name matches ``match`` (regex, default all) count and can fail; an
    ``errno`` of ENOSPC or EDQUOT is raised once the budget is spent.
    """

    def __init__(self, budget: int, match: str | None = None, err: int = errno.ENOSPC):
        self.budget, self.match, self.err = budget, match, err
        self.used = 0
        self.failures: list[str] = []
        self.real = eio._write_all

    def __call__(self, f, data) -> None:
        name = str(getattr(f, "name", ""))
        if self.match is not None and not re.search(self.match, name):
            return self.real(f, data)
        data = bytes(data)
        room = max(0, self.budget - self.used)
        if len(data) > room:
            if room:
                self.real(f, data[:room])  # a real disk takes what fits, then fails
            self.used += room
            self.failures.append(name)
            raise OSError(self.err, os.strerror(self.err))
        self.real(f, data)
        self.used += len(data)


class ArchiveBudget:
    """Stand-in for ``eagle3.io._save_archive`` (shards saved by path, ``via_path=True``) on a disk with
    ``budget`` free bytes: the archive's bytes that fit are written, then torch's C++ writer fails the
    way it does on a full disk (an errno-less RuntimeError); ``free`` stands in for
    ``eagle3.io.free_bytes`` on that disk. Every later save fails too (the disk stays full)."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.failures: list[str] = []

    def __call__(self, obj, tmp: Path) -> None:
        import io

        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        room = max(0, self.budget - self.used)
        tmp.write_bytes(data[:room])
        self.used += min(room, len(data))
        if len(data) > room:
            self.failures.append(tmp.name)
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                "data/0: file write failed"
            )

    def free(self, path) -> tuple[int, Path]:
        return max(0, self.budget - self.used), Path(path)


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if eio.TMP_MARK in p.name]


# ---- the writers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT])
def test_atomic_write_disk_full_is_one_line_and_keeps_old_file(tmp_path, monkeypatch, err):
    target = tmp_path / "sub" / "out.bin"
    eio.atomic_write_bytes(target, b"old contents")
    monkeypatch.setattr(eio, "_write_all", DiskBudget(1000, err=err))
    with pytest.raises(UserError) as e:
        eio.atomic_write_bytes(target, b"x" * 5000)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{target}: disk full ({os.strerror(err)})")
    assert "writing 5.00 kB (5000 bytes)" in msg
    free = shutil.disk_usage(tmp_path).free
    m = re.search(r"; [\d.]+ \w+ \((\d+) bytes\) free on the filesystem of (\S+);", msg)
    assert m and abs(int(m.group(1)) - free) < 64 * 2**20 and Path(m.group(2)) == target.parent
    assert "re-run the same command to resume" in msg
    assert target.read_bytes() == b"old contents"  # untouched
    assert _tmp_files(tmp_path) == []  # the partial temp file was removed


def test_atomic_torch_save_disk_full(tmp_path, monkeypatch):
    monkeypatch.setattr(eio, "_write_all", DiskBudget(100))
    with pytest.raises(UserError, match=r"vocab_map\.pt: disk full .* writing"):
        eio.atomic_torch_save(
            {"d2t": torch.zeros(1000, dtype=torch.int64)}, tmp_path / "vocab_map.pt"
        )
    assert list(tmp_path.iterdir()) == []


def test_atomic_torch_save_via_path_disk_full(tmp_path, monkeypatch):
    """Saved by path (stage 02's shards): torch's errno-less RuntimeError with less room left than the
    tensors need is reported as disk full; no temp file is left."""
    budget = ArchiveBudget(100)
    monkeypatch.setattr(eio, "_save_archive", budget)
    monkeypatch.setattr(eio, "free_bytes", budget.free)
    with pytest.raises(
        UserError, match=r"data_3\.pt: disk full \(No space left on device\) writing 8.00 kB"
    ):
        eio.atomic_torch_save(
            {"d2t": torch.zeros(1000, dtype=torch.int64)}, tmp_path / "data_3.pt", via_path=True
        )
    assert budget.failures and list(tmp_path.iterdir()) == []


def test_atomic_torch_save_via_path_other_errors_pass_through(tmp_path, monkeypatch):
    """A RuntimeError of torch's writer with room left on the disk is not called disk full."""

    def broken(obj, tmp):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(eio, "_save_archive", broken)
    with pytest.raises(RuntimeError, match="file write failed") as e:
        eio.atomic_torch_save({"a": torch.zeros(4)}, tmp_path / "x.pt", via_path=True)
    assert not isinstance(e.value, UserError) and list(tmp_path.iterdir()) == []


def test_other_os_errors_are_not_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(eio, "_write_all", DiskBudget(0, err=errno.EIO))
    with pytest.raises(OSError) as e:
        eio.atomic_write_bytes(tmp_path / "a", b"abc")
    assert e.value.errno == errno.EIO and not isinstance(e.value, UserError)
    assert list(tmp_path.iterdir()) == []


def test_manifest_append_rolls_back_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "manifest.jsonl"
    with ManifestWriter(path) as man:
        man.append(0, "a", 5)
        before = path.read_bytes()
        monkeypatch.setattr(
            eio, "_write_all", DiskBudget(10)
        )  # 10 bytes of the next line fit, then ENOSPC
        with pytest.raises(UserError, match=r"manifest\.jsonl: disk full"):
            man.append(1, "b", 7)
        assert path.read_bytes() == before  # no torn line left behind
        monkeypatch.undo()
        man.append(1, "b", 7)  # space freed: appending continues on the same handle
    assert sorted(read_manifest(path).rows) == [0, 1] and not read_manifest(path).dropped_tail


def test_library_writer_error_text_recognised(tmp_path):
    from safetensors import SafetensorError

    # the exact error safetensors raised on a full tmpfs (see test_real_small_filesystem)
    e = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert eio.is_disk_full(e)
    assert eio.is_disk_full(
        SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    )
    assert not eio.is_disk_full(
        SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")
    )
    assert not eio.is_disk_full(ValueError("bad shape"))
    assert not eio.is_disk_full(OSError(errno.ENOENT, "No such file"))
    with pytest.raises(
        UserError,
        match=r"model\.safetensors: disk full \(No space left on device or quota exceeded\) "
        r"writing 400.00 kB \(400000 bytes\)",
    ):
        with eio.disk_full_guard(tmp_path / "model.safetensors", 400000):
            raise e


def test_cli_turns_a_stray_disk_full_oserror_into_one_line(capsys):
    from eagle3.cli import run_main

    def main(argv):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out/tb/events.out")

    with pytest.raises(SystemExit) as e:
        run_main(main, [])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: /data/out/tb/events.out: disk full (No space left on device)")
        and "\n" not in err
    )


def test_real_small_filesystem(tmp_path):
    """Fill a real 64 KiB tmpfs (user + mount namespace): the errno path, the free-space figure,
    the clean-up and safetensors' own error, unfaked."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = (
        "import os, torch, eagle3.io as io\n"
        "from eagle3.errors import UserError\n"
        "from safetensors.torch import save_file\n"
        f"io.atomic_write_bytes('{mnt}/small.bin', b'a' * 1000)\n"
        f"try:\n    io.atomic_write_bytes('{mnt}/big.bin', b'b' * 200000)\n"
        "except UserError as e:\n    print(e)\n"
        f"try:\n    with io.atomic_path('{mnt}/head.safetensors') as tmp:\n"
        "        save_file({'a': torch.zeros(50000)}, str(tmp))\n"
        "except UserError as e:\n    print(e)\n"
        f"try:\n    io.atomic_torch_save({{'a': torch.zeros(50000)}}, '{mnt}/data_0.pt', via_path=True)\n"
        "except UserError as e:\n    print(e)\n"
        f"print(sorted(os.listdir('{mnt}')))\n"
    )
    env = child_env(ROOT)
    r = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount -t tmpfs -o size=64k tmpfs {mnt} && exec {sys.executable} -c "$0"',
            code,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if r.returncode != 0 and ("mount" in r.stderr or "unshare" in r.stderr):
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(
        f"{mnt}/big.bin: disk full (No space left on device) writing 200.00 kB (200000 bytes); "
    )
    free = int(re.search(r"\((\d+) bytes\) free", lines[0]).group(1))
    assert free < 65536  # the tmpfs' own free space, not the host disk's
    assert lines[1].startswith(f"{mnt}/head.safetensors: disk full")
    assert lines[2].startswith(
        f"{mnt}/data_0.pt: disk full (No space left on device) writing 200.00 kB"
    )  # torch's C++ writer
    assert lines[3] == "['small.bin']"  # no partial file, no temp file


# ---- stage 02 -------------------------------------------------------------------------------------
def _extract_cli(cfg_path: Path, capsys) -> tuple[int, str]:
    import importlib

    from eagle3.cli import run_main

    sys.path.insert(0, str(ROOT))
    cli = importlib.import_module("02_extract_hidden")
    with pytest.raises(SystemExit) as e:
        run_main(cli.main, ["--config", str(cfg_path)])
    return e.value.code, capsys.readouterr().err


def _samples(root: Path) -> dict:
    from eagle3.shards.format import list_samples
    from eagle3.shards.read import load_sample

    return {i: load_sample(p) for i, p in list_samples(root)}


def _assert_same_shards(a: Path, b: Path) -> None:
    sa, sb = _samples(a), _samples(b)
    assert sorted(sa) == sorted(sb)
    for i in sa:
        assert torch.equal(sa[i]["input_ids"], sb[i]["input_ids"]) and torch.equal(
            sa[i]["loss_mask"], sb[i]["loss_mask"]
        )
        for x, y in zip(sa[i]["hidden_states"], sb[i]["hidden_states"]):
            assert torch.equal(x, y), i
    ma, mb = read_manifest(a / "manifest.jsonl").rows, read_manifest(b / "manifest.jsonl").rows
    assert {k: (r["id"], r["num_tokens"]) for k, r in ma.items()} == {
        k: (r["id"], r["num_tokens"]) for k, r in mb.items()
    }
    da = eio.read_json(a / "data_config.json")
    db = eio.read_json(b / "data_config.json")
    assert {k: v for k, v in da.items() if k != "prompts_file"} == {
        k: v for k, v in db.items() if k != "prompts_file"
    }


@pytest.fixture(scope="module")
def ref_extract(tmp_path_factory, tiny_llama_dir) -> Path:
    """An uninterrupted stage-02 run on the tiny verifier (shards folder)."""
    from test_extract import _config

    from eagle3.config import load_config
    from eagle3.stages.extract import run

    cfg = load_config(_config(tmp_path_factory.mktemp("ref"), tiny_llama_dir))
    run(cfg)
    return cfg.shards_dir


@pytest.mark.parametrize("where", ["shards", "manifest", "data_config"])
def test_extract_disk_full_then_resume_matches_uninterrupted(
    tmp_path, tiny_llama_dir, ref_extract, monkeypatch, capsys, where
):
    from test_extract import _config

    ref_root = ref_extract
    shard_bytes = sum(p.stat().st_size for p in ref_root.rglob("data_*.pt"))

    cfg = _config(tmp_path / "full", tiny_llama_dir)
    root = tmp_path / "full" / "out" / "shards"
    budget = {
        "shards": ArchiveBudget(shard_bytes // 2),  # dies inside the 3rd-4th shard (saved by path)
        "manifest": DiskBudget(300, match=r"manifest\.jsonl"),  # a row torn mid-line
        "data_config": DiskBudget(0, match=r"data_config\.json"),
    }[where]  # everything but the last file
    if where == "shards":
        monkeypatch.setattr(eio, "_save_archive", budget)
        monkeypatch.setattr(eio, "free_bytes", budget.free)
    else:
        monkeypatch.setattr(eio, "_write_all", budget)
    code, err = _extract_cli(cfg, capsys)
    assert code == 2 and budget.failures
    errors = [x for x in err.splitlines() if x.startswith("error:")]  # (stderr also has tqdm bars)
    assert len(errors) == 1 and "Traceback" not in err
    line = errors[0]
    assert (
        line.startswith(f"error: {root}") and "disk full (No space left on device) writing " in line
    )
    assert " free on the filesystem of " in line
    assert _tmp_files(root) == []
    assert not (root / "data_config.json").exists()  # present == complete
    done = read_manifest(root / "manifest.jsonl")
    assert not done.dropped_tail  # the torn manifest line was rolled back
    on_disk = {int(p.stem.split("_")[1]) for p in root.rglob("data_*.pt")}
    if where == "shards":
        assert 0 < len(on_disk) < 6
    assert set(done.rows) <= on_disk

    monkeypatch.undo()  # space freed: the same command resumes
    assert _extract_cli(cfg, capsys)[0] == 0
    _assert_same_shards(ref_root, root)
    assert _tmp_files(root) == []


# ---- stage 04 -------------------------------------------------------------------------------------
def test_train_checkpoint_disk_full_then_resume_matches_uninterrupted(tmp_path, monkeypatch):
    from _ddp_worker import make_tiny_run

    from eagle3.config import load_config
    from eagle3.stages.export import export_for_run
    from eagle3.stages.train import run
    from eagle3.train import checkpoint as ckpt

    train = {"epochs": 2, "batch_size": 2, "ckpt_every": 2}
    a = load_config(make_tiny_run(tmp_path / "a", train=train))
    b = load_config(make_tiny_run(tmp_path / "b", train=train))
    run(a, device="cpu", export=export_for_run)
    budget = DiskBudget(0, match=r"step_00000004\.pt")
    monkeypatch.setattr(eio, "_write_all", budget)
    with pytest.raises(UserError) as e:
        run(b, device="cpu", export=export_for_run)
    msg = str(e.value)
    assert msg.startswith(
        f"{ckpt.ckpt_path(b.train_dir, 4)}: disk full (No space left on device) writing "
    )
    assert [s for s, _ in ckpt.list_checkpoints(b.train_dir)] == [2] and _tmp_files(
        b.train_dir
    ) == []
    monkeypatch.undo()
    r = run(b, resume=True, device="cpu", export=export_for_run)
    assert r["step"] == 8 and not r["stopped"]
    sa, sb = (
        ckpt.load_checkpoint(ckpt.list_checkpoints(a.train_dir)[-1][1]),
        ckpt.load_checkpoint(ckpt.list_checkpoints(b.train_dir)[-1][1]),
    )
    for k in sa["model"]:
        assert torch.equal(sa["model"][k], sb["model"][k]), k
    from safetensors.torch import load_file

    ea, eb = (
        load_file(a.export_dir / "model.safetensors"),
        load_file(b.export_dir / "model.safetensors"),
    )
    assert ea.keys() == eb.keys() and all(torch.equal(ea[k], eb[k]) for k in ea)


def test_train_export_and_metrics_disk_full(tmp_path, monkeypatch):
    """The export (safetensors' own writer) and the metrics log fail with the same one line."""
    from _ddp_worker import make_tiny_run
    from safetensors import SafetensorError

    from eagle3.config import load_config
    from eagle3.stages.export import export_for_run
    from eagle3.stages.train import run

    cfg = load_config(
        make_tiny_run(tmp_path, n_train=4, train={"epochs": 1, "batch_size": 2, "ckpt_every": 2})
    )

    def full_save(tensors, path, metadata=None):
        Path(path).write_bytes(
            b"partial"
        )  # what a full disk leaves, then the error safetensors raises there
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    import safetensors.torch

    monkeypatch.setattr(
        safetensors.torch, "save_file", full_save
    )  # eagle3.export.folder looks it up at call time
    with pytest.raises(
        UserError, match=r"model\.safetensors: disk full .* writing [\d.]+ \w+ \(\d+ bytes\); "
    ):
        run(cfg, device="cpu", export=export_for_run)
    assert not cfg.export_dir.exists() and not list(cfg.export_dir.parent.glob("*.tmp-*"))
    monkeypatch.undo()
    r = run(
        cfg, resume=True, device="cpu", export=export_for_run
    )  # the final checkpoint is there: only the export is redone
    assert (cfg.export_dir / "model.safetensors").is_file() and r["step"] == 2

    monkeypatch.setattr(eio, "_write_all", DiskBudget(0, match=r"metrics\.jsonl"))
    cfg2 = load_config(
        make_tiny_run(tmp_path / "m", n_train=4, train={"epochs": 1, "batch_size": 2})
    )
    with pytest.raises(UserError, match=r"metrics\.jsonl: disk full"):
        run(cfg2, device="cpu")
    assert (cfg2.train_dir / "metrics.jsonl").read_bytes() == b""


def test_train_report_disk_full_keeps_the_earlier_report_whole(tmp_path, monkeypatch):
    """train_report.json, train_report.md and loss.png were written one by one: a disk that filled at the Markdown
    or the plot left the new JSON beside the earlier run's Markdown (trial 2026-12-05g). They are one set now: the
    failed write replaces none of them, and the next one writes all three."""
    from _ddp_worker import make_tiny_run

    from eagle3.config import load_config
    from eagle3.drafter.args import DrafterArgs
    from eagle3.stages.train import run
    from eagle3.train.report import write_report

    cfg = load_config(make_tiny_run(tmp_path, n_train=4, train={"epochs": 1, "batch_size": 2}))
    run(cfg, device="cpu")
    names = ("train_report.json", "train_report.md", "loss.png")
    before = {n: (cfg.train_dir / n).read_bytes() for n in names}
    result = json.loads(before["train_report.json"])
    args = DrafterArgs.from_json(result.pop("drafter_args"))
    monkeypatch.setattr(eio, "_write_all", DiskBudget(0, match=r"train_report\.md"))
    with pytest.raises(UserError, match=r"train_report\.md: disk full \(No space left on device\)"):
        write_report(cfg.train_dir, dict(result, warnings=["rewritten"]), args)
    assert {n: (cfg.train_dir / n).read_bytes() for n in names} == before and _tmp_files(
        cfg.train_dir
    ) == []
    monkeypatch.undo()
    write_report(cfg.train_dir, dict(result, warnings=["rewritten"]), args)
    assert json.loads((cfg.train_dir / "train_report.json").read_text())["warnings"] == [
        "rewritten"
    ]
    assert "- **warning**: rewritten" in (cfg.train_dir / "train_report.md").read_text()


def test_the_disk_full_line_says_resume_only_where_a_rerun_resumes(tmp_path, monkeypatch):
    """Every disk-full line ended "re-run the same command to resume", also in 03 and 05, where a re-run starts over
    (trial 2026-12-05g), and in 04, whose same command without --resume refuses the checkpoints. The advice is now
    worded per stage: 01 / 02 (and a writer outside any stage) resume; 04 training says --resume; 04 --export-only
    says it starts over (03, 05: tests/data/test_prepare_data.py::test_a_full_disk_in_03_says_it_starts_over,
    tests/benchmark/test_benchmark.py::test_a_full_disk_in_05_says_it_starts_over)."""
    from _ddp_worker import make_tiny_run

    from eagle3.config import load_config
    from eagle3.stages.export import export_for_run, export_from_checkpoint
    from eagle3.stages.train import run

    def line(call) -> str:
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value)
        return str(e.value)

    cfg = load_config(
        make_tiny_run(tmp_path, n_train=4, train={"epochs": 1, "batch_size": 2, "ckpt_every": 100})
    )
    monkeypatch.setattr(eio, "_write_all", DiskBudget(0, match=r"step_\d+\.pt"))
    assert line(lambda: run(cfg, device="cpu", export=export_for_run)).endswith(
        "free space or move the output folder, then re-run the same command with --resume (04 continues from the "
        "newest checkpoint)"
    )
    monkeypatch.undo()
    run(cfg, resume=True, device="cpu", export=export_for_run)  # what the line says: it finishes
    import safetensors.torch
    from safetensors import SafetensorError

    def full_save(tensors, path, metadata=None):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full_save)
    assert line(lambda: export_from_checkpoint(cfg)).endswith(
        "then re-run the same command (--export-only does not resume: it exports the checkpoint again)"
    )
    assert str(eio.disk_full_error(tmp_path / "x", OSError(errno.ENOSPC, "full"))).endswith(
        "then re-run the same command to resume"
    )  # outside 03/04/05: the resuming stages' (01, 02) wording
