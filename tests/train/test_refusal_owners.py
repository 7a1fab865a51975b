"""The functions that own a refusal shared by two callers say it the same way for each (issue 50)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3.errors import UserError
from eagle3.train.inputs import head_problem
from eagle3.train.warm_start import init_drafter, require_verifier_width


def _head(vocab: int, hidden: int, post: bool):
    return SimpleNamespace(vocab_size=vocab, hidden_size=hidden, last_is_post_norm=post)


def test_head_problem_names_the_shape_then_the_norm():
    dc = {"vocab_size": 40, "hidden_size": 16, "last_hidden_state": "post_norm"}
    assert head_problem(_head(40, 16, True), dc) is None
    assert head_problem(_head(40, 8, False), dc) == (
        "head is [40, 8] but data_config.json says vocab_size 40, hidden_size 16"
    )
    assert head_problem(_head(40, 16, False), dc) == (
        "metadata 'last_is_post_norm' is False but data_config.json says last_hidden_state='post_norm'"
    )


def test_verifier_width_refusal_names_the_source_when_given():
    require_verifier_width(16, 16)
    with pytest.raises(UserError) as e:
        require_verifier_width(32, 16, "s/data_config.json")
    assert str(e.value) == (
        "drafter.hidden_size: 32 differs from the verifier hidden size 16 (s/data_config.json); the drafter "
        "reuses the verifier's token embedding: set drafter.hidden_size: 16 (or null, the verifier's)"
    )
    head = SimpleNamespace(embed=torch.zeros(40, 16))
    with pytest.raises(UserError) as e:
        init_drafter(SimpleNamespace(hidden_size=32), head, {}, seed=0)
    assert str(e.value) == (
        "drafter.hidden_size: 32 differs from the verifier hidden size 16; the drafter reuses the verifier's "
        "token embedding: set drafter.hidden_size: 16 (or null, the verifier's)"
    )


def test_best_file_that_does_not_load_is_one_line_with_the_fix(tmp_path):
    from torch import nn

    from eagle3.train.sim_accept import _load_best_into

    drafter, path = nn.Linear(4, 2), tmp_path / "best_drafter.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(UserError) as e:
        _load_best_into(path, drafter, "delete the file and re-run")
    assert str(e.value) == f"{path}: key 'step' missing; delete the file and re-run"
    torch.save({"step": 3, "model": {"weight": torch.zeros(2, 5)}}, path)
    with pytest.raises(UserError) as e:
        _load_best_into(path, drafter, "delete the file and re-run")
    assert (
        str(e.value)
        == f"{path}: tensor 'weight' does not fit the drafter; delete the file and re-run"
    )
    torch.save({"step": 3, "model": {"weight": torch.ones(2, 4)}}, path)
    assert _load_best_into(path, drafter, "x") == 3 and bool((drafter.weight == 1).all())


def test_curve_without_rows_is_refused_on_resume(tmp_path):
    from eagle3.train.sim_accept import CURVE_FILE, BestTracker

    (tmp_path / CURVE_FILE).write_text('{"chain": 3}')
    with pytest.raises(UserError) as e:
        BestTracker(tmp_path, chain=3, enabled=True, start_step=4)
    assert str(e.value) == (
        f"{tmp_path / CURVE_FILE}: key 'rows' missing (delete the file to start the curve again)"
    )


def test_hidden_states_without_their_source_are_refused_naming_the_fix(tmp_path):
    from eagle3.shards.data_config import FORMAT_TOKENS
    from eagle3.train.online import check_hidden_states

    ex = SimpleNamespace(backend="sglang", sglang_url=None, capture_dir=None)
    tokens = {"format": FORMAT_TOKENS}
    check_hidden_states("online", SimpleNamespace(backend="hf"), tmp_path, tokens)
    with pytest.raises(UserError) as e:
        check_hidden_states("offline", ex, tmp_path, tokens)
    assert str(e.value) == (
        f"{tmp_path / 'data_config.json'}: key 'format' is {FORMAT_TOKENS!r} (token-only samples, no hidden "
        "states); set train.hidden_states: online, or re-run 02 with offline"
    )
    with pytest.raises(UserError, match=r"^extract.sglang_url / extract.capture_dir: required for"):
        check_hidden_states("online", ex, None, tokens)


def test_export_of_a_best_file_the_curve_does_not_name_is_one_line_and_copies_nothing(tmp_path):
    """``_load_best_into(curve=...)`` owns every refusal of ``best_drafter.pt`` at ``04 --export-only``: not the
    curve's best step, or unreadable; each followed by the fix, the drafter left as it was."""
    import json

    from torch import nn

    from eagle3.train.sim_accept import BEST_FILE, CURVE_FILE, load_best_for_export

    drafter, path, curve = nn.Linear(4, 2), tmp_path / BEST_FILE, tmp_path / CURVE_FILE
    before = drafter.weight.detach().clone()
    torch.save({"step": 5, "model": {"weight": torch.ones(2, 4)}}, path)
    curve.write_text(json.dumps({"best": {"step": 10, "alpha": [0.5]}, "rows": []}))
    fix = "set train.select_best=last to export the checkpoint (step 7) instead"
    with pytest.raises(UserError) as e:
        load_best_for_export(tmp_path, drafter, 7)
    assert str(e.value) == (
        f"{path}: holds the weights of step 5, but {curve} names step 10 as the best; {fix}"
    )
    assert torch.equal(drafter.weight, before)
    path.write_bytes(b"not a torch file")
    with pytest.raises(UserError) as e:
        load_best_for_export(tmp_path, drafter, 7)
    assert str(e.value).startswith(str(path)) and str(e.value).endswith(f"; {fix}")
    torch.save({"step": 10, "model": {"weight": torch.ones(2, 4)}}, path)
    assert load_best_for_export(tmp_path, drafter, 7) == (10, None)
    assert bool((drafter.weight == 1).all())
