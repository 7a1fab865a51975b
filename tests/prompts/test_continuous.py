"""Continuous-batching regeneration engines (eagle3.regen.slots) equal plain transformers greedy decoding (fp32)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import SMOLLM_GGUF  # noqa: E402
from test_reuse_answers import REGEN

from eagle3.config import VerifierConfig
from eagle3.regen.hf_engine import HFContinuousEngine
from eagle3.regen.regenerate import regenerate
from eagle3.regen.slot_attention import decode_block_mask, flex_decode, kv_num_blocks
from eagle3.regen.slot_policy import (
    COMPILE_COLD_S,
    COMPILED_STEP_MS,
    EAGER_STEP_MS,
    choose_prefix,
    compile_decision,
    defer_refill,
    estimate_decode_steps,
    prefix_sizes,
)
from eagle3.regen.slots import SlotEngine
from eagle3.verifier.load import load_verifier


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_verifier(VerifierConfig(path=str(tiny_llama_dir), dtype="float32"), device="cpu")


@torch.no_grad()
def hf_greedy(
    model, prompt: list[int], max_new: int, stops: set[int]
) -> tuple[list[int], int | None]:
    """Plain transformers greedy decoding of one prompt (no padding, DynamicCache): (answer, stop id or None)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(stops),
        pad_token_id=sorted(stops)[0],
    )
    row = out[0, len(prompt) :].tolist()
    cut = next((j for j, t in enumerate(row) if t in stops), None)
    return (row[:cut], row[cut]) if cut is not None else (row, None)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def _stops(model, prompts, max_new) -> set[int]:
    """Two stop ids that occur in free-running answers (so some answers stop early, others run out)."""
    free = [hf_greedy(model, p, max_new, {0})[0] for p in prompts[:4]]
    return {free[0][3], free[1][5]}


def _greedy_case(model, n: int, max_new: int, seed: int):
    """``n`` random prompts, two stop ids that occur in their free-running answers, and HF greedy's answers."""
    prompts = _prompts(n, model.config.vocab_size, seed=seed)
    stops = _stops(model, prompts, max_new)
    return prompts, stops, [hf_greedy(model, p, max_new, stops) for p in prompts]


def _run(engine, prompts, later: dict | None = None):
    """Submit prompts, then (while iterating) the ``later`` prompts keyed after a finished key; collect answers."""
    for i, p in enumerate(prompts):
        engine.submit(i, p, (len(p) % 3,))
    got = {}
    for key, ans, stopped in engine.results():
        got[key] = (ans, stopped)
        if later and key in later:
            engine.submit(("after", key), later[key])
    engine.close()
    return got


@pytest.mark.parametrize(
    "slots,check_every,prefill_tokens,classes",
    [
        (1, 1, 65536, None),  # one row at a time, checked every step
        (
            3,
            5,
            40,
            [20, 30],
        ),  # rows refilled mid-answer of others, several prefill batches, 3 width classes
        (16, 4, 65536, [16, 40]),  # every prompt in one prefill, all rows live together
        (5, 3, 65536, [14]),  # a class for 2-token prompts only: most wait for the wide group
    ],
)
def test_slot_engine_equals_hf_greedy(tiny, slots, check_every, prefill_tokens, classes):
    model, _ = tiny
    max_new = 12
    prompts = _prompts(11, model.config.vocab_size)
    stops = _stops(model, prompts, max_new)
    want = [hf_greedy(model, p, max_new, stops) for p in prompts]
    assert any(s is not None for _, s in want) and not all(
        s is not None for _, s in want
    )  # both endings occur
    later = {2: prompts[0] + want[2][0], 5: prompts[7][:3]}  # prompts submitted while decoding
    eng = SlotEngine(
        model,
        slots,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=check_every,
        prefill_tokens=prefill_tokens,
        width_classes=classes,
        cuda_graphs=False,
    )
    got = _run(eng, prompts, later)
    assert [got[i] for i in range(len(prompts))] == want
    for k, p in later.items():
        assert got[("after", k)] == hf_greedy(model, p, max_new, stops)
    assert model.config._attn_implementation == "sdpa"  # restored by close()
    assert eng.stats["decode_steps"] % check_every == 0 and eng.stats["prefill_calls"] >= 1
    # every prompt is prefilled once, by its own tokens; padding only where a forward holds several rows
    assert eng.stats["prefill_tokens"] == sum(map(len, prompts)) + sum(map(len, later.values()))
    if slots == 1:
        assert eng.stats["prefill_padded_tokens"] == eng.stats["prefill_tokens"]
    else:
        assert eng.stats["prefill_padded_tokens"] >= eng.stats["prefill_tokens"]
    caps = [cap for _, _, cap in eng.groups]
    assert (
        caps == sorted(caps) and caps[-1] == 64 and eng.groups[-1][1] == slots
    )  # groups tile the slots


