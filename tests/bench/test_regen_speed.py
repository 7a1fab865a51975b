"""bench/regen_speed.py at a tiny size on CPU: every run, the ratios and the answer comparison are consistent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import regen_speed as rsp  # noqa: E402


def test_spread():
    assert rsp.spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert rsp.spread([1, 2], 5) == [1, 2]


def test_roofline_by_hand():
    st = {
        "decode_steps": 10,
        "seconds": 2.0,
        "engine_stats": {"kv_tokens_needed": 1000, "kv_bytes_per_token": 4, "kv_bytes_read": 8000},
    }
    r = rsp.roofline(st, weight_bytes=100, bandwidth=1000.0)
    # (10 steps x 100 weight bytes + 1000 tokens x 4 bytes) / 1000 B/s = 5 s of roofline in 2 s measured
    assert r["bytes_needed"] == 5000 and r["roofline_s"] == 5.0 and r["ratio_to_roofline"] == 2.5
    assert r["kv_read_over_needed"] == 2.0 and r["ms_per_decode_step"] == 200.0
    assert (
        rsp.roofline(st, 100, None) is None
    )  # JSON null: no bandwidth known (CPU), not a roofline of 0
    st["engine_stats"].update(decode_s=1.25, prefill_s=0.5)
    r = rsp.roofline(st, weight_bytes=100, bandwidth=1000.0)
    res = {
        "main": {
            "conversations": 1,
            "engine": "slots",
            "answers": 1,
            "new_tokens": 10,
            "seconds": 2.0,
            "tokens_per_s": 5.0,
            "decode_steps": 10,
        },
        "roofline": r,
        "verifier": "v",
        "dtype": "bf16",
        "device": "d",
        "batch_size": 4,
        "max_new_tokens": 8,
        "max_context": 16,
        "bandwidth_gb_s": 1.0,
    }
    assert "| 1.2 / 0.5 / 0.2 |" in rsp.markdown(res)  # decode / prefill / the rest of the 2 s
    assert r["first_step_s"] is None and "first steps" not in rsp.markdown(
        res
    )  # an engine without the stat
    st["engine_stats"]["first_step_s"] = {"8": 0.25, "4": 0.15}
    res["roofline"] = rsp.roofline(st, weight_bytes=100, bandwidth=1000.0)
    assert res["roofline"]["first_step_s"] == 0.4
    assert "| 0.4 / 6 |" in rsp.markdown(
        res
    )  # 10 tokens in the 2 s less 0.4 s of first steps = 6.25 tokens/s
    assert "padding overhead" not in rsp.markdown(res)  # an engine without the prefill token counts
    st["engine_stats"].update(prefill_calls=3, prefill_tokens=400, prefill_padded_tokens=500)
    res["roofline"] = rsp.roofline(st, weight_bytes=100, bandwidth=1000.0)
    assert "| 3 / 400 / 500 (1.25x) |" in rsp.markdown(res)  # 500 padded for 400 prompt tokens
    assert "reused from the previous turn" not in rsp.markdown(
        res
    )  # an engine without the reuse counts
    st["engine_stats"].update(reused_tokens=150, prefix_reuse=True)
    res["roofline"] = rsp.roofline(st, weight_bytes=100, bandwidth=1000.0)
    assert "(prefix reuse on) | 400 / 150 |" in rsp.markdown(res)


def test_markdown_says_the_roofline_is_unknown_without_a_bandwidth():
    """On the CPU (no device copy, bandwidth None) the title read "HBM bandwidth 0 GB/s (device copy)": it now says the
    bandwidth and the roofline are unknown there, and no roofline table is printed; with a bandwidth, its GB/s."""
    st = {
        "decode_steps": 10,
        "seconds": 2.0,
        "engine_stats": {"kv_tokens_needed": 1000, "kv_bytes_per_token": 4, "kv_bytes_read": 8000},
    }
    res = {
        "main": {
            "conversations": 1,
            "engine": "slots",
            "answers": 1,
            "new_tokens": 10,
            "seconds": 2.0,
            "tokens_per_s": 5.0,
            "decode_steps": 10,
        },
        "roofline": rsp.roofline(st, 100, None),
        "verifier": "v",
        "dtype": "float32",
        "device": "cpu",
        "batch_size": 4,
        "max_new_tokens": 8,
        "max_context": 16,
        "bandwidth_gb_s": None,
    }
    md = rsp.markdown(res)
    assert (
        "context cap 16; memory bandwidth unknown on cpu (measured by a device copy on CUDA only), so no "
        "roofline: not applicable." in md
    )
    assert "GB/s" not in md and "ratio to roofline" not in md
    res.update(bandwidth_gb_s=4335.2, roofline=rsp.roofline(st, 100, 4335.2e9))
    md = rsp.markdown(res)
    assert (
        "context cap 16; HBM bandwidth 4335 GB/s (device copy)." in md
        and "| ratio to roofline |" in md
    )


def test_bound_is_not_called_memory_bound_without_a_bandwidth(tmp_path, monkeypatch):
    """A step far above its launch floor was called memory-bound on the CPU, where no bandwidth was measured to
    compare its bytes with: it is 'not launch-bound (memory bandwidth unknown)' there, memory-bound with one."""
    from eagle3.config import load_config

    monkeypatch.setattr(
        rsp, "step_ms", lambda model, slots, width, *a, **k: 1.0 if width == 256 else 2.0
    )
    f = tmp_path / "c.yaml"
    f.write_text("run_name: t\nverifier: {path: x}\nprompts: {source: humaneval}\n")
    st = {
        "seconds": 1.0,
        "decode_steps": 100,
        "engine_stats": {"kv_bytes_per_token": 4},
    }  # 10 ms a step
    assert (
        rsp.bound(None, st, load_config(f), 4, 8, None)["verdict"]
        == "not launch-bound (memory bandwidth unknown)"
    )
    b = rsp.bound(None, st, load_config(f), 4, 8, 1e12)
    assert b["verdict"] == "memory-bound" and b["full_cache_step_bandwidth_share"] > 0


def test_bench_runs_tiny_on_cpu(tmp_path, tiny_llama_dir):
    src = tmp_path / "convs.jsonl"
    turns = [1, 3, 1, 2, 1, 1]
    src.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "messages": [
                        m
                        for t in range(n)
                        for m in (
                            {"role": "user", "content": f"Q{i}.{t}: name {t + 2} animals"},
                            {"role": "assistant", "content": "x"},
                        )
                    ],
                }
            )
            + "\n"
            for i, n in enumerate(turns)
        )
    )
    out = tmp_path / "r.json"
    assert (
        rsp.main(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                "--prompts",
                str(src),
                "--baseline-num",
                "4",
                "--hf-num",
                "2",
                "--batch-size",
                "3",
                "--max-new-tokens",
                "5",
                "--set",
                "prompts.regen_check_every=2",
                "--reuse-ab",
                "6",
                "--prefill-graphs-ab",
                "5",
                "--prefill-pack-ab",
                "4",
                "--batch-ab",
                "2",
                "--json",
                str(out),
                "--md",
                str(tmp_path / "r.md"),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["main"]["conversations"] == 6 and res["main"]["answers"] == sum(turns)
    runs = res["baseline"]["runs"]
    sub = rsp.spread(turns, 4)
    assert runs["slots"]["answers"] == runs["static"]["answers"] == sum(sub)
    assert runs["hf_continuous"]["answers"] == sum(rsp.spread(sub, 2))
    assert (
        res["baseline"]["ratios"]["slots/static"]
        == runs["slots"]["tokens_per_s"] / runs["static"]["tokens_per_s"]
    )
    eq = res["baseline"]["equality"]
    assert eq["answers_compared"] == sum(sub) and eq["identical"] == sum(sub)  # fp32: same tokens
    assert (
        res["roofline"] is None and res["bandwidth_gb_s"] is None
    )  # no roofline on CPU: null, not 0 or {}
    # no bandwidth on CPU: not called memory-bound (nothing compared the bytes read with a bandwidth)
    assert res["bound"]["verdict"] in (
        "launch-bound",
        "not launch-bound (memory bandwidth unknown)",
    )
    assert (
        res["bound"]["step_ms_measured"] > 0
        and "full_cache_step_bandwidth_share" not in res["bound"]
    )
    assert "| main | slots | 6 |" in (tmp_path / "r.md").read_text()
    ab = res["prefix_reuse_ab"]  # the same 6 conversations with prefix reuse on and off
    assert ab["conversations"] == 6 and ab["identical"] == ab["answers_compared"] == sum(
        turns
    )  # fp32: same tokens
    assert ab["differing_first_turns_checked"] == ab["near_ties"] == 0 and ab["max_gap"] is None
    assert ab["tie_tolerance"] == 1e-3  # fp32's default
    assert ab["on"]["reused_tokens"] > 0 and ab["off"]["reused_tokens"] == 0
    assert ab["on"]["prefill_tokens"] + ab["on"]["reused_tokens"] == ab["off"]["prefill_tokens"]
    assert (
        "| on |" in (tmp_path / "r.md").read_text()
        and "Prefix reuse on / off" in (tmp_path / "r.md").read_text()
    )
    pg = res[
        "prefill_graphs_ab"
    ]  # 5 conversations with bucketed prefill (eager on the CPU) on and off
    n5 = sum(rsp.spread(turns, 5))
    assert (
        pg["conversations"] == 5 and pg["identical"] == pg["answers_compared"] == n5
    )  # fp32: same tokens
    assert pg["differing_first_turns_checked"] == 0 and pg["max_gap"] is None
    on, off = pg["on"], pg["off"]
    assert (
        on["prefill_graph_captures"] == off["prefill_graph_captures"] == 0
    )  # CPU: nothing captured
    assert (
        sum(on["prefill_buckets"].values()) == on["prefill_calls"] and off["prefill_buckets"] == {}
    )
    assert (
        on["prefill_tokens"] == off["prefill_tokens"]
        and on["prefill_padded_tokens"] >= off["prefill_padded_tokens"]
    )
    md = (tmp_path / "r.md").read_text()
    assert (
        "Prefill graphs on / off" in md
        and f"{pg['identical']} of {pg['answers_compared']} answers identical" in md
    )
    pp = res["prefill_pack_ab"]  # 4 conversations with packed prefill (eager on the CPU) on and off
    n4 = sum(rsp.spread(turns, 4))
    assert (
        pp["conversations"] == 4 and pp["identical"] == pp["answers_compared"] == n4
    )  # fp32: same tokens
    on, off = pp["on"], pp["off"]
    assert (
        on["prefill_pack"] is True
        and off["prefill_pack"] is False
        and on["prefill_graph_captures"] == 0
    )
    assert sum(on["prefill_buckets"].values()) == on["prefill_calls"] and all(
        k[0] == "q" for k in on["prefill_buckets"]
    )
    assert on["prefill_padded_tokens"] == sum(
        int(k[1:].split("+")[0]) * n for k, n in on["prefill_buckets"].items()
    )
    assert on["prefill_tokens"] == off["prefill_tokens"]
    assert set(on["prefill_first_s"]) == set(on["prefill_buckets"]) and off["prefill_first_s"] == {}
    assert f"on {len(on['prefill_first_s'])} shapes in" in md
    assert (
        "Packed prefill on / off" in md
        and f"{pp['identical']} of {pp['answers_compared']} answers identical" in md
    )
    ba = res["batch_ab"]  # the main input again at 2 decode rows against the main run's 3
    assert ba["sizes"] == [3, 2] and ba["conversations"] == 6 and "error" not in ba
    assert (
        ba["identical"] == ba["answers_compared"] == sum(turns)
    )  # fp32: the batch size changes no token
    assert (
        ba["runs"]["3"]["new_tokens"] == res["main"]["new_tokens"] == ba["runs"]["2"]["new_tokens"]
    )
    assert (
        ba["runs"]["3"]["seconds"] == res["main"]["seconds"]
    )  # the main run is the 3-row arm, not run again
    assert (
        ba["runs"]["2"]["decode_steps"] > ba["runs"]["3"]["decode_steps"]
    )  # fewer rows: more steps
    assert ba["speed_ratio"] == ba["runs"]["2"]["tokens_per_s"] / ba["runs"]["3"]["tokens_per_s"]
    assert (
        "Decode rows 2 against the main run's 3" in md
        and "| 2 | " in md
        and "2/3 rows: tokens/s" in md
    )


def test_reuse_ab_counts_differences_by_logit_gap(tiny_llama_dir, monkeypatch):
    """--reuse-ab's difference count: for each conversation's first differing turn, the gap between the two runs'
    tokens at the first differing position, teacher-forced on the verifier, checked against a full reference
    forward; near-ties within benchmark.tie_tolerance; later turns of a differing conversation are not checked."""
    import torch

    from eagle3.chat.template import ChatOptions, generation_prompt
    from eagle3.config import load_config
    from eagle3.verifier.load import load_verifier, stop_token_ids

    cfg = load_config(
        ROOT / "configs" / "tiny-llama.yaml",
        [f"verifier.path={tiny_llama_dir}", "benchmark.tie_tolerance=0.5"],
    )
    model, tok = load_verifier(cfg.verifier)
    opts = ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning)
    stops = sorted(stop_token_ids(tok))
    common = tok("Sure, here", add_special_tokens=False)["input_ids"]

    def ref_logits(messages):  # the whole sequence through the model, last position's logits
        ids = (
            tok(generation_prompt(tok, messages, opts), add_special_tokens=False)["input_ids"]
            + common
        )
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].float()

    u0, u1 = (
        {"role": "user", "content": "Name two animals."},
        {"role": "user", "content": "And two more?"},
    )
    a0 = {
        "role": "assistant",
        "content": "Cat and dog.",
        "tokens": tok("Cat and dog.", add_special_tokens=False)["input_ids"],
    }
    # conversation 0: turn 0 identical, turn 1 differs after `common` by a near-tie (the top token vs the one whose
    # logit is nearest 0.2 below it); conversation 1: turn 0 differs after `common` by a wide gap (the top token vs
    # a stop: one answer ends there), its turn 1 differs too but sees a different history (not checked)
    l0 = ref_logits([u0, a0, u1])
    top0 = int(l0.argmax())
    near = int((l0 - (l0[top0] - 0.2)).abs().argmin())
    l1 = ref_logits([u0])
    top1 = int(l1.argmax())
    gap_tie, gap_wide = float(l0[top0] - l0[near]), float(l1[top1] - l1[stops].max())
    assert 0 < gap_tie <= 0.5 < gap_wide
    on = [
        {
            "messages": [
                u0,
                a0,
                u1,
                {"role": "assistant", "content": "x", "tokens": common + [top0, 5]},
            ]
        },
        {
            "messages": [
                u0,
                {"role": "assistant", "content": "y", "tokens": common + [top1]},
                u1,
                {"role": "assistant", "content": "z", "tokens": [7]},
            ]
        },
    ]
    off = [
        {
            "messages": [
                u0,
                a0,
                u1,
                {"role": "assistant", "content": "x", "tokens": common + [near]},
            ]
        },
        {
            "messages": [
                u0,
                {"role": "assistant", "content": "y", "tokens": list(common)},
                u1,
                {"role": "assistant", "content": "z", "tokens": [8]},
            ]
        },
    ]

    def fake_run(model, tok, convs, engine, cfg, batch_size, max_new, opts_kw):
        reuse = opts_kw["slots"]["prefix_reuse"]
        st = {
            "seconds": 1.0,
            "tokens_per_s": 10.0,
            "new_tokens": 10,
            "decode_steps": 5,
            "engine_stats": {
                "prefill_s": 0.5,
                "decode_s": 0.4,
                "prefill_calls": 2,
                "prefill_tokens": 40 - 10 * reuse,
                "reused_tokens": 10 * reuse,
            },
        }
        return (on if reuse else off), st

    monkeypatch.setattr(rsp, "timed_run", fake_run)
    ab = rsp.reuse_ab(model, tok, cfg, [{}, {}], 2, 8, {"slots": {"prefix_reuse": True}})
    assert ab["answers_compared"] == 4 and ab["identical"] == 1  # every turn, as before
    assert (
        ab["answers_compared_to_first_difference"] == 3 and ab["identical_to_first_difference"] == 1
    )
    assert (
        ab["differing_first_turns_checked"] == 2
        and ab["tie_tolerance"] == 0.5
        and ab["near_ties"] == 1
    )
    assert ab["gaps"] == pytest.approx([gap_tie, gap_wide], abs=1e-4)
    assert ab["max_gap"] == pytest.approx(gap_wide, abs=1e-4)
    md = rsp.markdown(
        {
            "main": {
                "conversations": 2,
                "engine": "slots",
                "answers": 4,
                "new_tokens": 10,
                "seconds": 1.0,
                "tokens_per_s": 10.0,
                "decode_steps": 5,
            },
            "verifier": "v",
            "dtype": "float32",
            "device": "cpu",
            "batch_size": 2,
            "max_new_tokens": 8,
            "max_context": 16,
            "bandwidth_gb_s": None,
            "prefix_reuse_ab": ab,
        }
    )
    assert (
        f"1 of 4 answers identical; 1 of 2 first differences are near-ties (logit gap <= 0.5), max gap "
        f"{ab['max_gap']}."
    ) in md


def test_setting_ab_order_and_first_steps(tiny_llama_dir, monkeypatch):
    """--ab-off-first runs the setting off, then on (recorded as ``order``, the table in that order); each run's
    first decode steps per slot prefix (engine_stats first_step_s, summed over prefixes) are kept and shown."""
    from eagle3.config import load_config
    from eagle3.verifier.load import load_verifier

    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml", [f"verifier.path={tiny_llama_dir}"])
    model, tok = load_verifier(cfg.verifier)
    convs = [
        {
            "messages": [
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "a", "tokens": [5, 6]},
            ]
        }
    ]
    seen = []

    def fake_run(model, tok, convs_, engine, cfg, batch_size, max_new, opts_kw):
        on = opts_kw["slots"]["prefill_graphs"]
        seen.append(on)
        es = {
            "prefill_s": 0.5,
            "decode_s": 4.0 if on else 1.0,
            "prefill_calls": 2,
            "prefill_tokens": 40,
            "reused_tokens": 0,
            "prefill_padded_tokens": 64 if on else 40,
            "prefill_graph_captures": 2 * on,
            "prefill_capture_s": 0.25 * on,
            "prefill_buckets": {"2x32": 2} if on else {},
            "first_step_s": {"1024": 2.5, "64": 0.5} if on else {"1024": 0.25},
        }
        return convs, {
            "seconds": 5.0,
            "tokens_per_s": 2.0,
            "new_tokens": 10,
            "decode_steps": 5,
            "engine_stats": es,
        }

    monkeypatch.setattr(rsp, "timed_run", fake_run)
    pg = rsp.prefill_graphs_ab(
        model, tok, cfg, convs, 2, 8, {"slots": {"prefill_graphs": False}}, off_first=True
    )
    assert seen == [False, True] and pg["order"] == ["off", "on"]
    assert pg["on"]["first_step_s"] == 3.0 and pg["off"]["first_step_s"] == 0.25
    assert pg["identical"] == pg["answers_compared"] == 1
    assert pg["speed_ratio"] == 1.0  # same seconds and tokens in the fake runs
    assert pg["steady_speed_ratio"] == pytest.approx(
        (10 / (5.0 - 3.0)) / (10 / (5.0 - 0.25))
    )  # 2.375x
    md = rsp.markdown(
        {
            "main": {
                "conversations": 1,
                "engine": "slots",
                "answers": 1,
                "new_tokens": 10,
                "seconds": 1.0,
                "tokens_per_s": 10.0,
                "decode_steps": 5,
            },
            "verifier": "v",
            "dtype": "float32",
            "device": "cpu",
            "batch_size": 2,
            "max_new_tokens": 8,
            "max_context": 16,
            "bandwidth_gb_s": None,
            "prefill_graphs_ab": pg,
        }
    )
    rows = [
        line for line in md.splitlines() if line.startswith("| off |") or line.startswith("| on |")
    ]
    assert (
        rows[0].startswith("| off |")
        and "| 1.00 (0.2) |" in rows[0]
        and "| 4.00 (3.0) |" in rows[1]
    )
    assert "on/off: tokens/s 1.000x (2.375x without each run's first decode steps)" in md
    seen.clear()
    assert rsp.prefill_graphs_ab(model, tok, cfg, convs, 2, 8, {"slots": {}})["order"] == [
        "on",
        "off",
    ]
    assert seen == [True, False]


def test_batch_ab_reports_out_of_memory(tiny_llama_dir, monkeypatch):
    """--batch-ab at a size the GPU cannot hold: the error is the result (one line), the bench goes on."""
    import torch

    from eagle3.config import load_config
    from eagle3.verifier.load import load_verifier

    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml", [f"verifier.path={tiny_llama_dir}"])
    model, tok = load_verifier(cfg.verifier)

    def oom(*a, **k):
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 120.00 GiB\nmore detail"
        )

    monkeypatch.setattr(rsp, "timed_run", oom)
    ba = rsp.batch_ab(model, tok, cfg, [{}], [], {}, 1024, 2048, 8, {"slots": {}})
    assert ba == {
        "sizes": [1024, 2048],
        "conversations": 1,
        "error": "OutOfMemoryError at 2048 rows: CUDA out of memory. Tried to allocate 120.00 GiB",
    }
    md = rsp.markdown(
        {
            "main": {
                "conversations": 1,
                "engine": "slots",
                "answers": 1,
                "new_tokens": 10,
                "seconds": 1.0,
                "tokens_per_s": 10.0,
                "decode_steps": 5,
            },
            "verifier": "v",
            "dtype": "float32",
            "device": "cpu",
            "batch_size": 1024,
            "max_new_tokens": 8,
            "max_context": 16,
            "bandwidth_gb_s": None,
            "batch_ab": ba,
        }
    )
    assert "2048 rows: OutOfMemoryError at 2048 rows" in md


def test_batch_ab_needs_the_slots_engine(tmp_path):
    from eagle3.errors import UserError

    with pytest.raises(UserError, match="--batch-ab compares the slots engine at two batch sizes"):
        rsp.main(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--main-engine",
                "static",
                "--batch-ab",
                "8",
            ]
        )


def test_prefill_probe_counts_and_table(tiny_llama_dir, monkeypatch):
    """The probe's token counts and matmul weights by hand (every parameter but the embeddings), and its table with
    the main run's own prefill rate (500 padded tokens in 0.5 s = 1000 tokens/s, 2 forwards = 250 ms each). The
    tiny verifier runs on the CPU, also where CUDA exists (its sync sites: the test below)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from eagle3.config import load_config
    from eagle3.verifier.load import load_verifier

    cfg = load_config(ROOT / "configs" / "tiny-llama.yaml", [f"verifier.path={tiny_llama_dir}"])
    model, _ = load_verifier(cfg.verifier)
    pp = rsp.prefill_probe(model, shapes=((1, 8), (3, 16)), reps=2)
    want = sum(
        p.numel()
        for n, p in model.named_parameters()
        if "embed_tokens" not in n and "lm_head" not in n
    )
    assert pp["linear_params"] == want > 0
    assert [(r["rows"], r["width"], r["tokens"]) for r in pp["rows"]] == [(1, 8, 8), (3, 16, 48)]
    for r in pp["rows"]:
        assert 0 < r["host_ms"] <= r["device_ms"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["device_ms"] / 1000))
        assert r["linear_tflops"] == pytest.approx(2 * want * r["tokens_per_s"] / 1e12)
    rf = {"prefill_padded_tokens": 500, "prefill_s": 0.5, "prefill_calls": 2}
    text = "\n".join(rsp.probe_markdown(pp, rf))
    assert "| 3 x 16 | 48 |" in text and "= 1000 tokens/s, 250.0 ms a forward" in text
    assert pp["sync_sites"] == [] and "Host syncs" not in text  # the CPU has no sync debug mode
    pp["sync_sites"] = ["a.py:3", "b.py:7"]
    assert (
        "Host syncs in one prefill forward (`torch.cuda.set_sync_debug_mode`): `a.py:3`, `b.py:7`."
        in "\n".join(rsp.probe_markdown(pp, rf))
    )


