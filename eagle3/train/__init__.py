"""Stage 04: the EAGLE-3 drafter, TTT objective, checkpoints and the trainer."""
