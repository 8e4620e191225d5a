"""packlora.training: the training loop and its parts (optimizer, schedule, checkpoints,
metrics)."""
from .run import FinetuneResult, finetune
from .trainer import Trainer, train

__all__ = ["FinetuneResult", "Trainer", "finetune", "train"]
