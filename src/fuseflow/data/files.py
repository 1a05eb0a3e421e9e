"""Reading the small JSON files fuseflow and its users hand each other (configs, indexes, state).

One reader, so that every bad file gets the same one-line error naming the file, the parse error and
where it is, instead of a bare ``json.JSONDecodeError`` that does not say which of a run's files broke.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class BadFileError(ValueError):
    """A file that exists but cannot be read as what it should be; the message names the file."""


def read_json(path: str | Path, what: str | None = None) -> Any:
    """The parsed JSON of ``path``; a read or parse error is one line naming the file.

    ``what`` prefixes the message (e.g. ``"model.path=DIR"``) so the user sees which setting led
    there: ``model.path=m: config.json is not valid JSON: Expecting value (line 1, column 1)``.
    """
    p = Path(path)
    name = f"{what}: {p.name}" if what else str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadFileError(f"{name} is not valid JSON: not UTF-8 text") from None
    except OSError as e:
        raise BadFileError(f"{name} cannot be read ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadFileError(f"{name} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
