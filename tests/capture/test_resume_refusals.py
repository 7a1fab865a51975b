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
