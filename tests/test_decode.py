"""Offline decoding: greedy baseline vs EAGLE-3 chain speculative decoding (lossless, bookkeeping)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from eagle3.decode import accepted_prefix, greedy_generate, speculative_generate
from eagle3.errors import UserError
from eagle3.model import DrafterArgs, Eagle3Drafter

AUX = [1, 3, 4]  # HF hidden_states indices of a 6-layer verifier



def make_verifier(vocab: int = 256, seed: int = 0):
    """A random 6-layer float32 Llama whose greedy output is varied (not one repeated token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def make_drafter(verifier, draft_targets: list[int], seed: int = 1) -> Eagle3Drafter:
    """A random real Eagle3Drafter over the draft vocab ``sorted(draft_targets)`` (d2t offsets)."""
    c = verifier.config
    V = c.vocab_size
    targets = torch.tensor(sorted(set(draft_targets)), dtype=torch.long)  # [draft_V]
    args = DrafterArgs(hidden_size=c.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=96, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                       draft_vocab_size=len(targets), target_vocab_size=V, target_hidden_size=c.hidden_size)
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
    assert accepted_prefix(d, torch.tensor([4, 0, 6, 9])) == 1  # a later match after a miss does not count
    assert accepted_prefix(d, torch.tensor([0, 5, 6, 9])) == 0


def test_greedy_matches_transformers_generate(verifier):
    ids = torch.tensor([PROMPTS[0]])
    ref = verifier.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                            min_new_tokens=24, eos_token_id=None, pad_token_id=0)
    tokens, seconds = greedy_generate(verifier, PROMPTS[0], 24, eos_ids=())
    assert tokens == ref[0, ids.shape[1]:].tolist()
    assert seconds > 0


@pytest.mark.parametrize("steps", [1, 4])
def test_random_drafter_is_lossless(verifier, steps):
    drafter = make_drafter(verifier, list(range(0, 256, 3)))
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
    equal greedy[j+1], greedy[j+2], ... and emits them plus one bonus token.
    """
    lens, j = [], 0
    while j + 1 < max_new:
        a = 0
        while a < steps and greedy[j + 1 + a] == c:
            a += 1
        lens.append(a + 1)
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
    r = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=40, eos_ids=[eos])
    assert g == long_greedy[: stop + 1] == r.tokens
    for n in (2, 5, 13):
        r = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=n)
        assert r.tokens == long_greedy[:n]
    r1 = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=4, max_new_tokens=1)
    assert r1.num_verify_steps == 0  # the prefill token alone


def test_drafter_cache_holds_only_verified_step0_keys(verifier):
    """Each drafter call continues the cache (positions == cache length onwards) and the step-0
    calls cover every verified position exactly once: 0..n-1 for the prompt, then each round's
    accepted tokens."""
    drafter = make_drafter(verifier, list(range(0, 256, 2)))
    calls = []
    orig = drafter.decode

    def spy(input_ids, hidden, position_ids, cache):
        calls.append((cache.length, position_ids[0].tolist()))
        return orig(input_ids, hidden, position_ids, cache)

    drafter.decode = spy
    steps = 3
    r = speculative_generate(verifier, drafter, PROMPTS[0], AUX, steps=steps, max_new_tokens=15)
    n = len(PROMPTS[0])
    for length, pos in calls:
        assert pos == list(range(length, length + len(pos)))
    step0 = [pos for (_, pos) in calls[:: steps]]  # 1 step-0 call + (steps-1) drafted calls per round
    assert step0[0] == list(range(n))
    assert len(step0) == r.num_verify_steps
    for prev, cur, a in zip(step0, step0[1:], r.accept_lengths):
        assert cur == list(range(prev[-1] + 1, prev[-1] + 1 + a))


def test_bad_arguments_raise_user_error(verifier):
    drafter = make_drafter(verifier, list(range(64)))
    with pytest.raises(UserError, match="steps"):
        speculative_generate(verifier, drafter, [1, 2], AUX, steps=0)
    with pytest.raises(UserError, match="aux_layers"):
        speculative_generate(verifier, drafter, [1, 2], [1, 2, 6], steps=2)
    with pytest.raises(UserError, match="empty"):
        greedy_generate(verifier, [], 4)
    with pytest.raises(UserError, match="max_new_tokens"):
        greedy_generate(verifier, [1], 0)


def test_lossless_on_tiny_llama_fixture(tiny_llama_dir, smollm_tokenizer):
    """The shared 6-layer random verifier with SmolLM2's vocab and a chat-rendered prompt."""
    from transformers import AutoModelForCausalLM

    from eagle3.chat import render

    v = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    drafter = make_drafter(v, list(range(0, len(smollm_tokenizer), 97)))
    ids = render(smollm_tokenizer, [{"role": "user", "content": "What is the capital of France?"}],
                 add_generation_prompt=True)
    g, _ = greedy_generate(v, ids, 20, [smollm_tokenizer.eos_token_id])
    r = speculative_generate(v, drafter, ids, [2, 3, 4], steps=3, max_new_tokens=20, eos_ids=[smollm_tokenizer.eos_token_id])
    assert r.tokens == g
