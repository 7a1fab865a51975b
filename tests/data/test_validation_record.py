"""Stage 03 reuses an earlier validation while the shards are unchanged (eagle3.data.validation_record)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_prepare_data import FREQ, SAMPLES, H, _make_shards

import eagle3.data.validate as validate
import eagle3.data.validation_record as vr
import eagle3.shards.checksum
from eagle3.config import load_config
from eagle3.data.validation_record import VALIDATION_RECORD
from eagle3.errors import UserError
from eagle3.shards.checksum import file_checksum
from eagle3.shards.format import DATA_CONFIG, list_samples
from eagle3.shards.manifest import MANIFEST
from eagle3.shards.write import write_sample
from eagle3.stages.prepare_data import run

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path: Path, name: str, **data):
    """A run ``name`` whose shards are the shared ``tmp_path/shards`` (as the ablations of one shard set)."""
    d = {"draft_vocab_size": 4, "val_fraction": 0.4, "seed": 3}
    d.update(data)
    cfg = {
        "run_name": name,
        "output_root": str(tmp_path / name),
        "verifier": {"path": "/nowhere", "name": "tiny"},
        "prompts": {"source": "humaneval"},
        "extract": {"output_dir": str(tmp_path / "shards")},
        "data": d,
    }
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _shards(tmp_path: Path, algo: str = "xxh3_128") -> Path:
    """The hand-made shards of test_prepare_data plus a manifest with each shard's checksum (as 02
    writes: xxh3_128; ``algo="sha256"``: as 02 wrote before)."""
    root = tmp_path / "shards"
    _make_shards(root)
    rows = [
        {"idx": i, "id": f"p{i}", "num_tokens": len(SAMPLES[i][0]), algo: file_checksum(p, algo)}
        for i, p in list_samples(root)
    ]
    (root / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


class Spy:
    """Counts shard hashes (``eagle3.shards.checksum.file_checksum`` on ``data_*.pt``) and shard loads in 03."""

    def __init__(self, monkeypatch):
        self.hashed: list[str] = []
        self.loaded: list[str] = []
        real_sum, real_load = eagle3.shards.checksum.file_checksum, validate.load_sample

        def checksum(path, algo=eagle3.shards.checksum.DEFAULT_ALGO):
            if Path(path).name.startswith("data_"):
                self.hashed.append(Path(path).name)
            return real_sum(path, algo)

        def load(path, expect=None):
            self.loaded.append(Path(path).name)
            return real_load(path, expect=expect)

        monkeypatch.setattr(eagle3.shards.checksum, "file_checksum", checksum)
        monkeypatch.setattr(validate, "load_sample", load)

    def reset(self) -> None:
        self.hashed.clear()
        self.loaded.clear()


def _outputs(data_dir: Path) -> dict:
    """Every output's bytes, with the report's ``validation`` field / row removed."""
    out = {n: (data_dir / n).read_bytes() for n in ("token_freq.pt", "vocab_map.pt", "split.json")}
    rep = json.loads((data_dir / "data_report.json").read_text())
    assert rep.pop("validation") in ("full", "reused")
    out["data_report.json"] = rep
    out["data_report.md"] = [
        ln
        for ln in (data_dir / "data_report.md").read_text().splitlines()
        if not ln.startswith("| shard validation |")
    ]
    return out


def test_second_run_reuses_without_touching_shards_and_matches_full_run(
    tmp_path, monkeypatch, caplog
):
    shards = _shards(tmp_path)
    spy = Spy(monkeypatch)
    a = load_config(_cfg(tmp_path, "a"))
    assert run(a, plot=False)["validation"] == "full"
    assert sorted(spy.hashed) == sorted(spy.loaded) == [f"data_{i}.pt" for i in range(5)]
    rec = json.loads((shards / VALIDATION_RECORD).read_text())
    assert rec["version"] == vr.RECORD_VERSION and rec["token_freq"] == FREQ
    assert rec["stats"] == {"num_samples": 5, "num_tokens": 18, "num_loss_tokens": 11, "max_len": 5}

    # another run (own data dir) on the same shards: nothing hashed, nothing loaded
    spy.reset()
    b = load_config(_cfg(tmp_path, "b"))
    with caplog.at_level(logging.INFO, logger="eagle3.data.validate"):
        rep = run(b, plot=False)
    assert rep["validation"] == "reused" and spy.hashed == [] and spy.loaded == []
    assert (
        "reusing the shard validation of" in caplog.text
        and "--revalidate forces a full pass" in caplog.text
    )
    assert json.loads((b.data_dir / "data_report.json").read_text())["validation"] == "reused"
    assert "| shard validation | reused |" in (b.data_dir / "data_report.md").read_text()
    # byte-identical to a full pass with the same settings
    c = load_config(_cfg(tmp_path, "c"))
    assert run(c, plot=False, revalidate=True)["validation"] == "full"
    assert _outputs(b.data_dir) == _outputs(c.data_dir)
    assert torch.load(b.data_dir / "token_freq.pt", weights_only=True).tolist() == FREQ


def test_read_only_shards_dir_keeps_the_record_in_the_data_dir(tmp_path, monkeypatch):
    shards = _shards(tmp_path)
    real = vr.atomic_write_json

    def refuse_shards_dir(path, obj):
        if Path(path).parent == shards:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, obj)

    monkeypatch.setattr(vr, "atomic_write_json", refuse_shards_dir)
    a = load_config(_cfg(tmp_path, "a"))
    assert run(a, plot=False)["validation"] == "full"
    assert not (shards / VALIDATION_RECORD).exists() and (a.data_dir / VALIDATION_RECORD).is_file()
    spy = Spy(monkeypatch)
    assert run(a, plot=False)["validation"] == "reused" and spy.hashed == spy.loaded == []
    # another run's data dir does not see it: full pass there
    assert (
        run(load_config(_cfg(tmp_path, "b")), plot=False)["validation"] == "full"
        and len(spy.hashed) == 5
    )


@pytest.mark.parametrize(
    "data",
    [
        {"draft_vocab_size": 3},
        {"train_samples": 2},
        {"draft_vocab_size": 6, "seed": 5, "val_fraction": 0.2},
    ],
)
def test_other_settings_with_reuse_equal_a_full_run(tmp_path, monkeypatch, data):
    _shards(tmp_path)
    run(load_config(_cfg(tmp_path, "first")), plot=False)
    spy = Spy(monkeypatch)
    r = load_config(_cfg(tmp_path, "reused", **data))
    assert run(r, plot=False)["validation"] == "reused" and spy.hashed == spy.loaded == []
    f = load_config(_cfg(tmp_path, "full", **data))
    assert run(f, plot=False, revalidate=True)["validation"] == "full" and len(spy.hashed) == 5
    assert _outputs(r.data_dir) == _outputs(f.data_dir)
    rep = json.loads((r.data_dir / "data_report.json").read_text())
    assert rep["draft_vocab_size"] == data.get("draft_vocab_size", 4)
    if "train_samples" in data:
        assert rep["train_samples"] == 2


def _flip_byte_keep_size(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    st = p.stat()
    p.write_bytes(bytes(b))
    os.utime(
        p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000)
    )  # as a later write would leave it


def _touch(p: Path) -> None:
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000))


def _manifest_row_sha(root: Path) -> None:
    rows = [json.loads(ln) for ln in (root / MANIFEST).read_text().splitlines()]
    rows[2]["xxh3_128"] = "0" * 32
    (root / MANIFEST).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _data_config(root: Path) -> None:
    meta = json.loads((root / DATA_CONFIG).read_text())
    meta["chat_template_hash"] = "y"
    (root / DATA_CONFIG).write_text(json.dumps(meta))


# change -> (number of shards the full pass hashes or loads, error expected from it or None)
CHANGES = {
    "touch_shard": (lambda r: _touch(r / "rows_2-4" / "data_2.pt"), 5, None),
    "modify_shard": (
        lambda r: _flip_byte_keep_size(r / "rows_2-4" / "data_2.pt"),
        3,
        r"data_2.pt: contents changed since extraction \(xxh3_128 differs from manifest.jsonl\)",
    ),
    "manifest_row": (_manifest_row_sha, 3, r"data_2.pt: contents changed since extraction"),
    "data_config": (_data_config, 5, None),
    "delete_shard": (
        lambda r: (r / "rows_4-6" / "data_4.pt").unlink(),
        4,
        "key 'num_samples' is 5 but the shards hold 4",
    ),
    "add_shard": (
        lambda r: write_sample(r, 5, 2, [1, 7], [torch.ones(2, H) for _ in range(4)], [0, 1]),
        6,
        "key 'num_samples' is 5 but the shards hold 6",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_shard_set_validates_fully(tmp_path, monkeypatch, change):
    shards = _shards(tmp_path)
    cfg = load_config(_cfg(tmp_path, "a"))
    run(cfg, plot=False)
    spy = Spy(monkeypatch)
    assert run(cfg, plot=False)["validation"] == "reused" and spy.hashed == []
    mutate, n_hashed, error = CHANGES[change]
    mutate(shards)
    if error is None:
        assert run(cfg, plot=False)["validation"] == "full"
        assert len(spy.hashed) == n_hashed == len(spy.loaded)
        spy.reset()
        assert (
            run(cfg, plot=False)["validation"] == "reused" and spy.hashed == []
        )  # record rewritten
    else:
        with pytest.raises(UserError, match=error):
            run(cfg, plot=False)
        # the full pass ran (in order, up to the bad shard: in-flight look-ahead may hash a few more)
        assert len(set(spy.hashed) | set(spy.loaded)) >= n_hashed
        with pytest.raises(
            UserError, match=error
        ):  # and a failed pass leaves no record that would hide it
            run(cfg, plot=False)


def test_sha256_manifest_of_an_earlier_02_is_still_checked(tmp_path, monkeypatch):
    """Shards whose manifest rows carry sha256 (02 before xxh3_128): 03 hashes them with sha256, a
    modified one is refused naming the algorithm, and an intact set passes."""
    shards = _shards(tmp_path, "sha256")
    spy = Spy(monkeypatch)
    assert (
        run(load_config(_cfg(tmp_path, "a")), plot=False)["validation"] == "full"
        and len(spy.hashed) == 5
    )
    _flip_byte_keep_size(shards / "rows_2-4" / "data_2.pt")
    with pytest.raises(
        UserError, match=r"data_2.pt: contents changed since extraction \(sha256 differs"
    ):
        run(load_config(_cfg(tmp_path, "a")), plot=False)


CORRUPT = {
    "truncated": lambda t: t[: len(t) // 2],
    "not_json": lambda t: "\x00garbage",
    "other_version": lambda t: t.replace(f'"version": {vr.RECORD_VERSION}', '"version": 99'),
    "freq_edited": lambda t: t.replace('"token_freq": [\n    1,', '"token_freq": [\n    2,'),
    "stats_edited": lambda t: t.replace('"num_tokens": 18', '"num_tokens": "18"'),
    "list": lambda t: "[]",
}


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_record_warns_and_validates_fully(tmp_path, monkeypatch, caplog, kind):
    shards = _shards(tmp_path)
    cfg = load_config(_cfg(tmp_path, "a"))
    run(cfg, plot=False)
    rec = shards / VALIDATION_RECORD
    text = rec.read_text()
    bad = CORRUPT[kind](text)
    assert bad != text
    rec.write_text(bad)
    spy = Spy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="eagle3.data.validation_record"):
        rep = run(cfg, plot=False)
    assert rep["validation"] == "full" and len(spy.hashed) == 5
    assert any(
        r.levelno == logging.WARNING and VALIDATION_RECORD in r.getMessage() for r in caplog.records
    )
    assert json.loads(rec.read_text())["token_freq"] == FREQ  # rewritten
    spy.reset()
    assert run(cfg, plot=False)["validation"] == "reused" and spy.hashed == []


def test_cli_revalidate_forces_full_pass(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT))
    cli = importlib.import_module("03_prepare_data")
    _shards(tmp_path)
    p = str(_cfg(tmp_path, "a"))
    data = load_config(p).data_dir
    assert cli.main(["--config", p, "--no-plot"]) == 0
    spy = Spy(monkeypatch)
    assert cli.main(["--config", p, "--no-plot"]) == 0 and spy.hashed == []
    assert json.loads((data / "data_report.json").read_text())["validation"] == "reused"
    assert cli.main(["--config", p, "--no-plot", "--revalidate"]) == 0
    assert len(spy.hashed) == 5 and len(spy.loaded) == 5
    assert json.loads((data / "data_report.json").read_text())["validation"] == "full"


def test_record_round_trip_and_the_reasons_a_record_is_ignored(tmp_path, caplog):
    """A written passing record loads back as written (stats, token_freq int64, created_at); a record of another
    version, one whose counts do not sum to its loss tokens, or one of another vocab size is ignored with one
    warning naming the file and the key."""
    a, b = tmp_path / "a", tmp_path / "b"
    stats = {"num_samples": 2, "num_tokens": 9, "num_loss_tokens": 5, "max_len": 6}
    path = vr.write_record([a, b], "fp", stats, torch.tensor([2, 0, 3]))
    assert path == a / VALIDATION_RECORD
    got_stats, freq, created, where = vr.load_matching_record([a, b], "fp", 3)
    assert (got_stats, freq.tolist(), freq.dtype, where) == (stats, [2, 0, 3], torch.int64, path)
    assert json.loads(path.read_text())["created_at"] == created
    assert vr.load_matching_record([a, b], "other", 3) is None
    raw = json.loads(path.read_text())
    for edit, why in (
        ({"version": 2}, "not a version-1 validation record (key 'version': Input should be 1)"),
        ({"token_freq": [2, 0, 4]}, "corrupt validation record (key 'token_freq' sums to 6, key"),
        ({"token_freq": [5]}, "corrupt validation record (key 'token_freq' holds 1 counts, not 3)"),
    ):
        path.write_text(json.dumps({**raw, **edit}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="eagle3.data.validation_record"):
            assert vr.load_matching_record([a, b], "fp", 3) is None
        assert caplog.messages[0].startswith(f"{path}: {why}")
    vr.write_failed_record([a, b], "fp", "shard 3 broken\nmore")
    assert json.loads(path.read_text())["error"] == "shard 3 broken"
    assert "stats" not in json.loads(path.read_text())
    assert vr.load_matching_record([a, b], "fp", 3) is None and vr.record_fingerprint(path) == "fp"
