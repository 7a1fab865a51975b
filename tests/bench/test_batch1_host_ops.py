"""bench/batch1_host_ops.py on CPU with --tiny: the per-token / per-round op accounting adds up."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import batch1_host_ops as b1  # noqa: E402


def test_batch1_host_ops_tiny_adds_up(tmp_path):
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    assert b1.main(["--tiny", "--max-new-tokens", "10", "--json", str(out), "--md", str(md)]) == 0
    r = json.loads(out.read_text())
    g, s = r["greedy"], r["eagle3"]
    assert g["forwards"] == 10  # no stop ids: one prefill + 9 decode forwards for 10 tokens
    assert 1 <= s["rounds"] <= 10
    per = s["per_round"]
    assert set(per) == set(b1.PHASES) and all(v > 0 for v in per.values())
    assert s["ops_per_round"] == pytest.approx(sum(per.values()))
    # every top-level op of the EAGLE-3 call is in a phase or in the prefill and loop
    assert s["ops"] == pytest.approx(sum(per.values()) * s["rounds"] + s["prefill_and_loop_ops"])
    assert r["ratio_round_to_token"] == pytest.approx(s["ops_per_round"] / g["ops_per_token"])
    # the verify forward takes k+1 = 4 tokens through a mask with holes: never fewer ops than a greedy forward
    assert per["verify forward"] >= g["ops_per_token"] - per["verify bookkeeping"]
    assert "| **round / greedy token** |" in md.read_text()


def test_top_level_ops_by_hand():
    from types import SimpleNamespace as E

    ph = E(name="PH_draft", cpu_parent=None)
    lin = E(name="aten::linear", cpu_parent=ph)
    mm = E(name="aten::mm", cpu_parent=lin)  # dispatched by linear: not top-level
    loose = E(name="aten::cat", cpu_parent=None)
    assert b1.top_level_ops([ph, lin, mm, loose]) == [
        ("aten::linear", ["PH_draft"]),
        ("aten::cat", []),
    ]


def test_random_drafter_is_the_configs_drafter():
    """The speed benches' untrained drafter takes the run config's drafter section (variant, depth, width): the
    ops and time of a draft depend on them (a second layer: 360 -> 530 ops per chain-3 draft on SmolLM2). It was
    always the verifier's one-layer eagle3 shape, whatever the config said."""
    from offline_bench_speed import _random_drafter
    from regen_step import tiny_model

    from eagle3.config.drafter import DrafterConfig

    model = tiny_model()
    plain = _random_drafter(model, "cpu", None)
    assert (plain.args.num_layers, plain.args.variant) == (1, "eagle3")
    assert plain.args.intermediate_size == model.config.intermediate_size
    d = _random_drafter(
        model, "cpu", None, DrafterConfig(num_layers=2, variant="eagle3.1", intermediate_size=40)
    )
    assert (d.args.num_layers, d.args.variant, d.args.intermediate_size) == (2, "eagle3.1", 40)
    assert (
        d.args.hidden_size == model.config.hidden_size
    )  # null fields still come from the verifier
    assert any(k.startswith("layers.1.") for k in d.state_dict())
