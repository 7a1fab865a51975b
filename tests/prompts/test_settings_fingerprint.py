"""01's settings fingerprint holds what changes its output, and only that: the verifier's weights (not only its
name) when it regenerates in-process, in prompts.jsonl's report, prompts.reuse_answers' check and the self-instruct
file's report; a setting that changes nothing (prompts.seed without sampling, hf_split without an hf: source, top_p
when greedy, the local dtype of a server regeneration) does not count, and reports written before stay up to date."""

from __future__ import annotations

import json

import pytest
from test_prompts import A, U, _jsonl

from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.stages.prepare_prompts import run
from eagle3.stages.prompts_manifest import report_path, settings


def _regen_config(tmp_path, verifier_dir, src, out="out", extra=""):
    """01 regenerating ``src`` with the verifier at ``verifier_dir`` named ``tiny`` (fp32 on the CPU, 4 new tokens)."""
    f = tmp_path / f"{out}.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / out}\n"
        f"verifier: {{name: tiny, path: {verifier_dir}, dtype: float32, device: cpu}}\n"
        f"prompts: {{source: {src}, format: messages, regenerate: true, max_new_tokens: 4, gen_batch_size: 2, "
        f"regen_cuda_graphs: false{extra}}}\nextract: {{max_length: 256}}\n"
    )
    return load_config(f)


def test_other_weights_under_the_same_name_remake_the_answers(
    tmp_path, tiny_llama_dir, other_weights_dir, capsys
):
    """verifier.path pointed at other weights under the same verifier.name: 01 names the change and regenerates (the
    old answers were another model's); the report records the fingerprint 02 records (data_config.json)."""
    from eagle3.verifier.load import weights_fingerprint

    src = _jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [U("Hi there"), A("x")]}, {"messages": [U("Count to three")]}],
    )
    first = _regen_config(tmp_path, tiny_llama_dir, src)
    assert run(first) == 0
    before = first.prompts_path.read_bytes()
    rep = json.loads(report_path(first).read_text())
    assert rep["settings"]["verifier_weights"] == weights_fingerprint(first.verifier) is not None
    capsys.readouterr()
    moved = _regen_config(tmp_path, other_weights_dir, src)
    assert run(moved) == 0
    out = capsys.readouterr().out
    assert "prompts up to date" not in out
    assert (
        f"remaking {moved.prompts_path} (settings changed: the weights at verifier.path "
        f"'{weights_fingerprint(first.verifier)}' -> '{weights_fingerprint(moved.verifier)}')"
    ) in out
    assert moved.prompts_path.read_bytes() != before  # the other model's answers
    assert json.loads(report_path(moved).read_text())["settings"][
        "verifier_weights"
    ] == weights_fingerprint(moved.verifier)
    capsys.readouterr()
    assert run(moved) == 0 and "prompts up to date" in capsys.readouterr().out


def test_reuse_answers_refuses_answers_of_other_weights(
    tmp_path, tiny_llama_dir, other_weights_dir
):
    """prompts.reuse_answers takes answers made 'under the same settings': answers of other weights under the same
    verifier.name are refused in one line naming verifier_weights and verifier.path; nothing written."""
    src = _jsonl(tmp_path / "c.jsonl", [{"id": "a", "messages": [U("Hi there")]}])
    first = _regen_config(tmp_path, tiny_llama_dir, src, out="first")
    assert run(first) == 0
    grown = _regen_config(
        tmp_path,
        other_weights_dir,
        src,
        out="grown",
        extra=f", reuse_answers: {first.prompts_path}",
    )
    with pytest.raises(UserError) as e:
        run(grown)
    assert str(e.value).startswith(
        f"{report_path(first)}: prompts.reuse_answers: its answers were made by other "
        f"weights than this run's verifier.path holds (settings key verifier_weights: "
    )
    assert "\n" not in str(e.value) and not grown.prompts_path.exists()
    same = _regen_config(
        tmp_path, tiny_llama_dir, src, out="same", extra=f", reuse_answers: {first.prompts_path}"
    )
    assert run(same) == 0 and same.prompts_path.read_bytes() == first.prompts_path.read_bytes()


def test_resume_log_of_other_weights_is_refused(tmp_path, tiny_llama_dir, other_weights_dir):
    """A regeneration stopped half-way, resumed with verifier.path on other weights (same name): its log holds the
    first model's answers, so it is refused (before, the settings header matched and they were kept)."""
    from eagle3.regen.resume_log import ResumeLog
    from eagle3.stages.prepare_prompts import partial_path

    src = _jsonl(
        tmp_path / "c.jsonl",
        [{"id": "a", "messages": [U("Hi there")]}, {"id": "b", "messages": [U("Q")]}],
    )
    first = _regen_config(tmp_path, tiny_llama_dir, src)
    partial_path(first).parent.mkdir(parents=True)
    log = ResumeLog(partial_path(first), settings(first, None))
    log.open()
    log.append(0, {"id": "a", "messages": [U("Hi there"), A("from the first model")]})
    log.close()
    with pytest.raises(
        UserError,
        match=r"a regeneration was started here with other settings \(verifier_weights "
        r"differ\)",
    ):
        run(_regen_config(tmp_path, other_weights_dir, src))


