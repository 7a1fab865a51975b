"""Stage 02 end to end on a tiny random Llama verifier: shards, metadata, resume, fingerprint."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.capture.folder import STATE
from eagle3.capture.prompts import read_prompts
from eagle3.config import load_config
from eagle3.errors import UserError
from eagle3.shards.data_config import read_data_config
from eagle3.shards.format import list_samples
from eagle3.shards.manifest import read_manifest
from eagle3.shards.read import load_sample
from eagle3.stages.extract import run

ROOT = Path(__file__).resolve().parents[2]
AUX = [1, 3, 4]

CONVS = [
    ("p0", [("user", "What is 2+2?"), ("assistant", "2+2 is 4.")]),
    ("p1", [("system", "Be brief."), ("user", "Name a colour."), ("assistant", "Blue.")]),
    (
        "p2",
        [
            ("user", "Write a haiku about the sea."),
            ("assistant", "Waves fold into foam, the grey horizon breathing, salt on every stone."),
        ],
    ),
    (
        "p3",
        [
            ("user", "Hi"),
            ("assistant", "Hello! How can I help?"),
            ("user", "Say bye"),
            ("assistant", "Bye!"),
        ],
    ),
    ("p4", [("user", "No answer here")]),  # no assistant turn -> skipped_no_loss_tokens
    ("p5", [("user", "Count to five."), ("assistant", "One, two, three, four, five.")]),
    (
        "p6",
        [
            ("user", "Explain recursion in one sentence."),
            (
                "assistant",
                "Recursion is when a function solves a problem by calling itself on smaller parts of it.",
            ),
        ],
    ),
]


def _write_prompts(path: Path, convs=CONVS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for pid, msgs in convs:
            f.write(
                json.dumps({"id": pid, "messages": [{"role": r, "content": c} for r, c in msgs]})
                + "\n"
            )


def _config(tmp_path: Path, model_dir: Path, **extract) -> Path:
    ex = {"aux_layers": AUX, "max_length": 64, "batch_tokens": 80, "rows_per_dir": 2}
    ex.update(extract)
    cfg = {
        "run_name": "t",
        "output_root": str(tmp_path / "out"),
        "verifier": {
            "path": str(model_dir),
            "name": "tiny-llama",
            "dtype": "float32",
            "device": "cpu",
        },
        "prompts": {"source": "humaneval"},
        "extract": ex,
    }
    p = tmp_path / "run.yaml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(cfg))
    _write_prompts(tmp_path / "out" / "prompts.jsonl")
    return p


@pytest.fixture(scope="module")
def tiny_backend(tiny_llama_dir):
    """One loaded tiny verifier + HF capture backend shared by the tests below (saves reloading)."""
    from eagle3.capture.hf import HFCapture
    from eagle3.config import VerifierConfig
    from eagle3.verifier.load import load_verifier

    model, tok = load_verifier(
        VerifierConfig(path=str(tiny_llama_dir), name="tiny-llama", dtype="float32", device="cpu")
    )
    return HFCapture(model, AUX, batch_tokens=10**9), tok


def _run(cfg, backend, **kw):
    cap, tok = backend
    return run(cfg, backend=cap, tokenizer=tok, **kw)


def _snapshot(root: Path) -> dict:
    out = {}
    for idx, p in list_samples(root):
        s = load_sample(p)
        out[idx] = (s, p.stat().st_ino, p.stat().st_mtime_ns)
    return out


def test_end_to_end_shards_match_verifier(tmp_path, tiny_llama_dir, smollm_tokenizer):
    from _chat_single import tokenize_conversation
    from transformers import AutoModelForCausalLM

    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    summary = run(cfg)
    root = cfg.shards_dir
    assert summary["samples"] == 6 and summary["written"] == 6 and summary["resumed"] == 0
    assert summary["skipped"] == {"skipped_no_loss_tokens": 1}
    listed = list_samples(root)
    assert [i for i, _ in listed] == [0, 1, 2, 3, 4, 5]
    assert listed[2][1] == root / "rows_2-4" / "data_2.pt"
    meta = read_data_config(root)
    assert meta["verifier"] == "tiny-llama" and meta["aux_layers"] == AUX
    assert (meta["num_layers"], meta["hidden_size"], meta["vocab_size"]) == (
        6,
        64,
        len(smollm_tokenizer),
    )
    assert meta["last_hidden_state"] == "post_norm" and meta["architecture"] == "LlamaForCausalLM"
    assert meta["bytes_per_token"] == 4 * 64 * 2
    man = read_manifest(root / "manifest.jsonl").rows
    assert [man[i]["id"] for i in range(6)] == [
        "p0",
        "p1",
        "p2",
        "p3",
        "p5",
        "p6",
    ]  # p4 skipped, dense idx

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    total = loss = 0
    kept = [c for c in CONVS if c[0] != "p4"]
    for (idx, path), (pid, msgs) in zip(listed, kept):
        s = load_sample(path, expect={"hidden_size": 64, "vocab_size": meta["vocab_size"]})
        ids, mask = tokenize_conversation(
            smollm_tokenizer, [{"role": r, "content": c} for r, c in msgs], 64
        )
        assert s["input_ids"].tolist() == ids and s["loss_mask"].tolist() == mask
        assert man[idx]["num_tokens"] == len(ids)
        total += len(ids)
        loss += sum(mask)
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for h, layer in zip(s["hidden_states"], AUX + [6]):
            torch.testing.assert_close(
                h.float(), ref[layer][0].to(torch.bfloat16).float(), atol=5e-4, rtol=8e-3
            )
    assert (
        meta["num_tokens"] == total and meta["num_loss_tokens"] == loss and meta["num_samples"] == 6
    )
    report = json.loads((root / "extract_report.json").read_text())
    assert report["num_tokens"] == total
    assert "| samples | 6 |" in (root / "extract_report.md").read_text()


def test_resume_after_losing_shards_and_manifest_lines(tmp_path, tiny_llama_dir, tiny_backend):
    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    _run(cfg, tiny_backend)
    root = cfg.shards_dir
    before = _snapshot(root)
    # Damage: delete shards 1 and 4, drop the last two manifest lines and add a torn one (the shards
    # of those lines stay: they must be adopted, not rewritten), leave a stale temp file.
    (root / "rows_0-2" / "data_1.pt").unlink()
    (root / "rows_4-6" / "data_4.pt").unlink()
    lines = (root / "manifest.jsonl").read_text().splitlines(keepends=True)
    dropped = [json.loads(x)["idx"] for x in lines[-2:]]
    (root / "manifest.jsonl").write_text("".join(lines[:-2]) + '{"idx": 9, "id"')
    (root / "rows_2-4" / "data_3.pt.tmp-xyz").write_bytes(b"partial")
    (root / "data_config.json").unlink()

    summary = _run(cfg, tiny_backend)
    assert summary["written"] == 2 and summary["resumed"] == 4
    after = _snapshot(root)
    assert sorted(after) == sorted(before)
    for idx, (s, ino, mtime) in after.items():
        b, b_ino, b_mtime = before[idx]
        assert torch.equal(s["input_ids"], b["input_ids"]) and torch.equal(
            s["loss_mask"], b["loss_mask"]
        )
        assert all(
            torch.equal(x, y) for x, y in zip(s["hidden_states"], b["hidden_states"])
        )  # bit-identical
        if idx not in (1, 4):
            assert (ino, mtime) == (b_ino, b_mtime), f"shard {idx} was rewritten"
    assert set(dropped) - {1, 4} <= set(read_manifest(root / "manifest.jsonl").rows)
    rows = [json.loads(x) for x in (root / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["idx"] for r in rows) == list(range(6))  # no duplicates, nothing lost
    assert not list(root.rglob("*.tmp-*"))
    assert read_data_config(root)["num_samples"] == 6


def test_changed_settings_name_each_changed_key():
    from eagle3.capture.resume import changed_settings

    old = {
        "verifier": {"path": "/m", "dtype": "bfloat16"},
        "extract": {"max_length": 2048, "backend": "hf"},
        "prompts_sha256": "1a2b3c4d" + "0" * 56,
        "verifier_id": "m",
    }
    new = {
        "verifier": {"path": "/m", "dtype": "float32", "reply_start": "<|im_start|>assistant\n"},
        "extract": {"max_length": 4096, "backend": "hf"},
        "prompts_sha256": "5e6f7a8b" + "0" * 56,
        "verifier_id": "m",
        "storage": {
            "storage_dtype": "float8_e4m3fn",
            "scale_scheme": "per_token",
            "scale_dtype": "float32",
        },
    }
    assert changed_settings(old, new) == [
        "extract.fp8_scale: default -> 'per_token'",
        "extract.max_length: 2048 -> 4096",
        "extract.storage_dtype: 'bfloat16' -> 'float8_e4m3fn'",
        "the prompts file (sha256 1a2b3c4d -> 5e6f7a8b)",
        "verifier.dtype: 'bfloat16' -> 'float32'",
        "verifier.reply_start: default -> '<|im_start|>assistant\\n'",
    ]
    assert changed_settings({}, new) == [] and changed_settings(new, new) == []
    # token-only samples (train.hidden_states: online) over offline shards named "samples: default -> 'tokens'"
    # (fresh-user trial 2026-12-05e): the config key the user set
    assert changed_settings(old, dict(old, samples="tokens")) == [
        "train.hidden_states: 'offline' -> 'online'"
    ]
    assert changed_settings(dict(old, samples="tokens"), old) == [
        "train.hidden_states: 'online' -> 'offline'"
    ]


def test_fingerprint_mismatch_refused_then_overwrite(tmp_path, tiny_llama_dir, tiny_backend):
    path = _config(tmp_path, tiny_llama_dir)
    _run(load_config(path), tiny_backend, limit=3)
    cfg2 = load_config(path, ["extract.max_length=40"])
    with pytest.raises(UserError) as e:
        _run(cfg2, tiny_backend, limit=3)
    assert str(e.value).endswith(
        f"{STATE}: the shards in {cfg2.shards_dir} were extracted with other settings: changed "
        f"extract.max_length: {load_config(path).extract.max_length} -> 40; re-run with "
        "--overwrite to delete them and start over, or set extract.output_dir to another folder "
        "to keep them (another run may read them)"
    )
    # the way out that keeps the shards (fresh-user trial 2026-12-05g: a second run sharing the first's shards
    # through extract.output_dir was told only to delete them): a new folder starts its own set
    s = _run(
        load_config(path, ["extract.max_length=40", f"extract.output_dir={tmp_path / 'other'}"]),
        tiny_backend,
        limit=3,
    )
    assert (s["written"], s["resumed"]) == (3, 0) and len(
        list(cfg2.shards_dir.rglob("data_*.pt"))
    ) == 3
    # batch_tokens is not part of the fingerprint: the finished folder is up to date with a smaller budget
    s = _run(load_config(path, ["extract.batch_tokens=40"]), tiny_backend, limit=3)
    assert s["up_to_date"] and s["written"] == 3 and s["resumed"] == 0
    s = _run(cfg2, tiny_backend, limit=3, overwrite=True)
    assert s["written"] == 3 and s["resumed"] == 0
    assert read_data_config(cfg2.shards_dir)["max_length"] == 40
    assert not (
        cfg2.shards_dir / ".extract.lock"
    ).exists()  # a finished run leaves no empty lock file
    assert all(load_sample(p)["input_ids"].numel() <= 40 for _, p in list_samples(cfg2.shards_dir))


def test_changed_prompts_refused(tmp_path, tiny_llama_dir, tiny_backend):
    path = _config(tmp_path, tiny_llama_dir)
    cfg = load_config(path)
    _run(cfg, tiny_backend, limit=2)
    _write_prompts(cfg.prompts_path, CONVS[::-1])
    with pytest.raises(
        UserError,
        match=r"other settings: changed the prompts file \(sha256 [0-9a-f]{8} -> [0-9a-f]{8}\);",
    ):
        _run(cfg, tiny_backend, limit=2)
    assert not (
        cfg.shards_dir / ".extract.lock"
    ).exists()  # released and removed, also after a refusal


def test_unknown_shards_refused(tmp_path, tiny_llama_dir):
    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    cfg.shards_dir.mkdir(parents=True)
    (cfg.shards_dir / "data_0.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="no extract_state.json"):
        run(cfg)


def test_too_long_policies(tmp_path, tiny_llama_dir, smollm_tokenizer, tiny_backend):
    from _chat_single import tokenize_conversation

    lengths = {
        pid: len(
            tokenize_conversation(
                smollm_tokenizer, [{"role": r, "content": c} for r, c in m], 10_000
            )[0]
        )
        for pid, m in CONVS
        if pid != "p4"
    }
    cut = sorted(lengths.values())[2]  # two conversations fit, the rest are longer
    n_long = sum(v > cut for v in lengths.values())
    s = _run(
        load_config(_config(tmp_path / "a", tiny_llama_dir, max_length=cut, too_long="skip")),
        tiny_backend,
    )
    assert s["skipped"]["skipped_too_long"] == n_long and s["samples"] == 6 - n_long
    s = _run(
        load_config(_config(tmp_path / "b", tiny_llama_dir, max_length=cut, too_long="truncate")),
        tiny_backend,
    )
    assert s["truncated"] == n_long
    assert (
        max(
            load_sample(p)["input_ids"].numel()
            for _, p in list_samples(tmp_path / "b" / "out" / "shards")
        )
        == cut
    )


def test_default_aux_layers_need_six_distinct(tmp_path, tiny_llama_dir):
    # 6 layers -> default [2, 3, 3] would not be strictly increasing: refused, nothing written
    cfg = load_config(_config(tmp_path, tiny_llama_dir, aux_layers=None))
    with pytest.raises(UserError, match=r"verifier has 6 layers.*set extract.aux_layers"):
        run(cfg)
    assert not list(cfg.shards_dir.rglob("*.pt"))


def test_aux_layer_out_of_range(tmp_path, tiny_llama_dir):
    cfg = load_config(_config(tmp_path, tiny_llama_dir, aux_layers=[1, 2, 6]))
    with pytest.raises(
        UserError, match=r"aux layers \[1, 2, 6\] must be .* in 1\.\.5 for a 6-layer verifier"
    ):
        run(cfg)


def test_bad_prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{"id": "b", "messages": [{"role": "bot", "content": "y"}]}\n'
    )
    with pytest.raises(
        UserError,
        match=r"prompts.jsonl:2: field 'messages\[0\]\.role' should be 'system', 'user', 'assistant' or 'tool', got 'bot'; the prompts file is 01_prepare_prompts.py's output",
    ):
        read_prompts(p)
    p.write_text('{"id": "a", "messages": []}\n')
    with pytest.raises(
        UserError,
        match=r"prompts.jsonl:1: field 'messages' should hold at least 1 item\(s\), got \[\]",
    ):
        read_prompts(p)
    p.write_text('{"id": "a"\n')
    with pytest.raises(UserError, match="prompts.jsonl:1: malformed JSON"):
        read_prompts(p)
    with pytest.raises(UserError, match="prompts file not found"):
        read_prompts(tmp_path / "nope.jsonl")
    p.write_text(
        "\n  \n"
    )  # blank lines only (an empty prompts.jsonl): refused, not 0 shards and a done capture
    with pytest.raises(UserError, match="prompts.jsonl: no conversations in the prompts file"):
        read_prompts(p)
    p.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "x"}, '
        '{"role": "assistant", "content": "y", "truncated": "yes"}]}\n'
    )  # 01 writes true, never a string
    with pytest.raises(
        UserError,
        match=r"prompts.jsonl:1: field 'messages\[1\].truncated' should be a valid boolean, got 'yes'",
    ):
        read_prompts(p)
    for bad in ('"2"', "true", "-1", "2.0"):  # 01 writes the stop id as an integer
        p.write_text(
            '{"id": "a", "messages": [{"role": "user", "content": "x"}, '
            f'{{"role": "assistant", "content": "y", "stop_token": {bad}}}]}}\n'
        )
        with pytest.raises(
            UserError,
            match=r"prompts.jsonl:1: field 'messages\[1\].stop_token' should be (a valid integer|greater "
            r"than or equal to 0), got ",
        ):
            read_prompts(p)
    p.write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "x"}, '
        '{"role": "assistant", "content": "y", "stop_token": 2}]}\n'
    )
    assert read_prompts(p)[0]["messages"][1]["stop_token"] == 2


def test_cli_exit_code_on_bad_input(tmp_path, tiny_llama_dir, capsys):
    sys.path.insert(0, str(ROOT))
    import importlib

    cli = importlib.import_module("02_extract_hidden")
    from eagle3.cli import run_main

    path = _config(tmp_path, tiny_llama_dir)
    (tmp_path / "out" / "prompts.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit) as e:
        run_main(cli.main, ["--config", str(path)])
    assert e.value.code == 2
    assert "prompts.jsonl:1: malformed JSON" in capsys.readouterr().err
    _write_prompts(tmp_path / "out" / "prompts.jsonl")
    with pytest.raises(SystemExit) as e:
        run_main(cli.main, ["--config", str(path), "--backend", "sglang"])
    assert e.value.code == 2
    assert "error: extract.sglang_url: required for backend sglang" in capsys.readouterr().err
    assert not list((tmp_path / "out" / "shards").rglob("*.pt"))


def test_backend_sglang_names_each_missing_field(tmp_path, tiny_llama_dir):
    from eagle3.capture.backends import make_backend

    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    ex = cfg.extract.model_copy(update={"backend": "sglang"})
    with pytest.raises(UserError) as e:
        make_backend(cfg.verifier, ex)
    assert str(e.value) == (
        "extract.sglang_url: required for backend sglang (or pass --server URL [URL ...])"
    )
    ex = ex.model_copy(update={"sglang_url": "http://127.0.0.1:9"})
    with pytest.raises(UserError) as e:
        make_backend(cfg.verifier, ex)
    assert str(e.value) == (
        "extract.capture_dir: required for backend sglang (where the patched server writes tensors)"
    )


def test_concurrent_run_refused(tmp_path, tiny_llama_dir):
    import fcntl

    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    cfg.shards_dir.mkdir(parents=True)
    with open(cfg.shards_dir / ".extract.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds the folder
        with pytest.raises(UserError, match="another 02_extract_hidden run is writing"):
            run(cfg)
    assert not (cfg.shards_dir / STATE).exists()


def test_silent_corruption_caught_by_stage03_checksum(tmp_path, tiny_llama_dir, tiny_backend):
    """Bytes flipped inside a shard's tensor data still unpickle (torch does not check the zip CRC);
    the checksum that 02 records per shard in manifest.jsonl (xxh3_128) makes stage 03 refuse it."""
    from eagle3.stages.prepare_data import run as prepare

    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"draft_vocab_size": 64})})
    _run(cfg, tiny_backend)
    rows = [json.loads(x) for x in (cfg.shards_dir / "manifest.jsonl").read_text().splitlines()]
    assert all(len(r["xxh3_128"]) == 32 and "sha256" not in r for r in rows)
    prepare(cfg, plot=False)  # intact: passes
    victim = cfg.shards_dir / "rows_2-4" / "data_3.pt"
    data = bytearray(victim.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0x01 for b in data[mid : mid + 64])
    victim.write_bytes(bytes(data))
    load_sample(victim)  # still loads: the corruption is silent without the checksum
    with pytest.raises(UserError, match=r"data_3\.pt: contents changed since extraction"):
        prepare(cfg, plot=False)


def _fail_load(*a, **k):
    raise AssertionError("the verifier was loaded")


@pytest.mark.parametrize("online", [False, True])
def test_rerun_of_finished_shards_is_up_to_date(
    tmp_path, tiny_llama_dir, caplog, monkeypatch, online
):
    """A second run of a finished folder loads no verifier and leaves every report byte for byte."""
    import eagle3.verifier.load as verifier

    path = _config(tmp_path, tiny_llama_dir)
    cfg = load_config(path, ["train.hidden_states=online"] if online else [])
    first = run(cfg)
    root = cfg.shards_dir
    names = [
        "extract_report.json",
        "extract_report.md",
        "data_config.json",
        STATE,
        "manifest.jsonl",
    ]
    before = {n: (root / n).read_bytes() for n in names}
    monkeypatch.setattr(verifier, "load_verifier", _fail_load)
    monkeypatch.setattr(verifier, "load_tokenizer", _fail_load)
    with caplog.at_level("INFO", logger="eagle3.stages.extract"):
        again = run(cfg)
    assert again["up_to_date"] and again["written"] == first["written"] == 6
    assert again["capture_s"] == first["capture_s"] and again["disk_plan"] == first["disk_plan"]
    assert {n: (root / n).read_bytes() for n in names} == before
    assert (
        f"shards up to date: {root} (6 samples, settings unchanged; use --overwrite to redo)"
        in caplog.messages
    )


def test_a_smaller_limit_on_a_finished_set_is_up_to_date(tmp_path, tiny_llama_dir, monkeypatch):
    """--limit at or below the finished run's prompts asks for a prefix of what is there: nothing to do, the reports
    stay byte for byte (a fresh-user trial: `--limit 4` after a full run of 8 rewrote the report with 0 written)."""
    import eagle3.verifier.load as verifier

    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    run(cfg)
    root = cfg.shards_dir
    names = [
        "extract_report.json",
        "extract_report.md",
        "data_config.json",
        STATE,
        "manifest.jsonl",
    ]
    before = {n: (root / n).read_bytes() for n in names}
    monkeypatch.setattr(verifier, "load_verifier", _fail_load)
    monkeypatch.setattr(verifier, "load_tokenizer", _fail_load)
    for limit in (2, 6, 50):  # below, equal to and above the 6 prompts there are
        assert run(cfg, limit=limit)["up_to_date"]
    assert {n: (root / n).read_bytes() for n in names} == before


def test_weights_replaced_at_the_same_path_are_not_up_to_date(
    tmp_path, tiny_llama_dir, other_weights_dir
):
    """Other weights saved over the verifier's folder (same verifier.path and name): 02 said "shards up to date" while
    03/04 refused the set for those weights and said to re-run 02; a half-done set would have resumed, mixing two
    models' states. Now 02 refuses the folder in one line naming the weights and --overwrite, which redoes it under
    the new weights."""
    import shutil

    vdir = tmp_path / "verifier"
    shutil.copytree(tiny_llama_dir, vdir)
    cfg = load_config(_config(tmp_path, vdir))
    run(cfg, limit=3)
    root = cfg.shards_dir
    first = json.loads((root / "data_config.json").read_text())["verifier_weights"]
    assert json.loads((root / STATE).read_text())["verifier_weights"] == first
    assert run(cfg, limit=3)["up_to_date"]  # same weights: nothing to do
    for f in other_weights_dir.glob("*.safetensors"):
        shutil.copy(f, vdir / f.name)
    from eagle3.verifier.load import weights_fingerprint

    now = weights_fingerprint(cfg.verifier)
    state = json.loads((root / STATE).read_text())
    del state["verifier_weights"]  # a state file of before: data_config.json's record is compared
    (root / STATE).write_text(json.dumps(state))
    for limit in (3, None):  # the finished set, and more prompts (a resume)
        with pytest.raises(UserError) as e:
            run(cfg, limit=limit)
        assert str(e.value) == (
            f"{root / STATE}: the shards in {root} were extracted with other settings: changed the "
            f"weights at verifier.path (verifier_weights: {first} -> {now}); re-run with "
            f"--overwrite to delete them and start over, or set extract.output_dir to another folder "
            f"to keep them (another run may read them)"
        )
    s = run(cfg, overwrite=True)
    assert (s["written"], s["resumed"]) == (6, 0)
    assert json.loads((root / "data_config.json").read_text())["verifier_weights"] == now


def test_rerun_not_up_to_date_when_more_prompts_or_a_shard_gone(
    tmp_path, tiny_llama_dir, tiny_backend
):
    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    _run(cfg, tiny_backend, limit=3)
    s = _run(cfg, tiny_backend)  # more prompts than the finished run: captures the rest
    assert not s.get("up_to_date") and (s["written"], s["resumed"]) == (3, 3)
    (cfg.shards_dir / "rows_0-2" / "data_1.pt").unlink()
    s = _run(cfg, tiny_backend)
    assert not s.get("up_to_date") and (s["written"], s["resumed"]) == (1, 5)
    s = _run(cfg, tiny_backend, overwrite=True)  # --overwrite never takes the shortcut
    assert not s.get("up_to_date") and (s["written"], s["resumed"]) == (6, 0)


def test_cli_rerun_prints_nothing_but_the_up_to_date_line(tmp_path, tiny_llama_dir, capsys, caplog):
    sys.path.insert(0, str(ROOT))
    import importlib

    cli = importlib.import_module("02_extract_hidden")
    path = _config(tmp_path, tiny_llama_dir)
    assert cli.main(["--config", str(path)]) == 0
    assert "6 samples (6 written, 0 resumed)" in capsys.readouterr().out
    with caplog.at_level("INFO", logger="eagle3.stages.extract"):
        assert cli.main(["--config", str(path)]) == 0
    assert capsys.readouterr().out == ""
    assert any(m.startswith("shards up to date: ") for m in caplog.messages)


def _prompts_report(cfg, **over) -> None:
    """A ``prompts_report.json`` as 01 writes it for ``cfg`` (settings overridden by ``over``)."""
    from eagle3.stages.prompts_manifest import report_path, settings

    report_path(cfg).write_text(
        json.dumps({"settings": {**settings(cfg, None), **over}, "cli_overrides": []})
    )


def test_changed_prompts_settings_refused(tmp_path, tiny_llama_dir, tiny_backend):
    path = _config(tmp_path, tiny_llama_dir)
    cfg = load_config(path)
    _prompts_report(cfg)
    assert _run(cfg, tiny_backend, limit=2)["written"] == 2  # same settings: no refusal
    cfg2 = load_config(path, ["prompts.sample_size=3", "prompts.seed=7"])
    with pytest.raises(UserError) as e:
        _run(cfg2, tiny_backend, limit=2)
    assert str(e.value) == (
        f"{cfg.root / 'prompts_report.json'}: prompts.sample_size None -> 3; re-run "
        "01_prepare_prompts.py with this config first"
    )
    # the limit of 01's --limit and a verifier-section setting are not prompts: settings
    _prompts_report(cfg, limit=5, verifier="other")
    assert _run(cfg, tiny_backend, limit=2)["written"] == 2
    # a regenerating 01 keeps only conversations under its context cap: the cap is compared (prompts.max_context_tokens,
    # else extract.max_length: 64 here)
    from eagle3.stages.prompts_manifest import report_path, require_current, settings

    regen = load_config(path, ["prompts.regenerate=true"])
    report_path(cfg).write_text(
        json.dumps({"settings": settings(regen, None), "cli_overrides": []})
    )
    cap = "max_context_tokens (prompts.max_context_tokens, else extract.max_length)"
    with pytest.raises(
        UserError, match=rf": {re.escape(cap)} 64 -> 200; re-run 01_prepare_prompts"
    ):
        require_current(
            load_config(path, ["prompts.regenerate=true", "prompts.max_context_tokens=200"])
        )
    # 02's refusal after an edit of extract.max_length names that key, not only the settings' max_context_tokens
    with pytest.raises(UserError) as e:
        _run(
            load_config(path, ["prompts.regenerate=true", "extract.max_length=128"]),
            tiny_backend,
            limit=2,
        )
    assert f": {cap} 64 -> 128; re-run 01_prepare_prompts.py" in str(e.value)
    # settings 01 took from its command line are named, so a re-run gives them again
    report_path(cfg).write_text(
        json.dumps(
            {
                "settings": {**settings(cfg, None), "dedupe": False},
                "cli_overrides": ["source", "regenerate"],
            }
        )
    )
    with pytest.raises(UserError) as e:
        _run(cfg, tiny_backend, limit=2)
    assert str(e.value).endswith(
        ": prompts.dedupe False -> True; re-run 01_prepare_prompts.py with this config first (it was "
        "run with --source, --regenerate on its command line: give them again, or put them "
        "in the config)"
    )


def test_prompts_settings_not_compared_without_report_or_for_cli_overrides(
    tmp_path, tiny_llama_dir, tiny_backend
):
    from eagle3.stages.prompts_manifest import report_path, require_current, settings

    path = _config(tmp_path, tiny_llama_dir)
    cfg = load_config(path, ["prompts.source=/tmp/ok.jsonl"])
    require_current(cfg)  # prompts.jsonl written by hand: no report
    old = {**settings(load_config(path), None), "format": "sharegpt"}
    report_path(cfg).write_text(json.dumps({"settings": old, "cli_overrides": ["source"]}))
    with pytest.raises(UserError) as e:  # 01 --source X: the source is not compared
        require_current(cfg)
    assert str(e.value).startswith(
        f"{report_path(cfg)}: prompts.format 'sharegpt' -> 'auto'; re-run"
    )
    report_path(cfg).write_text(
        json.dumps({"settings": old})
    )  # written before cli_overrides were recorded
    require_current(cfg)


class _ReportsDeepseek:
    """The tiny Llama backend, reporting a DeepSeek-family architecture (SGLang's rule for it is the one that
    cannot state a first HF aux layer 1)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def info(self):
        return {**self.inner.info(), "architecture": "DeepseekV3ForCausalLM"}


