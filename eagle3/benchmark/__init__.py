"""Stage 05: offline and server benchmarks of an exported drafter."""
