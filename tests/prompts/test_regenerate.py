"""Batched, left-padded greedy regeneration equals a plain per-sample greedy loop."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_reuse_answers import REGEN

import eagle3.regen.regenerate as regen_mod
from eagle3.chat.template import end_of_turn_ids
from eagle3.config import VerifierConfig
from eagle3.regen.regenerate import answer_steps, generate_greedy, pick_batch, regenerate
from eagle3.verifier.load import load_verifier

MAX_NEW = 6


@pytest.fixture(autouse=True)
def single_thread():
    """One intra-op thread: the tiny model is dispatch-bound, and two spinning threads per process are
    several times slower on a shared 2-core CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_verifier(VerifierConfig(path=str(tiny_llama_dir), dtype="float32"), device="cpu")


@torch.no_grad()
def _reference_greedy(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    """Unbatched, unpadded, uncached greedy decoding: argmax of the last position, one token at a time."""
    seq = list(prompt)
    out = []
    for _ in range(max_new):
        logits = model(torch.tensor([seq]), logits_to_keep=1).logits  # [1, 1, V]
        nxt = int(logits[0, -1].argmax())
        if nxt in stops:
            break
        out.append(nxt)
        seq.append(nxt)
    return out


def _reference_regenerate(model, tok, conv, max_new):
    stops = end_of_turn_ids(tok)
    msgs = [m for m in conv["messages"] if m["role"] == "system"]
    for u in [m["content"] for m in conv["messages"] if m["role"] == "user"]:
        msgs.append({"role": "user", "content": u})
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        ans = _reference_greedy(model, prompt, max_new, stops)
        msgs.append(
            {
                "role": "assistant",
                "content": tok.decode(ans, skip_special_tokens=True),
                "tokens": ans,
                **({"truncated": True} if len(ans) == max_new else {}),
            }
        )  # no stop token within the budget
    return {"id": conv["id"], "messages": msgs}


CONVS = [
    {
        "id": "a",
        "messages": [
            {"role": "user", "content": "Write a long story about a dragon and a knight."},
            {"role": "assistant", "content": "old answer"},
        ],
    },
    {
        "id": "b",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    },
    {
        "id": "c",
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "Another one, please?"},
            {"role": "assistant", "content": "y"},
        ],
    },
    {
        "id": "d",
        "messages": [
            {"role": "user", "content": "Question one?"},
            {"role": "user", "content": "And two?"},
        ],
    },
]


def test_batched_equals_unbatched_greedy(tiny):
    model, tok = tiny
    stats = {}
    got = regenerate(model, tok, CONVS, max_new_tokens=MAX_NEW, batch_size=3, stats=stats)
    want = [_reference_regenerate(model, tok, c, MAX_NEW) for c in CONVS]
    assert got == want
    # structure: system kept, user turns kept, one fresh answer per user turn
    assert [[m["role"] for m in c["messages"]] for c in got] == [
        ["user", "assistant"],
        ["system", "user", "assistant"],
        ["user", "assistant", "user", "assistant"],
        ["user", "assistant", "user", "assistant"],
    ]
    assert got[0]["messages"][1]["content"] != "old answer"
    answers = [m for c in got for m in c["messages"] if m["role"] == "assistant"]
    assert (
        stats["truncated"] == sum(m.get("truncated", False) for m in answers) > 0
    )  # recorded per answer
    assert stats["answers"] == 6
    assert 0 <= stats["new_tokens"] <= 6 * MAX_NEW


