"""What the export engine can serve is decided at 04's start (eagle3.stages.export.check_export_serves), before any
training step or write: a draft context below the verifier's (SGLang refuses to start it, vLLM caps it: issue 26
item 4, issue 51), a variant or MLA sizes the engine cannot build. The export writes what was decided."""

from __future__ import annotations

import hashlib
import importlib.util
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

SHORT = (
    "drafter.max_position_embeddings: 64 gives the draft a context length of 64 tokens, below the verifier's "
    "2048: SGLang 0.5.23 refuses to start such a draft"
)


def _train04():
    """``04_train.py`` as a module (its ``main(argv)`` raises the UserError that the command prints)."""
    spec = importlib.util.spec_from_file_location(
        "train04", Path(__file__).resolve().parents[2] / "04_train.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tree(root: Path) -> dict:
    """Every file under ``root``: relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _verifier(root: Path, **over) -> Path:
    """A verifier folder holding only a config (04 reads nothing else of it here): the tiny run's shape."""
    from transformers import LlamaConfig

    kw = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=48,
        max_position_embeddings=2048,
    )
    LlamaConfig(**{**kw, **over}).save_pretrained(root)
    return root


def test_04_refuses_a_short_sglang_draft_at_its_start_and_writes_nothing(tmp_path):
    vdir = _verifier(tmp_path / "verifier")
    path = make_tiny_run(tmp_path / "run", train={"epochs": 1, "max_steps": 2, "ckpt_every": 2})
    cfg = load_config(path, [f"verifier.path={vdir}"])
    before = _tree(tmp_path)
    for extra in ([], ["--export-only"]):
        with pytest.raises(UserError) as e:
            _train04().main(["--config", str(path), "--set", f"verifier.path={vdir}", *extra])
        msg = str(e.value)
        assert msg.startswith(SHORT) and "\n" not in msg, msg
        assert msg.endswith(
            "set drafter.max_position_embeddings: null (the verifier's) or >= 2048 (the weights do not depend "
            "on it, rotary angles are computed)"
        ), msg
        assert _tree(tmp_path) == before  # no step, no checkpoint, no report, no export
    assert not cfg.export_dir.exists() and not (cfg.train_dir / "checkpoints").exists()


def test_vllm_short_draft_warned_at_start_then_sglang_export_only_after_the_fix(tmp_path, caplog):
    """vLLM: one warning line at 04's start (also in train_report.json), the folder written with the configured
    context. --export-only for SGLang is refused before it reads a checkpoint; with the fix (null = the verifier's)
    it exports a folder SGLang 0.5.23's own check starts."""
    vdir = _verifier(tmp_path / "verifier")
    path = make_tiny_run(tmp_path / "run", train={"epochs": 1, "max_steps": 2, "ckpt_every": 2})
    sets = ["--config", str(path), "--set", f"verifier.path={vdir}"]
    with caplog.at_level(logging.WARNING):
        assert _train04().main([*sets, "--engine", "vllm"]) == 0
    cfg = load_config(path, [f"verifier.path={vdir}", "export.engine=vllm"])
    warned = [
        r.getMessage() for r in caplog.records if "vLLM caps the draft at 64" in r.getMessage()
    ]
    assert len(warned) == 1 and warned[0].startswith(
        "drafter.max_position_embeddings: 64 gives the draft a context length of 64 tokens"
    )
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert warned[0] in rep["warnings"]
    vl = json.loads((cfg.export_dir / "config.json").read_text())
    assert vl["transformer_layer_config"]["max_position_embeddings"] == 64
    before = _tree(tmp_path)
    with pytest.raises(UserError, match=f"^{SHORT}"):
        _train04().main([*sets, "--export-only", "--engine", "sglang"])
    assert _tree(tmp_path) == before
    fixed = [*sets, "--set", "drafter.max_position_embeddings=null"]
    assert _train04().main([*fixed, "--export-only", "--engine", "sglang"]) == 0
    out = load_config(path, [f"verifier.path={vdir}"]).export_dir
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 2048
    assert _sglang_starts(out, {"max_position_embeddings": 2048, "rope_scaling": None})


