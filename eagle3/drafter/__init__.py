"""The EAGLE-3 draft model: :mod:`~eagle3.drafter.model` (DrafterArgs, Eagle3Drafter), its attention kernels
(:mod:`~eagle3.drafter.attention`), decode KV caches (:mod:`~eagle3.drafter.caches`) and served ``config.json``
(:mod:`~eagle3.drafter.draft_config`)."""
