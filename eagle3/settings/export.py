"""The ``export`` section: the trained drafter's folder for a serving engine."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from eagle3.engines import Engine
from eagle3.settings.types import Section


class ExportConfig(Section):
    """Export of the trained drafter for a serving engine."""

    engine: Engine = Field(
        "sglang",
        description="the engine the folder is for; each engine takes only its own folder (layer-id conventions differ)",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype of the exported weights and config.json torch_dtype; auto = the serving dtype: "
        "verifier.dtype, but bfloat16 when verifier.dtype is float32 (an exactness setting; SGLang --dtype auto "
        "serves a float32 draft as float16, vLLM casts the draft to the verifier's dtype)",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/drafter-{engine}")
