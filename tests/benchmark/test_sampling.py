"""Decoding at temperature > 0: speculative rejection sampling emits the verifier's own distribution.

The statistical tests compare sampled tokens with the EXACT distribution of the tiny verifier (computed by
enumerating every continuation) by Pearson's chi-square, cells with an expected count below 5 merged into one.
The threshold is the chi-square quantile at significance 1e-4 (Wilson-Hilferty); the generators are seeded, so
each statistic is a fixed number. The negative controls replace the residual ``max(0, p - q)`` by ``p`` (a rule
that accepts with min(1, p/q) but resamples from the target on rejection): they must fail the same threshold.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_decode import AUX, make_drafter, make_verifier

from eagle3.decoding import report as report_mod
from eagle3.decoding import sampling
from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch
from eagle3.decoding.metrics import acceptance_probs, expected_tau
from eagle3.decoding.offline import bench_prompts
from eagle3.decoding.sampling import Sampler, processed_probs
from eagle3.errors import UserError

V = 32  # verifier vocab of the statistical tests (the (x2, x3) joint has V * V cells)
DRAFT_VOCAB = list(range(24))  # the drafter never proposes ids 24..31: q = 0 there
PROMPT = [5, 17, 9, 3]
N = 16000  # samples (rows of one batch) per statistical test
Z_1E4 = 3.719  # standard normal upper quantile at 1e-4


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts [C]`` against ``probs [C]`` and its degrees of freedom; cells expecting
    fewer than 5 merged into one; an observation in a cell of probability 0 gives inf."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return math.inf, 0
    exp = probs * counts.sum()
    small = exp < 5
    obs_c = torch.cat([counts[~small], counts[small].sum()[None]])
    exp_c = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    return float(((obs_c - exp_c) ** 2 / exp_c).sum()), int(keep.sum()) - 1


def critical(df: int, z: float = Z_1E4) -> float:
    """Upper chi-square quantile with ``df`` degrees of freedom at the normal quantile ``z`` (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def test_critical_value_matches_tables():
    assert critical(10, 2.326) == pytest.approx(23.21, abs=0.1)  # chi2.ppf(0.99, 10) = 23.209
    assert critical(100, 3.090) == pytest.approx(149.45, abs=0.3)  # chi2.ppf(0.999, 100) = 149.449


def tiny_models(scale: float = 6.0):
    """A 32-token verifier and a drafter over ids 0..23, both LM heads scaled so that ``p`` and ``q`` are uneven
    (top token ~0.15) and acceptance is partial (~0.2 per position)."""
    verifier = make_verifier(vocab=V)
    drafter = make_drafter(verifier, DRAFT_VOCAB)
    with torch.no_grad():
        verifier.lm_head.weight.mul_(scale)
        drafter.lm_head.weight.mul_(scale)
    return verifier, drafter


@torch.inference_mode()
def exact_joint(verifier, temperature: float, top_p: float) -> torch.Tensor:
    """``P(x2, x3) [V, V]`` of plain sampling after ``PROMPT``: ``sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2)``."""
    pr = lambda ids: processed_probs(verifier(ids).logits[:, -1].double(), temperature, top_p)  # noqa: E731
    x = torch.arange(V)
    p1 = pr(torch.tensor([PROMPT]))[0]  # [V]
    p2 = pr(torch.cat([torch.tensor(PROMPT).expand(V, -1), x[:, None]], 1))  # [V, V]
    pairs = torch.stack([x.repeat_interleave(V), x.repeat(V)], 1)  # [V*V, 2] (x1, x2)
    p3 = pr(torch.cat([torch.tensor(PROMPT).expand(V * V, -1), pairs], 1)).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [V, V]


def joint_counts(rows: list[list[int]]) -> torch.Tensor:
    """Counts ``[V, V]`` of (2nd, 3rd) generated tokens."""
    t = torch.tensor([r[:3] for r in rows])  # [N, 3]
    return torch.bincount(t[:, 1] * V + t[:, 2], minlength=V * V).view(V, V)


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def spec_rows(
    models, steps: int, temperature: float, top_p: float, seed: int = 0, method="standard"
):
    verifier, drafter = models
    sampler = Sampler(temperature, top_p, seed, method)
    res = speculative_generate_batch(
        verifier, drafter, [PROMPT] * N, AUX, steps, 3, sampler=sampler
    )
    assert all(len(r.tokens) == 3 for r in res.rows)
    return res


# ---------------------------------------------------------------------------------------------
# distributions and the rule, by hand
# ---------------------------------------------------------------------------------------------
def test_processed_probs_temperature_and_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(processed_probs(logits, 1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # top-p 0.7: token 1 stays (0.5 ranked before it < 0.7), token 2 goes (0.8 >= 0.7); renormalised
    assert torch.allclose(processed_probs(logits, 1.0, 0.7), torch.tensor([0.625, 0.375, 0, 0]))
    sq = torch.tensor([0.25, 0.09, 0.0225, 0.0025])  # temperature 0.5: p ** 2, renormalised
    assert torch.allclose(processed_probs(logits, 0.5), sq / sq.sum())
    assert processed_probs(logits, 1.0, 0.1).tolist() == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]  # the top-1 always stays


def test_sampler_settings_and_their_config_bounds():
    from pydantic import ValidationError

    from eagle3.settings.benchmark import BenchmarkConfig

    assert sampling.make_sampler(0.0) is None
    s = sampling.make_sampler(0.7, 0.9, seed=3)
    assert (s.temperature, s.top_p, s.seed) == (0.7, 0.9, 3)
    for bad in (
        {"temperature": -0.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"rejection_sample_method": "x"},
    ):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            BenchmarkConfig(**bad)


def test_expected_tau_hand_computed():
    # position 1: sum min = 0.5; position 2: sum min = 0.5 -> tau = 1 + 0.5 + 0.5 * 0.5
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])  # [k=2, V=2]
    q = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    assert acceptance_probs(p, q).tolist() == [0.5, 0.5]
    assert expected_tau(p, q) == pytest.approx(1.75)
    # two sequences of k=1: alpha 0.25 and 1 -> taus 1.25 and 2, mean 1.625
    p2 = torch.tensor([[[1.0, 0.0]], [[0.3, 0.7]]])  # [2, 1, 2]
    q2 = torch.tensor([[[0.25, 0.75]], [[0.3, 0.7]]])
    assert expected_tau(p2, q2) == pytest.approx(1.625)
    # one-hot p and q (temperature 0): greedy's chain, accepted while the argmaxes agree
    eye = torch.eye(3)
    assert expected_tau(eye[[0, 1, 2]], eye[[0, 1, 0]]) == pytest.approx(3.0)  # 1 + 1 + 1 + 0
    with pytest.raises(ValueError, match="shape"):
        expected_tau(p, q[:1])


