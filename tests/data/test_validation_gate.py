"""Stage 04 trains only on a shard set whose last 03 validation passed (eagle3.data.validation_record.require_passed).

The fault this guards: 03 refused a shard flipped in place (size and mtime kept; ``xxh3_128`` differs from the
manifest), and 04 then trained a full epoch on it with the vocab map / split of an earlier, passing 03.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ddp_worker import make_tiny_run, single_thread  # noqa: F401  (autouse fixture)

import eagle3.data.validation_record as vr
from eagle3 import manifest
from eagle3.config import load_config
from eagle3.data import validate
from eagle3.data.validation_record import VALIDATION_RECORD, require_passed
from eagle3.errors import UserError
from eagle3.shards.checksum import file_checksum
from eagle3.shards.data_config import read_data_config, write_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import MANIFEST
from eagle3.stages import prepare_data

ROOT = Path(__file__).resolve().parents[2]
TRAIN = {"epochs": 1, "batch_size": 2, "ckpt_every": 100}


def _as_02_wrote(root: Path) -> list[str]:
    """make_tiny_run's set as 02 leaves it: a manifest with each shard's xxh3_128, data_config totals that
    match, no validation record yet. Returns the ``--set`` overrides 03 needs (the verifier id)."""
    rows, tokens, loss = [], 0, 0
    for i, p in list_samples(root / "shards"):
        s = torch.load(p, weights_only=True)
        tokens, loss = tokens + s["input_ids"].numel(), loss + int(s["loss_mask"].sum())
        rows.append(
            {
                "idx": i,
                "id": f"p{i}",
                "num_tokens": s["input_ids"].numel(),
                "xxh3_128": file_checksum(p),
            }
        )
    (root / "shards" / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_data_config(
        root / "shards",
        {**read_data_config(root / "shards"), "num_tokens": tokens, "num_loss_tokens": loss},
    )
    (root / "shards" / VALIDATION_RECORD).unlink()
    return ["verifier.name=synthetic"]


def _flip_4k_keep_size_and_mtime(path: Path) -> bytes:
    """Overwrite 4 KB in the middle of ``path`` (the hidden states), restoring its mtime; returns the old bytes."""
    old = path.read_bytes()
    st = os.stat(path)
    a = len(old) // 2
    path.write_bytes(old[:a] + bytes(b ^ 0x5A for b in old[a : a + 4096]) + old[a + 4096 :])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    return old


def _train_cli(path: Path, sets: list[str]) -> subprocess.CompletedProcess:
    args = [sys.executable, str(ROOT / "04_train.py"), "--config", str(path)] + [
        x for s in sets for x in ("--set", s)
    ]
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_04_refuses_a_shard_set_03_rejected_and_trains_after_the_fix(tmp_path):
    from eagle3.stages.train import run as train

    path = make_tiny_run(tmp_path, train=TRAIN)
    sets = _as_02_wrote(tmp_path)
    cfg = load_config(path, sets)
    assert prepare_data.run(cfg, plot=False)["validation"] == "full"  # the earlier, passing 03
    assert json.loads((cfg.shards_dir / VALIDATION_RECORD).read_text())["status"] == "passed"
    shard = dict(list_samples(cfg.shards_dir))[5]
    original = _flip_4k_keep_size_and_mtime(shard)
    with pytest.raises(
        UserError, match=r"data_5.pt: contents changed since extraction \(xxh3_128 differs"
    ):
        prepare_data.run(cfg, plot=False, revalidate=True)
    rec = json.loads((cfg.shards_dir / VALIDATION_RECORD).read_text())
    assert rec["status"] == "failed" and "data_5.pt" in rec["error"] and "stats" not in rec
    # a plain 03 does not reuse a failed record (the fingerprint is unchanged): it validates and refuses again
    with pytest.raises(UserError, match=r"xxh3_128 differs"):
        prepare_data.run(cfg, plot=False)

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    p = _train_cli(path, sets)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(
        f"error: {cfg.shards_dir}: 03's last validation of this shard set "
        f"failed ({shard}: contents changed since extraction (xxh3_128 differs"
    )
    assert "run 03_prepare_data.py" in err[0] and str(cfg.shards_dir / VALIDATION_RECORD) in err[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert not (cfg.train_dir / "metrics.jsonl").exists() and not cfg.export_dir.exists()

    shard.write_bytes(original)  # re-extracted: same bytes, a new mtime
    assert prepare_data.run(cfg, plot=False)["validation"] == "full"
    r = train(cfg, device="cpu")
    assert r["step"] == r["total_steps"] == 4 and not r["stopped"]


def test_04_refuses_without_a_matching_passing_record(tmp_path):
    path = make_tiny_run(tmp_path, train=TRAIN)
    cfg = load_config(path)
    assert require_passed(cfg.shards_dir, cfg.data_dir) == cfg.shards_dir / VALIDATION_RECORD
    shard = dict(list_samples(cfg.shards_dir))[3]
    # an mtime set back (a copy restoring an older time): the fingerprint sees it, the file cannot be named by its mtime
    os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns - 10 * 10**9))
    with pytest.raises(
        UserError,
        match=r"shards: the shards, manifest.jsonl or data_config.json changed since 03 "
        r"last validated them, or the folder was moved or copied \(the record holds "
        r"its path, each shard's size and mtime: .*validation_record.json\); run "
        r"03_prepare_data.py",
    ):
        require_passed(cfg.shards_dir, cfg.data_dir)
    (cfg.shards_dir / VALIDATION_RECORD).unlink()
    with pytest.raises(
        UserError, match=r"no record that 03 validated this shard set .*; run 03_prepare_data.py"
    ):
        require_passed(cfg.shards_dir, cfg.data_dir)


def test_04_refuses_a_shard_replaced_after_03_naming_it(tmp_path):
    """A shard file replaced under the same name after 03's validation (same size, other bytes, a new inode and
    mtime) is seen by 04's check of 03's fingerprint (a stat per shard: size + mtime_ns, no shard read): 04 refuses
    before it writes anything, in one line naming the file and saying to run 03 again; 03 then validates afresh."""
    from eagle3.stages.train import run as train

    path = make_tiny_run(tmp_path, train=TRAIN)
    cfg = load_config(path)
    rec = cfg.shards_dir / VALIDATION_RECORD
    created = json.loads(rec.read_text())["created_at"]
    shard = dict(list_samples(cfg.shards_dir))[6]
    old, st = shard.read_bytes(), os.stat(shard)
    new = shard.with_name("replacement.tmp")
    a = len(old) // 2
    new.write_bytes(
        old[:a] + bytes(b ^ 0x5A for b in old[a : a + 64]) + old[a + 64 :]
    )  # same size, other states
    os.utime(
        new, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)
    )  # replaced a second after the shard was written
    os.replace(new, shard)
    assert os.stat(shard).st_size == st.st_size and os.stat(shard).st_ino != st.st_ino
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(UserError) as e:
        train(cfg, device="cpu")
    assert str(e.value) == (
        f"{shard}: changed after 03 validated this shard set ({vr.format_time(created)}); run "
        f"03_prepare_data.py again before training (record: {rec})"
    )
    assert {
        p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")
    } == before  # nothing written, no checkpoint
    other = dict(list_samples(cfg.shards_dir))[
        2
    ]  # a second shard touched: the first in idx order named, one counted
    os.utime(other, ns=(os.stat(other).st_atime_ns, os.stat(other).st_mtime_ns + 10**9))
    with pytest.raises(
        UserError,
        match=r"data_2\.pt: changed after 03 validated this shard set \(.*\) \(and 1 more "
        r"file\); run 03_prepare_data.py again before training",
    ):
        require_passed(cfg.shards_dir, cfg.data_dir)


def test_record_of_an_03_before_status_counts_as_passed(tmp_path):
    """Records written before ``status`` existed were written only after a passing full validation: 04 accepts
    one whose fingerprint matches, and 03 reuses it."""
    path = make_tiny_run(tmp_path, train=TRAIN)
    sets = _as_02_wrote(tmp_path)
    cfg = load_config(path, sets)
    prepare_data.run(cfg, plot=False)
    rec_path = cfg.shards_dir / VALIDATION_RECORD
    rec = json.loads(rec_path.read_text())
    del rec["status"]
    rec_path.write_text(json.dumps(rec))
    assert require_passed(cfg.shards_dir, cfg.data_dir) == rec_path
    assert prepare_data.run(cfg, plot=False)["validation"] == "reused"


def test_failed_record_replaces_a_passing_one_in_the_other_folder(tmp_path, monkeypatch):
    """A passing record kept in the data dir (shards folder read-only then) does not outlive a later failed
    validation written to the shards folder, and a later pass removes the failed one from the other folder."""
    shards, data = tmp_path / "shards", tmp_path / "data"
    shards.mkdir()
    real = vr.atomic_write_json

    def refuse_shards(path, obj):
        if Path(path).parent == shards:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, obj)

    stats = {"num_samples": 1, "num_tokens": 2, "num_loss_tokens": 1, "max_len": 2}
    monkeypatch.setattr(vr, "atomic_write_json", refuse_shards)
    assert (
        vr.write_record([shards, data], "fp", stats, torch.tensor([0, 1]))
        == data / VALIDATION_RECORD
    )
    monkeypatch.setattr(vr, "atomic_write_json", real)
    assert (
        vr.write_failed_record([shards, data], "fp", "x.pt: bad\nmore")
        == shards / VALIDATION_RECORD
    )
    assert not (data / VALIDATION_RECORD).exists()
    assert json.loads((shards / VALIDATION_RECORD).read_text())["error"] == "x.pt: bad"
    monkeypatch.setattr(vr, "atomic_write_json", refuse_shards)
    assert (
        vr.write_record([shards, data], "fp", stats, torch.tensor([0, 1]))
        == data / VALIDATION_RECORD
    )
    assert not (shards / VALIDATION_RECORD).exists()  # the failed record of the same shards is gone
    assert require_passed_fp(shards, data, "fp", monkeypatch) == data / VALIDATION_RECORD
    with pytest.raises(
        UserError, match=r"cannot write the validation record"
    ):  # 04 needs it: not only a warning
        vr.write_record([shards], "fp", stats, torch.tensor([0, 1]))


def require_passed_fp(shards: Path, data: Path, fp: str, monkeypatch) -> Path:
    """:func:`require_passed` with the shard set's fingerprint fixed to ``fp`` (no shards in these folders)."""
    monkeypatch.setattr(vr, "shard_set_fingerprint", lambda *a: fp)
    return require_passed(shards, data)


