"""Export a trained drafter as the folder a serving engine loads, and read such a folder back.

One writer (:mod:`eagle3.export.writer`) and one reader (:mod:`eagle3.export.reader`) over one format module per
engine (:mod:`eagle3.export.sglang`, :mod:`eagle3.export.vllm`, listed in :data:`eagle3.export.formats.FORMATS`);
plain arguments only: stage 04's glue that reads the run config is :mod:`eagle3.stages.export`.
"""
