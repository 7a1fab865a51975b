"""load_target_head_from_safetensors: reads only the 3 head tensors, only from the shards holding them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import eagle3.verifier.head as sh
from eagle3.errors import UserError
from eagle3.verifier.head import load_target_head_from_safetensors, locate_head_tensors

V, H = 48, 16


def _write_sharded(root, shards: dict[str, dict[str, torch.Tensor]], config: dict) -> None:
    """Write ``shards`` (file -> tensors) plus the HF index and config.json."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(root / fname))
        weight_map.update({k: fname for k in tensors})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (root / "config.json").write_text(json.dumps(config))


@pytest.fixture()
def k25_like(tmp_path):
    """A Kimi-K2.5-shaped checkpoint: ``language_model.`` prefix, nested text_config, 4 shards, a decoy."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=g).to(torch.bfloat16)  # [V, H]
    head = torch.randn(V, H, generator=g).to(torch.bfloat16)  # [V, H]
    norm = torch.rand(H, generator=g).to(torch.bfloat16)  # [H]
    shards = {
        "model-00001-of-00004.safetensors": {
            "language_model.model.embed_tokens.weight": embed,
            "language_model.model.layers.0.input_layernorm.weight": torch.ones(
                H, dtype=torch.bfloat16
            ),
        },
        # the decoy: a big tensor nobody needs, and a vision-tower norm that must not be mistaken for the final norm
        "model-00002-of-00004.safetensors": {
            "language_model.model.layers.1.mlp.experts.weight": torch.zeros(
                64, 256, dtype=torch.bfloat16
            ),
            "vision_tower.norm.weight": torch.full((H,), 7.0, dtype=torch.bfloat16),
        },
        "model-00003-of-00004.safetensors": {"language_model.model.norm.weight": norm},
        "model-00004-of-00004.safetensors": {"language_model.lm_head.weight": head},
    }
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {
            "hidden_size": H,
            "vocab_size": V,
            "rms_norm_eps": 1e-5,
            "num_hidden_layers": 2,
        },
        "vision_config": {"hidden_size": 32},
    }
    _write_sharded(tmp_path / "ckpt", shards, cfg)
    return tmp_path / "ckpt", embed, head, norm


def test_sharded_prefixed_reads_only_needed_shards(k25_like, monkeypatch):
    folder, embed, head, norm = k25_like
    opened: list[str] = []
    read: list[str] = []
    real_safe_open = sh.safe_open

    class Recorder:
        def __init__(self, path, framework, device="cpu"):
            opened.append(path.split("/")[-1])
            self._cm = real_safe_open(path, framework=framework, device=device)

        def __enter__(self):
            self._f = self._cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self._f.get_tensor(name)

        def keys(self):
            return self._f.keys()

    monkeypatch.setattr(sh, "safe_open", Recorder)
    th = load_target_head_from_safetensors(folder)
    assert torch.equal(th.embed, embed) and th.embed.dtype == torch.bfloat16
    assert torch.equal(th.lm_head, head)
    assert torch.equal(th.norm_weight, norm)
    assert th.norm_eps == 1e-5
    assert th.last_is_post_norm is True
    assert not th.tied
    # shard 2 (decoy + vision norm) never opened; exactly the three tensors were read
    assert sorted(opened) == [
        "model-00001-of-00004.safetensors",
        "model-00003-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
    ]
    assert sorted(read) == sorted(
        [
            "language_model.model.embed_tokens.weight",
            "language_model.model.norm.weight",
            "language_model.lm_head.weight",
        ]
    )


def test_names_located_for_wrapper(k25_like):
    folder = k25_like[0]
    assert locate_head_tensors(folder) == {
        "embed": "language_model.model.embed_tokens.weight",
        "norm": "language_model.model.norm.weight",
        "lm_head": "language_model.lm_head.weight",
    }


def test_same_shard_tensors_opened_once(tmp_path, monkeypatch):
    embed = torch.arange(V * H, dtype=torch.float32).reshape(V, H)  # [V, H]
    head = -embed  # [V, H]
    norm = torch.linspace(0.5, 1.5, H)  # [H]
    _write_sharded(
        tmp_path / "c",
        {
            "a.safetensors": {
                "model.embed_tokens.weight": embed,
                "model.norm.weight": norm,
                "lm_head.weight": head,
            },
            "b.safetensors": {"model.layers.0.self_attn.q_proj.weight": torch.ones(H, H)},
        },
        {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    )
    opened = []
    real = sh.safe_open
    monkeypatch.setattr(
        sh, "safe_open", lambda p, **kw: (opened.append(p.split("/")[-1]), real(p, **kw))[1]
    )
    th = load_target_head_from_safetensors(
        tmp_path / "c", last_hidden_state="pre_norm", dtype=torch.bfloat16
    )
    assert opened == ["a.safetensors"]
    assert torch.equal(th.embed, embed.to(torch.bfloat16)) and torch.equal(
        th.lm_head, head.to(torch.bfloat16)
    )
    assert torch.equal(th.norm_weight, norm.to(torch.bfloat16))
    assert th.last_is_post_norm is False and th.norm_eps == 1e-6


def test_single_file_tied_embeddings(tmp_path):
    embed = torch.randn(V, H)  # [V, H]
    norm = torch.rand(H)  # [H]
    d = tmp_path / "tied"
    d.mkdir()
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": norm},
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(
        json.dumps(
            {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
        )
    )
    th = load_target_head_from_safetensors(d)
    assert th.tied and th.lm_head is th.embed
    assert torch.equal(th.embed, embed) and torch.equal(th.norm_weight, norm)


def test_matches_transformers_model(tiny_llama_dir):
    """Round trip against the HF model saved by transformers (tied SmolLM2-like verifier)."""
    from transformers import AutoModelForCausalLM

    from eagle3.verifier.head import TargetHead

    ref = TargetHead.from_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    th = load_target_head_from_safetensors(tiny_llama_dir)
    assert torch.equal(th.embed, ref.embed) and torch.equal(th.lm_head, ref.lm_head)
    assert torch.equal(th.norm_weight, ref.norm_weight) and th.norm_eps == ref.norm_eps


def test_errors_name_file_and_key(tmp_path):
    with pytest.raises(UserError, match="config.json: file not found"):
        load_target_head_from_safetensors(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6})
    )
    with pytest.raises(UserError, match="no model.safetensors.index.json or model.safetensors"):
        load_target_head_from_safetensors(tmp_path)
    d = tmp_path / "untied"
    _write_sharded(
        d,
        {
            "a.safetensors": {
                "model.embed_tokens.weight": torch.zeros(V, H),
                "model.norm.weight": torch.ones(H),
            }
        },
        {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    )
    with pytest.raises(UserError, match="tie_word_embeddings: false"):
        load_target_head_from_safetensors(d)
    d2 = tmp_path / "badshape"
    _write_sharded(
        d2,
        {
            "a.safetensors": {
                "model.embed_tokens.weight": torch.zeros(V, H),
                "model.norm.weight": torch.ones(H),
            }
        },
        {"hidden_size": H + 1, "vocab_size": V, "rms_norm_eps": 1e-6},
    )
    with pytest.raises(UserError, match=r"model.embed_tokens.weight' has shape \(48, 16\)"):
        load_target_head_from_safetensors(d2)
    d3 = tmp_path / "noeps"
    _write_sharded(
        d3,
        {
            "a.safetensors": {
                "model.embed_tokens.weight": torch.zeros(V, H),
                "model.norm.weight": torch.ones(H),
            }
        },
        {"hidden_size": H, "vocab_size": V},
    )
    with pytest.raises(
        UserError,
        match="config.json: field 'rms_norm_eps' is missing; the checkpoint's config.json needs it",
    ):
        load_target_head_from_safetensors(d3)
    d4 = tmp_path / "missingshard"
    _write_sharded(
        d4,
        {
            "a.safetensors": {
                "model.embed_tokens.weight": torch.zeros(V, H),
                "model.norm.weight": torch.ones(H),
            }
        },
        {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6},
    )
    (d4 / "a.safetensors").unlink()
    with pytest.raises(UserError, match="shard 'a.safetensors'"):
        load_target_head_from_safetensors(d4)


def test_head_tensors_against_the_config_are_one_line(tmp_path):
    """Each disagreement of the head tensors with config.json, as one line naming the folder, tensor and file."""
    tensors = {"model.embed_tokens.weight": torch.zeros(V, H), "model.norm.weight": torch.ones(H)}
    for name, cfg, want in (
        (
            "untied",
            {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
            "no 'lm_head.weight' tensor but {cfg} says tie_word_embeddings: false",
        ),
        (
            "vocab",
            {"hidden_size": H, "vocab_size": V + 2, "rms_norm_eps": 1e-6},
            f"tensor 'model.embed_tokens.weight' has shape ({V}, {H}), {{cfg}} implies ({V + 2}, {H})",
        ),
    ):
        d = tmp_path / name
        _write_sharded(d, {"a.safetensors": tensors}, cfg)
        with pytest.raises(UserError) as e:
            load_target_head_from_safetensors(d)
        assert str(e.value) == f"{d}: " + want.format(cfg=d / "config.json")
    d = tmp_path / "norm"
    _write_sharded(
        d,
        {"a.safetensors": {**tensors, "model.norm.weight": torch.ones(H + 1)}},
        {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6},
    )
    with pytest.raises(UserError) as e:
        load_target_head_from_safetensors(d)
    assert str(e.value) == (
        f"{d}: tensor 'model.norm.weight' has shape ({H + 1},), {d / 'config.json'} implies ({H},)"
    )


def test_dtype_casts_every_tensor_and_a_tied_head_stays_tied(tmp_path):
    embed = torch.randn(V, H).to(torch.bfloat16)  # [V, H]
    norm = torch.rand(H).to(torch.bfloat16)  # [H]
    cfg = {"hidden_size": H, "vocab_size": V, "rms_norm_eps": 1e-6}
    _write_sharded(
        tmp_path / "t",
        {"a.safetensors": {"model.embed_tokens.weight": embed, "model.norm.weight": norm}},
        cfg,
    )
    th = load_target_head_from_safetensors(tmp_path / "t", "pre_norm", dtype=torch.float32)
    assert th.lm_head is th.embed and th.tied and th.last_is_post_norm is False
    assert th.embed.dtype == th.norm_weight.dtype == torch.float32
    assert torch.equal(th.embed, embed.float()) and torch.equal(th.norm_weight, norm.float())
