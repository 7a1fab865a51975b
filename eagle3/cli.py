"""Shared glue for the numbered CLI scripts: argument parsing and the error contract.

Contract (DESIGN.md, HELPERS): bad user input -> one line ``error: <the flag / --set override / file
and key>: <what is wrong>`` on stderr and exit status 2, never a traceback. :class:`ArgumentParser`
turns argparse's own errors (unknown flag, bad ``type=``, bad choice, missing ``--config``) into
:class:`~eagle3.errors.UserError`; :func:`eagle3.config.load_config` does the same for the config file
and ``--set``; :func:`run_main` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Optional

from eagle3.errors import UserError
from eagle3.io import disk_full_error, is_disk_full
from eagle3.settings.types import check_http_url


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors raise :class:`UserError` instead of printing the usage
    and exiting, so that they follow the ``error: ...`` / exit 2 contract of :func:`run_main` and can be
    caught in-process (``main(argv)`` in tests). ``--help`` still prints and exits 0."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{' '.join(message.split())} (see {self.prog} --help)")


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
    return v


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (message names the flag through argparse)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (message names the flag through argparse)."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def http_url(text: str) -> str:
    """argparse ``type=``: a server base URL (``http(s)://host[:port]``), see :func:`eagle3.settings.types.check_http_url`."""
    try:
        return check_http_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# OS errors that say a user-given path is unusable (permissions, read-only, a file where a folder
# must be...), never a bug in the code: reported as ``error: <path>: <reason>``.
PATH_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
    }
)


def path_error(exc: BaseException) -> Optional[UserError]:
    """The one-line :class:`UserError` for an ``OSError`` on a named path with one of
    :data:`PATH_ERRNOS` (e.g. ``output_root`` under a regular file, or an unwritable folder); else None."""
    if isinstance(exc, OSError) and exc.errno in PATH_ERRNOS and exc.filename is not None:
        return UserError(
            f"{exc.filename}: {exc.strerror or exc} (check the paths in the config and flags)"
        )
    return None


def env_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it for each rank; 1 when it is unset, empty or not an integer (no torch import:
    :func:`run_main` asks it on every error)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def refuse_torchrun(what: str, why: str) -> None:
    """Refuse a one-process stage started by ``torchrun --nproc_per_node N`` (``WORLD_SIZE`` > 1): every rank would run
    the whole stage, N copies writing the same files (03's vocab map and split, an export folder) or, in 05, decoding
    side by side and measuring each other's load as tokens/s. 01, 02 and 04 share the work over the ranks; these do
    not.

    Args:
        what: the command, e.g. ``05_benchmark.py`` or ``04_train.py --export-only``.
        why: what makes it one process (the parenthesis of the message).

    Raises:
        UserError: ``<what> runs in one process (<why>); run it without torchrun (WORLD_SIZE=N)``.
    """
    world = (
        env_world_size()
    )  # (not an integer: not torchrun's value; the stages that use the process group name it)
    if world > 1:
        raise UserError(
            f"{what} runs in one process ({why}); run it without torchrun (WORLD_SIZE={world})"
        )


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; turn :class:`UserError` into ``error: ...`` on stderr and exit 2.

    A disk-full / quota error (``ENOSPC``/``EDQUOT``) that escaped the atomic writers of
    :mod:`eagle3.io`, and an unusable path (:func:`path_error`), are reported the same way (one
    line, exit 2). Any other exception propagates with its traceback (a bug, not bad input). Ctrl-C
    (``KeyboardInterrupt``), and SIGTERM inside :func:`resume_on_interrupt`, print one line ``interrupted by
    SIGINT|SIGTERM[: <hint>]`` and exit ``128 + signal`` (130 / 143).

    Under torchrun (``WORLD_SIZE > 1``) the error line is printed once for the job, by the first rank that stops with
    one (:func:`eagle3.process_group.first_to_report`); every rank still exits 2. A rank torchrun then stops with
    SIGTERM exits 143 without an ``interrupted by`` line; a rank whose collective fails because that rank's process
    is gone (:func:`_peer_gone`) exits 2 without a traceback. A Ctrl-C (or a SIGTERM to every rank) prints its
    ``interrupted by`` line once for the job too, from the first rank that stops on it
    (:func:`eagle3.process_group.first_to_report_interrupt`); every rank exits ``128 + signal``.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        rc = main(argv)
    except UserError as e:
        _exit_with(e)
    except Exception as e:  # noqa: BLE001 - only disk-full and path errors are turned into one-liners
        err = _as_user_error(e)
        if err is None:
            raise
        _exit_with(err)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM inside resume_on_interrupt (Terminated)
        _exit_interrupted(e)
    sys.exit(int(rc or 0))


