"""Held-out exact match: generate each chat record's last assistant turn and compare exactly."""
import json
from pathlib import Path

from .errors import ConfigError, DataError
from .generate import generate_batch


def read_chat_records(path):
    """[(prompt messages, expected answer)] from a chat-format JSONL file."""
    out = []
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{i}: not a chat record ({e})") from None
        if not msgs or msgs[-1].get("role") != "assistant":
            raise DataError(f"{path}:{i}: the last message must be the assistant's answer")
        out.append((msgs[:-1], msgs[-1]["content"]))
    if not out:
        raise DataError(f"{path}: no records")
    return out


def exact_match(model, path, max_new_tokens=64, limit=None, on_item=None, batch_size=32):
    """Fraction of records whose greedy answer equals the expected one (after strip).
    Prompts are generated in left-padded batches, with float32 activations: 8-bit ones apply
    to batches of one or two prompts only (kernels/activations.py), and a record's answer must
    not depend on the batch it falls in."""
    if limit is not None and not (isinstance(limit, int) and limit >= 1):
        raise ConfigError(f"eval: limit must be a whole number >= 1, or None, got {limit!r}")
    records = read_chat_records(path)[:limit]
    answers = generate_batch(model, [p for p, _ in records], max_new_tokens,
                             batch_size=batch_size, int8_activations=False)
    hits = 0
    for (_, want), got in zip(records, answers):
        ok = got.strip() == want.strip()
        hits += ok
        if on_item:
            on_item(got, want, ok)
    return {"exact_match": hits / len(records), "correct": hits, "total": len(records)}
