#!/usr/bin/env python
"""README's demo table, generated from a demo run's summary (never typed by hand).

    python scripts/demo_table.py outputs/smollm2-135m/demo_summary.json

Prints Markdown: one row per stage (what it produced, wall time), the 01 -> 05 total and the set-up
time: the figures that run printed at its end (scripts/demo_summary.py writes the JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from demo_summary import markdown_table  # noqa: E402 - scripts/ put on the path just above


def main(argv: list[str] | None = None) -> int:
    from eagle3.errors import UserError

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise UserError("usage: python scripts/demo_table.py outputs/<run_name>/demo_summary.json")
    path = Path(args[0])
    if not path.is_file():
        raise UserError(f"{path}: not found (scripts/demo.sh writes it at the end of a run)")
    sys.stdout.write(markdown_table(json.loads(path.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    from eagle3.cli import run_main

    run_main(main)
