"""Training data: JSONL datasets in four formats, tokenized, masked, packed and batched."""
from .batches import Batches, collate, count_targets, count_tokens
from .dataset import DataStats, Examples, build_datasets, load_dataset, split_validation
from .example import IGNORE_INDEX, Example
from .formats import FORMATS, detect_format
from .packing import pack_examples

__all__ = [
           "FORMATS",
           "IGNORE_INDEX",
           "Batches",
           "DataStats",
           "Example",
           "Examples",
           "build_datasets",
           "collate",
           "count_targets",
           "count_tokens",
           "detect_format",
           "load_dataset",
           "pack_examples",
           "split_validation",
]
