"""States put in their stored form per batch on the capture device (``eagle3.shards.write.encode_batch``:
NaN/Inf check, fp8 quantisation) before the device -> host copy: the same shard bytes as the
writer's own CPU path, and non-finite values still refused with the same error."""

from __future__ import annotations

import io

import pytest
import torch
from test_capture_hf import SAMPLES, _llama

from eagle3.capture.loop import capture_and_write
from eagle3.capture.prompts import Sample
from eagle3.shards.format import list_samples
from eagle3.shards.fp8 import FP8_DTYPE, Storage, quantize, quantize_unchecked, scales_finite
from eagle3.shards.manifest import read_manifest
from eagle3.shards.write import StoredStates, encode_batch, shard_object, write_sample

FP8 = Storage("float8_e4m3fn")
FP8_BLOCK = Storage("float8_e4m3fn", scale="per_block", block_size=16)
STORAGES = [None, FP8, FP8_BLOCK]
IDS = ["bf16", "fp8_per_token", "fp8_per_block"]


def _bytes(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _old_cpu_object(ids, states, mask, storage):
    """The writer's former path, spelled out: bf16 copy, full isfinite scan, CPU quantisation."""
    hs = [h.to(torch.bfloat16).clone() for h in states]
    assert all(bool(torch.isfinite(h).all()) for h in hs)
    obj = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "hidden_states": hs,
        "loss_mask": torch.tensor(mask, dtype=torch.int64),
    }
    if storage is not None and storage.is_fp8:
        pairs = [quantize(h, storage.num_blocks(h.shape[1])) for h in hs]
        obj["hidden_states"] = [q for q, _ in pairs]
        obj["hidden_scales"] = [s for _, s in pairs]
    return obj


@pytest.mark.parametrize("storage", STORAGES, ids=IDS)
def test_device_encoded_shards_are_the_cpu_paths_bytes(tmp_path, storage):
    """HF capture with the storage encoded per batch (what stage 02 now writes) gives byte for byte
    the shard that the old CPU path made from the plain bf16 capture."""
    from eagle3.capture.hf import HFCapture

    cap = HFCapture(_llama(), [1, 3, 4], batch_tokens=12)  # several forwards
    plain = cap.capture(SAMPLES)  # 4 x bf16 [L, 64] per sample
    stored = cap.capture_async(SAMPLES, storage=storage or Storage()).stored()
    for i, (ids, st, hs) in enumerate(zip(SAMPLES, stored, plain)):
        assert isinstance(st, StoredStates) and st.source_finite == (storage is None)
        mask = [k % 2 for k in range(len(ids))]
        old = _bytes(_old_cpu_object(ids, hs, mask, storage))
        assert _bytes(shard_object(ids, st, mask, storage, idx=i)) == old
        assert _bytes(shard_object(ids, hs, mask, storage, idx=i)) == old  # the list path too
        p = write_sample(tmp_path, i, 2, ids, st, mask, storage)
        assert (
            p.read_bytes() == old
        )  # views into the batch buffer were copied out, not the whole buffer


