"""Held-out exact match: generate each record's answer from its prompt and compare exactly."""
from typing import NamedTuple

from .data.formats import detect_format, normalize, rename_fields
from .data.jsonl import read_jsonl
from .errors import DataError, check_count
from .generate import generate_batch


class EvalRecord(NamedTuple):
    prompt: object  # a list of {"role", "content"} messages, or a completion's plain text
    answer: str
    where: str  # "file:line", what errors call the record


def read_eval_records(path, fields=None):
    """[EvalRecord] of a JSONL file, checked as training checks it: a chat (or alpaca, or
    ShareGPT) record's last message is the answer and the messages before it the prompt; a
    completion record's prompt is plain text, generated from as it is trained (no template).
    fields: the records' own key names, as data.fields gives them."""
    out = []
    for where, record in read_jsonl(path):
        record = rename_fields(record, fields, where)
        fmt = detect_format(record, where)
        kind, *parts = normalize(record, fmt, where)
        if kind == "text":
            raise DataError(f"{where}: eval scores chat, alpaca or completion records (a prompt "
                            f"and its answer); this one is a {fmt!r} record")
        if kind == "chat" and parts[0][-1]["role"] != "assistant":
            raise DataError(f"{where}: the last message must be the assistant's answer")
        prompt, answer = (parts[0][:-1], parts[0][-1]["content"]) if kind == "chat" else parts
        if not prompt:
            raise DataError(f"{where}: nothing comes before the answer; eval scores the answer "
                            "to a prompt")
        out.append(EvalRecord(prompt, answer, where))
    if not out:
        raise DataError(f"{path}: no records")
    return out


def exact_match(model, records, max_new_tokens=64, limit=None, on_item=None, batch_size=32):
    """Fraction of `records` (read_eval_records') whose greedy answer equals the expected one
    (after strip). Prompts are generated in left-padded batches, with float32 activations:
    8-bit ones apply to batches of one or two prompts only (kernels/activations.py), and a
    record's answer must not depend on the batch it falls in."""
    check_count("eval", "limit", limit, 1, none_ok=True)
    records = records[:limit]
    answers = generate_batch(model, [r.prompt for r in records], max_new_tokens,
                             batch_size=batch_size, int8_activations=False,
                             names=[r.where for r in records])
    hits = 0
    for record, got in zip(records, answers):
        ok = got.strip() == record.answer.strip()
        hits += ok
        if on_item:
            on_item(got, record.answer, ok)
    return {"exact_match": hits / len(records), "correct": hits, "total": len(records)}
