"""Export for SGLang and vLLM: exact key sets and config fields, engine layer ids, reload with
identical logits, strict errors, atomic replacement."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.export.common import META_FILE
from eagle3.export.reader import load_exported
from eagle3.export.sglang import KEYS as SGLANG_KEYS
from eagle3.export.vllm import KEYS as VLLM_KEYS
from eagle3.export.writer import export_drafter
from eagle3.io import read_json

LLAMA30 = dict(
    name="tiny/llama-30",
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=24,
    vocab_size=50,
)
DSV3_61 = dict(
    name="tiny/kimi-like",
    architecture="DeepseekV3ForCausalLM",
    num_layers=61,
    hidden_size=24,
    vocab_size=50,
)

LAYER = [
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
]
HEAD = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]


def drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=512,
        draft_vocab_size=16,
        target_vocab_size=50,
        target_hidden_size=24,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    d = Eagle3Drafter(a)
    ids = torch.tensor(sorted(torch.randperm(50)[:16].tolist()))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(16), t2d)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def logits_of(d: Eagle3Drafter, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    aux = torch.randn(2, 9, 72, generator=g)
    with torch.no_grad():
        return [d.compute_logits(h) for h in d.ttt_forward(ids, aux, 3)]


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("with_embed", [False, True])
def test_round_trip_bf16_export_equals_drafter_cast_to_bf16(tmp_path, engine, with_embed):
    """Default export is bfloat16: the reloaded drafter computes what the drafter cast to bf16 computes."""
    d = drafter()
    out = export_drafter(
        d, tmp_path / "x", engine, [2, 15, 27], LLAMA30, include_embeddings=with_embed
    )
    d2 = load_exported(out, embed_weight=None if with_embed else d.embed_tokens.weight)
    assert d2.args == d.args
    assert torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)
    ref = copy.deepcopy(d).to(torch.bfloat16)
    for a, b in zip(logits_of(ref), logits_of(d2.to(torch.bfloat16))):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_round_trip_float32_when_asked(tmp_path, engine):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg if engine == "sglang" else cfg["transformer_layer_config"]
    assert cfg["torch_dtype"] == layer["torch_dtype"] == layer["dtype"] == "float32"
    d2 = load_exported(out, embed_weight=d.embed_tokens.weight)
    for a, b in zip(logits_of(d), logits_of(d2)):
        assert torch.equal(a, b)


def test_sglang_key_set_and_config_fields(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "sg", "sglang", [2, 15, 27], LLAMA30)
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == {f"midlayer.{k}" for k in LAYER} | set(HEAD) == set(SGLANG_KEYS)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"
    assert (
        cfg["draft_vocab_size"] == 16
        and cfg["vocab_size"] == 50
        and cfg["target_hidden_size"] == 24
    )
    assert (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    ) == (24, 4, 2, 6)
    assert (cfg["intermediate_size"], cfg["rms_norm_eps"], cfg["rope_theta"]) == (40, 1e-5, 50000.0)
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 14, 26],
        "use_aux_hidden_state": True,
    }
    meta = read_json(out / META_FILE)
    assert meta["aux_layers_hf"] == [2, 15, 27] and meta["engine_layer_ids"] == [1, 14, 26]
    assert meta["engine"] == "sglang" and meta["verifier"] == LLAMA30


def test_vllm_key_set_and_config_fields(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "vl", "vllm", [2, 15, 27], LLAMA30, num_speculative_tokens=4)
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == {f"layers.0.{k}" for k in LAYER} | set(HEAD) == set(VLLM_KEYS)
    assert torch.equal(
        sd["layers.0.hidden_norm.weight"], d.midlayer.hidden_norm.weight.detach().bfloat16()
    )
    cfg = json.loads((out / "config.json").read_text())
    assert (
        cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    )
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == 16 and cfg["target_hidden_size"] == 24
    tl = cfg["transformer_layer_config"]
    assert (
        tl["model_type"] == "llama"
        and tl["num_hidden_layers"] == 1
        and tl["vocab_size"] == 50
        and tl["hidden_size"] == 24
    )
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 4
    assert sc["verifier"] == {
        "name_or_path": "tiny/llama-30",
        "architectures": ["LlamaForCausalLM"],
    }
    assert read_json(out / META_FILE)["engine_layer_ids"] == [2, 15, 27]


def test_deepseek_61_layer_ids(tmp_path):
    d = drafter()
    sg = export_drafter(d, tmp_path / "sg", "sglang", [2, 30, 58], DSV3_61)
    assert json.loads((sg / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 30, 58]
    vl = export_drafter(d, tmp_path / "vl", "vllm", [2, 30, 58], DSV3_61)
    assert json.loads((vl / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        2,
        30,
        58,
    ]
    assert read_json(sg / META_FILE)["verifier"]["architecture"] == "DeepseekV3ForCausalLM"


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "engine,key",
    [
        ("sglang", "midlayer.hidden_norm.weight"),
        ("vllm", "layers.0.mlp.up_proj.weight"),
        ("sglang", "d2t"),
    ],
)
def test_missing_tensor_on_load_names_key_and_file(tmp_path, engine, key):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30)
    sd = load_file(str(out / "model.safetensors"))
    del sd[key]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=rf"model\.safetensors: missing required tensor '{key}'"):
        load_exported(out, embed_weight=d.embed_tokens.weight)


def test_unexpected_tensor_and_bad_config_on_load(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    sd = load_file(str(out / "model.safetensors"))
    sd["midlayer.self_attn.q_proj.bias"] = torch.zeros(24)
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(UserError, match="unexpected tensor 'midlayer.self_attn.q_proj.bias'"):
        load_exported(out, embed_weight=d.embed_tokens.weight)
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    with pytest.raises(UserError, match="embed_weight"):
        load_exported(out)
    cfg = json.loads((out / "config.json").read_text())
    del cfg["intermediate_size"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UserError, match=r"config\.json: field 'intermediate_size' is missing; re-export"
    ):
        load_exported(out, embed_weight=d.embed_tokens.weight)


def test_vllm_norm_before_residual_true_is_refused(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", "vllm", [2, 15, 27], LLAMA30)
    cfg = json.loads((out / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="norm_before_residual"):
        load_exported(out, embed_weight=d.embed_tokens.weight)


def test_export_refuses_missing_key_and_bad_inputs_writing_nothing(tmp_path):
    d = drafter()
    del d.midlayer.hidden_norm  # a drafter without a required parameter
    with pytest.raises(UserError, match="missing required tensor 'midlayer.hidden_norm.weight'"):
        export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    d = drafter()
    with pytest.raises(UserError, match="aux_layers_hf"):
        export_drafter(d, tmp_path / "x", "sglang", [2, 15, 30], LLAMA30)
    with pytest.raises(UserError, match="hidden_size"):
        export_drafter(d, tmp_path / "x", "vllm", [2, 15, 27], {**LLAMA30, "hidden_size": 32})
    with pytest.raises(UserError, match="engine"):
        export_drafter(d, tmp_path / "x", "trt", [2, 15, 27], LLAMA30)
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_existing_folder_atomically(tmp_path):
    d1, d2 = drafter(0), drafter(5)
    out = export_drafter(d1, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    (out / "stale.txt").write_text("old")
    export_drafter(d2, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", META_FILE]
    )
    re = load_exported(out, embed_weight=d2.embed_tokens.weight)
    assert torch.equal(re.fc.weight, d2.fc.weight.detach().bfloat16().float())


@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_permissions_follow_the_umask(tmp_path, umask, dir_mode, file_mode):
    """The folder and files get what mkdir()/open() give under the umask, not mkdtemp/mkstemp's owner-only modes:
    an engine serving as another user must read the export (fresh-user trial: drwx------ under umask 022)."""
    old = os.umask(umask)
    try:
        out = export_drafter(drafter(0), tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == dir_mode
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        n: file_mode for n in ("config.json", "model.safetensors", META_FILE)
    }


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_default_export_is_bf16_and_recorded(tmp_path, engine):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30)
    sd = load_file(str(out / "model.safetensors"))
    floats = {k: v.dtype for k, v in sd.items() if v.is_floating_point()}
    assert (
        set(floats.values()) == {torch.bfloat16}
        and sd["d2t"].dtype == torch.int64
        and sd["t2d"].dtype == torch.bool
    )
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg if engine == "sglang" else cfg["transformer_layer_config"]
    assert cfg["torch_dtype"] == layer["torch_dtype"] == layer["dtype"] == "bfloat16"
    assert read_json(out / META_FILE)["dtype"] == "bfloat16"
    fp32 = export_drafter(d, tmp_path / "y", engine, [2, 15, 27], LLAMA30, dtype=torch.float32)
    weights = sum(v.numel() for v in sd.values() if v.is_floating_point())
    size_bf16, size_fp32 = (
        (out / "model.safetensors").stat().st_size,
        (fp32 / "model.safetensors").stat().st_size,
    )
    assert (
        abs((size_fp32 - size_bf16) - 2 * weights) < 1024
    )  # 2 bytes less per weight (headers differ slightly)
    with pytest.raises(UserError, match="export.dtype"):
        export_drafter(d, tmp_path / "z", engine, [2, 15, 27], LLAMA30, dtype="float8")


def test_export_dtype_auto_follows_verifier():
    from eagle3.export.common import export_dtype

    assert export_dtype("auto", "bfloat16") == torch.bfloat16
    assert export_dtype("auto", "float16") == torch.float16
    assert export_dtype("float32", "bfloat16") == torch.float32
    assert export_dtype(torch.float16) == torch.float16
    for bad in ("int8", torch.float64):
        with pytest.raises(
            UserError, match=r"export.dtype: unknown dtype .* \(expected auto, bfloat16"
        ):
            export_dtype(bad)


def test_export_dtype_auto_is_bf16_for_a_float32_verifier(tmp_path, caplog):
    """Issue 26 item 5: verifier.dtype float32 (exactness) + export.dtype auto served as fp16 by SGLang's
    --dtype auto. auto is the serving dtype: bfloat16; an explicit float32 is kept, with a warning for SGLang."""
    import logging

    from eagle3.export.common import export_dtype

    assert export_dtype("auto", "float32") == torch.bfloat16
    d = drafter()
    out = export_drafter(
        d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30, dtype=export_dtype("auto", "float32")
    )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with caplog.at_level(logging.WARNING, logger="eagle3.export.sglang"):
        out = export_drafter(
            d,
            tmp_path / "y",
            "sglang",
            [2, 15, 27],
            LLAMA30,
            dtype=export_dtype("float32", "float32"),
        )
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert any("serves a float32 draft config as float16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3.export"):
        export_drafter(d, tmp_path / "z", "vllm", [2, 15, 27], LLAMA30, dtype="float32")
    assert not caplog.records  # vLLM casts the draft to the verifier's dtype


def test_sglang_config_parses_with_transformers_autoconfig(tmp_path):
    """SGLang reads the draft config through transformers' AutoConfig (model_type llama)."""
    from transformers import AutoConfig

    out = export_drafter(drafter(), tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    cfg = AutoConfig.from_pretrained(out)
    assert type(cfg).__name__ == "LlamaConfig"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (
        24,
        1,
        6,
        2,
    )
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.vocab_size) == (16, 24, 50)
    assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    # SGLang's _get_and_verify_dtype reads config.dtype (then torch_dtype); float32 there -> float16 under --dtype auto
    assert getattr(cfg, "dtype", None) in (torch.bfloat16, "bfloat16")
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_theta": cfg.rope_theta,
        **(cfg.rope_scaling or {}),
    }
    assert rope["rope_theta"] == 50000.0 and rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_recorded_block_is_validated_once(tmp_path):
    """The eagle3_train block of config.json: engine one of the engines, aux_layers_hf three integers."""
    from eagle3.export.reader import _recorded_block

    good = {"engine": "vllm", "aux_layers_hf": [2, 15, 27]}
    assert _recorded_block({"eagle3_train": good}, tmp_path) == {
        **good,
        "source": str(tmp_path / "config.json"),
    }
    with pytest.raises(
        UserError,
        match=r"config.json \(eagle3_train\): field 'engine' should be 'sglang' or 'vllm', "
        r"got 'trtllm'; re-export with 04_train.py --export-only",
    ):
        _recorded_block({"eagle3_train": {**good, "engine": "trtllm"}}, tmp_path)
    with pytest.raises(
        UserError, match=r"field 'aux_layers_hf' should hold at least 3 item\(s\), got \[2, 15\]"
    ):
        _recorded_block({"eagle3_train": {**good, "aux_layers_hf": [2, 15]}}, tmp_path)
    with pytest.raises(UserError, match=r"field 'aux_layers_hf\[1\]' should be a valid integer"):
        _recorded_block({"eagle3_train": {**good, "aux_layers_hf": [2, "15", 27]}}, tmp_path)
    with pytest.raises(UserError, match=r"the record should be a JSON object, got list"):
        _recorded_block({"eagle3_train": [2, 15, 27]}, tmp_path)


def test_load_refuses_a_tensor_the_config_does_not_imply_and_a_missing_embedding(tmp_path):
    d = drafter()
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    with pytest.raises(UserError) as e:
        load_exported(out, embed_weight=torch.zeros(50, 12))
    assert str(e.value) == (
        f"{out / 'model.safetensors'}: no 'embed_tokens.weight' stored and embed_weight is of shape [50, 12]; "
        f"pass the verifier's embedding of shape [50, 24] (config.json implies it)"
    )
    cfg = json.loads((out / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        load_exported(out, embed_weight=d.embed_tokens.weight)
    assert str(e.value) == (
        f"{out / 'model.safetensors'}: tensor 'midlayer.mlp.down_proj.weight' has shape [24, 40], config "
        f"implies [24, 48]"
    )
