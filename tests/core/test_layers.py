"""Aux-layer id conventions (eagle3/engines/layers.py), checked by hand and against SGLang 0.5.23's own code.

HF index i = residual stream entering decoder layer i. SGLang 0.5.23 (installed with --no-deps):
- ``srt/models/llama.py`` ``LlamaForCausalLM.set_eagle3_layers_to_capture``: ``None`` -> ``[2, N//2, N-3]``,
  else ``[val + 1 for val in layer_ids]``.
- ``srt/models/deepseek_v2.py`` ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``: ``None`` -> default,
  else +1 only when ``layer_ids[0] == 1``.
- ``srt/models/kimi_k25.py`` ``KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture`` delegates
  to its ``language_model`` (a ``DeepseekV3ForCausalLM``).
The SGLang tests compile those methods from the installed source and run them on stand-ins.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT

from eagle3.engines.layers import (
    check_aux_layers,
    default_aux_layers,
    engine_layer_ids,
    hf_layers_from_engine,
)
from eagle3.errors import UserError
from eagle3.verifier.arch import is_deepseek_family

sys.path.insert(0, str(ROOT / "patches"))
import sglang_source  # noqa: E402

KIMI, DSV3, LLAMA = "KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "LlamaForCausalLM"


# ---- hand-computed rules -------------------------------------------------------------------
def test_default_layers():
    assert default_aux_layers(61) == [2, 30, 58]  # Kimi-K2/K2.5, DeepSeek-V3
    assert default_aux_layers(30) == [2, 15, 27]  # SmolLM2-135M
    assert default_aux_layers(32) == [2, 16, 29]  # Llama-3.1-8B
    assert default_aux_layers(7) == [2, 3, 4]  # smallest with three distinct layers
    with pytest.raises(UserError, match="at least 7"):
        default_aux_layers(6)  # would be [2, 3, 3]


def test_default_aux_layers_docstring_states_the_boundary_the_code_uses():
    """The docstring said "fewer than 6" layers are refused while the code needs 7 (6 gives [2, 3, 3]): the number it
    names is now the smallest layer count that works, and one less is refused."""
    import re

    n = int(re.search(r"fewer than (\d+) layers", default_aux_layers.__doc__).group(1))
    assert n == 7 and default_aux_layers(n) == check_aux_layers(default_aux_layers(n), n) == [
        2,
        3,
        4,
    ]
    with pytest.raises(UserError, match=f"verifier has {n - 1} layers; .* need at least {n} "):
        default_aux_layers(n - 1)


def test_check_aux_layers():
    assert check_aux_layers([3, 31, 59], 61) == [3, 31, 59]
    assert check_aux_layers([1, 2, 60], 61) == [1, 2, 60]
    with pytest.raises(
        UserError,
        match=r"aux layers \[3, 31, 61\] must be exactly 3, strictly increasing, in 1\.\.60 ",
    ):
        check_aux_layers([3, 31, 61], 61)  # index N = final layer output, never capturable
    with pytest.raises(UserError, match=r"aux layers \[0, 15, 27\] must be .* in 1\.\.29 "):
        check_aux_layers([0, 15, 27], 30)  # embeddings
    with pytest.raises(
        UserError, match=r"aux layers \[15, 2, 27\] must be exactly 3, strictly increasing"
    ):
        check_aux_layers([15, 2, 27], 30)
    with pytest.raises(UserError, match=r"aux layers \[2, 15\] must be exactly 3"):
        check_aux_layers([2, 15], 30)
    with pytest.raises(UserError, match="my.field"):
        check_aux_layers([2, 15, 30], 30, field="my.field")


@pytest.mark.parametrize(
    "hf, arch, sglang, vllm",
    [
        ([2, 30, 58], KIMI, [2, 30, 58], [2, 30, 58]),  # 61 layers, default: DeepSeek ids as-is
        ([3, 31, 59], KIMI, [3, 31, 59], [3, 31, 59]),  # the production config
        ([3, 31, 59], DSV3, [3, 31, 59], [3, 31, 59]),
        (
            [2, 15, 27],
            LLAMA,
            [1, 14, 26],
            [2, 15, 27],
        ),  # 30 layers (SmolLM2): Llama adds +1, so write i-1
        ([1, 15, 29], LLAMA, [0, 14, 28], [1, 15, 29]),
        ([2, 30, 58], LLAMA, [1, 29, 57], [2, 30, 58]),  # DESIGN.md example
    ],
)
def test_engine_ids_and_round_trip(hf, arch, sglang, vllm):
    assert engine_layer_ids(hf, "sglang", arch) == sglang
    assert engine_layer_ids(hf, "vllm", arch) == vllm
    assert hf_layers_from_engine(sglang, "sglang", arch) == hf
    assert hf_layers_from_engine(vllm, "vllm", arch) == hf


def test_deepseek_first_id_one_is_shifted():
    # Draft config ids [1, 30, 58] on a DeepSeek verifier: SGLang adds +1 to all (first id is 1).
    assert hf_layers_from_engine([1, 30, 58], "sglang", KIMI) == [2, 31, 59]
    # ... hence HF index 1 cannot be the first aux layer of a DeepSeek verifier under SGLang.
    with pytest.raises(UserError, match="HF index 1 cannot be the first aux layer"):
        engine_layer_ids([1, 30, 58], "sglang", KIMI)
    assert engine_layer_ids([1, 30, 58], "vllm", KIMI) == [1, 30, 58]
    with pytest.raises(
        UserError, match=r"aux layers \[0, 15, 27\]: HF index 0 \(embeddings\) cannot be captured"
    ):
        engine_layer_ids([0, 15, 27], "sglang", LLAMA)


def test_unknown_engine_and_family():
    with pytest.raises(UserError, match="unknown engine 'trtllm'"):
        engine_layer_ids([2, 15, 27], "trtllm", LLAMA)
    with pytest.raises(UserError, match="unknown engine"):
        hf_layers_from_engine([2, 15, 27], "trtllm", LLAMA)
    assert (
        is_deepseek_family(KIMI) and is_deepseek_family("deepseek_v3") and is_deepseek_family(DSV3)
    )
    assert not is_deepseek_family(LLAMA)


# ---- SGLang 0.5.23's own rule, executed ----------------------------------------------------
needs_sglang = pytest.mark.skipif(
    sglang_source.sglang_root() is None,
    reason="SGLang not installed (CI installs 0.5.23 --no-deps)",
)


def _sglang_captures(file: str, cls: str, num_layers: int, ids):
    """Run ``cls.set_eagle3_layers_to_capture(ids)`` from the installed SGLang file on a stand-in model."""
    fn = sglang_source.compile_def(
        sglang_source.sglang_root() / "srt" / "models" / file, f"{cls}.set_eagle3_layers_to_capture"
    )
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    fn(model, ids)
    assert model.capture_aux_hidden_states is True
    return model.model.layers_to_capture


@needs_sglang
@pytest.mark.parametrize("hf", [[2, 30, 58], [3, 31, 59], [2, 3, 4], [10, 20, 60]])
def test_sglang_deepseek_rule_matches(hf):
    ids = engine_layer_ids(hf, "sglang", DSV3)
    assert _sglang_captures("deepseek_v2.py", "DeepseekV2ForCausalLM", 61, ids) == hf


@needs_sglang
@pytest.mark.parametrize("hf", [[2, 15, 27], [1, 15, 29], [3, 10, 20]])
def test_sglang_llama_rule_matches(hf):
    ids = engine_layer_ids(hf, "sglang", LLAMA)
    assert _sglang_captures("llama.py", "LlamaForCausalLM", 30, ids) == hf


@needs_sglang
def test_sglang_defaults_match():
    assert _sglang_captures("llama.py", "LlamaForCausalLM", 30, None) == default_aux_layers(30)
    assert _sglang_captures(
        "deepseek_v2.py", "DeepseekV2ForCausalLM", 61, None
    ) == default_aux_layers(61)


@needs_sglang
def test_sglang_deepseek_first_id_one():
    assert _sglang_captures("deepseek_v2.py", "DeepseekV2ForCausalLM", 61, [1, 30, 58]) == [
        2,
        31,
        59,
    ]
    assert hf_layers_from_engine([1, 30, 58], "sglang", DSV3) == [2, 31, 59]


@needs_sglang
def test_sglang_kimi_k25_delegates_to_deepseek():
    root = sglang_source.sglang_root() / "srt" / "models"
    inner = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=61),
        model=SimpleNamespace(layers_to_capture=[]),
        capture_aux_hidden_states=False,
    )
    ds = sglang_source.compile_def(
        root / "deepseek_v2.py", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"
    )
    inner.set_eagle3_layers_to_capture = lambda ids=None: ds(inner, ids)
    k25 = sglang_source.compile_def(
        root / "kimi_k25.py", "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture"
    )
    k25(SimpleNamespace(language_model=inner), engine_layer_ids([3, 31, 59], "sglang", KIMI))
    assert inner.model.layers_to_capture == [3, 31, 59]
    # kimi_k25.py builds its language model as DeepseekV3ForCausalLM, a DeepseekV2ForCausalLM subclass
    src = (root / "kimi_k25.py").read_text()
    assert "self.language_model = DeepseekV3ForCausalLM(" in src
    assert (
        "class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):"
        in (root / "deepseek_v2.py").read_text()
    )


def test_check_servable_names_the_engine_and_both_ways_out():
    """02 and 04 ask before capturing / training whether export.engine can state the aux layers (trial 05e: a
    DeepSeek run at HF [1, ...] was refused only by the export, after the capture and the whole training)."""
    from eagle3.engines.layers import check_servable

    with pytest.raises(
        UserError,
        match=r"^extract.aux_layers: export.engine sglang cannot serve a drafter on these "
        r"layers \(DeepseekV3ForCausalLM\): .*HF index 1 cannot be the first.*"
        r"export.engine: vllm",
    ):
        check_servable([1, 30, 58], "sglang", DSV3, "extract.aux_layers")
    assert check_servable([1, 30, 58], "vllm", DSV3, "x") == [1, 30, 58]
    assert check_servable([1, 30, 58], "sglang", "LlamaForCausalLM", "x") == [0, 29, 57]
    assert check_servable([3, 31, 59], "sglang", KIMI, "x") == [3, 31, 59]