def test_layers_the_export_engine_cannot_serve_refused_before_capture(tmp_path, tiny_backend):
    """HF aux layers [1, 3, 4] of a DeepSeek-family verifier cannot be stated to SGLang (its DeepSeek rule adds +1
    when the first id is 1): 02 refuses before capturing, naming export.engine (the export used to find out after
    the capture and the training; trial 05e). For vLLM the same layers are captured."""
    cap, tok = tiny_backend
    cfg = load_config(_config(tmp_path / "s", Path("unused")))
    with pytest.raises(
        UserError,
        match=r"extract.aux_layers: export.engine sglang cannot serve .*DeepseekV3ForCausalLM",
    ):
        run(cfg, backend=_ReportsDeepseek(cap), tokenizer=tok)
    assert not list(cfg.shards_dir.rglob("*.pt"))
    cfg_v = load_config(_config(tmp_path / "v", Path("unused")), ["export.engine=vllm"])
    run(cfg_v, backend=_ReportsDeepseek(cap), tokenizer=tok)
    assert read_data_config(cfg_v.shards_dir)["aux_layers"] == AUX


@pytest.mark.parametrize("bad", ["x", -5, 1.5, True])
def test_a_tokens_item_that_is_not_a_token_id_is_refused_naming_the_key(tmp_path, bad):
    """An answer's ``tokens`` (the ids 01 generated, taken verbatim) holding a string was a ValueError traceback, a
    negative id an IndexError in the embedding, and ``1.5`` / ``true`` were read as 1; each is refused naming the line
    and the item."""
    p = tmp_path / "prompts.jsonl"
    p.write_text(
        json.dumps(
            {
                "id": "a",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "y", "tokens": [5, bad]},
                ],
            }
        )
        + "\n"
    )
    with pytest.raises(UserError) as e:
        read_prompts(p)
    what = "greater than or equal to 0" if bad == -5 else "a valid integer"
    assert str(e.value) == (
        f"{p}:1: field 'messages[1].tokens[1]' should be {what}, got {bad!r}; the prompts file is "
        "01_prepare_prompts.py's output: re-run it or mend the record"
    )


