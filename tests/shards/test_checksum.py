"""Shard checksums (``eagle3.shards.checksum``): xxh3_128 for new shards, sha256 still verified for older
manifests; the writer records the digest of the bytes it wrote under the algorithm's name."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from eagle3.capture.shard_writer import ShardWriter
from eagle3.shards.checksum import DEFAULT_ALGO, file_checksum, new_hasher, row_checksum
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import ManifestWriter, read_manifest

# Reference digests of the empty input: the XXH3-128 value of the xxHash project's sanity vectors
# (XXH3_128bits of length 0, seed 0) and FIPS 180-2's sha256 of "".
EMPTY = {
    "xxh3_128": "99aa06d3014798d86001c324468d497f",
    "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
}


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_empty_input_gives_the_published_digest(tmp_path, algo):
    (tmp_path / "e").write_bytes(b"")
    assert new_hasher(algo).hexdigest() == EMPTY[algo]
    assert file_checksum(tmp_path / "e", algo) == EMPTY[algo]


def test_file_checksum_streams_across_blocks_like_one_update(tmp_path):
    import xxhash

    data = bytes(range(256)) * 9000  # 2.3 MB: three 1 MiB blocks
    (tmp_path / "f").write_bytes(data)
    assert file_checksum(tmp_path / "f") == xxhash.xxh3_128(data).hexdigest()
    assert file_checksum(tmp_path / "f", "sha256") == hashlib.sha256(data).hexdigest()


def test_unknown_algorithm_is_refused_before_any_write(tmp_path):
    with pytest.raises(ValueError, match="unknown shard checksum 'md5'"):
        new_hasher("md5")
    with ManifestWriter(tmp_path / "m.jsonl") as man:
        with pytest.raises(ValueError, match="unknown shard checksum"):
            ShardWriter(tmp_path, 4, man, threads=1, checksum="md5")
    assert not list(tmp_path.glob("rows_*"))


def test_row_checksum_reads_either_key():
    assert row_checksum({"idx": 0, "xxh3_128": "ab"}) == ("xxh3_128", "ab")
    assert row_checksum({"idx": 0, "sha256": "cd"}) == ("sha256", "cd")
    assert row_checksum({"idx": 0}) is None
    assert row_checksum({"idx": 0, "sha256": "cd", "xxh3_128": "ab"}) == (DEFAULT_ALGO, "ab")


@pytest.mark.parametrize("algo,threads", [("xxh3_128", 2), ("sha256", 0)])
def test_writer_records_the_digest_of_the_file_it_wrote(tmp_path, algo, threads):
    states = [
        torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8).to(torch.bfloat16) + k
        for k in range(4)
    ]
    with (
        ManifestWriter(tmp_path / "manifest.jsonl") as man,
        ShardWriter(tmp_path, 2, man, threads=threads, checksum=algo) as w,
    ):
        for idx in range(3):
            w.submit(idx, f"p{idx}", [5, 6, 7], states, [0, 1, 1])
    paths = dict(list_samples(tmp_path))
    rows = read_manifest(tmp_path / "manifest.jsonl").rows
    ref = {
        "xxh3_128": lambda b: __import__("xxhash").xxh3_128(b).hexdigest(),
        "sha256": lambda b: hashlib.sha256(b).hexdigest(),
    }[algo]
    for idx in range(3):
        assert set(rows[idx]) == {"idx", "id", "num_tokens", "num_loss_tokens", algo}
        assert rows[idx][algo] == ref(paths[idx].read_bytes())
    first = json.loads((tmp_path / "manifest.jsonl").read_text().splitlines()[0])
    assert list(first) == ["idx", "id", "num_tokens", "num_loss_tokens", algo]
