"""Offline decoding: greedy baseline vs EAGLE-3 chain speculative decoding (lossless, bookkeeping)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from single_prompt import greedy_generate, speculative_generate

from eagle3.decoding.common import accepted_prefix
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError

AUX = [1, 3, 4]  # HF hidden_states indices of a 6-layer verifier


def make_verifier(vocab: int = 256, seed: int = 0):
    """A random 6-layer float32 Llama whose greedy output is varied (not one repeated token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def make_drafter(
    verifier, draft_targets: list[int], seed: int = 1, num_layers: int = 1
) -> Eagle3Drafter:
    """A random real Eagle3Drafter over the draft vocab ``sorted(draft_targets)`` (d2t offsets), ``num_layers`` deep."""
    c = verifier.config
    V = c.vocab_size
    targets = torch.tensor(sorted(set(draft_targets)), dtype=torch.long)  # [draft_V]
    args = DrafterArgs(
        hidden_size=c.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        draft_vocab_size=len(targets),
        target_vocab_size=V,
        target_hidden_size=c.hidden_size,
        num_layers=num_layers,
    )
    torch.manual_seed(seed)
    d = Eagle3Drafter(args, verifier.get_input_embeddings().weight).eval()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[targets] = True
    d.set_vocab_map(targets - torch.arange(len(targets)), t2d)
    return d


def constant_drafter(verifier, token: int) -> Eagle3Drafter:
    """A real drafter that always drafts ``token``: lm_head = 0, so argmax = draft id 0 = smallest target id."""
    V = verifier.config.vocab_size
    d = make_drafter(verifier, [token] + list(range(token + 1, min(V, token + 32))))
    with torch.no_grad():
        d.lm_head.weight.zero_()
    return d


@pytest.fixture(scope="module")
def verifier():
    return make_verifier()


PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 7, 120, 64, 33, 8], [200, 1, 2, 3], [77]]


def test_accepted_prefix_hand_built():
    d = torch.tensor([4, 5, 6])
    assert accepted_prefix(d, torch.tensor([4, 5, 6, 9])) == 3
    assert accepted_prefix(d, torch.tensor([4, 5, 1, 9])) == 2
    assert (
        accepted_prefix(d, torch.tensor([4, 0, 6, 9])) == 1
    )  # a later match after a miss does not count
    assert accepted_prefix(d, torch.tensor([0, 5, 6, 9])) == 0


def test_greedy_matches_transformers_generate(verifier):
    ids = torch.tensor([PROMPTS[0]])
    ref = verifier.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=24,
        min_new_tokens=24,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens, seconds = greedy_generate(verifier, PROMPTS[0], 24, eos_ids=())
    assert tokens == ref[0, ids.shape[1] :].tolist()
    assert seconds > 0


@pytest.mark.parametrize("steps,num_layers", [(1, 1), (4, 1), (4, 2)])
def test_random_drafter_is_lossless(verifier, steps, num_layers):
    drafter = make_drafter(verifier, list(range(0, 256, 3)), num_layers=num_layers)
    for p in PROMPTS[1:]:
        g, _ = greedy_generate(verifier, p, 16, ())
        r = speculative_generate(verifier, drafter, p, AUX, steps=steps, max_new_tokens=16)
        assert r.tokens == g
        assert all(1 <= a <= steps + 1 for a in r.accept_lengths)
        for a, flags in zip(r.accept_lengths, r.accepted):
            assert flags == [j < a - 1 for j in range(steps)]
        # every verify step emits accepted + 1 tokens; the first token comes from the prefill
        assert 1 + sum(r.accept_lengths) >= len(g) > sum(r.accept_lengths[:-1])