@pytest.mark.parametrize(
    "attention,slots,check_every,min_prefix,block",
    [
        (
            "flex",
            3,
            2,
            1,
            16,
        ),  # 11 prompts on 3 rows: refills, the prefix shrinks to 2 and 1 in the tail
        (
            "flex",
            8,
            3,
            2,
            8,
        ),  # prefixes 2, 4, 8; blocks of 8 columns (several per row, partial last blocks)
        (
            "flex",
            16,
            4,
            8,
            128,
        ),  # every prompt at once, one block per row (the cache is rounded up to 128 columns)
        ("sdpa_groups", 5, 2, 1, 128),  # the width-group path under the same prefix logic
    ],
)
def test_slot_engine_prefixes_equal_hf_greedy(
    tiny, attention, slots, check_every, min_prefix, block
):
    """Greedy answers through FlexAttention (eager on CPU) and through the width groups, with decode windows over
    slot prefixes, equal plain transformers greedy decoding token for token (fp32), prompts resubmitted mid-run."""
    model, _ = tiny
    max_new = 12
    prompts = _prompts(11, model.config.vocab_size, seed=3)
    stops = _stops(model, prompts, max_new)
    want = [hf_greedy(model, p, max_new, stops) for p in prompts]
    later = {
        1: prompts[1] + want[1][0] + prompts[4][:2],
        9: prompts[2][:5],
    }  # a next turn, a late new prompt
    eng = SlotEngine(
        model,
        slots,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=check_every,
        width_classes=[20, 40],
        cuda_graphs=False,
        attention=attention,
        flex_block=block,
        min_prefix=min_prefix,
    )
    assert eng.stats["attention"] == attention
    cols = eng.cache.k[0].shape[2]
    t0 = time.perf_counter()
    got = _run(eng, prompts, later)
    wall = time.perf_counter() - t0
    assert [got[i] for i in range(len(prompts))] == want
    # the timed parts (host clock on the CPU) are inside the run and do not overlap
    assert (
        0 < eng.stats["prefill_s"]
        and 0 < eng.stats["decode_s"]
        and eng.stats["prefill_s"] + eng.stats["decode_s"] <= wall
    )
    assert not eng._timed  # every mark was read at a check
    for k, p in later.items():
        assert got[("after", k)] == hf_greedy(model, p, max_new, stops)
    ps = {int(n): c for n, c in eng.stats["prefix_steps"].items()}
    assert sum(ps.values()) == eng.stats["decode_steps"] and set(ps) <= set(
        prefix_sizes(slots, min_prefix)
    )
    if min_prefix < slots:
        assert len(ps) >= 2  # the tail ran on a smaller prefix than the bulk
    # each prefix stepped has its first step timed once (its compile/capture), inside the decode windows
    fs = eng.stats["first_step_s"]
    assert set(fs) == set(eng.stats["prefix_steps"]) and all(v > 0 for v in fs.values())
    assert sum(fs.values()) <= eng.stats["decode_s"]
    kv = eng.stats["kv_tokens_needed"] * eng.stats["kv_bytes_per_token"]
    assert (
        kv
        <= eng.stats["kv_bytes_read"]
        <= eng.stats["decode_steps"] * slots * 128 * eng.stats["kv_bytes_per_token"]
    )
    if attention == "flex":
        assert eng.groups == [(0, slots, 64)] and cols == -(-64 // block) * block


def test_flex_kv_bytes_read_by_hand(tiny):
    """One slot, one prompt, a check every step: step j reads floor((p + j) / block) + 1 blocks of the row."""
    model, _ = tiny
    p, block, max_new = 13, 8, 20
    prompt = _prompts(1, model.config.vocab_size, seed=4)[0][:1] * p
    eng = SlotEngine(
        model,
        1,
        max_len=48,
        max_new_tokens=max_new,
        stop_ids={0},
        check_every=1,
        cuda_graphs=False,
        attention="flex",
        flex_block=block,
    )
    got = _run(eng, [prompt])
    assert got[0] == hf_greedy(model, prompt, max_new, {0})
    steps = (
        len(got[0][0]) + int(got[0][1] is not None) - 1
    )  # decode steps after the prefill's token
    assert eng.stats["decode_steps"] == steps and eng.stats["prefix_steps"] == {"1": steps}
    blocks = sum((p + j) // block + 1 for j in range(steps))
    assert eng.stats["kv_bytes_read"] == blocks * block * eng.stats["kv_bytes_per_token"]
    assert eng.stats["kv_tokens_needed"] == steps * p + steps * (steps + 1) // 2


def test_decode_block_mask_against_dense():
    """Hand-made lengths: block counts, the dense block layout and the element mask (through the attention
    output against SDPA under a dense column mask) for empty, partial, exact-boundary and full rows."""
    block, kv_len = 4, 16
    attn_len = torch.tensor([0, 2, 3, 4, 9, 15])  # last attended column per row
    idx = torch.arange(kv_len // block, dtype=torch.int32).expand(6, 1, 1, 4).contiguous()
    bm = decode_block_mask(attn_len, idx, block, kv_len)
    assert bm.kv_num_blocks.view(-1).tolist() == [1, 1, 1, 2, 3, 4]  # ceil((len + 1) / 4)
    assert bm.shape == (6, 1, 1, kv_len)
    bm3 = decode_block_mask(
        attn_len, idx, block, kv_len, q_len=3
    )  # the grouped heads as 3 query positions
    assert bm3.shape == (6, 1, 3, kv_len) and torch.equal(bm3.kv_num_blocks, bm.kv_num_blocks)
    dense_blocks = bm.to_dense()[:, 0, 0].tolist()  # [6, 4] 0/1 per KV block
    assert dense_blocks == [
        [1, 0, 0, 0],
        [1, 0, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]
    elem = torch.tensor(
        [
            [bool(bm.mask_mod(torch.tensor(b), 0, 0, torch.tensor(c))) for c in range(kv_len)]
            for b in range(6)
        ]
    )  # [6, 16]
    want = torch.arange(kv_len)[None] <= attn_len[:, None]  # [6, 16]
    inside = torch.tensor(dense_blocks, dtype=torch.bool).repeat_interleave(
        block, 1
    )  # [6, 16] columns of read blocks
    assert torch.equal(elem & inside, want)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 6, 1, 8, generator=g)  # [n, H, 1, D], 3 query heads per KV head
    k, v = (
        torch.randn(6, 2, kv_len, 8, generator=g),
        torch.randn(6, 2, kv_len, 8, generator=g),
    )  # [n, Hkv, L, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q,
        k.repeat_interleave(3, 1),
        v.repeat_interleave(3, 1),
        attn_mask=want.view(6, 1, 1, kv_len),
    )
    torch.testing.assert_close(flex_decode(q, k, v, attn_len, idx, None, block), ref)
    nb = kv_num_blocks(attn_len, block)  # as the engine passes it, once per step
    assert nb.dtype == torch.int32 and nb.shape == (6, 1, 1)
    torch.testing.assert_close(flex_decode(q, k, v, attn_len, idx, None, block, nb), ref)


def test_prefix_sizes_and_choice():
    assert prefix_sizes(1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert prefix_sizes(1000) == [8, 16, 32, 63, 125, 250, 500, 1000]
    assert (
        prefix_sizes(5) == [5]
        and prefix_sizes(8) == [8]
        and prefix_sizes(16, 1) == [1, 2, 4, 8, 16]
    )
    sizes = prefix_sizes(1024)
    assert choose_prefix(sizes, [0, 3, 7]) == 8
    assert choose_prefix(sizes, [8]) == 16
    assert choose_prefix(sizes, [2, 100]) == 128 and choose_prefix(sizes, [127]) == 128
    assert choose_prefix(sizes, [0, 1023]) == 1024
    assert choose_prefix(sizes, []) == 8
    with pytest.raises(ValueError, match="beyond the largest prefix"):
        choose_prefix(sizes, [1024])


def test_lowest_free_slot_first(tiny):
    model, _ = tiny
    eng = SlotEngine(
        model, 8, max_len=64, max_new_tokens=4, stop_ids={0}, cuda_graphs=False, attention="flex"
    )
    for i in range(3):
        eng.submit(i, [5, 6, 7])
    eng._admit()
    assert eng.key == [0, 1, 2] + [None] * 5  # a short prefix holds them
    eng.key[1] = None  # freed: the next prompt takes slot 1, not slot 3
    eng.submit(9, [5])
    eng._admit()
    assert eng.key[:4] == [0, 9, 2, None]
    eng.close()


def test_width_classes_partition(tiny):
    """Groups in proportion to the waiting prompts' classes (widest >= S/16 and >= 1), prompts in their class."""
    model, _ = tiny
    eng = SlotEngine(
        model,
        16,
        max_len=64,
        max_new_tokens=10,
        stop_ids={0},
        width_classes=[20, 40],
        cuda_graphs=False,
    )
    for i, n in enumerate(
        [3] * 6 + [25] * 2
    ):  # classes: 3 + 10 <= 20 (six), 25 + 10 <= 40 (two), none of 64
        eng.submit(i, [5] * n)
    eng._partition()
    # shares 16 x 6/8 = 12 and 16 x 2/8 = 4, the widest gets max(0, 16 // 16) = 1, taken from the largest
    assert eng.caps == [20, 40, 64] and eng.groups == [(0, 11, 20), (11, 15, 40), (15, 16, 64)]
    eng.close()


def test_slot_engine_budget_of_one_and_bad_prompts(tiny):
    model, _ = tiny
    prompts = _prompts(4, model.config.vocab_size, seed=1)
    eng = SlotEngine(model, 2, max_len=48, max_new_tokens=1, stop_ids={0}, cuda_graphs=False)
    with pytest.raises(ValueError, match="prompt of 48 tokens"):
        eng.submit("long", [5] * 48)  # the cache holds prompts of up to max_len - max_new_tokens
    with pytest.raises(ValueError):
        eng.submit("empty", [])
    got = _run(eng, prompts)
    assert [got[i] for i in range(4)] == [hf_greedy(model, p, 1, {0}) for p in prompts]


def test_hf_continuous_engine_equals_hf_greedy(tiny):
    """transformers' ContinuousBatchingManager behind the same contract (the library baseline)."""
    model, _ = tiny
    max_new = 8
    prompts, stops, want = _greedy_case(model, 5, max_new, seed=2)
    got = _run(
        HFContinuousEngine(model, 4, max_new, stops, max_len=64), prompts, {1: prompts[3][:5]}
    )
    assert [got[i] for i in range(5)] == want
    assert got[("after", 1)] == hf_greedy(model, prompts[3][:5], max_new, stops)
    assert model.config._attn_implementation == "sdpa"


def _conv(cid, n_turns):
    msgs = []
    for t in range(n_turns):
        msgs += [
            {
                "role": "user",
                "content": f"Conversation {cid}, question {t + 1}: what is {t * 7 + 3} plus {t}?",
            },
            {"role": "assistant", "content": "old"},
        ]
    return {"id": cid, "messages": msgs}


CONVS = [_conv("one", 1), _conv("three", 3), _conv("five", 5), _conv("single", 1), _conv("two", 2)]


@pytest.mark.parametrize(
    "batch_size,attention", [(1, "auto"), (2, "flex"), (7, "auto"), (7, "flex")]
)
def test_regenerate_slots_equals_static(tiny, batch_size, attention):
    """Multi-turn conversations through the slot engine (turn k+1 joins once turn k is answered) give the
    static engine's conversations, whatever the number of rows."""
    model, tok = tiny
    want = regenerate(model, tok, CONVS, max_new_tokens=6, batch_size=3, engine="static")
    stats = {}
    got = regenerate(
        model,
        tok,
        CONVS,
        max_new_tokens=6,
        batch_size=batch_size,
        stats=stats,
        engine="slots",
        engine_options={"check_every": 2, "cuda_graphs": False, "attention": attention},
    )
    assert got == want
    assert stats["answers"] == 12 and stats["engine"] == "slots" and stats["decode_steps"] > 0
    assert stats["engine_stats"]["attention"] == (
        "flex" if attention == "flex" else "sdpa_groups"
    )  # auto on CPU


def test_slots_resume_after_a_kill(tiny, tmp_path, monkeypatch):
    """A slots run killed mid-decode keeps the conversations finished before it in the resume log; the rerun
    answers only the rest and equals the uninterrupted run."""
    from eagle3.regen.resume_log import ResumeLog

    model, tok = tiny
    opts = {"check_every": 1, "cuda_graphs": False}
    real = SlotEngine._harvest
    calls = []

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(SlotEngine, "_harvest", counted)
    want = regenerate(
        model, tok, CONVS, max_new_tokens=6, batch_size=2, engine="slots", engine_options=opts
    )
    kill_at, calls[:] = (
        len(calls),
        [],
    )  # the last check: every conversation but the last to finish is logged

    def dies(self):
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(SlotEngine, "_harvest", dies)
    path = tmp_path / "prompts.regen-partial.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(
            model,
            tok,
            CONVS,
            max_new_tokens=6,
            batch_size=2,
            journal=ResumeLog(path, REGEN),
            engine="slots",
            engine_options=opts,
        )
    rows = [json.loads(x) for x in path.read_text().splitlines()][1:]
    assert 1 <= len(rows) < len(CONVS)
    for r in rows:
        assert {k: v for k, v in r.items() if k != "idx"} == want[r["idx"]]
    monkeypatch.setattr(SlotEngine, "_harvest", real)
    stats = {}
    got = regenerate(
        model,
        tok,
        CONVS,
        max_new_tokens=6,
        batch_size=2,
        stats=stats,
        journal=ResumeLog(path, REGEN),
        engine="slots",
        engine_options=opts,
    )
    assert got == want and stats["resumed"] == len(rows)
    assert stats["answers"] == 12 - sum(
        sum(m["role"] == "assistant" for m in r["messages"]) for r in rows
    )


@pytest.fixture(scope="module")
def smollm_fp32():
    from conftest import smollm_dir

    return load_verifier(
        VerifierConfig(path=str(smollm_dir()), gguf_file=SMOLLM_GGUF, dtype="float32"), device="cpu"
    )


def test_slot_engine_equals_hf_greedy_on_smollm2(smollm_fp32):
    """The real verifier (SmolLM2-135M-Instruct GGUF, dequantised to fp32) on chat prompts, 2 rows for 4 prompts."""
    from eagle3.chat.template import ChatOptions, generation_prompt
    from eagle3.regen.regenerate import stop_token_ids

    model, tok = smollm_fp32
    stops = stop_token_ids(tok)
    prompts = [
        tok(
            generation_prompt(tok, [{"role": "user", "content": q}], ChatOptions()),
            add_special_tokens=False,
        )["input_ids"]
        for q in ("What is 2+2?", "Name three colours.", "Write a haiku about the sea.", "Hi")
    ]
    want = [hf_greedy(model, p, 16, stops) for p in prompts]
    sdpa = SlotEngine(
        model,
        2,
        max_len=128,
        max_new_tokens=16,
        stop_ids=stops,
        check_every=3,
        cuda_graphs=False,
        attention="sdpa_groups",
        min_prefix=1,
    )
    got = _run(sdpa, prompts)
    assert [got[i] for i in range(4)] == want
    assert any(s is not None for _, s in want)  # at least one answer ends on the end-of-turn token
    assert set(sdpa.stats["prefix_steps"]) <= {"1", "2"}  # width groups under the prefix logic
    eng = SlotEngine(
        model,
        3,
        max_len=128,
        max_new_tokens=16,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        attention="flex",
        flex_block=32,
        min_prefix=1,
    )
    later = {0: prompts[0] + want[0][0] + prompts[3]}  # a second turn after the first answer
    got = _run(eng, prompts, later)
    assert [got[i] for i in range(4)] == want  # FlexAttention decode, prefixes 1..3
    assert got[("after", 0)] == hf_greedy(model, later[0], 16, stops)


@pytest.mark.parametrize("pack", [False, True])
def test_prefix_reuse_on_smollm2_equals_hf_greedy(smollm_fp32, pack):
    """The real verifier (SmolLM2 GGUF, fp32) regenerating 3-turn chats through the slot engine with cross-turn prefix
    reuse (2 rows for 3 conversations, flex decode) gives batch-1 transformers greedy's conversations token for token;
    every later turn is prefilled after its cached prefix (the real ChatML re-rendering of the previous answer). With
    packed prefill (``pack``) the later turns are packed after their cached prefixes (a prefix stream)."""
    model, tok = smollm_fp32
    convs = [
        {
            "id": f"c{i}",
            "messages": [
                m
                for q in qs
                for m in ({"role": "user", "content": q}, {"role": "assistant", "content": "old"})
            ],
        }
        for i, qs in enumerate(
            [
                ("What is 2+2?", "And times 3?", "Say it in words."),
                ("Name three colours.", "Which one is warm?"),
                ("Write a haiku about the sea.", "Now one about rain.", "Which do you prefer?"),
            ]
        )
    ]
    want = regenerate(model, tok, convs, max_new_tokens=12, batch_size=1, engine="static")
    stats = {}
    got = regenerate(
        model,
        tok,
        convs,
        max_new_tokens=12,
        batch_size=2,
        stats=stats,
        engine="slots",
        engine_options={
            "check_every": 2,
            "cuda_graphs": False,
            "attention": "flex",
            "prefix_reuse": True,
            "prefill_pack": pack,
        },
    )
    assert got == want
    es = stats["engine_stats"]
    assert (
        es["reuse_rows"] == 5
        and es["reuse_full_prefills"] == 0
        and es["reused_tokens"] > es["prefill_tokens"]
    )
    assert es["prefill_pack"] is pack and any("+p" in k for k in es["prefill_buckets"]) is pack


def test_compiled_flex_decode_equals_eager():
    """The compiled flex decode (the CUDA path's function: BlockMask built inside the graph, fullgraph) traces and
    compiles here on CPU and equals eager FlexAttention, at two prefix shapes (a recompile each)."""
    from eagle3.regen.slot_attention import compiled_flex_decode

    block, kv_len = 128, 256
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 6, 1, 16, generator=g)  # [n, H, 1, D]
    k, v = (
        torch.randn(5, 2, kv_len, 16, generator=g),
        torch.randn(5, 2, kv_len, 16, generator=g),
    )  # [n, Hkv, L, D]
    attn_len = torch.tensor([0, 3, 127, 128, 255])
    idx = torch.arange(2, dtype=torch.int32).expand(5, 1, 1, 2).contiguous()
    fn = compiled_flex_decode()
    with torch.inference_mode():
        for n in (5, 2):
            want = flex_decode(q[:n], k[:n], v[:n], attn_len[:n], idx[:n], 16**-0.5, block)
            nb = kv_num_blocks(attn_len[:n], block)
            torch.testing.assert_close(
                fn(q[:n], k[:n], v[:n], attn_len[:n], idx[:n], 16**-0.5, block, nb), want
            )


def test_flex_probe_checks_the_result(tiny):
    """The start-up probe of the flex path (run on CUDA by auto/flex) passes eager FlexAttention and rejects a wrong
    kernel (here one that returns zeros) with a clear error."""
    model, _ = tiny
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=4,
        stop_ids={0},
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
    )
    eng._probe_flex(eng.flex, 6, 6, 2, 16, torch.float32, 64)
    with pytest.raises(RuntimeError, match="flex decode differs from SDPA"):
        eng._probe_flex(lambda q, *a, **kw: torch.zeros_like(q), 6, 6, 2, 16, torch.float32, 64)
    eng.close()


