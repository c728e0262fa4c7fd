"""The JSON readers: every loader of a ``.jsonl`` file goes through :func:`read_jsonl`, and every
small JSON file of a checkpoint or world (configs, vocabularies) through :func:`read_json`.

Blank lines are skipped; a malformed line or a line that is not a JSON object raises ``error``
(a :class:`~unicon.errors.UserError` subclass chosen by the caller) naming ``file:line`` and the
column, so that a user can open the file at the right place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from unicon.errors import UserError


def read_jsonl(path: str | Path, error: type[Exception] = UserError, what: str = "JSONL file") -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, row)`` for every non-blank line of ``path`` (1-based line numbers)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def read_json(path: str | Path, error: type[Exception] = UserError, what: str = "JSON file"):
    """The parsed content of a JSON file; a missing, unreadable or malformed file raises ``error``
    naming ``file:line:column``."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}:{e.colno}: malformed {what} ({e.msg}; truncated?)") from None