def _exit_with(err: UserError) -> NoReturn:
    """Print ``error: <err>`` (under torchrun: once for the job, by the first rank to stop) and exit 2."""
    if _first_to_report():
        print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def _as_user_error(e: Exception) -> Optional[UserError]:
    """The one-line error for an unusable path (:func:`path_error`) or a disk-full error a writer outside
    :mod:`eagle3.io` raised (a library's own file); None for a bug (its traceback is kept). A torchrun rank whose
    collective failed because a rank that already reported its error is gone exits 2 here without a line."""
    bad_path = path_error(e)
    if bad_path is not None:
        return bad_path
    if (
        _peer_gone(e) and _another_rank_reported()
    ):  # a rank stopped on bad input: its line is the job's
        sys.exit(2)
    if is_disk_full(e):
        return disk_full_error(getattr(e, "filename", None) or "output", e)
    return None


def _exit_interrupted(e: KeyboardInterrupt) -> NoReturn:
    """Print ``interrupted by SIGINT|SIGTERM[: <hint>]`` (under torchrun: once for the job; not at all on a rank
    torchrun stops after another rank's error) and exit ``128 + signal``."""
    signum = getattr(e, "signum", signal.SIGINT)
    hint = getattr(e, "hint", None)
    quiet = signum == signal.SIGTERM and _another_rank_reported()  # torchrun stopping the job
    if logging.getLogger("torch").level == logging.NOTSET:
        # a signal inside `import torch`, before its logging was set: its atexit INFO lines followed ours
        logging.getLogger("torch").setLevel(logging.WARNING)
    if not quiet and _first_to_report_interrupt():  # under torchrun: one line for the job
        print(
            f"interrupted by {signal.Signals(signum).name}" + (f": {hint}" if hint else ""),
            file=sys.stderr,
        )
    sys.exit(128 + int(signum))


# What a collective raises when a peer rank's process is gone (gloo over TCP, NCCL, torch's DistError family).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "ProcessGroupGloo",
)