def _synthetic(n: int, k: int = 2):
    """Fixed per-position ``p [k+1, 5]`` logits and ``q [k, 4]`` over draft ids 0..3 = verifier ids 1..4."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, 5, generator=g) * 1.5
    q = torch.softmax(torch.randn(k, 4, generator=g) * 1.5, -1)
    targets = torch.arange(4) + 1  # verifier id 0 is outside the draft vocab
    return logits.expand(n, -1, -1), q.expand(n, -1, -1), targets


def _verify_synthetic(n: int, seed: int = 0, method: str = "standard"):
    logits, q, targets = _synthetic(n)
    s = Sampler(1.0, seed=seed, method=method)
    drafts = targets[s.draw(q.reshape(-1, 4))].view(n, -1)  # [n, k] drafts sampled from q
    a, tokens = s.verify(drafts, q, targets, logits)
    return a, tokens, logits, q, targets


def test_rejection_rule_emits_p_and_its_acceptance_is_the_expected_one():
    a, tokens, logits, q, targets = _verify_synthetic(N)
    p = processed_probs(logits[0], 1.0)  # [k+1, 5]
    first = torch.bincount(
        tokens[:, 0], minlength=5
    )  # the first token: draft 1 accepted or the residual
    stat, df = chi_square(first, p[0])
    print(f"rule, first token: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat < critical(df), (stat, df)
    # tau = 1 + E[accepted] = 1 + a1 + a1 a2 with a_i = sum min(p_i, q_i) (q placed at the verifier ids)
    q_full = torch.zeros(2, 5).index_copy_(1, targets, q[0])
    want = expected_tau(p[:2], q_full)
    got = 1.0 + a.double().mean().item()
    print(f"rule: tau {got:.4f} sampled vs {want:.4f} expected_tau")
    assert got == pytest.approx(want, abs=4 * a.double().std().item() / math.sqrt(N))
    assert 1.2 < want < 2.8  # a chain where every outcome occurs
    assert set(a.tolist()) == {0, 1, 2}


def test_rejection_rule_negative_control_fails(monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)  # resample from p on rejection
    _, tokens, logits, _, _ = _verify_synthetic(N)
    stat, df = chi_square(
        torch.bincount(tokens[:, 0], minlength=5), processed_probs(logits[0, 0], 1.0)
    )
    print(f"rule negative control: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat > 10 * critical(df), (stat, df)


def test_block_rule_by_hand():
    """Two drafts over V = 2; ``w``, ``h`` and the residual worked out in the comments."""
    P = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]]])  # [1, k+1=3, 2]
    Q = torch.tensor([[[1.0, 0.0], [0.2, 0.8], [0.0, 0.0]]])
    d = torch.tensor(
        [[0, 1]]
    )  # x1 = 0: w1 = min(1, 0.5 / 1) = 0.5; x2 = 1: w2 = min(1, 0.5 * 0.1 / 0.8) = 0.0625
    p_x, q_x = P[:, :2].gather(2, d[..., None])[..., 0], Q[:, :2].gather(2, d[..., None])[..., 0]
    # r1 = max(0, 0.45 - 0.2) + max(0, 0.05 - 0.8) = 0.25 -> h1 = 0.25 / (0.25 + 1 - 0.5) = 1/3; h2 = w2
    for u, want_a, want_w in [
        (
            [0.30, 0.50],
            1,
            0.5,
        ),  # u1 <= 1/3, u2 > 0.0625: one draft kept, residual max(0, 0.5 p2 - q2)
        (
            [0.30, 0.05],
            2,
            0.0625,
        ),  # u2 <= w2: both kept (standard would stop at x1: 0.30 * 1 < 0.5 keeps x1,
        ([0.90, 0.50], 0, 1.0),  # x2: 0.05 * 0.8 < 0.1 keeps x2 too); neither passes: nothing kept
    ]:
        a, w = sampling.block_accept(p_x, q_x, P, Q, torch.tensor([u]))
        assert (a.item(), w.item()) == (want_a, pytest.approx(want_w)), u
    # a chain standard rejects at x1 (u1 = 0.6 >= p/q = 0.5) that block keeps whole: p2 = [0.2, 0.8], q2 = [0.5, 0.5],
    # x2 = 1: w2 = min(1, 0.5 * 1.6) = 0.8 >= u2 = 0.7 (r1 = 0: h1 = 0)
    P2 = torch.tensor([[[0.5, 0.5], [0.2, 0.8], [0.3, 0.7]]])
    Q2 = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]]])
    a, w = sampling.block_accept(torch.tensor([[0.5, 0.8]]), torch.tensor([[1.0, 0.5]]), P2, Q2,
                                 torch.tensor([[0.6, 0.7]]))  # fmt: skip
    assert (a.item(), w.item()) == (2, pytest.approx(0.8))
    assert not sampling.accept(torch.tensor(0.5), torch.tensor(1.0), torch.tensor(0.6))


def _block_expected_accepted(p: torch.Tensor, q_full: torch.Tensor) -> float:
    """E[accepted drafts] of block verification with position-independent ``p [3, V]`` and ``q_full [2, V]`` (k = 2),
    enumerating every draft pair: P(accepted = 2) = h2 = w2, P(accepted = 1) = h1 (1 - h2)."""
    total = 0.0
    V = p.shape[1]
    for x1 in range(V):
        for x2 in range(V):
            pq = float(q_full[0, x1] * q_full[1, x2])
            if pq == 0:
                continue
            w1 = min(1.0, float(p[0, x1] / q_full[0, x1]))
            w2 = min(1.0, w1 * float(p[1, x2] / q_full[1, x2]))
            r1 = float((w1 * p[1] - q_full[1]).clamp_min(0).sum())
            h1 = r1 / (r1 + 1 - w1) if r1 + 1 - w1 > 0 else 1.0
            total += pq * (2 * w2 + h1 * (1 - w2))
    return total


def test_block_rule_emits_p_and_keeps_more_drafts():
    a, tokens, logits, q, targets = _verify_synthetic(N, method="block")
    p = processed_probs(logits[0], 1.0).double()  # [k+1, 5]
    stat, df = chi_square(torch.bincount(tokens[:, 0], minlength=5), p[0])
    print(f"block rule, first token: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat < critical(df), (stat, df)
    q_full = torch.zeros(2, 5, dtype=torch.float64).index_copy_(1, targets, q[0].double())
    want = _block_expected_accepted(p, q_full)
    standard = expected_tau(p[:2], q_full) - 1.0
    got = a.double().mean().item()
    print(f"block rule: accepted {got:.4f} sampled vs {want:.4f} exact; standard {standard:.4f}")
    assert got == pytest.approx(want, abs=4 * a.double().std().item() / math.sqrt(N))
    assert want > standard + 0.02  # the chain judged whole keeps more drafts here
    assert set(a.tolist()) == {0, 1, 2}


def _stream_pairs(method: str, k: int) -> tuple[float, int]:
    """Chi-square of the first two emitted tokens against ``p x p`` when ``p [5]`` and ``q`` (draft ids 0..3 =
    verifier ids 1..4) are the same at every position: the emitted stream is then i.i.d. ``p``, across rounds
    (a row that emitted one token runs another round)."""
    g = torch.Generator().manual_seed(3)
    logits, q = (
        torch.randn(5, generator=g) * 1.5,
        torch.softmax(torch.randn(4, generator=g) * 1.5, -1),
    )
    targets, s = torch.arange(4) + 1, Sampler(1.0, method=method)
    out: list[list[int]] = [[] for _ in range(N)]
    while need := [i for i in range(N) if len(out[i]) < 2]:
        qd = q.expand(len(need), k, 4)
        drafts = targets[s.draw(qd.reshape(-1, 4))].view(len(need), k)
        a, tokens = s.verify(drafts, qd, targets, logits.expand(len(need), k + 1, 5))
        for j, i in enumerate(need):
            out[i].extend(tokens[j, : a[j] + 1].tolist())
    t = torch.tensor([o[:2] for o in out])
    p = processed_probs(logits, 1.0).double()
    return chi_square(torch.bincount(t[:, 0] * 5 + t[:, 1], minlength=25), torch.outer(p, p))


@pytest.mark.parametrize("method", ["standard", "block"])
def test_emitted_stream_is_iid_p(method):
    stat, df = _stream_pairs(method, 3)
    print(f"{method} stream pairs: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat < critical(df), (stat, df)


def test_block_rule_negative_control_fails(monkeypatch):
    """Block verification's residual needs the joint ratio ``w``: drawing it from ``max(0, p - q)`` (w = 1) is caught."""
    keep = sampling.block_accept
    monkeypatch.setattr(sampling, "block_accept", lambda *a: (keep(*a)[0], torch.ones(len(a[0]))))
    stat, df = _stream_pairs("block", 3)
    print(f"block negative control: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat > 2 * critical(df), (stat, df)


# ---------------------------------------------------------------------------------------------
# the decoders on a tiny verifier: the (2nd, 3rd) generated tokens against the exact joint
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "steps,temperature,top_p,method",
    [
        (1, 1.0, 1.0, "standard"),
        (2, 0.7, 0.9, "standard"),
        (2, 1.0, 1.0, "block"),
        (3, 0.7, 0.9, "block"),
    ],
)
def test_speculative_sampling_is_plain_sampling_in_distribution(
    models, steps, temperature, top_p, method
):
    """Token 1 comes from the prefill; tokens 2 and 3 from the first verify rounds: accepted drafts, residual
    tokens and (one step) the bonus token. Their joint over 1,024 cells equals the verifier's."""
    res = spec_rows(models, steps, temperature, top_p, method=method)
    stat, df = chi_square(
        joint_counts([r.tokens for r in res.rows]), exact_joint(models[0], temperature, top_p)
    )
    print(
        f"speculative {method} steps {steps} T {temperature} top-p {top_p}: chi2 {stat:.1f}, df {df}, "
        f"threshold {critical(df):.1f}, N {N}"
    )
    assert stat < critical(df), (stat, df)
    lens = [L for r in res.rows for L in r.accept_lengths]
    assert (
        0.05 < sum(L > 1 for L in lens) / len(lens) < 0.9
    )  # drafts are accepted and rejected alike