def _expected_accept_lengths(greedy: list[int], c: int, steps: int, max_new: int) -> list[int]:
    """Hand simulation of chain drafting with a drafter that always proposes ``c``.

    ``greedy`` is the verifier's greedy continuation (longer than ``max_new`` + steps). Token 0
    comes from the prefill; each verify step at emitted index j accepts the leading drafts that
    equal greedy[j+1], greedy[j+2], ... and emits them plus one bonus token, the last step only
    up to ``max_new`` tokens in all.
    """
    lens, j = [], 0
    while j + 1 < max_new:
        a = 0
        while a < steps and greedy[j + 1 + a] == c:
            a += 1
        lens.append(min(a + 1, max_new - 1 - j))
        j += a + 1
    return lens


@pytest.fixture(scope="module")
def long_greedy(verifier):
    return greedy_generate(verifier, PROMPTS[0], 40, ())[0]


@pytest.mark.parametrize("steps", [2, 3])
def test_constant_drafter_accept_lengths_match_hand_simulation(verifier, long_greedy, steps):
    prompt = PROMPTS[0]
    c = Counter(long_greedy).most_common(1)[0][0]
    assert 0.2 < long_greedy.count(c) / len(long_greedy) < 0.9  # a mixed accept/reject case
    drafter = constant_drafter(verifier, c)
    r = speculative_generate(verifier, drafter, prompt, AUX, steps=steps, max_new_tokens=30)
    assert r.tokens == long_greedy[:30]
    expected = _expected_accept_lengths(long_greedy, c, steps, 30)
    assert r.accept_lengths == expected
    assert 1 in expected and max(expected) > 1  # both rejections and acceptances occurred
    assert r.num_verify_steps == len(expected)


def test_eos_and_max_new_tokens_trim_like_greedy(verifier, long_greedy):
    c = Counter(long_greedy).most_common(1)[0][0]
    drafter = constant_drafter(verifier, c)
    eos = long_greedy[7]
    stop = long_greedy.index(eos)
    g, _ = greedy_generate(verifier, PROMPTS[0], 40, [eos])
    r = speculative_generate(
        verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=40, eos_ids=[eos]
    )
    assert g == long_greedy[: stop + 1] == r.tokens
    for n in (2, 5, 13):
        r = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=n)
        assert r.tokens == long_greedy[:n]
    r1 = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=1)
    assert r1.num_verify_steps == 0  # the prefill token alone


def test_drafter_cache_holds_only_verified_step0_keys(verifier):
    """Per round: one step-0 call appending the positions verified last round (the prompt first;
    later always k+1 slots, the rejected ones marked invalid, positions continuing), then k-1
    drafted calls at positions t+1..t+k-1 that are cropped before the next round."""
    drafter = make_drafter(verifier, list(range(0, 256, 2)))
    calls = []
    orig = drafter.decode

    def spy(input_ids, hidden, position_ids, cache, valid=None):
        calls.append(
            (cache.length, position_ids[0].tolist(), None if valid is None else valid[0].tolist())
        )
        return orig(input_ids, hidden, position_ids, cache, valid)

    drafter.decode = spy
    steps = 3
    r = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=steps, max_new_tokens=15)
    n = len(PROMPTS[0])
    rounds = [calls[i : i + steps] for i in range(0, len(calls), steps)]
    assert len(rounds) >= r.num_verify_steps and all(len(g) == steps for g in rounds)
    assert rounds[0][0] == (0, list(range(n)), [True] * n)
    slots, last = 0, n - 1  # cache slots, last verified position
    for rnd in range(r.num_verify_steps):
        length, pos, valid = rounds[rnd][0]
        assert length == slots  # the previous round's drafted keys were cropped
        if rnd > 0:
            emitted = r.accept_lengths[rnd - 1]  # not the last round: nothing was cut
            assert pos == list(range(last + 1, last + 2 + steps))
            assert valid == [j < emitted for j in range(steps + 1)]
            last += emitted
        slots += len(pos)
        for i in range(1, steps):
            assert rounds[rnd][i] == (slots + i - 1, [last + i], None)