@pytest.mark.parametrize(
    "verifier,drafter,expected",
    [
        ({}, {}, 64),  # every drafter field set: the verifier is not read, default rope
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {}, 64),  # ... even a scaled one
        ({}, {"max_position_embeddings": None}, 2048),  # null = the verifier's
        (
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            {"rope_theta": None},
            128,
        ),  # a field read from the verifier: its linear scaling is copied (64 x 2)
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            {"max_position_embeddings": None},
            2048,
        ),  # not copied: default rope
    ],
)
def test_planned_context_is_the_context_of_the_drafter_04_builds(
    tmp_path, verifier, drafter, expected
):
    """check_export_serves judges (max_position_embeddings, rope_scaling) of the DrafterArgs the training builds
    (eagle3.train.inputs.build_drafter_args), before the shards or the vocab map are read."""
    from eagle3.drafter.draft_config import DEFAULT_EXPORT_DTYPE, llama_config
    from eagle3.engines.context import draft_context_length
    from eagle3.shards.data_config import read_data_config
    from eagle3.stages.export import _verifier_text_config, planned_context
    from eagle3.train.inputs import build_drafter_args
    from eagle3.verifier.load import serving_context_length

    vdir = _verifier(tmp_path / "verifier", **verifier)
    sets = [f"verifier.path={vdir}"] + [
        f"drafter.{k}={'null' if v is None else v}" for k, v in drafter.items()
    ]
    cfg = load_config(make_tiny_run(tmp_path / "run"), sets)
    vocab = {"draft_vocab_size": 24, "target_vocab_size": 48}
    args = build_drafter_args(cfg, read_data_config(cfg.shards_dir), vocab)
    built = serving_context_length(llama_config(args, DEFAULT_EXPORT_DTYPE))
    mpe, rope = planned_context(cfg.drafter, _verifier_text_config(cfg.verifier))
    assert (mpe, rope) == (args.max_position_embeddings, args.rope_scaling)
    assert draft_context_length(mpe, rope) == built == expected


def test_unreadable_verifier_config_checks_nothing(tmp_path):
    from eagle3.stages.export import check_export_serves

    cfg = load_config(make_tiny_run(tmp_path / "run"))  # verifier folder does not exist
    assert check_export_serves(cfg) is None


def test_a_variant_the_engine_cannot_serve_is_refused_at_the_start(tmp_path, monkeypatch):
    """An engine version without the variant (as vLLM before 0.33 for EAGLE 3.1): refused before any step."""
    import eagle3.export.formats as formats

    monkeypatch.setitem(
        formats.VARIANT_ENGINES, "eagle3.1", {"sglang": "SGLang 0.5.23 llama_eagle3.py"}
    )
    path = make_tiny_run(tmp_path / "run")
    before = _tree(tmp_path)
    with pytest.raises(UserError) as e:
        _train04().main(
            ["--config", str(path), "--engine", "vllm", "--set", "drafter.variant=eagle3.1"]
        )
    assert str(e.value) == (
        "export.engine: vllm cannot serve an eagle3.1 drafter (its EAGLE-3 model code has no eagle3.1 layers); "
        "export for sglang, or train with drafter.variant: eagle3"
    )
    assert _tree(tmp_path) == before


def _deepseek_verifier(root: Path, **over) -> Path:
    """An MLA verifier config (DeepSeek-V3 shape, tiny); ``q_lora_rank=None`` = DeepSeek-V2-Lite's plain q_proj."""
    from transformers import DeepseekV3Config

    kw = dict(
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        vocab_size=48,
        max_position_embeddings=64,
    )
    DeepseekV3Config(**{**kw, **over}).save_pretrained(root)
    return root


