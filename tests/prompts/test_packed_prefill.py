"""Packed prefill of the slot engine (eagle3.regen.packed_prefill, prompts.regen_prefill_pack): the layout by hand,
the block mask against the dense document mask, the attention against per-row SDPA, and the engine's answers against
plain transformers greedy decoding (fp32)."""

from __future__ import annotations

import pytest
import torch
from test_continuous import (  # noqa: F401
    _greedy_case,
    _prefill_snapshots,
    _run,
    _run_turns,
    _sentinel_engine,
    _stops,
    _user_turns,
    hf_greedy,
    tiny,
)

from eagle3.regen.packed_prefill import (
    PackedRouting,
    packed_bucket,
    packed_flex,
    packed_layout,
    packed_prefill_attention,
)
from eagle3.regen.slots import SlotEngine


def test_packed_bucket_by_hand():
    assert (
        packed_bucket(0, 128) == 0
        and packed_bucket(1, 128) == 128
        and packed_bucket(128, 128) == 128
    )
    assert (
        packed_bucket(129, 128) == 256
        and packed_bucket(3000, 128) == 4096
        and packed_bucket(65536, 128) == 65536
    )
    assert packed_bucket(9, 4) == 16 and packed_bucket(3, 4) == 4
    for bad in ((-1, 128), (5, 0), (5, 96)):
        with pytest.raises(ValueError, match="packed_bucket"):
            packed_bucket(*bad)


def test_packed_layout_by_hand():
    """Rows of 3, 2 and 4 fed tokens after 0, 5 and 2 cached columns, slots 4, 1, 6 of 8, 32 columns, block 4:
    9 fed tokens -> Tq 16 (7 padding), 7 prefix entries -> Tp 8 (1 padding)."""
    ids = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    lay = packed_layout(ids, [0, 5, 2], [4, 1, 6], 8, 32, 4)
    pad = 7
    assert lay.ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34] + [0] * pad]
    doc, pos, wslot, wcol = lay.q.tolist()
    assert doc == [0, 0, 0, 1, 1, 2, 2, 2, 2] + [3] * pad  # padding: document R = 3
    assert (
        pos == [0, 1, 2, 5, 6, 2, 3, 4, 5] + [0] * pad
    )  # RoPE position = cache column after the cached prefix
    assert wslot == [4, 4, 4, 1, 1, 6, 6, 6, 6] + [0] * pad  # padding writes slot 0 ...
    assert (
        wcol == [0, 1, 2, 5, 6, 2, 3, 4, 5] + [31] * pad
    )  # ... at column L - 1, never used by a request
    kv_doc, kv_col = lay.kv.tolist()
    assert kv_doc == doc + [1, 1, 1, 1, 1, 2, 2, -1] and kv_col == pos + [0, 1, 2, 3, 4, 0, 1, 0]
    assert lay.prefix.tolist() == [[1, 1, 1, 1, 1, 6, 6, 0], [0, 1, 2, 3, 4, 0, 1, 31]]
    assert lay.rows.tolist() == [
        [4, 1, 6, 0, 0, 0, 0, 0],
        [2, 4, 8, 0, 0, 0, 0, 0],
        [3, 7, 6, 0, 0, 0, 0, 0],
    ]
    # query block 0 (rows 0-1): fed block 0, prefix entries 0..4 = stream 16..20 -> kv blocks 4, 5
    # block 1 (rows 1-2): fed blocks 0, 1; prefix 0..6 -> blocks 4, 5
    # block 2 (row 2 + padding): fed blocks 1, 2 (row 2 starts at 5); prefix 5..6 -> block 5
    # block 3 (padding): fed blocks 2 (padding starts at 9), 3; no prefix
    nb = lay.kv_num_blocks.view(-1).tolist()
    assert nb == [3, 4, 3, 2] and lay.kv_num_blocks.dtype == lay.kv_indices.dtype == torch.int32
    got = [lay.kv_indices[0, 0, i, :n].tolist() for i, n in enumerate(nb)]
    assert got == [[0, 4, 5], [0, 1, 4, 5], [1, 2, 5], [2, 3]]
    assert lay.kv_indices.shape == (1, 1, 4, 6) and int(lay.kv_indices.max()) <= 5
    for bad in (
        dict(ids=[[1], []], offsets=[0, 0], slots=[0, 1]),
        dict(ids=[[1]], offsets=[0, 0], slots=[0]),
        dict(ids=[[1]] * 9, offsets=[0] * 9, slots=list(range(9))),
    ):
        with pytest.raises(ValueError, match="packed_layout"):
            packed_layout(n_slots=8, cols=32, block=4, **bad)


