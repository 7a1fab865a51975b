"""EAGLE-3.1 (``drafter.variant: eagle3.1``): the TTT forward against a hand-written reference of both
variants, KV-cached decoding == TTT, lossless speculative decoding, export round trips for both
engines (config keys SGLang 0.5.23 / vLLM 0.33 read), the refusal of an engine that cannot serve
it, and old checkpoints / folders (no variant recorded) read as eagle3."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_model import scramble

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.caches import DrafterCache
from eagle3.drafter.model import Eagle3Drafter
from eagle3.errors import UserError
from eagle3.export import formats as export_mod
from eagle3.export.common import FC_NORM_KEYS
from eagle3.export.reader import load_exported
from eagle3.export.writer import export_drafter
from eagle3.train.resume_checks import drafter_args_problem

LLAMA30 = dict(
    name="tiny/llama-30",
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=24,
    vocab_size=50,
)


def make(variant: str, seed: int = 0, Ht: int = 24, num_layers: int = 1) -> Eagle3Drafter:
    """A tiny drafter (H 24, 4 heads of 6, 2 kv heads, ``num_layers`` decoder layers) with non-trivial norms (each
    its own) and a d2t map."""
    torch.manual_seed(seed)
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        draft_vocab_size=16,
        target_vocab_size=50,
        target_hidden_size=Ht,
        variant=variant,
        num_layers=num_layers,
    )
    d = Eagle3Drafter(a)
    ids = torch.tensor(sorted(torch.randperm(50)[:16].tolist()))
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(16), t2d)
    return scramble(d)


# ---------------------------------------------------------------------------------------------
# the hand-written reference: every operation spelled out from the weights
# ---------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [B, h, L, hd], pos [L]: Llama rotate-half rotary
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    ang = pos.double()[:, None] * inv[None]  # [L, hd/2]
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).float(),
        torch.cat([ang.sin(), ang.sin()], -1).float(),
    )  # [L, hd]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_ttt(
    d: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, K: int, variant: str
) -> list[torch.Tensor]:
    """Draft logits of K TTT steps, written out: eagle3 = the paper; eagle3.1 = per-aux RMSNorm before fc
    (speculators PR 670 ``fc_norm``: ``cat(n0(a1), n1(a2), n2(a3))``) and the post-norm state fed back and
    read by lm_head without a second norm (speculators PR 610 ``norm_output``, TorchSpec PR 97)."""
    a = d.args
    sd = {k: v.detach() for k, v in d.state_dict().items()}
    eps, B, L = a.rms_norm_eps, ids.shape[0], ids.shape[1]
    nh, kvh, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    if variant == "eagle3.1":
        Ht = a.target_hidden_size
        aux = torch.cat(
            [
                _rms(aux[..., j * Ht : (j + 1) * Ht], sd[f"fc_norm.{j}.weight"], eps)
                for j in range(3)
            ],
            -1,
        )
    hidden = aux @ sd["fc.weight"].t()  # [B, L, H]
    keys, vals, logits = [], [], []
    for i in range(K):
        tok = torch.zeros(B, L, dtype=torch.long)
        tok[:, : max(L - 1 - i, 0)] = ids[:, 1 + i :]
        emb = sd["embed_tokens.weight"][tok]  # [B, L, H]
        x = torch.cat(
            [
                _rms(emb, sd["midlayer.input_layernorm.weight"], eps),
                _rms(hidden, sd["midlayer.hidden_norm.weight"], eps),
            ],
            -1,
        )  # [B, L, 2H]
        pos = torch.arange(i, L + i)
        q = _rope(
            (x @ sd["midlayer.self_attn.q_proj.weight"].t()).view(B, L, nh, hd).transpose(1, 2),
            pos,
            a.rope_theta,
        )
        k = _rope(
            (x @ sd["midlayer.self_attn.k_proj.weight"].t()).view(B, L, kvh, hd).transpose(1, 2),
            pos,
            a.rope_theta,
        )
        v = (x @ sd["midlayer.self_attn.v_proj.weight"].t()).view(B, L, kvh, hd).transpose(1, 2)
        keys.append(k.repeat_interleave(nh // kvh, 1))
        vals.append(v.repeat_interleave(nh // kvh, 1))
        # keys: step 0 causal over s <= t; steps 1..i only at t itself
        scores = [q @ keys[0].transpose(-1, -2) / math.sqrt(hd)]  # [B, nh, L, L]
        scores[0] = scores[0].masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        scores += [
            (q * kk).sum(-1, keepdim=True) / math.sqrt(hd) for kk in keys[1:]
        ]  # [B, nh, L, 1] each
        p = torch.softmax(torch.cat(scores, -1), -1)  # [B, nh, L, L+i]
        o = p[..., :L] @ vals[0] + sum(
            p[..., L + j - 1 : L + j] * vals[j] for j in range(1, i + 1)
        )  # [B, nh, L, hd]
        h = (
            hidden
            + o.transpose(1, 2).reshape(B, L, nh * hd) @ sd["midlayer.self_attn.o_proj.weight"].t()
        )
        z = _rms(h, sd["midlayer.post_attention_layernorm.weight"], eps)
        h = (
            h
            + (
                F.silu(z @ sd["midlayer.mlp.gate_proj.weight"].t())
                * (z @ sd["midlayer.mlp.up_proj.weight"].t())
            )
            @ sd["midlayer.mlp.down_proj.weight"].t()
        )
        normed = _rms(h, sd["norm.weight"], eps)
        logits.append(normed @ sd["lm_head.weight"].t())
        hidden = normed if variant == "eagle3.1" else h
    return logits


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_ttt_forward_matches_hand_written_reference(variant):
    d = make(variant)
    g = torch.Generator().manual_seed(3)
    ids, aux = torch.randint(0, 50, (2, 9), generator=g), torch.randn(2, 9, 72, generator=g) * 3
    with torch.no_grad():
        got = [d.compute_logits(h) for h in d.ttt_forward(ids, aux, 4, attn_impl="eager")]
        fast = [d.compute_logits(h) for h in d.ttt_forward(ids, aux, 4, attn_impl="sdpa")]
    ref = reference_ttt(d, ids, aux, 4, variant)
    for i in range(4):
        assert torch.allclose(got[i], ref[i], atol=2e-4, rtol=1e-4), (
            variant,
            i,
            (got[i] - ref[i]).abs().max(),
        )
        assert torch.allclose(fast[i], ref[i], atol=2e-4, rtol=1e-4)
    if variant == "eagle3.1":  # the variants are different functions of the same weights
        assert (reference_ttt(d, ids, aux, 4, "eagle3")[1] - ref[1]).abs().max() > 1e-2


def test_eagle31_has_fc_norm_and_step_outputs_are_normed():
    d = make("eagle3.1")
    assert {f"fc_norm.{j}.weight" for j in range(3)} <= set(d.state_dict())
    assert d.fc_norm[0].weight.shape == (24,) and d.fc_norm[0].weight.requires_grad
    assert "fc_norm.0.weight" not in make("eagle3").state_dict()
    with torch.no_grad():
        outs = d.ttt_forward(torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 72), 2)
    w = d.norm.weight.detach()
    for h in outs:  # norm(x) / w has unit RMS
        rms = ((h / w) ** 2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3)


def test_eagle31_kv_cached_decode_matches_ttt():
    """05's decoding API (project + decode + compute_logits, outputs fed back) reproduces the TTT steps."""
    d = make("eagle3.1", seed=2)
    B, L, K = 2, 8, 3
    ids, aux = torch.randint(0, 50, (B, L)), torch.randn(B, L, 72)
    with torch.no_grad():
        ref = [d.compute_logits(o) for o in d.ttt_forward(ids, aux, K, attn_impl="eager")]
        ids_pad = torch.cat([ids, torch.zeros(B, K + 1, dtype=torch.long)], 1)
        pos = torch.arange(L).expand(B, L)
        for t in range(L):
            cache = DrafterCache()
            h0 = d.decode(ids_pad[:, 1 : L + 1], d.project(aux), pos, cache)
            assert torch.allclose(d.compute_logits(h0), ref[0], atol=1e-5)
            cache.crop(t + 1)
            h = h0[:, t : t + 1]
            for i in range(1, K):
                h = d.decode(ids_pad[:, t + 1 + i : t + 2 + i], h, torch.full((B, 1), t + i), cache)
                assert torch.allclose(d.compute_logits(h)[:, 0], ref[i][:, t], atol=1e-5), (t, i)


