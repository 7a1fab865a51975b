"""The ``data`` section (stage 03): validation, token frequencies, draft vocab map, split."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, StrictFloat, StrictInt

from eagle3.settings.types import Section, StrList


class DataConfig(Section):
    """Stage 03: validation, token frequencies, draft vocab map, split."""

    draft_vocab_size: StrictInt = Field(32000, ge=1)
    val_fraction: StrictFloat = Field(0.05, ge=0.0, lt=1.0)
    seed: StrictInt = 0
    train_samples: Optional[StrictInt] = Field(
        None,
        ge=1,
        description="train on a seeded subset of this many samples of the training split (data-scaling "
        "curves: the validation split and the draft vocab map stay those of the whole shard set); null = all",
    )
    exclude_id_prefixes: StrList = Field(
        default_factory=list,
        description="drop training samples whose id (02's manifest.jsonl 'id': 01's "
        "conversation id, e.g. 'staqc_sql_titles/...' or 'nl2bash/...' for the train-extra pool) starts with one of "
        "these: a data-mix ablation on the same shards (the validation split and the draft vocab map stay those "
        "of the whole shard set, as with train_samples, which applies after it); [] = keep all",
    )
    output_dir: Optional[str] = Field(None, description="default {output_root}/data")
