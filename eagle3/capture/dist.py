"""Stage 02 under torchrun: what the ranks agree on and how rank 0 folds their results together.

Rank 0 alone holds the folder lock, checks the fingerprint, cleans and reconciles the folder, and
broadcasts the finished set; each rank appends to ``manifest.rank{r}.jsonl``; after an all-gather
rank 0 merges them (:func:`gather_ranks`) and writes ``data_config.json`` last.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

from eagle3.capture.folder import merge_rank_manifests
from eagle3.capture.prompts import Sample
from eagle3.capture.report import rate_text
from eagle3.process_group import Dist

log = logging.getLogger(__name__)

DIST_TIMEOUT = timedelta(hours=6)  # ranks wait for the slowest one at the final gather
JOB = "stage 02"  # names the work in Dist.on_rank0's error on the other ranks


def ranks_agree(d: Dist, mine: Any, shards_dir: Path, prompts_path: Path) -> None:
    """Check that every rank captures under rank 0's settings and prompts (``mine``: this rank's
    :func:`eagle3.capture.resume.flat_components`, or a ``cannot read ...`` string).

    Raises:
        UserError: on every rank, naming the first differing rank and components (:meth:`Dist.agree`).
    """

    def refusal(r: int, first: Any, theirs: Any) -> str:
        if isinstance(theirs, str) or isinstance(first, str):
            what = theirs if isinstance(theirs, str) else f"rank 0: {first}"
        else:
            what = "differing: " + ", ".join(
                sorted(k for k in set(theirs) | set(first) if theirs.get(k) != first.get(k))
            )
        return (
            f"{shards_dir}: torchrun rank {r} read other 02 settings or prompts than rank 0 ({what}); "
            f"every rank must read the same config and {prompts_path} (a node with another copy?)"
        )

    d.agree(mine, refusal)


def gather_ranks(
    root: Path,
    samples: list[Sample],
    done: dict[int, dict],
    gathered: list[dict],
    ranks: list[dict],
) -> tuple[int, float]:
    """Rank 0, multi-process: fold every rank's rows into ``done``, merge the rank manifests;
    returns ``(written, capture wall seconds)`` over all ranks."""
    for g in gathered:
        for row in g.pop("rows"):
            done[row["idx"]] = row
        ranks.append(g)
        log.info(
            "rank %d: %d samples in %.1f s = %s samples/s (%s tok/s)",
            g["rank"],
            g["written"],
            g["capture_s"],
            rate_text(g["samples_per_s"]),
            rate_text(g["tokens_per_s"]),
        )
    missing = [s.idx for s in samples if s.idx not in done]
    if missing:
        raise RuntimeError(f"stage 02: samples {missing[:10]} were assigned to no rank (bug)")
    merge_rank_manifests(root)
    # wall time of the parallel capture
    return sum(g["written"] for g in ranks), max(g["capture_s"] for g in ranks)
