"""Aux-layer index conventions: the project's HF index and what each serving engine expects.

The project convention (recorded in every ``data_config.json``) is the HF ``hidden_states``
index: 0 = embeddings, i = output of decoder layer i-1 = the residual stream entering decoder
layer i. Valid aux indices are 1..N-1 for an N-layer verifier (index N would be the final
layer's output, which no engine can capture as an aux state).

Engines (FIELD-NOTES section 2; SGLang 0.5.23 ``models/llama.py`` / ``models/deepseek_v2.py``
``set_eagle3_layers_to_capture``, vLLM ``eagle_aux_hidden_state_layer_ids``):

- SGLang, Llama family: captures ``id + 1`` for every id in the draft config, so write ``i - 1``.
- SGLang, DeepSeek V2/V3 family (DeepSeek-V3, Kimi-K2, Kimi-K2.5): adds +1 only when the first
  id is 1, so write ``i`` as-is; a list whose first HF index is 1 cannot be expressed.
- vLLM: ids are HF indices, used as given.
"""

from __future__ import annotations

from typing import Sequence

from eagle3.engines import Engine, known
from eagle3.errors import UserError
from eagle3.verifier.arch import is_deepseek_family


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, N//2, N-3]`` as HF indices (61 -> [2,30,58], 30 -> [2,15,27]).

    Raises:
        UserError: the verifier has fewer than 7 layers (the three would not be distinct: 6 gives [2, 3, 3]).
    """
    if num_layers < 7:
        raise UserError(
            f"verifier has {num_layers} layers; EAGLE-3 default aux layers [2, N//2, N-3] need at least 7 "
            "(set extract.aux_layers explicitly)"
        )
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(
    layers: Sequence[int], num_layers: int, field: str = "extract.aux_layers"
) -> list[int]:
    """Validate HF-index aux layers against an N-layer verifier: three, increasing, each in 1..N-1.

    Raises:
        UserError: naming ``field`` and the offending value.
    """
    layers = [int(i) for i in layers]
    if (
        len(layers) != 3
        or sorted(set(layers)) != layers
        or not 1 <= layers[0] < layers[-1] < num_layers
    ):
        raise UserError(
            f"{field}: aux layers {layers} must be exactly 3, strictly increasing, in 1..{num_layers - 1} "
            f"for a {num_layers}-layer verifier (HF hidden_states indices; the final layer output cannot be an "
            "aux state)"
        )
    return layers


def engine_layer_ids(hf_layers: Sequence[int], engine: Engine, architecture: str) -> list[int]:
    """Convert HF-index aux layers to the ids a draft config must state for ``engine``.

    Examples (61 layers, HF [2, 30, 58]): SGLang Llama -> [1, 29, 57]; SGLang DeepSeek -> [2, 30, 58];
    vLLM -> [2, 30, 58].

    Raises:
        UserError: unknown engine, or a list the engine's rule cannot express.
    """
    hf_layers = [int(i) for i in hf_layers]
    if known(engine) == "vllm":
        return hf_layers
    deepseek = is_deepseek_family(architecture)
    ids = hf_layers if deepseek else [i - 1 for i in hf_layers]
    if min(ids) < 0 or hf_layers_from_engine(ids, engine, architecture) != hf_layers:
        why = (
            "SGLang's DeepSeek rule adds +1 when the first id is 1, so HF index 1 cannot be the first aux "
            "layer for this verifier"
            if deepseek
            else "HF index 0 (embeddings) cannot be captured by SGLang"
        )
        raise UserError(f"aux layers {hf_layers}: {why}")
    return ids


def hf_layers_from_engine(ids: Sequence[int], engine: Engine, architecture: str) -> list[int]:
    """Inverse of :func:`engine_layer_ids`: which HF indices an engine captures for these draft-config ids."""
    ids = [int(i) for i in ids]
    if known(engine) == "vllm":
        return ids
    if is_deepseek_family(architecture):
        return [i + 1 for i in ids] if ids and ids[0] == 1 else ids
    return [i + 1 for i in ids]


def layer_id_convention(engine: str, architecture: str) -> str:
    """How ``engine`` turns the draft config's aux-layer ids into verifier layers (recorded in exports)."""
    if engine == "vllm":
        return "hf: ids are HF hidden_states indices (vLLM uses them as given)"
    if is_deepseek_family(architecture):
        return "sglang-deepseek: ids are HF hidden_states indices (SGLang adds +1 only when the first id is 1)"
    return "sglang-llama: ids are HF hidden_states index - 1 (SGLang captures id + 1)"


def check_servable(
    hf_layers: Sequence[int], engine: Engine, architecture: str, where: str
) -> list[int]:
    """The ``engine`` ids of ``hf_layers`` (:func:`engine_layer_ids`), checked where a run can still change course:
    02 before it captures, 04 before it trains. The only list an engine cannot state is a DeepSeek-family one whose
    first HF index is 1 under SGLang; found by the export, it cost the whole capture and training.

    Args:
        where: what holds the layers (``extract.aux_layers``, or the shards' ``data_config.json``), named first.

    Raises:
        UserError: one line naming ``where``, the layers, the architecture, ``export.engine`` and both ways out.
    """
    try:
        return engine_layer_ids(hf_layers, engine, architecture)
    except UserError as e:
        raise UserError(
            f"{where}: export.engine {engine} cannot serve a drafter on these layers ({architecture}): {e}; "
            f"choose other extract.aux_layers (and capture again), or serve with vLLM (export.engine: vllm "
            f"takes HF indices as given)"
        ) from None
