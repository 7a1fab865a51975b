"""Issue 26 item 6: NaN/Inf in captured states is one ``error:`` line (exit 2) naming the sample and its
conversation id, the state (HF hidden_states index / last), the verifier dtype and the fix, at every
place that checks: 02's start-up probe, 02's shard writer (after the device-side flag), 03's validation."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
AUX = [1, 3, 4]
CONVS = [
    ("p0", "Say hi.", "Hi there."),
    ("p1", "Name a zebra fact.", "Zebras have stripes."),
    ("p2", "Count to three.", "One, two, three."),
]


def _main02():
    spec = importlib.util.spec_from_file_location("extract_cli", ROOT / "02_extract_hidden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _setup(tmp_path: Path, tok, poison) -> Path:
    """A tiny float16-served verifier; ``poison(model, tok)`` makes it overflow in float16 only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        poison(model, tok)
    vdir = tmp_path / "verifier"
    model.save_pretrained(vdir)  # float32 on disk: finite; float16 when served
    tok.save_pretrained(vdir)
    out = tmp_path / "out"
    out.mkdir(parents=True)
    with open(out / "prompts.jsonl", "w") as f:
        for pid, u, a in CONVS:
            f.write(
                json.dumps(
                    {
                        "id": pid,
                        "messages": [
                            {"role": "user", "content": u},
                            {"role": "assistant", "content": a},
                        ],
                    }
                )
                + "\n"
            )
    run = {
        "run_name": "t",
        "output_root": str(out),
        "prompts": {"source": "humaneval"},
        "verifier": {"path": str(vdir), "name": "tiny", "dtype": "float16", "device": "cpu"},
        "extract": {
            "aux_layers": AUX,
            "max_length": 64,
            "batch_tokens": 64,
            "rows_per_dir": 2,
            "write_threads": 0,
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    return tmp_path / "run.yaml"


def _exit2(main, argv, capsys) -> str:
    from eagle3.cli import run_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    err = capsys.readouterr().err
    lines = [
        x for x in err.splitlines() if x.startswith("error: ")
    ]  # (progress bars also write to stderr)
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_probe_overflow_names_the_layer_and_dtype_not_the_norm(tmp_path, smollm_tokenizer, capsys):
    def poison(
        model, tok
    ):  # layer 1's MLP weights beyond float16's range (65504): every token overflows
        model.model.layers[1].mlp.down_proj.weight.mul_(1e7)

    cfg = _setup(tmp_path, smollm_tokenizer, poison)
    line = _exit2(_main02(), ["--config", str(cfg)], capsys)
    assert (
        "verifier probe forward" in line
        and "HF hidden_states[2] has NaN/Inf with verifier.dtype float16" in line
    )
    assert (
        "run it in bfloat16 or float32 (verifier.dtype)" in line and "post- or pre-norm" not in line
    )
    assert not list((tmp_path / "out" / "shards").glob("rows_*/*.pt"))


def test_sample_overflow_names_sample_conversation_layer_dtype(tmp_path, smollm_tokenizer, capsys):
    tok = smollm_tokenizer
    V = len(tok)
    probe = {i * 7919 % V for i in range(8)}
    ids = {
        pid: set(
            tok.apply_chat_template(
                [{"role": "user", "content": u}, {"role": "assistant", "content": a}],
                tokenize=True,
                return_dict=False,
            )
        )
        for pid, u, a in CONVS
    }
    only_p1 = sorted(ids["p1"] - ids["p0"] - ids["p2"] - probe)
    T = only_p1[0]

    def poison(
        model, tok
    ):  # one token's embedding beyond float16's range: only conversation p1 overflows
        model.model.embed_tokens.weight[T] = 1e5

    cfg = _setup(tmp_path, tok, poison)
    line = _exit2(_main02(), ["--config", str(cfg)], capsys)
    assert line == (
        "error: sample 1 (conversation 'p1'): hidden_states[0] = HF hidden_states[1] has NaN/Inf with "
        "verifier.dtype float16; the verifier overflows in this dtype (float16 is the usual cause): run it "
        "in bfloat16 or float32 (verifier.dtype) and re-run"
    )
    shards = tmp_path / "out" / "shards"
    assert "data_1.pt" not in [p.name for p in shards.glob("rows_*/*.pt")]  # nothing bad written
    # the same verifier in bfloat16 captures every sample (the fix the line names)
    from eagle3.cli import run_main

    with pytest.raises(SystemExit) as e:
        run_main(
            _main02(), ["--config", str(cfg), "--set", "verifier.dtype=bfloat16", "--overwrite"]
        )
    assert e.value.code in (0, None)
    assert sorted(p.name for p in shards.glob("rows_*/*.pt")) == [
        "data_0.pt",
        "data_1.pt",
        "data_2.pt",
    ]
    assert json.loads((shards / "data_config.json").read_text())["verifier_dtype"] == "bfloat16"


def test_03_names_the_hf_layer_and_capture_dtype(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "data"))
    from test_prepare_data import _cfg, _make_shards

    from eagle3.config import load_config
    from eagle3.errors import UserError
    from eagle3.stages.prepare_data import run

    cfg = load_config(_cfg(tmp_path))
    _make_shards(cfg.shards_dir, verifier_dtype="float16")
    bad = cfg.shards_dir / "rows_2-4" / "data_3.pt"
    d = torch.load(bad, weights_only=True)
    d["hidden_states"][1][0, 0] = float("inf")
    torch.save(d, bad)
    with pytest.raises(
        UserError,
        match=r"data_3.pt: key 'hidden_states\[1\]': contains NaN/Inf \(HF hidden_states\[3\] "
        r"of the verifier, captured in float16\): the verifier overflows .* bfloat16 or float32",
    ):
        run(cfg)
