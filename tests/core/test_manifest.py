"""eagle3.manifest: atomic write / read round trip, the one-line refusals of read() and require()."""

from __future__ import annotations

import json

import pytest

from eagle3 import manifest
from eagle3.errors import UserError
from eagle3.manifest import FILE, DataManifest, DrafterManifest, ShardsManifest


def _data(**over) -> DataManifest:
    fields = dict(
        shards_dir="/runs/a/shards",
        shards_fingerprint="ab" * 32,
        draft_vocab_size=24,
        val_fraction=0.05,
        seed=0,
        train_samples=None,
        exclude_id_prefixes=[],
    )
    return DataManifest.make(**{**fields, **over})


def test_write_read_round_trip(tmp_path):
    m = _data(exclude_id_prefixes=["p1"], train_samples=5)
    path = manifest.write(tmp_path, m)
    assert path == tmp_path / FILE
    assert json.loads(path.read_text())["written_by"] == "03_prepare_data.py"
    back = manifest.read(tmp_path, DataManifest)
    assert back.model_dump() == m.model_dump() and back.where == str(path)
    assert not list(tmp_path.glob("*.tmp-*"))  # atomic: no temporary file left


def test_read_refuses_a_missing_old_or_corrupt_manifest(tmp_path):
    with pytest.raises(UserError) as e:
        manifest.read(tmp_path, DataManifest)
    assert str(e.value) == (
        f"{tmp_path}: no {FILE} (not made by this version of 03_prepare_data.py); "
        f"re-run 03_prepare_data.py"
    )
    raw = json.loads(_data().model_dump_json())
    (tmp_path / FILE).write_text(json.dumps({**raw, "version": 0}))
    with pytest.raises(UserError) as e:
        manifest.read(tmp_path, DataManifest)
    assert str(e.value) == (
        f"{tmp_path / FILE}: written by 03_prepare_data.py version 0, this code reads 03_prepare_data.py "
        f"version 1; re-run 03_prepare_data.py"
    )
    (tmp_path / FILE).write_text(json.dumps({**raw, "seed": "x"}))
    with pytest.raises(
        UserError, match=r"field 'seed': Input should be a valid integer.*; re-run 03"
    ):
        manifest.read(tmp_path, DataManifest)
    (tmp_path / FILE).write_text("{")
    with pytest.raises(UserError, match=FILE):
        manifest.read(tmp_path, DataManifest)


def test_read_and_of_record_refuse_through_one_owner_each_naming_field_or_key(tmp_path):
    """A manifest file names a bad ``field``, a stage's own record a bad ``key``; both say ``not a JSON object``."""
    path = tmp_path / FILE
    path.write_text("[1]")
    with pytest.raises(UserError) as e:
        manifest.read(tmp_path, DataManifest)
    assert str(e.value) == f"{path}: not a JSON object; re-run 03_prepare_data.py"
    raw = json.loads(_data().model_dump_json())
    path.write_text(json.dumps({**raw, "extra": 1}))
    with pytest.raises(UserError) as e:
        manifest.read(tmp_path, DataManifest)
    assert str(e.value) == (
        f"{path}: field 'extra': Extra inputs are not permitted; re-run 03_prepare_data.py"
    )
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "written_by"}))
    with pytest.raises(UserError) as e:
        manifest.read(tmp_path, DataManifest)
    assert str(e.value) == (
        f"{path}: written by None version 1, this code reads 03_prepare_data.py version 1; "
        f"re-run 03_prepare_data.py"
    )
    with pytest.raises(UserError) as e:
        DataManifest.of_record({**raw, "seed": "x"}, "rec.json")
    assert str(e.value).startswith("rec.json: key 'seed': Input should be a valid integer")
    assert str(e.value).endswith("; re-run 03_prepare_data.py")
    with pytest.raises(UserError) as e:
        DataManifest.of_record([raw], "rec.json")
    assert str(e.value) == "rec.json: not a JSON object; re-run 03_prepare_data.py"


def test_require_names_the_first_differing_field_old_and_new(tmp_path):
    manifest.write(tmp_path, _data())
    found = manifest.read(tmp_path, DataManifest)
    manifest.require(found, {"seed": 0, "draft_vocab_size": 24}, "03_prepare_data.py")
    with pytest.raises(UserError) as e:
        manifest.require(
            found, {"draft_vocab_size": 24, "seed": 3, "train_samples": 7}, "03_prepare_data.py"
        )
    assert str(e.value) == (f"{tmp_path / FILE}: data.seed 0 -> 3; re-run 03_prepare_data.py")
    with pytest.raises(UserError, match=r"^03_prepare_data.py's eagle3_manifest.json: data.ex"):
        manifest.require(_data(), {"exclude_id_prefixes": ["p"]}, "03_prepare_data.py")


def test_differing_lists_every_differing_field_in_order_less_the_tolerated():
    found = _data()
    needed = {"seed": 3, "draft_vocab_size": 24, "val_fraction": 0.1, "train_samples": 7}
    assert manifest.differing(found, needed) == ["seed", "val_fraction", "train_samples"]
    assert manifest.differing(
        found, needed, tolerate=lambda name, old, now: old is None or name == "seed"
    ) == ["val_fraction"]