@pytest.mark.parametrize(
    "change",
    [
        "prompts.seed=7",  # nothing is sampled: the seed picks nothing
        "prompts.hf_split=test",  # a file source: no split is read
        "verifier.dtype=float32",  # endpoints answer: the local dtype is not used
        "prompts.top_p=0.5",  # temperature 0: greedy whatever top_p is
    ],
)
def test_settings_that_change_nothing_are_not_in_the_fingerprint(tmp_path, change):
    """Each of these left prompts.jsonl out of date though it could not change it (every answer regenerated)."""
    f = tmp_path / "c.yaml"
    f.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: a.jsonl, regenerate: true, "
        "regenerate_via: sglang}\n"
    )
    assert settings(load_config(f, [change]), None) == settings(load_config(f), None)


@pytest.mark.parametrize(
    "base,change,key",
    [
        ("prompts.sample_size=2", "prompts.seed=7", "seed"),
        ("prompts.source=hf:some/set", "prompts.hf_split=test", "hf_split"),
        ("prompts.temperature=0.7", "prompts.top_p=0.5", "top_p"),
        ("prompts.regenerate_via=local", "verifier.dtype=float32", "verifier_dtype"),
    ],
)
def test_the_same_settings_count_where_they_change_the_output(tmp_path, base, change, key):
    """The counterpart: with sampling, an hf: source, a sampling temperature, the in-process regeneration, the
    setting is in the fingerprint."""
    f = tmp_path / "c.yaml"
    f.write_text(
        "run_name: t\nverifier: {path: x}\nprompts: {source: a.jsonl, regenerate: true, "
        "regenerate_via: sglang}\n"
    )
    a, b = settings(load_config(f, [base]), None), settings(load_config(f, [base, change]), None)
    assert key in a and a[key] != b[key]


def test_seed_counts_with_self_instruct_without_sample_size(tmp_path):
    """prompts.seed also seeds prompts.self_instruct's sampling: with self_instruct and no sample_size it was left out
    of the fingerprint, so 02's prompts check let a prompts.jsonl made under another seed pass ("up to date") where it
    refused it before, though 01 would sample other self-instruct prompts."""
    from eagle3.stages.prompts_manifest import require_current

    f = tmp_path / "c.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: x}}\n"
        "prompts: {source: a.jsonl, regenerate: true, regenerate_via: sglang, self_instruct: {num: 4}}\n"
    )
    made = settings(load_config(f), None)
    assert made["seed"] == 0
    cfg = load_config(f)
    cfg.prompts_path.parent.mkdir(parents=True)
    cfg.prompts_path.write_text("{}\n")
    report_path(cfg).write_text(json.dumps({"settings": made}))
    with pytest.raises(UserError) as e:
        require_current(load_config(f, ["prompts.seed=7"]))
    assert str(e.value) == (
        f"{report_path(cfg)}: prompts.seed 0 -> 7; re-run 01_prepare_prompts.py with this config first"
    )
    require_current(cfg)


def test_seed_without_sampling_leaves_prompts_up_to_date(tmp_path, capsys):
    """prompts.seed changed without prompts.sample_size: nothing to do (it remade prompts.jsonl); a report written
    before the seed was conditional (``seed: 0`` recorded without sampling, ``hf_split`` for a file) stays up to date;
    with sampling, changing the seed remakes the file and names sample_size's seed."""
    src = _jsonl(tmp_path / "q.jsonl", [{"messages": [U(f"u{i}"), A(f"a{i}")]} for i in range(5)])
    f = tmp_path / "c.yaml"
    f.write_text(
        f"run_name: t\noutput_root: {tmp_path / 'out'}\nverifier: {{path: {tmp_path}}}\n"
        f"prompts: {{source: {src}}}\n"
    )
    cfg = load_config(f)
    assert run(cfg) == 0
    capsys.readouterr()
    assert run(load_config(f, ["prompts.seed=7"])) == 0
    assert "prompts up to date" in capsys.readouterr().out
    rep = json.loads(report_path(cfg).read_text())
    assert "seed" not in rep["settings"] and "hf_split" not in rep["settings"]
    rep["settings"].update(seed=0, hf_split="train")  # as 01 wrote it before
    report_path(cfg).write_text(json.dumps(rep))
    assert run(cfg) == 0 and "prompts up to date" in capsys.readouterr().out
    assert run(load_config(f, ["prompts.sample_size=3"])) == 0
    assert "(settings changed: prompts.sample_size None -> 3)" in capsys.readouterr().out
    assert run(load_config(f, ["prompts.sample_size=3", "prompts.seed=7"])) == 0
    assert "(settings changed: prompts.seed 0 -> 7)" in capsys.readouterr().out


