"""packlora: LoRA/QLoRA fine-tuning on packed, quantized base weights."""
from . import _env  # noqa: F401  (must run before numpy/numba are imported)
from . import ops
from .autodiff import without_autodiff
from .device import Device
from .errors import (AutodiffError, ConfigError, DataError, DeviceError, ModelError,
                     PackloraError, QuantError, TrainingError)
from .tensor import Tensor, full, ones, randn, uniform, zeros

__all__ = ["Device", "Tensor", "ops", "without_autodiff", "zeros", "ones", "full", "randn",
           "uniform", "DeviceError", "AutodiffError", "QuantError", "ModelError", "ConfigError",
           "DataError", "TrainingError", "PackloraError"]
