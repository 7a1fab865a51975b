"""The one copy of the distributed helpers: start and teardown of the torch.distributed process group and a rank's
place in the job, shared by every multi-rank entry point (stage 01 replicas, stage 02 capture, stage 04 training,
``bench/train_throughput.py``).

Teardown contract (no rank may die at interpreter exit with gloo's C++ threads still running, which makes torchrun
report a finished job as failed): a rank (1) imports ``torch._dynamo`` before making the group
(:func:`init_process_group`: a later first import of it pins the group, so ``destroy_process_group`` would leave
its threads and sockets alive), (2) on a clean exit waits at a barrier until every rank is done with collectives,
and (3) destroys the group in a ``finally``, then collects garbage, so its threads are joined while the interpreter
is fully alive. Every entry point runs its work inside :func:`process_group_scope`, which does (2) and (3): a
barrier and the teardown when the block finishes, the teardown without a barrier when an exception
(``KeyboardInterrupt`` and ``SystemExit`` from a signal included) leaves it.

A rank's place in the job is a :class:`Dist` (:func:`init_dist`: from the torchrun environment), whose collectives
run on a gloo control group (CPU objects, never a GPU sync) and are no-ops in a world of 1.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from eagle3.errors import UserError


def init_process_group(**kwargs: Any) -> None:
    """``torch.distributed.init_process_group(**kwargs)``, after importing ``torch._dynamo``.

    The import comes first so that no later first import of it (DDP construction, transformers) pins the
    new group and keeps its gloo threads alive into interpreter exit (module docstring); it stays local because
    it costs seconds and only a process that makes a group needs it.
    """
    import torch._dynamo  # noqa: F401  (side effect: see above)

    dist.init_process_group(**kwargs)


@dataclass
class Dist:
    """This process's place in a torchrun job (``world == 1``: no torch.distributed, the collectives are no-ops).

    Attributes:
        rank, world, local_rank: from the torchrun environment (:func:`torchrun_env`).
        device: the device this rank computes on (None: the caller did not say).
        ctrl_group: a gloo group for control traffic (CPU objects only, never a GPU sync): the default group when
            it is gloo, else a gloo group of all ranks; None in a world of 1.
        initialized_here: this process made the default group (and so tears it down).
        job: what names the work in the error :meth:`on_rank0` raises on the other ranks.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: Optional[torch.device] = None
    ctrl_group: Any = None
    initialized_here: bool = False
    job: str = "the job"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        """Wait for every rank (on the control group)."""
        if self.world > 1:
            dist.barrier(group=self.ctrl_group)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled)."""
        if self.world == 1:
            return obj
        buf = [obj]
        dist.broadcast_object_list(buf, src=0, group=self.ctrl_group)
        return buf[0]

    def all_gather(self, obj: Any) -> list:
        """``[obj of rank 0, ..., obj of rank world-1]`` on every rank; doubles as a barrier."""
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl_group)
        return out

    def agree(self, mine: Any, refusal: Callable[[int, Any, Any], str]) -> None:
        """Refuse a job whose ranks hold different ``mine`` (the settings each read, a decision each made): every
        rank raises ``UserError(refusal(r, rank 0's, rank r's))`` for the first rank ``r`` whose value differs from
        rank 0's. The gather doubles as a barrier; nothing to compare in a world of 1."""
        if self.world > 1:
            require_agreement(self.all_gather(mine), refusal)

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` on rank 0 only and hand its result to every rank.

        An exception on rank 0 reaches all ranks (so none hangs in the next collective): a
        :class:`UserError` is re-raised with the same message everywhere, anything else is
        re-raised on rank 0 and becomes a ``RuntimeError`` (``<job> failed on rank 0: ...``) on the others.
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
            raise RuntimeError(f"{self.job} failed on rank 0: {err[1]}")
        return res


def require_agreement(values: Iterable[Any], refusal: Callable[[int, Any, Any], str]) -> None:
    """Refuse replicas (torchrun ranks, capture servers) that do not all hold the first one's value:
    ``UserError(refusal(i, the first's, the i-th's))`` for the first ``i`` whose value differs. ``values`` is read in
    order and no further than that one (a generator asks the replicas one by one)."""
    it = iter(values)
    first = next(it)
    for i, theirs in enumerate(it, 1):
        if theirs != first:
            raise UserError(refusal(i, first, theirs))


def torchrun_env() -> tuple[int, int, int]:
    """``(world, rank, local_rank)`` from torchrun's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (unset or empty:
    1, 0 and the rank).

    Raises:
        UserError: a value that is not an integer.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        rank = int(os.environ.get("RANK", "0") or 0)
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    except ValueError as e:
        raise UserError(f"WORLD_SIZE/RANK/LOCAL_RANK: not an integer ({e})") from e
    return world, rank, local_rank


def rank_cuda_device(local_rank: int) -> str:
    """``cuda:{local_rank}``: the GPU of one torchrun rank per GPU (stages 01, 02 and 04).

    Raises:
        UserError: ``local_rank`` names no GPU of this machine (more ranks than GPUs).
    """
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise UserError(
            f"LOCAL_RANK={local_rank}: this machine has {n} GPU(s), one rank per GPU; "
            f"start torchrun with --nproc_per_node {n} or fewer"
        )
    return f"cuda:{local_rank}"


def init_dist(
    backend: str = "gloo",
    timeout: Optional[datetime.timedelta] = None,
    device: Optional[torch.device] = None,
    job: str = "the job",
) -> Dist:
    """This process's :class:`Dist`: in a torchrun world (``WORLD_SIZE > 1``) the default process group is made
    (:func:`init_process_group`, unless one exists) and a gloo control group chosen; else a world of 1.

    Args:
        backend: of the default group: ``gloo`` or ``nccl`` (then bound to ``device``).
        timeout: of the default group and of a separate control group (None: torch's default).
        device: this rank's device, recorded in the result.
        job: names the work in :meth:`Dist.on_rank0`'s error.

    Raises:
        UserError: the torchrun variables are not integers.
    """
    world, rank, local_rank = torchrun_env()
    if world <= 1:
        return Dist(device=device, job=job)
    here = not dist.is_initialized()
    if here:
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        if backend == "nccl":
            kw["device_id"] = device
        init_process_group(backend=backend, **kw)
    ctrl = (
        dist.group.WORLD
        if dist.get_backend() == "gloo"
        else dist.new_group(backend="gloo", timeout=timeout)
    )
    return Dist(rank, world, local_rank, device, ctrl, here, job)


def close_process_group(group: Optional[Any] = None, *, barrier: bool = True) -> None:
    """Tear down torch.distributed: barrier on ``group``, then ``destroy_process_group()`` (all groups).

    Does nothing when no process group is initialised. ``destroy_process_group`` runs even when the
    barrier raises (a peer died); the barrier's error then propagates. Garbage is collected afterwards so
    that an unreachable object still holding the group (a DDP wrapper in a reference cycle) releases it now
    and the group's gloo threads are joined before interpreter exit.

    Args:
        group: the group to wait on: a gloo group (the control group when the world is NCCL); None = the
            default group.
        barrier: False on an error path: the other ranks may be blocked in another collective or gone,
            and a barrier would only wait for the group's timeout; the group is destroyed at once.
    """
    if not dist.is_initialized():
        return
    try:
        if barrier:
            dist.barrier(group=group)
    finally:
        dist.destroy_process_group()
        gc.collect()


# Where the ranks of a torchrun job agree on who prints a user error (see first_to_report); one key per restart.
REPORT_KEY = "eagle3/user_error_reported/{restart}"
# ... and on who prints the ``interrupted by SIGINT|SIGTERM`` line of a Ctrl-C (see first_to_report_interrupt).
INTERRUPT_KEY = "eagle3/interrupt_reported/{restart}"


def _agent_store(timeout_s: float):
    """A client of the TCPStore that torchrun's agent hosts for the job (``TORCHELASTIC_USE_AGENT_STORE=True``, the
    default of ``torchrun`` / ``--standalone``: ``MASTER_ADDR:MASTER_PORT`` is the agent's store, alive while any rank
    runs and whether or not this rank made a process group), or None (another launcher, or not reachable)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception:  # noqa: BLE001 - no store: the caller falls back to printing
        return None


def is_rank0() -> bool:
    """This process is the only one or torchrun's rank 0 (``RANK`` unset, empty or 0): the one that says what every
    rank does alike (a verifier replica's norm probe, its load line), so the job's log has it once."""
    return os.environ.get("RANK", "0") in ("", "0")


def rank_tag(prefix: str = "", suffix: str = "") -> str:
    """``rank r/W`` (with ``prefix``/``suffix``) under torchrun (``WORLD_SIZE`` > 1), else "": each replica's progress
    bar and per-replica log lines name their rank (two unlabelled `regenerate` bars and two `regeneration prompts:`
    lines of other figures read as one line said twice; 02's bars say `capture rank r/W`)."""
    world = _world()
    return f"{prefix}rank {os.environ.get('RANK', '0')}/{world}{suffix}" if world > 1 else ""


def _world() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _reports(add: int, timeout_s: float, key: str = REPORT_KEY) -> Optional[int]:
    """The job's count of ranks that reported a user error (``key``: :data:`REPORT_KEY`; :data:`INTERRUPT_KEY`: an
    interruption) after adding ``add`` to it (None: no store)."""
    store = _agent_store(timeout_s)
    if store is None:
        return None
    try:
        return int(
            store.add(key.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), add)
        )
    except Exception:  # noqa: BLE001
        return None


def first_to_report(timeout_s: float = 10.0) -> bool:
    """Whether this process prints the user error (``UserError``) it stops with.

    One process: yes. Under torchrun (``WORLD_SIZE > 1``) the same bad config or file is met by every rank; only the
    first rank to stop with a user error prints it, whichever rank that is: the ranks claim one counter in
    torchrun's agent store (:func:`_agent_store`), and the one that finds it at 0 prints (not always rank 0: when
    only some ranks meet an error, rank 0 may never raise one). The other ranks print nothing and every rank still
    exits 2 (:func:`eagle3.cli.run_main`), so torchrun reports the job as failed. Without the agent's store (a
    launcher other than torchrun setting ``RANK``/``WORLD_SIZE``, or the store unreachable) every rank prints: an
    error is never hidden.
    """
    if _world() <= 1:
        return True
    n = _reports(1, timeout_s)
    return n is None or n == 1


def first_to_report_interrupt(timeout_s: float = 10.0) -> bool:
    """Whether this process prints the ``interrupted by SIGINT|SIGTERM: ...`` line of :func:`eagle3.cli.run_main`.

    One process: yes. Under torchrun a Ctrl-C reaches every rank (the terminal signals the whole foreground process
    group); the first rank to stop on it prints, the others print nothing, through the same counter in torchrun's
    agent store as :func:`first_to_report` (its own key, :data:`INTERRUPT_KEY`, so a user error met at the same time
    is still printed once). Without the agent's store every rank prints.
    """
    if _world() <= 1:
        return True
    n = _reports(1, timeout_s, INTERRUPT_KEY)
    return n is None or n == 1


def another_rank_reported(timeout_s: float = 10.0) -> bool:
    """Under torchrun: a rank already printed a user error (:func:`first_to_report`). torchrun then stops the other
    ranks with SIGTERM, whose ``interrupted by SIGTERM: ...`` line would follow the error though nobody interrupted
    anything; :func:`eagle3.cli.run_main` keeps those ranks quiet (exit 143 still)."""
    if _world() <= 1:
        return False
    n = _reports(0, timeout_s)
    return bool(n)


@contextlib.contextmanager
def process_group_scope(group: Optional[Any] = None, *, owned: bool = True) -> Iterator[None]:
    """Run a block of distributed work, then tear the process group down (:func:`close_process_group`).

    The block finishing (a ``return`` inside it included): a barrier on ``group`` first, so no rank closes its
    sockets while a peer still sends. An exception leaving the block (any ``BaseException``: a ``UserError``,
    a bug, ``KeyboardInterrupt`` / ``SystemExit`` raised on a signal): no barrier (the other ranks may be
    blocked in another collective or gone), the group is destroyed at once and the exception propagates.

    Args:
        group: the group to wait on (a gloo group; the control group when the world is NCCL); None = default.
        owned: False when this process did not make the group (a caller's own, or a world of 1): nothing is
            torn down.
    """
    try:
        yield
    except BaseException:
        if owned:
            close_process_group(group, barrier=False)
        raise
    if owned:
        close_process_group(group, barrier=True)