def test_eagle31_speculative_decoding_is_lossless():
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3.decoding.decode import greedy_generate_batch, speculative_generate_batch

    torch.manual_seed(0)
    ver = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        )
    ).eval()
    a = DrafterArgs(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        draft_vocab_size=64,
        target_vocab_size=64,
        target_hidden_size=32,
        variant="eagle3.1",
    )
    d = Eagle3Drafter(a, ver.get_input_embeddings().weight).eval()
    for p in ([3, 9, 27, 5, 1], [40, 2]):
        g = greedy_generate_batch(ver, [p], 12).tokens[0]
        r = speculative_generate_batch(ver, d, [p], [1, 2, 3], steps=3, max_new_tokens=12)
        assert r.rows[0].tokens == g


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle31_export_round_trip(tmp_path, engine):
    d = make("eagle3.1")
    out = export_drafter(d, tmp_path / "x", engine, [2, 15, 27], LLAMA30, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    # the keys SGLang 0.5.23 (LlamaModel: getattr(config, "fc_norm"/"norm_output")) and vLLM 0.33
    # (algos.update_eagle3 copies them from the speculators config) read, at the top level
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert cfg["eagle3_train"]["variant"] == "eagle3.1"
    keys = set(load_file(str(out / "model.safetensors")))
    assert set(FC_NORM_KEYS) <= keys
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["fc_norm.2.weight"], d.fc_norm[2].weight.detach()
    )
    d2 = load_exported(out, embed_weight=d.embed_tokens.weight)
    assert d2.args == d.args and d2.args.variant == "eagle3.1"
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, 50, (2, 7), generator=g), torch.randn(2, 7, 72, generator=g)
    with torch.no_grad():
        for x, y in zip(d.ttt_forward(ids, aux, 3), d2.ttt_forward(ids, aux, 3)):
            assert torch.equal(d.compute_logits(x), d2.compute_logits(y))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_eagle3_export_has_no_variant_keys(tmp_path, engine):
    """An eagle3 folder is what it was before the variant existed (no fc_norm / norm_output keys)."""
    out = export_drafter(make("eagle3"), tmp_path / "x", engine, [2, 15, 27], LLAMA30)
    cfg = json.loads((out / "config.json").read_text())
    assert "fc_norm" not in cfg and "norm_output" not in cfg
    assert not set(FC_NORM_KEYS) & set(load_file(str(out / "model.safetensors")))
    assert (
        load_exported(out, embed_weight=make("eagle3").embed_tokens.weight).args.variant == "eagle3"
    )