def test_a_token_id_past_the_verifiers_vocab_is_refused_before_the_capture(
    tmp_path, tiny_llama_dir, tiny_backend
):
    """``tokens`` from another verifier (or edited): an id >= the verifier's vocab was an IndexError traceback from the
    embedding lookup, after the disk plan; 02 now stops with one line naming the file, line and key, and writes no
    shard."""
    cfg = load_config(_config(tmp_path, tiny_llama_dir))
    vocab = tiny_backend[0].info()["vocab_size"]
    convs = [
        json.dumps({"id": pid, "messages": [{"role": r, "content": c} for r, c in msgs]})
        for pid, msgs in CONVS[:2]
    ]
    bad = {
        "id": "big",
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "tokens": [3, vocab - 1, vocab]},
        ],
    }
    cfg.prompts_path.write_text("\n".join(convs + [json.dumps(bad)]) + "\n")
    with pytest.raises(UserError) as e:
        _run(cfg, tiny_backend)
    assert str(e.value) == (
        f"{cfg.prompts_path}:3: field 'messages[1].tokens[2]' = {vocab} is not a token id of this "
        f"verifier (vocab {vocab}): were the answers generated by another one? Re-run "
        "01_prepare_prompts.py with this verifier"
    )
    assert not list(cfg.shards_dir.rglob("*.pt"))
    bad["messages"][1].update(tokens=[3, vocab - 1], stop_token=vocab)  # the recorded stop id too
    cfg.prompts_path.write_text("\n".join(convs + [json.dumps(bad)]) + "\n")
    with pytest.raises(
        UserError,
        match=rf"prompts.jsonl:3: field 'messages\[1\].stop_token' = {vocab} is not a token id ",
    ):
        _run(cfg, tiny_backend)
    bad["messages"][1].pop("stop_token")
    cfg.prompts_path.write_text("\n".join(convs + [json.dumps(bad)]) + "\n")
    _run(cfg, tiny_backend)
    assert len(list(cfg.shards_dir.rglob("data_*.pt"))) == 3


