"""Stage 02 under torchrun: this process's rank, CPU-only collectives (gloo) and what the ranks agree on.

Rank 0 alone holds the folder lock (so an independent run is still refused, the job's own ranks are not),
checks the fingerprint, removes temp files, merges leftover ``manifest.rank*.jsonl`` and reconciles the manifest
with the shards; the resulting finished set is broadcast, so every rank derives the same batches. Each rank appends
to its own ``manifest.rank{r}.jsonl``; after an all-gather (the barrier) rank 0 merges them
(:func:`gather_ranks`) and writes ``data_config.json`` last.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from eagle3.capture.folder import merge_rank_manifests
from eagle3.capture.prompts import Sample
from eagle3.capture.report import rate_text
from eagle3.errors import UserError
from eagle3.process_group import init_process_group

log = logging.getLogger(__name__)

DIST_TIMEOUT = timedelta(hours=6)  # ranks wait for the slowest one at the final gather


@dataclass
class Dist:
    """This process's place in a torchrun job (``world == 1``: no torch.distributed, no-op collectives).

    ``group`` is a gloo process group (CPU tensors only), so control traffic never touches a GPU.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None
    initialized_here: bool = False

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        if self.world == 1:
            return obj
        buf = [obj]
        dist.broadcast_object_list(buf, src=0, group=self.group)
        return buf[0]

    def all_gather(self, obj: Any) -> list:
        """``[obj of rank 0, ..., obj of rank world-1]`` on every rank; doubles as a barrier."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on rank 0 only and hand its result to every rank.

        An exception on rank 0 reaches all ranks (so none hangs in the next collective): a
        :class:`UserError` is re-raised with the same message everywhere, anything else is
        re-raised on rank 0 and becomes a ``RuntimeError`` on the others.
        """
        if self.world == 1:
            return fn()
        res, err, exc = None, None, None
        if self.rank == 0:
            try:
                res = fn()
            except BaseException as e:  # noqa: BLE001 - forwarded to the other ranks, then re-raised
                exc = e
                err = (
                    "user" if isinstance(e, UserError) else "bug",
                    str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}",
                )
        res, err = self.broadcast((res, err))
        if exc is not None:
            raise exc
        if err is not None:
            if err[0] == "user":
                raise UserError(err[1])
            raise RuntimeError(f"stage 02 failed on rank 0: {err[1]}")
        return res


def init_dist() -> Dist:
    """torch.distributed (gloo) from the torchrun env when ``WORLD_SIZE > 1``; else a single process.

    Raises:
        UserError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return Dist()
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise UserError(f"WORLD_SIZE/RANK/LOCAL_RANK: not an integer ({e})") from e
    here = False
    if not dist.is_initialized():
        init_process_group(backend="gloo", timeout=DIST_TIMEOUT)
        here = True
    group = (
        dist.group.WORLD
        if dist.get_backend() == "gloo"
        else dist.new_group(backend="gloo", timeout=DIST_TIMEOUT)
    )
    return Dist(rank=rank, world=world, local_rank=local_rank, group=group, initialized_here=here)


def flat_components(comp: dict) -> dict:
    """A fingerprint's components one level flat (``extract.max_length``), for naming the ones that differ."""
    return {
        f"{k}.{k2}" if isinstance(v, dict) else k: v2
        for k, v in comp.items()
        for k2, v2 in (v.items() if isinstance(v, dict) else [(None, v)])
    }


def ranks_agree(d: Dist, mine: Any, shards_dir: Path, prompts_path: Path) -> None:
    """Every torchrun rank must capture under rank 0's settings and prompts: ``mine`` is this rank's
    :func:`flat_components` of its fingerprint (or a ``cannot read ...`` string); a rank that read another config or
    ``prompts.jsonl`` (a node with another copy) would tokenize another sample set.

    Raises:
        UserError: on every rank, naming the first rank that differs from rank 0 and the differing components.
    """
    if d.world == 1:
        return
    everyone = d.all_gather(mine)
    for r, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if isinstance(theirs, str) or isinstance(everyone[0], str):
            what = theirs if isinstance(theirs, str) else f"rank 0: {everyone[0]}"
        else:
            what = "differing: " + ", ".join(
                sorted(
                    k for k in set(theirs) | set(everyone[0]) if theirs.get(k) != everyone[0].get(k)
                )
            )
        raise UserError(
            f"{shards_dir}: torchrun rank {r} read other 02 settings or prompts than rank 0 ({what}); "
            f"every rank must read the same config and {prompts_path} (a node with another copy?)"
        )


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
    return sum(g["written"] for g in ranks), max(
        g["capture_s"] for g in ranks
    )  # wall time of the parallel capture