def _dense_mask(lay) -> torch.Tensor:
    """bool [Tq, Tq + Tp]: same row and column at or before the query's (the mask_mod, evaluated everywhere)."""
    return (lay.kv[0][None] == lay.q[0][:, None]) & (lay.kv[1][None] <= lay.q[1][:, None])


def _block_cover(lay, block: int) -> torch.Tensor:
    """bool [Tq, Tq + Tp]: pairs inside a kv block the block mask lists for the query's block."""
    tq, tk = lay.q.shape[1], lay.kv.shape[1]
    cover = torch.zeros(tq // block, tk // block, dtype=torch.bool)
    for i, n in enumerate(lay.kv_num_blocks.view(-1).tolist()):
        cover[i, lay.kv_indices[0, 0, i, :n].long()] = True
    return cover.repeat_interleave(block, 0).repeat_interleave(block, 1)


@pytest.mark.parametrize("seed", range(6))
def test_packed_blocks_cover_the_document_mask(seed):
    """Random rows (lengths, offsets, slots): every (query, key) pair a real query attends under the document mask
    lies in a listed block, each real query attends exactly its row's cached prefix and fed tokens up to itself, each
    padding query at least itself, and the listed blocks are fewer than all of them (the block-diagonal part)."""
    g = torch.Generator().manual_seed(seed)
    r = int(torch.randint(1, 9, (1,), generator=g))
    fed = torch.randint(1, 40, (r,), generator=g).tolist()
    off = [int(x) * (int(x) % 2) for x in torch.randint(0, 50, (r,), generator=g)]
    slots = torch.randperm(12, generator=g)[:r].tolist()
    block = 8
    lay = packed_layout([[5] * n for n in fed], off, slots, 12, 128, block)
    dense, cover = _dense_mask(lay), _block_cover(lay, block)
    n = sum(fed)
    assert not (dense[:n] & ~cover[:n]).any()  # real queries: nothing they attend is left out
    t = 0
    for row, (f, o) in enumerate(zip(fed, off)):
        for j in range(f):
            want = torch.zeros(dense.shape[1], dtype=torch.bool)
            want[t - j : t + 1] = True  # its fed tokens up to itself
            p0 = lay.q.shape[1] + sum(off[:row])
            want[p0 : p0 + o] = True  # its whole cached prefix
            assert torch.equal(dense[t], want), (row, j)
            t += 1
    # padding queries (one document at column 0): each attends at least itself inside the listed blocks
    assert all(dense[k, k] and cover[k, k] for k in range(n, lay.q.shape[1]))
    nq, nk = lay.kv_indices.shape[2:]
    if nq > 2:
        assert int(lay.kv_num_blocks.sum()) < nq * nk


def test_packed_flex_equals_per_row_sdpa():
    """The packed attention (eager FlexAttention, grouped-query heads 6 / 2) equals per-row causal SDPA over each row's
    cached prefix + fed tokens (fp32); the fed tokens' K/V are written at their (slot, column) and the prefix is read
    from the cache."""
    g = torch.Generator().manual_seed(3)
    h, hkv, d, cols, s = 6, 2, 16, 64, 5
    fed, off, slots = [7, 3, 12], [0, 9, 4], [3, 0, 2]
    kc, vc = torch.randn(s, hkv, cols, d, generator=g), torch.randn(s, hkv, cols, d, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    lay = packed_layout([[1] * n for n in fed], off, slots, s, cols, 8)
    tq = lay.q.shape[1]
    q = torch.randn(1, h, tq, d, generator=g)
    k, v = torch.randn(1, hkv, tq, d, generator=g), torch.randn(1, hkv, tq, d, generator=g)
    routing = PackedRouting(
        lay.q, lay.kv, lay.prefix, lay.kv_num_blocks, lay.kv_indices, packed_flex, 8
    )
    out = packed_prefill_attention(q, k, v, kc, vc, routing, None)  # [1, H, Tq, D]
    t = 0
    for f, o, sl in zip(fed, off, slots):
        kk = torch.cat([kc0[sl, :, :o], k[0, :, t : t + f]], 1)  # [Hkv, o + f, D]
        vv = torch.cat([vc0[sl, :, :o], v[0, :, t : t + f]], 1)
        mask = torch.arange(o + f)[None] <= (o + torch.arange(f))[:, None]  # [f, o + f]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[0, :, t : t + f],
            kk.repeat_interleave(h // hkv, 0),
            vv.repeat_interleave(h // hkv, 0),
            attn_mask=mask,
        )
        torch.testing.assert_close(out[0, :, t : t + f], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            kc[sl, :, o : o + f], k[0, :, t : t + f]
        )  # written at the row's columns
        assert torch.equal(kc[sl, :, :o], kc0[sl, :, :o])  # its cached prefix kept
        t += f
    assert torch.isfinite(out).all()
    for sl in (1, 4):
        assert torch.equal(kc[sl], kc0[sl]) and torch.equal(
            vc[sl], vc0[sl]
        )  # other slots untouched
    assert torch.equal(
        kc[0, :, : cols - 1][:, :9], kc0[0, :, :9]
    )  # slot 0: only its fed columns 9..11 and L - 1


@pytest.mark.parametrize(
    "attention,slots,check_every,prefill_tokens,reuse",
    [
        ("flex", 5, 2, 65536, True),  # successors at offsets share packed forwards with first turns
        ("sdpa_groups", 5, 2, 40, True),  # a 40-token budget: many packed forwards, mixed offsets
        ("flex", 5, 1, 65536, False),  # prefix reuse off: no prefix stream
        ("sdpa_groups", 7, 3, 65536, False),
    ],
)
def test_packed_prefill_equals_hf_greedy(
    tiny, attention, slots, check_every, prefill_tokens, reuse, monkeypatch
):
    """Packed prefill forwards (eager on the CPU): multi-turn answers equal plain transformers greedy decoding token
    for token (fp32), with prefix reuse on and off; every forward's fed tokens stay within the budget (a lone row
    excepted), its stream is the power-of-two bucket of them, and the padding counted is the streams' length."""
    model, _ = tiny
    max_new = 10
    users = _user_turns(7, 3, model.config.vocab_size, seed=21)
    stops = _stops(model, [u[0] for u in users], max_new)
    seen = []
    real = SlotEngine._packed_forward

    def fwd(self, buf):
        seen.append((buf.key, buf.t.q[0].tolist(), buf.t.rows[2].tolist()))
        return real(self, buf)

    monkeypatch.setattr(SlotEngine, "_packed_forward", fwd)
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
        prefill_pack=True,
    )
    assert eng.cache.k[0].shape[0] == slots  # no scratch row
    got = _run_turns(eng, users, rewrite={1})
    assert len(got) == 21
    for (c, k), (prompt, ans, stopped) in got.items():
        assert (ans, stopped) == hf_greedy(model, prompt, max_new, stops), (c, k)
    st = eng.stats
    assert st["prefill_pack"] is True and st["prefill_graph_captures"] == 0
    assert (st["reused_tokens"] > 0) == reuse and st["prefill_tokens"] + st["reused_tokens"] == sum(
        len(p) for p, _, _ in got.values()
    )
    assert len(seen) == st["prefill_calls"] == sum(st["prefill_buckets"].values())
    assert st["prefill_padded_tokens"] == sum(tq for (tq, _), _, _ in seen)
    for (tq, tp), doc, lens in seen:
        r = sum(n > 0 for n in lens)  # rows of the forward; padding tokens are document r
        n = sum(d < r for d in doc)  # fed tokens
        assert (
            tq == packed_bucket(n, 16) and doc[n:] == [r] * (tq - n) and doc[:n] == sorted(doc[:n])
        )
        assert (n <= prefill_tokens or r == 1) and (tp > 0) <= reuse
    assert all(name.startswith("q") for name in st["prefill_buckets"])
    assert set(st["prefill_first_s"]) == set(
        st["prefill_buckets"]
    )  # each shape's first forward timed once
    assert all(v > 0 for v in st["prefill_first_s"].values())
    assert any(tp for (_, tp), _, _ in seen) == reuse


def test_packed_prefill_kv_equals_padded(tiny):
    """The K/V a packed prefill leaves in a row's slot (columns [0, len): cached prefix + suffix, every layer) equal
    the padded prefill's (fp32, 1e-5), with prefix reuse on and off, and the padding is below the padded path's."""
    model, _ = tiny
    users = _user_turns(5, 2, model.config.vocab_size, seed=14)
    want, st0 = _prefill_snapshots(model, users, False, 6)
    for reuse in (True, False):
        got, st = _prefill_snapshots(model, users, reuse, 6, prefill_pack=True)
        assert st["prefill_pack"] and (st["reuse_rows"] >= 3 if reuse else st["reused_tokens"] == 0)
        assert got.keys() == want.keys() and len(got) == 10
        for k in got:
            assert got[k][0] == want[k][0]
            torch.testing.assert_close(got[k][1], want[k][1], rtol=1e-5, atol=1e-5)


def test_packed_prefill_writes_only_its_rows_and_column_l_minus_1(tiny):
    """A packed prefill of 3 rows into slots 1, 4 and 6 of 8 (two at offsets), every slot's cache set to a sentinel
    first: the other slots are untouched except column L - 1 of slot 0 (the padding's), the prefilled slots keep
    their cached prefix and get new K/V over their fed tokens only."""
    model, _ = tiny
    lens, offs, slots = [9, 25, 30], [0, 12, 20], [1, 4, 6]
    eng, before, reqs = _sentinel_engine(model, lens, prefill_pack=True)
    with torch.inference_mode():
        eng._prefill(reqs, slots, max(n - o for n, o in zip(lens, offs)), offs)
    # fed 9 + 13 + 10 = 32 -> a 32-token stream (no padding); prefix 12 + 20 = 32 entries -> 32
    assert (
        eng.stats["prefill_buckets"] == {"q32+p32": 1} and eng.stats["prefill_padded_tokens"] == 32
    )
    cols = eng.cache.k[0].shape[2]
    for t0, t1 in zip(before, eng.cache.k + eng.cache.v):
        for s in (0, 2, 3, 5, 7):
            assert torch.equal(t1[s], t0[s]), s  # no padding in this stream: slot 0 untouched too
        for s, n, o in zip(slots, lens, offs):
            assert torch.equal(t1[s, :, :o], t0[s, :, :o]) and torch.equal(
                t1[s, :, n:], t0[s, :, n:]
            )
            assert not torch.isclose(t1[s, :, o:n], t0[s, :, o:n]).any(), s
    with (
        torch.inference_mode()
    ):  # 9 fed tokens -> 16: 7 padding tokens write column L - 1 of slot 0, nothing else
        eng._prefill(reqs[:1], [2], 9, [0])
    for t0, t1 in zip(before, eng.cache.k + eng.cache.v):
        assert torch.equal(t1[0, :, : cols - 1], t0[0, :, : cols - 1]) and not torch.equal(
            t1[0, :, cols - 1], t0[0, :, cols - 1]
        )
        for s in (3, 5, 7):
            assert torch.equal(t1[s], t0[s])
    assert (
        eng.key[1] == 0
        and eng.key[4] == 1
        and eng.key[6] == 2
        and eng.lengths[[1, 4, 6]].tolist() == lens
    )
    eng.close()


def test_packed_prefill_failure_falls_back_to_padded(tiny, caplog):
    """A packed forward that fails where the engine may fall back (CUDA; forced here) logs one warning, leaves the
    packed path and prefills padded, with HF greedy's answers; on the CPU the same failure raises."""
    model, _ = tiny
    max_new = 8
    prompts, stops, want = _greedy_case(model, 9, max_new, seed=4)

    def broken(*a, **k):
        raise RuntimeError("no kernel for this shape")

    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        flex_block=16,
        prefill_pack=True,
    )
    eng._packed_flex, eng._pack_fallback = broken, True
    with caplog.at_level("WARNING"):
        got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    warns = [r for r in caplog.records if "packed prefill failed" in r.getMessage()]
    assert (
        len(warns) == 1
        and eng.stats["prefill_pack"] is False
        and eng.stats["prefill_buckets"] == {}
    )
    # CUDA's order: the auto-dynamic compile first; when it fails, the static one (here: eager) takes over, still packed
    caplog.clear()
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        check_every=2,
        cuda_graphs=False,
        flex_block=16,
        prefill_pack=True,
    )
    eng._packed_flex, eng._packed_flexes, eng._pack_fallback = broken, [packed_flex], True
    with caplog.at_level("WARNING"):
        got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert [r.getMessage()[:60] for r in caplog.records] == [
        "packed prefill attention failed at stream shape (64, 0) (Run"
    ]  # the first forward: 4 prompts, 33-64 tokens
    assert "retrying with static-shape compiles" in caplog.records[0].getMessage()
    assert eng.stats["prefill_pack"] is True and eng.stats["prefill_calls"] == sum(
        eng.stats["prefill_buckets"].values()
    )
    eng = SlotEngine(
        model,
        4,
        max_len=64,
        max_new_tokens=max_new,
        stop_ids=stops,
        cuda_graphs=False,
        flex_block=16,
        prefill_pack=True,
    )
    eng._packed_flex = broken
    try:
        with pytest.raises(RuntimeError, match="no kernel"):
            _run(eng, prompts)
    finally:
        eng.close()  # the model's attention back to its own