def test_check_token_ids_names_the_first_id_out_of_the_vocab(tmp_path):
    from eagle3.capture.prompts import check_token_ids

    def rec(*msgs):
        return {"id": "a", "line": 7, "messages": [{"role": "user", "content": "x"}, *msgs]}

    def a(**kw):
        return {"role": "assistant", "content": "y", **kw}

    tail = (
        "is not a token id of this verifier (vocab 10): were the answers generated by another one? "
        "Re-run 01_prepare_prompts.py with this verifier"
    )
    p = tmp_path / "prompts.jsonl"
    check_token_ids([rec(a(tokens=[0, 9], stop_token=9))], 10, p)
    for r, field, v in [
        (rec(a(tokens=[1, 12, 11], stop_token=10)), "messages[1].tokens[1]", 12),
        (rec(a(tokens=[1], stop_token=10), a(tokens=[30])), "messages[1].stop_token", 10),
        (rec(a(tokens=[1]), a(tokens=[2, 30])), "messages[2].tokens[1]", 30),
    ]:
        with pytest.raises(UserError) as e:
            check_token_ids([r], 10, p)
        assert str(e.value) == f"{p}:7: field '{field}' = {v} {tail}"


def test_every_conversation_skipped_is_refused_not_an_empty_finished_set(
    tmp_path, tiny_llama_dir, tiny_backend
):
    """Every conversation skipped (too long under ``too_long: skip``, or no assistant answer): 02 wrote an empty shard
    set with its ``data_config.json`` (complete), printed ``0 samples ... None tok/s`` and exited 0, and 03 then said
    ``no shards found``; it now stops with one line naming the prompts file, the reasons and what to change, and
    leaves no shard folder."""
    cfg = load_config(_config(tmp_path, tiny_llama_dir, max_length=8, too_long="skip"))
    _write_prompts(cfg.prompts_path, CONVS[2:4])
    with pytest.raises(UserError) as e:
        _run(cfg, tiny_backend)
    assert str(e.value) == (
        f"{cfg.prompts_path}: no sample to capture: every conversation was skipped (too long: 2; "
        "the first at line 1, conversation 'p2'); raise extract.max_length or set extract.too_long: "
        "truncate; nothing written"
    )
    assert not cfg.shards_dir.exists()
    _write_prompts(cfg.prompts_path, [("q", [("user", "Hi")])])
    with pytest.raises(
        UserError,
        match=r"every conversation was skipped \(no loss tokens: 1; the first at line 1, "
        r"conversation 'q'\); a conversation needs an assistant answer",
    ):
        _run(cfg, tiny_backend)
    assert not cfg.shards_dir.exists()