def test_export_refuses_an_engine_that_cannot_serve_the_variant(tmp_path, monkeypatch):
    d = make("eagle3.1")
    monkeypatch.setitem(
        export_mod.VARIANT_ENGINES, "eagle3.1", {"sglang": "SGLang 0.5.23 llama_eagle3.py"}
    )
    with pytest.raises(
        UserError, match=r"^export.engine: vllm cannot serve an eagle3.1 drafter"
    ) as e:
        export_drafter(d, tmp_path / "x", "vllm", [2, 15, 27], LLAMA30)
    assert "\n" not in str(e.value) and "sglang" in str(e.value)
    assert not (tmp_path / "x").exists() and not list(tmp_path.iterdir())
    export_drafter(
        d, tmp_path / "y", "sglang", [2, 15, 27], LLAMA30
    )  # the engine that serves it still works
    # both engines serve eagle3.1 in the versions whose model code was read (SGLang 0.5.23, vLLM 0.33)
    assert set(export_mod.VARIANT_ENGINES["eagle3.1"]) == {"sglang"}
    monkeypatch.undo()
    assert set(export_mod.VARIANT_ENGINES["eagle3.1"]) == {"sglang", "vllm"}


def _edit_config(folder, **kv):
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in kv.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def test_load_exported_refuses_folders_of_neither_variant(tmp_path):
    d = make("eagle3.1")
    emb = d.embed_tokens.weight
    out = export_drafter(d, tmp_path / "x", "sglang", [2, 15, 27], LLAMA30)
    _edit_config(out, norm_output=None)  # fc_norm alone: neither eagle3 nor eagle3.1
    with pytest.raises(
        UserError, match=r"config.json: field 'norm_output' \(False\) differs from fc_norm \(True\)"
    ):
        load_exported(out, embed_weight=emb)
    _edit_config(
        out, fc_norm=None
    )  # config says eagle3 but the weights hold fc_norm: a folder edited by hand
    with pytest.raises(UserError, match="unexpected tensor 'fc_norm.0.weight'"):
        load_exported(out, embed_weight=emb)
    _edit_config(out, norm_before_fc=True)
    with pytest.raises(
        UserError,
        match="field 'norm_before_fc' should be False, got True; this project implements eagle3 and",
    ):
        load_exported(out, embed_weight=emb)
    # SGLang's legacy flag name use_aux_norm means fc_norm
    out2 = export_drafter(d, tmp_path / "y", "sglang", [2, 15, 27], LLAMA30)
    _edit_config(out2, fc_norm=None, use_aux_norm=True)
    assert load_exported(out2, embed_weight=emb).args.variant == "eagle3.1"
    # a 3.1 config without the fc_norm tensors
    out3 = export_drafter(d, tmp_path / "z", "vllm", [2, 15, 27], LLAMA30)
    w = load_file(str(out3 / "model.safetensors"))
    del w["fc_norm.1.weight"]
    save_file(w, str(out3 / "model.safetensors"))
    with pytest.raises(UserError, match="missing required tensor 'fc_norm.1.weight'"):
        load_exported(out3, embed_weight=emb)


