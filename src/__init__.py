"""packlora: LoRA/QLoRA fine-tuning on packed, quantized base weights."""
from . import (
    _env,  # noqa: F401  (must run before numpy/numba are imported)
    memory,
    ops,
)
from .adapters import apply_lora, load_adapter, save_adapter
from .autodiff import without_autodiff
from .config import DataConfig, LoraConfig, QuantConfig, RunConfig, TrainConfig, load_config
from .device import Device
from .errors import (
    AutodiffError,
    ConfigError,
    DataError,
    DeviceError,
    ModelError,
    PackloraError,
    QuantError,
    TrainingError,
)
from .export import export_model
from .generate import generate, generate_batch
from .gguf_out.adapter import export_gguf_adapter
from .gguf_out.merge import merge_to_gguf
from .models import load_model, load_tokenizer
from .tensor import Tensor, full, ones, randn, uniform, zeros
from .training import finetune, train


def merge(model, adapter, out, dtype="float32", quantize=None, base=None):
    """Merge a PEFT-format adapter into `model` (a name, folder or .gguf) and write, streaming
    tensor by tensor, a Hugging Face folder to `out` (float `dtype`, or packed in the `quantize`
    format) or, when `out` ends in .gguf, one GGUF file (`quantize`: the linear weights' type
    or preset, which a float embedding and head follow as llama.cpp's quantizer would; default:
    as in a GGUF base). base: "float" or "quantized", what float base
    weights take the adapter on (see `packlora merge --help`)."""
    if str(out).lower().endswith(".gguf"):
        return merge_to_gguf(model, adapter, out, quantize_to=quantize, base_mode=base)
    return export_model(model, out, adapter=adapter, dtype=dtype, quantize=quantize,
                        base_mode=base)


__all__ = ["Device", "Tensor", "ops", "memory", "without_autodiff", "zeros", "ones", "full",
           "randn", "uniform", "load_model", "load_tokenizer", "generate", "generate_batch",
           "apply_lora",
           "save_adapter", "load_adapter", "merge", "export_gguf_adapter",
           "merge_to_gguf", "finetune", "train", "LoraConfig",
           "TrainConfig", "QuantConfig", "DataConfig", "RunConfig", "load_config",
           "DeviceError", "AutodiffError", "QuantError", "ModelError", "ConfigError",
           "DataError", "TrainingError", "PackloraError"]