def test_plain_sampling_is_the_verifier_distribution(models):
    g = greedy_generate_batch(models[0], [PROMPT] * N, 3, sampler=Sampler(1.0))
    stat, df = chi_square(joint_counts(g.tokens), exact_joint(models[0], 1.0, 1.0))
    assert stat < critical(df), (stat, df)


def test_speculative_sampling_negative_control_fails(models, monkeypatch):
    """The same test catches a wrong rule: resampling from p instead of max(0, p - q) on rejection."""
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    res = spec_rows(models, 1, 1.0, 1.0)
    stat, df = chi_square(
        joint_counts([r.tokens for r in res.rows]), exact_joint(models[0], 1.0, 1.0)
    )
    print(f"negative control: chi2 {stat:.1f}, df {df}, threshold {critical(df):.1f}, N {N}")
    assert stat > 2 * critical(df), (stat, df)


def test_sampling_is_seeded(models):
    verifier, drafter = models
    run = lambda seed: speculative_generate_batch(  # noqa: E731
        verifier, drafter, [PROMPT] * 4, AUX, 2, 12, sampler=Sampler(1.0, seed=seed)
    )
    assert [r.tokens for r in run(5).rows] == [r.tokens for r in run(5).rows]
    assert [r.tokens for r in run(5).rows] != [r.tokens for r in run(6).rows]
    with pytest.raises(UserError, match="reference"):
        speculative_generate_batch(
            verifier, drafter, [PROMPT], AUX, 2, 4, reference=[[1]], sampler=Sampler(1.0)
        )


