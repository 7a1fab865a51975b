"""Shard format: round trips (nested + flat speculators layout), validation errors, manifest."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3.errors import UserError
from eagle3.io import remove_stale_tmp
from eagle3.shards.data_config import expect_from_data_config, read_data_config, write_data_config
from eagle3.shards.format import LAYER_INDEX_CONVENTION, list_samples, shard_path
from eagle3.shards.manifest import ManifestWriter, read_manifest, rewrite_manifest
from eagle3.shards.read import load_sample
from eagle3.shards.write import write_sample

H = 8


def _sample(L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (L,), generator=g)  # [L]
    hs = [torch.randn(L, H, generator=g) for _ in range(4)]  # 4 x [L, H]
    mask = (torch.arange(L) % 2).tolist()  # [L]
    return ids, hs, mask


def _meta(**kw):
    meta = {
        "format": "speculators-v1",
        "verifier": "tiny",
        "architecture": "LlamaForCausalLM",
        "num_layers": 6,
        "hidden_size": H,
        "vocab_size": 100,
        "aux_layers": [2, 3, 4],
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": "post_norm",
        "dtype": "bfloat16",
        "max_length": 64,
        "rows_per_dir": 2,
        "chat_template_hash": None,
        "config_fingerprint": "f",
        "prompts_sha256": "p",
        "num_samples": 1,
        "num_tokens": 5,
        "num_loss_tokens": 2,
        "bytes_per_token": 4 * H * 2,
        "skipped": {},
    }
    meta.update(kw)
    return meta


def test_shard_path_layout(tmp_path):
    assert shard_path(tmp_path, 0, 2000) == tmp_path / "rows_0-2000" / "data_0.pt"
    assert shard_path(tmp_path, 1999, 2000) == tmp_path / "rows_0-2000" / "data_1999.pt"
    assert shard_path(tmp_path, 2000, 2000) == tmp_path / "rows_2000-4000" / "data_2000.pt"
    assert shard_path(tmp_path, 7, 3) == tmp_path / "rows_6-9" / "data_7.pt"


def test_round_trip_nested(tmp_path):
    written = {}
    for idx, L in [(0, 5), (1, 3), (4, 7)]:
        ids, hs, mask = _sample(L, seed=idx)
        p = write_sample(tmp_path, idx, 2, ids, hs, mask)
        written[idx] = (p, ids, hs, mask)
    (tmp_path / "rows_0-2" / "data_9.pt.tmp-abc").write_bytes(b"junk")  # unfinished write: ignored
    listed = list_samples(tmp_path)
    assert [i for i, _ in listed] == [0, 1, 4]
    assert listed[2][1] == tmp_path / "rows_4-6" / "data_4.pt"
    for idx, path in listed:
        _, ids, hs, mask = written[idx]
        s = load_sample(path, expect={"hidden_size": H, "num_hidden_states": 4, "vocab_size": 100})
        assert s["input_ids"].dtype == torch.int64 and torch.equal(s["input_ids"], ids)
        assert s["loss_mask"].tolist() == mask
        assert len(s["hidden_states"]) == 4
        for a, b in zip(s["hidden_states"], hs):
            assert a.dtype == torch.bfloat16
            assert torch.equal(a, b.to(torch.bfloat16))
    assert remove_stale_tmp(tmp_path) == [tmp_path / "rows_0-2" / "data_9.pt.tmp-abc"]
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_round_trip_flat_speculators_layout(tmp_path):
    # vLLM speculators writes data_{idx}.pt straight into one folder.
    ids, hs, mask = _sample(4)
    torch.save(
        {
            "input_ids": ids,
            "hidden_states": [h.to(torch.bfloat16) for h in hs],
            "loss_mask": torch.tensor(mask),
        },
        tmp_path / "data_3.pt",
    )
    torch.save(
        {
            "input_ids": ids[:2],
            "hidden_states": [h[:2].to(torch.bfloat16) for h in hs],
            "loss_mask": torch.tensor(mask[:2]),
        },
        tmp_path / "data_10.pt",
    )
    listed = list_samples(tmp_path)
    assert listed == [(3, tmp_path / "data_3.pt"), (10, tmp_path / "data_10.pt")]
    s = load_sample(listed[1][1])
    assert s["input_ids"].tolist() == ids[:2].tolist()


def test_duplicate_idx_refused(tmp_path):
    ids, hs, mask = _sample(3)
    write_sample(tmp_path, 1, 2, ids, hs, mask)
    torch.save({"input_ids": ids}, tmp_path / "data_1.pt")
    with pytest.raises(UserError, match="sample 1 also stored"):
        list_samples(tmp_path)


def test_views_do_not_store_padded_batch(tmp_path):
    big = torch.randn(1000, H)  # a padded batch; the sample is its first 3 rows
    ids, _, mask = _sample(3)
    p = write_sample(tmp_path, 0, 10, ids, [big[:3]] * 4, mask)
    # 4 x 3 x 8 bf16 = 192 bytes of data; the full batch in bf16 would be 16000 bytes.
    assert p.stat().st_size < 4000


def _write_raw(tmp_path, obj, name="data_0.pt"):
    p = tmp_path / name
    torch.save(obj, p)
    return p


def _good(L=4):
    ids, hs, mask = _sample(L)
    return {
        "input_ids": ids,
        "hidden_states": [h.to(torch.bfloat16) for h in hs],
        "loss_mask": torch.tensor(mask),
    }


@pytest.mark.parametrize(
    "mutate, expect, match",
    [
        (lambda d: d.pop("loss_mask"), None, "key 'loss_mask': missing"),
        (lambda d: d.pop("hidden_states"), None, "key 'hidden_states': missing"),
        (
            lambda d: d.__setitem__("input_ids", d["input_ids"].int()),
            None,
            "key 'input_ids': dtype torch.int32",
        ),
        (
            lambda d: d["hidden_states"].__setitem__(1, d["hidden_states"][1].float()),
            None,
            r"key 'hidden_states\[1\]': dtype torch.float32",
        ),
        (
            lambda d: d["hidden_states"][2].__setitem__((1, 3), float("nan")),
            None,
            r"'hidden_states\[2\]': contains NaN/Inf",
        ),
        (
            lambda d: d["hidden_states"][0].__setitem__((0, 0), float("inf")),
            None,
            r"'hidden_states\[0\]': contains NaN/Inf",
        ),
        (
            lambda d: d.__setitem__("loss_mask", d["loss_mask"][:-1]),
            None,
            "key 'loss_mask': length 3 != input_ids length 4",
        ),
        (
            lambda d: d["hidden_states"].__setitem__(3, d["hidden_states"][3][:2]),
            None,
            r"'hidden_states\[3\]': shape \(2, 8\)",
        ),
        (
            lambda d: None,
            {"hidden_size": 16},
            r"'hidden_states\[0\]': hidden size 8, data_config says 16",
        ),
        (lambda d: d["hidden_states"].pop(), None, "key 'hidden_states': 3 tensors, expected 4"),
        (lambda d: None, {"num_hidden_states": 5}, "key 'hidden_states': 4 tensors, expected 5"),
        (
            lambda d: d.__setitem__("loss_mask", torch.full((4,), 2)),
            None,
            "key 'loss_mask': values must be 0 or 1",
        ),
        (
            lambda d: d["input_ids"].__setitem__(0, 100),
            {"vocab_size": 100},
            "key 'input_ids': token id 100 >= vocab_size 100",
        ),
        (
            lambda d: d.__setitem__("hidden_states", torch.zeros(4, 4, H)),
            None,
            "expected a list of tensors",
        ),
    ],
)
def test_validation_errors_name_file_and_key(tmp_path, mutate, expect, match):
    d = _good()
    mutate(d)
    p = _write_raw(tmp_path, d)
    with pytest.raises(UserError, match=match) as ei:
        load_sample(p, expect=expect)
    assert str(p) in str(ei.value)
    assert "\n" not in str(ei.value)


def test_not_a_dict(tmp_path):
    p = _write_raw(tmp_path, [torch.zeros(2)])
    with pytest.raises(UserError, match="not a speculators shard"):
        load_sample(p)


def test_truncated_file_refused(tmp_path):
    ids, hs, mask = _sample(6)
    p = write_sample(tmp_path, 0, 2, ids, hs, mask)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated or corrupt") as ei:
        load_sample(p)
    assert str(p) in str(ei.value)


class _Evil:
    """Unpickling this runs os.system: the weights-only loader must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_refused(tmp_path):
    marker = tmp_path / "pwned"
    d = _good()
    d["input_ids"] = _Evil(marker)
    p = _write_raw(tmp_path, d)
    with pytest.raises(UserError, match="refused by the weights-only loader"):
        load_sample(p)
    assert not marker.exists()