# ---------------------------------------------------------------------------------------------
# config, args and checkpoints
# ---------------------------------------------------------------------------------------------
def test_args_without_variant_are_eagle3_and_bad_variant_refused():
    a = make("eagle3.1").args
    j = a.to_json()
    assert j["variant"] == "eagle3.1" and DrafterArgs.from_json(j) == a
    old = {k: v for k, v in j.items() if k != "variant"}
    assert DrafterArgs.from_json(old).variant == "eagle3"
    with pytest.raises(
        UserError, match="drafter: field 'variant' should be 'eagle3' or 'eagle3.1'"
    ):
        DrafterArgs(**dict(old, variant="eagle4"))
    # resume: an old checkpoint (no variant) is an eagle3 drafter
    assert drafter_args_problem(old, dict(old, variant="eagle3")) is None
    assert re.match(
        "drafter field 'variant' is 'eagle3' in the checkpoint but 'eagle3.1'.*drafter.variant",
        drafter_args_problem(old, j),
    )


def test_config_key_drafter_variant(tmp_path):
    from eagle3.config import load_config

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny-llama.yaml"
    cfg = load_config(tiny, ["drafter.variant=eagle3.1"])
    assert cfg.drafter.variant == "eagle3.1"
    assert load_config(tiny, []).drafter.variant == "eagle3"
    with pytest.raises(UserError, match=r"--set drafter.variant=eagle4: field 'drafter.variant'"):
        load_config(tiny, ["drafter.variant=eagle4"])