def test_generate_greedy_stops_and_strips_stop_token(tiny):
    model, tok = tiny
    prompts = [[1, 4093, 198, 26843, 2], [1, 4093, 198, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]]
    free = [_reference_greedy(model, p, MAX_NEW, set()) for p in prompts]
    # declare the 3rd free-running token of prompt 0 a stop token: the answer is cut just before it
    stop = free[0][2]
    got = generate_greedy(model, prompts, MAX_NEW, {stop}, pad_id=tok.pad_token_id)
    for (ans, stopped), ref in zip(got, free):
        cut = ref.index(stop) if stop in ref else None
        assert ans == (ref[:cut] if cut is not None else ref)
        assert stopped == (
            stop if cut is not None else None
        )  # the stop id it ended on, None when cut
    assert got[0][1] == stop and len(got[0][0]) == free[0].index(stop)


def _prompt_len(tok, msgs):
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_context_cap_answers_turns_only_below_the_cap(tiny):
    """``max_context``: the turn whose prompt reaches the cap and every later turn go unanswered; a
    conversation whose first prompt reaches it is left out; everything below the cap is unchanged."""
    model, tok = tiny
    full = [_reference_regenerate(model, tok, c, MAX_NEW) for c in CONVS]
    # cap between conversation c's first and second prompt: c keeps one turn, the long first prompt of a
    # is over the cap (left out), b and d's prompts are measured to decide the expected result by hand
    c_first = _prompt_len(tok, full[2]["messages"][:1])
    c_second = _prompt_len(tok, full[2]["messages"][:3])
    a_first = _prompt_len(tok, full[0]["messages"][:1])
    assert c_first < c_second
    cap = c_first + 1
    assert a_first >= cap, "conversation a's first prompt must be over the cap for this test"
    want = []
    turns_left = 0
    for conv in full:
        msgs, kept = conv["messages"], []
        users = [m for m in msgs if m["role"] == "user"]
        for j, m in enumerate(msgs):
            if m["role"] == "user" and _prompt_len(tok, msgs[: j + 1]) >= cap:
                turns_left += sum(1 for x in msgs[j:] if x["role"] == "user")
                break
            kept.append(m)
        if any(m["role"] == "assistant" for m in kept):
            want.append({"id": conv["id"], "messages": kept})
        else:
            assert users  # every test conversation has a user turn
    stats = {}
    got = regenerate(
        model, tok, CONVS, max_new_tokens=MAX_NEW, batch_size=3, stats=stats, max_context=cap
    )
    assert got == want
    assert "a" not in [c["id"] for c in got] and stats["dropped_over_context"] == 1
    assert [m["role"] for m in next(c for c in got if c["id"] == "c")["messages"]] == [
        "user",
        "assistant",
    ]
    assert stats["turns_over_context"] == turns_left >= 2
    # no cap reached: identical to the uncapped run
    assert (
        regenerate(model, tok, CONVS, max_new_tokens=MAX_NEW, batch_size=3, max_context=10_000)
        == full
    )


def test_pick_batch_hand_computed():
    """Critical turns (conversations with >= 2 and >= ceil(total / batch_size) turns left) first, most
    left first; then the others by prompt length: those under the widest critical prompt longest first
    (no padding added), then the shortest; ties by more turns left, then position."""
    # 12 turns left / 4 = 3 full batches: 4 (5 left) and 1 (3 left) are critical, width max(4, 9) = 9;
    # every other turn fits under it: 5 (8), 3 (7), 0 (5), 2 (3)
    assert pick_batch([5, 9, 3, 7, 4, 8], [1, 3, 1, 1, 5, 1], 4) == [4, 1, 5, 3]
    # batch size 1: 12 batches are needed whatever the order, nothing is critical: the shortest prompt
    assert pick_batch([5, 9, 3, 7, 4, 8], [1, 3, 1, 1, 5, 1], 1) == [2]
    # width max(2, 4) = 4: only 2 (3) fits under it; then the shortest wider ones: 0 (5), 3 (7), 5 (8)
    assert pick_batch([5, 2, 3, 7, 4, 8], [1, 3, 1, 1, 5, 1], 4) == [4, 1, 2, 0]
    assert pick_batch([5, 2, 3, 7, 4, 8], [1, 3, 1, 1, 5, 1], 10) == [4, 1, 2, 0, 3, 5]
    # 5 turns left / 2 = 3 batches: a conversation with 2 turns left can wait (it is ordered by length) ...
    assert pick_batch([4, 6, 2, 9], [2, 1, 1, 1], 2) == [2, 0]
    assert pick_batch([1, 6, 2, 9], [2, 1, 1, 1], 2) == [0, 2]
    # ... one with 3 left cannot (6 / 2 = 3 batches): it goes first, then 2 (2 <= its width 4)
    assert pick_batch([4, 6, 2, 9], [3, 1, 1, 1], 2) == [0, 2]
    # equal prompt lengths, nothing critical: more turns left first
    assert pick_batch([3, 3, 3], [1, 2, 1], 1) == [1]
    # first turns only: consecutive prompt lengths from the shortest (the old plan)
    assert pick_batch([5, 3, 3, 1], [1, 1, 1, 1], 2) == [3, 1]
    assert pick_batch([], [], 3) == []
    with pytest.raises(ValueError):
        pick_batch([1, 2], [1], 2)
    with pytest.raises(ValueError):
        pick_batch([1], [0], 2)
    with pytest.raises(ValueError):
        pick_batch([1], [1], 0)


