"""``prompts.chain_conversations``: 01 joins sampled conversations into long multi-turn chats (seeded), records the
setting where it changes the output, and regeneration answers every turn of a chain with the whole chain before it."""

from __future__ import annotations

import json

import pytest
from test_prompts import A, U, _config

from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.regen.selection import chain
from eagle3.stages.prepare_prompts import run
from eagle3.stages.prompts_manifest import report_path


def S(c):
    return {"role": "system", "content": c}


def _convs(n):
    return [{"id": f"c{i}", "messages": [S(f"sys{i}"), U(f"q{i}"), A(f"a{i}")]} for i in range(n)]


def test_chain_joins_k_at_a_time_and_each_chat_is_its_members_in_id_order():
    convs = _convs(5)
    tool = {
        "id": "t",
        "messages": [
            U("weather?"),
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
        ],
    }
    defs = {"id": "d", "messages": [U("hi"), A("yo")], "tools": [{"type": "function"}]}
    out = chain(convs[:2] + [tool] + convs[2:] + [defs], 2, seed=3)
    # tools and tool calls first, alone, in their order; then ceil(5 / 2) = 3 chats of 2, 2, 1
    assert [c["id"] for c in out[:2]] == ["t", "d"] and out[0] is tool and out[1] is defs
    members = [c["id"].split("+") for c in out[2:]]
    assert [len(m) for m in members] == [2, 2, 1]
    assert sorted(sum(members, [])) == [f"c{i}" for i in range(5)]
    by_id = {c["id"]: c for c in convs}
    for c, ids in zip(out[2:], members):
        first, *rest = (by_id[i]["messages"] for i in ids)
        # one system message, at the start: the first member's; the others' turns follow in order
        assert c["messages"] == first + [m for msgs in rest for m in msgs[1:]]
        assert [m["role"] for m in c["messages"]].count("system") == 1


def test_chain_is_seeded_and_one_is_the_identity():
    convs = _convs(12)
    a, b = chain(convs, 4, seed=0), chain(convs, 4, seed=0)
    assert a == b
    assert [c["id"] for c in chain(convs, 4, seed=1)] != [c["id"] for c in a]
    assert chain(convs, 1, seed=0) is convs
    # one chat of all: the whole shuffle in one id
    (whole,) = chain(convs, 12, seed=0)
    assert sorted(whole["id"].split("+")) == sorted(c["id"] for c in convs)
    assert len(whole["messages"]) == 1 + 2 * 12


def _source(tmp_path, n):
    src = tmp_path / "c.jsonl"
    rows = [{"messages": [U(f"question {i}"), A(f"answer {i}")]} for i in range(n)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_01_writes_the_chains_counts_them_and_remakes_them_when_the_setting_changes(
    tmp_path, capsys
):
    src = _source(tmp_path, 7)
    cfg = load_config(_config(tmp_path, src, format="messages", chain_conversations=3, seed=4))
    assert run(cfg) == 0
    rows = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert [len(r["id"].split("+")) for r in rows] == [3, 3, 1]
    assert all(len(r["messages"]) == 2 * len(r["id"].split("+")) for r in rows)
    rep = json.loads(report_path(cfg).read_text())
    assert rep["settings"]["chain_conversations"] == 3 and rep["settings"]["seed"] == 4
    assert rep["counts"]["normalised"] == 7 and rep["counts"]["chained_into"] == 3
    assert rep["counts"]["kept"] == 3
    assert "| chained_into (conversations after prompts.chain_conversations) | 3 |" in (
        report_path(cfg).with_suffix(".md").read_text()
    )
    capsys.readouterr()
    assert run(cfg) == 0 and "up to date" in capsys.readouterr().out
    # another seed or k is another file; back to 1 (off) is the unchained file, without either key
    for sets, n in ((["prompts.seed=5"], 3), (["prompts.chain_conversations=2"], 4), ([], 7)):
        cfg2 = load_config(
            _config(
                tmp_path, src, format="messages", **({"chain_conversations": 3} if sets else {})
            ),
            sets,
        )
        assert run(cfg2) == 0 and "up to date" not in capsys.readouterr().out
        assert len(cfg2.prompts_path.read_text().splitlines()) == n
    rep = json.loads(report_path(cfg2).read_text())
    assert "chain_conversations" not in rep["settings"] and "chained_into" not in rep["counts"]


def test_chain_conversations_below_one_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        load_config(
            _config(tmp_path, _source(tmp_path, 2), format="messages", chain_conversations=0)
        )
    assert "prompts.chain_conversations" in str(e.value) and "\n" not in str(e.value)


def _regen_config(tmp_path, tiny_llama_dir, src, name, chain_k):
    f = tmp_path / f"{name}.yaml"
    f.write_text(
        f"run_name: {name}\noutput_root: {tmp_path / name}\n"
        f"verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {src}, format: messages, regenerate: true, max_new_tokens: 3, gen_batch_size: 2,\n"
        f"          regen_cuda_graphs: false, chain_conversations: {chain_k}}}\nextract: {{max_length: 256}}\n"
    )
    return load_config(f)


def test_a_regenerated_chain_is_the_multi_turn_chat_of_its_members(tmp_path, tiny_llama_dir):
    """The tiny Llama (float32, greedy) regenerates a chain of two one-turn prompts exactly as it regenerates the
    two-turn chat holding those questions in the chain's order: the second answer is generated after the first
    question and the verifier's own answer to it."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"messages": [U(f"q number {i}")]}) + "\n" for i in range(2)))
    cfg = _regen_config(tmp_path, tiny_llama_dir, src, "chained", 2)
    assert run(cfg) == 0
    (row,) = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "user", "assistant"]
    rep = json.loads(report_path(cfg).read_text())
    assert rep["counts"]["regenerated"] == 1 and rep["regeneration"]["answers"] == 2
    questions = [row["messages"][0]["content"], row["messages"][2]["content"]]
    assert sorted(questions) == ["q number 0", "q number 1"]
    two_turns = tmp_path / "t.jsonl"
    two_turns.write_text(json.dumps({"messages": [U(q) for q in questions]}) + "\n")
    ref = _regen_config(tmp_path, tiny_llama_dir, two_turns, "multi", 1)
    assert run(ref) == 0
    (want,) = [json.loads(x) for x in ref.prompts_path.read_text().splitlines()]
    assert row["messages"] == want["messages"]
