"""One training row: input token ids and their (already shifted) target labels."""
from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # label of a position that is not in the loss


class Example:
    """A row of `T` positions; `labels[t]` is the token to predict after `input_ids[:t + 1]`.

    Labels are shifted here, once: for a token sequence `ids`, `input_ids = ids[:-1]` and
    `labels = ids[1:]` with masked targets set to IGNORE_INDEX, so a loss compares
    `logits[t]` with `labels[t]` directly. `segment_ids` (1, 2, ... per packed example) is set
    on packed rows only; `origin` names where the row came from (`file:line`).
    """

    __slots__ = ("input_ids", "labels", "origin", "segment_ids")

    def __init__(self, input_ids, labels, segment_ids=None, origin: str = ""):
        self.input_ids = np.asarray(input_ids, dtype=np.int32)  # (T,)
        self.labels = np.asarray(labels, dtype=np.int64)  # (T,)
        self.segment_ids: np.ndarray | None = (
            None if segment_ids is None else np.asarray(segment_ids, dtype=np.int32))  # (T,)
        self.origin = origin
        if self.input_ids.shape != self.labels.shape or self.input_ids.ndim != 1:
            raise ValueError(f"{origin}: input_ids {self.input_ids.shape} and labels "
                             f"{self.labels.shape} must be equal 1-D shapes")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def num_targets(self) -> int:
        """Positions that count in the loss."""
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))

    def __repr__(self) -> str:
        return f"Example({self.origin or '?'}, tokens={len(self)}, targets={self.num_targets()})"


def from_token_mask(ids: list[int], in_loss: list[bool], origin: str = "") -> Example:
    """Shift a token sequence and its loss mask into an Example (needs >= 2 tokens)."""
    ids_arr = np.asarray(ids, dtype=np.int64)  # (N,)
    mask = np.asarray(in_loss, dtype=bool)  # (N,)
    labels = np.where(mask[1:], ids_arr[1:], IGNORE_INDEX)  # (N-1,)
    return Example(ids_arr[:-1], labels, origin=origin)
