"""fp8 shard storage (eagle3.shards.fp8, eagle3.shards.format, eagle3.shards.convert): values, format, readers, converter."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import eagle3.io as eio
from eagle3.errors import UserError
from eagle3.shards.data_config import expect_from_data_config, read_data_config, storage_meta
from eagle3.shards.format import FORMAT, FORMAT_FP8, list_samples
from eagle3.shards.fp8 import (
    FP8_DTYPE,
    Storage,
    dequantize,
    dequantize_batch,
    has_nan_fp8,
    quantize,
)
from eagle3.shards.read import hidden_states_bf16, load_sample
from eagle3.shards.write import write_sample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
FP8 = Storage("float8_e4m3fn", "per_token")


# ---- quantisation values --------------------------------------------------------------------------
def _amax_rows(n: int = 4096, seed: int = 0) -> torch.Tensor:
    """[n, 2] float32 rows whose amax is spread over many binades (so some scale rounding is hard)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((n, 2), generator=g) * 2 - 1) * torch.exp2(
        torch.randint(-20, 20, (n, 1), generator=g).float()
    )


def test_quantize_scale_is_correctly_rounded_division():
    # the scale is IEEE float32 amax / 448 (what every device's true division gives), not amax * (1 / 448):
    # the float64 quotient rounded to float32 is the correctly rounded float32 quotient
    h = _amax_rows()  # [n, 2]
    _, s = quantize(h)
    want = (h.abs().amax(dim=-1, keepdim=True).double() / 448.0).float()  # [n, 1]
    assert torch.equal(s, want)
    recip = h.abs().amax(dim=-1, keepdim=True) * torch.tensor(
        1.0 / 448.0
    )  # the reciprocal multiply
    assert not torch.equal(recip, want)  # so these rows do tell the two apart


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantize_same_bytes_on_cuda_and_cpu():
    # stage 02 quantises on the verifier's GPU, shard_convert and the SGLang path on the CPU: same shard bytes
    h = _amax_rows(1 << 16).to(torch.bfloat16).repeat(1, 64)  # [n, 128]
    q_cpu, s_cpu = quantize(h)
    q_dev, s_dev = quantize(h.cuda())
    assert torch.equal(s_dev.cpu(), s_cpu)
    assert torch.equal(q_dev.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def test_quantize_hand_computed():
    h = torch.tensor([[1.0, -2.0, 0.5, 4.0], [4.0, 0.3, 0.0, -4.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize(h)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (3, 1)
    torch.testing.assert_close(s[:, 0], torch.tensor([4 / 448, 4 / 448, 1.0]))
    # row 0: h / s = 112, -224, 56, 448: all exact e4m3 values
    assert q[0].float().tolist() == [112.0, -224.0, 56.0, 448.0]
    torch.testing.assert_close(dequantize(q, s, torch.float32)[0], h[0])
    # row 1: 0.3 / (4/448) = 33.6 -> nearest e4m3 is 32 (spacing 4 in [32, 64))
    assert q[1].float().tolist() == [448.0, 32.0, 0.0, -448.0]
    assert abs(float(dequantize(q, s, torch.float32)[1, 1]) - 32 * 4 / 448) < 1e-7
    # all-zero row: scale 1, zeros back
    assert q[2].float().abs().sum() == 0 and dequantize(q, s)[2].abs().sum() == 0


def test_quantize_per_block_scales_each_block():
    h = torch.tensor([[1.0, 2.0, 100.0, -50.0]])  # [1, 4], 2 blocks of 2
    q, s = quantize(h, num_blocks=2)
    torch.testing.assert_close(s, torch.tensor([[2 / 448, 100 / 448]]))
    assert q.float().tolist() == [[224.0, 448.0, 448.0, -224.0]]
    torch.testing.assert_close(dequantize(q, s, torch.float32), h)
    with pytest.raises(ValueError, match="do not divide"):
        quantize(h, num_blocks=3)
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(torch.tensor([[1.0, float("inf")]]))


def test_quantize_error_bound_on_random_rows():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 256, generator=g) * torch.logspace(-2, 2, 64).unsqueeze(
        1
    )  # rows of very different size
    h[5, 7] = 300.0  # an outlier dimension, as residual streams have
    q, s = quantize(h)
    back = dequantize(q, s, torch.float32)
    normal = (
        q.float().abs() >= 2**-6
    )  # e4m3 normal range: relative error <= 2^-4 (3 mantissa bits, RNE)
    rel = ((back - h).abs() / h.abs())[normal]
    assert float(rel.max()) <= 2**-4 + 1e-6
    assert float(q.float().abs().amax(1).min()) == 448.0  # every row uses the full range


def test_storage_bytes_and_meta():
    assert Storage().bytes_per_token(7168) == 57344
    assert FP8.bytes_per_token(7168) == 4 * (7168 + 4) == 28688  # 0.5003x
    assert Storage("float8_e4m3fn", "per_block", 128).bytes_per_token(7168) == 4 * (7168 + 4 * 56)
    assert Storage.from_meta(FP8.to_meta()) == FP8 and Storage.from_meta({}) == Storage()
    assert storage_meta(Storage()) == {"format": FORMAT, "dtype": "bfloat16"}
    m = storage_meta(FP8)
    assert m["format"] == FORMAT_FP8 and m["storage_dtype"] == m["dtype"] == "float8_e4m3fn"
    assert (
        m["scale_scheme"] == "per_token"
        and m["scale_dtype"] == "float32"
        and m["storage_format_version"] == 1
    )
    with pytest.raises(ValueError, match="does not divide"):
        Storage("float8_e4m3fn", "per_block", 100).num_blocks(576)


def test_dequantize_batch_on_device_side():
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(2, 5, 12, generator=g)
    q, s = quantize(aux, 3)  # [2, 5, 12] fp8, [2, 5, 3]
    batch = {"aux": q, "aux_scale": s, "input_ids": torch.zeros(2, 5, dtype=torch.int64)}
    out = dequantize_batch(batch, torch.float32)
    assert set(out) == {"aux", "input_ids"} and out["aux"].dtype == torch.float32
    torch.testing.assert_close(out["aux"], dequantize(q, s, torch.float32))


# ---- shard format ---------------------------------------------------------------------------------
def _sample(L=9, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 40, (L,), generator=g),
        [torch.randn(L, H, generator=g) for _ in range(4)],
        (torch.arange(L) >= 3).long(),
    )


def test_fp8_shard_round_trip_and_size(tmp_path):
    ids, hs, mask = _sample(L=64, H=64)
    pb = write_sample(tmp_path / "bf16", 3, 2, ids, hs, mask)
    pf = write_sample(tmp_path / "fp8", 3, 2, ids, hs, mask, FP8)
    assert pf == tmp_path / "fp8" / "rows_2-4" / "data_3.pt"
    s = load_sample(
        pf, expect={"hidden_size": 64, "storage_dtype": "float8_e4m3fn", "scale_blocks": 1}
    )
    assert [h.dtype for h in s["hidden_states"]] == [FP8_DTYPE] * 4
    assert [tuple(x.shape) for x in s["hidden_scales"]] == [(64, 1)] * 4
    ref = [
        h.to(torch.bfloat16) for h in hs
    ]  # fp8 quantises the bf16 values a bf16 shard would hold
    for k in range(4):
        q, sc = quantize(ref[k])
        assert torch.equal(s["hidden_states"][k].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(hidden_states_bf16(s)[k], dequantize(q, sc))
    raw = torch.load(pf, weights_only=True)
    assert set(raw) == {"input_ids", "hidden_states", "hidden_scales", "loss_mask"}
    b = load_sample(pb)
    assert "hidden_scales" not in b and all(
        x is y for x, y in zip(hidden_states_bf16(b), b["hidden_states"])
    )
    # data: bf16 4 x 64 x 64 x 2 = 32768 B; fp8 4 x 64 x 64 + 4 x 64 x 4 (scales) = 17408 B; zip records differ by < 1.5 KB
    saved = pb.stat().st_size - pf.stat().st_size
    assert 32768 - 17408 - 1536 < saved <= 32768 - 17408


@pytest.mark.parametrize(
    "break_it, match",
    [
        (lambda o: o.pop("hidden_scales"), "key 'hidden_scales': missing"),
        (lambda o: o["hidden_scales"].pop(), "key 'hidden_scales': expected a list of 4"),
        (
            lambda o: o["hidden_scales"].__setitem__(1, torch.ones(9, 1, dtype=torch.bfloat16)),
            r"hidden_scales\[1\]': dtype",
        ),
        (
            lambda o: o["hidden_scales"].__setitem__(2, torch.ones(9, 3)),
            r"hidden_scales\[2\]': shape \(9, 3\)",
        ),
        (
            lambda o: o["hidden_scales"].__setitem__(0, torch.zeros(9, 1)),
            r"hidden_scales\[0\]': scales must be finite and > 0",
        ),
        (
            lambda o: o["hidden_scales"].__setitem__(3, torch.full((9, 1), float("nan"))),
            "finite and > 0",
        ),
        (
            lambda o: o["hidden_states"][1].view(torch.uint8).__setitem__((0, 0), 0x7F),
            r"hidden_states\[1\]': contains NaN",
        ),
        (
            lambda o: o["hidden_states"].__setitem__(2, o["hidden_states"][2].to(torch.bfloat16)),
            r"hidden_states\[2\]': dtype",
        ),
    ],
)
def test_fp8_shard_validation_names_the_key(tmp_path, break_it, match):
    ids, hs, mask = _sample()
    p = write_sample(tmp_path, 0, 10, ids, hs, mask, FP8)
    obj = torch.load(p, weights_only=True)
    break_it(obj)
    torch.save(obj, p)
    with pytest.raises(UserError, match=match):
        load_sample(p)


def test_storage_dtype_must_match_data_config(tmp_path):
    ids, hs, mask = _sample()
    pf = write_sample(tmp_path / "a", 0, 10, ids, hs, mask, FP8)
    pb = write_sample(tmp_path / "b", 0, 10, ids, hs, mask)
    with pytest.raises(UserError, match="data_config.json says storage_dtype 'bfloat16'"):
        load_sample(pf, expect={"storage_dtype": "bfloat16"})
    with pytest.raises(UserError, match="storage_dtype 'float8_e4m3fn'"):
        load_sample(pb, expect={"storage_dtype": "float8_e4m3fn"})
    with pytest.raises(UserError, match="2 scales per token, data_config.json implies 1"):
        load_sample(
            write_sample(
                tmp_path / "c", 0, 10, ids, hs, mask, Storage("float8_e4m3fn", "per_block", 8)
            ),
            expect={"scale_blocks": 1},
        )


def _meta(storage: Storage, H=16) -> dict:
    from eagle3.shards.format import LAYER_INDEX_CONVENTION

    return {
        **storage_meta(storage),
        "verifier": "v",
        "architecture": "LlamaForCausalLM",
        "num_layers": 6,
        "hidden_size": H,
        "vocab_size": 40,
        "aux_layers": [1, 3, 4],
        "layer_index_convention": LAYER_INDEX_CONVENTION,
        "last_hidden_state": "post_norm",
        "max_length": 64,
        "rows_per_dir": 10,
        "chat_template_hash": None,
        "config_fingerprint": "x",
        "prompts_sha256": "x",
        "num_samples": 1,
        "num_tokens": 9,
        "num_loss_tokens": 6,
        "bytes_per_token": storage.bytes_per_token(H),
        "skipped": {},
    }


def test_data_config_storage_keys_validated(tmp_path):
    from eagle3.shards.data_config import write_data_config

    write_data_config(tmp_path, _meta(FP8))
    meta = read_data_config(tmp_path)
    assert expect_from_data_config(meta)["storage_dtype"] == "float8_e4m3fn"
    assert expect_from_data_config(meta)["scale_blocks"] == 1
    for change, match in [
        ({"storage_format_version": 2}, "storage_format_version' is 2"),
        ({"scale_dtype": "bfloat16"}, "scale_dtype"),
        ({"format": FORMAT}, "stores bfloat16"),
        ({"scale_scheme": "per_block", "scale_block_size": 5}, "does not divide"),
    ]:
        (tmp_path / "data_config.json").write_text(json.dumps({**_meta(FP8), **change}))
        with pytest.raises(UserError, match=match):
            read_data_config(tmp_path)
    (tmp_path / "data_config.json").write_text(
        json.dumps({**_meta(Storage()), "dtype": "float8_e4m3fn"})
    )
    with pytest.raises(UserError, match="stores bfloat16"):
        read_data_config(tmp_path)


def test_flat_speculators_folder_from_another_tool_still_loads(tmp_path):
    """A vLLM-speculators style folder: data_{idx}.pt written by plain torch.save, no manifest."""
    from eagle3.data.dataset import ShardDataset, collate

    for idx in range(3):
        ids, hs, mask = _sample(L=5 + idx, seed=idx)
        torch.save(
            {
                "input_ids": ids,
                "hidden_states": [h.to(torch.bfloat16) for h in hs],
                "loss_mask": mask,
            },
            tmp_path / f"data_{idx}.pt",
        )
    assert [i for i, _ in list_samples(tmp_path)] == [0, 1, 2]
    ds = ShardDataset(tmp_path, [0, 1, 2], expect={"hidden_size": 16, "storage_dtype": "bfloat16"})
    batch = collate([ds[i] for i in range(3)])
    assert (
        batch["aux"].dtype == torch.bfloat16
        and batch["aux"].shape == (3, 7, 48)
        and "aux_scale" not in batch
    )
    ids, hs, mask = _sample(L=7, seed=2)
    assert torch.equal(batch["last"][2], hs[3].to(torch.bfloat16))


def test_dataset_fp8_items_dequantised_after_move(tmp_path):
    from eagle3.data.dataset import ShardDataset, collate
    from eagle3.train.loop import move_batch as _move_batch

    ref = []
    for idx in range(2):
        ids, hs, mask = _sample(L=6 + 3 * idx, seed=idx)
        write_sample(tmp_path, idx, 10, ids, hs, mask, Storage("float8_e4m3fn", "per_block", 8))
        ref.append(hs)
    ds = ShardDataset(
        tmp_path,
        [0, 1],
        expect={"hidden_size": 16, "storage_dtype": "float8_e4m3fn", "scale_blocks": 2},
    )
    item = ds[1]
    assert (
        item["aux"].dtype == FP8_DTYPE
        and item["aux_scale"].shape == (9, 6)
        and item["last_scale"].shape == (9, 2)
    )
    batch = collate([ds[0], ds[1]])
    assert batch["aux"].dtype == FP8_DTYPE and batch["aux_scale"].shape == (2, 9, 6)
    moved = _move_batch(batch, torch.device("cpu"), torch.float32)
    assert (
        "aux_scale" not in moved
        and moved["aux"].dtype == torch.float32
        and moved["last"].dtype == torch.float32
    )
    for b, hs in enumerate(ref):
        L = hs[0].shape[0]
        want = [dequantize(*quantize(h.to(torch.bfloat16), 2), torch.float32) for h in hs]
        torch.testing.assert_close(moved["aux"][b, :L], torch.cat(want[:3], -1), rtol=0, atol=0)
        torch.testing.assert_close(moved["last"][b, :L], want[3], rtol=0, atol=0)
        assert moved["aux"][b, L:].abs().sum() == 0  # padding stays zero
        rel = (moved["last"][b, :L] - hs[3]).norm() / hs[3].norm()
        assert 0 < float(rel) < 0.05


# ---- stages 02/03 and the converter -------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, tiny_llama_dir):
    """Stage 02 (bf16) and stage 02 (fp8) on the tiny verifier: the same prompts, two shard folders."""
    from test_extract import _config

    from eagle3.config import load_config
    from eagle3.stages.extract import run

    base = tmp_path_factory.mktemp("fp8run")
    bf = load_config(_config(base / "bf16", tiny_llama_dir))
    run(bf)
    f8 = load_config(_config(base / "fp8", tiny_llama_dir, storage_dtype="float8_e4m3fn"))
    run(f8)
    return bf, f8


def _assert_same_set(a: Path, b: Path) -> None:
    la, lb = list_samples(a), list_samples(b)
    assert [i for i, _ in la] == [i for i, _ in lb]
    for (_, pa), (_, pb) in zip(la, lb):
        sa, sb = load_sample(pa), load_sample(pb)
        assert torch.equal(sa["input_ids"], sb["input_ids"]) and torch.equal(
            sa["loss_mask"], sb["loss_mask"]
        )
        for x, y in zip(sa["hidden_states"], sb["hidden_states"]):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(sa.get("hidden_scales", []), sb.get("hidden_scales", [])):
            assert torch.equal(x, y)


def test_extract_fp8_metadata_and_stage03(bf16_run):
    from eagle3.stages.prepare_data import run as prepare

    bf, f8 = bf16_run
    mb, mf = read_data_config(bf.shards_dir), read_data_config(f8.shards_dir)
    assert mb["format"] == FORMAT and mb["dtype"] == "bfloat16" and "storage_dtype" not in mb
    assert (
        mf["format"] == FORMAT_FP8
        and mf["storage_dtype"] == "float8_e4m3fn"
        and mf["scale_scheme"] == "per_token"
    )
    assert mf["bytes_per_token"] == 4 * (64 + 4) and mb["bytes_per_token"] == 4 * 64 * 2
    assert mf["config_fingerprint"] != mb["config_fingerprint"]
    rb, rf = prepare(bf, plot=False), prepare(f8, plot=False)
    assert rf["storage_dtype"] == "float8_e4m3fn" and rb["storage_dtype"] == "bfloat16"
    assert (rf["num_tokens"], rf["coverage"]) == (rb["num_tokens"], rb["coverage"])
    fb = sum(p.stat().st_size for _, p in list_samples(bf.shards_dir))
    ff = sum(p.stat().st_size for _, p in list_samples(f8.shards_dir))
    # the disk plan of 02 measured the fp8 writer (values + scales), not bf16
    pb = json.loads((bf.shards_dir / "extract_report.json").read_text())["disk_plan"]
    pf = json.loads((f8.shards_dir / "extract_report.json").read_text())["disk_plan"]
    assert (
        pf["hidden_bytes_per_token"] == 4 * (64 + 4) and pb["hidden_bytes_per_token"] == 4 * 64 * 2
    )
    assert abs(pf["shard_bytes"] - ff) <= 0.02 * ff and abs(pb["shard_bytes"] - fb) <= 0.02 * fb
    data_saved = mb["num_tokens"] * (mb["bytes_per_token"] - mf["bytes_per_token"])
    assert (
        0.85 * data_saved < fb - ff <= data_saved
    )  # less only by the zip records of the 4 scale tensors


def test_extract_refuses_switching_storage_midway(bf16_run, tiny_llama_dir):
    from eagle3.stages.extract import run

    bf, _ = bf16_run
    cfg = bf.model_copy(deep=True)
    cfg.extract.storage_dtype = "float8_e4m3fn"
    with pytest.raises(
        UserError,
        match="extracted with other settings: changed extract.fp8_scale: default -> .per_token.; extract.storage_dtype: .bfloat16. -> .float8_e4m3fn.",
    ):
        run(cfg)


def test_convert_bf16_to_fp8_equals_fp8_extraction_and_back(bf16_run, tmp_path):
    from eagle3.shards.convert import convert

    bf, f8 = bf16_run
    out = convert(bf.shards_dir, tmp_path / "fp8", FP8, workers=2)
    assert out["complete"] and out["samples"] == 6 and out["converted"] == 6
    assert out["src_bytes"] == sum(p.stat().st_size for _, p in list_samples(bf.shards_dir))
    assert out["dst_bytes"] == sum(p.stat().st_size for _, p in list_samples(f8.shards_dir))
    assert out["bytes_per_token"] == 4 * (64 + 4) and out["src_bytes_per_token"] == 4 * 64 * 2
    _assert_same_set(tmp_path / "fp8", f8.shards_dir)  # bit-identical to capturing in fp8 directly
    mc, mf = read_data_config(tmp_path / "fp8"), read_data_config(f8.shards_dir)
    assert mc["converted_from"]["format"] == FORMAT
    drop = ("converted_from", "config_fingerprint", "prompts_file")
    assert {k: v for k, v in mc.items() if k not in drop} == {
        k: v for k, v in mf.items() if k not in drop
    }
    from eagle3.shards.manifest import read_manifest

    man = read_manifest(tmp_path / "fp8" / "manifest.jsonl").rows
    assert [man[i]["id"] for i in sorted(man)] == ["p0", "p1", "p2", "p3", "p5", "p6"]
    # and back: fp8 -> bf16 gives speculators-v1 shards holding the dequantised values
    back = convert(tmp_path / "fp8", tmp_path / "bf16", Storage(), workers=1)
    assert back["complete"] and read_data_config(tmp_path / "bf16")["format"] == FORMAT
    assert "storage_dtype" not in read_data_config(tmp_path / "bf16")
    for (_, pa), (_, pb) in zip(list_samples(tmp_path / "fp8"), list_samples(tmp_path / "bf16")):
        assert all(
            torch.equal(x, y)
            for x, y in zip(hidden_states_bf16(load_sample(pa)), load_sample(pb)["hidden_states"])
        )


def test_convert_resumes_after_kill_and_disk_full(bf16_run, tmp_path, monkeypatch):
    from test_disk_full import ArchiveBudget

    from eagle3.shards.convert import convert

    bf, f8 = bf16_run
    dst = tmp_path / "fp8"
    part = convert(bf.shards_dir, dst, FP8, workers=1, limit=2)  # a run that stopped after 2 shards
    assert not part["complete"] and not (dst / "data_config.json").exists()
    budget = ArchiveBudget(1500)  # shards are saved by path (eagle3.shards.write.SAVE_VIA_PATH)
    monkeypatch.setattr(eio, "_save_archive", budget)
    monkeypatch.setattr(eio, "free_bytes", budget.free)
    with pytest.raises(
        UserError, match=r"data_\d+\.pt: disk full \(No space left on device\) writing"
    ):
        convert(bf.shards_dir, dst, FP8, workers=1)
    assert (
        not [p for p in dst.rglob("*") if eio.TMP_MARK in p.name]
        and not (dst / "data_config.json").exists()
    )
    monkeypatch.undo()
    done = convert(bf.shards_dir, dst, FP8, workers=2)
    assert done["complete"] and done["resumed"] >= 2
    _assert_same_set(dst, f8.shards_dir)
    with pytest.raises(UserError, match="holds a different conversion"):
        convert(bf.shards_dir, dst, Storage("float8_e4m3fn", "per_block", 32))
    with pytest.raises(
        UserError, match=r"must be outside the source folder .* choose another folder"
    ):
        convert(bf.shards_dir, bf.shards_dir, FP8)
    redo = convert(bf.shards_dir, dst, Storage("float8_e4m3fn", "per_block", 32), overwrite=True)
    assert redo["complete"] and read_data_config(dst)["scale_block_size"] == 32


def test_convert_overwrite_keeps_dst_when_the_source_has_no_shards(bf16_run, tmp_path):
    # --overwrite deletes the earlier conversion only once the source is known to hold shards
    import shutil

    from eagle3.shards.convert import convert

    bf, _ = bf16_run
    dst = tmp_path / "fp8"
    convert(bf.shards_dir, dst, FP8, workers=1)
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(
        bf.shards_dir / "data_config.json", empty / "data_config.json"
    )  # a set whose shards are gone
    with pytest.raises(UserError, match=rf"^{re.escape(str(empty))}: no shards found$"):
        convert(empty, dst, Storage("float8_e4m3fn", "per_block", 32), overwrite=True)
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before


def test_convert_refuses_corrupt_source(bf16_run, tmp_path):
    import shutil

    from eagle3.shards.convert import convert

    bf, _ = bf16_run
    src = tmp_path / "src"
    shutil.copytree(bf.shards_dir, src)
    victim = list_samples(src)[1][1]
    data = bytearray(victim.read_bytes())
    data[-200] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"data_1\.pt: contents changed since extraction"):
        convert(src, tmp_path / "dst", FP8, workers=1)


def test_convert_cli_from_config(bf16_run, tmp_path, capsys):
    import importlib

    from eagle3.cli import run_main

    bf, f8 = bf16_run
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    cli = importlib.import_module("convert_shards")
    cfg_path = Path(bf.output_root) / ".." / "run.yaml"
    dst = tmp_path / "fp8"
    with pytest.raises(SystemExit) as e:
        run_main(
            cli.main,
            [
                "--config",
                str(cfg_path),
                "--set",
                "extract.storage_dtype=float8_e4m3fn",
                "--dst",
                str(dst),
                "--json",
                str(tmp_path / "s.json"),
            ],
        )
    assert e.value.code == 0
    assert json.loads((tmp_path / "s.json").read_text())["complete"] is True
    _assert_same_set(dst, f8.shards_dir)
    with pytest.raises(SystemExit) as e:
        run_main(
            cli.main,
            [
                "--src",
                str(bf.shards_dir),
                "--dst",
                str(tmp_path / "x"),
                "--to",
                "float8_e4m3fn",
                "--scale",
                "per_block",
                "--block-size",
                "48",
            ],
        )
    assert (
        e.value.code == 2
        and "block_size 48 does not divide hidden size 64" in capsys.readouterr().err
    )
    # malformed flags: one error line, exit 2 (no usage dump, no silent default), nothing written
    for argv, msg in [
        (["--to", "float16"], "argument --to: invalid choice"),
        (["--to", "float8_e4m3fn", "--scale", "per_block", "--block-size", "0"], "--block-size"),
        (["--to", "float8_e4m3fn", "--workers", "-1"], "--workers"),
    ]:
        with pytest.raises(SystemExit) as e:
            run_main(cli.main, ["--src", str(bf.shards_dir), "--dst", str(tmp_path / "y"), *argv])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error:") and msg in err and "\n" not in err, (
            err
        )
        assert "block_size 128" not in err
        assert not (tmp_path / "y").exists()
    with pytest.raises(SystemExit) as e:  # destination inside the source folder
        run_main(
            cli.main,
            [
                "--src",
                str(bf.shards_dir),
                "--dst",
                str(bf.shards_dir / "sub"),
                "--to",
                "float8_e4m3fn",
            ],
        )
    assert e.value.code == 2 and "must be outside the source folder" in capsys.readouterr().err
    assert not (bf.shards_dir / "sub").exists()


# ---- stage 04 on fp8 shards -----------------------------------------------------------------------
def test_train_on_fp8_shards_matches_bf16_first_loss(tmp_path):
    """A training run on converted fp8 shards sees the dequantised features: its first-step loss is
    within fp8 rounding of the bf16 run's (ignoring the scales would be off by orders of magnitude)."""
    from _ddp_worker import make_tiny_run, mark_validated

    from eagle3.config import load_config
    from eagle3.data.validation_record import VALIDATION_RECORD
    from eagle3.shards.convert import convert
    from eagle3.stages.train import run

    train = {"epochs": 1, "batch_size": 2, "ckpt_every": 100}
    a = load_config(make_tiny_run(tmp_path / "a", train=train))
    b = load_config(make_tiny_run(tmp_path / "b", train=train))
    convert(b.shards_dir, tmp_path / "b" / "shards-fp8", FP8, workers=1)
    rec = json.loads(
        (b.shards_dir / VALIDATION_RECORD).read_text()
    )  # same samples: 03's figures carry over
    b.extract.output_dir = str(tmp_path / "b" / "shards-fp8")
    mark_validated(b.shards_dir, b.data_dir, rec["stats"], torch.tensor(rec["token_freq"]))
    ra, rb = run(a, device="cpu"), run(b, device="cpu")
    assert ra["step"] == rb["step"] == 4
    rows_a = [json.loads(x) for x in (a.train_dir / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (b.train_dir / "metrics.jsonl").read_text().splitlines()]
    la = [r["loss"] for r in rows_a if r["kind"] == "train"]
    lb = [r["loss"] for r in rows_b if r["kind"] == "train"]
    assert la[0] != lb[0] and abs(la[0] - lb[0]) < 0.02 * abs(la[0])


def test_has_nan_fp8_exactly_the_nan_bit_patterns():
    """Each of the 256 e4m3fn bit patterns, alone among finite values: NaN iff ``S1111111`` (0x7F, 0xFF), as
    torch's own decoding says; empty tensors have none."""
    base = torch.tensor(
        [0x00, 0x38, 0xB8, 0x7E, 0xFE, 0x80], dtype=torch.uint8
    )  # 0, 1, -1, 448, -448, -0
    for bits in range(256):
        q = (
            torch.cat([base, torch.tensor([bits], dtype=torch.uint8), base])
            .view(FP8_DTYPE)
            .reshape(1, 13)
        )  # [1, 13]
        want = bool(torch.isnan(q.float()).any())
        assert want == (bits & 0x7F == 0x7F)
        assert has_nan_fp8(q) is want, bits
    assert has_nan_fp8(base.view(FP8_DTYPE)) is False
    assert has_nan_fp8(torch.empty(0, 4, dtype=FP8_DTYPE)) is False
