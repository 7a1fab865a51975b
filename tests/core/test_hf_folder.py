"""eagle3.verifier.hf_folder: a loaded verifier written as a plain HF folder that loads back to the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.errors import UserError
from eagle3.verifier.hf_folder import write_hf_folder


def test_round_trip_gives_the_same_logits(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    out = write_hf_folder(model, tok, tmp_path / "verifier-hf")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["torch_dtype"] == "float32"
    assert "quantization_config" not in conf
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
    assert (
        AutoTokenizer.from_pretrained(out)("def f(x):")["input_ids"]
        == tok("def f(x):")["input_ids"]
    )
    # a second write replaces the folder, leaving no temporary folder beside it
    write_hf_folder(model, tok, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["verifier-hf"]


def test_refuses_to_replace_a_folder_that_is_no_model(tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a model folder"):
        write_hf_folder(model, None, tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


def test_source_record_makes_the_folder_the_configured_verifier(tiny_llama_dir, tmp_path):
    """A folder written in another dtype has other weight files: without the source record 05 --server's check says
    "differs", with the configured verifier's fingerprint recorded it says "same weights"."""
    from eagle3.config import VerifierConfig
    from eagle3.decoding.server_checks import compare_served_model
    from eagle3.verifier.hf_folder import SOURCE_FILE, source_weights
    from eagle3.verifier.load import weights_fingerprint

    vcfg = VerifierConfig(path=str(tiny_llama_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    plain = write_hf_folder(model, tok, tmp_path / "plain", dtype=torch.bfloat16)
    assert source_weights(plain) is None and not (plain / SOURCE_FILE).exists()
    assert compare_served_model(vcfg, str(plain))[0] == "differs"
    fp = weights_fingerprint(vcfg)
    rec = write_hf_folder(model, tok, tmp_path / "rec", dtype=torch.bfloat16, source_weights=fp)
    assert source_weights(rec) == fp and fp.startswith("sha256:")
    assert compare_served_model(vcfg, str(rec)) == (
        "same weights",
        f"written from verifier.path's weights ({SOURCE_FILE})",
    )
