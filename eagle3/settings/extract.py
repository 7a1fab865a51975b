"""The ``extract`` section (stage 02): verifier prefill and hidden-state capture."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator

from eagle3.settings.types import ItemError, Section, StrOrList, check_http_url, check_items


class ExtractConfig(Section):
    """Stage 02: verifier prefill and hidden-state capture."""

    backend: Literal["hf", "sglang"] = "hf"
    aux_layers: Optional[list[int]] = Field(
        None,
        description="HF hidden_states indices (0 = embeddings, i = input of decoder layer i); default [2, N//2, N-3]",
    )
    max_length: StrictInt = Field(2048, ge=8)
    too_long: Literal["truncate", "skip"] = "truncate"
    loss_on_reasoning: StrictBool = Field(
        True,
        description="train on the reasoning tokens of a reply (<think>...</think>) too; false = only the answer, "
        "tool calls and end-of-turn token",
    )
    batch_tokens: StrictInt = Field(
        16384,
        ge=1,
        description="padded tokens per capture batch: one HF prefill, or one batch of /generate requests to the SGLang server(s)",
    )
    rows_per_dir: StrictInt = Field(2000, ge=1, description="samples per rows_{start}-{end} folder")
    write_threads: Optional[StrictInt] = Field(
        None,
        ge=0,
        description="background threads that serialise, hash and atomically write shards while the "
        "verifier captures the next batch; null = min(8, usable cores / local ranks); 0 = serial (no overlap; "
        "same bytes on disk either way)",
    )
    tokenize_workers: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="processes that tokenize conversations and build loss masks; null = the usable CPU "
        "cores divided by the local torchrun ranks; 1 = in-process (the result is the same for any count)",
    )
    sglang_url: Optional[StrOrList] = Field(
        None,
        description="the patched SGLang server's URL, or a list of them (one per node): batches are spread over "
        "them, a failing server's batches retried on the others; the shards are the same as with one server",
    )
    capture_dir: Optional[StrOrList] = Field(
        None,
        description="where the patched SGLang server writes tensors (its --capture-dir as this host sees it); "
        "a list with one folder per sglang_url entry, in the same order, when there are several servers",
    )
    batches_in_flight_per_server: StrictInt = Field(
        2,
        ge=1,
        description="several sglang servers: batches sent to one server at a time (captured batches wait in "
        "host memory until written: at most this x servers)",
    )
    server_max_failures: StrictInt = Field(
        3,
        ge=1,
        description="several sglang servers: failed batches in a row that take a server out of rotation",
    )
    sglang_tp_size: StrictInt = Field(
        1, ge=1, description="--tp-size the capture server was launched with (recorded in metadata)"
    )
    sglang_timeout_s: StrictFloat = Field(
        600.0, gt=0, description="HTTP timeout of one /generate batch"
    )
    requests_per_batch: StrictInt = Field(
        64, ge=1, description="max prompts per /generate POST (sglang backend)"
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/shards")
    disk_margin: StrictFloat = Field(
        0.05,
        ge=0,
        description="disk plan: free space required beyond the estimated bytes, as a fraction of the "
        "estimate (the larger of this and disk_margin_bytes); 02 refuses to start without it (--ignore-disk-check)",
    )
    disk_margin_bytes: StrictInt = Field(
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
    fp8_block_size: StrictInt = Field(
        128, ge=1, description="fp8 per_block only: columns per scale (must divide the hidden size)"
    )

    @field_validator("aux_layers", mode="before")
    @classmethod
    def _no_booleans(cls, v):
        """A YAML boolean is not a layer index (lax ``list[int]`` would read ``true`` as 1)."""
        if isinstance(v, list) and any(isinstance(i, bool) for i in v):
            raise ValueError("expected a number, not a boolean")
        return v

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
