"""Stage 04's pieces, taking plain arguments: the TTT training loop, data order, resume and checkpoints, warm start,
metrics and report (the stage itself: :mod:`eagle3.stages.train`)."""
