"""Stage 03 on hand-made shards: frequencies, d2t/t2d, coverage, split, reports, error paths."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.config import load_config
from eagle3.data.split import split_indices
from eagle3.data.vocab import load_vocab_map
from eagle3.errors import UserError
from eagle3.shards.data_config import write_data_config
from eagle3.shards.format import LAYER_INDEX_CONVENTION
from eagle3.shards.write import write_sample
from eagle3.stages.prepare_data import run

ROOT = Path(__file__).resolve().parents[2]
H, V = 4, 10
# (input_ids, loss_mask); masked ids: s0: 3, 3, 7 | s1: 7, 7, 1 | s2: 3 | s3: 9, 0 | s4: 5, 7
SAMPLES = [
    ([1, 2, 3, 3, 7], [0, 0, 1, 1, 1]),
    ([4, 7, 7, 1], [0, 1, 1, 1]),
    ([8, 3], [0, 1]),
    ([2, 9, 0], [0, 1, 1]),
    ([6, 5, 7, 2], [0, 1, 1, 0]),
]
# counts: id0:1 id1:1 id2:0 id3:3 id4:0 id5:1 id6:0 id7:4 id8:0 id9:1  (total 11)
FREQ = [1, 1, 0, 3, 0, 1, 0, 4, 0, 1]


def _make_shards(root: Path, samples=SAMPLES, **meta_kw) -> None:
    g = torch.Generator().manual_seed(0)
    for idx, (ids, mask) in enumerate(samples):
        write_sample(
            root, idx, 2, ids, [torch.randn(len(ids), H, generator=g) for _ in range(4)], mask
        )
    meta = {
        "format": "speculators-v1",
        "verifier": "tiny",
        "architecture": "LlamaForCausalLM",
        "num_layers": 6,
        "hidden_size": H,
        "vocab_size": V,
        "aux_layers": [1, 3, 4],
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": "post_norm",
        "dtype": "bfloat16",
        "max_length": 16,
        "rows_per_dir": 2,
        "chat_template_hash": "x",
        "config_fingerprint": "f",
        "prompts_sha256": "p",
        "num_samples": len(samples),
        "num_tokens": sum(len(s[0]) for s in samples),
        "num_loss_tokens": sum(sum(s[1]) for s in samples),
        "bytes_per_token": 4 * H * 2,
        "skipped": {},
    }
    meta.update(meta_kw)
    write_data_config(root, meta)


def _cfg(tmp_path: Path, **data) -> Path:
    d = {"draft_vocab_size": 4, "val_fraction": 0.4, "seed": 3}
    d.update(data)
    cfg = {
        "run_name": "t",
        "output_root": str(tmp_path / "out"),
        "verifier": {"path": "/nowhere", "name": "tiny"},
        "prompts": {"source": "humaneval"},
        "data": d,
    }
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_prepare_data_hand_computed(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    report = run(cfg)
    out = cfg.data_dir
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert freq.tolist() == FREQ
    m = load_vocab_map(out / "vocab_map.pt", target_vocab_size=V, draft_vocab_size=4)
    # top 4 by count: 7 (4), 3 (3), then two of the ids with count 1 (0, 1, 5, 9): lower ids 0, 1
    # -> draft ids map to target [0, 1, 3, 7] -> d2t = [0-0, 1-1, 3-2, 7-3]; coverage (1+1+3+4)/11
    assert m["d2t"].tolist() == [0, 0, 1, 4]
    assert m["t2d"].nonzero().flatten().tolist() == [0, 1, 3, 7]
    assert report["coverage"] == pytest.approx(9 / 11, abs=1e-6)
    assert (
        report["num_loss_tokens"] == 11
        and report["num_tokens"] == 18
        and report["distinct_loss_tokens"] == 6
    )
    split = json.loads((out / "split.json").read_text())
    assert set(split) == {"train", "val"}
    assert len(split["val"]) == 2 and sorted(split["train"] + split["val"]) == [0, 1, 2, 3, 4]
    assert split == split_indices([0, 1, 2, 3, 4], 0.4, 3)
    assert json.loads((out / "data_report.json").read_text()) == report
    assert "| draft vocab | 4 |" in (out / "data_report.md").read_text()
    assert (out / "coverage.png").read_bytes()[:4] == b"\x89PNG"
    # idempotent: a second full run rewrites identical content
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".json", ".md")}
    run(cfg, plot=False, revalidate=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".json", ".md")} == before
    assert torch.equal(torch.load(out / "token_freq.pt", weights_only=True), freq)
    assert not list(out.glob("*.tmp-*"))


def test_a_full_disk_at_the_report_keeps_the_earlier_outputs_whole(tmp_path, monkeypatch):
    """03 wrote token_freq.pt, vocab_map.pt, split.json, then the report and the plot, each atomically: a disk that
    filled at data_report.json left the new draft-size vocab map and split beside the earlier run's report (trial
    2026-12-05g). They are now one set with the folder's manifest: the failed run replaces none of them; --no-plot
    removes an earlier plot."""
    import errno
    import os

    import eagle3.io as eio

    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    run(cfg)
    out = cfg.data_dir
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = eio._write_all

    def full_at_the_report(f, data):
        if "data_report.json" in str(getattr(f, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, data)

    monkeypatch.setattr(eio, "_write_all", full_at_the_report)
    with pytest.raises(
        UserError, match=r"data_report\.json: disk full \(No space left on device\)"
    ):
        run(load_config(_cfg(tmp_path, draft_vocab_size=3, seed=5)))
    assert {
        p.name: p.read_bytes() for p in out.iterdir()
    } == before  # no file replaced, no temp file left
    assert load_vocab_map(out / "vocab_map.pt")["d2t"].numel() == 4
    monkeypatch.setattr(eio, "_write_all", real)
    r = run(load_config(_cfg(tmp_path, draft_vocab_size=3, seed=5)), plot=False)
    assert load_vocab_map(out / "vocab_map.pt")["d2t"].numel() == 3 == r["draft_vocab_size"]
    assert sorted(p.name for p in out.iterdir()) == [
        "data_report.json",
        "data_report.md",
        "eagle3_manifest.json",
        "split.json",
        "token_freq.pt",
        "vocab_map.pt",
    ]  # the 4-id plot is gone


def test_identity_map_when_draft_equals_target(tmp_path):
    cfg = load_config(_cfg(tmp_path, draft_vocab_size=V))
    _make_shards(cfg.shards_dir)
    r = run(cfg, plot=False)
    m = load_vocab_map(cfg.data_dir / "vocab_map.pt")
    assert r["identity_vocab_map"] and r["coverage"] == 1.0
    assert m["d2t"].tolist() == [0] * V and bool(m["t2d"].all())


def test_draft_larger_than_target_is_config_error(tmp_path):
    cfg = load_config(_cfg(tmp_path, draft_vocab_size=V + 1))
    _make_shards(cfg.shards_dir)
    with pytest.raises(
        UserError, match=r"data.draft_vocab_size: 11 is larger than the verifier's vocab \(10"
    ):
        run(cfg)


def test_a_shard_set_without_samples_is_refused_by_list_samples(tmp_path):
    """03 reads the samples through ``list_samples(at_least_one=True)``: its one line, nothing written."""
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir, samples=[])
    with pytest.raises(UserError, match=rf"^{re.escape(str(cfg.shards_dir))}: no shards found$"):
        run(cfg)
    assert not (cfg.data_dir / "vocab_map.pt").exists()


def test_verifier_mismatch_refused(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir, verifier="another-model")
    with pytest.raises(
        UserError,
        match=r"data_config.json: verifier \(verifier.name / verifier.path\) 'another-model' -> 'tiny'; "
        r"re-run 02_extract_hidden.py$",
    ):
        run(cfg)


def test_shards_without_a_weights_fingerprint_are_said_not_silently_passed(
    tmp_path, tiny_llama_dir, caplog
):
    """Shards captured before 02 recorded ``verifier_weights`` were checked by name only, without a word, also when
    verifier.path holds weight files that could be compared: another model of the same shapes under the old name
    trained against its lm_head. 03 (and 04, 04 --export-only, through the same check) now says so in one warning
    line; with the fingerprint recorded, or no weight file on this machine (03 needs none), nothing is said."""
    import logging

    from eagle3.shards.checks import check_verifier
    from eagle3.verifier.load import weights_fingerprint

    cfg = load_config(_cfg(tmp_path), [f"verifier.path={tiny_llama_dir}"])
    _make_shards(cfg.shards_dir)
    dc = cfg.shards_dir / "data_config.json"
    want = (
        f"{dc}: records no verifier_weights: the weights at verifier.path "
        f"'{tiny_llama_dir}' were not checked against the model the shards were captured from, only the name "
        f"'tiny'; a verifier.path pointed at another model of the same shapes would train against its lm_head "
        f"without an error: check that it is the model 02 captured from, or re-run 02 to record its fingerprint"
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.prepare_data"):
        run(cfg)
    assert caplog.messages.count(want) == 1
    meta = json.loads(dc.read_text())
    assert (
        check_verifier(
            cfg.verifier, {**meta, "verifier_weights": weights_fingerprint(cfg.verifier)}, dc
        )
        is None
    )
    assert (
        check_verifier(load_config(_cfg(tmp_path)).verifier, meta, dc) is None
    )  # /nowhere: nothing to compare


def test_bad_shard_named_and_nothing_written(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    bad = cfg.shards_dir / "rows_2-4" / "data_3.pt"
    d = torch.load(bad, weights_only=True)
    d["hidden_states"][2][0, 0] = float("nan")
    torch.save(d, bad)
    with pytest.raises(UserError, match=r"data_3.pt: key 'hidden_states\[2\]': contains NaN/Inf"):
        run(cfg)
    assert not cfg.data_dir.exists() or not any(cfg.data_dir.iterdir())


def test_wrong_hidden_size_vs_data_config(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir, hidden_size=8, bytes_per_token=64)
    with pytest.raises(
        UserError, match=r"data_0.pt: key 'hidden_states\[0\]': hidden size 4, data_config says 8"
    ):
        run(cfg)


def test_sample_count_mismatch(tmp_path):
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    (cfg.shards_dir / "rows_4-6" / "data_4.pt").unlink()
    with pytest.raises(UserError, match="key 'num_samples' is 5 but the shards hold 4"):
        run(cfg)


def test_split_indices_properties():
    ids = list(range(100, 120))
    a = split_indices(ids, 0.25, 7)
    assert len(a["val"]) == 5 and len(a["train"]) == 15
    assert sorted(a["train"] + a["val"]) == ids and not set(a["train"]) & set(a["val"])
    assert split_indices(ids[::-1], 0.25, 7) == a  # depends on the id set, not the order
    assert split_indices(ids, 0.25, 8) != a
    assert split_indices([4, 5], 0.01, 0)["val"].__len__() == 1  # at least one val sample
    assert split_indices([4], 0.5, 0) == {"train": [4], "val": []}  # never all of them
    assert split_indices(ids, 0.0, 0)["val"] == []


def test_cli_missing_data_config_exits_2(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    import importlib

    from eagle3.cli import run_main

    cli = importlib.import_module("03_prepare_data")
    with pytest.raises(SystemExit) as e:
        run_main(cli.main, ["--config", str(_cfg(tmp_path))])
    assert e.value.code == 2
    assert "data_config.json: file not found" in capsys.readouterr().err


def test_train_subset_nested_seeded_and_val_unchanged(tmp_path):
    from eagle3.data.split import subset_train

    train = list(range(50, 90))
    a, b = subset_train(train, 10, 0), subset_train(train, 25, 0)
    assert len(a) == 10 and len(b) == 25 and a == sorted(a) and set(a) <= set(b) <= set(train)
    assert subset_train(train, 10, 1) != a and subset_train(train[::-1], 10, 0) == a
    assert subset_train(train, None, 0) == train and subset_train(train, 99, 0) == train
    # through 03: val identical to the full run's, train = the seeded subset of the full run's train
    _make_shards(load_config(_cfg(tmp_path)).shards_dir)
    full = run(load_config(_cfg(tmp_path)))
    split_full = json.loads((load_config(_cfg(tmp_path)).data_dir / "split.json").read_text())
    cfg = load_config(_cfg(tmp_path), overrides=["data.train_samples=2"])
    rep = run(cfg)
    split = json.loads((cfg.data_dir / "split.json").read_text())
    assert split["val"] == split_full["val"]
    assert (
        split["train"] == subset_train(split_full["train"], 2, cfg.data.seed)
        and len(split["train"]) == 2
    )
    assert rep["train_samples"] == 2 and rep["train_samples_available"] == full["train_samples"] > 2


def test_train_samples_above_the_split_is_warned(tmp_path, caplog):
    """data.train_samples larger than the training split used to take all of it in silence (a data-curve point
    then equals the next one); now one warning gives both numbers."""
    _make_shards(load_config(_cfg(tmp_path)).shards_dir)
    with caplog.at_level("WARNING", logger="eagle3.data.split"):
        rep = run(load_config(_cfg(tmp_path), overrides=["data.train_samples=99"]))
    warned = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("data.train_samples")
    ]
    assert warned == [
        f"data.train_samples: 99 asked, the training split holds {rep['train_samples']} (after the "
        "validation split and data.exclude_id_prefixes): all of them are used"
    ]


def _write_manifest(shards: Path, ids: list[str]) -> None:
    lines = [
        json.dumps({"idx": i, "id": sid, "num_tokens": len(SAMPLES[i][0])})
        for i, sid in enumerate(ids)
    ]
    (shards / "manifest.jsonl").write_text("\n".join(lines) + "\n")


def test_exclude_id_prefixes_drops_train_only(tmp_path):
    ids = ["staqc_sql_titles/1", "chat/2", "nl2bash/3", "chat/4", "math/5"]
    cfg_full = load_config(_cfg(tmp_path))
    _make_shards(cfg_full.shards_dir)
    _write_manifest(cfg_full.shards_dir, ids)
    full = run(cfg_full)
    split_full = json.loads((cfg_full.data_dir / "split.json").read_text())
    vocab_full = (cfg_full.data_dir / "vocab_map.pt").read_bytes()
    cfg = load_config(
        _cfg(tmp_path), overrides=["data.exclude_id_prefixes=[staqc_sql_titles/, nl2bash/]"]
    )
    rep = run(cfg)
    split = json.loads((cfg.data_dir / "split.json").read_text())
    want = [
        i for i in split_full["train"] if not ids[i].startswith(("staqc_sql_titles/", "nl2bash/"))
    ]
    assert split["train"] == want and split["val"] == split_full["val"]
    dropped = [i for i in split_full["train"] if i not in want]
    assert rep["excluded_by_id_prefix"] == {
        "staqc_sql_titles/": sum(ids[i].startswith("staqc_sql_titles/") for i in dropped),
        "nl2bash/": sum(ids[i].startswith("nl2bash/") for i in dropped),
    }
    assert (
        rep["train_samples"] == len(want)
        and rep["train_samples_available"] == full["train_samples"]
    )
    assert (
        cfg.data_dir / "vocab_map.pt"
    ).read_bytes() == vocab_full  # the draft vocab map is the whole set's


def test_a_prefix_that_matches_nothing_is_warned_with_the_ids_prefixes(tmp_path, caplog):
    """A typo in data.exclude_id_prefixes (wrong case) used to drop nothing in silence: now one warning names the
    prefix and the id prefixes that exist; a prefix that matches stays quiet."""
    cfg = load_config(_cfg(tmp_path), overrides=["data.exclude_id_prefixes=[Chat/, math/]"])
    _make_shards(cfg.shards_dir)
    _write_manifest(cfg.shards_dir, ["chat/1", "chat/2", "math/3", "chat/4", "math/5"])
    with caplog.at_level("WARNING", logger="eagle3.data.split"):
        rep = run(cfg)
    warned = [
        r.getMessage() for r in caplog.records if "matches no training sample" in r.getMessage()
    ]
    assert len(warned) == 1 and "'Chat/'" in warned[0] and "chat/, math/" in warned[0]
    assert rep["excluded_by_id_prefix"]["Chat/"] == 0 and rep["excluded_by_id_prefix"]["math/"] > 0


def test_exclude_id_prefixes_errors(tmp_path):
    cfg = load_config(_cfg(tmp_path), overrides=["data.exclude_id_prefixes=[x]"])
    _make_shards(cfg.shards_dir)
    with pytest.raises(UserError, match="manifest.jsonl is missing"):
        run(cfg)
    _write_manifest(cfg.shards_dir, ["x/1", "x/2", "x/3", "x/4", "x/5"])
    with pytest.raises(UserError, match="drops all"):
        run(cfg)


def _token_shards(root: Path, n: int, seed: int = 0) -> list[tuple[int, Path]]:
    """``n`` token-only samples (``eagle3-tokens-v1``: input_ids + loss_mask) with random lengths and masks."""
    from eagle3.shards.format import shard_path

    g = torch.Generator().manual_seed(seed)
    out = []
    for idx in range(n):
        L = int(torch.randint(1, 12, (1,), generator=g))
        ids = torch.randint(0, V, (L,), generator=g).tolist()
        mask = torch.randint(0, 2, (L,), generator=g).tolist()
        write_sample(root, idx, 8, ids, None, mask)
        out.append((idx, shard_path(root, idx, 8)))
    return out


def test_token_only_validation_in_processes_matches_threads(tmp_path, monkeypatch):
    """03's process path for large token-only sets yields the thread path's samples, in order, with the same
    counts, across several map_records windows; the first bad shard in order is the one raised."""
    import eagle3.capture.tokenize_pool as tp
    import eagle3.data.validate as pd
    import eagle3.shards.format as shard_format

    paths = _token_shards(tmp_path / "shards", 40)
    expect = {"tokens_only": True, "vocab_size": V}
    monkeypatch.setattr(tp, "available_cpus", lambda: 2)
    st_t = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 0}
    threaded = list(
        pd._validated_samples(paths, expect, st_t, {}, workers=2)
    )  # 40 < TOKEN_PROCESS_MIN
    monkeypatch.setattr(shard_format, "TOKEN_PROCESS_MIN", 1)
    monkeypatch.setattr(pd, "PROCESS_WINDOW", 16)  # windows of 16 + 16 + 8
    st_p = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "max_len": 0}
    procs = list(pd._validated_samples(paths, expect, st_p, {}, workers=2))
    loaded = [torch.load(p, weights_only=True) for _, p in paths]
    assert len(procs) == len(threaded) == 40
    for a, b, ref in zip(procs, threaded, loaded):
        assert torch.equal(a["input_ids"], ref["input_ids"]) and torch.equal(
            b["input_ids"], ref["input_ids"]
        )
        assert torch.equal(a["loss_mask"], ref["loss_mask"]) and a["input_ids"].dtype == torch.int64
    want = {
        "num_samples": 40,
        "num_tokens": sum(len(r["input_ids"]) for r in loaded),
        "num_loss_tokens": sum(int(r["loss_mask"].sum()) for r in loaded),
        "max_len": max(len(r["input_ids"]) for r in loaded),
    }
    assert st_p == st_t == want
    for bad in (21, 33):  # two bad shards in the second and third windows: the first is named
        d = torch.load(paths[bad][1], weights_only=True)
        d["loss_mask"][0] = 2
        torch.save(d, paths[bad][1])
    with pytest.raises(UserError, match=r"data_21\.pt: key 'loss_mask': values must be 0 or 1"):
        list(pd._validated_samples(paths, expect, dict.fromkeys(want, 0), {}, workers=2))


@pytest.mark.parametrize(
    "over, msg",
    [
        (["extract.aux_layers=[2, 3, 4]"], "extract.aux_layers [1, 3, 4] -> [2, 3, 4]"),
        (["extract.max_length=32"], "extract.max_length 16 -> 32"),
        (
            ["extract.aux_layers=null"],
            "extract.aux_layers [1, 3, 4] -> [2, 15, 27]",
        ),  # EAGLE default
        (  # the first differing field is named
            ["extract.aux_layers=[2, 3, 4]", "extract.max_length=32"],
            "extract.aux_layers [1, 3, 4] -> [2, 3, 4]",
        ),
    ],
)
def test_extract_settings_other_than_the_shards_refused(tmp_path, over, msg):
    cfg = load_config(_cfg(tmp_path), over)
    _make_shards(cfg.shards_dir, num_layers=30)
    with pytest.raises(UserError) as e:
        run(cfg)
    assert (
        str(e.value) == f"{cfg.shards_dir / 'data_config.json'}: {msg}; re-run 02_extract_hidden.py"
    )
    assert not cfg.data_dir.exists()  # nothing written


def test_extract_settings_equal_to_the_shards_or_unset_accepted(tmp_path):
    cfg = load_config(_cfg(tmp_path), ["extract.aux_layers=[1, 3, 4]", "extract.max_length=16"])
    _make_shards(cfg.shards_dir)
    assert run(cfg)["num_loss_tokens"] == 11
    cfg = load_config(_cfg(tmp_path))  # unset: the default max_length 2048 is not compared
    assert cfg.extract.max_length != 16 and run(cfg)["num_loss_tokens"] == 11


def test_a_deleted_or_stray_shard_is_named_with_the_fix(tmp_path):
    """A shard deleted after 02 made 03 say only `key 'num_samples' is 10 but the shards hold 9 (shards added or
    removed after stage 02?)` (fresh-user trial 2026-12-05d); now the missing samples are named with the fix (02's
    same command recaptures them), and a shard file the manifest does not hold is named too."""
    import shutil

    from _ddp_worker import make_tiny_run
    from test_validation_gate import _as_02_wrote

    from eagle3.config import load_config
    from eagle3.errors import UserError
    from eagle3.shards.format import list_samples
    from eagle3.stages import prepare_data

    path = make_tiny_run(tmp_path)
    cfg = load_config(path, _as_02_wrote(tmp_path))
    paths = dict(list_samples(cfg.shards_dir))
    gone = paths[3].read_bytes()
    paths[3].unlink()
    with pytest.raises(UserError) as e:
        prepare_data.run(cfg, plot=False)
    assert str(e.value) == (
        f"{cfg.shards_dir / 'data_config.json'}: key 'num_samples' is 10 but the shards hold 9 (1 "
        f"of the 10 shards in manifest.jsonl are missing: sample 3); re-run 02_extract_hidden.py "
        f"with the same command (without --overwrite) to recapture them, then 03"
    )
    paths[3].write_bytes(gone)
    stray = paths[4].parent / "data_40.pt"
    shutil.copy(paths[4], stray)
    with pytest.raises(UserError) as e:
        prepare_data.run(cfg, plot=False)
    assert str(e.value) == (
        f"{cfg.shards_dir / 'data_config.json'}: key 'num_samples' is 10 but the shards hold 11 (1 "
        f"shard files not in manifest.jsonl: sample 40, e.g. {stray}); remove them, or re-run "
        f"02_extract_hidden.py --overwrite"
    )
    stray.unlink()
    assert prepare_data.run(cfg, plot=False)["num_samples"] == 10


def test_shards_without_a_loss_token_are_refused(tmp_path):
    """A shard set with no loss-masked token (prompt-only conversations captured) is refused by 03 in one line; the
    check had become unreachable code after a refactor of its neighbour (review, session 2026-12-05d)."""
    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir, samples=[(ids, [0] * len(mask)) for ids, mask in SAMPLES])
    with pytest.raises(
        UserError, match=r"no loss-masked token in any shard \(no assistant replies\?\)"
    ):
        run(cfg)


def test_03_stops_while_02_is_writing_the_shards_and_not_for_a_dead_ones_lock(tmp_path):
    """03 did not look at 02's lock: run while 02 was still writing, it validated the half-written set and recorded a
    failed validation (trial 2026-12-05g). Now, while another process holds `shards/.extract.lock`, 03 stops with one
    line naming the lock and 02, writing nothing (no validation record, no data folder); the lock file a killed 02
    left (its flock released by the OS) does not stop it."""
    import signal
    import subprocess

    from eagle3.data.validation_record import VALIDATION_RECORD as RECORD

    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    lock = cfg.shards_dir / ".extract.lock"
    holder = subprocess.Popen(  # a 02 in flight: another process holding the flock
        [
            sys.executable,
            "-c",
            f"import fcntl, sys, time\nf = open({str(lock)!r}, 'a+')\n"
            f"fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as e:
            run(cfg, plot=False)
        assert str(e.value) == (
            f"{lock}: 02_extract_hidden is still writing the shards in {cfg.shards_dir} (it holds "
            f"this lock); wait for it to end, then run 03_prepare_data.py (a half-written shard set "
            f"would fail validation)"
        )
        assert not (cfg.shards_dir / RECORD).exists() and not cfg.data_dir.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.exists()  # what a killed 02 leaves: a file nobody holds
    report = run(cfg, plot=False)
    assert report["num_samples"] == len(SAMPLES) and (cfg.shards_dir / RECORD).is_file()


@pytest.mark.parametrize("meanwhile", ["02 holds its lock", "02 rewrote a shard"])
def test_03_rechecks_02_before_writing_its_outputs(tmp_path, monkeypatch, meanwhile):
    """03 looked at 02's lock only at its start: a 02 started on the same shards folder during 03's validation pass
    was not noticed, and 03 published a vocab map and split of a set 02 was changing. Before writing, 03 now checks the
    lock again and that the shard set is the one it read: one line, nothing in the data folder; a re-run on the
    finished set passes."""
    import fcntl
    import os

    import eagle3.data.validate as validate

    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    lock = cfg.shards_dir / ".extract.lock"
    real, held = validate.validate_all, []

    def a_02_starts_meanwhile(shards, meta, paths):
        out = real(shards, meta, paths)
        if (
            meanwhile == "02 holds its lock"
        ):  # another open file: its flock conflicts with 03's probe
            f = open(lock, "a+")
            fcntl.flock(f, fcntl.LOCK_EX)
            held.append(f)
        else:  # a 02 that ran and finished while 03 validated: a shard written again
            path = paths[0][1]
            path.write_bytes(path.read_bytes())
            os.utime(path, ns=(1, 1))
        return out

    monkeypatch.setattr(validate, "validate_all", a_02_starts_meanwhile)
    with pytest.raises(UserError) as e:
        run(cfg, plot=False)
    if held:
        assert str(e.value).startswith(
            f"{lock}: 02_extract_hidden is still writing the shards in {cfg.shards_dir} "
        )
        held[0].close()
    else:
        assert str(e.value) == (
            f"{cfg.shards_dir}: the shard set changed while 03_prepare_data read it (shards, "
            f"manifest.jsonl or data_config.json written since it started: a 02_extract_hidden run "
            f"there?); nothing written to {cfg.data_dir}; run 03_prepare_data.py again once 02 has "
            f"finished"
        )
    assert not any(cfg.data_dir.glob("*.pt")) and not (cfg.data_dir / "split.json").exists()
    monkeypatch.setattr(validate, "validate_all", real)
    assert run(cfg, plot=False)["num_samples"] == len(SAMPLES)
    assert (cfg.data_dir / "vocab_map.pt").is_file()


def test_a_full_disk_in_03_says_it_starts_over(tmp_path, monkeypatch):
    """03's disk-full line said "re-run the same command to resume", but a re-run of 03 starts over (trial
    2026-12-05g). It now says so; also for a disk-full OSError no writer of eagle3.io turned into a line (a library
    writing its own file): one line, the same wording."""
    import errno
    import os

    import eagle3.io as eio
    import eagle3.stages.prepare_data as prepare_data

    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir)
    real = eio._write_all

    def full_at_the_vocab_map(f, data):
        if "vocab_map" in str(getattr(f, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, data)

    monkeypatch.setattr(eio, "_write_all", full_at_the_vocab_map)
    with pytest.raises(UserError) as e:
        run(cfg, plot=False)
    msg = str(e.value)
    assert (
        msg.startswith(f"{cfg.data_dir / 'vocab_map.pt'}: disk full (No space left on device)")
        and "\n" not in msg
    )
    assert msg.endswith(
        "free space or move the output folder, then re-run the same command (03 does not resume: it "
        "starts over)"
    )
    monkeypatch.undo()

    def stray(*a, **k):  # a library's own writer on a full disk, inside 03
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(cfg.data_dir / "coverage.png"))

    monkeypatch.setattr(prepare_data, "prepare", stray)
    with pytest.raises(UserError) as e:
        run(cfg, plot=False)
    assert str(e.value).startswith(
        f"{cfg.data_dir / 'coverage.png'}: disk full (No space left on device)"
    )
    assert str(e.value).endswith("(03 does not resume: it starts over)")


def test_exclude_by_id_refusals_name_the_setting_and_the_fix(tmp_path):
    """``exclude_by_id`` refuses in one line: a manifest missing, one without a training sample's row, or
    prefixes that drop every training sample."""
    from eagle3.data.split import exclude_by_id

    man = tmp_path / "manifest.jsonl"
    with pytest.raises(UserError) as ei:
        exclude_by_id([0, 1], tmp_path, ["x/"])
    assert str(ei.value) == (
        f"data.exclude_id_prefixes: {man} is missing or empty (02 writes it), and the setting needs every "
        "sample's id; re-run 02_extract_hidden.py to complete it"
    )
    man.write_text('{"idx": 0, "id": "x/0", "num_tokens": 3}\n')
    with pytest.raises(UserError) as ei:
        exclude_by_id([0, 1], tmp_path, ["x/"])
    assert str(ei.value) == (
        f"data.exclude_id_prefixes: {man} has no row for sample 1, and the setting needs every sample's id; "
        "re-run 02_extract_hidden.py to complete it"
    )
    with pytest.raises(UserError) as ei:
        exclude_by_id([0], tmp_path, ["x/"])
    assert str(ei.value) == (
        f"data.exclude_id_prefixes: ['x/'] drops all 1 training samples of {tmp_path}"
    )
    assert exclude_by_id([0], tmp_path, ["y/"]) == ([0], {"y/": 0})
