"""05's batch-1 static decoder (eagle3/decoding/static_decode.py): the same tokens, acceptance lengths and mismatch
records as the batched decoder (and as transformers' ``generate``), for a Llama and an MLA/MoE DeepseekV3 verifier;
one decoder reused over prompts of different lengths; the static cache's mask by hand."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from single_prompt import greedy_generate, speculative_generate
from test_decode import (
    AUX,
    PROMPTS,
    _expected_accept_lengths,
    constant_drafter,
    make_drafter,
    make_verifier,
)

from eagle3.decoding.static_decode import StaticDecoder, capacity_for, resolve_decoder
from eagle3.drafter.caches import StaticKVCache
from eagle3.errors import UserError


@pytest.fixture(scope="module")
def verifier():
    return make_verifier()


@pytest.fixture(scope="module")
def long_greedy(verifier):
    return greedy_generate(verifier, PROMPTS[0], 40, ())[0]


def _deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
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
        max_position_embeddings=512,
    )
    return DeepseekV3ForCausalLM(cfg).eval()


def test_static_cache_mask_and_write_by_hand():
    c = StaticKVCache(5, 1)
    m = c.mask(torch.tensor([1, 3]))
    assert m.shape == (1, 1, 2, 5)
    assert m[0, 0].tolist() == [[True, True, False, False, False], [True, True, True, True, False]]
    k = torch.arange(2.0).view(1, 1, 2, 1)  # [1, kvh=1, T=2, d=1]
    kc, vc = c.write(0, k, k + 10, torch.tensor([3, 1]))
    assert kc[0, 0, :, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0] and vc[0, 0, :, 0].tolist() == [
        0.0,
        11.0,
        0.0,
        10.0,
        0.0,
    ]
    with pytest.raises(ValueError):
        StaticKVCache(0)


def test_greedy_matches_transformers_generate_over_reused_decoder(verifier):
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]  # one decoder, lengths 12, 1, 4 in turn
    refs = []
    for p in prompts:  # transformers' own greedy, before the decoder swaps the verifier's attention
        ids = torch.tensor([p])
        refs.append(
            verifier.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        )
    with StaticDecoder(verifier, capacity_for(prompts, 24, 3), 24) as dec:
        for p, ref in zip(prompts, refs):
            g = dec.greedy(p)
            assert g.tokens == [ref] and g.seconds > 0
    assert (
        verifier.config._attn_implementation != "eagle3_static"
    )  # close() gave the attention back


@pytest.mark.parametrize("steps,num_layers", [(1, 1), (3, 1), (3, 2)])
def test_speculative_equals_batched_decoder(verifier, steps, num_layers):
    drafter = make_drafter(verifier, list(range(0, 256, 3)), num_layers=num_layers)
    prompts = [PROMPTS[0], [9, 8, 7, 6, 5, 4], PROMPTS[2]]
    wants = [
        speculative_generate(verifier, drafter, p, AUX, steps=steps, max_new_tokens=20)
        for p in prompts
    ]
    greedy = [greedy_generate(verifier, p, 20, ())[0] for p in prompts]
    with StaticDecoder(
        verifier, capacity_for(prompts, 20, steps), 20, drafter=drafter, aux_layers=AUX, steps=steps
    ) as dec:
        for p, want, g in zip(prompts, wants, greedy):
            got = dec.speculative(p).rows[0]
            assert got.tokens == want.tokens == g
            assert got.accept_lengths == want.accept_lengths and got.accepted == want.accepted


@pytest.mark.parametrize("steps", [2, 3])
def test_constant_drafter_accept_lengths_match_hand_simulation(verifier, long_greedy, steps):
    c = Counter(long_greedy).most_common(1)[0][0]
    drafter = constant_drafter(verifier, c)
    with StaticDecoder(
        verifier,
        capacity_for([PROMPTS[0]], 30, steps),
        30,
        drafter=drafter,
        aux_layers=AUX,
        steps=steps,
    ) as dec:
        s = dec.speculative(PROMPTS[0])
    r = s.rows[0]
    expected = _expected_accept_lengths(long_greedy, c, steps, 30)
    assert r.tokens == long_greedy[:30] and r.accept_lengths == expected
    assert 1 in expected and max(expected) > 1
    assert s.rounds >= len(expected) and s.draft_seconds > 0 and s.verify_seconds > 0


def test_oracle_drafter_eos_and_budget(verifier, long_greedy):
    from oracle_drafter import OracleDrafter

    oracle = OracleDrafter([PROMPTS[0] + long_greedy], verifier.config.vocab_size)
    with StaticDecoder(
        verifier, capacity_for([PROMPTS[0]], 10, 3), 10, drafter=oracle, aux_layers=AUX, steps=3
    ) as dec:
        r = dec.speculative(PROMPTS[0]).rows[0]
    assert r.tokens == long_greedy[:10] and r.accept_lengths == [
        4,
        4,
        1,
    ]  # as the batched decoder (test_decode)
    eos = long_greedy[6]
    stop = long_greedy.index(eos)
    with StaticDecoder(
        verifier,
        capacity_for([PROMPTS[0]], 40, 3),
        40,
        eos_ids=[eos],
        drafter=oracle,
        aux_layers=AUX,
        steps=3,
    ) as dec:
        r = dec.speculative(PROMPTS[0]).rows[0]
        g = dec.greedy(PROMPTS[0]).tokens[0]
    assert r.tokens == g == long_greedy[: stop + 1]
    assert sum(r.accept_lengths) == stop and r.accept_lengths[:-1] == [4] * (
        len(r.accept_lengths) - 1
    )


def test_mismatch_index_and_gap_as_batched(verifier, long_greedy):
    drafter = make_drafter(verifier, list(range(0, 256, 2)))
    ref = list(long_greedy[:20])
    ref[5] = (ref[5] + 1) % 256  # a reference that differs from the verifier at index 5
    from eagle3.decoding.decode import speculative_generate_batch

    want = speculative_generate_batch(
        verifier, drafter, [PROMPTS[0]], AUX, 3, 20, (), reference=[ref]
    ).rows[0]
    with StaticDecoder(
        verifier, capacity_for([PROMPTS[0]], 20, 3), 20, drafter=drafter, aux_layers=AUX, steps=3
    ) as dec:
        got = dec.speculative(PROMPTS[0], reference=ref).rows[0]
    assert got.mismatch == want.mismatch == 5
    assert got.gap == pytest.approx(want.gap, abs=1e-5) and got.gap > 0


def test_deepseek_v3_verifier_mla_moe():
    v = _deepseek()
    d = make_drafter(v, list(range(0, 256, 4)))
    aux = [1, 3, 4]
    p = [5, 17, 99, 3, 250, 42, 7]
    ids = torch.tensor([p])
    ref = v.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=16,
        min_new_tokens=16,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(p) :].tolist()
    want = speculative_generate(v, d, p, aux, steps=3, max_new_tokens=16)
    with StaticDecoder(v, capacity_for([p], 16, 3), 16, drafter=d, aux_layers=aux, steps=3) as dec:
        assert dec.greedy(p).tokens == [ref]
        got = dec.speculative(p).rows[0]
        assert dec.kv.k[0].shape[-1] == 24 and dec.kv.v[0].shape[-1] == 16  # MLA: qk 16 + 8, v 16
    assert got.tokens == want.tokens == ref and got.accept_lengths == want.accept_lengths


def test_bench_prompts_static_equals_batched(verifier):
    from eagle3.decoding.offline import bench_prompts

    drafter = make_drafter(verifier, list(range(0, 256, 3)))
    ids = [("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", [9, 8, 7, 6, 5, 4])]
    b = bench_prompts(
        verifier, drafter, ids, AUX, 3, 16, (), batch_size=1, decoder="batched", progress=False
    )
    s = bench_prompts(
        verifier, drafter, ids, AUX, 3, 16, (), batch_size=1, decoder="static", progress=False
    )
    assert s["decoder"] == "static" and b["decoder"] == "batched"
    assert s["tau"] == b["tau"] and s["accepted_hist"] == b["accepted_hist"] and s["failures"] == 0
    assert [r["accept_lengths"] for r in s["per_prompt"]] == [
        r["accept_lengths"] for r in b["per_prompt"]
    ]


def test_errors(verifier):
    cpu = torch.device("cpu")
    assert (
        resolve_decoder("auto", 1, cpu) == "batched"
        and resolve_decoder("auto", 1, torch.device("cuda")) == "static"
    )
    assert resolve_decoder("auto", 8, torch.device("cuda")) == "batched"
    with pytest.raises(UserError, match="one prompt at a time"):
        resolve_decoder("static", 4, cpu)
    with StaticDecoder(verifier, 40, 20) as dec:
        with pytest.raises(ValueError, match="needs 41 cache columns, capacity 40"):
            dec.greedy(list(range(1, 14)))
        with pytest.raises(UserError, match="without a drafter"):
            dec.speculative([1, 2])
    with pytest.raises(UserError, match="exactly 3"):
        StaticDecoder(verifier, 40, 20, drafter=make_drafter(verifier, [1, 2]), aux_layers=[1, 2])


@pytest.mark.parametrize("num_layers", [1, 2])
def test_layer_dependent_drafter_static_equals_batched(verifier, num_layers):
    """The static decoder's drafter (one StaticKVCache column set per layer, drafted slots overwritten in place) drafts
    what the batched decoder's does, with drafts that depend on every layer and are accepted in places."""
    from test_decode import BATCH_PROMPTS, frequent_pair, two_token_drafter

    greedy = [greedy_generate(verifier, p, 20, ())[0] for p in BATCH_PROMPTS]
    drafter = two_token_drafter(verifier, *frequent_pair(greedy), num_layers=num_layers, seed=3)
    wants = [
        speculative_generate(verifier, drafter, p, AUX, steps=3, max_new_tokens=20)
        for p in BATCH_PROMPTS
    ]
    with StaticDecoder(
        verifier, capacity_for(BATCH_PROMPTS, 20, 3), 20, drafter=drafter, aux_layers=AUX, steps=3
    ) as dec:
        for p, want, g in zip(BATCH_PROMPTS, wants, greedy):
            got = dec.speculative(p).rows[0]
            assert got.tokens == want.tokens == g
            assert got.accept_lengths == want.accept_lengths and got.accepted == want.accepted
    assert sum(f for w in wants for fl in w.accepted for f in fl) > 0
