"""Reading record files, with errors that name `file:line`: JSONL line by line, or a file
that is one JSON array of records (`[{...}, {...}]`, as Stanford Alpaca's alpaca_data.json is
published), read whole."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError

BOM = b"\xef\xbb\xbf"
# tables datasets are also published as (Hugging Face's Parquet exports, its cache's Arrow
# files, CSV), and a call that writes one as JSONL records
_PANDAS = "pandas.{}('{{src}}').to_json('{{out}}', orient='records', lines=True)"
CONVERT = {".parquet": _PANDAS.format("read_parquet"), ".csv": _PANDAS.format("read_csv"),
           ".tsv": _PANDAS.format("read_table"), ".feather": _PANDAS.format("read_feather"),
           ".arrow": "datasets.Dataset.from_file('{src}').to_json('{out}')"}


def read_jsonl(path, name: str | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (`name:line`, record) for every non-blank line, or (`name[i]`, record) for every
    item of a file that is one JSON array; each record must be an object."""
    name = name or str(path)
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{name}: a folder, not a JSONL file")
    if not p.is_file():
        raise DataError(f"{name}: dataset file not found")
    if p.suffix.lower() in CONVERT:
        how = CONVERT[p.suffix.lower()].format(src=p.name, out=f"{p.stem}.jsonl")
        raise DataError(f"{name}: a {p.suffix} table; packlora reads JSONL records (or one JSON "
                        f"array of them): convert it first, e.g. {how}")
    started = False
    with p.open("rb") as f:  # bytes, decoded line by line: an error names its own line
        for lineno, raw in enumerate(f, start=1):
            line = _decoded(_without_bom(raw) if lineno == 1 else raw, f"{name}:{lineno}")
            if not line.strip():
                continue
            if not started and line.lstrip().startswith("["):
                break  # one JSON array, not a record per line
            started = True
            yield _record(f"{name}:{lineno}", line)
        else:
            return
    yield from _array(p, name)


def _without_bom(raw: bytes) -> bytes:
    """A file's first bytes without the BOM Windows editors start files with."""
    return raw[len(BOM):] if raw.startswith(BOM) else raw


def _decoded(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 ({exc.reason})") from None


def _record(where: str, line: str) -> tuple[str, dict]:
    """(where, the line's JSON object), or a DataError naming `where`."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})") from None
    return _object(where, record)


def _object(where: str, record) -> tuple[str, dict]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return where, record


def _array(p: Path, name: str) -> Iterator[tuple[str, dict]]:
    """The records of a file that is one JSON array (read whole: its JSON text, then its
    objects, are in memory together)."""
    raw = p.read_bytes()
    text = _decoded(_without_bom(raw), name)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{name}:{exc.lineno}: bad JSON: {exc.msg} (column {exc.colno})") \
            from None
    for i, record in enumerate(records):
        yield _object(f"{name}[{i}]", record)