def test_04_refuses_a_split_made_under_other_data_settings(tmp_path):
    """03's outputs record the data: settings they were made under (its eagle3_manifest.json); 04 refuses them when
    the config now says otherwise (e.g. data.exclude_id_prefixes set after 03, or an 03 that then failed and left
    the earlier split), naming the first differing field with both values, and trains once 03 has run again. A data
    folder without a manifest (made before manifests) is refused, naming 03."""
    from eagle3.stages.train import run as train

    path = make_tiny_run(tmp_path, train=TRAIN)
    sets = _as_02_wrote(tmp_path)
    cfg = load_config(path, sets)
    prepare_data.run(cfg, plot=False)
    made = manifest.read(cfg.data_dir, manifest.DataManifest)
    assert made.model_dump(include=set(made.SETTINGS)) == {
        "draft_vocab_size": 24,
        "val_fraction": cfg.data.val_fraction,
        "seed": 0,
        "train_samples": None,
        "exclude_id_prefixes": [],
    }
    assert made.shards_dir == str(cfg.shards_dir.resolve())
    assert made.shards_fingerprint == vr.fingerprint_now(cfg.shards_dir)
    changed = load_config(path, sets + ["data.exclude_id_prefixes=[p1]", "data.seed=3"])
    assert _train_refused(changed) == (
        f"{cfg.data_dir / manifest.FILE}: data.seed 0 -> 3; re-run 03_prepare_data.py"
    )
    prepare_data.run(changed, plot=False)
    assert train(changed, device="cpu")["step"] >= 1
    (cfg.data_dir / manifest.FILE).unlink()  # a data folder from before the manifest
    with pytest.raises(UserError) as e:
        train(changed, device="cpu", resume=True)
    assert str(e.value) == (
        f"{cfg.data_dir}: no {manifest.FILE} (not made by this version of 03_prepare_data.py); "
        f"re-run 03_prepare_data.py"
    )