def _peer_gone(e: BaseException) -> bool:
    """``e`` is a collective failing because another rank's process ended (torchrun ranks only; torch is imported by
    then). A rank that stopped on bad input exits at once, and a peer blocked in a collective with it (04's
    ``_any_rank`` start-up checks: rank 1 could not read a shards folder rank 0 reads) met ``RuntimeError: [...gloo...]
    Connection closed by peer`` before torchrun's SIGTERM, and printed its traceback under the job's one error line."""
    if not _several_ranks():
        return False
    dist_error = getattr(sys.modules.get("torch.distributed"), "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_GONE)


def _several_ranks() -> bool:
    """This process is one of several torchrun ranks (``WORLD_SIZE > 1``); torch is imported only then."""
    return env_world_size() > 1


def _first_to_report() -> bool:
    """Print the error here? One process: yes; torchrun ranks: the first to stop with one
    (:func:`eagle3.process_group.first_to_report`)."""
    if not _several_ranks():
        return True
    from eagle3.process_group import first_to_report

    return first_to_report()


def _first_to_report_interrupt() -> bool:
    """Print the ``interrupted by`` line here? One process: yes; torchrun ranks: the first to stop on the signal
    (:func:`eagle3.process_group.first_to_report_interrupt`); a rank whose ``import torch`` the signal cut asks the
    agent's store from a child interpreter (:func:`_claim_interrupt_in_child`), and rank 0 prints when that fails."""
    if not _several_ranks():
        return True
    pg = _process_group()
    if pg is not None:
        return pg.first_to_report_interrupt()
    claimed = _claim_interrupt_in_child()
    return claimed if claimed is not None else os.environ.get("RANK", "0") == "0"


# A fresh interpreter claims the interrupt counter for a rank whose own ``import torch`` was cut (_process_group).
_CLAIM_INTERRUPT = (
    "import sys\nfrom eagle3.process_group import first_to_report_interrupt\n"
    "sys.stdout.write('claimed' if first_to_report_interrupt() else 'taken')\n"
)


def _claim_interrupt_in_child(timeout_s: float = 60.0) -> Optional[bool]:
    """Claim the job's ``interrupted by`` counter (:func:`eagle3.process_group.first_to_report_interrupt`) from a
    child interpreter, for a rank whose ``import torch`` a Ctrl-C cut (it cannot import torch again). That rank fell
    back to "rank 0 prints" while the other rank, interrupted after its import, claimed the counter and printed too:
    two lines for one Ctrl-C (``timeout -s INT 3 torchrun --nproc_per_node 2 04_train.py``). Returns None when the
    child gives no answer (then rank 0 prints, as before). SIGTERM is ignored meanwhile: torchrun stops the ranks
    still running after the first one exits, and this rank's line may be the job's only one."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN) if main else None
    try:
        out = subprocess.run(
            [sys.executable, "-c", _CLAIM_INTERRUPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
    return {"claimed": True, "taken": False}.get(out)


def _another_rank_reported() -> bool:
    """A torchrun rank already printed the job's error (:func:`eagle3.process_group.another_rank_reported`)."""
    if not _several_ranks():
        return False
    pg = _process_group()
    return pg.another_rank_reported() if pg is not None else False


def _process_group():
    """:mod:`eagle3.process_group` for the interrupt path, or None when it cannot be imported: a Ctrl-C in a stage's
    first seconds lands inside ``import torch``, whose half-registered operators then make every new import of it
    fail (``RuntimeError: Only a single TORCH_LIBRARY can be used to register the namespace prims``), and each rank
    printed that traceback instead of the ``interrupted by`` line (exit 1, not 130)."""
    if "torch" not in sys.modules and any(
        m.startswith("torch.") for m in sys.modules
    ):  # torch's import was cut
        return None
    try:
        import eagle3.process_group as pg
    except Exception:  # noqa: BLE001 - any failed import: no store to ask, the interrupt is still reported
        return None
    return pg


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an exception by :func:`resume_on_interrupt` (or a signal 04 honours during its start-up,
    ``eagle3.stages.train.stop_before_training``): a ``KeyboardInterrupt`` (so every cleanup
    path written for Ctrl-C runs: ``finally`` blocks, writer threads closed, no barrier in
    :func:`eagle3.process_group.process_group_scope`), carrying ``signum`` for the exit status ``128 + signum``."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


@contextlib.contextmanager
def resume_on_interrupt(hint: Callable[[], str]) -> Iterator[None]:
    """Run a resumable stage's work so that SIGTERM and Ctrl-C end it with one line, not a traceback.

    While the block runs, SIGTERM raises :class:`Terminated` in the main thread (Python runs signal handlers
    only there; worker threads are never interrupted, they are closed by the cleanup paths that Ctrl-C's
    ``KeyboardInterrupt`` already takes). A ``KeyboardInterrupt`` leaving the block gets ``hint()`` (evaluated
    then: what was kept, and that re-running the same command resumes) attached, unless the interrupted step
    attached its own; :func:`run_main` prints
    ``interrupted by SIGTERM: <hint>`` and exits ``128 + signal`` (143 / 130, as 04 does). A process forked
    inside the block (a tokenizer pool worker) that gets SIGTERM dies of it as before. Outside the main thread
    (a test calling ``main`` from a thread) no handler is installed.
    """
    owner = os.getpid()

    def on_sigterm(signum, frame):
        if os.getpid() != owner:  # a forked child: the default action, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated(signum)

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        yield
    except KeyboardInterrupt as e:
        try:
            if (
                getattr(e, "hint", None) is None
            ):  # one the interrupted step attached knows better (01's sampling)
                e.hint = hint()
        except Exception as err:  # noqa: BLE001 - the hint must never hide the interruption
            e.hint = f"re-run the same command to resume ({type(err).__name__} while counting what was kept: {err})"
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
