"""The served draft's HF config (a LlamaConfig of ``num_layers`` layers) and the engines' context-length rule.

Stage 04 warns at start when the drafter's context is below the verifier's (:func:`check_context_length`);
the export (:mod:`eagle3.export.serving`) writes :func:`llama_config` and refuses the SGLang folder by the
same rule.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from eagle3.drafter.model import DrafterArgs
from eagle3.errors import UserError
from eagle3.verifier.load import serving_context_length

log = logging.getLogger(__name__)

DEFAULT_EXPORT_DTYPE = torch.bfloat16
#: An export folder's own metadata file (HF aux layers, engine ids, verifier, drafter_args, trained_from): written by
#: :mod:`eagle3.export.serving`, read back by 04 (``train.init_from``, the export record) and 05.
EXPORT_META_FILE = "eagle3_train.json"


def untrained_positions(ttt_length: int, steps: int, verb: bool = False) -> str:
    """``position 3`` / ``positions 3..5`` (with ``verb``: ``position 3 was`` / ``positions 3..5 were``): the draft
    positions past ``ttt_length`` (the TTT steps the drafter trained, ``train.ttt_length``) that a chain of ``steps``
    drafts, for the warnings of 05 and the vLLM export (positions counted from 1, as in the per-position
    acceptance). Needs ``steps > ttt_length``."""
    first = int(ttt_length) + 1
    if first == int(steps):
        return f"position {first}" + (" was" if verb else "")
    return f"positions {first}..{int(steps)}" + (" were" if verb else "")


def llama_config(a: DrafterArgs, dtype: torch.dtype) -> dict:
    """LlamaConfig fields of the drafter (``num_hidden_layers`` = ``num_layers``; ``vocab_size`` = verifier vocab, for
    embeddings)."""
    return {
        "model_type": "llama",
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "num_hidden_layers": a.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": a.rope_scaling,
        "max_position_embeddings": a.max_position_embeddings,
        "vocab_size": a.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "dtype": str(dtype).replace("torch.", ""),
    }


def check_context_length(args: DrafterArgs, verifier_context: Optional[int], engine: str) -> None:
    """The draft config's context length against the verifier's, by the engine's rule.

    SGLang 0.5.23 builds the draft's ``ModelConfig`` with the target's context length
    (``speculative/eagle_worker_v2.py``: ``context_length=target ... context_len``) and
    ``ModelConfig._derive_context_length`` (``srt/configs/model_config.py``) raises when it
    exceeds the draft's own (:func:`eagle3.verifier.load.serving_context_length` of the exported
    config) unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``: the server does not start.
    vLLM 0.33 does not refuse: it caps the draft's ``max_model_len`` at the smaller of the two
    (``SpeculativeConfig._maybe_override_draft_max_model_len``) and sizes the draft's rotary table
    by ``max_position_embeddings``, so positions past it are outside what the draft was configured
    for. The drafter's weights do not depend on ``max_position_embeddings`` (rotary angles are
    computed), so re-exporting with a larger value is exact.

    Args:
        args: the drafter's args (``max_position_embeddings``, ``rope_scaling``).
        verifier_context: the verifier's context length (:func:`eagle3.verifier.load.verifier_context_length`);
            ``None`` = unknown, nothing checked.
        engine: ``sglang`` (refused) or ``vllm`` (warned).

    Raises:
        UserError: ``engine == "sglang"`` and the draft's context is shorter, naming
            ``drafter.max_position_embeddings``, both lengths, SGLang's rule and the fix.
    """
    if verifier_context is None:
        return
    draft = serving_context_length(llama_config(args, DEFAULT_EXPORT_DTYPE))
    if draft is None or draft >= verifier_context:
        return
    need = -(
        -verifier_context * args.max_position_embeddings // draft
    )  # scales with any rope factor
    fix = (
        f"set drafter.max_position_embeddings: null (the verifier's) or >= {need} and re-export "
        f"(04_train.py --export-only; the weights do not depend on it, rotary angles are computed)"
    )
    head = (
        f"drafter.max_position_embeddings: {args.max_position_embeddings} gives the draft a context length of "
        f"{draft} tokens, below the verifier's {verifier_context}"
    )
    if engine == "sglang":
        raise UserError(
            f"{head}: SGLang 0.5.23 refuses to start such a draft (ModelConfig._derive_context_length: "
            f"the draft gets the verifier's context length and may not exceed its own unless "
            f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); {fix}"
        )
    log.warning(
        "%s: vLLM caps the draft at %d positions (SpeculativeConfig._maybe_override_draft_max_model_len), "
        "longer requests run the draft past its configured range; %s",
        head,
        draft,
        fix,
    )
