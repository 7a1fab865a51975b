"""The ``benchmark`` section (stage 05): the speculative decoding benchmark."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictFloat, StrictInt, field_validator

from eagle3.settings.types import Section, StrList, check_http_url, check_items


class BenchmarkConfig(Section):
    """Stage 05: offline speculative decoding benchmark."""

    datasets: StrList = Field(
        default_factory=lambda: ["humaneval"],
        min_length=1,
        description="'humaneval', 'mtbench', 'gsm8k' (../shared/data) or prompt files",
    )
    num_prompts: Optional[StrictInt] = Field(
        None, ge=1, description="N prompts of each dataset (all if unset), picked by prompt_pick"
    )
    prompt_pick: Literal["first", "spread"] = Field(
        "first",
        description="which num_prompts prompts: 'first' (the first N; every recorded run of this project) or "
        "'spread' (N evenly spaced over the set: MT-bench is stored in category order, so its first "
        "8 are all writing; a first-N subset that leaves categories out is warned about)",
    )
    max_new_tokens: StrictInt = Field(256, ge=1)
    steps: StrictInt = Field(3, ge=1, description="chain draft length k")
    batch_size: StrictInt = Field(
        32,
        ge=1,
        description="prompts decoded together (greedy baseline and EAGLE-3 alike); speedups are measured at this batch size",
    )
    decoder: Literal["auto", "batched", "static"] = Field(
        "auto",
        description="in-process decoder of the greedy baseline and EAGLE-3 alike: 'batched' (transformers' DynamicCache, "
        "any batch size), 'static' (batch 1 only: preallocated caches, every decode step and round phase "
        "replayed as a CUDA graph on CUDA, so a small verifier's step costs its kernels, not the host), "
        "'auto' = static at batch_size 1 on CUDA, else batched (eagle3/decoding/static_decode.py)",
    )
    temperature: StrictFloat = Field(
        0.0,
        ge=0,
        description="0 = greedy chains, every token checked against greedy; > 0 = the baseline samples and EAGLE-3 "
        "samples its drafts from the drafter and decides them by speculative rejection sampling (lossless in "
        "distribution: no per-token verdict; eagle3/decoding/sampling.py); decoder batched",
    )
    top_p: StrictFloat = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus filter of the verifier's and the drafter's distributions at temperature > 0",
    )
    rejection_sample_method: Literal["standard", "block"] = Field(
        "standard",
        description="the rule deciding sampled drafts at temperature > 0 (vLLM's speculative_config key of the same "
        "name): 'standard' (each draft kept with probability min(1, p/q)) or 'block' (block verification, "
        "arXiv 2403.10444: the chain judged as a whole, at least as many drafts kept in expectation); both emit "
        "the verifier's distribution",
    )
    context_lengths: list[StrictInt] = Field(
        default_factory=list,
        description="context-length buckets in prompt tokens (ascending upper edges, e.g. [1024, 2048, 4096, 8192]): "
        "05 adds the set 'context', context_prompts chats per length of earlier GSM8K problems and answers before a "
        "new question (eagle3/data/context_prompts.py), and bench.json / bench.md give tau per bucket of every set; a "
        "length past the verifier's context (less max_new_tokens and steps) is capped there; [] = off",
    )
    context_prompts: StrictInt = Field(4, ge=1, description="prompts per length of context_lengths")
    tie_tolerance: Optional[StrictFloat] = Field(
        None,
        ge=0,
        description="logit gap (verify top-1 minus the logit of greedy's token) up to which a difference from greedy is "
        "counted as a floating-point near-tie, not a failure; default 1e-3 for float32, 0.25 for bf16/fp16",
    )
    server_urls: StrList = Field(
        default_factory=list,
        max_length=2,
        description="SGLang server(s) to benchmark instead of the in-process HF decoder: [spec] or [spec, baseline]; 05 runs in server mode when set (--server overrides)",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/bench")

    @field_validator("context_lengths")
    @classmethod
    def _ascending(cls, v: list[int]) -> list[int]:
        """Bucket edges: positive and strictly ascending (bucket j holds edges[j-1] < tokens <= edges[j])."""
        if any(n < 1 for n in v) or any(a >= b for a, b in zip(v, v[1:])):
            raise ValueError(f"must be positive and ascending, e.g. [1024, 2048, 4096], got {v}")
        return v

    @field_validator("server_urls")
    @classmethod
    def _urls(cls, v):
        return check_items(v, check_http_url)  # one URL string was made a list of one (StrList)