def test_summary_says_n_a_where_no_rate_was_measured(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """A torchrun rank dealt no batch (a small run on 2 ranks) printed ``rank 1: 0 samples in 0.001 s, None samples/s,
    None tok/s``, and a resume that captured nothing ``None tok/s``; such rates read ``n/a``, measured ones unchanged."""
    import importlib

    import eagle3.stages.extract as ex
    from eagle3.capture.report import markdown

    sys.path.insert(0, str(ROOT))
    cli = importlib.import_module("02_extract_hidden")
    summary = {
        "samples": 6,
        "written": 6,
        "resumed": 0,
        "num_tokens": 725,
        "captured_tokens_per_s": 388.5,
        "shards_dir": "out/shards",
        "world_size": 2,
        "capture_s": 1.866,
        "samples_per_s": 3.22,
        "ranks": [
            {
                "rank": 0,
                "written": 6,
                "capture_s": 1.866,
                "samples_per_s": 3.22,
                "tokens_per_s": 388.5,
            },
            {
                "rank": 1,
                "written": 0,
                "capture_s": 0.001,
                "samples_per_s": None,
                "tokens_per_s": None,
            },
        ],
    }
    monkeypatch.setattr(ex, "run", lambda cfg, **kw: summary)
    assert cli.main(["--config", str(_config(tmp_path, tiny_llama_dir))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "rank 0: 6 samples in 1.866 s, 3.22 samples/s, 388.5 tok/s",
        "rank 1: 0 samples in 0.001 s, n/a samples/s, n/a tok/s",
    ]
    summary.update(written=0, resumed=6, captured_tokens_per_s=None)
    del summary["ranks"]
    assert cli.main(["--config", str(_config(tmp_path, tiny_llama_dir))]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "6 samples (0 written, 6 resumed), 725 tokens, n/a tok/s -> out/shards"
    )
    assert "| captured_tokens_per_s | n/a |" in markdown(
        {
            **{
                k: 0
                for k in (
                    "prompts",
                    "samples",
                    "split_conversations",
                    "split_samples",
                    "written",
                    "resumed",
                    "num_tokens",
                    "num_loss_tokens",
                    "truncated",
                    "capture_s",
                    "total_s",
                    "disk_gb",
                )
            },
            "captured_tokens_per_s": None,
            "skipped": {},
        }
    )


def test_a_shards_folder_without_a_weights_fingerprint_is_said_on_resume_and_up_to_date(
    tmp_path, tiny_llama_dir, caplog
):
    """02 compares the verifier weights a shards folder records with those at verifier.path; a folder of a 02 from
    before the fingerprint (none in extract_state.json nor data_config.json) was found up to date, or resumed into,
    without a word that the weights were not compared. One warning line now says so, each time."""
    import shutil

    vdir = tmp_path / "verifier"
    shutil.copytree(tiny_llama_dir, vdir)
    cfg = load_config(_config(tmp_path, vdir))
    run(cfg, limit=3)
    root = cfg.shards_dir
    for name in (STATE, "data_config.json"):  # an old folder: no fingerprint anywhere
        rec = json.loads((root / name).read_text())
        del rec["verifier_weights"]
        (root / name).write_text(json.dumps(rec))
    want = (
        f"{root / STATE}: records no verifier_weights (shards extracted by a 02 of before 2026-12-05f): 02 did not "
        f"check the weights at verifier.path against the model the shards in {root} were captured from; check "
        f"that it is, or re-run with --overwrite to capture every shard from this one (a set from two models "
        f"trains against one's lm_head)"
    )
    with caplog.at_level("WARNING", logger="eagle3.stages.extract"):
        assert run(cfg, limit=3)["up_to_date"]
    assert [m for m in caplog.messages if "verifier_weights" in m] == [want]
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle3.stages.extract"):
        s = run(cfg)  # more prompts: a resume
    assert (s["written"], s["resumed"]) == (3, 3)
    assert [m for m in caplog.messages if "verifier_weights" in m] == [want]
