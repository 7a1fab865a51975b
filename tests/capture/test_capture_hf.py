"""HF capture backend: padding invariance on Llama, DeepseekV3 (MLA + MoE) and a multimodal
wrapper, batch planning, and post/pre-norm detection of the last hidden state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3.capture.base import CaptureBackend
from eagle3.capture.hf import HFCapture, plan_batches

V = 300


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def _deepseek_config():
    from transformers import DeepseekV3Config

    # MLA (q/kv LoRA ranks, split nope/rope head dims) + MoE (4 routed experts, top-2, 1 shared),
    # first layer dense like Kimi-K2 / DeepSeek-V3.
    return DeepseekV3Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
    )


def _deepseek():
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(_deepseek_config()).eval()


def _multimodal_deepseek():
    """Kimi-K2.5-like: a vision-language wrapper whose language model is DeepseekV3 (dims in text_config)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = LlavaConfig(
        text_config=_deepseek_config().to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=V - 1,
    )
    model = LlavaForConditionalGeneration(cfg).eval()
    assert (
        not hasattr(model.config, "num_hidden_layers")
        or model.config.text_config.num_hidden_layers == 6
    )
    return model


SAMPLES = [[5, 17, 3, 99, 250, 7, 7, 1, 42], [8, 1, 2], [11, 12, 13, 14, 15, 16]]  # lengths 9, 3, 6


def test_plan_batches_hand_computed():
    # longest first: 1 (10), 2 (5), 3 (5), 0 (3), 4 (2); 2*10 > 12 -> alone; 2*5 <= 12; 3*5 > 12; 2*3 <= 12
    assert plan_batches([3, 10, 5, 5, 2], 12) == [[1], [2, 3], [0, 4]]
    assert plan_batches([50, 4], 12) == [[0], [1]]  # longer than the budget: alone
    assert plan_batches([4, 4, 4], 100) == [[0, 1, 2]]
    assert plan_batches([], 8) == []


@pytest.mark.parametrize(
    "make",
    [_llama, _deepseek, _multimodal_deepseek],
    ids=["llama", "deepseek_v3", "llava_deepseek"],
)
def test_padding_invariance(make):
    model = make()
    aux = [1, 3, 4]
    cap = HFCapture(model, aux, batch_tokens=10_000, pad_id=0)
    assert isinstance(cap, CaptureBackend)
    info = cap.info()
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (6, 64, V)
    assert info["last_hidden_state"] == "post_norm"
    got = cap.capture(SAMPLES)  # one right-padded batch of 3 (padded to 9)
    assert len(got) == 3
    for s, states in zip(SAMPLES, got):
        with torch.no_grad():
            ref = model(
                input_ids=torch.tensor([s]), output_hidden_states=True, use_cache=False
            ).hidden_states
        assert len(ref) == 7
        for k, layer in enumerate(aux + [6]):
            h = states[k]
            assert (
                h.dtype == torch.bfloat16
                and h.device.type == "cpu"
                and tuple(h.shape) == (len(s), 64)
            )
            want = ref[layer][0].to(torch.bfloat16).float()  # [L, H]
            torch.testing.assert_close(h.float(), want, atol=5e-4, rtol=8e-3)  # bf16 rounding
            # the comparison discriminates: the neighbouring layer is outside the same tolerance
            other = ref[layer - 1][0].float()
            assert not torch.allclose(h.float(), other, atol=5e-4, rtol=8e-3)


def test_split_batches_match_single_batch():
    model = _deepseek()
    one = HFCapture(model, [2, 3, 5], batch_tokens=10_000).capture(SAMPLES)
    split = HFCapture(model, [2, 3, 5], batch_tokens=9).capture(SAMPLES)  # 3 forwards
    for a, b in zip(one, split):
        for x, y in zip(a, b):
            torch.testing.assert_close(x.float(), y.float(), atol=5e-4, rtol=8e-3)


def test_padding_not_returned_and_storage_small():
    model = _llama()
    got = HFCapture(model, [2, 3, 4]).capture([[1] * 40, [2, 3]])
    short = got[1][0]
    assert short.shape == (2, 64)
    assert short.untyped_storage().nbytes() == 2 * 64 * 2  # own storage, not the padded batch


class _FakeLM(torch.nn.Module):
    """A 2-layer toy LM whose hidden_states[-1] is the PRE-norm residual stream (logits use the norm)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = SimpleNamespace(
            num_hidden_layers=2, hidden_size=8, vocab_size=20, architectures=["FakeLM"]
        )
        self.embed = torch.nn.Embedding(20, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.model = SimpleNamespace(norm=torch.nn.LayerNorm(8))
        self.norm = self.model.norm
        self.lm_head = torch.nn.Linear(8, 20, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, use_cache=False):
        h = self.embed(input_ids)
        hs = [h]
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
            hs.append(h)
        return SimpleNamespace(hidden_states=tuple(hs), logits=self.lm_head(self.norm(h)))


def test_detects_pre_norm_last_state():
    cap = HFCapture(_FakeLM(), [1, 1, 1])
    assert cap.info()["last_hidden_state"] == "pre_norm"
    assert cap.info()["architecture"] == "FakeLM"


def test_wrong_hidden_state_count_is_an_error():
    fake = _FakeLM()
    fake.config.num_hidden_layers = 3  # claims 3 layers, returns 2 + 1 states
    with pytest.raises(
        RuntimeError, match="returned 3 hidden states, expected num_hidden_layers \\+ 1 = 4"
    ):
        HFCapture(fake, [1, 2, 2]).capture([[1, 2]])