@pytest.mark.parametrize("mode", ["auto", "flex"])
def test_flex_failure_falls_back_or_raises(tiny, mode):
    """A flex failure at a prefix's first step: auto logs it and redoes the step on the SDPA path (same answers),
    flex raises with the prefix named."""
    model, _ = tiny
    max_new = 8
    prompts = _prompts(5, model.config.vocab_size, seed=5)
    stops = _stops(model, prompts, max_new)
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        min_prefix=1,
    )
    eng.attention_mode = mode  # as an auto engine whose start-up probe passed

    def broken(*a, **kw):
        raise RuntimeError("no kernel")

    eng.flex = eng._flex_alone = eng.cache.flex = broken  # the eager steps call _flex_alone
    if mode == "flex":
        with pytest.raises(RuntimeError, match="FlexAttention decode failed at slot prefix 4"):
            _run(eng, prompts)
        eng.close()  # _run raised before its close: give the model its attention back
        return
    got = _run(eng, prompts)
    assert [got[i] for i in range(5)] == [hf_greedy(model, p, max_new, stops) for p in prompts]
    assert eng.stats["attention"] == "sdpa_groups" and eng.flex is None


@pytest.mark.parametrize("attention", ["flex", "sdpa_groups"])
def test_compiled_step_equals_hf_greedy(tiny, attention):
    """prompts.regen_compile: the whole decode step under torch.compile (compile_min_prefix=2: one compile per slot
    prefix) gives HF greedy's answers token for token in fp32, rows refilled mid-answer and a tail on a smaller
    prefix included."""
    model, _ = tiny
    max_new = 12
    prompts = _prompts(11, model.config.vocab_size)
    stops = _stops(model, prompts, max_new)
    want = [hf_greedy(model, p, max_new, stops) for p in prompts]
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=3,
        cuda_graphs=False,
        attention=attention,
        flex_block=16,
        min_prefix=2,
        compile_step=True,
        compile_min_prefix=2,
    )
    assert eng.stats["compiled_step"] and eng._compiled is not None
    got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert (
        eng.stats["compiled_step"] and len(eng.stats["prefix_steps"]) >= 2
    )  # compiled for more than one prefix


