"""Packing short examples into rows of `max_seq_len` positions.

Examples are placed whole, in order, into the current row while they fit; a row that cannot
take the next example is closed (rows are never split mid-example, so the tail of a row may be
shorter than `max_seq_len`). Each packed row carries `segment_ids` (1, 2, ... per example).

Attention is NOT reset at example boundaries by default: with a plain causal mask a token
can see the earlier examples of its row. Labels stay exact (each example's targets are its own
tokens, shifted before packing), so no target crosses a boundary. A consumer that wants
block-diagonal attention builds it from `segment_ids`: query i may see key j iff j <= i and
segment_ids[i] == segment_ids[j].
"""
from __future__ import annotations

import numpy as np

from .example import Example


def pack_examples(examples, max_seq_len: int) -> list[Example]:
    """Greedy in-order packing; every example must already be at most max_seq_len long."""
    rows: list[Example] = []
    group: list[Example] = []
    used = 0
    for ex in examples:
        if len(ex) > max_seq_len:
            raise ValueError(f"{ex.origin}: example of {len(ex)} tokens exceeds "
                             f"max_seq_len={max_seq_len}; truncate before packing")
        if group and used + len(ex) > max_seq_len:
            rows.append(_join(group))
            group, used = [], 0
        group.append(ex)
        used += len(ex)
    if group:
        rows.append(_join(group))
    return rows


def _join(group: list[Example]) -> Example:
    ids = np.concatenate([ex.input_ids for ex in group])  # (T,)
    labels = np.concatenate([ex.labels for ex in group])  # (T,)
    segments = np.concatenate([np.full(len(ex), i + 1, dtype=np.int32)
                               for i, ex in enumerate(group)])  # (T,)
    origin = group[0].origin if len(group) == 1 else f"{group[0].origin}+{len(group) - 1}"
    return Example(ids, labels, segment_ids=segments, origin=origin)
