"""Loading JSONL datasets into Examples, splitting validation, and the numbers to log."""
from __future__ import annotations

import numpy as np

from ..errors import DataError
from ..tokenizer import read_chat_template
from .batches import count_targets, count_tokens
from .formats import detect_format, normalize, rename_fields
from .jsonl import read_jsonl
from .packing import pack_examples
from .tokenize import make_example

TEMPLATED = ("chat", "alpaca", "sharegpt")  # formats rendered through the model's chat template


class Examples(list):
    """A list of Examples plus where they came from and what loading had to do to them."""

    def __init__(self, items=(), name: str = "", format: str = "", num_records: int = 0,
                 num_truncated: int = 0, num_dropped: int = 0):
        super().__init__(items)
        self.name, self.format = name, format
        self.num_records = num_records  # records read from the file
        self.num_truncated = num_truncated  # records cut to max_seq_len
        self.num_dropped = num_dropped  # records with no target token left (skipped)

    def derive(self, items) -> Examples:
        """Same provenance numbers, other rows (after a split or packing)."""
        return Examples(items, self.name, self.format, self.num_records, self.num_truncated,
                        self.num_dropped)


def load_dataset(path, tokenizer, cfg, source_name: str | None = None) -> Examples:
    """Read, check, tokenize and truncate every record of a JSONL file (no packing)."""
    name = source_name or str(path)
    fmt = cfg.format
    out = Examples(name=name)
    checked = False
    for where, record in read_jsonl(path, name):
        record = rename_fields(record, cfg.fields, where)
        if fmt == "auto":
            fmt = detect_format(record, where)
        if not checked and fmt in TEMPLATED:
            _check_chat_template(tokenizer, name)
        checked = True
        item = normalize(record, fmt, where)
        example, truncated = make_example(item, tokenizer, cfg.train_on_inputs,
                                          cfg.max_seq_len, where)
        out.num_records += 1
        out.num_truncated += int(truncated)
        if example is None:
            out.num_dropped += 1
        else:
            out.append(example)
    out.format = fmt
    if out.num_records == 0:
        raise DataError(f"{name}: the dataset has no records (empty file)")
    if not out:
        raise DataError(f"{name}: none of the {out.num_records} records has a token to train "
                        "on (all masked or too short)")
    return out


def _check_chat_template(tokenizer, name):
    """Chat (and alpaca, rendered as chat) records need a chat template; a tokenizer without one
    must not fall back to ChatML behind the user's back."""
    if not getattr(tokenizer, "has_chat_template", True):
        raise DataError(f"{name}: chat records need a chat template and the model's tokenizer "
                        "has none; set data.chat_template (a jinja template, or a path to a "
                        ".jinja file)")


def use_chat_template(tokenizer, template):
    """Give the tokenizer data.chat_template: a jinja string, or the path of a file holding one
    (any value without a jinja tag: a template without one renders every conversation alike)."""
    if template is None:
        return
    if "{{" in template or "{%" in template:
        tokenizer.set_chat_template(template, "data.chat_template")
    else:
        text = read_chat_template(template, "data.chat_template", DataError)
        tokenizer.set_chat_template(text, f"data.chat_template ({template})")


def split_validation(examples: Examples, val_size, seed: int) -> tuple[Examples, Examples]:
    """Deterministic (train, valid) split: `val_size` is a count or a fraction in (0, 1).

    The provenance counts (truncated, dropped) stay with the train part."""
    n = len(examples)
    count = round(val_size * n) if isinstance(val_size, float) else int(val_size)
    count = max(count, 1)
    if count >= n:
        raise DataError(f"{examples.name}: val_size={val_size} takes {count} of {n} examples, "
                        "leaving none to train on")
    order = np.random.default_rng([seed, 0x5A11]).permutation(n)
    valid_idx, train_idx = np.sort(order[:count]), np.sort(order[count:])
    valid = Examples((examples[i] for i in valid_idx), f"{examples.name} (validation split)",
                     examples.format)
    return examples.derive(examples[i] for i in train_idx), valid


class DataStats:
    """Counts the trainer logs: records, rows, tokens, targets, truncated and dropped."""

    def __init__(self, train: Examples, valid: Examples | None, packed: bool):
        self.format = train.format
        self.packed = packed
        self.train_records = train.num_records
        self.train_rows = len(train)
        self.train_tokens = count_tokens(train)
        self.train_targets = count_targets(train)
        self.truncated = train.num_truncated + (0 if valid is None else valid.num_truncated)
        self.dropped = train.num_dropped + (0 if valid is None else valid.num_dropped)
        self.valid_rows = 0 if valid is None else len(valid)
        self.valid_tokens = 0 if valid is None else count_tokens(valid)

    def as_dict(self) -> dict:
        return dict(vars(self))

    def __repr__(self) -> str:
        return "DataStats(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")"


def build_datasets(cfg, tokenizer, seed: int) -> tuple[Examples, Examples | None, DataStats]:
    """Train rows (shuffled and packed when cfg.packing), valid rows or None, and stats."""
    use_chat_template(tokenizer, cfg.chat_template)
    train = load_dataset(cfg.train, tokenizer, cfg)
    valid = None
    if cfg.valid is not None:
        valid = load_dataset(cfg.valid, tokenizer, cfg)
    elif cfg.val_size:
        train, valid = split_validation(train, cfg.val_size, seed)
    if cfg.packing:
        order = (np.random.default_rng([seed, 0x9AC]).permutation(len(train))
                 if cfg.shuffle else np.arange(len(train)))
        train = train.derive(pack_examples([train[i] for i in order], cfg.max_seq_len))
    return train, valid, DataStats(train, valid, cfg.packing)
