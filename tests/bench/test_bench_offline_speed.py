"""bench/offline_bench_speed.py on CPU at tiny size: one run per batch size, same outputs, JSON keys."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location(
        "offline_bench_speed", ROOT / "bench" / "offline_bench_speed.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offline_bench_speed_tiny(tmp_path, tiny_llama_dir):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": t}) + "\n"
            for i, t in enumerate(["What is 2+2?", "Name a colour please.", "Hi"])
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\nextract: {{aux_layers: [1, 3, 4]}}\n"
    )
    out = tmp_path / "speed.json"
    rc = _script().main(
        [
            "--config",
            str(cfg),
            "--random-drafter",
            "--dataset",
            str(prompts),
            "--num-prompts",
            "5",
            "--prompts-per-batch-size",
            "2",
            "--max-new-tokens",
            "6",
            "--batch-sizes",
            "1",
            "3",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    # --num-prompts above the set's 3: all 3, with a warning (was silent)
    assert (
        "p: 5 prompts asked (--num-prompts / benchmark.num_prompts) but the set has 3: all 3 measured"
        in res["warnings"]
    )
    assert (
        res["dtype"] == "float32"
        and res["headline_batch_size"] == 3
        and res["aux_layers"] == [1, 3, 4]
    )
    b1, b3 = res["rows"]
    assert (b1["batch_size"], b1["num_prompts"], b3["batch_size"], b3["num_prompts"]) == (
        1,
        2,
        3,
        3,
    )
    assert res["bench_3x6_s"] == res["bench_set_s"] == b3["wall_seconds"] > 0
    for r in (b1, b3):
        assert r["failures"] == 0 and r["mismatches"] == []  # float32: lossless
        assert r["speedup"] == pytest.approx(r["spec_tokens_per_s"] / r["greedy_tokens_per_s"])
        assert 0 < r["drafter_share"] < 1
        assert r["spec_tokens"] == r["greedy_tokens"]
        assert r["tau"] == pytest.approx(1 + sum(r["unconditional"]))


def test_offline_bench_speed_pick_spread_records_the_prompts(tmp_path, tiny_llama_dir):
    """--pick spread benchmarks prompts spread over the file (both the headline and a smaller batch's subset);
    --pick first's subset that leaves a category out is warned about in the JSON."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"Say {i}.", "category": "abc"[i // 2]}) + "\n"
            for i in range(6)
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\nextract: {{aux_layers: [1, 3, 4]}}\n"
    )
    mod = _script()
    rows = {}
    for pick, ids, nwarn in (("spread", ["q0", "q2", "q4"], 0), ("first", ["q0", "q1", "q2"], 1)):
        out = tmp_path / f"{pick}.json"
        rc = mod.main(
            [
                "--config",
                str(cfg),
                "--random-drafter",
                "--dataset",
                str(prompts),
                "--num-prompts",
                "3",
                "--pick",
                pick,
                "--prompts-per-batch-size",
                "2",
                "--max-new-tokens",
                "3",
                "--batch-sizes",
                "1",
                "3",
                "--json",
                str(out),
            ]
        )
        assert rc == 0
        res = json.loads(out.read_text())
        assert (res["prompt_pick"], res["prompt_ids"], len(res["warnings"])) == (pick, ids, nwarn)
        assert [r["num_prompts"] for r in res["rows"]] == [2, 3]
        assert (
            res["rows"][1]["prompt_ids"] == ids and res["rows"][1]["warnings"] == []
        )  # the headline's: top level
        rows[pick] = res["rows"][0]
    assert (
        "cover 2 of 3 categories (a, b)" in res["warnings"][0]
        and "(--pick spread takes them" in res["warnings"][0]
    )
    # the batch-1 row's own subset (2 of the 3) and its warning: first -> q0, q1 (category a); spread -> q0, q2
    assert (
        rows["first"]["prompt_ids"] == ["q0", "q1"]
        and "cover 1 of 3 categories (a)" in rows["first"]["warnings"][0]
    )
    assert rows["spread"]["prompt_ids"] == ["q0", "q2"]
    assert rows["spread"]["warnings"] == [
        "p: the 2 prompts benchmarked (of 6) cover 2 of 3 categories (a, b); tau and "
        "speedup are then not the set's (spread over the set, 2 prompts cannot hold "
        "all 3: take at least 3)"
    ]