def test_packed_prefill_settings_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="exclusive"):
        SlotEngine(
            model,
            4,
            max_len=64,
            max_new_tokens=4,
            stop_ids={0},
            prefill_graphs=True,
            prefill_pack=True,
        )
    with pytest.raises(ValueError, match="power of two"):
        SlotEngine(
            model, 4, max_len=64, max_new_tokens=4, stop_ids={0}, flex_block=24, prefill_pack=True
        )


def test_compiled_packed_flex_equals_eager():
    """The compiled packed attention (the CUDA path's function, compiled here by Inductor for the CPU; it visits only
    the listed kv blocks, where eager FlexAttention evaluates the mask everywhere) equals the eager one (fp32) at two
    stream shapes (one static compile each)."""
    from eagle3.regen.packed_prefill import compiled_packed_flex

    g = torch.Generator().manual_seed(3)
    h, hkv, d, cols, s, block = 6, 2, 16, 64, 5, 16
    for fed, off, slots in (
        ([7, 3, 12], [0, 9, 4], [3, 0, 2]),
        ([20, 5, 9, 30], [0, 0, 33, 0], [1, 4, 0, 2]),
    ):
        kc, vc = (
            torch.randn(s, hkv, cols, d, generator=g),
            torch.randn(s, hkv, cols, d, generator=g),
        )
        lay = packed_layout([[1] * n for n in fed], off, slots, s, cols, block)
        tq = lay.q.shape[1]
        q = torch.randn(1, h, tq, d, generator=g)
        k, v = torch.randn(1, hkv, tq, d, generator=g), torch.randn(1, hkv, tq, d, generator=g)
        outs = []
        for fn in (packed_flex, compiled_packed_flex(False)):
            r = PackedRouting(
                lay.q, lay.kv, lay.prefix, lay.kv_num_blocks, lay.kv_indices, fn, block
            )
            outs.append(packed_prefill_attention(q, k, v, kc.clone(), vc.clone(), r, None))
        n = sum(fed)
        assert (
            int(lay.kv_num_blocks.sum()) < lay.kv_indices.shape[2] * lay.kv_indices.shape[3]
        )  # blocks skipped
        torch.testing.assert_close(outs[1][:, :, :n], outs[0][:, :, :n], rtol=1e-5, atol=1e-5)