def _train_refused(cfg) -> str:
    """04 on ``cfg`` refused before its first step: the one-line error (no checkpoint written)."""
    from eagle3.stages.train import run as train

    with pytest.raises(UserError) as e:
        train(cfg, device="cpu")
    assert not cfg.train_dir.joinpath("checkpoints").exists()
    return str(e.value)


def test_04_refuses_a_split_made_from_other_shards(tmp_path):
    """03's data folder is tied to the shard set it read (its manifest's 'shards_fingerprint'): 04 run with
    extract.output_dir pointing at another run's shards but the data folder of the first (same sample count, so every
    split index exists) trained silently on a vocab map and split of other data (fresh-user trial 2026-12-05d); now it
    is one line naming both shard folders, and a data folder made from the shards as they were before a re-extraction
    is refused as well."""
    from eagle3.stages.train import run as train

    a_path, b_path = (
        make_tiny_run(tmp_path / "a", train=TRAIN),
        make_tiny_run(tmp_path / "b", train=TRAIN, seed=1),
    )
    sets = _as_02_wrote(tmp_path / "a")
    _as_02_wrote(tmp_path / "b")
    a = load_config(a_path, sets)
    prepare_data.run(a, plot=False)
    prepare_data.run(load_config(b_path, sets), plot=False)  # B's shards pass 03 (their own record)
    mixed = load_config(a_path, sets + [f"extract.output_dir={tmp_path / 'b' / 'shards'}"])
    assert _train_refused(mixed) == (
        f"{a.data_dir / manifest.FILE}: extract.output_dir '{a.shards_dir.resolve()}' -> "
        f"'{mixed.shards_dir.resolve()}'; re-run 03_prepare_data.py"
    )
    # the same folder re-extracted (here: B's shards copied over A's) and validated by 03 into another data folder
    shutil.rmtree(tmp_path / "a" / "shards")
    shutil.copytree(tmp_path / "b" / "shards", tmp_path / "a" / "shards")
    prepare_data.run(
        load_config(a_path, sets + [f"data.output_dir={tmp_path / 'other'}"]), plot=False
    )
    with pytest.raises(
        UserError,
        match=r"the shard set's fingerprint \(re-extracted or changed since\) '[0-9a-f]+' -> ",
    ):
        train(a, device="cpu")
    prepare_data.run(a, plot=False)  # 03 again: trains
    assert train(a, device="cpu")["step"] >= 1


