"""Stage 01's in-process regeneration over N verifier replicas (``torchrun --nproc_per_node N``).

Each rank loads the verifier on ``cuda:LOCAL_RANK`` and answers a round-robin share of the open
conversations (sorted by user turns), appending to its own resume log (rank 0:
``prompts.regen-partial.jsonl``, rank r: ``...rank{r}.jsonl``, keyed by input position). After a
barrier rank 0 merges every log into ``prompts.jsonl`` in input order, the file one process writes.
Gloo process group, timeout 3 hours.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Optional

import torch

from eagle3.chat.template import has_tool_calls
from eagle3.process_group import Dist, init_dist, process_group_scope, rank_cuda_device
from eagle3.regen.regenerate import regenerate
from eagle3.regen.resume_log import PARTIAL_NAME, ResumeLog, log_resuming, logged_positions
from eagle3.verifier.load import load_verifier, stop_token_ids

TIMEOUT = datetime.timedelta(hours=3)
_SUMMED = (
    "answers",
    "new_tokens",
    "truncated",
    "turns_over_context",
    "dropped_over_context",
    "batches",
    "decode_steps",
)


def init_replicas() -> Dist:
    """This rank's :class:`Dist`: a gloo group from the torchrun env when ``WORLD_SIZE > 1``, else
    a world of 1.

    Raises:
        UserError: ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` are not integers.
    """
    return init_dist(timeout=TIMEOUT, job="stage 01")


def ranks_agree(d: Dist, want: dict, fresh: bool, prompts_path: Path) -> bool:
    """The ranks' one decision (``fresh``), after checking that every rank read the same settings
    (source files' sha256 included).

    Raises:
        UserError: on every rank, naming the first rank whose settings or decision differ
            (:meth:`Dist.agree`).
    """

    def refusal(r: int, first: tuple, theirs: tuple) -> str:
        (w0, _), (w, f) = first, theirs
        if w != w0:
            mine, other = json.loads(w), json.loads(w0)
            keys = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
            return (
                f"{prompts_path}: torchrun rank {r} read other 01 settings or prompts.source files "
                f"than rank 0 (differing: {', '.join(keys)}); every rank must read the same config and "
                f"source files (a node with another copy of them?)"
            )
        return (
            f"{prompts_path}: torchrun rank {r} found {prompts_path.name} "
            f"{'up to date' if f else 'out of date'}, rank 0 did not; every rank must see the same "
            f"output folder (a node-local output_root?)"
        )

    d.agree((json.dumps(want, sort_keys=True, default=str), fresh), refusal)
    return fresh


def kept_answers_hint(folder: Path) -> str:
    """The number of distinct regenerated conversations the resume logs in ``folder`` hold (every rank's) and that
    the same command, without ``--force`` (which discards them), resumes: what an interrupted 01 kept."""
    logs = all_logs(folder)
    if not logs:
        return "no regenerated answer was kept yet; re-run the same command (without --force) to start again"
    n = len(logged_positions(logs))
    pattern = folder / PARTIAL_NAME.replace(".jsonl", "*.jsonl")
    return (
        f"{n} regenerated conversation{'' if n == 1 else 's'} kept in {pattern}; "
        "re-run the same command (without --force) to resume"
    )


def log_path(folder: Path, rank: int) -> Path:
    """Rank ``rank``'s resume log in ``folder``."""
    return folder / (
        PARTIAL_NAME if rank == 0 else PARTIAL_NAME.replace(".jsonl", f".rank{rank}.jsonl")
    )


def all_logs(folder: Path) -> list[Path]:
    """Every resume log in ``folder`` (rank 0's first, then the others by rank)."""
    ranked = sorted(
        folder.glob(PARTIAL_NAME.replace(".jsonl", ".rank*.jsonl")),
        key=lambda p: int(p.name.rsplit(".rank", 1)[1].split(".")[0]),
    )
    return [p for p in [folder / PARTIAL_NAME, *ranked] if p.is_file()]


def load_finished(folder: Path, settings: dict, convs: list[dict]) -> dict[int, dict]:
    """Finished conversations of every log, by input position.

    Raises:
        UserError: a log of other settings or input (:meth:`ResumeLog.load`).
    """
    done: dict[int, dict] = {}
    for p in all_logs(folder):
        done.update(ResumeLog(p, settings).load(convs))
    return done


class _GlobalLog:
    """A rank's resume log seen by :func:`regenerate` on its share: local positions written as global ones."""

    def __init__(self, log: ResumeLog, positions: list[int]):
        self.log, self.positions = log, positions

    def load(self, conversations) -> dict:
        return {}  # finished conversations were taken out of the share already

    def open(self) -> None:
        self.log.open()

    def append_many(self, entries) -> None:
        self.log.append_many([(self.positions[i], conv) for i, conv in entries])

    def close(self) -> None:
        self.log.close()


def share(convs: list[dict], open_positions: list[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s positions: the open conversations by user turns (most first, then position), dealt round-robin."""
    order = sorted(
        open_positions, key=lambda i: (-sum(m["role"] == "user" for m in convs[i]["messages"]), i)
    )
    return sorted(order[rank::world])


def merge_stats(parts: list[dict], resumed: int, kept_with_tools: int) -> dict:
    """One report's regeneration stats from every rank's: counts summed, seconds the slowest rank's."""
    out = {k: sum(p.get(k, 0) for p in parts) for k in _SUMMED}
    out.update(
        seconds=max(p.get("seconds", 0.0) for p in parts),
        resumed=resumed,
        kept_with_tools=kept_with_tools,
        replicas=len(parts),
        engine=parts[0].get("engine"),
    )
    if any("engine_stats" in p for p in parts):
        out["engine_stats"] = [p.get("engine_stats") for p in parts]  # one per replica
    return out


def assemble(convs: list[dict], finished: dict[int, dict], has_tools) -> list[dict]:
    """The output in input order: tool conversations as they are, the others from the logs; a conversation in
    neither was left out by the context cap (its first prompt is over it: never logged)."""
    return [
        c if has_tools(c) else finished[i]
        for i, c in enumerate(convs)
        if has_tools(c) or i in finished
    ]


def regenerate_replicas(
    verifier_cfg,
    folder: Path,
    convs: list[dict],
    want: dict,
    stats: dict,
    force: bool = False,
    regen_kwargs: Optional[dict] = None,
) -> Optional[list[dict]]:
    """Regenerate ``convs`` over the torchrun replicas; the conversations on rank 0 (``stats``
    merged), None elsewhere. ``verifier_cfg``: the section each replica loads; ``folder``: the logs'.

    Raises:
        UserError: a resume log of other settings or input.
    """
    d = init_replicas()
    # barrier on success only: peers may be stuck after an error
    with process_group_scope(owned=d.initialized_here):
        if force and d.rank == 0:
            for p in all_logs(folder):
                p.unlink()
        d.barrier()
        finished = load_finished(folder, want, convs)  # refused before the verifier loads
        if d.rank == 0:
            log_resuming(len(finished), len(convs))
        d.barrier()  # every rank has read the logs before any rank appends
        todo = [i for i, c in enumerate(convs) if i not in finished and not has_tool_calls(c)]
        mine = share(convs, todo, d.rank, d.world)
        device = (
            rank_cuda_device(d.local_rank) if d.world > 1 and torch.cuda.is_available() else None
        )
        model, tok = load_verifier(verifier_cfg, device=device)
        # the verifier's stop set, recorded in the report
        stats["stop_token_ids"] = sorted(stop_token_ids(tok))
        st: dict = {}
        regenerate(
            model,
            tok,
            [convs[i] for i in mine],
            stats=st,
            journal=_GlobalLog(ResumeLog(log_path(folder, d.rank), want), mine),
            **(regen_kwargs or {}),
        )
        parts = d.all_gather(st)
        d.barrier()  # every rank's log is complete
        if d.rank != 0:
            return None
        tools = sum(1 for c in convs if has_tool_calls(c))
        stats.update(merge_stats(parts, resumed=len(finished), kept_with_tools=tools))
        return assemble(convs, load_finished(folder, want, convs), has_tool_calls)
