"""Stage 02's disk plan (eagle3.capture.disk_plan): estimate vs real bytes written, resume, refusal."""

from __future__ import annotations

import importlib
import re
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from test_extract import _config, _run, tiny_backend  # noqa: F401 - fixture

from eagle3.capture.disk_plan import NotEnoughDisk, plan_disk, shard_size_model
from eagle3.capture.folder import LOCK, REPORT_JSON
from eagle3.config import load_config
from eagle3.io import read_json
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.write import shard_object, write_sample

ROOT = Path(__file__).resolve().parents[2]
_Usage = namedtuple("_Usage", "total used free")


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != LOCK]


@pytest.mark.parametrize("H", [64, 576])
def test_shard_size_model_matches_written_files(tmp_path, H):
    overhead, per_token = shard_size_model(H, shard_object)
    assert per_token == 4 * H * 2 + 16  # 4 bf16 [L, H] states + int64 ids and mask
    for L in (1, 7, 29, 100, 513):
        p = write_sample(
            tmp_path, L, 1000, list(range(L)), [torch.randn(L, H) for _ in range(4)], [1] * L
        )
        assert (
            abs(p.stat().st_size - (overhead + per_token * L)) <= 6 * 64
        )  # zip's 64-byte alignment per tensor


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_estimate_matches_bytes_written(tmp_path, tiny_llama_dir, tiny_backend, storage):  # noqa: F811
    cfg = load_config(_config(tmp_path, tiny_llama_dir, storage_dtype=storage))
    s = _run(cfg, tiny_backend)
    plan = s["disk_plan"]
    root = cfg.shards_dir
    files = _files(root)
    shards = [p for p in files if p.suffix == ".pt"]
    assert plan["samples"] == len(shards) == s["samples"] and plan["tokens"] == s["num_tokens"]
    shard_bytes = sum(p.stat().st_size for p in shards)
    assert abs(plan["shard_bytes"] - shard_bytes) / shard_bytes < 0.01
    total = sum(p.stat().st_size for p in files)
    assert (
        total <= plan["bytes"] <= 1.05 * total + 16 * 1024
    )  # metadata: a fixed 16 kB allowance, never short
    allocated = sum(p.stat().st_blocks * 512 for p in shards)
    assert allocated <= plan["allocated_bytes"]
    assert plan["checked"] and plan["fits"]
    if storage == "bfloat16":
        assert (
            plan["hidden_bytes_per_token"] == 4 * 64 * 2
            and plan["file_bytes_per_token"] == 4 * 64 * 2 + 16
        )
    else:  # fp8 values + scales, measured from the fp8 writer: about half
        assert (
            plan["hidden_bytes_per_token"]
            == read_json(root / "data_config.json")["bytes_per_token"]
        )
        assert (
            plan["file_bytes_per_token"]
            == plan["hidden_bytes_per_token"] + 16
            < 0.6 * (4 * 64 * 2 + 16)
        )
    assert "disk plan: " in (root / "extract_report.md").read_text()
    assert "disk_plan" not in read_json(
        root / "data_config.json"
    )  # data_config depends on the data only


def test_resume_plans_only_the_missing_samples(tmp_path, tiny_llama_dir, tiny_backend):  # noqa: F811
    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    _run(cfg, tiny_backend)
    root = cfg.shards_dir
    gone = dict(list_samples(root)[1:3])
    sizes = {i: p.stat().st_size for i, p in gone.items()}
    for p in gone.values():
        p.unlink()
    s = _run(cfg, tiny_backend)
    rows = read_manifest(root / "manifest.jsonl").rows
    plan = s["disk_plan"]
    assert s["written"] == 2 and plan["samples"] == 2
    assert plan["tokens"] == sum(rows[i]["num_tokens"] for i in gone)
    assert abs(plan["shard_bytes"] - sum(sizes.values())) / sum(sizes.values()) < 0.01


def _extract_cli(cfg_path: Path, capsys, *args) -> tuple[int, str]:
    from eagle3.cli import run_main

    sys.path.insert(0, str(ROOT))
    cli = importlib.import_module("02_extract_hidden")
    with pytest.raises(SystemExit) as e:
        run_main(cli.main, ["--config", str(cfg_path), *args])
    return e.value.code, capsys.readouterr().err


def _fake_free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: _Usage(real(p).total, real(p).total - free, free)
    )