def test_data_config_round_trip_and_errors(tmp_path):
    meta = _meta()
    write_data_config(tmp_path, meta)
    back = read_data_config(tmp_path)
    assert back == meta
    assert expect_from_data_config(back) == {
        "hidden_size": H,
        "num_hidden_states": 4,
        "vocab_size": 100,
        "storage_dtype": "bfloat16",
        "aux_layers": [2, 3, 4],
    }
    bad = dict(meta)
    del bad["hidden_size"]
    (tmp_path / "data_config.json").write_text(__import__("json").dumps(bad))
    with pytest.raises(
        UserError,
        match="data_config.json: field 'hidden_size' is missing; 02_extract_hidden.py writes it",
    ):
        read_data_config(tmp_path)
    (tmp_path / "data_config.json").write_text(
        __import__("json").dumps(_meta(last_hidden_state="weird"))
    )
    with pytest.raises(
        UserError,
        match="field 'last_hidden_state' should be 'post_norm' or 'pre_norm', got 'weird'",
    ):
        read_data_config(tmp_path)
    with pytest.raises(ValueError, match="hidden_size\n  Field required"):
        write_data_config(tmp_path, bad)


def test_manifest_append_torn_tail_and_corruption(tmp_path):
    path = tmp_path / "manifest.jsonl"
    assert read_manifest(path).rows == {}
    with ManifestWriter(path) as w:
        w.append(0, "a", 5)
        w.append(2, "c", 7)
    with open(path, "a") as f:
        f.write('{"idx": 3, "id": "d", "num_t')  # killed mid-append
    m = read_manifest(path)
    assert m.rows == {
        0: {"idx": 0, "id": "a", "num_tokens": 5},
        2: {"idx": 2, "id": "c", "num_tokens": 7},
    }
    assert m.dropped_tail
    rewrite_manifest(path, m.rows)
    assert path.read_text().splitlines() == [
        '{"idx": 0, "id": "a", "num_tokens": 5}',
        '{"idx": 2, "id": "c", "num_tokens": 7}',
    ]
    assert not read_manifest(path).dropped_tail
    path.write_text(
        '{"idx": 0, "id": "a", "num_tokens": 5}\nnot json\n{"idx": 2, "id": "c", "num_tokens": 7}\n'
    )
    with pytest.raises(UserError, match="manifest.jsonl:2: malformed manifest line"):
        read_manifest(path)


