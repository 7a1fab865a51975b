"""User-facing errors: one line, naming the file, line, key or field at fault."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (file, config field, shard...). The CLI prints ``error: <message>`` and exits 2.

    The message must be a single line that names the file and the line/key/field at fault.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
