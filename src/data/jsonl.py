"""Reading JSONL files line by line, with errors that name `file:line`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError

BOM = b"\xef\xbb\xbf"


def read_jsonl(path, name: str | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (`name:line`, record) for every non-blank line; each record must be an object."""
    name = name or str(path)
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{name}: a folder, not a JSONL file")
    if not p.is_file():
        raise DataError(f"{name}: dataset file not found")
    with p.open("rb") as f:  # bytes, decoded line by line: an error names its own line
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(BOM):  # Windows editors start with a BOM
                raw = raw[len(BOM):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{name}:{lineno}: not valid UTF-8 ({exc.reason})") from None
            if not line.strip():
                continue
            yield _record(f"{name}:{lineno}", line)


def _record(where: str, line: str) -> tuple[str, dict]:
    """(where, the line's JSON object), or a DataError naming `where`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return where, record