def test_refused_when_it_does_not_fit_nothing_written(
    tmp_path, tiny_llama_dir, capsys, monkeypatch
):
    cfg_path = _config(tmp_path, tiny_llama_dir)
    root = load_config(cfg_path).shards_dir
    _fake_free(monkeypatch, 10_000_000)  # 10 MB: less than the default 1 GB margin
    code, err = _extract_cli(cfg_path, capsys)
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    m = re.fullmatch(
        r"error: (\S+): not enough disk space for stage 02: needs [\d.]+ [kMG]B \((\d+) bytes\) "
        r"\(6 samples, (\d+) tokens, .*\), 10\.00 MB \(10000000 bytes\) free; .*--ignore-disk-check",
        errors[0],
    )
    assert m, errors[0]
    assert m.group(1) == str(
        root
    )  # the folder measured: the shards folder (created, then removed again)
    assert int(m.group(2)) >= 1_000_000_000
    assert not root.exists()  # nothing written, not even the folder

    # --ignore-disk-check runs anyway and records that the check was skipped
    assert _extract_cli(cfg_path, capsys, "--ignore-disk-check")[0] == 0
    rep = read_json(root / REPORT_JSON)
    assert rep["disk_plan"]["fits"] is False and rep["disk_plan"]["checked"] is False
    assert len(list_samples(root)) == 6


def test_refusal_on_resume_leaves_the_folder_alone(
    tmp_path, tiny_llama_dir, tiny_backend, monkeypatch
):  # noqa: F811
    cfg = load_config(_config(tmp_path, tiny_llama_dir, disk_margin_bytes=0, disk_margin=0.0))
    _run(cfg, tiny_backend)
    root = cfg.shards_dir
    victim = list_samples(root)[4][1]
    victim.unlink()
    before = {p: p.read_bytes() for p in _files(root) if p.suffix == ".pt"}
    # Free space for everything but that one shard: refused, no shard written or touched (the manifest
    # is reconciled with the shards first: that repair is the same as any resume's)
    need_all = sum(p.stat().st_size for p in _files(root))
    _fake_free(monkeypatch, 4096)
    with pytest.raises(
        NotEnoughDisk,
        match=rf"^{re.escape(str(root))}: not enough disk space for stage 02: .*"
        r"\(1 samples, \d+ tokens",
    ):
        _run(cfg, tiny_backend)
    assert {p: p.read_bytes() for p in _files(root) if p.suffix == ".pt"} == before
    assert not list(root.rglob("*.tmp-*"))
    _fake_free(monkeypatch, need_all)  # room for one shard: goes ahead
    s = _run(cfg, tiny_backend)
    assert s["written"] == 1 and victim.is_file()


def test_margin_is_the_larger_of_fraction_and_bytes(tmp_path):
    pending = [("a", 100), ("b", 300)]
    kw = dict(
        hidden_size=64,
        hidden_bytes_per_token=512,
        rows_per_dir=10,
        pending_idx=[0, 1],
        encode=shard_object,
    )
    p = plan_disk(tmp_path, pending, margin=0.5, margin_bytes=10, free=(10**9, tmp_path), **kw)
    assert (
        p.margin_bytes == int(0.5 * p.allocated_bytes)
        and p.needed_bytes == p.allocated_bytes + p.margin_bytes
    )
    q = plan_disk(tmp_path, pending, margin=0.5, margin_bytes=10**7, free=(10**7, tmp_path), **kw)
    assert q.margin_bytes == 10**7 and not q.fits
    assert p.tokens == 400 and p.shard_bytes > 400 * 528


def test_overwrite_deletes_nothing_when_the_new_plan_does_not_fit(
    tmp_path,
    tiny_llama_dir,
    tiny_backend,  # noqa: F811
    monkeypatch,
):
    # --overwrite used to delete the old shards first and check the disk after: a refused run lost them
    cfg = load_config(_config(tmp_path, tiny_llama_dir, disk_margin_bytes=0, disk_margin=0.0))
    _run(cfg, tiny_backend)
    root = cfg.shards_dir
    before = {p: p.read_bytes() for p in _files(root)}
    freed = sum(
        p.stat().st_blocks * 512 for p in _files(root)
    )  # what deleting the old run gives back
    assert freed > 0
    big = load_config(
        _config(tmp_path, tiny_llama_dir, disk_margin_bytes=freed + 1_000_000, disk_margin=0.0)
    )
    _fake_free(monkeypatch, 0)
    with pytest.raises(
        NotEnoughDisk,
        match=rf"^{re.escape(str(root))}: not enough disk space for stage 02: .* "
        rf"\({freed} bytes\) free counting .* of old shards that --overwrite "
        r"would delete \(nothing was deleted\); ",
    ):
        _run(big, tiny_backend, overwrite=True)
    assert {
        p: p.read_bytes() for p in _files(root)
    } == before  # every old file still there, unchanged
    assert not list(root.rglob("*.tmp-*"))

    _fake_free(monkeypatch, 1_000_000_000)  # fits: the old run is deleted, the new one written
    s = _run(cfg, tiny_backend, overwrite=True)
    plan = read_json(root / REPORT_JSON)["disk_plan"]
    assert s["written"] == 6 and plan["samples"] == 6
    assert plan["freed_by_overwrite"] == freed and plan["free_bytes"] == 1_000_000_000 + freed
    assert "of old shards that --overwrite deletes" in (root / "extract_report.md").read_text()
    assert {p.name: p.read_bytes() for p in _files(root) if p.suffix == ".pt"} == {
        p.name: b for p, b in before.items() if p.suffix == ".pt"
    }  # same data, same shards
