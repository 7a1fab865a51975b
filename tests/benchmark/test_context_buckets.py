"""Stage 05's context-length buckets (``benchmark.context_lengths``): bucket assignment and tau per bucket by hand,
the edges capped by the verifier's context, the long-context prompt builder, and 05 end to end on the tiny verifier
(each built prompt in its bucket, the bucket rows of bench.json / bench.md from the per-prompt rows)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import needs_shared_data
from pydantic import ValidationError

from eagle3.data.context_prompts import build_context_prompts, capped_edges, context_set, load_pairs
from eagle3.decoding.metrics import add_context_buckets, bucket_index, bucket_label, context_buckets
from eagle3.decoding.report import context_lines
from eagle3.errors import UserError
from eagle3.settings.benchmark import BenchmarkConfig


def test_bucket_index_and_labels_by_hand():
    edges = [4, 8, 16]
    assert [bucket_index(n, edges) for n in (1, 4, 5, 8, 9, 16, 17, 1000)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert [bucket_label(j, edges) for j in range(4)] == ["<=4", "5-8", "9-16", ">16"]


def test_tau_per_bucket_and_markdown_rows_by_hand():
    per_prompt = [
        {"prompt_tokens": 3, "accept_lengths": [1, 2]},  # <=4: 3 tokens / 2 steps
        {"prompt_tokens": 6, "accept_lengths": [3, 3, 1]},  # 5-8
        {"prompt_tokens": 8, "accept_lengths": [2]},  # 5-8: with the row above 9 / 4
        {"prompt_tokens": 20, "accept_lengths": [4, 4]},  # >16: 8 / 2
    ]
    rows = context_buckets(per_prompt, [4, 8, 16])
    assert [(r["bucket"], r["max_tokens"], r["prompts"], r["verify_steps"]) for r in rows] == [
        ("<=4", 4, 1, 2),
        ("5-8", 8, 2, 4),
        ("9-16", 16, 0, 0),
        (">16", None, 1, 2),
    ]
    assert [r["tau"] for r in rows[:2]] + [rows[3]["tau"]] == [1.5, 2.25, 4.0]
    assert math.isnan(rows[2]["tau"])
    # the bucket past the last edge is listed only when a prompt is there
    assert [r["bucket"] for r in context_buckets(per_prompt[:3], [4, 8, 16])] == [
        "<=4",
        "5-8",
        "9-16",
    ]
    report = {"datasets": [{"dataset": "mine", "per_prompt": per_prompt}]}
    assert context_lines(report) == []  # without edges: no table
    add_context_buckets(report, [])
    assert "context_edges" not in report and "context_buckets" not in report["datasets"][0]
    add_context_buckets(report, [4, 8, 16])
    assert report["context_edges"] == [4, 8, 16]
    assert context_lines(report)[-4:] == [
        "|---|---|---:|---:|---:|",
        "| mine | <=4 | 1 | 2 | 1.50 |",
        "| mine | 5-8 | 2 | 4 | 2.25 |",
        "| mine | >16 | 1 | 2 | 4.00 |",
    ]  # the empty bucket 9-16 has no row


def test_the_plot_panel_draws_tau_per_bucket():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eagle3.decoding.report import plot_acceptance, plot_context

    rows = [
        {"prompt_tokens": 3, "accept_lengths": [1, 2]},
        {"prompt_tokens": 6, "accept_lengths": [3, 3, 1, 2]},
        {"prompt_tokens": 20, "accept_lengths": [4, 4]},
    ]
    sets = [
        {"dataset": "a", "context_buckets": context_buckets(rows, [4, 8, 16])},
        {"dataset": "b", "context_buckets": context_buckets(rows[1:2], [4, 8, 16])},
    ]
    fig, ax = plt.subplots()
    plot_context(ax, sets)
    (la, lb) = ax.get_lines()
    # the empty bucket 9-16 is left out of a's line; x = the bucket's place among all labels
    assert list(la.get_xdata()) == [0, 1, 3] and list(la.get_ydata()) == [1.5, 2.25, 4.0]
    assert list(lb.get_xdata()) == [1] and list(lb.get_ydata()) == [2.25]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["<=4", "5-8", "9-16", ">16"]
    plt.close(fig)
    steps = {"conditional": [0.5], "unconditional": [0.5], "tau": 1.5}
    png = plot_acceptance([{**sets[0], **steps}], 1)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_edges_are_capped_by_the_verifier_context():
    # 2048 positions - 12 new tokens - 3 drafts = 2033 prompt tokens at most
    edges, warn = capped_edges([256, 512, 4096, 8192], 2048, 12, 3)
    assert edges == [256, 512, 2033]
    assert warn == [
        "benchmark.context_lengths: [4096, 8192] past the longest prompt the verifier's context allows (2033 "
        "tokens after max_new_tokens and steps): capped at 2033"
    ]
    assert capped_edges([256, 512], 2048, 12, 3) == ([256, 512], [])
    assert capped_edges([256, 99999], None, 12, 3) == ([256, 99999], [])
    with pytest.raises(UserError, match="lower benchmark.max_new_tokens"):
        capped_edges([256], 16, 14, 3)


def test_config_refuses_unordered_lengths():
    assert BenchmarkConfig().context_lengths == [] and BenchmarkConfig().context_prompts == 4
    with pytest.raises(ValidationError, match="must be positive and ascending"):
        BenchmarkConfig(context_lengths=[2048, 1024])
    with pytest.raises(ValidationError, match="must be positive and ascending"):
        BenchmarkConfig(context_lengths=[0, 1024])


def _words(msgs):
    """A toy prompt length: words of every message plus 2 per message."""
    return sum(len(m["content"].split()) + 2 for m in msgs)


def test_builder_takes_the_most_history_that_fits():
    pairs = [(f"q{i} " * (i % 3 + 1), f"a{i} " * 5) for i in range(20)]  # a pair: 1-3 + 5 words + 4
    prompts = build_context_prompts(_words, [12, 40, 1000], 2, pairs)
    assert [p.id for p in prompts] == [
        "ctx12-0",
        "ctx12-1",
        "ctx40-0",
        "ctx40-1",
        "ctx1000-0",
        "ctx1000-1",
    ]
    pool = pairs[:18]  # the last 2 rows are the final questions
    for p in prompts:
        L, i = map(int, p.id[3:].split("-"))
        final = pairs[19 - i][0]
        assert p.messages[-1] == {"role": "user", "content": final}
        hist = p.messages[:-1]
        n = len(hist) // 2
        start = i * 9  # the stride: 18 history rows / 2 prompts
        assert [m["content"] for m in hist] == [x for j in range(n) for x in pool[(start + j) % 18]]
        assert _words(p.messages) <= L or n == 0
        q, a = pool[(start + n) % 18]
        longer = hist + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        assert n == 18 or _words(longer + p.messages[-1:]) > L  # one more pair would not fit
    assert len(prompts[-1].messages) == 37  # 1000 words hold the whole pool
    with pytest.raises(
        UserError, match="benchmark.context_prompts: 20 needs more than 20 source rows"
    ):
        build_context_prompts(_words, [12], 20, pairs)


@needs_shared_data
def test_gsm8k_pairs_lose_their_calculator_annotations():
    pairs = load_pairs()
    assert len(pairs) == 1319 and not any("<<" in a for _, a in pairs)
    assert pairs[1][1].startswith("It takes 2/2=1 bolt of white fiber")
    # the set's label stays apart from the other sets' (a prompt file named context.jsonl)
    (label, built), warn = context_set([200], 1, _words, None, 8, 2, taken=["context", "context#2"])
    assert label == "context#3" and warn == [] and [p.id for p in built] == ["ctx200-0"]
    assert built[0].messages[-1]["content"] == pairs[-1][0] and _words(built[0].messages) <= 200


@pytest.fixture(scope="module")
def context_run(tmp_path_factory, tiny_llama_dir):
    """The tiny verifier (2,048 positions), an exported random drafter, a 2-prompt file, and a config whose
    context_lengths [256, 1024, 4096] 05 caps at 2048 - 8 - 2 = 2038."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.export.writer import export_drafter
    from eagle3.verifier.load import verifier_dims

    root = tmp_path_factory.mktemp("ctx-run")
    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(3)
    d = Eagle3Drafter(
        DrafterArgs.from_hf_config(hf, draft_vocab_size=512), v.get_input_embeddings().weight
    )
    export_drafter(d, root / "drafter", "sglang", [2, 3, 4], {"name": "tiny", **verifier_dims(hf)})
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(["Hi.", "2+2?"])
        )
    )
    cfg = root / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {root / 'out'}\n"
        f"verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {prompts}}}\ndata: {{draft_vocab_size: 512}}\n"
        f"benchmark: {{datasets: [{prompts}], max_new_tokens: 8, steps: 2, context_lengths: [256, 1024, 4096], "
        f"context_prompts: 2}}\n"
    )
    return root, cfg