# ---------------------------------------------------------------------------------------------
# stage 05's rows and report at temperature > 0
# ---------------------------------------------------------------------------------------------
BENCH_IDS = [("a", PROMPT), ("b", [7, 7, 1]), ("c", [30])]


def sampled_row(models, **kw) -> dict:
    """:func:`bench_prompts` of :data:`BENCH_IDS` at temperature 1, top-p 0.95, 2 steps, 10 new tokens."""
    kw = {"batch_size": 2, "temperature": 1.0, "top_p": 0.95, "progress": False, **kw}
    return bench_prompts(*models, BENCH_IDS, AUX, 2, 10, (), "set", **kw)


def test_bench_prompts_at_temperature_one(models):
    row = sampled_row(models)
    assert (row["temperature"], row["top_p"], row["decoder"]) == (1.0, 0.95, "batched")
    assert row["mismatches"] == [] and row["failures"] == 0
    assert [p["lossless"] for p in row["per_prompt"]] == [None, None, None]
    assert [p["spec_tokens"] for p in row["per_prompt"]] == [10, 10, 10]
    assert 1.0 <= row["tau"] <= 3.0 and row["verify_steps"] > 0
    again = sampled_row(models)
    assert again["accepted_hist"] == row["accepted_hist"]  # each set starts from the seed
    with pytest.raises(UserError, match="'static' decodes at temperature 0 only"):
        sampled_row(models, decoder="static", batch_size=1)


