"""The export format of each engine (one module a format) and what follows from the list: which engine serves which
drafter variant, which tensors a folder holds, which format a ``config.json`` is in.

A format module (:mod:`eagle3.export.sglang`, :mod:`eagle3.export.vllm`) states ``ENGINE``, ``ARCH``, ``KEYS`` (the
one-layer tensor names), ``UPPER_NORM`` (the pre-attention norm name it applies in layers ``i >= 1``), ``SERVES``
(variant -> model code read), ``IDS_KEY``, ``LAYER0``, ``VOCAB_MAP_REFUSAL``, and ``writes_vocab_map``, ``warn_dtype``, ``build_config``,
``is_format``, ``layer_source``, ``layer_ids``, ``mla_refusal``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Optional

from eagle3.drafter.args import VARIANTS
from eagle3.engines import ENGINES
from eagle3.errors import UserError
from eagle3.export import sglang, vllm
from eagle3.export.common import FC_NORM_KEYS, HEAD_KEYS, upper_layer_keys

FORMATS: dict[str, ModuleType] = {"vllm": vllm, "sglang": sglang}
"""Engine -> its format module, one entry an engine of :data:`eagle3.engines.ENGINES`, in the order
:func:`format_of` tries them (the speculators keys first: they are unambiguous)."""
VARIANT_ENGINES = {
    v: {e: FORMATS[e].SERVES[v] for e in ENGINES if v in FORMATS[e].SERVES} for v in VARIANTS
}
"""Which engine serves which drafter variant, and the model code read to say so."""


def required_keys(
    engine: str,
    variant: str = "eagle3",
    num_layers: int = 1,
    layer0: Optional[tuple[str, ...]] = None,
) -> tuple[str, ...]:
    """Tensor names an export for ``engine`` must hold (``embed_tokens.weight`` optional): the format's ``KEYS``
    (``layer0``: layer 0's names without prefix instead, e.g. :func:`eagle3.export.common.layer_keys` of an MLA
    drafter), plus :data:`FC_NORM_KEYS` for ``eagle3.1`` and :func:`upper_layer_keys` for a deeper drafter."""
    fmt = FORMATS[engine]
    base = fmt.KEYS if layer0 is None else tuple(fmt.LAYER0 + k for k in layer0) + HEAD_KEYS
    return base + (FC_NORM_KEYS if variant == "eagle3.1" else ()) + upper_layer_keys(num_layers)


def check_engine_serves(engine: str, variant: str, mla: Optional[dict] = None) -> None:
    """Refuse an export of a drafter ``variant`` for an ``engine`` that cannot serve it (:data:`VARIANT_ENGINES`),
    and of an MLA drafter (``mla``: its sizes, ``DrafterArgs.mla``) whose sizes the engine's MLA draft class cannot
    build (the format's ``mla_refusal``).

    Raises:
        UserError: one line naming the engine and the variant or setting.
    """
    serving = VARIANT_ENGINES[variant]  # variant: one of VARIANTS (DrafterArgs' Literal)
    why = FORMATS[engine].mla_refusal(mla) if mla is not None else None
    if why or engine not in serving:
        raise UserError(
            f"export.engine: {engine} cannot serve this MLA drafter: {why}"
            if why
            else f"export.engine: {engine} cannot serve an {variant} drafter (its EAGLE-3 model code has no "
            f"{variant} layers); export for {' or '.join(sorted(serving))}, or train with drafter.variant: eagle3"
        )


def format_of(cfg: dict, path: Path) -> ModuleType:
    """The format module a ``config.json`` dict (read from ``path``) is in.

    Raises:
        UserError: neither format (naming ``architectures`` and the expected values).
    """
    for fmt in FORMATS.values():
        if fmt.is_format(cfg):
            return fmt
    archs = cfg.get("architectures") or []
    expected = " or ".join(f"[{FORMATS[e].ARCH!r}]" for e in ENGINES)
    raise UserError(f"{path}: key 'architectures' is {archs}; expected {expected}")
