"""The serving engines an export is written for: the one engine list, read by the config (``export.engine``), the
command lines (``--engine``), the export writers and readers.

Per engine, the rules live beside the list: :mod:`eagle3.engines.layers` (which aux-layer ids a draft config states)
and :mod:`eagle3.engines.context` (what the engine does with a draft shorter than the verifier). Each engine's folder
format is one writer in ``eagle3/export/`` (``eagle3/export/<engine>.py``, listed in :data:`eagle3.export.formats.FORMATS`).
"""

from __future__ import annotations

from typing import Literal, get_args

from eagle3.errors import UserError

Engine = Literal["sglang", "vllm"]
ENGINES: tuple[str, ...] = get_args(Engine)
"""The engine names, in the order messages list them."""
LABELS: dict[str, str] = {"sglang": "SGLang", "vllm": "vLLM"}
"""How messages and exported folders name each engine."""


def others(engine: str) -> tuple[str, ...]:
    """The engines other than ``engine`` (the ones a folder for ``engine`` must not be served with)."""
    return tuple(e for e in ENGINES if e != engine)


def known(engine: str, field: str = "engine") -> Engine:
    """``engine`` as an :data:`Engine`. Raises :class:`UserError` naming ``field`` when it is not one of :data:`ENGINES`."""
    if engine not in ENGINES:
        raise UserError(f"{field}: unknown engine '{engine}' (expected {spelled()})")
    return engine


def spelled(engines: tuple[str, ...] = ENGINES, quote: bool = False) -> str:
    """``sglang or vllm`` (``'sglang' or 'vllm'`` with ``quote``): a list of engines in a message."""
    return " or ".join(repr(e) if quote else e for e in engines)
