"""Shared glue for the numbered CLI scripts: ``--config`` parsing and the error contract."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from eagle3.errors import UserError


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; turn :class:`UserError` into ``error: ...`` on stderr and exit 2.

    A disk-full / quota error (``ENOSPC``/``EDQUOT``) that escaped the atomic writers of
    :mod:`eagle3.io` is reported the same way (one line, exit 2). Any other exception propagates
    with its traceback (a bug, not bad input).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - only a disk-full error is turned into a one-liner
        from eagle3.io import disk_full_error, is_disk_full

        if not is_disk_full(e):
            raise
        # A writer outside eagle3.io (a library's own file) ran out of space: still one line + exit 2.
        err = disk_full_error(getattr(e, "filename", None) or "output", e)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(int(rc or 0))
