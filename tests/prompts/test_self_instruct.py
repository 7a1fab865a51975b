"""01's self-instruct mode (eagle3.regen.self_instruct): the pre-query prefix by hand, the filter by hand, seeded
sampling on a tiny random Llama, the CLI's files, up-to-date check, --exclude and one-line errors, and real SmolLM2
queries."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from eagle3.chat.template import ChatOptions
from eagle3.config import load_config
from eagle3.data.readers import read_conversations
from eagle3.errors import UserError
from eagle3.regen import self_instruct as si
from eagle3.stages import self_instruct as stage_si

ROOT = Path(__file__).resolve().parents[2]
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _cli():
    spec = importlib.util.spec_from_file_location("prepare01", ROOT / "01_prepare_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_pre_query_prefix_by_hand(smollm_tokenizer):
    """SmolLM2's ChatML: its default system turn, then the user header; a configured system prompt replaces it; a
    template that drops the user content is refused in one line."""
    tok = smollm_tokenizer
    assert si.pre_query_prefix(tok, ChatOptions()) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    )
    assert si.pre_query_prefix(tok, ChatOptions(), "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    )
    with pytest.raises(UserError, match="does not render a user message's content"):
        si.pre_query_prefix(
            tok, ChatOptions(chat_template="{% for m in messages %}[{{ m.role }}]{% endfor %}")
        )


def test_select_queries_by_hand():
    """Unfinished, short, repeated (01's dedupe key: case and whitespace) and already-seen queries are dropped, counted."""
    seen = {"known prompt here"}
    texts = [
        "  Write a poem about rain.  ",
        "Write a poem about rain",
        "write  a POEM about rain.",
        "Hi?",
        "An unfinished query that ran out of",
        "Known prompt HERE",
        "Explain photosynthesis simply.",
    ]
    ended = [True, True, True, True, False, True, True]
    kept, counts = si.select_queries(texts, ended, 16, seen)
    assert kept == [
        "Write a poem about rain.",
        "Write a poem about rain",
        "Explain photosynthesis simply.",
    ]
    assert counts == {"truncated": 1, "too_short": 1, "duplicate": 2, "kept": 3}
    assert "explain photosynthesis simply." in seen and len(seen) == 4


def test_sample_queries_seeded_on_a_tiny_llama(tiny_llama_dir):
    """Seeded sampling repeats itself and another seed differs; a query ends at its first stop token (which it does
    not include) exactly when one was sampled; the token count is the stop-inclusive length."""
    from eagle3.config import VerifierConfig
    from eagle3.verifier.load import load_verifier

    model, tok = load_verifier(
        VerifierConfig(path=str(tiny_llama_dir), dtype="float32"), device="cpu"
    )
    prefix = tok(si.pre_query_prefix(tok, ChatOptions()), add_special_tokens=False)["input_ids"]
    torch.manual_seed(1)
    free = model.generate(
        torch.tensor([prefix] * 4), do_sample=True, top_k=0, max_new_tokens=12, pad_token_id=0
    )[:, len(prefix) :]
    stops = {
        int(free[0, 2]),
        int(free[1, 5]),
    }  # ids that occur in sampled text, so some queries end early
    a = si.sample_queries(model, tok, prefix, 6, stops, 1.0, 1.0, 12, seed=7)
    b = si.sample_queries(model, tok, prefix, 6, stops, 1.0, 1.0, 12, seed=7)
    c = si.sample_queries(model, tok, prefix, 6, stops, 1.0, 1.0, 12, seed=8)
    assert a == b and a != c
    texts, ended, tokens = a
    assert len(texts) == len(ended) == 6 and 0 < tokens <= 6 * 12
    assert any(ended) or tokens == 72


def _fake_sampler(batches):
    """A stand-in for sample_queries returning the given batches in order (the CLI's orchestration under test)."""
    calls = []

    def fake(model, tok, prefix_ids, n, stop_ids, temperature, top_p, max_tokens, seed):
        texts, ended = batches[len(calls)]
        calls.append((n, seed, temperature, top_p, max_tokens))
        assert len(texts) == n
        return texts, ended, 5 * n

    return fake, calls


def test_cli_writes_the_prompts_and_report_and_is_resumable(
    tmp_path, tiny_llama_dir, monkeypatch, capsys
):
    """01 --self-instruct 5 --out F (batches of 3): F holds the kept queries as one-user-turn messages that 01's reader
    reads back; the report has the settings and counts (their sum: 5); the same command again is up to date; an
    --exclude file's prompt is left out (a changed setting: sampled again)."""
    cfg_path = ROOT / "configs" / "tiny-llama.yaml"
    sets = ["--set", f"verifier.path={tiny_llama_dir}", "--self-instruct-batch-size", "3"]
    batches = [
        (
            ["Write a story about a dragon.", "Too short", "What is the capital of France?"],
            [True, True, True],
        ),
        (["Plan a trip to Rome for me.", "An unfinished query"], [True, False]),
    ]
    fake, calls = _fake_sampler(batches * 3)
    monkeypatch.setattr(si, "sample_queries", fake)
    out = tmp_path / "si.jsonl"
    main = _cli()
    assert main(["--config", str(cfg_path), *sets, "--self-instruct", "5", "--out", str(out)]) == 0
    assert [(n, seed) for n, seed, *_ in calls] == [
        (3, 0),
        (2, 1),
    ]  # prompts.seed 0: batch b seeds 0 * 1_000_003 + b
    got = read_conversations(str(out), keep_prompt_only=True)
    assert [c["messages"] for c in got] == [
        [{"role": "user", "content": q}]
        for q in (
            "Write a story about a dragon.",
            "What is the capital of France?",
            "Plan a trip to Rome for me.",
        )
    ]
    assert [c["id"] for c in got] == ["self_instruct/0", "self_instruct/1", "self_instruct/2"]
    rep = json.loads((tmp_path / "si_report.json").read_text())
    assert rep["counts"] == {"truncated": 1, "too_short": 1, "duplicate": 0, "kept": 3}
    assert rep["settings"]["num"] == 5 and rep["settings"]["prefix"].endswith("<|im_start|>user\n")
    assert (
        rep["query_tokens"] == 25
        and "3 self-instruct prompts of 5 sampled" in capsys.readouterr().out
    )
    assert main(["--config", str(cfg_path), *sets, "--self-instruct", "5", "--out", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out and len(calls) == 2  # nothing sampled again
    ex = tmp_path / "eval.jsonl"
    ex.write_text(
        json.dumps({"messages": [{"role": "user", "content": "what is the capital of  FRANCE?"}]})
        + "\n"
    )
    assert (
        main(
            [
                "--config",
                str(cfg_path),
                *sets,
                "--self-instruct",
                "5",
                "--out",
                str(out),
                "--exclude",
                str(ex),
            ]
        )
        == 0
    )
    assert len(calls) == 4
    assert [
        c["messages"][0]["content"] for c in read_conversations(str(out), keep_prompt_only=True)
    ] == ["Write a story about a dragon.", "Plan a trip to Rome for me."]
    rep = json.loads((tmp_path / "si_report.json").read_text())
    assert rep["counts"]["duplicate"] == 1 and rep["excluded_prompts_known"] == 1
    assert rep["settings"]["exclude"] == [str(ex)]
    assert (
        main(
            [
                "--config",
                str(cfg_path),
                *sets,
                "--self-instruct",
                "5",
                "--out",
                str(out),
                "--exclude",
                str(ex),
            ]
        )
        == 0
    )
    assert len(calls) == 4  # up to date
    ex.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Plan a trip to Rome for me."}]})
        + "\n"
    )
    assert (
        main(
            [
                "--config",
                str(cfg_path),
                *sets,
                "--self-instruct",
                "5",
                "--out",
                str(out),
                "--exclude",
                str(ex),
            ]
        )
        == 0
    )  # trial 2: an edited exclude file (same path) was "up to date"
    assert len(calls) == 6
    assert [
        c["messages"][0]["content"] for c in read_conversations(str(out), keep_prompt_only=True)
    ] == ["Write a story about a dragon.", "What is the capital of France?"]


@pytest.mark.parametrize(
    "args,env,msg",
    [
        (["--self-instruct", "5"], {}, "--self-instruct N and --out FILE go together"),
        (["--out", "x.jsonl"], {}, "--self-instruct N and --out FILE go together"),
        (["--self-instruct", "0", "--out", "x.jsonl"], {}, "argument --self-instruct"),
        (
            ["--self-instruct", "5", "--out", "no/such/dir/x.jsonl"],
            {},
            "folder no/such/dir does not exist",
        ),
        (
            ["--self-instruct", "5", "--out", "x.jsonl", "--self-instruct-top-p", "1.5"],
            {},
            "'--self-instruct-top-p' should be less than or equal to 1, got 1.5",
        ),
        (["--self-instruct", "5", "--out", "x.jsonl"], {"WORLD_SIZE": "2"}, "without torchrun"),
        # trial si-2: written after the sampling, then unreadable in prompts.source (.json: one JSON array; .txt refused)
        (
            ["--self-instruct", "5", "--out", "x.json"],
            {},
            "ending in .jsonl or .jsonl.gz; name it e.g. x.jsonl",
        ),
        (
            ["--self-instruct", "5", "--out", "x.txt"],
            {},
            "ending in .jsonl or .jsonl.gz; name it e.g. x.jsonl",
        ),
        (
            ["--self-instruct", "5", "--out", "x.json.gz"],
            {},
            "ending in .jsonl or .jsonl.gz; name it e.g. x.jsonl",
        ),
    ],
)
def test_cli_refuses_bad_arguments_in_one_line(
    tmp_path, tiny_llama_dir, monkeypatch, args, env, msg
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        _cli()(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                *args,
            ]
        )
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x.jsonl").exists()


def test_smollm2_writes_user_prompts(tmp_path, monkeypatch):
    """The real verifier (SmolLM2 GGUF, fp32) continues its pre-query template with user prompts: 8 sampled, the kept
    ones non-empty plain text without chat markers."""
    from conftest import SMOLLM_GGUF, smollm_dir

    f = tmp_path / "c.yaml"
    f.write_text(
        f"run_name: si\nverifier: {{path: {smollm_dir()}, gguf_file: {SMOLLM_GGUF}, dtype: float32, "
        "device: cpu}\nprompts: {source: humaneval, gen_batch_size: 8}\n"
    )
    cfg = load_config(f)
    out = tmp_path / "q.jsonl"
    assert stage_si.run(cfg, 8, out, max_query_tokens=48) == 0
    rep = json.loads((tmp_path / "q_report.json").read_text())
    assert sum(rep["counts"].values()) == 8 and rep["counts"]["kept"] >= 3
    qs = [c["messages"][0]["content"] for c in read_conversations(str(out), keep_prompt_only=True)]
    assert len(qs) == rep["counts"]["kept"] and all(len(q) >= 16 and "<|im_" not in q for q in qs)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--self-instruct", "5", "--out", "."], "--out .: a folder; give the file to write"),
        (["--self-instruct", "5", "--out", "sub/"], "--out sub/: a folder; give the file to write"),
        (["--self-instruct", "5", "--out", "prompts.jsonl"], "the name of 01's own report"),
        (
            ["--self-instruct", "5", "--out", "x.jsonl", "--source", "humaneval"],
            "--source has no effect with --self-instruct",
        ),
        (
            ["--self-instruct", "5", "--out", "x.jsonl", "--no-regenerate"],
            "--[no-]regenerate has no effect",
        ),
        (
            ["--self-instruct", "5", "--out", "x.jsonl", "--limit", "3"],
            "--limit has no effect with --self-instruct",
        ),
        (["--exclude", "eval.jsonl"], "--exclude applies only with --self-instruct N --out FILE"),
        (
            ["--self-instruct-max-tokens", "64", "--limit", "2"],
            "--self-instruct-max-tokens applies only with",
        ),
    ],
)
def test_cli_refuses_misplaced_flags_before_sampling(
    tmp_path, tiny_llama_dir, monkeypatch, args, msg
):
    """Trial 2: an --out that is a folder failed only after sampling, naming a temporary file; --out prompts.jsonl
    overwrote a 01 run's prompts_report.json; --exclude (or any self-instruct flag) without --self-instruct, and 01's
    --source/--regenerate/--limit with it, were silently ignored. Now one line each, before the verifier loads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        si, "sample_queries", lambda *a, **k: pytest.fail("sampled before refusing")
    )
    with pytest.raises(UserError) as e:
        _cli()(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                *args,
            ]
        )
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_gz_out_is_gzip_and_01_reads_it(tmp_path, tiny_llama_dir, monkeypatch):
    """--out F.jsonl.gz writes gzip (trial 2: plain text under a .gz name, which 01 then refused as 'Not a gzipped
    file'); 01's reader reads it back; the report is F_report.json; the same queries give the same bytes."""
    import gzip

    fake, _ = _fake_sampler(
        [(["Write a story about a dragon.", "Plan a trip to Rome for me."], [True, True])] * 2
    )
    monkeypatch.setattr(si, "sample_queries", fake)
    out = tmp_path / "si.jsonl.gz"
    args = [
        "--config",
        str(ROOT / "configs" / "tiny-llama.yaml"),
        "--set",
        f"verifier.path={tiny_llama_dir}",
        "--self-instruct",
        "2",
        "--out",
        str(out),
    ]
    assert _cli()(args) == 0
    first = out.read_bytes()
    assert first[:2] == b"\x1f\x8b"
    assert [
        json.loads(line)["messages"][0]["content"]
        for line in gzip.decompress(first).decode().splitlines()
    ] == ["Write a story about a dragon.", "Plan a trip to Rome for me."]
    assert len(read_conversations(str(out), keep_prompt_only=True)) == 2
    assert (tmp_path / "si_report.json").is_file()
    assert _cli()(args + ["--force"]) == 0 and out.read_bytes() == first


def test_cli_no_query_kept_is_an_error_and_writes_nothing(tmp_path, tiny_llama_dir, monkeypatch):
    """Every query unfinished or excluded: one line with the counts and what to change, no file (trial 2: an empty
    file, exit 0 and "list it in prompts.source", which 01 then refused as 'no records')."""
    fake, _ = _fake_sampler(
        [(["An unfinished query that is long", "Write a story about a dragon."], [False, True])]
    )
    monkeypatch.setattr(si, "sample_queries", fake)
    ex = tmp_path / "eval.jsonl"
    ex.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Write a story about a dragon."}]})
        + "\n"
    )
    out = tmp_path / "si.jsonl"
    with pytest.raises(UserError) as e:
        _cli()(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                "--self-instruct",
                "2",
                "--out",
                str(out),
                "--exclude",
                str(ex),
            ]
        )
    assert str(e.value) == (
        "--self-instruct 2: no query kept (1 unfinished, 0 too short, 1 repeated or excluded), nothing written; raise "
        "--self-instruct-max-tokens (now 128) or use an instruction-tuned verifier; set another prompts.seed (the "
        "same seed samples the same queries: a second file made with it repeats the first)"
    )
    assert not out.exists() and not (tmp_path / "si_report.json").exists()


def test_cli_sigterm_says_nothing_was_written(tmp_path, tiny_llama_dir, monkeypatch):
    """SIGTERM while sampling ends with run_main's one line and a hint, as 01's other mode (trial 2: the process died
    silently); nothing is written."""
    import os
    import signal

    from eagle3.cli import Terminated

    def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not interrupt")

    monkeypatch.setattr(si, "sample_queries", killed)
    out = tmp_path / "si.jsonl"
    with pytest.raises(Terminated) as e:
        _cli()(
            [
                "--config",
                str(ROOT / "configs" / "tiny-llama.yaml"),
                "--set",
                f"verifier.path={tiny_llama_dir}",
                "--self-instruct",
                "2",
                "--out",
                str(out),
            ]
        )
    assert e.value.hint == f"nothing written ({out} is written at the end); re-run the same command"
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_forced_sampling_samples_again_without_force(
    tmp_path, tiny_llama_dir, monkeypatch, capsys
):
    """``--self-instruct N --out F --force`` stopped while sampling left F and its report, which the same command
    without --force then found "up to date" (the old queries kept). The forced run now removes F's report before it
    samples: the rerun samples again and writes F and its report."""
    batches = [(["Write a story about a dragon.", "Plan a trip to Rome for me."], [True, True])]
    fake, calls = _fake_sampler(batches * 3)
    monkeypatch.setattr(si, "sample_queries", fake)
    out = tmp_path / "si.jsonl"
    args = [
        "--config",
        str(ROOT / "configs" / "tiny-llama.yaml"),
        "--set",
        f"verifier.path={tiny_llama_dir}",
        "--self-instruct",
        "2",
        "--out",
        str(out),
    ]
    assert _cli()(args) == 0 and len(calls) == 1

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(si, "sample_queries", killed)
    with pytest.raises(KeyboardInterrupt):
        _cli()(args + ["--force"])
    assert out.is_file() and not (tmp_path / "si_report.json").exists()
    capsys.readouterr()
    monkeypatch.setattr(si, "sample_queries", fake)
    assert _cli()(args) == 0
    assert len(calls) == 2 and "up to date" not in capsys.readouterr().out
    assert (tmp_path / "si_report.json").is_file()
    assert _cli()(args) == 0 and len(calls) == 2 and "up to date" in capsys.readouterr().out