def test_packed_streams_are_capped_off_cuda(tiny, monkeypatch):
    """Off CUDA (eager FlexAttention: dense scores) a packed forward feeds at most PACK_EAGER_TOKENS tokens whatever
    prefill_tokens allows (a lone longer prompt excepted); answers stay HF greedy."""
    import eagle3.regen.slots as cont

    model, _ = tiny
    monkeypatch.setattr(cont, "PACK_EAGER_TOKENS", 40)
    prompts, stops, want = _greedy_case(model, 12, 6, seed=9)
    fed = []
    real = SlotEngine._prefill_host

    def spy(self, reqs, slots, offsets):
        fed.append([len(w.ids) - o for w, o in zip(reqs, offsets)])
        return real(self, reqs, slots, offsets)

    monkeypatch.setattr(SlotEngine, "_prefill_host", spy)
    eng = SlotEngine(
        model,
        12,
        max_len=64,
        max_new_tokens=6,
        stop_ids=stops,
        cuda_graphs=False,
        flex_block=16,
        prefill_tokens=65536,
        prefill_pack=True,
    )
    got = _run(eng, prompts)
    assert [got[i] for i in range(len(prompts))] == want
    assert len(fed) >= 3 and all(sum(f) <= 40 or len(f) == 1 for f in fed), fed
    assert sum(map(sum, fed)) == sum(map(len, prompts))


