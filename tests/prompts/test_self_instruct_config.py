"""``prompts.self_instruct``: one 01 run makes the self-instruct file (the code of ``01 --self-instruct``) and adds its
prompts to the sampled sources. Validation, equality with the two-step manual flow, up-to-date / remake, refusal
without regeneration, and 2 gloo ranks (tiny random Llama, fp32, CPU; the sampler faked as in test_self_instruct)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import child_env
from test_self_instruct import _cli

from eagle3.config import load_config
from eagle3.data.readers import sample
from eagle3.errors import UserError
from eagle3.regen import self_instruct as si

ROOT = Path(__file__).resolve().parents[2]

# what the fake sampler "samples": batch b (prompts.seed 0: seed b) of n queries is POOL[3b : 3b + n]; item 1 repeats a
# source prompt that sample_size keeps, item 4 one it leaves out, item 2 is under min_chars
POOL = [
    "Write a story about a dragon.",
    "Source question 2: what is 2 plus 2?",
    "Too short",
    "Plan a trip to Rome for me.",
    "Source question 3: what is 3 plus 3?",
    "Explain how rainbows form, simply.",
]


def pool_sampler(calls: list):
    """A stand-in for :func:`si.sample_queries` reading :data:`POOL` by batch (``seed`` = batch index); ``calls``
    gets ``(n, seed)`` per call."""

    def fake(model, tok, prefix_ids, n, stop_ids, temperature, top_p, max_tokens, seed):
        calls.append((n, seed))
        texts = POOL[3 * seed : 3 * seed + n]
        return texts, [True] * n, 5 * n

    return fake


def _source(tmp_path: Path) -> Path:
    """10 answered one-turn conversations ``s0..s9`` (messages JSONL)."""
    src = tmp_path / "src.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"s{i}",
                    "messages": [
                        {"role": "user", "content": f"Source question {i}: what is {i} plus {i}?"},
                        {"role": "assistant", "content": "old"},
                    ],
                }
            )
            + "\n"
            for i in range(10)
        )
    )
    return src


def _config(
    tmp_path: Path, tiny_llama_dir: Path, name: str, source, prompts_extra: str = ""
) -> Path:
    cfg = tmp_path / f"{name}.yaml"
    # the fake sampler's batches of 3 (prompts.self_instruct.batch_size; gen_batch_size 3 is the regeneration's own)
    prompts_extra = prompts_extra.replace(
        "self_instruct: {num:", "self_instruct: {batch_size: 3, num:"
    )
    cfg.write_text(f"""run_name: {name}
output_root: {tmp_path / name}
verifier: {{path: {tiny_llama_dir}, dtype: float32, device: cpu}}
prompts: {{source: {json.dumps(source)}, format: messages, regenerate: true, max_new_tokens: 6, gen_batch_size: 3,
          regen_check_every: 2{prompts_extra}}}
