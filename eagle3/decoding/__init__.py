"""Greedy and EAGLE-3 chain speculative decoding for the stage-05 benchmark: the batched and static decoders, the
offline benchmark over prompt sets, the SGLang server client, the checks of a drafter against its run, the figures
(tau, per-position acceptance, speedup) and the report files."""