def test_eager_packed_flex_is_quiet_and_equal(monkeypatch):
    """The CPU's packed attention (eager_packed_flex, the engine's choice off CUDA) gives packed_flex's result without
    PyTorch's 15-line "flex_attention called without torch.compile()" UserWarning (trial 2: printed by every CPU run
    with prompts.regen_prefill_pack); packed_flex itself still warns (the check is not vacuous)."""
    import warnings

    import torch.nn.attention.flex_attention as fa

    from eagle3.regen.packed_prefill import eager_packed_flex

    g = torch.Generator().manual_seed(3)
    h, hkv, d, cols, s = 6, 2, 16, 64, 5
    lay = packed_layout([[1] * n for n in (7, 3)], [0, 9], [3, 0], s, cols, 8)
    tq = lay.q.shape[1]
    q, k, v = (torch.randn(1, n, tq, d, generator=g) for n in (h, hkv, hkv))
    outs, texts = [], []
    for fn in (eager_packed_flex, packed_flex):
        monkeypatch.setattr(
            fa, "_WARNINGS_SHOWN", set()
        )  # torch warns once a process: as in a fresh run
        r = PackedRouting(lay.q, lay.kv, lay.prefix, lay.kv_num_blocks, lay.kv_indices, fn, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs.append(
                packed_prefill_attention(
                    q, k, v, torch.zeros(s, hkv, cols, d), torch.zeros(s, hkv, cols, d), r, None
                )
            )
        texts.append([str(w.message) for w in caught if "without torch.compile" in str(w.message)])
    assert texts[0] == [] and len(texts[1]) == 1
    assert torch.equal(outs[0], outs[1])