def test_answer_steps():
    assert answer_steps(3, True, 6) == 4  # 3 tokens + the stop token
    assert answer_steps(5, True, 6) == 6
    assert answer_steps(6, False, 6) == 6  # truncated at the budget
    assert answer_steps(0, True, 6) == 1


def _conv(cid, n_turns, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for t in range(n_turns):
        msgs += [
            {
                "role": "user",
                "content": f"Conversation {cid}, question {t + 1}: tell me about the number {t * 7 + 3}.",
            },
            {"role": "assistant", "content": "old"},
        ]
    return {"id": cid, "messages": msgs}


def test_pooled_turns_of_any_round_equal_reference(tiny, monkeypatch):
    """Conversations of 1, 3 and 5 turns (plus another single turn) at batch size 2 < the 4 ready first
    turns: batches mix turn indices, the answers still equal the unbatched uncached greedy reference, and
    the 5-turn conversation advances in every batch, so 5 batches suffice (round by round: 2 + 1 + 1 + 1 + 1 = 6)."""
    model, tok = tiny
    convs = [
        _conv("one", 1),
        _conv("three", 3, system="Be brief."),
        _conv("five", 5),
        _conv("single", 1),
    ]
    batches = []
    real = regen_mod.generate_greedy

    def spy(model_, prompts, max_new, stops, pad):
        out = real(model_, prompts, max_new, stops, pad)
        batches.append((len(prompts), out))
        return out

    monkeypatch.setattr(regen_mod, "generate_greedy", spy)
    stats = {}
    got = regenerate(
        model, tok, convs, max_new_tokens=MAX_NEW, batch_size=2, stats=stats, engine="static"
    )
    want = [_reference_regenerate(model, tok, c, MAX_NEW) for c in convs]
    assert got == want
    assert [sum(m["role"] == "assistant" for m in c["messages"]) for c in got] == [1, 3, 5, 1]
    assert stats["answers"] == 10
    assert stats["batches"] == len(batches) == 5
    assert all(n == 2 for n, _ in batches)
    assert stats["decode_steps"] == sum(
        max(answer_steps(len(a), s is not None, MAX_NEW) for a, s in out) for _, out in batches
    )
    assert 5 <= stats["decode_steps"] <= 5 * MAX_NEW
    # the former round plan (bench baseline): same answers, 2 + 1 + 1 + 1 + 1 batches
    batches.clear()
    old = {}
    assert (
        regenerate(
            model,
            tok,
            convs,
            max_new_tokens=MAX_NEW,
            batch_size=2,
            stats=old,
            schedule="rounds",
            engine="static",
        )
        == want
    )
    assert old["batches"] == len(batches) == 6
    assert [n for n, _ in batches] == [
        2,
        2,
        2,
        2,
        1,
        1,
    ]  # rounds 0 (4 turns), 1 and 2 (three, five), 3, 4 (five)


def test_resume_after_a_kill_equals_the_uninterrupted_run(tiny, tmp_path, monkeypatch, caplog):
    """In-process regeneration with a resume log: a run killed in its 4th batch keeps the conversations
    finished before it; the rerun answers only the rest, and the result equals the uninterrupted run."""
    from eagle3.errors import UserError
    from eagle3.regen.resume_log import ResumeLog

    model, tok = tiny
    convs = [
        _conv("one", 1),
        _conv("three", 3, system="Be brief."),
        _conv("five", 5),
        _conv("single", 1),
    ]
    want = regenerate(model, tok, convs, max_new_tokens=MAX_NEW, batch_size=2)
    real = regen_mod.generate_greedy
    calls = []

    def dies_in_batch_4(*a):
        calls.append(len(a[1]))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a)

    path = tmp_path / "prompts.regen-partial.jsonl"
    monkeypatch.setattr(regen_mod, "generate_greedy", dies_in_batch_4)
    with pytest.raises(KeyboardInterrupt):
        regenerate(
            model,
            tok,
            convs,
            max_new_tokens=MAX_NEW,
            batch_size=2,
            journal=ResumeLog(path, REGEN),
            engine="static",
        )
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0] == {"settings": REGEN, "answer_fields": ["tokens", "truncated", "stop_token"]}
    logged = {r["id"]: r for r in rows[1:]}
    # batches 1-3 answered every first turn and turns 2-3 of the longer ones: "one", "single" finished
    assert set(logged) == {"one", "single"}
    for r in rows[1:]:
        assert {k: v for k, v in r.items() if k != "idx"} == want[r["idx"]]

    calls.clear()
    monkeypatch.setattr(
        regen_mod, "generate_greedy", lambda *a: calls.append(len(a[1])) or real(*a)
    )
    stats = {}
    got = regenerate(
        model,
        tok,
        convs,
        max_new_tokens=MAX_NEW,
        batch_size=2,
        stats=stats,
        journal=ResumeLog(path, REGEN),
        engine="static",
    )
    assert got == want
    assert (
        stats["resumed"] == 2 and stats["answers"] == 3 + 5 and sum(calls) == 8
    )  # "three" and "five" only
    assert len(path.read_text().splitlines()) == 1 + 4  # every conversation is in the log now
    with pytest.raises(
        UserError,
        match=r"prompts\.regen-partial\.jsonl: a regeneration was started here with "
        r"other settings \(max_new_tokens differ\)",
    ):
        regenerate(
            model,
            tok,
            convs,
            max_new_tokens=MAX_NEW,
            batch_size=2,
            journal=ResumeLog(path, {**REGEN, "max_new_tokens": 9}),
        )
    # a log of a 01 from before stop_token was recorded: resumed as it is, with one warning line (refusing it threw
    # away hours of regeneration); logged_answer_fields gives the fields the report may then claim: none
    from eagle3.regen.resume_log import logged_answer_fields

    lines = path.read_text().splitlines()
    path.write_text("\n".join([json.dumps({"settings": REGEN})] + lines[1:]) + "\n")
    assert logged_answer_fields([path]) == []
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        got = regenerate(
            model,
            tok,
            convs,
            max_new_tokens=MAX_NEW,
            batch_size=2,
            journal=ResumeLog(path, REGEN),
        )
    assert got == want
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"{path}: resuming answers an older 01 wrote without tokens / truncated / stop_token on each answer "
        "(answer_fields: none recorded); they are kept as they are (02 counts an answer without stop_token as stopped "
        "on the template's end-of-turn token) and prompts_report.json records only the fields every answer has; pass "
        "--force to regenerate them all"
    ]