extract: {{max_length: 256}}
""")
    return cfg


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "value,msg",
    [
        (
            "{num: 0}",
            "field 'prompts.self_instruct.num': Input should be greater than or equal to 1",
        ),
        (
            "{num: 5, top_p: 1.5}",
            "field 'prompts.self_instruct.top_p': Input should be less than or equal to 1",
        ),
        (
            "{num: 5, temperature: 0}",
            "field 'prompts.self_instruct.temperature': Input should be greater than 0",
        ),
        ("{num: 5, max_query_tokens: 0}", "field 'prompts.self_instruct.max_query_tokens'"),
        ("{num: 5, min_chars: -1}", "field 'prompts.self_instruct.min_chars'"),
        ("{num: 5, exclude: ['']}", "field 'prompts.self_instruct.exclude[0]': an empty entry"),
        ("{num: 5, max_tokens: 64}", "unknown config key 'prompts.self_instruct.max_tokens'"),
        ("{exclude: [a.jsonl]}", "missing required config key 'prompts.self_instruct.num'"),
        ("8000", "field 'prompts.self_instruct': expected a mapping such as {num: 8000"),
        ("true", "field 'prompts.self_instruct': expected a mapping such as {num: 8000"),
    ],
)
def test_config_refuses_a_bad_value_in_one_line(tmp_path, value, msg):
    f = tmp_path / "c.yaml"
    f.write_text(
        f"run_name: x\nverifier: {{path: v}}\nprompts:\n  source: humaneval\n  regenerate: true\n"
        f"  self_instruct: {value}\n"
    )
    with pytest.raises(UserError) as e:
        load_config(f)
    assert msg in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(f"{f}:6: ")
    f.write_text(
        "run_name: x\nverifier: {path: v}\nprompts: {source: humaneval, regenerate: true, self_instruct: null}\n"
    )
    assert load_config(f).prompts.self_instruct is None  # null: off (the default)


def test_one_run_equals_the_two_step_flow_and_reruns_are_up_to_date(
    tmp_path, tiny_llama_dir, monkeypatch, capsys
):
    """One 01 run with prompts.self_instruct {num: 5} over a 10-conversation source (sample_size 4): prompts.jsonl
    holds the 4 sampled conversations, then the self-instruct prompts (ids self_instruct/<k>; the one repeating a
    sampled source prompt dropped; the one repeating an unsampled one kept), every answer regenerated; equal to the
    manual flow (01 --self-instruct 5 --out F; the sampled source; 01 over [it, F] without sample_size). The same
    run again is up to date (nothing sampled); num 6 samples and regenerates again."""
    calls: list = []
    monkeypatch.setattr(si, "sample_queries", pool_sampler(calls))
    src = _source(tmp_path)
    one = _config(
        tmp_path, tiny_llama_dir, "one", str(src), ", sample_size: 4, self_instruct: {num: 5}"
    )
    main = _cli()
    assert main(["--config", str(one)]) == 0
    assert calls == [(3, 0), (2, 1)]
    got = _rows(tmp_path / "one" / "prompts.jsonl")
    sampled = [f"s{i}" for i in sample(list(range(10)), 4, 0)]
    assert "s2" in sampled and "s3" not in sampled  # what POOL's repeats are about
    assert [c["id"] for c in got] == sampled + [
        "self_instruct/0",
        "self_instruct/2",
        "self_instruct/3",
    ]
    assert [c["messages"][0]["content"] for c in got[4:]] == [POOL[0], POOL[3], POOL[4]]
    assert all(
        len(c["messages"]) == 2
        and c["messages"][1]["role"] == "assistant"
        and c["messages"][1]["content"] != "old"
        for c in got
    )  # every answer the verifier's own
    rep = json.loads((tmp_path / "one" / "prompts_report.json").read_text())
    assert rep["counts"]["sampled_out"] == 6 and rep["counts"]["self_instruct"] == 3
    assert (
        rep["counts"]["self_instruct_deduped"] == 1
        and rep["counts"]["kept"] == rep["counts"]["regenerated"] == 7
    )
    assert (
        rep["settings"]["self_instruct"]["num"] == 5
        and "sha256" in rep["settings"]["self_instruct"]["file"]
    )
    assert (
        json.loads((tmp_path / "one" / "self_instruct_report.json").read_text())["counts"]["kept"]
        == 4
    )

    # the manual flow: the CLI mode, the sampled source on its own, 01 over both files
    (tmp_path / "m").mkdir()
    assert (
        main(
            [
                "--config",
                str(one),
                "--self-instruct",
                "5",
                "--self-instruct-batch-size",
                "3",
                "--out",
                str(tmp_path / "m" / "si.jsonl"),
            ]
        )
        == 0
    )
    assert (tmp_path / "m" / "si.jsonl").read_bytes() == (
        tmp_path / "one" / "self_instruct.jsonl"
    ).read_bytes()
    seed = _config(tmp_path, tiny_llama_dir, "seed", str(src), ", sample_size: 4")
    assert main(["--config", str(seed), "--no-regenerate"]) == 0
    two = _config(
        tmp_path,
        tiny_llama_dir,
        "two",
        [str(tmp_path / "seed" / "prompts.jsonl"), str(tmp_path / "m" / "si.jsonl")],
    )
    assert main(["--config", str(two)]) == 0
    assert _rows(tmp_path / "two" / "prompts.jsonl") == got
    n_calls = len(calls)
    capsys.readouterr()

    assert main(["--config", str(one)]) == 0  # the same run: up to date, nothing sampled
    out = capsys.readouterr().out
    assert (
        "self_instruct.jsonl: up to date" in out
        and "prompts up to date" in out
        and len(calls) == n_calls
    )
    from eagle3.stages.prompts_manifest import require_current

    require_current(load_config(one))  # 02 sees the prompts as made with its config

    six = one.read_text().replace("num: 5}", "num: 6}")
    one.write_text(six)
    # 02 names the changed key (trial si-2: both whole mappings, with the file's sha256, ~700 characters)
    with pytest.raises(
        UserError, match=r": prompts\.self_instruct\.num 5 -> 6; re-run 01_prepare_prompts"
    ):
        require_current(load_config(one))
    assert main(["--config", str(one)]) == 0
    out = capsys.readouterr().out
    assert (
        len(calls) == n_calls + 2
        and "remaking" in out
        and "prompts.self_instruct.num 5 -> 6" in out
    )
    got6 = _rows(tmp_path / "one" / "prompts.jsonl")
    assert [c["messages"][0]["content"] for c in got6[4:]] == [POOL[0], POOL[3], POOL[4], POOL[5]]
    assert got6[:7] == got


def test_limit_applies_after_the_self_instruct_prompts(tmp_path, tiny_llama_dir, monkeypatch):
    """--limit keeps the first N of the sampled sources followed by the self-instruct prompts (a quick run stays
    quick); the report counts what it cut."""
    monkeypatch.setattr(si, "sample_queries", pool_sampler([]))
    cfg = _config(
        tmp_path,
        tiny_llama_dir,
        "lim",
        str(_source(tmp_path)),
        ", sample_size: 2, self_instruct: {num: 5}",
    )
    assert _cli()(["--config", str(cfg), "--limit", "3"]) == 0
    got = _rows(tmp_path / "lim" / "prompts.jsonl")
    assert len(got) == 3 and got[2]["id"] == "self_instruct/0"
    c = json.loads((tmp_path / "lim" / "prompts_report.json").read_text())["counts"]
    assert (c["self_instruct"], c["limited_out"], c["kept"]) == (4, 3, 3)


@pytest.mark.parametrize("how", ["config", "flag"])
def test_without_regeneration_it_is_refused_in_one_line(tmp_path, tiny_llama_dir, monkeypatch, how):
    """A self-instruct prompt has no answer: prompts.regenerate: false (or --no-regenerate) with prompts.self_instruct
    is one line naming the field, before anything is sampled or written."""
    monkeypatch.setattr(
        si, "sample_queries", lambda *a, **k: pytest.fail("sampled before refusing")
    )
    cfg = _config(
        tmp_path, tiny_llama_dir, "noregen", str(_source(tmp_path)), ", self_instruct: {num: 5}"
    )
    args = ["--config", str(cfg)]
    if how == "config":
        args += ["--set", "prompts.regenerate=false"]
    else:
        args += ["--no-regenerate"]
    with pytest.raises(UserError) as e:
        _cli()(args)
    msg = str(e.value)
    assert (
        "prompts.self_instruct" in msg and "prompts.regenerate is false" in msg and "\n" not in msg
    )
    assert not (tmp_path / "noregen").exists()


def test_no_query_kept_names_the_config_keys(tmp_path, tiny_llama_dir, monkeypatch):
    """The self-instruct run's error names prompts.self_instruct's keys (not the CLI flags); nothing is written."""
    monkeypatch.setattr(
        si,
        "sample_queries",
        lambda model, tok, p, n, *a: (["An unfinished query"] * n, [False] * n, 1),
    )
    cfg = _config(
        tmp_path, tiny_llama_dir, "none", str(_source(tmp_path)), ", self_instruct: {num: 2}"
    )
    with pytest.raises(UserError) as e:
        _cli()(["--config", str(cfg)])
    assert str(e.value).startswith("prompts.self_instruct.num 2: no query kept (2 unfinished")
    assert "raise prompts.self_instruct.max_query_tokens (now 128)" in str(e.value)
    assert not (tmp_path / "none").exists()  # the folder 01 made for the file is removed again


_WORKER = """import runpy, sys
sys.path.insert(0, {tests!r}); sys.path.insert(0, {root!r})
from eagle3.regen import self_instruct as si
from test_self_instruct_config import pool_sampler

