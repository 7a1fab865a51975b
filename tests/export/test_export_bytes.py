"""The exported bytes are pinned: each file of an export folder (``config.json``, ``eagle3_train.json``,
``model.safetensors``) has the SHA-256 below for a drafter whose every tensor is set without a random generator.
A change of any byte an engine reads (key order, a config field, a tensor name, dtype or value) fails here."""

from __future__ import annotations

import hashlib

import pytest
import torch

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.model import Eagle3Drafter
from eagle3.export.writer import export_drafter

LLAMA30 = dict(
    name="tiny/llama-30",
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=24,
    vocab_size=50,
    context_length=512,
)
DSV3_61 = dict(LLAMA30, name="tiny/kimi-like", architecture="DeepseekV3ForCausalLM", num_layers=61)


def drafter(variant: str = "eagle3", num_layers: int = 1, draft_vocab: int = 16) -> Eagle3Drafter:
    """A drafter whose tensors are a fixed function of their index (no random generator)."""
    a = DrafterArgs(
        hidden_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=40,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        max_position_embeddings=512,
        draft_vocab_size=draft_vocab,
        target_vocab_size=50,
        target_hidden_size=24,
        variant=variant,
        num_layers=num_layers,
    )
    d = Eagle3Drafter(a)
    ids = (
        torch.arange(0, 50, 50 // draft_vocab)[:draft_vocab]
        if draft_vocab < 50
        else torch.arange(50)
    )
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(draft_vocab), t2d)
    with torch.no_grad():
        for j, (_, p) in enumerate(sorted(d.named_parameters())):
            n = p.numel()
            p.copy_(
                ((torch.arange(n, dtype=torch.float64) * 0.37 + j) % 1.9 - 0.95).reshape(p.shape)
            )
    return d


CASES = {
    "sglang-llama": (dict(), "sglang", LLAMA30, dict()),
    "vllm-llama": (dict(), "vllm", LLAMA30, dict()),
    "sglang-deepseek": (dict(), "sglang", DSV3_61, dict()),
    "vllm-deepseek": (dict(), "vllm", DSV3_61, dict()),
    "sglang-3.1-deep-f16": (
        dict(variant="eagle3.1", num_layers=2),
        "sglang",
        LLAMA30,
        dict(dtype="float16", include_embeddings=True),
    ),
    "vllm-3.1-deep-f32": (
        dict(variant="eagle3.1", num_layers=3),
        "vllm",
        LLAMA30,
        dict(
            dtype="float32",
            num_speculative_tokens=5,
            ttt_length=4,
            provenance={"train_dir": "t", "checkpoint": "c", "step": 7, "select_best": "last"},
        ),
    ),
    "sglang-full-vocab": (dict(draft_vocab=50), "sglang", LLAMA30, dict()),
    "vllm-full-vocab": (dict(draft_vocab=50), "vllm", LLAMA30, dict(include_embeddings=True)),
}

GOLDEN: dict[str, dict[str, str]] = {
    "sglang-3.1-deep-f16": {
        "config.json": "93d648658849b1300148f786b463e49be4207eb6c5d277ee0034a704d1bdb2fe",
        "eagle3_train.json": "c03a1eb234748dabfeb96649fdd05c03f1eb40388a510c8f983cf9b44213207a",
        "model.safetensors": "06480186e0c4901a2237d31f4a46f88851910fe1bdb255eef6261a4d7d090e5a",
    },
    "sglang-deepseek": {
        "config.json": "b09937b53b7686973b381c9954f8da0ea0574dd5225899c292fc6ee6cfb292d9",
        "eagle3_train.json": "0dae70897d9dda7351161afb64c49a8961f09a542c5c7784e500aac9d8cce928",
        "model.safetensors": "dba914bfffb195c6805cbfd7bec419ac36e41ad5a75a862640332188c9a378cd",
    },
    "sglang-full-vocab": {
        "config.json": "b0f9e71d1b71f92127d33e5fe1eb9632f892432bcf7230b31fdeb581a3826479",
        "eagle3_train.json": "d4626a1b24522698fcd7e9b3d2e2d36eb7d89959643ab39d9a43119ff124e462",
        "model.safetensors": "356430aad3bd7bab196ad5293ea405b26e82ffff5bd0e2129cffdba3b87c3420",
    },
    "sglang-llama": {
        "config.json": "59cd4b402b6393a5326b2841e785bacedc2e031dc34c4ddce676e143a1206987",
        "eagle3_train.json": "08cf89f4d3f43c0d45a1a1c884d12244c1ccda6dd2008ac3cc140ebe1daabd8a",
        "model.safetensors": "dba914bfffb195c6805cbfd7bec419ac36e41ad5a75a862640332188c9a378cd",
    },
    "vllm-3.1-deep-f32": {
        "config.json": "a34614331362f19ecb8d441f1c751e45c5e758d454db26daf25c5d2294798f63",
        "eagle3_train.json": "3e1c0c422897b9a0d4b8b05376fc90cddc1d3e0334a60016186e28504e9b17b8",
        "model.safetensors": "f9fd385fef34724860de6dee367469096ca6ba2d513721d672c0ff6602a91cd5",
    },
    "vllm-deepseek": {
        "config.json": "38d8367796b1a368dd4e5f62fd3862e7d4e24e412e31c2115eccf3b02852455f",
        "eagle3_train.json": "af5d7ec498f98d39646a3fc98918d80faaa90e781a622c32bb3fbb695d1cb71e",
        "model.safetensors": "6dc3e94e8f7efec75decc4dd466342d22dd61878f851029dfce418cb22ae028d",
    },
    "vllm-full-vocab": {
        "config.json": "428a9b4730e0fc5c1c0d57266917efda3956f856b5846a5286210bd7de4353ca",
        "eagle3_train.json": "52a8ff93290b72ac40efa9cd3d4c18164b525a6a63fd9819aeda94a3718185c8",
        "model.safetensors": "6f56822ba8c58f46d7dd18b0780be4852210ac760c278748168b07fb3ec537e5",
    },
    "vllm-llama": {
        "config.json": "4fcbf0ff104a8b075947ef65e255c22bc18af504ab819f5f06584e0cc49a4553",
        "eagle3_train.json": "4d5a93074660e78476933841c63be99708c29c6cde599a4d8c04df50df2ce763",
        "model.safetensors": "6dc3e94e8f7efec75decc4dd466342d22dd61878f851029dfce418cb22ae028d",
    },
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_bytes_are_pinned(tmp_path, case):
    make, engine, verifier, kw = CASES[case]
    out = export_drafter(drafter(**make), tmp_path / case, engine, [2, 15, 27], verifier, **kw)
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
    assert got == GOLDEN[case]
