"""bench/regen_schedule.py: the old round plan and the ready-pool plan replayed without a model,
figures computed by hand."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import regen_schedule as rs  # noqa: E402

# A: 3 turns (answers of 5, 511 and 2 tokens), B: 1 turn truncated at 512, C: 1 turn of 1 token
A = [(10, 5), (20, 511), (30, 2)]
B = [(5, 512)]
C = [(8, 1)]


def test_plans_by_hand():
    convs = [A, B, C]
    # rounds: round 0 by prompt length B(5) C(8) | A0(10); round 1 A1; round 2 A2
    assert rs.plan_rounds(convs, 2) == [[(1, 0), (2, 0)], [(0, 0)], [(0, 1)], [(0, 2)]]
    # pooled: 5 turns / 2 = 3 batches, A (3 left) is critical: A0 + C (8 <= 10, longest under A's width);
    # then A1 (2 left >= 2 batches) + B; then A2
    assert rs.plan_pooled(convs, 2) == [[(0, 0), (2, 0)], [(0, 1), (1, 0)], [(0, 2)]]
    old = rs.plan_figures(convs, rs.plan_rounds(convs, 2), 512)
    # steps per batch: max(512 truncated, 1 + stop) + (5 + stop) + (511 + stop) + (2 + stop)
    assert old == {
        "batches": 4,
        "answers": 5,
        "decode_steps": 512 + 6 + 512 + 3,
        "prefill_tokens": 73,
        "padded_prefill_tokens": 2 * 8 + 10 + 20 + 30,
    }
    new = rs.plan_figures(convs, rs.plan_pooled(convs, 2), 512)
    assert new == {
        "batches": 3,
        "answers": 5,
        "decode_steps": 6 + 512 + 3,
        "prefill_tokens": 73,
        "padded_prefill_tokens": 2 * 10 + 2 * 20 + 30,
    }
    res = rs.compare(convs, 2, 512)
    assert res["ratio_pooled_over_rounds"]["decode_steps"] == 521 / 1033
    assert res["longest_conversation_turns"] == 3 and res["min_batches"] == 3
    # a smaller budget caps every batch: 100-token answers count 100 steps
    assert rs.plan_figures(convs, rs.plan_pooled(convs, 2), 100)["decode_steps"] == 6 + 100 + 3
    # prefix reuse: A1 re-prefills A0's 10 + 5 of its 20; A2 would re-prefill A1's 20 + 511 but its prompt is 30
    assert rs.prefix_reuse(convs) == {
        "prefill_tokens": 73,
        "reusable_tokens": 15 + 30,
        "reusable_share": round(45 / 73, 4),
    }
    assert rs.prefix_reuse([B, C]) == {
        "prefill_tokens": 13,
        "reusable_tokens": 0,
        "reusable_share": 0.0,
    }


def _record(cid, users, answer_lens, tools=False):
    msgs = []
    for u, n in zip(users, answer_lens):
        msgs += [
            {"role": "user", "content": u},
            {"role": "assistant", "content": "x" * n, **({} if tools else {"tokens": [100] * n})},
        ]
    if tools:
        msgs.append({"role": "tool", "content": "42", "tool_call_id": "c1"})
    return {"id": cid, "messages": msgs}


def test_recorded_turns_and_cli(tmp_path, tiny_llama_dir, smollm_tokenizer):
    """Prompt lengths are the tokenizer's ids of the rendered history; a record without ``tokens`` is not
    replayed; the CLI's figures are the hand-computed ones of test_plans_by_hand (same shape)."""
    from eagle3.chat.template import ChatOptions

    long_first = "Please explain in great detail how a bicycle gear system works and why."
    recs = [
        _record("A", [long_first, "And brakes?", "Thanks."], [5, 511, 2]),
        _record("B", ["Hi"], [512]),
        _record("C", ["Name a colour."], [1]),
        _record("D", ["Call the tool."], [3], tools=True),
    ]
    tok = smollm_tokenizer
    turns = rs.recorded_turns(tok, recs[0], ChatOptions(), None)
    msgs = recs[0]["messages"]
    want = [
        len(
            tok(
                tok.apply_chat_template(msgs[:j], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )["input_ids"]
        )
        for j in (1, 3, 5)
    ]
    assert turns == list(zip(want, [5, 511, 2]))
    assert want[0] < want[1] < want[2]
    # a cap between the 2nd and 3rd prompt keeps 2 turns
    assert rs.recorded_turns(tok, recs[0], ChatOptions(), want[2]) == turns[:2]
    assert rs.recorded_turns(tok, recs[3], ChatOptions(), None) is None

    path = tmp_path / "prompts.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert (
        rs.main(
            [
                "--config",
                str(ROOT / "configs/tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                "--prompts",
                str(path),
                "--batch-size",
                "2",
                "--max-new-tokens",
                "512",
                "--max-context",
                "0",
                "--json",
                str(out),
                "--md",
                str(md),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert (res["records"], res["conversations"], res["not_regenerated"], res["answers"]) == (
        4,
        3,
        1,
        5,
    )
    assert res["max_context"] is None
    assert (res["rounds"]["batches"], res["rounds"]["decode_steps"]) == (4, 1033)
    assert (res["pooled"]["batches"], res["pooled"]["decode_steps"]) == (3, 521)
    assert "| pooled / rounds | 0.750 | 0.504 |" in md.read_text()