def test_compiled_step_full_prefix_only_by_default(tiny):
    """By default only the full slot prefix runs the compiled step (one cold compile per run); the tail's smaller
    prefixes step eagerly, and the mix still gives HF greedy's answers token for token in fp32."""
    model, _ = tiny
    max_new = 12
    prompts = _prompts(
        11, model.config.vocab_size
    )  # as test_compiled_step_equals_hf_greedy: its tail hits prefix 2
    stops = _stops(model, prompts, max_new)
    want = [hf_greedy(model, p, max_new, stops) for p in prompts]
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=3,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        min_prefix=2,
        compile_step=True,
    )
    assert eng.stats["compile_min_prefix"] == 4
    compiled, seen = eng._compiled, []

    def counting(n):
        seen.append(n)
        return compiled(n)

    eng._compiled = counting
    got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert seen and set(seen) == {4}  # the compiled step ran at the full prefix only
    assert set(eng.stats["prefix_steps"]) - {"4"}  # and smaller prefixes were stepped (eagerly)
    assert eng.stats["compiled_step"]


def test_compiled_step_failure_falls_back(tiny, caplog):
    """A compiled step that fails is dropped with one warning; the answers are still HF greedy's."""
    model, _ = tiny
    max_new = 8
    prompts = _prompts(5, model.config.vocab_size, seed=7)
    want = [hf_greedy(model, p, max_new, {0}) for p in prompts]

    def broken(*a, **k):
        raise RuntimeError("inductor: no C++ compiler")

    eng = SlotEngine(
        model,
        3,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids={0},
        check_every=2,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        compile_step=True,
    )
    eng._compiled = broken  # as a compile that fails at its first call
    with caplog.at_level("WARNING"):
        got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert (
        not eng.stats["compiled_step"] and eng.stats["attention"] == "flex"
    )  # flex kept, compile dropped
    assert sum("compiled decode step failed" in r.message for r in caplog.records) == 1


# ---------------------------------------------------------------- prompts.regen_compile: auto


def test_estimate_decode_steps_is_the_answer_budget_over_the_rows():
    assert (
        estimate_decode_steps(18081, 512, 1024) == 9041
    )  # the 17K config's answers (H200 lease 2026-12-04)
    assert (
        estimate_decode_steps(106041, 512, 1024) == 53021
    )  # 100K conversations of the 127K config
    assert estimate_decode_steps(3, 10, 4) == 8  # 30 tokens over 4 rows: rounded up
    assert estimate_decode_steps(0, 512, 1024) == 0
    with pytest.raises(ValueError):
        estimate_decode_steps(5, 0, 4)


def test_compile_decision_auto_against_hand_computed_break_even():
    """auto compiles when estimated steps x (7.56 - 5.65) ms > 41.4 s: 21,675 steps give 41.399 s (off), 21,676 give
    41.401 s (on); at 512 tokens over 1,024 rows that is 43,350 vs 43,351 answers."""
    assert (EAGER_STEP_MS, COMPILED_STEP_MS, COMPILE_COLD_S) == (
        7.56,
        5.65,
        41.4,
    )  # the results files' figures
    below = compile_decision("auto", "cuda", "flex", 43350, 512, 1024)
    above = compile_decision("auto", "cuda", "flex", 43351, 512, 1024)
    assert below["compile"] is False and below["estimated_steps"] == 21675
    assert (
        below["estimated_saving_s"] == pytest.approx(41.40, abs=0.01)
        and below["compile_cost_s"] == 41.4
    )
    assert above["compile"] is True and above["estimated_steps"] == 21676
    assert "41.4 s cold compile" in above["reason"] and ">" in above["reason"]
    # today's hand choices: the 17K config off (9,041 steps: 17.3 s saved), 100K of the 127K config on (101.3 s)
    k17 = compile_decision("auto", "cuda", "flex", 18081, 512, 1024)
    k100 = compile_decision("auto", "cuda", "flex", 106041, 512, 1024)
    assert not k17["compile"] and k17["estimated_saving_s"] == pytest.approx(17.27, abs=0.01)
    assert k100["compile"] and k100["estimated_saving_s"] == pytest.approx(101.27, abs=0.01)
    assert k100 == {
        "setting": "auto",
        "compile": True,
        "device": "cuda",
        "attention": "flex",
        "answers": 106041,
        "max_new_tokens": 512,
        "slots": 1024,
        "estimated_steps": 53021,
        "saving_ms_per_step": 1.91,
        "estimated_saving_s": k100["estimated_saving_s"],
        "compile_cost_s": 41.4,
        "reason": k100["reason"],
    }


def test_compile_decision_auto_never_on_cpu_nor_off_the_measured_path():
    many = 10**9  # far above break-even
    cpu = compile_decision("auto", "cpu", "flex", many, 512, 1024)
    assert cpu["compile"] is False and "cpu" in cpu["reason"] and "estimated_steps" not in cpu
    assert compile_decision("auto", "mps", "flex", many, 512, 1024)["compile"] is False
    sdpa = compile_decision("auto", "cuda", "sdpa_groups", many, 512, 1024)
    assert sdpa["compile"] is False and "sdpa_groups" in sdpa["reason"]
    assert (
        compile_decision("auto", "cuda", "flex", None, 512, 1024)["compile"] is False
    )  # work unknown
    # true / false are taken as they are (true compiles on the CPU too, as before auto existed)
    assert compile_decision(True, "cpu", "sdpa_groups", 0, 512, 1024) == {
        "setting": True,
        "compile": True,
        "reason": "prompts.regen_compile: true",
    }
    assert compile_decision(False, "cuda", "flex", many, 512, 1024)["compile"] is False
    with pytest.raises(ValueError, match="compile_step"):
        compile_decision("yes", "cuda", "flex", many, 512, 1024)


def test_auto_engine_on_cpu_never_calls_torch_compile(tiny, monkeypatch):
    model, _ = tiny

    def no_compile(*a, **k):
        raise AssertionError("torch.compile called on the CPU")

    monkeypatch.setattr(torch, "compile", no_compile)
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=8,
        stop_ids={0},
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        compile_step="auto",
        planned_answers=10**9,
    )
    try:
        assert eng._compiled is None and not eng.stats["compiled_step"]
        d = eng.stats["compile_decision"]
        assert (
            d["setting"] == "auto"
            and d["compile"] is False
            and d["device"] == "cpu"
            and d["answers"] == 10**9
        )
    finally:
        eng.close()


