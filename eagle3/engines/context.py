"""The per-engine context-length rule: what each engine does with a draft whose context is below the verifier's.

04 decides it once, at its start, from the config and the verifier's config (:func:`eagle3.stages.export.
check_export_serves`): refused for SGLang, one warning line for vLLM; the export writes what was decided.
"""

from __future__ import annotations

from typing import Optional

from eagle3.engines import known
from eagle3.errors import UserError
from eagle3.verifier.load import serving_context_length


def draft_context_length(max_position_embeddings: int, rope_scaling: Optional[dict]) -> int:
    """The context length (tokens) an engine derives from the exported draft config, whose only context keys are
    ``max_position_embeddings`` and ``rope_scaling`` (:func:`eagle3.drafter.draft_config.llama_config`,
    ``deepseek_config``): :func:`eagle3.verifier.load.serving_context_length` of those two."""
    return int(
        serving_context_length(
            {"max_position_embeddings": int(max_position_embeddings), "rope_scaling": rope_scaling}
        )
    )


def check_context_length(
    max_position_embeddings: int,
    rope_scaling: Optional[dict],
    verifier_context: Optional[int],
    engine: str,
) -> Optional[str]:
    """The draft's context length against the verifier's, by ``engine``'s rule.

    SGLang 0.5.23 builds the draft's ``ModelConfig`` with the target's context length
    (``speculative/eagle_worker_v2.py``: ``context_length=target ... context_len``) and
    ``ModelConfig._derive_context_length`` (``srt/configs/model_config.py``) raises when it
    exceeds the draft's own (:func:`draft_context_length`) unless
    ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``: the server does not start.
    vLLM 0.33 does not refuse: it caps the draft's ``max_model_len`` at the smaller of the two
    (``SpeculativeConfig._maybe_override_draft_max_model_len``) and sizes the draft's rotary table
    by ``max_position_embeddings``, so positions past it are outside what the draft was configured
    for. The drafter's weights do not depend on ``max_position_embeddings`` (rotary angles are
    computed), so re-exporting with a larger value is exact.

    Args:
        max_position_embeddings, rope_scaling: the draft config's (``DrafterArgs`` fields).
        verifier_context: the verifier's context length (:func:`eagle3.verifier.load.serving_context_length`);
            ``None`` = unknown, nothing checked.
        engine: one of :data:`eagle3.engines.ENGINES`.

    Returns:
        vLLM's warning line for a shorter draft; None when the draft is long enough or nothing is known.

    Raises:
        UserError: an unknown engine; ``engine == "sglang"`` and a shorter draft: one line naming
            ``drafter.max_position_embeddings``, both lengths, SGLang's rule and the fix.
    """
    known(engine, "export.engine")
    if verifier_context is None:
        return None
    draft = draft_context_length(max_position_embeddings, rope_scaling)
    if draft >= verifier_context:
        return None
    need = -(-verifier_context * max_position_embeddings // draft)  # scales with any rope factor
    fix = (
        f"set drafter.max_position_embeddings: null (the verifier's) or >= {need} "
        f"(the weights do not depend on it, rotary angles are computed)"
    )
    head = (
        f"drafter.max_position_embeddings: {max_position_embeddings} gives the draft a context length of "
        f"{draft} tokens, below the verifier's {verifier_context}"
    )
    if engine == "sglang":
        raise UserError(
            f"{head}: SGLang 0.5.23 refuses to start such a draft (ModelConfig._derive_context_length: "
            f"the draft gets the verifier's context length and may not exceed its own unless "
            f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); {fix}"
        )
    return (
        f"{head}: vLLM caps the draft at {draft} positions (SpeculativeConfig._maybe_override_draft_max_model_len), "
        f"longer requests run the draft past its configured range; {fix}"
    )
