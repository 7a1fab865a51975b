"""bench/small_train_speed.py runs end to end on CPU at tiny shapes and reports every mode (the H200 figures come
from the same code)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def test_synthetic_lengths_within_bounds():
    from small_train_speed import synthetic_lengths

    lens = synthetic_lengths(500, 300, seed=1)
    assert all(4 <= p and 1 <= r <= 256 and p + r <= 300 for p, r in lens)
    assert lens == synthetic_lengths(500, 300, seed=1)  # seeded


@pytest.mark.slow
def test_bench_tiny_cpu_reports_all_modes(tmp_path):
    import small_train_speed

    out = tmp_path / "r.json"
    small_train_speed.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--samples",
            "24",
            "--steps",
            "legacy8=2,fixed8=2,tokens=2",
            "--batch-tokens",
            "400",
            "--log-every",
            "1",
            "--workdir",
            str(tmp_path / "w"),
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert [x["mode"] for x in r["results"]] == ["legacy8", "fixed8", "tokens"]
    assert all(x["steps"] == 2 and x["tokens_per_s"] > 0 for x in r["results"])
    assert r["small_train_tokens_per_s"] == r["results"][2]["tokens_per_s"]


def test_bench_fp8_mode_trains_on_converted_fp8_shards(tmp_path):
    """``tokens,tokens+fp8`` (issue 13): the second run reads the converter's fp8 copy of the same samples (its
    data_config, the loader's batches and the step-1 loss show it), both rows report finite tokens/s, and the
    ratio is fp8 / bf16."""
    import small_train_speed

    from eagle3.errors import UserError
    from eagle3.io import read_json

    work, out = tmp_path / "w", tmp_path / "r.json"
    small_train_speed.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--samples",
            "24",
            "--modes",
            "tokens,tokens+fp8",
            "--steps",
            "tokens=3",
            "--batch-tokens",
            "400",
            "--log-every",
            "1",
            "--rounds",
            "2",
            "--workdir",
            str(work),
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    bf, fp = r["results"]
    assert (bf["mode"], fp["mode"]) == ("tokens", "tokens+fp8")
    assert bf["steps"] == fp["steps"] == 3  # the +fp8 mode takes its bf16 mode's --steps entry
    for x in (bf, fp):
        assert math.isfinite(x["tokens_per_s"]) and x["tokens_per_s"] > 0
        assert math.isfinite(x["loader_tokens_per_s"]) and x["loader_tokens_per_s"] > 0
        assert [y["round"] for y in x["rounds"]] == [
            0,
            1,
        ]  # --rounds 2: median of two runs per mode
        assert x["tokens_per_s"] == pytest.approx(
            statistics.median(y["tokens_per_s"] for y in x["rounds"])
        )
    assert r["fp8_vs_bf16_tokens_per_s_rounds"] == pytest.approx(
        [f["tokens_per_s"] / b["tokens_per_s"] for f, b in zip(fp["rounds"], bf["rounds"])]
    )
    assert r["fp8_vs_bf16_tokens_per_s"] == pytest.approx(fp["tokens_per_s"] / bf["tokens_per_s"])
    assert r["fp8_vs_bf16_loader_tokens_per_s"] == pytest.approx(
        fp["loader_tokens_per_s"] / bf["loader_tokens_per_s"]
    )
    # the fp8 run trained on the converter's output, and its loader shipped 1-byte features
    meta = read_json(work / "shards-fp8" / "data_config.json")
    assert (
        meta["storage_dtype"] == "float8_e4m3fn"
        and meta["format"] != read_json(work / "data" / "shards" / "data_config.json")["format"]
    )
    assert meta["converted_from"]["path"] == str(work / "data" / "shards")
    assert r["fp8_convert"]["samples"] == 24 + 16 and r["fp8_convert"]["complete"]
    assert (bf["storage_dtype"], bf["loader_feature_dtype"]) == ("bfloat16", "bfloat16")
    assert (fp["storage_dtype"], fp["loader_feature_dtype"]) == ("float8_e4m3fn", "float8_e4m3fn")
    # same init, samples and order: the step-1 losses differ only by fp8 rounding of the features (bitwise equal
    # on CPU if the fp8 run had read the bf16 shards)
    assert math.isfinite(bf["first_loss"]) and math.isfinite(fp["first_loss"])
    assert fp["first_loss"] != bf["first_loss"]
    assert fp["first_loss_rel_diff"] == pytest.approx(
        abs(fp["first_loss"] - bf["first_loss"]) / bf["first_loss"]
    )
    assert fp["first_loss_rel_diff"] < 1e-2
    assert "| float8_e4m3fn | tokens+fp8 |" in r["table_md"]
    # nothing to compare against when the source is fp8 already
    with pytest.raises(UserError, match="already float8_e4m3fn"):
        small_train_speed.make_fp8_shards(work / "shards-fp8", tmp_path / "again", overwrite=False)


def test_fp8_mode_names():
    from small_train_speed import bf16_mode, mode_flags

    assert mode_flags("tokens+nock+fp8") == ["nock", "fp8"] and mode_flags("tokens") == []
    assert bf16_mode("tokens+nock+fp8") == "tokens+nock" and bf16_mode("fixed8+fp8") == "fixed8"
    assert bf16_mode("tokens") == "tokens"


def test_median_of_rounds_single_run_unchanged_several_give_medians():
    from small_train_speed import ISSUE_RUN_TOKENS, median_of_rounds

    one = {
        "mode": "tokens",
        "tokens_per_s": 10.0,
        "loader_tokens_per_s": 5.0,
        "step_ms": 2.0,
        "x": 1,
    }
    assert median_of_rounds([one]) is one  # --rounds 1 (the default): the row as before
    runs = [
        {**one, "round": k, "tokens_per_s": t, "loader_tokens_per_s": lt, "step_ms": ms}
        for k, (t, lt, ms) in enumerate([(30.0, 1.0, 7.0), (10.0, 3.0, 5.0), (20.0, 2.0, 9.0)])
    ]
    m = median_of_rounds(runs)
    assert (m["tokens_per_s"], m["loader_tokens_per_s"], m["step_ms"], m["x"]) == (
        20.0,
        2.0,
        7.0,
        1,
    )
    assert m["issue_run_projected_s"] == ISSUE_RUN_TOKENS / 20.0 and "round" not in m
    assert [x["tokens_per_s"] for x in m["rounds"]] == [30.0, 10.0, 20.0]


def test_bench_fp8_mode_on_a_prepared_run_reuses_its_conversion(tmp_path):
    """``--config`` (a prepared run; the GPU session's form): the first run extracts the verifier head and later
    runs reuse a copy of it (``--rounds 2`` reruns that first mode), the fp8 copy goes to ``--fp8-shards``, and
    a second call finds that conversion complete and converts nothing."""
    import small_train_speed
    import torch
    from safetensors.torch import save_file

    cfg = small_train_speed.write_synthetic(tmp_path / "run", 12, 4, small_train_speed.TINY, 256)
    H, V = small_train_speed.TINY["hidden"], small_train_speed.TINY["vocab"]
    vdir = tmp_path / "verifier"  # safetensors checkpoint with the 3 head tensors (tied embeddings)
    vdir.mkdir()
    (vdir / "config.json").write_text(
        json.dumps(
            {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
        )
    )
    save_file(
        {"model.embed_tokens.weight": torch.randn(V, H) * 0.05, "model.norm.weight": torch.ones(H)},
        str(vdir / "model.safetensors"),
    )
    args = [
        "--config",
        str(cfg),
        "--set",
        f"verifier.path={vdir}",
        "--device",
        "cpu",
        "--modes",
        "tokens,tokens+fp8",
        "--steps",
        "tokens=2",
        "--batch-tokens",
        "300",
        "--log-every",
        "1",
        "--fp8-shards",
        str(tmp_path / "fp8"),
        "--workdir",
        str(tmp_path / "w"),
    ]
    small_train_speed.main(args + ["--rounds", "2", "--json", str(tmp_path / "a.json")])
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["fp8_convert"]["converted"] == 16 and a["fp8_convert"]["complete"]
    assert [x["storage_dtype"] for x in a["results"]] == ["bfloat16", "float8_e4m3fn"]
    assert all(len(x["rounds"]) == 2 and math.isfinite(x["tokens_per_s"]) for x in a["results"])
    small_train_speed.main(args + ["--json", str(tmp_path / "b.json")])
    b = json.loads((tmp_path / "b.json").read_text())
    assert (b["fp8_convert"]["converted"], b["fp8_convert"]["resumed"]) == (0, 16)
    assert b["results"][1]["loader_feature_dtype"] == "float8_e4m3fn"
    assert math.isfinite(b["fp8_vs_bf16_tokens_per_s"]) and b["fp8_vs_bf16_tokens_per_s"] > 0