def test_engine_compiles_when_the_decision_says_so(tiny, monkeypatch):
    """The engine follows compile_decision (a CUDA-sized positive decision, faked here) and records it."""
    import eagle3.regen.slots as cont

    model, _ = tiny
    seen = []

    def decide(setting, device, attention, answers, max_new, slots):
        seen.append((setting, device, attention, answers, max_new, slots))
        return {"setting": setting, "compile": True, "reason": "test"}

    monkeypatch.setattr(cont, "compile_decision", decide)
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=8,
        stop_ids={0},
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        compile_step="auto",
        planned_answers=123,
    )
    try:
        assert seen == [("auto", "cpu", "flex", 123, 8, 4)]
        assert eng._compiled is not None and eng.stats["compiled_step"]
        assert eng.stats["compile_decision"] == {
            "setting": "auto",
            "compile": True,
            "reason": "test",
        }
    finally:
        eng.close()


def test_regenerate_gives_the_engine_its_answers_and_records_the_decision(tiny):
    model, tok = tiny
    stats = {}
    regenerate(
        model,
        tok,
        CONVS,
        max_new_tokens=6,
        batch_size=2,
        stats=stats,
        engine="slots",
        engine_options={"check_every": 2, "cuda_graphs": False, "compile_step": "auto"},
    )
    d = stats["engine_stats"]["compile_decision"]
    assert stats["answers"] == 12 and not stats["engine_stats"]["compiled_step"]
    assert (
        d
        == {
            "setting": "auto",
            "compile": False,
            "device": "cpu",
            "attention": "sdpa_groups",
            "answers": 12,
            "max_new_tokens": 6,
            "slots": 2,
            "reason": d["reason"],
        }
        and "not CUDA" in d["reason"]
    )


def test_slot_rows_are_capped_at_the_conversations_and_checked_against_host_memory(
    tiny, monkeypatch
):
    """configs/smollm2-135m-full.yaml (prompts.gen_batch_size 1024) with `01 --limit 6` on a 23 GB CPU machine was
    killed by the kernel (a bare `Killed`): the slot engine preallocated 1,024 rows of KV cache (49 GB) for 6
    conversations, and its memory check ran on CUDA only (fresh-user trial 2026-12-05f). A conversation has one turn
    in flight at a time, so the rows are now at most the conversations; on the CPU the cache is checked against the
    host's available memory, as against the GPU's free memory."""
    import eagle3.regen.slots as C
    from eagle3.regen.kv_cache import KVCacheTooLarge

    model, tok = tiny
    want = regenerate(
        model,
        tok,
        CONVS,
        max_new_tokens=6,
        batch_size=2,
        engine="slots",
        engine_options={"check_every": 2, "cuda_graphs": False},
    )
    stats = {}
    got = regenerate(
        model,
        tok,
        CONVS,
        max_new_tokens=6,
        batch_size=1024,
        stats=stats,
        engine="slots",
        engine_options={"check_every": 2, "cuda_graphs": False, "compile_step": "auto"},
    )
    assert got == want and stats["engine_stats"]["compile_decision"]["slots"] == len(CONVS) == 5
    monkeypatch.setattr(C, "host_available_bytes", lambda: 2**30)
    with pytest.raises(
        KVCacheTooLarge
    ) as e:  # 1,024 rows x 2,048 columns of the tiny verifier: 6 GiB
        SlotEngine(model, 1024, 2048, 6, {0}, cuda_graphs=False, attention="sdpa_groups")
    assert str(e.value) == (
        "prompts.gen_batch_size: the regeneration KV cache of 1024 rows x 2048 columns (6 layers, "
        "2 KV heads of 16) needs 3.0 GiB, more than 90% of the 1.0 GiB this machine has available "
        "(MemAvailable); lower prompts.gen_batch_size (rows) or prompts.max_context_tokens / "
        "prompts.max_new_tokens (columns)"
    )


# ---------------------------------------------------------------- cross-turn prefix reuse (prompts.regen_prefix_reuse)

END = 7  # the token a "template" puts after an answer (as <|im_end|>); the stop ids are others


def _user_turns(n_convs: int, n_turns: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the user tokens (3..12 tokens each)."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randint(
                8, vocab, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g
            ).tolist()
            for _ in range(n_turns)
        ]
        for _ in range(n_convs)
    ]


def _next_prompt(prompt: list[int], ans: list[int], user: list[int], rewrite: bool) -> list[int]:
    """Turn k+1's prompt: turn k's prompt, its answer (``rewrite``: the last two answer tokens re-tokenised as two
    other ids, as a template's re-tokenisation may do at the boundary), the end token, the next user tokens."""
    if rewrite:
        ans = ans[:-2] + [
            (t + 1) % 5 + 1 for t in ans[-2:]
        ]  # ids 1..5: never an answer token here (vocab >= 8)
    return prompt + ans + [END] + user


def _run_turns(engine, users, rewrite=(), late=(), parent=True):
    """Drive ``engine`` as stage 01 does: every conversation's first turn submitted, turn k+1 submitted (with
    ``parent``/``retain``) while handling turn k's answer; conversations in ``late`` submit their next turn only while
    handling the NEXT answer of any conversation (their parent slot is gone by then). Returns ``{(c, k): (prompt,
    answer, stopped)}``."""
    got, prompts, turn, owed = {}, {}, {}, []

    def submit(c):
        k = turn[c]
        engine.submit(
            c,
            prompts[c],
            (-(len(users[c]) - k),),
            parent=c if parent and k else None,
            retain=k + 1 < len(users[c]),
        )

    for c in range(len(users)):
        prompts[c], turn[c] = list(users[c][0]), 0
        submit(c)
    for c, ans, stopped in engine.results():
        for d in owed:
            submit(d)
        owed.clear()
        got[(c, turn[c])] = (prompts[c], ans, stopped)
        if turn[c] + 1 < len(users[c]):
            prompts[c] = _next_prompt(
                prompts[c], ans, users[c][turn[c] + 1], c in rewrite and len(ans) >= 3
            )
            turn[c] += 1
            owed.append(c) if c in late else submit(c)
    engine.close()
    return got


def _expected_offset(prompt, ans, stopped, rewritten, min_tokens):
    """Cached columns a successor keeps, by hand: its parent's prompt + answer, less the last generated token when the
    answer ran out of budget (a stop token is never part of the answer, so a stopped answer is cached whole), less
    two more when the boundary was re-tokenised; 0 under the threshold."""
    off = (
        len(prompt)
        + len(ans)
        - (0 if stopped is not None and not rewritten else 1 if not rewritten else 2)
    )
    return off if off >= min_tokens else 0


@pytest.mark.parametrize(
    "attention,slots,check_every,prefill_tokens,min_prefix",
    [
        (
            "flex",
            2,
            3,
            65536,
            1,
        ),  # 6 conversations on 2 rows: first turns wait while successors take their slots
        (
            "sdpa_groups",
            3,
            2,
            48,
            1,
        ),  # several prefill forwards per check (48-token budget), mixed offsets in one
        ("flex", 8, 1, 65536, 2),  # every conversation live at once, checked every step
    ],
)
def test_prefix_reuse_equals_hf_greedy(
    tiny, attention, slots, check_every, prefill_tokens, min_prefix, monkeypatch
):
    """Multi-turn conversations with cross-turn prefix reuse: every answer equals plain transformers greedy decoding of
    the full prompt (fp32), and the reused / prefilled token counts equal the hand-computed offsets (truncated answers
    lose their last token, re-tokenised boundaries their last two; the first turns are prefilled in full)."""
    model, _ = tiny
    max_new = 10
    users = _user_turns(6, 3, model.config.vocab_size, seed=11)
    stops = _stops(model, [u[0] for u in users], max_new)
    offsets_seen = []
    real = SlotEngine._prefill

    def spy(self, reqs, slots_, width, offsets=None):
        offsets_seen.append(list(offsets or [0] * len(reqs)))
        return real(self, reqs, slots_, width, offsets)

    monkeypatch.setattr(SlotEngine, "_prefill", spy)
    eng = SlotEngine(
        model,
        slots,
        max_len=160,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=check_every,
        prefill_tokens=prefill_tokens,
        width_classes=[],
        cuda_graphs=False,
        attention=attention,
        flex_block=16,
        min_prefix=min_prefix,
        reuse_min_tokens=4,
    )
    got = _run_turns(eng, users, rewrite={1, 4})
    assert len(got) == 18
    for (c, k), (prompt, ans, stopped) in got.items():
        assert (ans, stopped) == hf_greedy(model, prompt, max_new, stops), (c, k)
    assert any(s is not None for _, _, s in got.values()) and not all(
        s is not None for _, _, s in got.values()
    )
    want_off = {
        (c, k): _expected_offset(*got[(c, k - 1)], c in {1, 4} and len(got[(c, k - 1)][1]) >= 3, 4)
        for c, k in got
        if k
    }
    kinds = {
        (c in {1, 4} and len(got[(c, k - 1)][1]) >= 3, got[(c, k - 1)][2] is not None)
        for c, k in want_off
    }
    assert {(False, True), (False, False)} <= kinds and any(
        r for r, _ in kinds
    )  # stopped, truncated, re-tokenised
    total = sum(len(p) for p, _, _ in got.values())
    assert eng.stats["reused_tokens"] == sum(want_off.values()) > 0
    assert eng.stats["prefill_tokens"] == total - sum(want_off.values())
    assert eng.stats["reuse_rows"] == sum(o > 0 for o in want_off.values())
    assert eng.stats["reuse_full_prefills"] == sum(o == 0 for o in want_off.values())
    assert sorted(o for call in offsets_seen for o in call if o) == sorted(
        o for o in want_off.values() if o
    )
    if slots < 6:
        assert any(
            0 in call and any(call) for call in offsets_seen
        )  # first turns and successors in one forward