def test_a_report_without_the_weights_fingerprint_stays_up_to_date(
    tmp_path, tiny_llama_dir, capsys
):
    """A prompts.jsonl regenerated before 01 recorded verifier_weights (its report has none) is not remade for it:
    nothing to compare, as 03/04 do with a data_config.json of before it (a remake would regenerate every answer)."""
    src = _jsonl(tmp_path / "c.jsonl", [{"messages": [U("Hi there")]}])
    cfg = _regen_config(tmp_path, tiny_llama_dir, src)
    assert run(cfg) == 0
    rep = json.loads(report_path(cfg).read_text())
    del rep["settings"]["verifier_weights"]
    report_path(cfg).write_text(json.dumps(rep))
    capsys.readouterr()
    assert run(cfg) == 0 and "prompts up to date" in capsys.readouterr().out


def _fake_sampler(si, monkeypatch) -> list:
    """Replace self-instruct's sampling with a fake that logs each call's query count (the returned list)."""
    calls = []

    def fake(model, tok, prefix_ids, n, stop_ids, temperature, top_p, max_tokens, seed):
        calls.append(n)
        return [f"Tell me about topic number {len(calls)}, please."] * n, [True] * n, 5 * n

    monkeypatch.setattr(si, "sample_queries", fake)
    return calls


def test_self_instruct_file_of_other_weights_is_sampled_again(
    tmp_path, tiny_llama_dir, other_weights_dir, monkeypatch, capsys
):
    """01 --self-instruct's file (and prompts.self_instruct's) is sampled from the verifier: with verifier.path on
    other weights under the same verifier.name it was 'up to date', the first model's prompts kept. Its report now
    records the weights; the same weights stay up to date, and a report without them (made before) too."""
    from eagle3.regen import self_instruct as si
    from eagle3.stages import self_instruct as stage_si
    from eagle3.verifier.load import weights_fingerprint

    calls = _fake_sampler(si, monkeypatch)
    out = tmp_path / "si.jsonl"
    cfg = _regen_config(tmp_path, tiny_llama_dir, "unused.jsonl")
    assert stage_si.make(cfg, out, 2) is True
    rep = json.loads((tmp_path / "si_report.json").read_text())
    assert rep["settings"]["verifier_weights"] == weights_fingerprint(cfg.verifier) is not None
    assert stage_si.make(cfg, out, 2) is False and len(calls) == 1  # up to date
    moved = _regen_config(tmp_path, other_weights_dir, "unused.jsonl")
    assert stage_si.make(moved, out, 2) is True and len(calls) == 2  # other weights: sampled again
    assert json.loads((tmp_path / "si_report.json").read_text())["settings"][
        "verifier_weights"
    ] == weights_fingerprint(moved.verifier)
    rep = json.loads((tmp_path / "si_report.json").read_text())
    del rep["settings"]["verifier_weights"]
    (tmp_path / "si_report.json").write_text(json.dumps(rep))
    assert (
        stage_si.make(moved, out, 2) is False and len(calls) == 2
    )  # a report of before: not compared on the weights


def test_self_instruct_report_without_weight_files_is_not_compared_on_them(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """A self-instruct report recorded ``verifier_weights: null`` when the verifier's folder held no weight file (a hub
    id, loaded from the cache); the same model given as a folder then sampled every query again (null != the folder's
    fingerprint), though 01's settings, 02 and 03/04 compare the weights only when both sides record them."""
    from eagle3.regen import self_instruct as si
    from eagle3.stages import self_instruct as stage_si

    calls = _fake_sampler(si, monkeypatch)
    out = tmp_path / "si.jsonl"
    cfg = _regen_config(tmp_path, tiny_llama_dir, "unused.jsonl")
    assert stage_si.make(cfg, out, 2) is True and len(calls) == 1
    rep = json.loads((tmp_path / "si_report.json").read_text())
    rep["settings"]["verifier_weights"] = None  # sampled where no weight file was found
    (tmp_path / "si_report.json").write_text(json.dumps(rep))
    assert (
        stage_si.make(cfg, out, 2) is False and len(calls) == 1
    )  # up to date: nothing sampled again
