"""The per-engine context-length rule: what each engine does with a draft whose context is below the verifier's.

Stage 04 warns at start (:func:`check_context_length` with ``sglang``); the export refuses the SGLang folder and warns
for vLLM by the same rule.
"""

from __future__ import annotations

import logging
from typing import Optional

from eagle3.drafter.args import DrafterArgs
from eagle3.drafter.draft_config import DEFAULT_EXPORT_DTYPE, llama_config
from eagle3.engines import spelled
from eagle3.errors import UserError
from eagle3.verifier.load import serving_context_length

log = logging.getLogger(__name__)


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
        engine: ``sglang`` (refused) or ``vllm`` (warned); another name is refused as unknown.

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
    if engine != "vllm":
        raise UserError(f"unknown engine '{engine}' (expected {spelled()})")
    log.warning(
        "%s: vLLM caps the draft at %d positions (SpeculativeConfig._maybe_override_draft_max_model_len), "
        "longer requests run the draft past its configured range; %s",
        head,
        draft,
        fix,
    )
