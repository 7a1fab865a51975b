"""Stage 03: split, vocab map, validation record; the dataset and batching stage 04 reads."""
