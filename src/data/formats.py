"""The four JSONL record formats: detection from keys and checking into a common shape."""
from __future__ import annotations

from ..errors import DataError

FORMATS = ("text", "completion", "alpaca", "chat")
ROLES = ("system", "user", "assistant")
_KEYS = {"text": ("text",), "completion": ("prompt", "completion"),
         "alpaca": ("instruction", "output"), "chat": ("messages",)}


def detect_format(record: dict, where: str) -> str:
    """The format a record's keys announce: chat, alpaca, completion or text."""
    for fmt in ("chat", "alpaca", "completion", "text"):
        if all(k in record for k in _KEYS[fmt]):
            return fmt
    raise DataError(f"{where}: cannot detect the format from keys {sorted(record)}; expected "
                    "'text', 'prompt'+'completion', 'instruction'+'input'+'output' or "
                    "'messages'")


def _string(record: dict, key: str, where: str, fmt: str, required: bool = True) -> str:
    if key not in record:
        if not required:
            return ""
        raise DataError(f"{where}: missing key '{key}' (format '{fmt}')")
    value = record[key]
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _messages(record: dict, where: str) -> list[dict]:
    if "messages" not in record:
        raise DataError(f"{where}: missing key 'messages' (format 'chat')")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        "{'role', 'content'} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, "
                            f"got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: messages[{i}].content must be a string, got "
                            f"{type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: 'messages' has no assistant message to train on")
    return out


def normalize(record: dict, fmt: str, where: str) -> tuple:
    """Check a record and return ("text", text), ("completion", prompt, completion) or
    ("chat", messages); alpaca records become a user/assistant chat."""
    if fmt == "text":
        return ("text", _string(record, "text", where, fmt))
    if fmt == "completion":
        return ("completion", _string(record, "prompt", where, fmt),
                _string(record, "completion", where, fmt))
    if fmt == "alpaca":
        instruction = _string(record, "instruction", where, fmt)
        extra = _string(record, "input", where, fmt, required=False)
        output = _string(record, "output", where, fmt)
        user = instruction + "\n\n" + extra if extra else instruction
        return ("chat", [{"role": "user", "content": user},
                         {"role": "assistant", "content": output}])
    if fmt == "chat":
        return ("chat", _messages(record, where))
    raise DataError(f"{where}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
