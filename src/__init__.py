"""packlora: LoRA/QLoRA fine-tuning on packed, quantized base weights."""
from . import _env  # noqa: F401  (must run before numpy/numba are imported)
from .device import Device
from .errors import (AutodiffError, ConfigError, DataError, DeviceError, ModelError,
                     PackloraError, QuantError, TrainingError)

__all__ = ["Device", "DeviceError", "AutodiffError", "QuantError", "ModelError", "ConfigError",
           "DataError", "TrainingError", "PackloraError"]