def test_bench_prompts_block_verification(models):
    row = sampled_row(models, rejection_sample_method="block")
    assert row["rejection_sample_method"] == "block" and row["failures"] == 0
    assert [p["spec_tokens"] for p in row["per_prompt"]] == [10, 10, 10]
    assert "rejection_sample_method" not in sampled_row(models, temperature=0.0)  # greedy: no rule
    head = {"steps": 2, "temperature": 1.0, "top_p": 0.95, "rejection_sample_method": "block"}
    assert report_mod._sampling(head) == "temperature 1, top-p 0.95, block verification"


def test_bench_md_at_temperature_one(models):
    row = sampled_row(models)
    head = {"verifier": "tiny", "drafter": "d", "steps": 2, "max_new_tokens": 10, "device": "cpu"}
    report = {**head, "dtype": "float32", "aux_layers": AUX, "temperature": 1.0, "top_p": 0.95}
    md = report_mod.render_markdown({**report, "datasets": [row]})
    assert "temperature 1, top-p 0.95" in md and report_mod.SAMPLED_NOTE in md
    assert f"| {row['tau']:.2f} |" in md and "| n/a |" in md
    greedy = report_mod.render_markdown({**report, "temperature": 0.0, "datasets": []})
    assert "temperature 0," in greedy and report_mod.SAMPLED_NOTE not in greedy