def test_offline_bench_speed_failed_decoder_keeps_the_other_rows(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """A decoder that raises (e.g. a CUDA-graph fault on a new device) is recorded as an error row; the next decoder
    still runs, the JSON holds both, and the exit status is 1."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": t}) + "\n" for i, t in enumerate(["Hi", "2+2?"])
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\nextract: {{aux_layers: [1, 3, 4]}}\n"
    )
    mod = _script()
    real = mod.bench_prompts

    def flaky(*args, **kw):
        if kw.get("decoder") == "static":
            raise RuntimeError("capture boom")
        return real(*args, **kw)

    monkeypatch.setattr(mod, "bench_prompts", flaky)
    out = tmp_path / "speed.json"
    rc = mod.main(
        [
            "--config",
            str(cfg),
            "--random-drafter",
            "--dataset",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "4",
            "--batch-sizes",
            "1",
            "--headline-batch-size",
            "1",
            "--decoder",
            "static",
            "batched",
            "--json",
            str(out),
        ]
    )
    assert rc == 1
    res = json.loads(out.read_text())
    bad, good = res["rows"]
    assert (bad["decoder"], bad["error"]) == ("static", "RuntimeError: capture boom")
    assert (
        good["decoder"] == "batched"
        and good["failures"] == 0
        and good["spec_tokens"] == good["greedy_tokens"]
    )
    assert res["bench_set_s"] == good["wall_seconds"]
    assert "failed: RuntimeError: capture boom" in mod.markdown(res)


def test_offline_bench_speed_rows_record_the_effective_batch_size(tmp_path, tiny_llama_dir):
    """--batch-sizes 8 on 2 prompts decodes (and records) batch 2; the headline row is still found."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": t}) + "\n" for i, t in enumerate(["Hi", "2+2?"])
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\nextract: {{aux_layers: [1, 3, 4]}}\n"
    )
    out = tmp_path / "speed.json"
    rc = _script().main(
        [
            "--config",
            str(cfg),
            "--random-drafter",
            "--dataset",
            str(prompts),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "4",
            "--batch-sizes",
            "8",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert (row["batch_size"], row["num_prompts"]) == (2, 2)
    assert res["bench_set_s"] == row["wall_seconds"] > 0


def test_offline_bench_speed_checks_the_drafter_shape_and_takes_num_prompts_from_the_config(
    tmp_path, tiny_llama_dir
):
    """As 05: the run's own export of another shape than the config's drafter: section is refused, naming every
    differing field; another run's export (--drafter) is benchmarked with the difference as a warning in the JSON. The
    prompt count defaults to benchmark.num_prompts (it was always 80)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.errors import UserError
    from eagle3.export.writer import export_drafter
    from eagle3.verifier.load import verifier_dims

    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(0)
    d = Eagle3Drafter(
        DrafterArgs.from_hf_config(hf, draft_vocab_size=512), v.get_input_embeddings().weight
    )
    export_drafter(
        d,
        tmp_path / "out" / "drafter-sglang",
        "sglang",
        [2, 3, 4],
        {"name": "tiny", **verifier_dims(hf)},
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}."}) + "\n" for i in range(3))
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\ndata: {{draft_vocab_size: 512}}\n"
        f"extract: {{aux_layers: [2, 3, 4]}}\ndrafter: {{num_layers: 2, variant: eagle3.1}}\n"
        f"benchmark: {{num_prompts: 2}}\n"
    )
    args = [
        "--config",
        str(cfg),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "3",
        "--batch-sizes",
        "1",
    ]
    mod = _script()
    with pytest.raises(
        UserError,
        match=r"drafter-sglang: the drafter has variant 'eagle3' but the config's "
        r"drafter.variant is 'eagle3.1'; num_layers 1 but the config's drafter.num_layers "
        r"is 2 \(set those drafter fields back to the trained values, or train a drafter "
        r"of this shape with 04_train.py into a new train.output_dir",
    ):
        mod.main(args)
    other = tmp_path / "other"
    (tmp_path / "out" / "drafter-sglang").rename(other)
    out = tmp_path / "s.json"
    assert mod.main(args + ["--drafter", str(other), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["num_prompts"] == 2 and res["prompt_ids"] == ["q0", "q1"]
    other_verifier, shape = [
        w for w in res["warnings"] if w not in res["not_checked"]
    ]  # as 05 warns
    assert "num_layers 1 but the config's drafter.num_layers is 2" in shape
    assert other_verifier.startswith(
        f"drafter {other / 'eagle3_train.json'} was exported for verifier 'tiny'"
    )


def test_offline_bench_speed_flags_a_speedup_above_tau(tmp_path, tiny_llama_dir, monkeypatch):
    """A row whose speedup (1.40x, hand-made) exceeds its tau (1.02) carries the warning line of 05's check (the greedy
    baseline was slowed), logged and in the row's warnings; a row within tau none."""
    from eagle3.decoding.metrics import speedup_warning

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": t}) + "\n" for i, t in enumerate(["Hi", "2+2?"])
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\nextract: {{aux_layers: [1, 3, 4]}}\n"
    )
    mod = _script()
    real = mod.bench_prompts

    def made(*args, **kw):
        d = real(*args, **kw)
        return {**d, "tau": 1.02, "speedup": 1.40 if d["batch_size"] == 1 else 0.9}

    monkeypatch.setattr(mod, "bench_prompts", made)
    out = tmp_path / "speed.json"
    assert (
        mod.main(
            [
                "--config",
                str(cfg),
                "--random-drafter",
                "--dataset",
                str(prompts),
                "--num-prompts",
                "2",
                "--max-new-tokens",
                "4",
                "--batch-sizes",
                "1",
                "2",
                "--headline-batch-size",
                "1",
                "--decoder",
                "batched",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    one, two = json.loads(out.read_text())["rows"]
    assert one["warnings"] == [speedup_warning("p batch 1 (batched decoder)", 1.40, 1.02)]
    assert two["warnings"] == []


def test_offline_bench_speed_reports_the_checks_05_makes(tmp_path, tiny_llama_dir):
    """The speed script dropped 05's aux-layer mismatch warning (`aux, _ = resolve_aux_layers(...)`) and made none of
    05's `not_checked` lines: a drafter trained on other layers than the shards' was timed without a word. It now
    loads the drafter through 05's `load_checked_drafter` (and `check_before_load`): the same warnings and
    `not_checked` lines, in its JSON and its log."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.export.writer import export_drafter
    from eagle3.verifier.load import verifier_dims

    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(0)
    d = Eagle3Drafter(
        DrafterArgs.from_hf_config(hf, draft_vocab_size=512), v.get_input_embeddings().weight
    )
    drafter = tmp_path / "other"
    export_drafter(d, drafter, "sglang", [2, 3, 4], {"name": "tiny", **verifier_dims(hf)})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}."}) + "\n" for i in range(2))
    )
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "data_config.json").write_text(
        json.dumps({"verifier": "tiny", "aux_layers": [1, 3, 4]})
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tiny_llama_dir}, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\ndata: {{draft_vocab_size: 512}}\n"
        f"extract: {{output_dir: {shards}}}\n"
    )
    out = tmp_path / "s.json"
    assert (
        _script().main(
            [
                "--config",
                str(cfg),
                "--dataset",
                str(prompts),
                "--max-new-tokens",
                "3",
                "--batch-sizes",
                "1",
                "--drafter",
                str(drafter),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["aux_layers"] == [2, 3, 4]
    assert (
        f"aux layers differ: drafter {drafter / 'eagle3_train.json'} records [2, 3, 4] but shards "
        f"{shards / 'data_config.json'} record [1, 3, 4] (HF hidden_states indices); using the drafter's"
        in res["warnings"]
    )
    assert [w.split(":")[0].rsplit("/", 1)[-1] for w in res["not_checked"]] == [
        "eagle3_train.json records no ttt_length",
        "vocab_map.pt not found",
        "data_config.json records no chat_template_hash",
        "data_config.json records no chat_template_kwargs",
    ]  # the verifier record is there (tiny), so that one was checked
    assert all(w in res["warnings"] for w in res["not_checked"])


def test_random_drafter_is_the_configs_drafter():
    """The speed benches' untrained drafter takes the run config's drafter section (variant, depth, width): the
    ops and time of a draft depend on them (a second layer: 360 -> 530 ops per chain-3 draft on SmolLM2)."""
    from eagle3.config import DrafterConfig

    spec = importlib.util.spec_from_file_location("regen_step", ROOT / "bench" / "regen_step.py")
    regen_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen_step)
    random_drafter = _script()._random_drafter

    model = regen_step.tiny_model()
    plain = random_drafter(model, "cpu", None)
    assert (plain.args.num_layers, plain.args.variant) == (1, "eagle3")
    assert plain.args.intermediate_size == model.config.intermediate_size
    d = random_drafter(
        model, "cpu", None, DrafterConfig(num_layers=2, variant="eagle3.1", intermediate_size=40)
    )
    assert (d.args.num_layers, d.args.variant, d.args.intermediate_size) == (2, "eagle3.1", 40)
    assert (
        d.args.hidden_size == model.config.hidden_size
    )  # null fields still come from the verifier
    assert any(k.startswith("layers.1.") for k in d.state_dict())
