"""LoRA / DoRA adapters: layers, injection, PEFT-format I/O, llama.cpp LoRA GGUFs in, merging."""
from .inject import apply_lora, linear_modules, select_targets
from .lora import LoraLinear, LoraMatmul
from .load import load_adapter
from .peft_io import adapter_state, save_adapter

__all__ = ["LoraLinear", "LoraMatmul", "apply_lora", "select_targets", "linear_modules",
           "save_adapter", "load_adapter", "adapter_state"]
