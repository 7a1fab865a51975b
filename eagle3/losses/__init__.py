"""The TTT losses: the per-token losses by name (reference and fused row kernel), the TTT targets, masks and the
step-normalised sums (DESIGN.md "TTT indexing", "Loss normalisation")."""
