"""Export a trained drafter for SGLang / vLLM and load it back (after stage 04)."""