calls = []
fake = pool_sampler(calls)

def sampler(*a, **k):
    import os
    open({marks!r} + "/rank" + os.environ.get("RANK", "0"), "a").write("x")
    return fake(*a, **k)

si.sample_queries = sampler
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_two_gloo_ranks_write_the_one_process_file(tmp_path, tiny_llama_dir):
    """torchrun, 2 ranks: rank 0 alone samples the self-instruct file, the other waits; prompts.jsonl equals the
    one-process run's."""
    marks = tmp_path / "marks"
    marks.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(
        _WORKER.format(
            tests=str(ROOT / "tests" / "prompts"),
            root=str(ROOT),
            marks=str(marks),
            script=str(ROOT / "01_prepare_prompts.py"),
        )
    )
    src = _source(tmp_path)
    env = child_env(ROOT, ROOT / "tests")
    for name, launch in (
        ("one", [sys.executable]),
        (
            "two",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
            ],
        ),
    ):
        cfg = _config(
            tmp_path, tiny_llama_dir, name, str(src), ", sample_size: 4, self_instruct: {num: 5}"
        )
        p = subprocess.run(
            [*launch, str(worker), "--config", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(x.name for x in marks.iterdir()) == [
        "rank0"
    ]  # one process, then rank 0 of two; never rank 1
    assert (tmp_path / "two" / "prompts.jsonl").read_text() == (
        tmp_path / "one" / "prompts.jsonl"
    ).read_text()
    rep = json.loads((tmp_path / "two" / "prompts_report.json").read_text())
    assert rep["regeneration"]["replicas"] == 2 and rep["counts"]["self_instruct"] == 3


def test_a_rank_past_0_stops_with_rank_0s_error_in_one_line(tmp_path, tiny_llama_dir, monkeypatch):
    """Rank 1's line when rank 0 could not make the file (its error gathered), and none when rank 0 made it."""
    from eagle3.process_group import Dist
    from eagle3.stages.prepare_prompts import make_self_instruct

    cfg = load_config(
        _config(tmp_path, tiny_llama_dir, "r1", "x.jsonl", ", self_instruct: {num: 5}")
    )
    d = Dist(rank=1, world=2)
    monkeypatch.setattr(d, "all_gather", lambda mine: ["--exclude: gone", mine])
    with pytest.raises(UserError) as e:
        make_self_instruct(cfg, False, d)
    assert str(e.value) == (
        f"rank 1: stopped, rank 0 could not make {cfg.self_instruct_path}: --exclude: gone"
    )
    monkeypatch.setattr(d, "all_gather", lambda mine: [None, mine])
    assert make_self_instruct(cfg, False, d) == cfg.self_instruct_path


def test_two_gloo_ranks_stop_in_one_line_when_rank_0_cannot_make_the_file(tmp_path, tiny_llama_dir):
    """torchrun, 2 ranks, a missing exclude file: rank 0 stops on it; rank 1, waiting for the file, died in a gloo
    'Connection closed by peer' traceback (trial si-2); it now stops with rank 0's error, and the job prints it once."""
    cfg = _config(
        tmp_path,
        tiny_llama_dir,
        "two",
        str(_source(tmp_path)),
        f", self_instruct: {{num: 5, exclude: [{tmp_path / 'no_such_eval.jsonl'}]}}",
    )
    env = child_env(ROOT, ROOT / "tests")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "01_prepare_prompts.py"),
            "--config",
            str(cfg),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode != 0
    assert "[rank1]: Traceback" not in p.stderr and "Connection closed" not in p.stderr, p.stderr[
        -3000:
    ]
    # one error line for the job (each rank printed its own: rank 0's, then rank 1's repeating it), from the first
    # rank to stop: rank 0's error, or rank 1's line that quotes it
    errors = [x for x in p.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "no_such_eval.jsonl" in errors[0], p.stderr[-3000:]
    if errors[0].startswith("error: rank 1: stopped"):
        assert f"rank 0 could not make {tmp_path / 'two' / 'self_instruct.jsonl'}: " in errors[0]
    assert not (tmp_path / "two" / "prompts.jsonl").exists()


@pytest.mark.parametrize("how", ["config", "cli"])
@pytest.mark.parametrize(
    "make_file,reader_msg",
    [
        (None, "prompts file not found"),
        (
            lambda p: p.with_suffix(".txt").write_text("hello\n") and p.with_suffix(".txt"),
            "unsupported prompts file type",
        ),
        (
            lambda p: (p.write_text(json.dumps({"answer_id": 1, "choices": []}) + "\n"), p)[1],
            "unrecognised record",
        ),
    ],
)
def test_an_unusable_exclude_file_is_named_as_the_exclude_setting(
    tmp_path, tiny_llama_dir, monkeypatch, how, make_file, reader_msg
):
    """An exclude file that is missing, of another type or of no known format said only `<file>: prompts file not
    found` (read as if about prompts.source, trial si-2); the error now starts with the setting or flag. Nothing is
    sampled or written."""
    monkeypatch.setattr(
        si, "sample_queries", lambda *a, **k: pytest.fail("sampled before refusing")
    )
    ex = tmp_path / "eval.jsonl"
    ex = make_file(ex) if make_file else ex
    src = str(_source(tmp_path))
    if how == "config":
        cfg, args, name = (
            _config(
                tmp_path, tiny_llama_dir, "r", src, f", self_instruct: {{num: 3, exclude: [{ex}]}}"
            ),
            [],
            "prompts.self_instruct.exclude: ",
        )
    else:
        (tmp_path / "r").mkdir()
        cfg, args, name = (
            _config(tmp_path, tiny_llama_dir, "r", src),
            [
                "--self-instruct",
                "3",
                "--out",
                str(tmp_path / "r" / "si.jsonl"),
                "--exclude",
                str(ex),
            ],
            "--exclude: ",
        )
    with pytest.raises(UserError) as e:
        _cli()(["--config", str(cfg), *args])
    assert str(e.value).startswith(f"{name}{ex}") and reader_msg in str(e.value), str(e.value)
    assert not any((tmp_path / "r").glob("*.jsonl"))


def test_sigterm_while_sampling_says_the_sampling_kept_nothing(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """SIGTERM during prompts.self_instruct's sampling said `no regenerated answer was kept yet; re-run the same
    command (without --force) to start again` (trial si-2): about the regeneration, which had not started. The hint now
    names the sampling and its file; nothing is written."""
    import signal

    from eagle3.cli import Terminated

    def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not interrupt")

    monkeypatch.setattr(si, "sample_queries", killed)
    cfg = _config(
        tmp_path, tiny_llama_dir, "t", str(_source(tmp_path)), ", self_instruct: {num: 3}"
    )
    with pytest.raises(Terminated) as e:
        _cli()(["--config", str(cfg)])
    assert e.value.hint.startswith(
        f"self-instruct sampling stopped, nothing of it kept "
        f"({tmp_path / 't' / 'self_instruct.jsonl'} is written once"
    ), e.value.hint
    assert "regenerated" not in e.value.hint
    assert not any((tmp_path / "t").glob("*.jsonl"))


def test_up_to_date_is_printed_by_rank_0_only(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    """Under torchrun every rank printed `prompts up to date: ...` (twice with 2 ranks, trial si-2); rank 0 prints it,
    as it prints `remaking`. (RANK=1 without WORLD_SIZE: this process plays rank 1 of an up-to-date run.)"""
    cfg = _config(tmp_path, tiny_llama_dir, "u", str(_source(tmp_path)), ", sample_size: 2")
    assert _cli()(["--config", str(cfg)]) == 0
    capsys.readouterr()
    monkeypatch.setenv("RANK", "1")
    assert _cli()(["--config", str(cfg)]) == 0
    assert "up to date" not in capsys.readouterr().out
    monkeypatch.setenv("RANK", "0")
    assert _cli()(["--config", str(cfg)]) == 0
    assert "prompts up to date: " in capsys.readouterr().out


def test_a_forced_run_stopped_while_sampling_is_redone_without_force(
    tmp_path, tiny_llama_dir, monkeypatch, capsys
):
    """01 --force with prompts.self_instruct, stopped while it sampled the self-instruct prompts, left the old
    self_instruct.jsonl, prompts.jsonl and their reports, which the same command without --force found up to date.
    Now the rerun samples again and remakes prompts.jsonl (the forced run marked both as not current first)."""
    calls: list = []
    monkeypatch.setattr(si, "sample_queries", pool_sampler(calls))
    cfg = _config(
        tmp_path,
        tiny_llama_dir,
        "f",
        str(_source(tmp_path)),
        ", sample_size: 2, self_instruct: {num: 3}",
    )
    assert _cli()(["--config", str(cfg)]) == 0 and len(calls) == 1

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(si, "sample_queries", killed)
    with pytest.raises(KeyboardInterrupt):
        _cli()(["--config", str(cfg), "--force"])
    assert (tmp_path / "f" / "prompts.forced-run.json").is_file()
    capsys.readouterr()
    monkeypatch.setattr(si, "sample_queries", pool_sampler(calls))
    assert _cli()(["--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 2 and "up to date" not in out
    assert "(a --force run did not finish (prompts.forced-run.json): redoing it)" in out
    assert not (tmp_path / "f" / "prompts.forced-run.json").exists()


def test_limit_that_drops_self_instruct_prompts_warns_and_the_summary_counts_them(
    tmp_path, tiny_llama_dir, monkeypatch, capsys, caplog
):
    """--limit applies after the self-instruct prompts (they come after the sampled sources), so a small one left
    every one of them out without a word, and 01's closing `prompts: ...` line never mentioned them. Now one warning
    line says how many --limit leaves out (01, and 02's --limit over that prompts.jsonl), the report counts them
    (`self_instruct_limited_out`), and the closing line gives `self-instruct <num> sampled / <in prompts.jsonl> kept`."""
    import logging

    monkeypatch.setattr(si, "sample_queries", pool_sampler([]))
    cfg = _config(
        tmp_path,
        tiny_llama_dir,
        "lim",
        str(_source(tmp_path)),
        ", sample_size: 2, self_instruct: {num: 5}",
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.regen.selection"):
        assert _cli()(["--config", str(cfg), "--limit", "2"]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "eagle3.regen.selection"] == [
        "--limit 2: leaves out 4 of the 4 prompts.self_instruct prompts (they come after the 2 sampled source "
        "conversations); --limit 6 keeps them all"
    ]
    ids = [c["id"] for c in _rows(tmp_path / "lim" / "prompts.jsonl")]
    assert len(ids) == 2 and not any(i.startswith("self_instruct/") for i in ids)
    c = json.loads((tmp_path / "lim" / "prompts_report.json").read_text())["counts"]
    assert (c["self_instruct"], c["limited_out"], c["self_instruct_limited_out"], c["kept"]) == (
        4,
        4,
        4,
        2,
    )
    assert "self-instruct 5 sampled / 0 kept)" in capsys.readouterr().out
    assert (
        "| self_instruct_limited_out | 4 |" in (tmp_path / "lim" / "prompts_report.md").read_text()
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.regen.selection"):
        assert _cli()(["--config", str(cfg), "--limit", "5"]) == 0  # one of them cut: still said
    assert [r.getMessage() for r in caplog.records if r.name == "eagle3.regen.selection"] == [
        "--limit 5: leaves out 1 of the 4 prompts.self_instruct prompts (they come after the 2 sampled source "
        "conversations); --limit 6 keeps them all"
    ]
    assert "self-instruct 5 sampled / 3 kept)" in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.regen.selection"):
        assert _cli()(["--config", str(cfg)]) == 0  # no limit: nothing said, all kept
    assert not [r for r in caplog.records if r.name == "eagle3.regen.selection"]
    assert "self-instruct 5 sampled / 4 kept)" in capsys.readouterr().out
    # 02's --limit over this prompts.jsonl (2 sources, then 4 self-instruct prompts)
    from eagle3.stages.extract import warn_limit_drops_self_instruct

    loaded = load_config(cfg)
    assert warn_limit_drops_self_instruct(loaded, 3) == (
        "--limit 3: leaves out 3 of the 4 prompts.self_instruct prompts (they come after the 2 sampled source "
        "conversations); --limit 6 keeps them all"
    )
    assert (
        warn_limit_drops_self_instruct(loaded, 6) is None
        and warn_limit_drops_self_instruct(loaded, 2) is not None
    )


def test_the_regeneration_batch_size_leaves_the_self_instruct_file_and_prompts_up_to_date(
    tmp_path, tiny_llama_dir, monkeypatch, capsys
):
    """The self-instruct sampling is seeded per batch, so its batch size makes the file; it is its own setting
    (prompts.self_instruct.batch_size, --self-instruct-batch-size), not prompts.gen_batch_size: tuning the
    regeneration's decode rows for another GPU leaves self_instruct.jsonl and prompts.jsonl up to date (before: the
    file was sampled again in batches of the new gen_batch_size, other queries, and every answer regenerated)."""
    calls: list = []
    monkeypatch.setattr(si, "sample_queries", pool_sampler(calls))
    one = _config(
        tmp_path,
        tiny_llama_dir,
        "one",
        str(_source(tmp_path)),
        ", sample_size: 4, self_instruct: {num: 5}",
    )
    main = _cli()
    assert main(["--config", str(one)]) == 0 and calls == [(3, 0), (2, 1)]
    before = (tmp_path / "one" / "prompts.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["--config", str(one), "--set", "prompts.gen_batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert (
        len(calls) == 2 and "self_instruct.jsonl: up to date" in out and "prompts up to date" in out
    )
    assert (tmp_path / "one" / "prompts.jsonl").read_bytes() == before
    assert (
        json.loads((tmp_path / "one" / "self_instruct_report.json").read_text())["settings"][
            "batch_size"
        ]
        == 3
    )
    # its own batch size samples another file (batches of 2: seeds 0, 1, 2)
    assert main(["--config", str(one), "--set", "prompts.self_instruct.batch_size=2"]) == 0
    assert calls[2:] == [(2, 0), (2, 1), (1, 2)]


def test_torchrun_ranks_through_endpoints_make_no_process_group(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """``prompts.self_instruct`` with endpoint regeneration under torchrun (the env of rank 0 / rank 1 of 2, no
    rendezvous address): only the in-process regeneration shares work over ranks, so rank 1 returns at once and rank 0
    samples the file and regenerates alone, with no process group. Before, both ranks made a gloo group for the
    self-instruct file (here: no MASTER_ADDR, an error), and rank 1, its part done, waited at the group's teardown
    barrier for the whole endpoint regeneration (a 3-hour timeout)."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tests" / "prompts"))
    from standin_server import FakeBackend, StandInServer
    from transformers import AutoTokenizer

    calls: list = []
    monkeypatch.setattr(si, "sample_queries", pool_sampler(calls))
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = _config(
        tmp_path,
        tiny_llama_dir,
        "srv",
        str(_source(tmp_path)),
        ", sample_size: 2, self_instruct: {num: 5}",
    )
    main = _cli()
    with StandInServer(FakeBackend(tok.eos_token_id), tok) as srv:
        sets = [
            "--set",
            "prompts.regenerate_via=openai",
            "--set",
            f"prompts.server.urls=[{srv.url}]",
        ]
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        assert main(["--config", str(cfg), *sets]) == 0
        assert calls == [] and srv.requests == [] and not (tmp_path / "srv").exists()
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert main(["--config", str(cfg), *sets]) == 0
        assert not dist.is_initialized()
    rows = _rows(tmp_path / "srv" / "prompts.jsonl")
    assert (
        len(rows) == 2 + 4 and calls == [(3, 0), (2, 1)] and len(srv.requests) == 6
    )  # one turn each
