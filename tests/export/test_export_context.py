"""Issue 26 item 4: a drafter whose context (max_position_embeddings) is below the verifier's is warned
about at the start of 04, refused by the SGLang export (SGLang 0.5.23 would not start it) and fixed by
re-exporting with drafter.max_position_embeddings: null (the weights do not depend on it)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ddp_worker import make_tiny_run  # noqa: E402
from test_export_contract import _sglang_starts  # noqa: E402

from eagle3.config import load_config  # noqa: E402
from eagle3.errors import UserError  # noqa: E402


def test_04_warns_sglang_export_refused_and_export_only_with_null_fixes_it(tmp_path, caplog):
    from transformers import LlamaConfig

    from eagle3.stages.export import export_for_run, export_from_checkpoint
    from eagle3.stages.train import run

    vdir = (
        tmp_path / "verifier"
    )  # config only: the context length is all 04/export read from it here
    LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=48,
        max_position_embeddings=2048,
    ).save_pretrained(vdir)
    path = make_tiny_run(
        tmp_path / "run", train={"epochs": 1, "max_steps": 2, "ckpt_every": 2}
    )  # drafter: 64 positions
    cfg = load_config(path, [f"verifier.path={vdir}"])
    with caplog.at_level(logging.WARNING):
        with pytest.raises(
            UserError,
            match=r"drafter.max_position_embeddings: 64 gives the draft a context length of 64 "
            r"tokens, below the verifier's 2048: SGLang 0.5.23 refuses .*>= 2048",
        ):
            run(cfg, device="cpu", export=export_for_run)
    start = [r.getMessage() for r in caplog.records if r.name == "eagle3.train.inputs"]
    assert any(
        "drafter.max_position_embeddings: 64" in m and "SGLang export will be refused" in m
        for m in start
    )
    assert not cfg.export_dir.exists()
    # --export-only for SGLang with the same short context: the text once, as the error (no WARNING first)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        with pytest.raises(
            UserError, match=r"drafter.max_position_embeddings: 64 gives the draft a context length"
        ):
            export_from_checkpoint(load_config(path, [f"verifier.path={vdir}"]))
    assert not [
        r for r in caplog.records if "drafter.max_position_embeddings: 64" in r.getMessage()
    ]
    out = export_from_checkpoint(
        load_config(path, [f"verifier.path={vdir}", "drafter.max_position_embeddings=null"])
    )
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 2048
    rep = json.loads(
        (cfg.train_dir / "train_report.json").read_text()
    )  # the report now says it was exported
    assert (
        rep["export_dir"] == str(out)
        and "export_error" not in rep
        and rep["export_only"]["weights_step"] == 2
    )
    assert f"- export: `{out}`" in (cfg.train_dir / "train_report.md").read_text()
    assert _sglang_starts(out, {"max_position_embeddings": 2048, "rope_scaling": None})
    vl = export_from_checkpoint(
        load_config(path, [f"verifier.path={vdir}"]), engine="vllm"
    )  # vLLM: written, warned
    assert (
        json.loads((vl / "config.json").read_text())["transformer_layer_config"][
            "max_position_embeddings"
        ]
        == 64
    )


def test_unreadable_verifier_config_checks_nothing(tmp_path):
    from eagle3.verifier.load import verifier_context_length

    cfg = load_config(make_tiny_run(tmp_path / "run"))  # verifier folder does not exist
    assert verifier_context_length(cfg.verifier) is None


def test_a_refused_export_after_training_still_writes_the_report(tmp_path):
    """The SGLang export refusing after training (drafter.max_position_embeddings below the verifier's: kept as a
    refusal) left no train_report.md/json: the finished run's validation, steps and the reason were only in the log.
    The report is now written, saying the export was refused, why, and that --export-only exports the kept
    checkpoint after the fix; 04 still exits 2 with one line that names the report; --export-only with the fix then
    exports."""
    import importlib.util

    from transformers import LlamaConfig

    from eagle3.stages.export import export_from_checkpoint

    vdir = tmp_path / "verifier"
    LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=48,
        max_position_embeddings=2048,
    ).save_pretrained(vdir)
    path = make_tiny_run(tmp_path / "run", train={"epochs": 1, "max_steps": 2, "ckpt_every": 2})
    cfg = load_config(path, [f"verifier.path={vdir}"])
    spec = importlib.util.spec_from_file_location(
        "train04", Path(__file__).resolve().parents[2] / "04_train.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(UserError) as e:
        mod.main(["--config", str(path), "--set", f"verifier.path={vdir}"])
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith(
        "drafter.max_position_embeddings: 64 gives the draft a context length of 64 tokens"
    )
    assert msg.endswith(
        f"[training finished: checkpoint {cfg.train_dir / 'checkpoints' / 'step_00000002.pt'} kept, "
        f"report {cfg.train_dir / 'train_report.md'}; after the fix, 04_train.py --export-only "
        f"exports it without retraining]"
    ), msg
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert rep["step"] == 2 and rep["export_dir"] is None and rep["final_val"]["loss"] > 0
    assert rep["export_error"].startswith("drafter.max_position_embeddings: 64 gives the draft")
    md = (cfg.train_dir / "train_report.md").read_text()
    assert "- export: **refused**: drafter.max_position_embeddings: 64 gives the draft" in md
    assert "after the fix, `04_train.py --export-only` exports it without retraining" in md
    assert "final validation loss" in md and not cfg.export_dir.exists()
    out = export_from_checkpoint(
        load_config(path, [f"verifier.path={vdir}", "drafter.max_position_embeddings=null"])
    )
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 2048
    rep = json.loads(
        (cfg.train_dir / "train_report.json").read_text()
    )  # the report now says it was exported
    assert (
        rep["export_dir"] == str(out)
        and "export_error" not in rep
        and rep["export_only"]["weights_step"] == 2
    )
    assert f"- export: `{out}`" in (cfg.train_dir / "train_report.md").read_text()
