"""Draft vocab: frequency counting, d2t/t2d on hand-made tables, coverage, vocab_map.pt checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import eagle3.data.vocab as vocab
from eagle3.data.vocab import (
    build_vocab_map,
    count_token_freq,
    coverage,
    load_vocab_map,
    save_vocab_map,
)
from eagle3.errors import UserError


def test_count_token_freq_hand_computed():
    samples = [
        {"input_ids": torch.tensor([1, 2, 2, 3]), "loss_mask": torch.tensor([0, 1, 1, 1])},
        (torch.tensor([3, 3, 0]), torch.tensor([1, 0, 1])),
    ]
    # masked ids: 2, 2, 3 | 3, 0  -> counts id0:1 id1:0 id2:2 id3:2 id4:0
    assert count_token_freq(samples, 5).tolist() == [1, 0, 2, 2, 0]


def test_count_token_freq_matches_counter_reference(monkeypatch):
    monkeypatch.setattr(vocab, "_FLUSH_TOKENS", 50)  # force several bincount flushes
    g = torch.Generator().manual_seed(1)
    samples = []
    ref = Counter()
    for _ in range(20):
        L = int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(0, 30, (L,), generator=g)
        mask = torch.randint(0, 2, (L,), generator=g)
        samples.append({"input_ids": ids, "loss_mask": mask})
        ref.update(int(t) for t, m in zip(ids, mask) if m)
    freq = count_token_freq(iter(samples), 30)
    assert freq.dtype == torch.int64
    assert freq.tolist() == [ref.get(i, 0) for i in range(30)]


def test_count_token_freq_out_of_range():
    with pytest.raises(ValueError, match="token id 7 outside 0..4"):
        count_token_freq([(torch.tensor([7]), torch.tensor([1]))], 5)


def test_build_vocab_map_hand_made_table():
    freq = torch.tensor([5, 0, 7, 7, 1, 3, 7, 2])
    d2t, t2d = build_vocab_map(freq, 4)
    # top 4: ids 2, 3, 6 (count 7) and 0 (count 5) -> sorted [0, 2, 3, 6]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [0, 1, 1, 3]
    assert t2d.dtype == torch.bool and t2d.tolist() == [
        True,
        False,
        True,
        True,
        False,
        False,
        True,
        False,
    ]
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 3, 6]  # target id of each draft id
    assert coverage(freq, t2d) == pytest.approx(26 / 32)


def test_build_vocab_map_ties_lower_id_wins():
    freq = torch.tensor([5, 0, 7, 7, 1, 3, 7, 2])
    d2t, t2d = build_vocab_map(freq, 2)
    assert d2t.tolist() == [2, 2]  # ids 2 and 3 (tie among 2, 3, 6)
    assert t2d.nonzero().flatten().tolist() == [2, 3]
    d2t, _ = build_vocab_map(torch.zeros(6, dtype=torch.int64), 3)  # all tied -> lowest ids
    assert d2t.tolist() == [0, 0, 0]


def test_identity_when_target_vocab_fits():
    freq = torch.tensor([3, 0, 1])
    d2t, t2d = build_vocab_map(freq, 3)
    assert d2t.tolist() == [0, 0, 0] and t2d.tolist() == [True, True, True]
    d2t, t2d = build_vocab_map(freq, 10)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()
    assert coverage(freq, t2d) == 1.0


def test_coverage_errors():
    with pytest.raises(ValueError, match="no tokens"):
        coverage(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool))


def test_vocab_map_save_load_and_size_check(tmp_path):
    d2t, t2d = build_vocab_map(torch.tensor([5, 0, 7, 7, 1, 3, 7, 2]), 4)
    p = save_vocab_map(tmp_path / "vocab_map.pt", d2t, t2d)
    m = load_vocab_map(p, target_vocab_size=8, draft_vocab_size=4)
    assert torch.equal(m["d2t"], d2t) and torch.equal(m["t2d"], t2d)
    assert (m["target_vocab_size"], m["draft_vocab_size"]) == (8, 4)
    with pytest.raises(UserError, match="map built for a target vocab of 8, this verifier has 9"):
        load_vocab_map(p, target_vocab_size=9)
    with pytest.raises(UserError, match="key 'draft_vocab_size'"):
        load_vocab_map(p, draft_vocab_size=5)
    bad_t2d = t2d.clone()
    bad_t2d[1] = True
    torch.save({"d2t": d2t, "t2d": bad_t2d, "target_vocab_size": 8, "draft_vocab_size": 4}, p)
    with pytest.raises(UserError, match="key 't2d'"):
        load_vocab_map(p)
    torch.save(
        {
            "d2t": torch.tensor([0, 0, -1, 0]),
            "t2d": t2d,
            "target_vocab_size": 8,
            "draft_vocab_size": 4,
        },
        p,
    )
    with pytest.raises(UserError, match="draft ids 1 and 2 both map to target id 1"):
        load_vocab_map(p)