def test_prefix_reuse_falls_back_when_the_slot_is_gone_or_off(tiny):
    """A successor submitted after its parent's slot was freed (the caller let a check pass), a parent whose common
    prefix is below the threshold, and prefix_reuse=False all prefill in full, with HF greedy's answers."""
    model, _ = tiny
    max_new = 8
    users = _user_turns(4, 2, model.config.vocab_size, seed=12)
    stops = _stops(model, [u[0] for u in users], max_new)

    def check(got):
        for (c, k), (prompt, ans, stopped) in got.items():
            assert (ans, stopped) == hf_greedy(model, prompt, max_new, stops), (c, k)
        return sum(len(p) for p, _, _ in got.values())

    kw = dict(
        max_len=128,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
    )
    eng = SlotEngine(model, 1, **kw, reuse_min_tokens=4)  # one row: each check harvests one answer
    got = _run_turns(
        eng, users, late={0, 1, 2, 3}
    )  # every successor arrives one answer (one check) late
    assert len(got) == 8
    assert eng.stats["reused_tokens"] == 0 and eng.stats["prefill_tokens"] == check(got)
    assert not eng.retained and all(h is None for h in eng.hold)  # nothing left held
    eng = SlotEngine(
        model, 2, **kw, reuse_min_tokens=1000
    )  # every common prefix is under the threshold
    got = _run_turns(eng, users)
    assert eng.stats["reused_tokens"] == 0 and eng.stats["prefill_tokens"] == check(got)
    assert eng.stats["reuse_full_prefills"] == 4
    eng = SlotEngine(model, 2, **kw, prefix_reuse=False)
    got = _run_turns(eng, users)
    assert eng.stats["reused_tokens"] == 0 and eng.stats["prefill_tokens"] == check(got)
    assert eng.stats["prefix_reuse"] is False and eng.stats["reuse_full_prefills"] == 0


def test_prefix_reuse_frees_unclaimed_slots(tiny):
    """A retained slot whose successor never comes is freed at the check after its answer is yielded, so later
    prompts get it (a 1-slot engine would otherwise stall)."""
    model, _ = tiny
    prompts = _prompts(3, model.config.vocab_size, seed=13)
    want = {i: hf_greedy(model, p, 4, {0}) for i, p in enumerate(prompts)}
    eng = SlotEngine(
        model,
        1,
        max_len=64,
        max_new_tokens=4,
        stop_ids={0},
        check_every=1,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
    )
    for i, p in enumerate(prompts):
        eng.submit(i, p, retain=True)  # nobody submits a successor
    got = {k: (a, s) for k, a, s in eng.results()}
    assert got == want
    assert eng.stats["reused_tokens"] == 0 and list(eng.retained) == [
        2
    ]  # the last one is still held, nothing waits
    eng.close()


def test_offset_prefill_layout_by_hand():
    """Columns and mask of a prefill at offsets 0 and 3, width 2, a 6-column cache: row 1's padding clamps to column 5."""
    cols, mask = eagle3_offset_layout(torch.tensor([0, 3]), 2, 6)
    assert cols.tolist() == [[0, 1], [3, 4]]
    assert mask.shape == (2, 1, 2, 5)  # Kw = min(6, 3 + 2)
    assert mask[:, 0].int().tolist() == [
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    ]
    cols, mask = eagle3_offset_layout(torch.tensor([4, 0]), 3, 6)
    assert cols.tolist() == [[4, 5, 5], [0, 1, 2]] and mask.shape == (2, 1, 3, 6)


def eagle3_offset_layout(offsets, width, cols):
    from eagle3.regen.slot_attention import offset_prefill_layout

    return offset_prefill_layout(offsets, width, cols)


def test_common_prefix():
    from eagle3.regen.slot_policy import common_prefix

    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert (
        common_prefix([], [1]) == 0
        and common_prefix([9], [1]) == 0
        and common_prefix([1, 2], [1, 2]) == 2
    )


def _prefill_snapshots(
    model,
    users,
    reuse: bool,
    max_new: int,
    prefill_graphs: bool = False,
    prefill_pack: bool = False,
) -> dict:
    """Run 2-turn conversations through a 3-slot engine; per (conversation, turn) the prompt and the K/V its prefill
    left in columns [0, len(prompt)) of its slot, every layer (``[layers, 2, Hkv, len, D]``)."""
    snaps, real = {}, SlotEngine._prefill
    eng = SlotEngine(
        model,
        3,
        max_len=128,
        max_new_tokens=max_new,
        stop_ids={0},
        check_every=2,
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        prefix_reuse=reuse,
        reuse_min_tokens=1,
        prefill_graphs=prefill_graphs,
        prefill_pack=prefill_pack,
    )

    def spy(self, reqs, slots, width, offsets=None):
        real(self, reqs, slots, width, offsets)
        for w, s in zip(reqs, slots):
            kv = [
                torch.stack([k[s, :, : len(w.ids)], v[s, :, : len(w.ids)]])
                for k, v in zip(self.cache.k, self.cache.v)
            ]
            snaps[(w.key, len(w.ids) > len(users[w.key][0]))] = (w.ids, torch.stack(kv))

    eng._prefill = spy.__get__(eng)
    _run_turns(eng, users)
    return snaps, eng.stats


def test_offset_prefill_leaves_the_full_prefill_kv(tiny):
    """The K/V a successor's suffix prefill leaves in its slot (columns [0, len): cached prefix + suffix, every layer)
    equal a full prefill of the same prompt (fp32, 1e-5): RoPE positions, write columns and the mask over the cached
    prefix are right. Three conversations whose successors share prefill forwards with first turns."""
    model, _ = tiny
    users = _user_turns(5, 2, model.config.vocab_size, seed=14)
    got, st = _prefill_snapshots(model, users, True, 6)
    want, st0 = _prefill_snapshots(model, users, False, 6)
    assert st["reuse_rows"] >= 3 and st0["reused_tokens"] == 0
    assert got.keys() == want.keys() and len(got) == 10
    for k in got:
        assert got[k][0] == want[k][0]
        torch.testing.assert_close(got[k][1], want[k][1], rtol=1e-5, atol=1e-5)


def test_defer_refill_by_hand():
    """The bulk-refill rule: defer while fewer than refill_free x slots are free, at least half are busy and more wait."""
    assert defer_refill(31, 1024, 100, 1 / 32)  # 31 < 32 free, 993 busy, 100 waiting
    assert not defer_refill(32, 1024, 100, 1 / 32)  # 32 free: refill
    assert not defer_refill(31, 1024, 31, 1 / 32)  # every waiting prompt fits: refill
    assert not defer_refill(600, 1024, 700, 1.0)  # under half busy: refill
    assert defer_refill(511, 1024, 700, 0.5) and not defer_refill(512, 1024, 700, 0.5)
    assert not defer_refill(1, 8, 5, 1 / 32)  # 8 slots x 1/32 < 1: never deferred


