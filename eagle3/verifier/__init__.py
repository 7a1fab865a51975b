"""The verifier (target) model: loading, tokenizer, config, shapes and the weights fingerprint
(:mod:`~eagle3.verifier.load`), the frozen head training needs (:mod:`~eagle3.verifier.head`) and every
per-architecture fact (:mod:`~eagle3.verifier.arch`)."""
