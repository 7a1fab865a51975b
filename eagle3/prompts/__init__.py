"""Stage 01: prompt readers, chat rendering, regeneration by the verifier (local or served)."""
