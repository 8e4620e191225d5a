"""Readable config errors: pydantic's validation errors as `file: key.path: what is wrong`."""
from __future__ import annotations

import difflib
import re
from typing import Any, get_args

from pydantic import BaseModel, ValidationError


def loc_text(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def section_model(ann: Any) -> type | None:
    """The pydantic section class inside an annotation (unwrapping Optional), or None."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in get_args(ann):
        found = section_model(arg)
        if found is not None:
            return found
    return None


def _model_at(root: type, path: tuple) -> type | None:
    cls = root
    for part in path:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        cls = section_model(field.annotation) if field is not None else None
        if cls is None:
            return None
    return cls


def suggest(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.5)
    return f", did you mean '{close[0]}'?" if close else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TYPE_WORDS = {
    "float_parsing": "a number", "float_type": "a number", "finite_number": "a finite number",
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "bool_parsing": "true or false", "bool_type": "true or false", "string_type": "a string",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "a mapping",
    "model_type": "a mapping", "model_attributes_type": "a mapping",
}


def _describe(err: dict, root: type) -> str:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "extra_forbidden":
        section = _model_at(root, err["loc"][:-1])
        options = section.model_fields if section is not None else ()
        return "unknown key" + suggest(err["loc"][-1], options)
    if kind == "missing":
        return "missing required key"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {_short(value)}"
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return (f"expected one of {', '.join(options)}, got {_short(value)}"
                + suggest(value, options))
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    msg = err["msg"].replace("Input should be", "must be").replace("Input", "value")
    return f"{msg}, got {_short(value)}"


def format_errors(exc: ValidationError, root: type, source: str, origins: dict) -> str:
    """One line per problem: `source: key.path: what is wrong`."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        where = source
        for path, override in origins.items():
            if loc[:len(path)] == path:
                where = f"{source}: override '{override}'"
        key = loc_text(loc)
        line = f"{where}: {key}: {_describe(err, root)}" if key else \
            f"{where}: {_describe(err, root)}"
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)