def test_an_interrupted_revalidate_leaves_no_passing_record(tmp_path, monkeypatch):
    """``03 --revalidate`` stopped during its full pass (Ctrl-C / SIGTERM / a crash) left the earlier passing record,
    so a plain 03 reused it ("reusing the shard validation") and 04 trained on a set whose forced re-check never
    finished. The forced pass now records ``unfinished`` before it starts: a plain 03 validates every shard again,
    04 refuses the set meanwhile in one line, and the finished pass records ``passed``."""
    path = make_tiny_run(tmp_path, train=TRAIN)
    cfg = load_config(path, _as_02_wrote(tmp_path))
    assert prepare_data.run(cfg, plot=False)["validation"] == "full"
    real = validate.validate_all

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_all", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.run(cfg, plot=False, revalidate=True)
    rec = json.loads((cfg.shards_dir / VALIDATION_RECORD).read_text())
    assert rec["status"] == "unfinished" and "stats" not in rec
    with pytest.raises(UserError) as e:
        require_passed(cfg.shards_dir, cfg.data_dir)
    assert str(e.value) == (
        f"{cfg.shards_dir}: 03_prepare_data.py --revalidate of this shard set did not finish "
        f"(record: {cfg.shards_dir / VALIDATION_RECORD}); run 03_prepare_data.py before training"
    )
    monkeypatch.setattr(validate, "validate_all", real)
    assert prepare_data.run(cfg, plot=False)["validation"] == "full"  # not "reused"
    assert json.loads((cfg.shards_dir / VALIDATION_RECORD).read_text())["status"] == "passed"
    assert require_passed(cfg.shards_dir, cfg.data_dir) == cfg.shards_dir / VALIDATION_RECORD


def test_an_interrupted_03_says_what_it_left_and_how_to_go_on(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `03 --revalidate` printed a bare `interrupted by SIGINT` (fresh-user trial 2026-12-05e): nothing
    said the record was now `unfinished` and that 04 would refuse the set. 03 now ends like 01, 02 and 05: one line
    saying what was left and how to go on, exit 130."""
    import runpy

    from eagle3.cli import run_main

    path = make_tiny_run(tmp_path, train=TRAIN)
    sets = _as_02_wrote(tmp_path)
    cfg = load_config(path, sets)
    prepare_data.run(cfg, plot=False)

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_all", killed)
    main = runpy.run_path(str(ROOT / "03_prepare_data.py"))["main"]
    argv = [
        "--config",
        str(path),
        *[x for s in sets for x in ("--set", s)],
        "--no-plot",
        "--revalidate",
    ]
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    assert e.value.code == 130
    rec = cfg.shards_dir / VALIDATION_RECORD
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"interrupted by SIGINT: the --revalidate pass did not finish: {rec} says unfinished, so 04_train.py refuses "
        f"the shard set; re-run 03_prepare_data.py (it validates every shard)"
    )
