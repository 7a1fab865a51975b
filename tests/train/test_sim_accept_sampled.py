"""Simulated acceptance at temperature > 0 (``train.select_temperature``): the per-position acceptance probability
``sum_x min(p_T, q_T)`` against hand-computed values and a float64 reference over a real tiny drafter, the formula
against 05's rejection sampler by Monte-Carlo, the tracker scoring with it, and a tiny training run that selects by it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from _ddp_worker import make_tiny_run, single_thread  # noqa: F401  (autouse fixture)

from eagle3.config import load_config
from eagle3.decoding.metrics import acceptance_probs, expected_tau
from eagle3.decoding.sampling import Sampler
from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.stages.train import run
from eagle3.train.sampled_accept import SampledAcceptance, sampled_acceptance_sums
from eagle3.train.sim_accept import CURVE_FILE, BestTracker, markdown_lines, simulated_tau


class _Identity(torch.nn.Module):
    """A "drafter" whose logits are its hidden state (so ``q = softmax(h / T)``), draft id d -> verifier id d + d2t."""

    def __init__(self, d2t):
        super().__init__()
        self.register_buffer("d2t", torch.tensor(d2t))

    def compute_logits(self, h):
        return h


def _hand_case():
    """Verifier vocab 3, draft vocab {0, 2} (d2t [0, 1]); one sample of 4 tokens, loss positions 2 and 3.

    Verifier rows 1 and 2 (predicting positions 2, 3): p = [0.5, 0.3, 0.2]. Step 0 hidden rows 0, 1: q = [0.1, 0.9]
    and [0.5, 0.5]; step 1 hidden row 0: q = [0.2, 0.8] (draft ids 0, 1 = verifier ids 0, 2).
    """
    last = torch.zeros(1, 4, 3)
    last[0, 1] = last[0, 2] = torch.tensor([0.5, 0.3, 0.2]).log()
    h0, h1 = torch.zeros(1, 4, 2), torch.zeros(1, 4, 2)
    h0[0, 0], h0[0, 1] = torch.tensor([0.1, 0.9]).log(), torch.tensor([0.5, 0.5]).log()
    h1[0, 0] = torch.tensor([0.2, 0.8]).log()
    loss_pos = torch.tensor([2, 3])
    return _Identity([0, 1]), [h0, h1], last, loss_pos, torch.eye(3)


def test_acceptance_sums_hand_values():
    drafter, hs, last, pos, W = _hand_case()
    a, c = sampled_acceptance_sums(drafter, hs, last, pos, W, temperature=1.0, chunk=1)
    # step 0: min(.5,.1)+min(.2,.9) = 0.3 at position 2, min(.5,.5)+min(.2,.5) = 0.7 at 3; step 1 (position 3 only):
    # min(.5,.2)+min(.2,.8) = 0.4; verifier id 1 (0.3) is outside the draft vocab and never accepted
    assert torch.allclose(a, torch.tensor([1.0, 0.4], dtype=torch.float64), atol=1e-6)
    assert c.tolist() == [2, 1]
    # T = 2: p ~ sqrt([.5,.3,.2]) = [.415447, .321803, .262751], q ~ sqrt([.1,.9]) = [.25, .75] at position 2
    a2, _ = sampled_acceptance_sums(drafter, [hs[0][:, :1].expand(1, 4, 2)], last, pos[:1], W, 2.0)
    assert float(a2[0]) == pytest.approx(0.25 + 0.262751, abs=1e-5)
    # top-p 0.7: p -> [.625, .375, 0]; q [.1, .9] -> [0, 1] (acceptance 0), q [.5, .5] stays (min(.625,.5) = .5)
    a3, _ = sampled_acceptance_sums(drafter, hs[:1], last, pos, W, 1.0, top_p=0.7)
    assert float(a3[0]) == pytest.approx(0.0 + 0.5, abs=1e-6)
    # the meter's keys and tau_sim(2) from them: alpha = [0.5, 0.4] -> 1 + 0.5 + 0.2
    m = SampledAcceptance(2, 1.0)
    m.sums = {"alpha_sum": a, "alpha_count": c.double()}
    m.n = 1
    val = SampledAcceptance.summarize(m.totals())
    assert val == pytest.approx({"sampled_acc_0": 0.5, "sampled_acc_1": 0.4})
    assert simulated_tau([val["sampled_acc_0"], val["sampled_acc_1"]], 2) == pytest.approx(1.7)
    assert SampledAcceptance.summarize(SampledAcceptance(2, 1.0).totals()) == {}
    with pytest.raises(ValueError):
        SampledAcceptance(2, 0.0)


def test_acceptance_probs_and_expected_tau_hand_values():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.3, 0.5], [0.0, 0.5, 0.5]])
    assert torch.allclose(acceptance_probs(p, q), torch.tensor([0.7, 0.6]))
    assert expected_tau(p, q) == pytest.approx(1 + 0.7 + 0.7 * 0.6)


TV, DV, HT = 40, 16, 24


def _tiny_drafter(seed=0):
    torch.manual_seed(seed)
    args = dict(hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    d = Eagle3Drafter(
        DrafterArgs(
            **args, intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=256, draft_vocab_size=DV, target_vocab_size=TV, target_hidden_size=HT,
        )
    )  # fmt: skip
    ids = torch.randperm(TV)[:DV].sort().values  # [DV] verifier ids of the draft vocab
    t2d = torch.zeros(TV, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DV), t2d)
    return d.eval(), ids


@pytest.mark.parametrize("pre_norm", [False, True])
def test_meter_matches_a_float64_reference_over_a_tiny_drafter(pre_norm):
    d, ids = _tiny_drafter()
    B, L, K, T = 2, 9, 3, 0.7
    batch = {
        "input_ids": torch.randint(0, TV, (B, L)),
        "aux": torch.randn(B, L, 3 * HT),
        "last": torch.randn(B, L, HT) * 2,
        "loss_mask": (torch.rand(B, L) > 0.3).long(),
    }
    W, nw = torch.randn(TV, HT), (torch.rand(HT) + 0.5 if pre_norm else None)
    m = SampledAcceptance(K, T)
    m.add(d, batch, W, nw, 1e-5)
    m.add(d, batch, W, nw, 1e-5)  # two batches: sums add
    got = SampledAcceptance.summarize(m.totals())
    # reference from the definition (DESIGN.md "TTT indexing"): step i at position t predicts t+2+i from the verifier
    # row t+1+i; every loss position counts
    with torch.no_grad():
        hs = d.ttt_forward(batch["input_ids"], batch["aux"], K)
        h = batch["last"].double()
        if pre_norm:
            h = h / torch.sqrt((h**2).mean(-1, keepdim=True) + 1e-5) * nw.double()
        p = torch.softmax((h @ W.double().t()) / T, -1)  # [B, L, TV]
        for i in range(K):
            q = torch.softmax(d.compute_logits(hs[i]).double() / T, -1)  # [B, L, DV]
            total, n = 0.0, 0
            for b in range(B):
                for t in range(L - 2 - i):
                    if batch["loss_mask"][b, t + 2 + i]:
                        total += sum(
                            min(float(p[b, t + 1 + i, ids[x]]), float(q[b, t, x]))
                            for x in range(DV)
                        )
                        n += 1
            assert n > 0 and got[f"sampled_acc_{i}"] == pytest.approx(total / n, abs=1e-5)


def test_expected_tau_matches_rejection_sampling_by_monte_carlo():
    """05's rejection sampler (:meth:`Sampler.verify`) on fixed per-position distributions: the mean accepted
    drafts per verify step equals ``expected_tau - 1`` within 4 standard errors."""
    g = torch.Generator().manual_seed(3)
    V, dV, k, n = 6, 4, 3, 40_000
    targets = torch.tensor([0, 2, 3, 5])  # draft id -> verifier id
    vlog = torch.randn(k + 1, V, generator=g) * 1.5  # [k+1, V] verifier logits per position
    dlog = torch.randn(k, dV, generator=g) * 1.5  # [k, dV] drafter logits per position
    s = Sampler(temperature=0.8, top_p=1.0, seed=1)
    q = s.probs(dlog)  # [k, dV]
    drafts_d = torch.stack([s.draw(q[j].expand(n, dV)) for j in range(k)], 1)  # [n, k] draft ids
    accepted, _ = s.verify(targets[drafts_d], q.expand(n, k, dV), targets, vlog.expand(n, k + 1, V))
    p_full = s.probs(vlog[:k])  # [k, V]
    q_full = torch.zeros(k, V)
    q_full[:, targets] = q
    want = expected_tau(p_full, q_full) - 1  # sum_m prod_{j<=m} alpha_j
    mean, sd = accepted.double().mean().item(), accepted.double().std().item()
    assert 0.2 < want < 2.8  # a case where acceptance is neither sure nor impossible
    assert abs(mean - want) < 4 * sd / math.sqrt(n)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def test_tracker_scores_the_sampled_acceptance_and_refuses_another_temperature(tmp_path):
    m = _Tiny()
    tr = BestTracker(tmp_path, chain=2, enabled=True, keep_best=True, temperature=1.0, top_p=0.9)
    assert tr.meter(3).temperature == 1.0 and BestTracker(tmp_path / "g", 2, False).meter(3) is None
    val = {"loss": 1.0, "acc_0": 0.9, "acc_1": 0.9, "sampled_acc_0": 0.5, "sampled_acc_1": 0.4}
    assert tr.update(1, 0, val, m)
    row = tr.best
    assert row["alpha"] == [0.5, 0.4] and row["alpha_top1"] == [0.9, 0.9]
    assert row["tau_sim"] == pytest.approx(1.7)  # 1 + 0.5 + 0.5 * 0.4, not the top-1 2.71
    # greedy selection (temperature 0) scores the top-1 alphas of the same row, as before
    g = BestTracker(tmp_path / "g", chain=2, enabled=True)
    g.update(1, 0, val, m)
    assert g.best["tau_sim"] == pytest.approx(1 + 0.9 + 0.81) and "alpha_top1" not in g.best
    assert "temperature" not in g.summary()
    saved = json.loads((tmp_path / CURVE_FILE).read_text())
    assert saved["temperature"] == 1.0 and saved["top_p"] == 0.9
    text = "\n".join(markdown_lines({**saved, "select_best": "sim_accept", "exported_step": 1}))
    assert (
        "at temperature 1, top-p 0.9" in text and "| 1 (best) | 1.7000 | 0.5000 | 0.4000 |" in text
    )
    # a resume at the same settings keeps the curve; at another temperature it is refused in one line
    assert BestTracker(
        tmp_path, 2, True, start_step=1, keep_best=True, temperature=1.0, top_p=0.9
    ).best
    with pytest.raises(
        UserError, match=r"curve measured at train.select_temperature 1, select_top_p 0.9, now 0, 1"
    ):
        BestTracker(tmp_path, 2, True, start_step=1, keep_best=True)


def test_training_selects_by_the_sampled_acceptance(tmp_path):
    path = make_tiny_run(
        tmp_path,
        n_train=8,
        n_val=4,
        train={
            "epochs": 2,
            "eval_every": 1,
            "select_best": "sim_accept",
            "select_temperature": 1.0,
        },
    )
    cfg = load_config(path)
    run(cfg, device="cpu")
    sa = json.loads((cfg.train_dir / CURVE_FILE).read_text())
    assert sa["temperature"] == 1.0 and sa["rows"]
    val = {
        v["step"]: v
        for v in map(json.loads, (cfg.train_dir / "metrics.jsonl").read_text().splitlines())
        if v["kind"] == "val"
    }
    for row in sa["rows"]:
        v = val[row["step"]]
        k = len(row["alpha"])
        assert row["alpha"] == pytest.approx([v[f"sampled_acc_{j}"] for j in range(k)], abs=1e-6)
        assert row["alpha_top1"] == pytest.approx([v[f"acc_{j}"] for j in range(k)], abs=1e-6)
        assert all(
            0 < a < 1 for a in row["alpha"]
        )  # a random drafter: acceptance neither sure nor impossible
        assert row["tau_sim"] == pytest.approx(simulated_tau(row["alpha"], sa["chain"]))
    assert sa["best"]["step"] == max(sa["rows"], key=lambda r: r["tau_sim"])["step"]