def test_list_samples_refuses_a_missing_folder_and_with_at_least_one_an_empty_set(tmp_path):
    """``list_samples`` owns "is there a shard set": no folder, or (``at_least_one``) a folder with no sample."""
    with pytest.raises(UserError) as ei:
        list_samples(tmp_path / "gone")
    assert str(ei.value) == f"{tmp_path / 'gone'}: shards folder not found"
    (tmp_path / "rows_0-10").mkdir()
    assert list_samples(tmp_path) == []
    with pytest.raises(UserError) as ei:
        list_samples(tmp_path, at_least_one=True)
    assert str(ei.value) == f"{tmp_path}: no shards found"


def test_list_samples_refuses_an_idx_stored_twice(tmp_path):
    """A sample stored flat and nested is refused in one line naming both files (the nested one found second)."""
    (tmp_path / "data_3.pt").write_bytes(b"")
    (tmp_path / "rows_0-10").mkdir()
    (tmp_path / "rows_0-10" / "data_3.pt").write_bytes(b"")
    for at_least_one in (False, True):
        with pytest.raises(UserError) as ei:
            list_samples(tmp_path, at_least_one=at_least_one)
        assert str(ei.value) == (
            f"{tmp_path / 'rows_0-10' / 'data_3.pt'}: sample 3 also stored as {tmp_path / 'data_3.pt'}"
        )