def test_shards_manifest_of_a_data_config_record(tmp_path):
    """02's data_config.json read as ShardsManifest: other keys ignored, absent ones None, a bad type one line."""
    where = tmp_path / "data_config.json"
    found = ShardsManifest.of_record({"verifier": "m", "aux_layers": [1, 2], "format": "x"}, where)
    assert (found.verifier, found.aux_layers, found.max_length) == ("m", [1, 2], None)
    manifest.require(found, {"aux_layers": [1, 2]}, found.STAGE)
    with pytest.raises(UserError) as e:
        manifest.require(found, {"verifier": "n"}, found.STAGE)
    assert str(e.value) == (
        f"{where}: verifier (verifier.name / verifier.path) 'm' -> 'n'; re-run 02_extract_hidden.py"
    )
    with pytest.raises(
        UserError, match=r"data_config.json: key 'verifier': Field required; re-run 02"
    ):
        ShardsManifest.of_record({"aux_layers": [1]}, where)


def test_drafter_manifest_of_an_export_folder(tmp_path):
    """04's eagle3_train.json read as DrafterManifest: none for a folder without one (a drafter exported elsewhere),
    the older key ``aux_layers`` read as ``aux_layers_hf``, other keys ignored, a bad value one line naming the key
    and the stage that writes the file."""
    assert DrafterManifest.of_folder(tmp_path) is None
    meta = tmp_path / "eagle3_train.json"
    meta.write_text(
        json.dumps({"aux_layers": [2, 3, 4], "verifier": {"name": "m", "num_layers": 6}, "x": 1})
    )
    found = DrafterManifest.of_folder(tmp_path)
    assert (found.aux_layers_hf, found.ttt_length, found.where) == ([2, 3, 4], None, str(meta))
    assert (found.verifier.name, found.verifier.num_layers, found.verifier.weights) == (
        "m",
        6,
        None,
    )
    manifest.require(found, {"aux_layers_hf": [2, 3, 4]}, found.STAGE)
    meta.write_text(json.dumps({"aux_layers_hf": [2, 3, 4], "ttt_length": 7}))
    with pytest.raises(UserError) as e:
        manifest.require(DrafterManifest.of_folder(tmp_path), {"ttt_length": 5}, "04_train.py")
    assert str(e.value) == f"{meta}: ttt_length (train.ttt_length) 7 -> 5; re-run 04_train.py"
    for bad, key in (
        ({"aux_layers_hf": [2, 3]}, "aux_layers_hf"),
        ({"ttt_length": True}, "ttt_length"),
        ({"verifier": {"num_layers": "6"}}, "verifier.num_layers"),
    ):
        meta.write_text(json.dumps(bad))
        with pytest.raises(UserError) as e:
            DrafterManifest.of_folder(tmp_path)
        assert str(e.value).startswith(f"{meta}: key '{key}': ")
        assert str(e.value).endswith("; re-run 04_train.py --export-only")
    meta.write_text("[1, 2]")
    with pytest.raises(UserError) as e:
        DrafterManifest.of_folder(tmp_path)
    assert str(e.value) == f"{meta}: not a JSON object; re-run 04_train.py --export-only"


def test_prompts_manifest_compares_conditional_keys_only_when_both_record_them(tmp_path):
    """01's settings: ``seed`` / ``verifier_weights`` (and the other CONDITIONAL keys) recorded on one side only are not
    compared; one ``source`` and a ``sources`` list read as one list; require names a changed file, not its hash."""
    base = dict(format="auto", sample_size=None, dedupe=True, system_prompt=None, regenerate=False)
    base |= dict(limit=None, source="a.jsonl", bytes=3, sha256="aa" * 32)
    rep = tmp_path / "prompts_report.json"
    old = manifest.PromptsManifest.of_record({**base, "seed": 0, "verifier_weights": "w1"}, rep)
    now = manifest.PromptsManifest.make(**base)
    assert old.source == [{"source": "a.jsonl", "bytes": 3, "sha256": "aa" * 32}]
    assert old.changed(now) == []  # seed and weights recorded on one side only
    assert old.changed(manifest.PromptsManifest.make(**base, seed=1, verifier_weights="w2")) == [
        "seed",
        "verifier_weights",
    ]
    listed = {k: v for k, v in base.items() if k not in ("source", "bytes", "sha256")}
    listed["sources"] = [{"source": "a.jsonl", "bytes": 4, "sha256": "bb" * 32}]
    edited = manifest.PromptsManifest.make(**listed)
    assert old.changed(edited) == ["source"]
    with pytest.raises(UserError) as e:
        manifest.require(old, {"source": edited.source}, "01_prepare_prompts.py")
    assert str(e.value) == f"{rep}: the content of a.jsonl changed; re-run 01_prepare_prompts.py"
    with pytest.raises(UserError) as e:
        manifest.require(old, {"dedupe": False}, "01_prepare_prompts.py")
    assert str(e.value) == f"{rep}: prompts.dedupe True -> False; re-run 01_prepare_prompts.py"
    with pytest.raises(UserError) as e:
        manifest.PromptsManifest.of_record({**base, "dedupe": "maybe"}, rep)
    assert str(e.value).startswith(f"{rep}: key 'dedupe': Input should be a valid boolean")
