"""Deterministic, resumable batching: shuffled epochs, right padding to the longest row."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import DataError
from .example import IGNORE_INDEX, Example


def count_tokens(examples: Sequence[Example]) -> int:
    """Input positions over all examples (padding not included)."""
    return sum(len(ex) for ex in examples)


def count_targets(examples: Sequence[Example]) -> int:
    """Positions that count in the loss over all examples."""
    return sum(ex.num_targets() for ex in examples)


class Batches:
    """An endless stream of batches over `examples`, one shuffled permutation per epoch.

    `next(batches)` returns `(input_ids int32 (B, T), labels int64 (B, T))`, or with
    `segments=True` also `segment_ids int32 (B, T)` (0 on padding). T is the longest row of the
    batch rounded up to `pad_multiple`; rows are right-padded with `pad_id`, labels with -100.
    The last batch of an epoch may be smaller than `batch_size` unless `drop_last`.
    The permutation of epoch e comes from `default_rng([seed, e])`, so the state is just
    (epoch, position): `load_state_dict(state_dict())` continues exactly where it stopped.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0,
                 shuffle: bool = True, pad_id: int = 0, drop_last: bool = False,
                 pad_multiple: int = 1, segments: bool = False):
        if len(examples) == 0:
            raise DataError("cannot batch an empty dataset")
        if batch_size < 1 or pad_multiple < 1:
            raise ValueError(f"batch_size and pad_multiple must be >= 1, got {batch_size}, "
                             f"{pad_multiple}")
        if drop_last and len(examples) < batch_size:
            raise DataError(f"drop_last with {len(examples)} examples < batch_size {batch_size} "
                            "gives no batch at all")
        self.examples = examples
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.pad_id, self.drop_last = int(pad_id), bool(drop_last)
        self.pad_multiple, self.segments = int(pad_multiple), bool(segments)
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.examples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> tuple:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        start = self.position * self.batch_size
        picked = self._order[start:start + self.batch_size]
        self.position += 1
        return collate([self.examples[int(i)] for i in picked], self.pad_id,
                       self.pad_multiple, self.segments)

    def epoch_batches(self) -> Iterator[tuple]:
        """The remaining batches of the current epoch (a whole epoch on a fresh object)."""
        epoch = self.epoch if self.position < len(self) else self.epoch + 1
        while not (self.epoch == epoch and self.position >= len(self)):
            yield next(self)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_examples": len(self.examples),
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_examples", "batch_size"):
            mine = len(self.examples) if key == "num_examples" else self.batch_size
            if int(state[key]) != mine:
                raise DataError(f"cannot resume batches: the checkpoint has {key}="
                                f"{state[key]}, this run has {mine}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def collate(rows: Sequence[Example], pad_id: int = 0, pad_multiple: int = 1,
            segments: bool = False) -> tuple:
    """Right-pad rows into (input_ids (B, T), labels (B, T)[, segment_ids (B, T)])."""
    longest = max(len(ex) for ex in rows)
    width = -(-longest // pad_multiple) * pad_multiple
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)  # (B, T)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)  # (B, T)
    seg = np.zeros((len(rows), width), dtype=np.int32)  # (B, T)
    for b, ex in enumerate(rows):
        n = len(ex)
        ids[b, :n] = ex.input_ids
        labels[b, :n] = ex.labels
        seg[b, :n] = 1 if ex.segment_ids is None else ex.segment_ids
    return (ids, labels, seg) if segments else (ids, labels)
