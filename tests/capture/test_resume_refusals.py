"""capture.resume.foreign_shards owns 'the shards in the folder are this run's to resume': check_state raises its
one line (no extract_state.json; other settings; other verifier weights), and resumes a folder of this run's."""

from __future__ import annotations

import json

import pytest

from eagle3.capture.folder import STATE
from eagle3.capture.resume import check_state, foreign_shards
from eagle3.errors import UserError

FP, COMP = "f" * 64, {"extract": {"max_length": 4096}, "prompts_sha256": "a" * 64}
WEIGHTS = {"verifier_weights": "w1"}


@pytest.fixture()
def root(tmp_path):
    root = tmp_path / "shards"
    (root / "rows_00000").mkdir(parents=True)  # a shard folder: the root holds shards
    return root


def test_shards_without_a_state_file(root):
    with pytest.raises(UserError) as e:
        check_state(root, FP, COMP, False, WEIGHTS)
    assert str(e.value) == (
        f"{root}: holds shards but no {STATE} (unknown provenance); re-run with --overwrite to delete them, or "
        "set extract.output_dir to another folder to keep them"
    )
    assert not (root / STATE).exists()  # nothing written


def test_shards_of_other_settings_or_weights(root):
    (root / STATE).write_text(
        json.dumps(
            {"fingerprint": "0" * 64, "components": {**COMP, "extract": {"max_length": 2048}}}
        )
    )
    tail = (
        "; re-run with --overwrite to delete them and start over, or set extract.output_dir to another folder "
        "to keep them (another run may read them)"
    )
    head = f"{root / STATE}: the shards in {root} were extracted with other settings: changed "
    with pytest.raises(UserError) as e:
        check_state(root, FP, COMP, False, WEIGHTS)
    assert str(e.value) == head + "extract.max_length: 2048 -> 4096" + tail
    (root / STATE).write_text(
        json.dumps({"fingerprint": FP, "components": COMP, "verifier_weights": "w0"})
    )
    with pytest.raises(UserError) as e:
        check_state(root, FP, COMP, False, WEIGHTS)
    assert str(e.value) == (
        head + "the weights at verifier.path (verifier_weights: w0 -> w1)" + tail
    )
    assert json.loads((root / STATE).read_text())["verifier_weights"] == "w0"  # kept as it was


def test_this_runs_shards_resume(root):
    (root / STATE).write_text(json.dumps({"fingerprint": FP, "components": COMP, **WEIGHTS}))
    assert foreign_shards(root, FP, COMP, WEIGHTS) is None
    check_state(root, FP, COMP, False, WEIGHTS)
    assert json.loads((root / STATE).read_text())["fingerprint"] == FP


def _folder(tmp_path, shards: dict[int, str], rows: dict[int, str]):
    """A shards folder with a shard file per ``shards`` idx (at the given place under the root) and a manifest of
    ``rows`` (idx -> recorded prompt id); returns ``(root, manifest path)``."""
    from eagle3.shards.manifest import rewrite_manifest

    root = tmp_path / "shards"
    for idx, where in shards.items():
        (root / where).mkdir(parents=True, exist_ok=True)
        (root / where / f"data_{idx}.pt").write_bytes(b"x")
    man = root / "manifest.jsonl"
    rewrite_manifest(man, {i: {"idx": i, "id": cid, "num_tokens": 2} for i, cid in rows.items()})
    return root, man


def _samples(n: int):
    from eagle3.capture.prompts import Sample

    return [Sample(i, f"p{i}", [1, 2], [0, 1]) for i in range(n)]


def test_a_resumed_row_of_another_prompt_or_place_is_refused_in_its_own_words(tmp_path):
    """capture.resume.foreign_row owns 'a finished row is this run's sample': its recorded prompt id and its shard's
    place (rows_per_dir); resume_state raises its line and leaves the manifest as it was."""
    from eagle3.capture.resume import resume_state

    root, man = _folder(tmp_path, {0: "rows_0-4", 1: "rows_0-4"}, {0: "p0", 1: "other"})
    before = man.read_text()
    with pytest.raises(UserError) as e:
        resume_state(root, _samples(2), 4, {}, man)
    assert str(e.value) == (
        f"{man}: sample 1 is recorded as prompt 'other' but the prompts file gives 'p1'; re-run with --overwrite"
    )
    assert man.read_text() == before
    root, man = _folder(tmp_path / "b", {0: "rows_0-2", 1: "rows_0-2"}, {0: "p0", 1: "p1"})
    with pytest.raises(UserError) as e:
        resume_state(root, _samples(2), 4, {}, man)
    assert str(e.value) == (
        f"{root / 'rows_0-2' / 'data_0.pt'}: sample 0 is not at {root / 'rows_0-4' / 'data_0.pt'}; "
        "re-run with --overwrite"
    )
    assert resume_state(root, _samples(2), 2, {}, man) == {
        i: {"idx": i, "id": f"p{i}", "num_tokens": 2} for i in range(2)
    }
    # a row outside this run's samples (an earlier run without --limit) is kept, whatever it records
    root, man = _folder(tmp_path / "c", {0: "rows_0-4", 5: "rows_4-8"}, {0: "p0", 5: "x"})
    assert set(resume_state(root, _samples(1), 4, {}, man)) == {0, 5}