def test_bad_arguments_raise_user_error(verifier):
    drafter = make_drafter(verifier, list(range(64)))
    with pytest.raises(UserError, match="aux_layers"):
        speculative_generate(verifier, drafter, [1, 2], [1, 2, 6], steps=2)
    with pytest.raises(UserError, match="prompt 0 is empty"):
        greedy_generate(verifier, [], 4)


def test_lossless_on_tiny_llama_fixture(tiny_llama_dir, smollm_tokenizer):
    """The shared 6-layer random verifier with SmolLM2's vocab and a chat-rendered prompt."""
    from transformers import AutoModelForCausalLM

    from eagle3.chat.template import render

    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    drafter = make_drafter(v, list(range(0, len(smollm_tokenizer), 97)))
    ids = render(
        smollm_tokenizer,
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    g, _ = greedy_generate(v, ids, 20, [smollm_tokenizer.eos_token_id])
    r = speculative_generate(
        v,
        drafter,
        ids,
        [2, 3, 4],
        steps=3,
        max_new_tokens=20,
        eos_ids=[smollm_tokenizer.eos_token_id],
    )
    assert r.tokens == g


def test_oracle_drafter_counts_only_emitted_tokens(verifier, long_greedy):
    """Issue 11 item 2: a drafter that always proposes the verifier's own greedy tokens, 3 steps,
    max_new_tokens 10. Token 0 comes from the prefill; the 3 verify steps emit 4 + 4 + 1 tokens
    (the third step's verifier accepted all 3 drafts, but only one token fits the budget): tau 3.0."""
    from oracle_drafter import OracleDrafter

    from eagle3.decoding.metrics import acceptance_stats

    oracle = OracleDrafter([PROMPTS[0] + long_greedy], verifier.config.vocab_size)
    r = speculative_generate(verifier, oracle, PROMPTS[0], AUX, steps=3, max_new_tokens=10)
    assert r.tokens == long_greedy[:10]
    assert r.accept_lengths == [4, 4, 1]
    T, F = True, False
    assert r.accepted == [[T, T, T], [T, T, T], [F, F, F]]
    s = acceptance_stats(r.accepted, 3)
    assert s["tau"] == pytest.approx(3.0) and s["accepted_hist"] == [1, 0, 0, 2]
    assert s["conditional"] == pytest.approx([2 / 3, 1.0, 1.0])
    # EOS inside a step: greedy[6] first occurs at index i <= 6; the cut keeps tokens 0..i
    eos = long_greedy[6]
    stop = long_greedy.index(eos)
    r = speculative_generate(
        verifier, oracle, PROMPTS[0], AUX, steps=3, max_new_tokens=40, eos_ids=[eos]
    )
    assert r.tokens == long_greedy[: stop + 1]
    assert (
        sum(r.accept_lengths) == stop
    )  # every emitted token after the prefill one, nothing past EOS
    assert r.accept_lengths[:-1] == [4] * (len(r.accept_lengths) - 1)


# ---------------------------------------------------------------------------------------------
# batches: rows of different lengths that accept different numbers of drafts per round
# ---------------------------------------------------------------------------------------------
BATCH_PROMPTS = [PROMPTS[0], [9, 8, 7, 6, 5, 4], PROMPTS[1], [13, 250, 31, 4, 4, 4, 100, 2, 8]]


@pytest.fixture(scope="module")
def per_row_greedy(verifier):
    return [greedy_generate(verifier, p, 20, ())[0] for p in BATCH_PROMPTS]


def test_batched_greedy_equals_per_row_greedy(verifier, per_row_greedy):
    from eagle3.decoding.decode import greedy_generate_batch

    res = greedy_generate_batch(verifier, BATCH_PROMPTS, 20)
    assert res.tokens == per_row_greedy
    ref = verifier.generate(
        torch.tensor([BATCH_PROMPTS[1]]),
        do_sample=False,
        max_new_tokens=20,
        min_new_tokens=20,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert per_row_greedy[1] == ref[0, len(BATCH_PROMPTS[1]) :].tolist()


@pytest.mark.parametrize("steps,num_layers", [(1, 1), (3, 1), (3, 2)])
def test_batched_speculative_equals_per_row_greedy_and_batch1_tau(
    verifier, per_row_greedy, steps, num_layers
):
    """fp32: batched speculative output == per-row unbatched greedy token for token, and every row
    accepts exactly what it accepts alone (so tau of batch 4 == tau of batch 1)."""
    from eagle3.decoding.decode import speculative_generate_batch
    from eagle3.decoding.metrics import acceptance_stats

    drafter = make_drafter(verifier, list(range(0, 256, 3)), num_layers=num_layers)
    batch = speculative_generate_batch(
        verifier,
        drafter,
        BATCH_PROMPTS,
        AUX,
        steps=steps,
        max_new_tokens=20,
        reference=per_row_greedy,
    )
    alone = [
        speculative_generate(verifier, drafter, p, AUX, steps=steps, max_new_tokens=20)
        for p in BATCH_PROMPTS
    ]
    assert [r.tokens for r in batch.rows] == per_row_greedy
    assert [r.accept_lengths for r in batch.rows] == [r.accept_lengths for r in alone]
    assert all(r.mismatch is None and r.gap is None for r in batch.rows)
    flags_b = [f for r in batch.rows for f in r.accepted]
    flags_1 = [f for r in alone for f in r.accepted]
    assert acceptance_stats(flags_b, steps)["tau"] == acceptance_stats(flags_1, steps)["tau"]
    assert batch.rounds >= max(r.num_verify_steps for r in batch.rows)


def test_batched_constant_drafter_mixed_acceptance(verifier, long_greedy):
    """A drafter that always proposes the most frequent greedy token: rows accept different counts
    per round; each row still matches its own greedy output and hand-simulated accept lengths."""
    from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch

    c = Counter(long_greedy).most_common(1)[0][0]
    drafter = constant_drafter(verifier, c)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    greedy = [greedy_generate(verifier, p, 40, ())[0] for p in prompts]
    res = speculative_generate_batch(verifier, drafter, prompts, AUX, steps=3, max_new_tokens=30)
    for g, row in zip(greedy, res.rows):
        assert row.tokens == g[:30]
        assert row.accept_lengths == _expected_accept_lengths(g, c, 3, 30)
    assert len({tuple(r.accept_lengths) for r in res.rows}) > 1  # rows really advanced differently
    assert greedy_generate_batch(verifier, prompts, 30).tokens == [g[:30] for g in greedy]


def test_batched_oracle_drafter_tau_counts_only_emitted_tokens(verifier):
    """Issue 11 item 2 in a batch: every row gets 4 + 4 + 1 emitted tokens at 3 steps and 10 new tokens."""
    from oracle_drafter import OracleDrafter

    from eagle3.decoding.decode import speculative_generate_batch
    from eagle3.decoding.metrics import acceptance_stats

    greedy = [greedy_generate(verifier, p, 20, ())[0] for p in BATCH_PROMPTS]
    oracle = OracleDrafter(
        [p + g for p, g in zip(BATCH_PROMPTS, greedy)], verifier.config.vocab_size
    )
    res = speculative_generate_batch(
        verifier, oracle, BATCH_PROMPTS, AUX, steps=3, max_new_tokens=10, reference=greedy
    )
    assert [r.tokens for r in res.rows] == [g[:10] for g in greedy]
    assert all(r.accept_lengths == [4, 4, 1] for r in res.rows)
    s = acceptance_stats([f for r in res.rows for f in r.accepted], 3)
    assert s["tau"] == pytest.approx(3.0) and s["accepted_hist"] == [4, 0, 0, 8]


def test_batched_eos_per_row(verifier, per_row_greedy):
    """A row that emits the EOS id stops there (EOS kept); the others run to max_new_tokens."""
    from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch

    eos = per_row_greedy[2][5]
    cuts = [g[: g.index(eos) + 1] if eos in g[:20] else g[:20] for g in per_row_greedy]
    assert any(len(c) < 20 for c in cuts)
    drafter = make_drafter(verifier, list(range(0, 256, 3)))
    spec = speculative_generate_batch(
        verifier, drafter, BATCH_PROMPTS, AUX, steps=2, max_new_tokens=20, eos_ids=[eos]
    )
    assert [r.tokens for r in spec.rows] == cuts
    assert [1 + sum(r.accept_lengths) for r in spec.rows] == [len(c) for c in cuts]
    assert greedy_generate_batch(verifier, BATCH_PROMPTS, 20, [eos]).tokens == cuts


def test_mismatch_reports_index_and_logit_gap(verifier, per_row_greedy):
    """A reference that differs from the verifier at token 5 of row 1: the first mismatch is found
    there, with gap = verifier logit of its top-1 minus that of the reference token (hand-computed
    from a plain forward over prompt + greedy[:5])."""
    from eagle3.decoding.decode import speculative_generate_batch

    ref = [list(g) for g in per_row_greedy]
    wrong = (ref[1][5] + 7) % 256
    ref[1][5] = wrong
    drafter = make_drafter(verifier, list(range(0, 256, 3)))
    res = speculative_generate_batch(
        verifier, drafter, BATCH_PROMPTS, AUX, steps=3, max_new_tokens=20, reference=ref
    )
    assert [r.mismatch for r in res.rows] == [None, 5, None, None]
    with torch.no_grad():
        logits = verifier(torch.tensor([BATCH_PROMPTS[1] + per_row_greedy[1][:5]])).logits[
            0, -1
        ]  # [V]
    want = float(logits.max() - logits[wrong])
    assert want > 0 and res.rows[1].gap == pytest.approx(want, abs=1e-4)


def two_token_drafter(verifier, a: int, b: int, num_layers: int, seed: int = 1) -> Eagle3Drafter:
    """A real drafter over the draft vocab {a, b} whose choice depends on every layer: ``lm_head`` row 1 random, row 0
    zero, so it drafts the larger id when ``w . norm(h) > 0`` and the smaller one otherwise (argmax takes the first of
    ties). With ``a``, ``b`` the verifier's most frequent greedy tokens, some drafts are accepted."""
    d = make_drafter(verifier, [a, b], seed=seed, num_layers=num_layers)
    with torch.no_grad():
        d.lm_head.weight.zero_()
        d.lm_head.weight[1].normal_()
    return d


def frequent_pair(greedy_rows: list[list[int]]) -> tuple[int, int]:
    (a, _), (b, _) = Counter(t for r in greedy_rows for t in r).most_common(2)
    return a, b


@pytest.mark.parametrize("num_layers", [1, 2])
def test_layer_dependent_drafter_batched_equals_alone_with_acceptances(
    verifier, per_row_greedy, num_layers
):
    """Drafts that depend on all the drafter's layers (and so on each layer's cache: crops of the drafted slots,
    holes of rejected ones) are accepted in places; batched == alone == greedy, accept lengths equal."""
    from eagle3.decoding.decode import speculative_generate_batch

    drafter = two_token_drafter(
        verifier, *frequent_pair(per_row_greedy), num_layers=num_layers, seed=3
    )
    batch = speculative_generate_batch(
        verifier, drafter, BATCH_PROMPTS, AUX, steps=3, max_new_tokens=20, reference=per_row_greedy
    )
    alone = [
        speculative_generate(verifier, drafter, p, AUX, steps=3, max_new_tokens=20)
        for p in BATCH_PROMPTS
    ]
    assert [r.tokens for r in batch.rows] == [r.tokens for r in alone] == per_row_greedy
    assert [r.accept_lengths for r in batch.rows] == [r.accept_lengths for r in alone]
    assert [r.accepted for r in batch.rows] == [r.accepted for r in alone]
    flags = [f for r in alone for fl in r.accepted for f in fl]
    assert 0 < sum(flags) < len(flags)  # accepted and rejected drafts both occur
