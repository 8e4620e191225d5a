"""Config objects from what API callers pass (None, a name, a dict): validated once, here, with
the same defaults and errors as a YAML run config. Code below the API only sees the objects."""
from __future__ import annotations

from pydantic import BaseModel, ValidationError

from .config import LoraConfig, QuantConfig, TrainConfig
from .config_errors import format_errors
from .errors import ConfigError

_FLOAT_NAMES = ("none", "float32", "fp32")


def _validate(cls: type[BaseModel], data: dict, section: str):
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, cls, section, {})) from None


def lora_config(cfg) -> LoraConfig:
    """A LoraConfig from a LoraConfig, a dict of its fields (YAML's `lora:` section) or None
    (the defaults)."""
    if isinstance(cfg, LoraConfig):
        return cfg
    if cfg is None:
        return LoraConfig()
    if isinstance(cfg, dict):
        return _validate(LoraConfig, cfg, "lora")
    raise ConfigError(f"lora: expected a LoraConfig or a dict, got {type(cfg).__name__}")


def train_config(cfg) -> TrainConfig:
    """A TrainConfig from a TrainConfig or a dict of its fields (YAML's `train:` section)."""
    if isinstance(cfg, TrainConfig):
        return cfg
    if isinstance(cfg, dict):
        return _validate(TrainConfig, cfg, "train")
    raise ConfigError(f"train: expected a TrainConfig or a dict, got {type(cfg).__name__}")


def quant_config(quant) -> QuantConfig:
    """A QuantConfig from a QuantConfig, a dict of its fields (YAML's `quant:` section), a format
    name ("nf4", "q8_0", ...; "none"/"float32" keep float32), False (float32) or None (the QLoRA
    default: NF4 with double quantization)."""
    if isinstance(quant, QuantConfig):
        return quant
    if quant is None:
        return QuantConfig()
    if quant is False:
        return QuantConfig(format="none")
    if isinstance(quant, str):
        fmt = quant.strip().lower()
        return _validate(QuantConfig, {"format": "none" if fmt in _FLOAT_NAMES else fmt}, "quant")
    if isinstance(quant, dict):
        fmt = quant.get("format")
        return _validate(QuantConfig, dict(quant, format=fmt.lower()) if isinstance(fmt, str)
                         else quant, "quant")
    raise ConfigError(f"quant: expected a QuantConfig, a dict, a format name or None, got "
                      f"{type(quant).__name__}")
