"""Shared glue for the numbered CLI scripts: ``--config`` parsing and the error contract."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from eagle3.errors import UserError


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; turn :class:`UserError` into ``error: ...`` on stderr and exit 2.

    Any other exception propagates with its traceback (a bug, not bad input).
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(int(rc or 0))