def test_refill_free_gives_fewer_fuller_prefills_and_the_same_answers(tiny):
    """A larger prompts.regen_refill_free batches the refills (fewer prefill forwards); answers stay HF greedy."""
    model, _ = tiny
    max_new = 12
    prompts, stops, want = _greedy_case(model, 24, max_new, seed=3)
    calls = {}
    for share in (1 / 32, 0.5):
        eng = SlotEngine(
            model,
            8,
            max_len=64,
            max_new_tokens=max_new,
            stop_ids=stops,
            check_every=1,
            cuda_graphs=False,
            refill_free=share,
        )
        got = _run(eng, prompts)
        assert [got[i] for i in range(len(prompts))] == want
        assert eng.stats["prefill_tokens"] == sum(map(len, prompts))
        calls[share] = eng.stats["prefill_calls"]
    assert calls[0.5] < calls[1 / 32], calls
    with pytest.raises(ValueError, match="refill_free"):
        SlotEngine(model, 8, max_len=64, max_new_tokens=max_new, stop_ids=stops, refill_free=0)


# ---------------------------------------------------------------- bucketed prefill (prompts.regen_prefill_graphs)


def test_prefill_bucket_by_hand():
    """Rows and width to powers of two (width >= 16), the offset path's attended columns too, each capped."""
    from eagle3.regen.slot_policy import prefill_bucket

    assert prefill_bucket(1, 1, 0, 1024, 2560) == (
        1,
        16,
        0,
    )  # the smallest forward: one row, 16 columns
    assert prefill_bucket(5, 40, 0, 1024, 2560) == (
        8,
        64,
        0,
    )  # 5 -> 8 rows, 40 -> 64 tokens, causal path
    assert prefill_bucket(3, 300, 1100, 1024, 2560) == (
        4,
        512,
        2048,
    )  # offsets: 1,100 attended columns -> 2,048
    assert prefill_bucket(32, 512, 512, 1024, 2560) == (
        32,
        512,
        512,
    )  # already at a bucket: unchanged
    assert prefill_bucket(600, 2000, 2100, 1024, 2560) == (
        1024,
        2048,
        2560,
    )  # columns capped at the cache's
    assert prefill_bucket(3, 40, 0, 3, 64) == (3, 64, 0)  # rows capped at the slots (3, not 4)
    assert prefill_bucket(2, 17, 33, 8, 48) == (
        2,
        32,
        48,
    )  # width 17 -> 32; 33 columns -> 64, capped at 48
    assert prefill_bucket(2, 5, 9, 8, 48, min_width=4) == (2, 8, 16)
    for bad in (
        (0, 5, 0, 8, 64),
        (9, 5, 0, 8, 64),
        (2, 0, 0, 8, 64),
        (2, 65, 0, 8, 64),
        (2, 5, 65, 8, 64),
    ):
        with pytest.raises(ValueError, match="prefill_bucket"):
            prefill_bucket(*bad)


def _is_bucket(n: int, cap: int, lo: int = 1) -> bool:
    """``n`` is a power of two >= ``lo``, or the cap."""
    return n == cap or (n >= lo and n & (n - 1) == 0)


@pytest.mark.parametrize(
    "attention,slots,check_every,prefill_tokens,reuse",
    [
        (
            "flex",
            5,
            2,
            65536,
            True,
        ),  # 5 rows (3 refilled: bucket 4, one padded row), successors at offsets
        (
            "sdpa_groups",
            5,
            2,
            64,
            True,
        ),  # a 64-token budget at bucketed shapes: many forwards, mixed offsets
        (
            "flex",
            5,
            1,
            65536,
            False,
        ),  # prefix reuse off: every turn prefilled in full on the causal path
        ("sdpa_groups", 7, 3, 65536, False),  # 7 slots: rows bucket 8 capped at 7
    ],
)
def test_prefill_graphs_equals_hf_greedy(
    tiny, attention, slots, check_every, prefill_tokens, reuse, monkeypatch
):
    """Bucketed prefill forwards (prefill_graphs=True: eager on the CPU, the same shapes a CUDA graph would replay):
    multi-turn answers equal plain transformers greedy decoding token for token (fp32), with prefix reuse on and off;
    every forward runs at a bucketed shape (rows, width and the offset path's attended columns), padded rows go to
    the scratch row, and rows and width were both padded somewhere."""
    import eagle3.regen.slot_attention as cont

    model, _ = tiny
    max_new = 10
    users = _user_turns(7, 3, model.config.vocab_size, seed=21)
    stops = _stops(model, [u[0] for u in users], max_new)
    seen, masked = [], []
    real_fwd, real_attn = SlotEngine._prefill_forward, cont.offset_prefill_attention

    def fwd(self, buf):
        seen.append((buf.key, buf.meta[0].tolist(), buf.meta[2].tolist()))
        return real_fwd(self, buf)

    def attn(query, key, value, kc, vc, rows, cols_idx, mask, scaling):
        masked.append((tuple(query.shape), tuple(mask.shape), kc.shape[2]))
        return real_attn(query, key, value, kc, vc, rows, cols_idx, mask, scaling)

    monkeypatch.setattr(SlotEngine, "_prefill_forward", fwd)
    monkeypatch.setattr(cont, "offset_prefill_attention", attn)
    eng = SlotEngine(
        model,
        slots,
        max_len=160,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=check_every,
        prefill_tokens=prefill_tokens,
        width_classes=[],
        cuda_graphs=False,
        attention=attention,
        flex_block=16,
        min_prefix=1,
        reuse_min_tokens=4,
        prefix_reuse=reuse,
        prefill_graphs=True,
    )
    assert eng.cache.k[0].shape[0] == slots + 1  # the scratch row
    cols = eng.cache.k[0].shape[2]
    got = _run_turns(eng, users, rewrite={1})
    assert len(got) == 21
    for (c, k), (prompt, ans, stopped) in got.items():
        assert (ans, stopped) == hf_greedy(model, prompt, max_new, stops), (c, k)
    st = eng.stats
    assert (
        st["prefill_graphs"] is True and st["prefill_graph_captures"] == 0
    )  # CPU: eager, never captured
    assert (st["reused_tokens"] > 0) == reuse and st["prefill_tokens"] + st["reused_tokens"] == sum(
        len(p) for p, _, _ in got.values()
    )
    assert len(seen) == st["prefill_calls"] == sum(st["prefill_buckets"].values())
    assert st["prefill_padded_tokens"] == sum(pb * wb for (pb, wb, _), _, _ in seen)
    row_pad = width_pad = False
    for (pb, wb, kw), rows, last in seen:
        p = sum(r < slots for r in rows)
        assert (
            rows[p:] == [slots] * (pb - p) and len(set(rows[:p])) == p
        )  # padded rows: the scratch row only
        assert (
            _is_bucket(pb, slots) and _is_bucket(wb, cols, 16) and (kw == 0 or _is_bucket(kw, cols))
        )
        assert pb * wb <= max(
            prefill_tokens, wb
        )  # within the budget at the bucketed shape (a lone row excepted)
        row_pad |= pb > p
        width_pad |= wb > max(last[:p]) + 1
    assert row_pad and width_pad, seen
    # the offset path ran at the bucketed shapes: queries [Pb, H, Wb, D], mask [Pb, 1, Wb, Kwb]
    assert bool(masked) == reuse
    offset_keys = [k for k, _, _ in seen if k[2]]
    assert len(offset_keys) * 6 == len(masked)  # one call per layer
    for (pb, wb, kw), (q, m, _) in zip([k for k in offset_keys for _ in range(6)], masked):
        assert (q[0], q[2]) == (pb, wb) and m == (pb, 1, wb, kw)


def test_bucketed_prefill_kv_equals_unbucketed(tiny):
    """The K/V a bucketed prefill leaves in its slot for a real row (columns [0, len): cached prefix + suffix, every
    layer) equal the unbucketed full prefill's (fp32, 1e-5), with prefix reuse on and off."""
    model, _ = tiny
    users = _user_turns(5, 2, model.config.vocab_size, seed=14)
    want, _ = _prefill_snapshots(model, users, False, 6)
    for reuse in (True, False):
        got, st = _prefill_snapshots(model, users, reuse, 6, prefill_graphs=True)
        assert st["prefill_graphs"] and (
            st["reuse_rows"] >= 3 if reuse else st["reused_tokens"] == 0
        )
        assert (
            st["prefill_padded_tokens"]
            > sum(len(ids) for ids, _ in got.values()) - st["reused_tokens"]
        )
        assert got.keys() == want.keys() and len(got) == 10
        for k in got:
            assert got[k][0] == want[k][0]
            torch.testing.assert_close(got[k][1], want[k][1], rtol=1e-5, atol=1e-5)


