"""The four JSONL record formats: detection from keys and checking into a common shape."""
from __future__ import annotations

from ..config_errors import suggest
from ..errors import DataError

FORMATS = ("text", "completion", "alpaca", "chat", "sharegpt")
ROLES = ("system", "user", "assistant")
_KEYS = {"text": ("text",), "completion": ("prompt", "completion"),
         "alpaca": ("instruction", "output"), "chat": ("messages",),
         "sharegpt": ("conversations",)}
# every key a format reads: what data.fields can name a record's own key for
FIELDS = (*dict.fromkeys(k for keys in _KEYS.values() for k in keys), "input")
# ShareGPT's speakers (as Axolotl, LLaMA-Factory and Unsloth read them) as chat roles
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}


def detect_format(record: dict, where: str) -> str:
    """The format a record's keys announce: chat, sharegpt, alpaca, completion or text."""
    for fmt in ("chat", "sharegpt", "alpaca", "completion", "text"):
        if all(k in record for k in _KEYS[fmt]):
            return fmt
    raise DataError(f"{where}: cannot detect the format from keys {sorted(record)}; expected "
                    "'text', 'prompt'+'completion', 'instruction'+'input'+'output', "
                    "'messages' or 'conversations'")


def check_fields(fields: dict) -> dict:
    """data.fields (eval's --field): each key a format reads (FIELDS) to a key of the records;
    ValueError names the first wrong one."""
    for ours, theirs in fields.items():
        if ours not in FIELDS:
            raise ValueError(f"{ours}: no format reads this key (they read "
                             f"{', '.join(FIELDS)}){suggest(ours, FIELDS)}")
        if not theirs:  # (a string: the config's type and argparse see to that)
            raise ValueError(f"{ours}: expected the name of a key of the records, got "
                             f"{theirs!r}")
    return fields


def rename_fields(record: dict, fields: dict, where: str) -> dict:
    """`record` with its keys renamed as data.fields says ({format's key: record's key}; empty
    or None: as it is); a record missing a key the mapping names (other than alpaca's optional
    input) is an error."""
    if not fields:
        return record
    missing = [f"'{theirs}' (data.fields.{ours})" for ours, theirs in fields.items()
               if theirs not in record and ours != "input"]
    if missing:
        raise DataError(f"{where}: no key {', '.join(missing)}; the record has keys "
                        f"{sorted(record)}")
    out = {k: v for k, v in record.items() if k not in fields.values()}
    out.update((ours, record[theirs]) for ours, theirs in fields.items() if theirs in record)
    return out


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


def _messages(record: dict, where: str, fmt="chat", names=("role", "content"),
              roles=None) -> list[dict]:
    """A chat's messages, checked: the format's key holds a list of objects with the fields
    `names` (a role and a text); `roles` maps the record's role names to chat roles (None:
    ROLES as they are)."""
    key = _KEYS[fmt][0]
    if key not in record:
        raise DataError(f"{where}: missing key '{key}' (format '{fmt}')")
    messages = record[key]
    role, text = names
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: '{key}' must be a non-empty list of "
                        f"{{'{role}', '{text}'}} objects")
    roles = roles or {r: r for r in ROLES}
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or role not in m or text not in m:
            raise DataError(f"{where}: {key}[{i}] must be an object with '{role}' and '{text}'")
        if not isinstance(m[role], str) or m[role] not in roles:
            raise DataError(f"{where}: {key}[{i}].{role} must be one of {', '.join(roles)}, "
                            f"got {m[role]!r}")
        if not isinstance(m[text], str):
            raise DataError(f"{where}: {key}[{i}].{text} must be a string, got "
                            f"{type(m[text]).__name__}")
        out.append({"role": roles[m[role]], "content": m[text]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: '{key}' has no assistant message to train on")
    return out


def _untrained(record: dict, where: str, fmt: str) -> frozenset:
    """Indices of the messages whose "weight" is 0: OpenAI's fine-tuning format keeps such an
    assistant message in the conversation but out of the loss (1, or no weight: trained)."""
    key, out = _KEYS[fmt][0], set()
    for i, m in enumerate(record[key]):
        weight = m.get("weight", 1)
        if isinstance(weight, str) or weight not in (0, 1):
            raise DataError(f"{where}: {key}[{i}].weight must be 0 (not trained on) or 1, got "
                            f"{weight!r}")
        if weight == 0:
            out.add(i)
    return frozenset(out)


def _conversations(record: dict, where: str) -> list[dict]:
    """A ShareGPT record's turns as chat messages: {"from", "value"} turns, or {"role",
    "content"} ones (as Unsloth's standardize_sharegpt leaves them)."""
    turns = record.get("conversations")
    first = turns[0] if isinstance(turns, list) and turns else None
    names = ("role", "content") if isinstance(first, dict) and "from" not in first \
        and "role" in first else ("from", "value")
    return _messages(record, where, "sharegpt", names, SHAREGPT_ROLES)


def normalize(record: dict, fmt: str, where: str) -> tuple:
    """Check a record and return ("text", text), ("completion", prompt, completion) or
    ("chat", messages, untrained); alpaca records become a user/assistant chat, ShareGPT ones
    a chat. `untrained`: the indices of messages with weight 0 (kept out of the loss)."""
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
                         {"role": "assistant", "content": output}], frozenset())
    if fmt in ("chat", "sharegpt"):
        messages = _messages(record, where) if fmt == "chat" else _conversations(record, where)
        return ("chat", messages, _untrained(record, where, fmt))
    raise DataError(f"{where}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
