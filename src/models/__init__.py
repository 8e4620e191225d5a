"""Llama-family models: architecture config, file readers, the model, and load_model."""
from .config import ModelConfig
from .llama import KVCache, LlamaForCausalLM
from .load import load_model
from .sources import load_tokenizer
from .tensors import TensorSpec, model_tensors, quant_spec

__all__ = ["ModelConfig", "LlamaForCausalLM", "KVCache", "load_model", "load_tokenizer",
           "quant_spec", "TensorSpec", "model_tensors"]
