"""A deeper drafter (``drafter.num_layers``): the model against a reference written from the engines' layer loops
(SGLang 0.5.23 / vLLM 0.33 ``llama_eagle3.py``, run on the tensors of each engine's export folder), each layer's own
TTT keys, KV-cached decoding == TTT, export round trips with the pre-attention norm of layers >= 1 under both
engine names, checkpoint/config plumbing, and the one-layer drafter unchanged."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_variant import make as make_tiny

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.caches import DrafterCache, StaticKVCache
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.export.common import upper_layer_keys
from eagle3.export.reader import load_exported
from eagle3.export.sglang import KEYS as SGLANG_KEYS
from eagle3.export.vllm import KEYS as VLLM_KEYS
from eagle3.export.writer import export_drafter
from eagle3.train.resume_checks import drafter_args_problem

LLAMA30 = dict(
    name="tiny/llama-30",
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=24,
    vocab_size=50,
)


def make(num_layers: int = 2, variant: str = "eagle3", seed: int = 0) -> Eagle3Drafter:
    """A tiny drafter (H 24, 4 heads of 6, 2 kv heads), non-trivial norms (every layer's differ), a d2t map."""
    return make_tiny(variant, seed, num_layers=num_layers)


def inputs(seed=3, B=2, L=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (B, L), generator=g), torch.randn(B, L, 72, generator=g) * 3


# ---------------------------------------------------------------------------------------------
# the engines' forward, in plain torch, on an export folder's tensors
# ---------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _fused(x, residual, w, eps):
    """SGLang/vLLM ``RMSNorm(x, residual)``: ``(norm(x + residual), x + residual)``."""
    r = x + residual
    return _rms(r, w, eps), r


def _rope(x, pos, theta):  # x [B, h, L, hd], pos [L]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).float(),
        torch.cat([ang.sin(), ang.sin()], -1).float(),
    )
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def engine_ttt(folder, engine: str, ids, aux, K: int):
    """Draft logits of K TTT steps by the engine's ``LlamaModel.forward`` layer loop, read from ``folder``'s
    ``config.json`` and ``model.safetensors``. SGLang: layer 0 ``residual = hidden``, q/k/v of
    ``cat(input_layernorm(embeds), hidden_norm(hidden))``; layer i >= 1 ``hidden, residual =
    layers.i.hidden_norm(hidden, residual)`` (vLLM: ``layers.i.input_layernorm``); then
    ``post_attention_layernorm(attn, residual)``, MLP; finally ``norm(hidden, residual)`` -> logits, and the
    pre-norm sum (``norm_output``: the normed one) is the next step's hidden. Every layer at the same positions;
    layer l's step-i queries see layer l's step-0 keys s <= t and its steps 1..i keys at t."""
    cfg = json.loads((folder / "config.json").read_text())
    lc = cfg if engine == "sglang" else cfg["transformer_layer_config"]
    sd = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    sd = {
        (k.replace("midlayer.", "layers.0.") if k.startswith("midlayer.") else k): v
        for k, v in sd.items()
    }
    n, eps, theta = lc["num_hidden_layers"], lc["rms_norm_eps"], lc["rope_theta"]
    nh, kvh, hd = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    pre_norm = "hidden_norm" if engine == "sglang" else "input_layernorm"
    norm_output = bool(cfg.get("norm_output"))
    if cfg.get("fc_norm"):
        Ht = cfg["target_hidden_size"]
        aux = torch.cat(
            [
                _rms(aux[..., j * Ht : (j + 1) * Ht], sd[f"fc_norm.{j}.weight"], eps)
                for j in range(3)
            ],
            -1,
        )
    hidden = aux @ sd["fc.weight"].t()  # [B, L, H]
    B, L = ids.shape
    keys = [[] for _ in range(n)]
    vals = [[] for _ in range(n)]
    logits = []
    for i in range(K):
        tok = torch.zeros(B, L, dtype=torch.long)
        tok[:, : max(L - 1 - i, 0)] = ids[:, 1 + i :]
        embeds = emb_weight[tok]  # [B, L, H]
        pos = torch.arange(i, L + i)
        hs, residual = hidden, None
        for l in range(n):
            p = f"layers.{l}."
            if l == 0:
                residual = hs
                x = torch.cat(
                    [
                        _rms(embeds, sd[p + "input_layernorm.weight"], eps),
                        _rms(hs, sd[p + "hidden_norm.weight"], eps),
                    ],
                    -1,
                )
            else:
                x, residual = _fused(hs, residual, sd[p + pre_norm + ".weight"], eps)
            q = _rope(
                (x @ sd[p + "self_attn.q_proj.weight"].t()).view(B, L, nh, hd).transpose(1, 2),
                pos,
                theta,
            )
            k = _rope(
                (x @ sd[p + "self_attn.k_proj.weight"].t()).view(B, L, kvh, hd).transpose(1, 2),
                pos,
                theta,
            )
            v = (x @ sd[p + "self_attn.v_proj.weight"].t()).view(B, L, kvh, hd).transpose(1, 2)
            keys[l].append(k.repeat_interleave(nh // kvh, 1))
            vals[l].append(v.repeat_interleave(nh // kvh, 1))
            scores = [q @ keys[l][0].transpose(-1, -2) / math.sqrt(hd)]
            scores[0] = scores[0].masked_fill(
                ~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")
            )
            scores += [(q * kk).sum(-1, keepdim=True) / math.sqrt(hd) for kk in keys[l][1:]]
            pr = torch.softmax(torch.cat(scores, -1), -1)
            o = pr[..., :L] @ vals[l][0] + sum(
                pr[..., L + j - 1 : L + j] * vals[l][j] for j in range(1, i + 1)
            )
            attn = o.transpose(1, 2).reshape(B, L, nh * hd) @ sd[p + "self_attn.o_proj.weight"].t()
            z, residual = _fused(attn, residual, sd[p + "post_attention_layernorm.weight"], eps)
            hs = (
                F.silu(z @ sd[p + "mlp.gate_proj.weight"].t())
                * (z @ sd[p + "mlp.up_proj.weight"].t())
            ) @ sd[p + "mlp.down_proj.weight"].t()
        to_logits, prenorm = _fused(hs, residual, sd["norm.weight"], eps)
        logits.append(to_logits @ sd["lm_head.weight"].t())
        hidden = to_logits if norm_output else prenorm
    return logits


emb_weight = None


def _export(d, tmp_path, engine):
    global emb_weight
    emb_weight = d.embed_tokens.weight.detach()
    return export_drafter(d, tmp_path / engine, engine, [2, 15, 27], LLAMA30, dtype="float32")


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("num_layers", [2, 3])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_model_equals_the_engines_layer_loop(tmp_path, engine, num_layers, variant):
    d = make(num_layers, variant)
    ids, aux = inputs()
    K = 3
    ref = engine_ttt(_export(d, tmp_path, engine), engine, ids, aux, K)
    with torch.no_grad():
        ttt = [d.compute_logits(h) for h in d.ttt_forward(ids, aux, K, attn_impl="eager")]
        fast = [d.compute_logits(h) for h in d.ttt_forward(ids, aux, K, attn_impl="sdpa")]
        B, L = ids.shape
        ids_pad = torch.cat([ids, torch.zeros(B, 1, dtype=torch.long)], 1)
        dec = d.compute_logits(
            d.decode(ids_pad[:, 1:], d.project(aux), torch.arange(L).expand(B, L), DrafterCache())
        )
        st = StaticKVCache(16, num_layers)
        stat = d.compute_logits(
            d.decode_static(ids_pad[:1, 1:], d.project(aux[:1]), torch.arange(L)[None], st)
        )
    assert torch.allclose(dec, ref[0], atol=2e-4, rtol=1e-4), (dec - ref[0]).abs().max()
    assert torch.allclose(stat, ref[0][:1], atol=2e-4, rtol=1e-4)
    for i in range(K):
        assert torch.allclose(ttt[i], ref[i], atol=2e-4, rtol=1e-4), (
            i,
            (ttt[i] - ref[i]).abs().max(),
        )
        assert torch.allclose(fast[i], ref[i], atol=2e-4, rtol=1e-4), i
    # the extra layers matter: the same weights without them give other logits
    shallow = make(1, variant)
    shallow.load_state_dict(
        {k: v for k, v in d.state_dict().items() if not k.startswith("layers.")}
    )
    with torch.no_grad():
        assert (
            shallow.compute_logits(shallow.ttt_forward(ids, aux, 1)[0]) - ref[0]
        ).abs().max() > 1e-2


def test_decode_keeps_one_cache_per_layer():
    """A 2-layer prefill fills two caches of the same slots with different keys, and equals TTT step 0 (the later
    steps, read from each layer's own cache, are checked by test_model.py::test_kv_cached_decode_matches_ttt_*)."""
    d = make(2)
    ids, aux = inputs()
    with torch.no_grad():
        good = d.ttt_forward(ids, aux, 3, attn_impl="eager")
    c = DrafterCache()
    B, L = ids.shape
    with torch.no_grad():
        ids_pad = torch.cat([ids, torch.zeros(B, 4, dtype=torch.long)], 1)
        h0 = d.decode(ids_pad[:, 1 : L + 1], d.project(aux), torch.arange(L).expand(B, L), c)
    assert (
        len(c.keys) == 2
        and c.keys[1].shape == c.keys[0].shape
        and not torch.equal(c.keys[0], c.keys[1])
    )
    assert torch.allclose(h0, good[0], atol=1e-5)


def test_one_layer_drafter_keys_and_args_unchanged():
    d = make(1)
    assert set(d.state_dict()) == set(SGLANG_KEYS) | {"embed_tokens.weight"}
    assert "num_layers" not in d.args.to_json()  # checkpoints / exports / fingerprints as before
    assert upper_layer_keys(1) == ()
    d2 = make(2)
    extra = set(d2.state_dict()) - set(d.state_dict())
    assert extra == {
        f"layers.1.{k}"
        for k in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
    }
    assert d2.state_dict()["layers.1.self_attn.q_proj.weight"].shape == (
        24,
        24,
    )  # H wide, no embedding
    assert d2.args.to_json()["num_layers"] == 2
    assert DrafterArgs.from_json(d2.args.to_json()) == d2.args
    assert DrafterArgs.from_json(d.args.to_json()).num_layers == 1


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_export_round_trip_two_layers(tmp_path, engine):
    d = make(2, seed=4)
    out = export_drafter(d, tmp_path / engine, engine, [2, 15, 27], LLAMA30)  # bf16
    cfg = json.loads((out / "config.json").read_text())
    lc = cfg if engine == "sglang" else cfg["transformer_layer_config"]
    assert lc["num_hidden_layers"] == 2
    t = load_file(str(out / "model.safetensors"))
    base = SGLANG_KEYS if engine == "sglang" else VLLM_KEYS
    assert set(t) == set(base) | set(upper_layer_keys(2))
    w = d.state_dict()["layers.1.input_layernorm.weight"].to(torch.bfloat16)
    assert torch.equal(t["layers.1.hidden_norm.weight"], w) and torch.equal(
        t["layers.1.input_layernorm.weight"], w
    )
    emb = d.embed_tokens.weight.detach().clone()
    back = load_exported(out, emb)
    assert back.args.num_layers == 2
    ref = d.to(torch.bfloat16).float()
    for k, v in ref.state_dict().items():
        if k != "embed_tokens.weight":  # not exported: the verifier's, passed in
            assert torch.equal(back.state_dict()[k], v), k
    ids, aux = inputs()
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(emb)
        for a, b in zip(back.ttt_forward(ids, aux, 3), ref.ttt_forward(ids, aux, 3)):
            assert torch.equal(a, b)
    # the folder's engine decides which of the two names is loaded (warned when they differ)
    t["layers.1." + ("input_layernorm" if engine == "sglang" else "hidden_norm") + ".weight"] = (
        torch.ones(24, dtype=torch.bfloat16)
    )
    save_file(t, str(out / "model.safetensors"))
    assert torch.equal(
        load_exported(out, emb).state_dict()["layers.1.input_layernorm.weight"], w.float()
    )


def test_export_refuses_folders_missing_a_norm_name_and_bad_layer_counts(tmp_path):
    d = make(2)
    out = export_drafter(d, tmp_path / "s", "sglang", [2, 15, 27], LLAMA30)
    t = load_file(str(out / "model.safetensors"))
    del t["layers.1.input_layernorm.weight"]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(
        UserError, match="missing required tensor 'layers.1.input_layernorm.weight'"
    ):
        load_exported(out, d.embed_tokens.weight.detach())
    for bad in (0, "2", 1.5):
        cfg = json.loads((out / "config.json").read_text())
        cfg["num_hidden_layers"] = bad
        (out / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UserError, match="config.json: field 'num_hidden_layers' should be"):
            load_exported(out, d.embed_tokens.weight.detach())
    # a 1-layer folder stating 2 layers lacks layers.1.*
    one = export_drafter(make(1), tmp_path / "one", "vllm", [2, 15, 27], LLAMA30)
    cfg = json.loads((one / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 2
    (one / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="missing required tensor 'layers.1."):
        load_exported(one, make(1).embed_tokens.weight.detach())


def test_args_config_and_checkpoint_plumbing():
    with pytest.raises(UserError, match="num_layers"):
        make(0)
    with pytest.raises(UserError, match="num_layers"):
        DrafterArgs(**{**make(1).args.to_json(), "num_layers": 2.0})
    a1 = make(1).args.to_json()
    assert drafter_args_problem(a1, {**a1, "num_layers": 1}) is None  # no field vs explicit 1
    assert drafter_args_problem(a1, {**a1, "num_layers": 2}) == (
        "drafter field 'num_layers' is 1 in the checkpoint but 2 in the config (set drafter.num_layers back, "
        "or train into a new train.output_dir)"
    )
    from eagle3.settings.drafter import DrafterConfig

    assert DrafterConfig().num_layers == 1 and DrafterConfig(num_layers=3).num_layers == 3
    with pytest.raises(Exception):
        DrafterConfig(num_layers=0)
    assert "hidden_norm" in DrafterConfig.model_fields["num_layers"].description


def _engine_params(n: int) -> set[str]:
    """Parameter names (and stacked shards) of SGLang 0.5.23's / vLLM 0.33's ``llama_eagle3.py`` model for
    ``num_hidden_layers = n`` (every layer creates input_layernorm AND hidden_norm; q/k/v and gate/up stacked)."""
    out = {"model.fc.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(n):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.qkv_proj.weight:" + s for s in "qkv"} | {
            p + "mlp.gate_up_proj.weight:" + s for s in "01"
        }
        out |= {
            p + k
            for k in (
                "self_attn.o_proj.weight",
                "mlp.down_proj.weight",
                "input_layernorm.weight",
                "hidden_norm.weight",
                "post_attention_layernorm.weight",
            )
        }
    return out


def _sglang_loaded(names) -> dict[str, str]:
    """SGLang 0.5.23 ``LlamaForCausalLMEagle3.load_weights`` name handling: legacy ``midlayer`` -> ``layers.0``,
    d2t/t2d consumed, stacked q/k/v and gate/up, ``model.`` prefix when the bare name is not a parameter; names that
    match no parameter are skipped silently (returned as ``None``)."""
    params = _engine_params(99)
    stacked = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", "0"),
        (".gate_up_proj", ".up_proj", "1"),
    ]
    got = {}
    for orig in names:
        name = orig.replace("midlayer", "layers.0") if "midlayer" in orig else orig
        if "d2t" in name or "t2d" in name:
            continue
        for pn, wn, sid in stacked:
            if wn in name:
                name = name.replace(wn, pn)
                full = name if name + ":" + sid in params else f"model.{name}"
                got[orig] = full + ":" + sid if full + ":" + sid in params else None
                break
        else:
            full = name if name in params else f"model.{name}"
            got[orig] = full if full in params else None
    return got


def _vllm_loaded(names) -> dict[str, str]:
    """vLLM 0.33 ``Eagle3LlamaForCausalLM.load_weights``: t2d dropped, d2t renamed, ``model.`` prefix except
    ``lm_head``, then ``hf_to_vllm_mapper`` (``midlayer.`` -> ``layers.0.``, stacked q/k/v and gate/up)."""
    stacked = {
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", "0"),
        ".up_proj": (".gate_up_proj", "1"),
    }
    params = _engine_params(99)
    got = {}
    for orig in names:
        if "t2d" in orig or "d2t" in orig:
            continue
        name = orig if "lm_head" in orig else "model." + orig
        name = name.replace("midlayer.", "layers.0.")
        for wn, (pn, sid) in stacked.items():
            if wn in name:
                name = name.replace(wn, pn) + ":" + sid
                break
        got[orig] = name if name in params else None
    return got


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_loaders_fill_every_parameter_of_a_two_layer_draft(tmp_path, engine):
    """Every tensor of the 2-layer export lands on a parameter of the engine's 2-layer model and every parameter of
    it is written (SGLang would skip an unknown name silently and keep a random or unit weight); the norm each engine
    applies in layer 1 holds the trained weight."""
    d = make(2)
    out = export_drafter(d, tmp_path / engine, engine, [2, 15, 27], LLAMA30, dtype="float32")
    t = load_file(str(out / "model.safetensors"))
    got = (_sglang_loaded if engine == "sglang" else _vllm_loaded)(t)
    assert None not in got.values(), [k for k, v in got.items() if v is None]
    assert set(got.values()) == _engine_params(2)
    applied = {v: k for k, v in got.items()}[
        "model.layers.1." + ("hidden_norm" if engine == "sglang" else "input_layernorm") + ".weight"
    ]
    assert torch.equal(t[applied], d.layers["1"].input_layernorm.weight.detach())