@pytest.mark.parametrize("storage", [FP8, FP8_BLOCK], ids=IDS[1:])
def test_encode_batch_equals_per_sample_quantize(storage):
    torch.manual_seed(1)
    pack = (torch.randn(4, 50, 64) * torch.logspace(-3, 3, 50).unsqueeze(1)).to(
        torch.bfloat16
    )  # [4, T, H]
    pack[1, 7] = 0  # an all-zero row: scale 1
    q, sc, finite = encode_batch(pack, storage)
    assert q.dtype == FP8_DTYPE and sc.dtype == torch.float32 and bool(finite)
    nb = storage.num_blocks(64)
    assert sc.shape == (4, 50, nb) and float(sc[1, 7, 0]) == 1.0
    for k in range(4):
        for a, b in ((0, 20), (20, 23), (23, 50)):  # three "samples" back to back
            rq, rs = quantize(pack[k, a:b], nb)
            assert torch.equal(q[k, a:b].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(
                sc[k, a:b], rs
            )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_unchecked_quantize_scales_carry_the_nonfinite(bad):
    """Finite scales <=> finite input: a NaN row must not get the all-zero row's scale of 1."""
    x = torch.randn(3, 32)
    x[1, 5] = bad
    _, sc = quantize_unchecked(x, 2)
    assert (
        not scales_finite(sc)
        and not bool(torch.isfinite(sc[1, 0]))
        and bool(torch.isfinite(sc[[0, 2]]).all())
    )
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(x, 2)
    q, sc = encode_batch(x.to(torch.bfloat16).expand(4, 3, 32), FP8)[:2]
    assert not scales_finite(sc)


def _poisoned_capture(bad_sample: int, value: float):
    """HFCapture whose decoder output gets ``value`` in one token of sample ``bad_sample`` (batch of all SAMPLES)."""
    from eagle3.capture.hf import HFCapture

    model = _llama()

    def hook(_mod, _args, out):
        if out.last_hidden_state.shape[0] == len(
            SAMPLES
        ):  # the real batch, not the hooks' 2-row probe
            out.last_hidden_state[bad_sample, 1, 3] = value  # [B, Lmax, H]
        return out

    model.get_decoder().register_forward_hook(hook)
    return HFCapture(model, [1, 3, 4], batch_tokens=10_000)


@pytest.mark.parametrize("storage", STORAGES, ids=IDS)
@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_capture_refused_with_the_same_error(tmp_path, storage, threads, value):
    """A NaN/Inf in a captured batch is refused before its shard exists, naming the sample and the
    state, as the writer's CPU check did; the other samples of the batch are still written."""
    cap = _poisoned_capture(
        2, value
    )  # padded row 2 = SAMPLES[1] (rows go longest first: lengths 9, 6, 3)
    samples = [Sample(10 + i, f"p{i}", s, [1] * len(s)) for i, s in enumerate(SAMPLES)]
    with pytest.raises(
        ValueError,
        match=r"^sample 11 \(conversation 'p1'\): hidden_states\[3\] has NaN/Inf; the verifier overflows in this dtype",
    ):
        capture_and_write(
            cap,
            samples,
            [[0, 1, 2]],
            {},
            64,
            tmp_path,
            4,
            tmp_path / "manifest.jsonl",
            write_threads=threads,
            max_pending_tokens=10_000,
            storage=storage,
        )
    written = [i for i, _ in list_samples(tmp_path)]
    assert 11 not in written
    assert list(read_manifest(tmp_path / "manifest.jsonl").rows) == [
        10
    ]  # the sample before it in order


def test_stored_states_that_do_not_match_the_storage_are_refused():
    h = [torch.zeros(3, 16, dtype=torch.bfloat16)] * 4
    with pytest.raises(ValueError, match="without scales for fp8"):
        shard_object([1, 2, 3], StoredStates(h), [1, 1, 1], FP8)
    q, sc = quantize(torch.zeros(3, 16), 1)
    with pytest.raises(ValueError, match="with scales for bf16"):
        shard_object([1, 2, 3], StoredStates([q] * 4, [sc] * 4), [1, 1, 1], None)
    with pytest.raises(
        ValueError, match=r"hidden_scales\[0\] has shape \(3, 2\), expected \[3, 1\]"
    ):
        shard_object([1, 2, 3], StoredStates([q] * 4, [torch.ones(3, 2)] * 4), [1, 1, 1], FP8)
    with pytest.raises(ValueError, match=r"hidden_states\[2\] has shape \(2, 16\)"):
        shard_object([1, 2, 3], StoredStates(h[:2] + [h[0][:2], h[0]]), [1, 1, 1], None)
    bad = h[0].clone()
    bad[2, 2] = float("nan")
    with pytest.raises(ValueError, match=r"sample 5: hidden_states\[1\] has NaN/Inf"):
        shard_object([1, 2, 3], StoredStates([h[0], bad, h[0], h[0]]), [1, 1, 1], None, idx=5)


def test_manifest_checksum_is_of_the_device_encoded_bytes(tmp_path):
    import xxhash

    from eagle3.capture.hf import HFCapture

    cap = HFCapture(_llama(), [1, 3, 4], batch_tokens=12)
    samples = [Sample(i, f"p{i}", s, [1] * len(s)) for i, s in enumerate(SAMPLES)]
    rows = capture_and_write(
        cap,
        samples,
        [[0, 1, 2]],
        {},
        64,
        tmp_path,
        4,
        tmp_path / "manifest.jsonl",
        write_threads=2,
        max_pending_tokens=10_000,
        storage=FP8,
    )
    paths = dict(list_samples(tmp_path))
    assert [r["idx"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["xxh3_128"] == xxhash.xxh3_128(paths[r["idx"]].read_bytes()).hexdigest()


def test_check_captured_takes_stored_states_and_names_a_wrong_dtype():
    from eagle3.capture.base import check_captured

    q = torch.zeros(3, 16).to(FP8_DTYPE)
    check_captured(
        [1, 2, 3], StoredStates([q] * 4, [torch.ones(3, 1)] * 4), 16, "s"
    )  # fp8 stored form: fine
    with pytest.raises(
        RuntimeError, match=r"s: capture tensor 0 is \(3, 16\) torch.float32 on cpu"
    ):
        check_captured([1, 2, 3], StoredStates([torch.zeros(3, 16)] * 4), 16, "s")
    with pytest.raises(RuntimeError, match="expected \\(3, 16\\) torch.bfloat16 on cpu"):
        check_captured(
            [1, 2, 3], [q] * 4, 16, "s"
        )  # plain lists stay bf16 only (the capture contract)
