#!/usr/bin/env python
"""README's demo table, generated from a demo run's summary (never typed by hand).

    python scripts/demo_table.py outputs/smollm2-135m/demo_summary.json

Prints Markdown: one row per stage (what it produced, wall time), the 01 -> 05 total and the set-up
time: the figures that run printed at its end (scripts/demo_summary.py writes the JSON).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from demo_summary import SUMMARY_NAME, markdown_table  # noqa: E402 - scripts/ put on the path just above

from eagle3.io import read_json  # noqa: E402 - the repository put on the path just above


def main(argv: list[str] | None = None) -> int:
    from eagle3.errors import UserError

    ap = argparse.ArgumentParser(
        prog="demo_table.py",
        description="Print README's demo table (Markdown) from a demo run's summary, which scripts/demo.sh "
        f"(scripts/demo_summary.py) writes at the end of a run as outputs/<run_name>/{SUMMARY_NAME}.",
    )
    ap.add_argument(
        "summary", help=f"the demo's summary JSON, e.g. outputs/smollm2-135m/{SUMMARY_NAME}"
    )
    path = Path(ap.parse_args(sys.argv[1:] if argv is None else argv).summary)
    if not path.is_file():
        raise UserError(f"{path}: not found (scripts/demo.sh writes it at the end of a run)")
    sys.stdout.write(markdown_table(check_summary(read_json(path), path)))
    return 0


def check_summary(summary: Any, path: Path) -> dict:
    """``summary`` when it has what :func:`markdown_table` reads (``stages``: objects with ``stage``,
    ``headline``, ``seconds``; ``stages_seconds``); else a one-line :class:`UserError` naming the file and field."""
    from eagle3.errors import UserError

    hint = f"{path}: not a demo summary ({{}}; scripts/demo_summary.py writes outputs/<run_name>/{SUMMARY_NAME})"
    if not isinstance(summary, dict):
        raise UserError(hint.format(f"a JSON {type(summary).__name__}, not an object"))
    stages = summary.get("stages")
    if not isinstance(stages, list) or not stages:
        raise UserError(hint.format("no 'stages' list"))
    for i, s in enumerate(stages):
        missing = [
            k for k in ("stage", "headline", "seconds") if not isinstance(s, dict) or k not in s
        ]
        if missing:
            raise UserError(hint.format(f"stages[{i}] has no '{missing[0]}'"))
    if "stages_seconds" not in summary:
        raise UserError(hint.format("no 'stages_seconds'"))
    return summary


if __name__ == "__main__":
    from eagle3.cli import run_main

    run_main(main)
