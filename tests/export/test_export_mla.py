"""MLA drafter exports (``drafter.attention: mla``): the Kimi-K2.5-size folder against each engine's MLA draft
loader (SGLang 0.5.23 ``models/kimi_k25_eagle3.py``, vLLM 0.34 ``models/deepseek_eagle3.py``, both
``Eagle3DeepseekV2ForCausalLM``), emulated name by name and shape by shape from the ``config.json`` we write (shapes
on the meta device: no weights); tiny round trips through our reader; the engines' refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3.drafter.args import MLA_FIELDS, DrafterArgs
from eagle3.drafter.mla import mla_drafter_fields
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.export.reader import _args_from_config, load_exported
from eagle3.export.writer import export_config, export_drafter, export_tensor_names

KIMI_TEXT = {  # Kimi-K2.5 text_config (FIELD-NOTES section 6): MLA sizes, YaRN
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 262144,
    "vocab_size": 163840,
}
KIMI_INFO = dict(
    name="moonshotai/Kimi-K2.5",
    architecture="KimiK25ForConditionalGeneration",
    num_layers=61,
    hidden_size=7168,
    vocab_size=163840,
)


def kimi_mla_args() -> DrafterArgs:
    """The MLA drafter 04 builds for Kimi-K2.5 with every ``drafter.mla`` size null (the verifier's)."""
    fields = mla_drafter_fields(dict.fromkeys(MLA_FIELDS), 64, KIMI_TEXT)
    return DrafterArgs.from_hf_config(KIMI_TEXT, 32000, target_hidden_size=7168, **fields)


def _meta_shapes(a: DrafterArgs, engine: str) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        sd = Eagle3Drafter(a).state_dict()
    return {k: tuple(sd[src].shape) for k, src in export_tensor_names(a, engine).items()}


def _mla_params(cfg: dict, engine: str) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the engine's ``Eagle3DeepseekV2ForCausalLM`` built from ``cfg`` (embedding left out: both
    take the verifier's), read off the model code: the layer's MLA (``input_size`` / the replaced fused projection
    = 2H), dense MLP with stacked gate/up, three norms, fc over 3 aux states, final norm, lm_head ``[draft_V, H]``;
    vLLM adds ``draft_id_to_target_id`` when the draft vocab differs."""
    H, nh, ql, kl = (
        cfg[k] for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank")
    )
    dn, dr, dv, inter = (
        cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
    )
    th = cfg.get("target_hidden_size") or H
    p = "model.midlayer." if engine == "sglang" else "model.layers.0."
    fused = (
        "self_attn.fused_qkv_a_proj_with_mqa"
        if engine == "sglang"
        else "self_attn.fused_qkv_a_proj"
    )
    out = {
        p + fused + ".weight": (ql + kl + dr, 2 * H),
        p + "self_attn.q_a_layernorm.weight": (ql,),
        p + "self_attn.q_b_proj.weight": (nh * (dn + dr), ql),
        p + "self_attn.kv_a_layernorm.weight": (kl,),
        p + "self_attn.kv_b_proj.weight": (nh * (dn + dv), kl),
        p + "self_attn.o_proj.weight": (H, nh * dv),
        p + "mlp.gate_up_proj.weight": (2 * inter, H),
        p + "mlp.down_proj.weight": (H, inter),
        p + "input_layernorm.weight": (H,),
        p + "hidden_norm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        "model.fc.weight": (H, 3 * th),
        "model.norm.weight": (H,),
        "lm_head.weight": (cfg["draft_vocab_size"], H),
    }
    if cfg.get("fc_norm"):
        out |= {f"model.fc_norm.{j}.weight": (th,) for j in range(3)}
    if engine == "vllm" and cfg["draft_vocab_size"] != KIMI_INFO["vocab_size"]:
        out["draft_id_to_target_id"] = (cfg["draft_vocab_size"],)
    return out


def _sglang_load(shapes: dict, params: dict) -> dict[str, tuple]:
    """SGLang 0.5.23 ``Eagle3DeepseekV2ForCausalLM.load_weights``: d2t -> hot_token_id, t2d skipped, ``layers.0.`` ->
    ``midlayer.``, ``model.`` prefix except lm_head, gate/up into ``gate_up_proj`` shards, q_a_proj and
    kv_a_proj_with_mqa concatenated (dim 0) into ``fused_qkv_a_proj_with_mqa``; an unknown name is skipped with a
    warning (here: an error). Returns parameter -> shape written (stacked shards summed along dim 0)."""
    written: dict[str, list] = {}
    cached = {}
    for name, shape in shapes.items():
        if name in ("d2t", "t2d"):
            continue
        m = re.sub(r"^layers\.0\.", "midlayer.", name)
        m = m if m.startswith("lm_head.") else f"model.{m}"
        for wn in (".gate_proj", ".up_proj"):
            if wn in m:
                written.setdefault(m.replace(wn, ".gate_up_proj"), []).append(shape)
                break
        else:
            if "q_a_proj" in m or "kv_a_proj_with_mqa" in m:
                cached[m] = shape
                continue
            assert m in params, f"SGLang skips unexpected weight {name}"
            written.setdefault(m, []).append(shape)
    (q,) = [k for k in cached if "q_a_proj" in k]
    kv = q.replace("q_a_proj", "kv_a_proj_with_mqa")
    fused = q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
    written[fused] = [cached[q], cached[kv]]
    return {k: (sum(s[0] for s in v),) + tuple(v[0][1:]) for k, v in written.items()}


def _vllm_load(shapes: dict, params: dict) -> dict[str, tuple]:
    """vLLM 0.34 ``Eagle3DeepseekV2ForCausalLM.load_weights``: t2d dropped, d2t -> ``draft_id_to_target_id``,
    ``model.`` prefix except lm_head; then ``DeepseekV2Eagle3Model.hf_to_vllm_mapper`` (``midlayer.`` ->
    ``layers.0.``, gate/up -> ``gate_up_proj``, q_a_proj / kv_a_proj_with_mqa -> ``fused_qkv_a_proj`` shards 0/1);
    ``AutoWeightsLoader`` refuses a name with no parameter."""
    stacked = {
        ".gate_proj": ".gate_up_proj",
        ".up_proj": ".gate_up_proj",
        ".q_a_proj": ".fused_qkv_a_proj",
        ".kv_a_proj_with_mqa": ".fused_qkv_a_proj",
    }
    written: dict[str, list] = {}
    for name, shape in shapes.items():
        if "t2d" in name:
            continue
        n = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else name
        if "lm_head" not in n and "draft_id_to_target_id" not in n:
            n = "model." + n
        n = n.replace("midlayer.", "layers.0.")
        for wn, pn in stacked.items():
            if wn in n:
                n = n.replace(wn, pn, 1)
                break
        assert n in params, f"vLLM: there is no module or parameter named {n}"
        written.setdefault(n, []).append(shape)
    return {k: (sum(s[0] for s in v),) + tuple(v[0][1:]) for k, v in written.items()}


def test_kimi_mla_args_come_from_the_verifier():
    a = kimi_mla_args()
    assert a.is_mla and a.mla == dict(
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
    )
    assert (a.num_key_value_heads, a.head_dim, a.rope_scaling["type"]) == (64, 192, "yarn")


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_kimi_size_mla_export_fills_every_engine_parameter(engine, variant):
    """Every tensor of the Kimi-size MLA export lands on a parameter of the engine's MLA draft model with its shape,
    and every parameter (but the shared embedding) is written; the config is the one both engines build from."""
    a = kimi_mla_args()
    a = DrafterArgs(**{**a.to_json(), "variant": variant})
    cfg = json.loads(json.dumps(export_config(a, engine, [2, 30, 58], KIMI_INFO)))
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert cfg["model_type"] == ("deepseek_v2" if engine == "vllm" else "deepseek_v3")
    assert cfg["rope_scaling"]["factor"] == 64.0
    ids = (
        [2, 30, 58] if engine == "vllm" else [2, 30, 58]
    )  # DeepSeek family: SGLang ids = HF indices
    if engine == "sglang":
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        assert "eagle_aux_hidden_state_layer_ids" not in cfg
    else:
        assert (
            cfg["eagle_aux_hidden_state_layer_ids"] == ids and cfg["norm_before_residual"] is False
        )
    assert bool(cfg.get("fc_norm")) == bool(cfg.get("norm_output")) == (variant == "eagle3.1")
    params = _mla_params(cfg, engine)
    shapes = _meta_shapes(a, engine)
    got = (_sglang_load if engine == "sglang" else _vllm_load)(shapes, params)
    assert got == params
    if engine == "sglang":  # post_load_weights: kv_b_proj.unflatten(0, (-1, dn + dv)) -> 64 heads
        rows = shapes["midlayer.self_attn.kv_b_proj.weight"][0]
        assert rows // (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) == cfg["num_attention_heads"]
    # our reader builds the same drafter from that config.json (the weight-free part of load_exported)
    engine_read, back = _args_from_config(cfg, Path("config.json"))
    assert engine_read == engine and back == a


def test_engines_softmax_scale_matches_the_drafters():
    """Both engines (and DeepSeek-V3) scale by qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2 under YaRN."""
    a = kimi_mla_args()
    with torch.device("meta"):
        attn = Eagle3Drafter(a).midlayer.self_attn
    m = 0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1.0
    assert attn.scale == pytest.approx(192**-0.5 * m * m)
    assert attn.rope_factor == 1.0  # mscale / mscale_all_dim


def _tiny_mla(q_lora=8, interleave=True, variant="eagle3") -> Eagle3Drafter:
    torch.manual_seed(0)
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=12,
        intermediate_size=40,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        draft_vocab_size=16,
        target_vocab_size=50,
        target_hidden_size=24,
        variant=variant,
        attention="mla",
        mla=dict(
            q_lora_rank=q_lora,
            kv_lora_rank=6,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=5,
            rope_interleave=interleave,
        ),
    )
    d = Eagle3Drafter(a)
    ids = torch.tensor(sorted(torch.randperm(50)[:16].tolist()))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(16), t2d)
    with torch.no_grad():
        d.embed_tokens.weight.normal_()
        for n, p in d.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)
    return d


LLAMA30 = dict(
    name="tiny/llama", architecture="LlamaForCausalLM", num_layers=30, hidden_size=24, vocab_size=50
)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_tiny_mla_round_trip(tmp_path, engine, variant):
    d = _tiny_mla(variant=variant)
    out = export_drafter(d, tmp_path / engine, engine, [2, 15, 27], LLAMA30, dtype="float32")
    names = set(load_file(str(out / "model.safetensors")))
    prefix = "midlayer." if engine == "sglang" else "layers.0."
    assert (
        prefix + "self_attn.kv_b_proj.weight" in names
        and prefix + "self_attn.q_proj.weight" not in names
    )
    back = load_exported(out, embed_weight=d.embed_tokens.weight)
    assert back.args == d.args
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_reader_refuses_an_mla_folder_missing_a_latent_tensor(tmp_path):
    from safetensors.torch import save_file

    d = _tiny_mla()
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30, dtype="float32")
    w = load_file(str(out / "model.safetensors"))
    del w["midlayer.self_attn.kv_a_layernorm.weight"]
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(
        UserError, match=r"missing required tensor 'midlayer.self_attn.kv_a_layernorm.weight'"
    ):
        load_exported(out, embed_weight=d.embed_tokens.weight)


@pytest.mark.parametrize(
    "engine,q_lora,interleave,message",
    [
        (
            "sglang",
            None,
            True,
            "export.engine: sglang cannot serve this MLA drafter: .*set drafter.mla.q_lora_rank",
        ),
        (
            "vllm",
            None,
            True,
            "export.engine: vllm cannot serve this MLA drafter: .*set drafter.mla.q_lora_rank",
        ),
        (
            "vllm",
            8,
            False,
            "export.engine: vllm cannot serve this MLA drafter: .*rope_interleave: true",
        ),
    ],
)
def test_engine_refuses_mla_sizes_it_cannot_build(tmp_path, engine, q_lora, interleave, message):
    d = _tiny_mla(q_lora=q_lora, interleave=interleave)
    with pytest.raises(UserError, match=message):
        export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30)


def test_sglang_serves_neox_rope_mla(tmp_path):
    """SGLang reads rope_interleave (is_neox_style = not rope_interleave), so a non-interleaved MLA drafter exports."""
    d = _tiny_mla(interleave=False)
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    assert json.loads((out / "config.json").read_text())["rope_interleave"] is False


def test_warm_start_from_an_mla_export_checks_attention_not_the_derived_head_sizes(tmp_path):
    """``train.init_from`` an MLA export: the config's num_key_value_heads / head_dim do not shape an MLA layer (its
    sizes do), so they are not compared; a Llama-style run from it is refused naming drafter.attention."""
    from eagle3.train.resume_checks import DRAFTER_CONFIG_KEYS
    from eagle3.train.warm_start import WARM_START_SHAPE, check_init_from

    out = export_drafter(_tiny_mla(), tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    cfg = dict.fromkeys(WARM_START_SHAPE) | {
        "variant": "eagle3",
        "num_layers": 1,
        "hidden_size": 24,
    }
    mla_run = cfg | {"attention": "mla", "num_key_value_heads": 2, "head_dim": 16}
    assert check_init_from(str(out), mla_run, DRAFTER_CONFIG_KEYS) is True
    with pytest.raises(
        UserError,
        match=r"holds a drafter with attention 'mla', this run trains 'llama' \(drafter.attention\)",
    ):
        check_init_from(str(out), cfg | {"attention": "llama"}, DRAFTER_CONFIG_KEYS)