@pytest.mark.parametrize(
    "verifier,sets,engine,message",
    [
        (
            {"q_lora_rank": None},
            [],
            "sglang",
            r"^export.engine: sglang cannot serve this MLA drafter: its kimi_k25_eagle3.py needs q_lora_rank "
            r"\(a q_a_proj\); set drafter.mla.q_lora_rank$",
        ),  # the verifier's sizes, known before training
        (
            {"rope_interleave": False},
            [],
            "vllm",
            r"^export.engine: vllm cannot serve this MLA drafter: .*set drafter.mla.rope_interleave: true$",
        ),
        (
            None,
            [],
            "sglang",
            r"^drafter.mla.kv_lora_rank is null and the verifier is not an MLA model; set drafter.mla.kv_lora_rank",
        ),  # a Llama verifier has no latent sizes to copy
        (
            "unreadable",
            ["drafter.mla.rope_interleave=false"],
            "vllm",
            r"^export.engine: vllm cannot serve this MLA drafter: .*rope_interleave: true$",
        ),  # what the config fixes is judged without the verifier
    ],
)
def test_mla_sizes_the_engine_cannot_build_are_refused_at_the_start(
    tmp_path, verifier, sets, engine, message
):
    path = make_tiny_run(tmp_path / "run")
    if verifier == "unreadable":
        vdir = tmp_path / "missing"
    elif verifier is None:
        vdir = _verifier(tmp_path / "verifier")
    else:
        vdir = _deepseek_verifier(tmp_path / "verifier", **verifier)
    before = _tree(tmp_path)
    argv = ["--config", str(path), "--engine", engine, "--set", "drafter.attention=mla"]
    for s in [f"verifier.path={vdir}", *sets]:
        argv += ["--set", s]
    with pytest.raises(UserError, match=message) as e:
        _train04().main(argv)
    assert "\n" not in str(e.value)
    assert _tree(tmp_path) == before


def test_mla_sizes_the_engine_builds_pass_and_unknown_ones_wait(tmp_path):
    """The other engine builds the same sizes; with the verifier unreadable nothing null is judged."""
    from eagle3.stages.export import check_export_serves

    path = make_tiny_run(tmp_path / "run")
    vdir = _deepseek_verifier(tmp_path / "verifier", rope_interleave=False)
    ok = load_config(
        path, [f"verifier.path={vdir}", "drafter.attention=mla", "export.engine=sglang"]
    )
    assert check_export_serves(ok) is None
    unknown = load_config(
        path,
        [f"verifier.path={tmp_path / 'missing'}", "drafter.attention=mla", "export.engine=vllm"],
    )
    assert check_export_serves(unknown) is None


def test_a_refused_export_after_training_still_writes_the_report(tmp_path, monkeypatch):
    """An export refused after training (here: a folder of other files put at export.output_dir while it trained)
    still leaves train_report.md/json saying the export was refused, why, and that --export-only exports the kept
    checkpoint after the fix; 04 exits 2 with one line that names the report; --export-only then exports."""
    import eagle3.stages.train as stage
    from eagle3.stages.export import export_for_run, export_from_checkpoint

    path = make_tiny_run(tmp_path / "run", train={"epochs": 1, "max_steps": 2, "ckpt_every": 2})
    cfg = load_config(path)

    def export_after_a_foreign_folder(cfg, *a, **k):
        cfg.export_dir.mkdir(parents=True)
        (cfg.export_dir / "notes.txt").write_text("not an export")
        return export_for_run(cfg, *a, **k)

    monkeypatch.setattr(stage, "export_for_run", export_after_a_foreign_folder)
    with pytest.raises(UserError) as e:
        _train04().main(["--config", str(path)])
    msg = str(e.value)
    why = f"{cfg.export_dir}: export.output_dir holds files that are not an eagle3-train export"
    assert e.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith(why), msg
    assert msg.endswith(
        f"[training finished: checkpoint {cfg.train_dir / 'checkpoints' / 'step_00000002.pt'} kept, "
        f"report {cfg.train_dir / 'train_report.md'}; after the fix, 04_train.py --export-only "
        f"exports it without retraining]"
    ), msg
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert rep["step"] == 2 and rep["export_dir"] is None and rep["final_val"]["loss"] > 0
    assert rep["export_error"].startswith(why)
    md = (cfg.train_dir / "train_report.md").read_text()
    assert f"- export: **refused**: {why}" in md
    assert "after the fix, `04_train.py --export-only` exports it without retraining" in md
    (cfg.export_dir / "notes.txt").unlink()
    out = export_from_checkpoint(cfg)
    rep = json.loads((cfg.train_dir / "train_report.json").read_text())
    assert (
        rep["export_dir"] == str(out)
        and "export_error" not in rep
        and rep["export_only"]["weights_step"] == 2
    )
    assert f"- export: `{out}`" in (cfg.train_dir / "train_report.md").read_text()