def _sentinel_engine(model, lens, **engine_kw):
    """An 8-slot engine (64 columns, flex blocks of 16, ``engine_kw``) whose cache holds 0.5 everywhere, that cache's
    copy, and one waiting request of random ids per length in ``lens`` (keys 0, 1, ...)."""
    from eagle3.regen.slot_policy import Waiting

    eng = SlotEngine(
        model,
        8,
        max_len=64,
        max_new_tokens=4,
        stop_ids={0},
        cuda_graphs=False,
        attention="flex",
        flex_block=16,
        **engine_kw,
    )
    for t in eng.cache.k + eng.cache.v:
        t.fill_(0.5)
    g = torch.Generator().manual_seed(5)
    reqs = [
        Waiting((i,), i, torch.randint(8, model.config.vocab_size, (n,), generator=g).tolist())
        for i, n in enumerate(lens)
    ]
    return eng, [t.clone() for t in eng.cache.k + eng.cache.v], reqs


@pytest.mark.parametrize("offsets", [None, [0, 12, 20]])
def test_bucketed_prefill_writes_only_its_rows_and_the_scratch_row(tiny, offsets):
    """A bucketed prefill of 3 rows (bucket 4: one padded row) into slots 1, 4 and 6 of 8, every slot's cache set to a
    sentinel first: the other slots are untouched, the prefilled slots keep their cached prefix (columns [0, offset))
    and get new K/V over their prompt, and the padded row wrote the scratch row (slot 8) only."""
    model, _ = tiny
    lens = [9, 25, 30]
    eng, before, reqs = _sentinel_engine(model, lens, prefill_graphs=True)
    offs = offsets or [0, 0, 0]
    slots = [1, 4, 6]
    with torch.inference_mode():
        eng._prefill(reqs, slots, max(n - o for n, o in zip(lens, offs)), offsets)
    # 3 rows -> 4; fresh: width 30 -> 32, the causal path; at offsets: suffixes 9, 13, 10 -> 16, prompts of up to
    # 30 tokens -> 32 attended columns
    assert list(eng.stats["prefill_buckets"]) == (["4x16x32"] if offsets else ["4x32"])
    assert eng.stats["prefill_padded_tokens"] == (4 * 16 if offsets else 4 * 32)
    for t0, t1 in zip(before, eng.cache.k + eng.cache.v):
        for s in (0, 2, 3, 5, 7):
            assert torch.equal(t1[s], t0[s]), s  # live slots untouched
        for s, n, o in zip(slots, lens, offs):
            assert torch.equal(t1[s, :, :o], t0[s, :, :o])  # the cached prefix kept
            assert not torch.isclose(t1[s, :, o:n], t0[s, :, o:n]).any(), s  # the suffix written
        assert not torch.equal(t1[8], t0[8])  # the padded row wrote the scratch row
    assert (
        eng.key[1] == 0
        and eng.key[4] == 1
        and eng.key[6] == 2
        and eng.lengths[[1, 4, 6]].tolist() == lens
    )
    eng.close()


def test_prefill_graph_capture_failure_falls_back_to_eager(tiny, caplog, monkeypatch):
    """A prefill graph that cannot be captured (here: capture asked for on the CPU, and the capture itself made to
    fail, so also where CUDA exists) logs one warning and the bucketed forwards run eagerly, with HF greedy's
    answers."""
    from eagle3.regen import slot_prefill

    def fail(*_a, **_k):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(slot_prefill, "capture_graph", fail)
    model, _ = tiny
    max_new = 8
    prompts, stops, want = _greedy_case(model, 9, max_new, seed=4)
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        prefill_graphs=True,
    )
    eng._prefill_capture = True  # as on CUDA with graphs: torch.cuda.Stream() fails here
    with caplog.at_level("WARNING"):
        got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    warns = [r for r in caplog.records if "prefill CUDA graph capture failed" in r.getMessage()]
    assert len(warns) == 1 and eng._prefill_capture is False
    assert eng.stats["prefill_graph_captures"] == 0 and eng.stats["prefill_calls"] >= 2


def test_kv_cache_size_is_checked_before_allocation():
    """SmolLM2-135M's slot KV cache (30 layers, 3 KV heads of 64, bf16) at 2,560 columns: 56.25 GiB at 1,024 rows and
    112.5 GiB at 2,048; a cache over 90% of the free GPU memory is refused in one line naming the settings."""
    from eagle3.errors import UserError
    from eagle3.regen.kv_cache import KVCacheTooLarge, check_kv_fits

    gib = 2**30
    assert (
        check_kv_fits(1024, 2560, 30, 3, 64, 2, 139 * gib)
        == 2 * 30 * 1024 * 3 * 2560 * 64 * 2
        == int(56.25 * gib)
    )
    assert check_kv_fits(2048, 2560, 30, 3, 64, 2, 139 * gib) == int(
        112.5 * gib
    )  # 112.5 <= 0.9 x 139 = 125.1
    with pytest.raises(KVCacheTooLarge) as e:
        check_kv_fits(2048, 2560, 30, 3, 64, 2, 120 * gib)  # 112.5 > 0.9 x 120 = 108
    assert isinstance(e.value, UserError)
    assert str(e.value) == (
        "prompts.gen_batch_size: the regeneration KV cache of 2048 rows x 2560 columns (30 layers, "
        "3 KV heads of 64) needs 112.5 GiB, more than 90% of the 120.0 GiB the GPU has free; lower "
        "prompts.gen_batch_size (rows) or prompts.max_context_tokens / prompts.max_new_tokens "
        "(columns)"
    )


@pytest.fixture(scope="module")
def tiny_mla():
    """A random MLA + MoE DeepseekV3 verifier (Kimi-K2.5's architecture): keys 16 + 8 = 24 wide, values 16, and a
    config ``head_dim`` of 8 (the rope part alone)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
    )
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.mark.parametrize(
    "attention,pack", [("sdpa_groups", False), ("flex", False), ("flex", True)]
)
def test_slot_engine_on_an_mla_verifier_equals_hf_greedy(tiny_mla, attention, pack):
    """01's default engine on Kimi's architecture: the K cache is 24 wide and the V cache 16 (kv_head_dims), and the
    answers, next turns reusing their prefix included, equal plain transformers greedy (fp32). Before the fix the
    cache took the config's head_dim (8) for both and the first prefill raised a shape-mismatch traceback."""
    from eagle3.verifier.arch import kv_head_dims

    model = tiny_mla
    assert kv_head_dims(model.config) == (24, 16)
    max_new = 10
    prompts = _prompts(7, model.config.vocab_size, seed=5)
    stops = _stops(model, prompts, max_new)
    want = [hf_greedy(model, p, max_new, stops) for p in prompts]
    later = {
        1: prompts[1] + want[1][0] + prompts[4][:3]
    }  # a next turn: its prefix is reused from the slot
    eng = SlotEngine(
        model,
        3,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        width_classes=[],
        cuda_graphs=False,
        attention=attention,
        flex_block=16,
        reuse_min_tokens=4,
        prefill_pack=pack,
    )
    assert (eng.cache.k[0].shape[-1], eng.cache.v[0].shape[-1]) == (24, 16)
    assert (
        eng.kv_bytes_per_token == 4 * 4 * (24 + 16) * 4
    )  # layers x KV heads x (key + value width) x fp32
    if attention == "flex":  # the start-up probe (CUDA) at MLA's widths: keys 24, values 16
        eng._probe_flex(eng.flex, 3, 4, 4, 24, torch.float32, 64, dv=16)
    got = _run(eng, prompts, later)
    assert [got[i] for i in range(len(prompts))] == want
    assert got[("after", 1)] == hf_greedy(model, later[1], max_new, stops)


def test_kv_cache_check_counts_mla_value_width():
    """K and V of different widths (MLA) are summed, not the key width twice: Kimi-K2.5 (61 layers, 64 heads, keys
    192, values 128, bf16) at 16 rows x 4,096 columns needs 61 x 16 x 64 x 4096 x (192 + 128) x 2 bytes = 152.5 GiB."""
    from eagle3.regen.kv_cache import check_kv_fits

    gib = 2**30
    assert (
        check_kv_fits(16, 4096, 61, 64, 192, 2, 1000 * gib, v_head_dim=128)
        == 61 * 16 * 64 * 4096 * 320 * 2
    )
    assert check_kv_fits(16, 4096, 61, 64, 192, 2, 1000 * gib, v_head_dim=128) == int(152.5 * gib)
