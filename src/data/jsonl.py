"""Reading JSONL files line by line, with errors that name `file:line`."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError


def read_jsonl(path, name: str | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (`name:line`, record) for every non-blank line; each record must be an object."""
    name = name or str(path)
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{name}: a folder, not a JSONL file")
    if not p.is_file():
        raise DataError(f"{name}: dataset file not found")
    with p.open("r", encoding="utf-8-sig") as f:  # -sig: Windows editors start with a BOM
        lineno = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as exc:
                raise DataError(f"{name}:{lineno + 1}: not valid UTF-8 ({exc.reason})") from None
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record