def test_sync_sites_restores_the_mode_and_is_empty_without_cuda(monkeypatch):
    """Without CUDA nothing runs under the debug mode; with it (faked here), each synchronising warning's line is
    kept once, other warnings are not, and the previous mode comes back even when ``fn`` raises."""
    import warnings

    import torch

    assert rsp.sync_sites(lambda: None) == []
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def fn():
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "x.py", 5)
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "x.py", 5)
        warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, "a.py", 9)
        warnings.warn_explicit("something else", UserWarning, "z.py", 1)

    assert rsp.sync_sites(fn) == ["a.py:9", "x.py:5"] and modes == ["warn", 0]

    def boom():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        rsp.sync_sites(boom)
    assert modes[-1] == 0


def test_warm_up_is_labelled_and_kept_within_the_run_sizes(tmp_path, tiny_llama_dir, capsys):
    """The unmeasured warm-up before the main run prints ``warm-up (not measured): ...`` (before: a line like the
    main run's, with other figures) and stays within the run's sizes: the first turn of min(8, --batch-size)
    conversations at min(8, --max-new-tokens) new tokens (before: 8 rows, every turn, 8 tokens)."""
    src = tmp_path / "convs.jsonl"
    turns = [3, 2, 1, 2]
    src.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "messages": [
                        m
                        for t in range(n)
                        for m in (
                            {"role": "user", "content": f"Q{i}.{t}: name {t + 2} animals"},
                            {"role": "assistant", "content": "x"},
                        )
                    ],
                }
            )
            + "\n"
            for i, n in enumerate(turns)
        )
    )
    assert (
        rsp.main(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                "--prompts",
                str(src),
                "--baseline-num",
                "0",
                "--batch-size",
                "2",
                "--max-new-tokens",
                "3",
                "--no-bound",
                "--json",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    lines = [x for x in capsys.readouterr().out.splitlines() if " conversations, " in x]
    assert lines[0].startswith("warm-up (not measured): 2 conversations, 2 answers, ")
    assert int(lines[0].split(" answers, ")[1].split(" tokens")[0]) <= 2 * 3
    assert lines[1].startswith(f"slots: 4 conversations, {sum(turns)} answers, ")
    assert rsp.first_turns(
        [
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "x"},
                ],
            }
        ]
    )[0]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def test_a_sample_size_above_the_pool_is_warned_as_01_warns(tmp_path, caplog):
    """bench/regen_speed.py samples the config's sources with prompts.sample_size as 01 does, but a sample_size above
    the conversations there are was silent (01 warned); it now warns with 01's line (readers.short_pool_warning)."""
    from eagle3.config import load_config

    src = tmp_path / "q.jsonl"
    src.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"u{i}"}]}) + "\n"
            for i in range(3)
        )
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\nverifier: {{path: {tmp_path}}}\nprompts: {{source: {src}, sample_size: 7}}\n"
    )
    with caplog.at_level("WARNING"):
        assert len(rsp.read_input(load_config(cfg), None)) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "prompts.sample_size 7: only 3 conversations left after reading and dedupe; keeping all 3"
    ]
