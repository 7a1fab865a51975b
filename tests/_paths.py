"""PYTHONPATH for a test's child process."""

from __future__ import annotations

import os
from pathlib import Path


def pythonpath(*dirs: Path | str) -> str:
    """``dirs`` first, then every entry of this process's PYTHONPATH (a machine whose packages come by PYTHONPATH,
    as gpu-carry's wheels on a lent GPU do, keeps them in the child)."""
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(d) for d in dirs] + kept)


def child_env(*dirs: Path | str, **extra: str) -> dict[str, str]:
    """This process's environment for a CPU child (a torchrun of gloo ranks, a stage run on a tiny model): ``dirs``
    first on PYTHONPATH, one intra-op thread, no GPU (two ranks on a one-GPU machine would each ask for
    ``cuda:LOCAL_RANK``), plus ``extra``."""
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=pythonpath(*dirs),
        **extra,
    )
