"""prompts.reuse_answers (eagle3.regen.reuse_answers): the match key and the merge by hand, and 01 growing a
regenerated set: the same prompts.jsonl as a full regeneration (fp32), only the new conversations regenerated, and
one-line refusals for other settings, a missing report or a bad line."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
from test_prompts import A, U, _jsonl

from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.regen import reuse_answers as ra
from eagle3.stages.prepare_prompts import run
from eagle3.stages.prompts_manifest import report_path

# a regenerating 01's settings (eagle3.stages.prompts_manifest.settings) as its report records them
REGEN = {
    "format": "messages",
    "sample_size": None,
    "dedupe": True,
    "system_prompt": None,
    "regenerate": True,
    "limit": None,
    "source": "a.jsonl",
}


def test_conversation_key_by_hand():
    """A prompt-only input matches its regenerated output; multi-turn inputs match whatever their old answers were;
    token ids and reasoning are ignored, tool calls and tools are not; another user turn is another key."""
    k = ra.conversation_key
    assert k({"messages": [U("Hi")]}) == k(
        {"id": "x", "messages": [U("Hi"), {**A("Hello!"), "tokens": [1, 2]}]}
    )
    assert k({"messages": [U("Hi"), A("old"), U("More")]}) == k(
        {"messages": [U("Hi"), {**A("new"), "reasoning_content": "r"}, U("More"), A("x")]}
    )
    assert k({"messages": [U("Hi")]}) != k({"messages": [U("Hi "), A("x")]})
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
    }
    tool = {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert k({"messages": [U("Q"), call, tool]}) != k({"messages": [U("Q"), tool]})
    assert k({"messages": [U("Q")], "tools": [{"name": "f"}]}) != k({"messages": [U("Q")]})


def test_split_and_merge_by_hand():
    """Reused positions keep the earlier conversation, the others take the regenerated ones in order; a failed
    regeneration (missing from the output) is dropped, as a full regeneration drops it."""
    convs = [{"id": i, "messages": [U(f"q{i}")]} for i in range(5)]
    earlier = {
        ra.conversation_key(convs[1]): {"id": 1, "messages": [U("q1"), A("old1")]},
        ra.conversation_key(convs[3]): {"id": 3, "messages": [U("q3"), A("old3")]},
    }
    reused, todo = ra.split(convs, earlier)
    assert [c["id"] for c in todo] == [0, 2, 4] and [r is not None for r in reused] == [
        False,
        True,
        False,
        True,
        False,
    ]
    regenerated = [
        {"id": 0, "messages": [U("q0"), A("a0")]},
        {"id": 4, "messages": [U("q4"), A("a4")]},
    ]  # 2 failed
    out = ra.merge(convs, reused, regenerated)
    assert [(c["id"], c["messages"][1]["content"]) for c in out] == [
        (0, "a0"),
        (1, "old1"),
        (3, "old3"),
        (4, "a4"),
    ]


def _config(tmp_path, tiny_llama_dir, sources, max_new=5, reuse=None, out="out"):
    f = tmp_path / f"{out}.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / out}\n"
        f"verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {json.dumps(sources)}, format: messages, regenerate: true, "
        f"max_new_tokens: {max_new}, gen_batch_size: 2, regen_cuda_graphs: false"
        + (f", reuse_answers: {reuse}" if reuse else "")
        + "}\nextract: {max_length: 256}\n"
    )
    return load_config(f)


def test_01_grows_a_regenerated_set_reusing_its_answers(tmp_path, tiny_llama_dir, capsys):
    """Sources A, then A + B: 01 with prompts.reuse_answers = A's (gzipped) prompts.jsonl regenerates only B's
    conversations, and writes byte for byte the prompts.jsonl a full regeneration of A + B writes (fp32); the report
    says how many were reused."""
    a = _jsonl(
        tmp_path / "a.jsonl",
        [
            {"id": "a0", "messages": [U("Hi there"), A("x"), U("And then?"), A("y")]},
            {"id": "a1", "messages": [U("Count to three")]},
            {"id": "a2", "messages": [U("Name a colour"), A("red")]},
        ],
    )
    b = _jsonl(
        tmp_path / "b.jsonl",
        [
            {"id": "b0", "messages": [U("Write a poem")]},
            {"id": "b1", "messages": [U("Hello again"), A("q"), U("Something else"), A("z")]},
        ],
    )
    cfg_a = _config(tmp_path, tiny_llama_dir, [a], out="first")
    assert run(cfg_a) == 0
    seed = tmp_path / "seed"
    seed.mkdir()
    with open(cfg_a.prompts_path, "rb") as src, gzip.open(seed / "prompts.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(report_path(cfg_a), seed / "prompts_report.json")
    full = _config(tmp_path, tiny_llama_dir, [a, b], out="full")
    assert run(full) == 0
    grown = _config(tmp_path, tiny_llama_dir, [a, b], reuse=seed / "prompts.jsonl.gz", out="grown")
    capsys.readouterr()
    assert run(grown) == 0
    assert "3 of 5 conversations answered in" in capsys.readouterr().out
    assert grown.prompts_path.read_bytes() == full.prompts_path.read_bytes()
    rep = json.loads(report_path(grown).read_text())
    assert rep["reused_answers"] == {"file": str(seed / "prompts.jsonl.gz"), "conversations": 3}
    assert (
        rep["regeneration"]["answers"] == 3 and rep["counts"]["regenerated"] == 5
    )  # b0 (1 turn) + b1 (2 turns)
    assert (
        rep["settings"] == json.loads(report_path(full).read_text())["settings"]
    )  # not in the fingerprint


def test_reuse_refused_in_one_line(tmp_path, tiny_llama_dir):
    """Answers made with another answer budget, a file without its report, a bad line: one line each, nothing written."""
    a = _jsonl(tmp_path / "a.jsonl", [{"id": "a0", "messages": [U("Hi there")]}])
    cfg_a = _config(tmp_path, tiny_llama_dir, [a], out="first")
    assert run(cfg_a) == 0
    other = _config(tmp_path, tiny_llama_dir, [a], max_new=6, reuse=cfg_a.prompts_path, out="other")
    with pytest.raises(UserError) as e:
        run(other)
    assert str(e.value) == (
        f"{report_path(cfg_a)}: prompts.reuse_answers: its answers were made with max_new_tokens = "
        "5, this run has 6; regenerate without prompts.reuse_answers or match the setting"
    )
    assert not other.prompts_path.exists()
    lone = tmp_path / "lone" / "p.jsonl"
    lone.parent.mkdir()
    shutil.copy(cfg_a.prompts_path, lone)
    with pytest.raises(
        UserError, match=r"prompts_report.json: missing \(the report 01 wrote beside p.jsonl"
    ):
        run(_config(tmp_path, tiny_llama_dir, [a], reuse=lone, out="lone_run"))
    shutil.copy(report_path(cfg_a), lone.parent / "prompts_report.json")
    lone.write_text(lone.read_text() + "{not json\n")
    with pytest.raises(UserError, match=r"p.jsonl:2: malformed JSON: .*\(prompts.reuse_answers\)$"):
        run(_config(tmp_path, tiny_llama_dir, [a], reuse=lone, out="bad_run"))
    with pytest.raises(UserError, match="no such file"):
        run(_config(tmp_path, tiny_llama_dir, [a], reuse=tmp_path / "nope.jsonl", out="nope_run"))


def test_merge_gives_a_reused_conversation_this_runs_id():
    """A reused conversation keeps its messages but takes the input's id (trial 2: the earlier file's id, so ids
    made from line numbers repeated after a row was inserted)."""
    convs = [{"id": "f-1", "messages": [U("new")]}, {"id": "f-2", "messages": [U("old q")]}]
    earlier = {ra.conversation_key(convs[1]): {"id": "f-1", "messages": [U("old q"), A("old a")]}}
    reused, todo = ra.split(convs, earlier)
    out = ra.merge(convs, reused, [{"id": "f-1", "messages": [U("new"), A("a")]}])
    assert out == [
        {"id": "f-1", "messages": [U("new"), A("a")]},
        {"id": "f-2", "messages": [U("old q"), A("old a")]},
    ]


def test_reuse_after_a_row_is_inserted_equals_a_full_regeneration(tmp_path, tiny_llama_dir, capsys):
    """A source without ids (ids from line numbers) gets a new first row: the grown run (reusing the first run's
    answers) writes byte for byte the full regeneration's prompts.jsonl, ids unique (trial 2: two rows 'f-1'), and
    its summary line says how many were reused."""
    rows = [
        {"messages": [U("Hi there"), A("x"), U("And then?"), A("y")]},
        {"messages": [U("Count to three")]},
    ]
    f = _jsonl(tmp_path / "f.jsonl", rows)
    first = _config(tmp_path, tiny_llama_dir, [f], out="first")
    assert run(first) == 0
    _jsonl(tmp_path / "f.jsonl", [{"messages": [U("Name a colour")]}] + rows)
    full = _config(tmp_path, tiny_llama_dir, [f], out="full")
    assert run(full) == 0
    grown = _config(tmp_path, tiny_llama_dir, [f], reuse=first.prompts_path, out="grown")
    capsys.readouterr()
    assert run(grown) == 0
    assert "regenerated 3, 2 of them reused from " in capsys.readouterr().out
    assert grown.prompts_path.read_bytes() == full.prompts_path.read_bytes()
    assert [json.loads(r)["id"] for r in grown.prompts_path.read_text().splitlines()] == [
        "f-1",
        "f-2",
        "f-3",
    ]


def test_reuse_refused_for_a_folder_a_non_report_or_no_regeneration(tmp_path, tiny_llama_dir):
    """Trial 2: a folder was 'no such file', a report that is no JSON object read as 'did not regenerate', and
    prompts.reuse_answers with prompts.regenerate false (or --no-regenerate) was silently ignored. One line each."""
    from eagle3.stages.prepare_prompts import apply_overrides

    a = _jsonl(tmp_path / "a.jsonl", [{"id": "a0", "messages": [U("Hi there")]}])
    d = tmp_path / "seed"
    d.mkdir()
    with pytest.raises(
        UserError, match=r"^prompts.reuse_answers: .*seed: a folder; give the earlier prompts.jsonl"
    ):
        run(_config(tmp_path, tiny_llama_dir, [a], reuse=d, out="o1"))
    (d / "prompts.jsonl").write_text(
        json.dumps({"id": "a0", "messages": [U("Hi there"), A("x")]}) + "\n"
    )
    (d / "prompts_report.json").write_text("[]\n")
    with pytest.raises(
        UserError,
        match=r"prompts_report.json: prompts.reuse_answers: the record should be a JSON object, got list; "
        "name a regenerating 01 run's file",
    ):
        run(_config(tmp_path, tiny_llama_dir, [a], reuse=d / "prompts.jsonl", out="o2"))
    y = tmp_path / "c.yaml"
    y.write_text(
        f"run_name: t\nverifier: {{path: {tiny_llama_dir}}}\nprompts:\n  source: {a}\n"
        f"  reuse_answers: {d / 'prompts.jsonl'}\n"
    )
    with pytest.raises(UserError) as e:
        load_config(y)
    assert str(e.value).startswith(
        f"{y}:5: field 'prompts.reuse_answers': reuses regenerated answers, but "
        "prompts.regenerate is false"
    )
    cfg = _config(tmp_path, tiny_llama_dir, [a], reuse=d / "prompts.jsonl", out="o3")
    with pytest.raises(
        UserError,
        match=r"^prompts.reuse_answers: reuses regenerated answers, but prompts.regenerate",
    ):
        apply_overrides(cfg, None, None, False)  # --no-regenerate
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def test_reuse_line_printed_once_under_torchrun(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """Only rank 0 prints the 'N of M conversations answered' line (trial 2: every rank printed it)."""
    from eagle3.stages import prepare_prompts as pp

    cfg = _config(tmp_path, tiny_llama_dir, [str(tmp_path / "a.jsonl")], reuse=tmp_path / "p.jsonl")
    monkeypatch.setattr(ra, "load", lambda path, want: {})
    monkeypatch.setattr(pp, "_regenerate", lambda *a, **k: None)  # a rank > 0's return
    monkeypatch.setenv("RANK", "1")
    assert pp._regenerate_reusing(cfg, [{"id": "x", "messages": [U("q")]}], {}, {}, False) == (
        None,
        {"file": str(tmp_path / "p.jsonl"), "conversations": 0},
    )
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    pp._regenerate_reusing(cfg, [{"id": "x", "messages": [U("q")]}], {}, {}, False)
    assert "0 of 1 conversations answered in" in capsys.readouterr().out


def test_answer_fields_of_an_older_or_hand_edited_01_are_said_in_one_line(tmp_path, caplog):
    """A resume log or reused report whose ``answer_fields`` lack ``stop_token`` (an older 01), or hold non-strings
    (``[1, null]``, edited by hand): one warning line naming the file and the fields (it was a ``TypeError`` from
    joining them, then a refusal that threw away the regeneration), the answers kept; the fields every answer has
    (:func:`common_answer_fields`) are what the new report records."""
    import logging

    from eagle3.chat.template import common_answer_fields
    from eagle3.regen.resume_log import ResumeLog, logged_answer_fields

    log_file = tmp_path / "prompts.regen-partial.jsonl"
    log_file.write_text(json.dumps({"settings": REGEN, "answer_fields": [1, None]}) + "\n")
    with caplog.at_level(logging.WARNING):
        assert ResumeLog(log_file, REGEN).load([{"id": "a", "messages": []}]) == {}
    assert caplog.messages == [
        f"{log_file}: resuming answers an older 01 wrote without tokens / truncated / stop_token on each answer "
        "(answer_fields: 1, None); they are kept as they are (02 counts an answer without stop_token as stopped on the "
        "template's end-of-turn token) and prompts_report.json records only the fields every answer has; pass --force "
        "to regenerate them all"
    ]
    report = tmp_path / "prompts_report.json"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ra.check_settings(
            {"settings": REGEN, "answer_fields": ["tokens", "truncated"]}, REGEN, report
        )
    assert caplog.messages == [
        f"{report}: prompts.reuse_answers: reusing answers an older 01 wrote without stop_token on each answer "
        "(answer_fields: tokens, truncated); they are kept as they are (02 counts an answer without stop_token as "
        "stopped on the template's end-of-turn token) and prompts_report.json records only the fields every answer "
        "has; pass --force to regenerate them all"
    ]
    # what the report then records: the fields common to this run's answers and the resumed / reused ones
    assert logged_answer_fields([log_file]) == []
    assert common_answer_fields(["tokens", "truncated", "stop_token"], ["tokens", "truncated"]) == [
        "tokens",
        "truncated",
    ]
    assert common_answer_fields(["tokens", "truncated", "stop_token"], None) == []
    assert common_answer_fields(["tokens", "truncated", "stop_token"]) == [
        "tokens",
        "truncated",
        "stop_token",
    ]


def test_the_earlier_report_is_read_as_its_model(tmp_path):
    """``prompts_report.json`` of the reused file is an :class:`EarlierReport`: no ``settings`` or a run that did not
    regenerate is refused naming the file and the field; equal settings pass."""
    from eagle3.regen.reuse_answers import check_settings

    rep = tmp_path / "prompts_report.json"
    with pytest.raises(UserError) as e:
        check_settings({"counts": {}}, REGEN, rep)
    assert str(e.value) == (
        f"{rep}: prompts.reuse_answers: field 'settings' is missing; name a regenerating 01 run's file"
    )
    with pytest.raises(UserError) as e:
        check_settings({"settings": {**REGEN, "regenerate": False}}, REGEN, rep)
    assert str(e.value) == (
        f"{rep}: prompts.reuse_answers: field 'settings' says regenerate is not true: that run did not "
        "regenerate its answers; name a regenerating 01 run's file"
    )
    check_settings({"settings": REGEN}, REGEN, rep)
    with pytest.raises(
        UserError
    ) as e:  # settings that do not read as 01's (eagle3.manifest.PromptsManifest)
        check_settings({"settings": {"regenerate": True}}, REGEN, rep)
    assert str(e.value) == f"{rep}: key 'source': Field required; re-run 01_prepare_prompts.py"
    with pytest.raises(
        UserError, match=r"with max_new_tokens = 8, this run has 9; regenerate without"
    ):
        check_settings(
            {"settings": {**REGEN, "max_new_tokens": 8}}, {**REGEN, "max_new_tokens": 9}, rep
        )