@needs_shared_data
def test_05_reports_tau_per_context_bucket(context_run):
    from eagle3.config import load_config
    from eagle3.stages.benchmark import run

    root, cfg = context_run
    assert run(load_config(cfg), drafter_dir=str(root / "drafter")) == 0
    rep = json.loads((root / "out" / "bench" / "bench.json").read_text())
    assert rep["context_edges"] == [256, 1024, 2038]
    assert any(
        "[4096] past the longest prompt" in w and "capped at 2038" in w for w in rep["warnings"]
    )
    sets = {d["dataset"]: d for d in rep["datasets"]}
    ctx = sets["context"]
    assert [p["id"] for p in ctx["per_prompt"]] == [
        f"ctx{L}-{i}" for L in (256, 1024, 2038) for i in range(2)
    ]
    low = {256: 0, 1024: 256, 2038: 1024}
    for p in ctx["per_prompt"]:  # each built prompt lies in the bucket its length was built for
        L = int(p["id"][3:].split("-")[0])
        assert low[L] < p["prompt_tokens"] <= L
        assert L - p["prompt_tokens"] < 400  # filled: a GSM8K pair is under 400 tokens
    for d in rep["datasets"]:  # the bucket rows from the per-prompt rows, by hand
        for j, b in enumerate(d["context_buckets"]):
            mine = [
                p
                for p in d["per_prompt"]
                if bucket_index(p["prompt_tokens"], [256, 1024, 2038]) == j
            ]
            steps = sum(len(p["accept_lengths"]) for p in mine)
            assert b["prompts"] == len(mine) and b["verify_steps"] == steps
            emitted = sum(sum(p["accept_lengths"]) for p in mine)
            assert b["tau"] == pytest.approx(emitted / steps) if steps else b["tau"] is None
    assert [b["prompts"] for b in ctx["context_buckets"]] == [2, 2, 2]
    assert [b["prompts"] for b in sets["prompts"]["context_buckets"]] == [
        2,
        0,
        0,
    ]  # short prompts: bucket 0
    md = (root / "out" / "bench" / "bench.md").read_text()
    b = ctx["context_buckets"][2]
    assert f"| context | 1025-2038 | 2 | {b['verify_steps']} | {b['tau']:.2f} |" in md
    assert "| prompts | 257-1024 |" not in md  # empty buckets have no row
