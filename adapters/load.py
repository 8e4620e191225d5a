"""load_adapter: an adapter (PEFT folder or llama.cpp LoRA GGUF) into a model's LoRA layers."""
import numpy as np

from ..errors import ConfigError, ModelError
from .inject import apply_lora
from .lora import LoraLinear
from .peft_io import (
    MAGNITUDE,
    adapter_chat_template,
    check_base,
    is_lora_key,
    lora_config_from_peft,
    lora_layers,
    not_lora_weight,
    peft_terms,
    read_adapter,
    settings_file,
    strip_key,
)


def load_adapter(model, adapter_dir):
    """Load a PEFT-format adapter (ours or PEFT's), or a llama.cpp LoRA GGUF, into `model`,
    applying LoRA if needed."""
    cfg, tensors = read_adapter(adapter_dir, model.config)
    weights = {}
    for key, value in tensors.items():
        k = strip_key(key)
        if k.endswith(f".{MAGNITUDE}.weight"):
            k = k[: -len(".weight")]
        weights[k] = value
    other = sorted(k for k in weights if not is_lora_key(k))
    if other:
        raise ModelError(not_lora_weight(adapter_dir, other[0]))
    paths = sorted({k.rsplit(".lora_", 1)[0] for k in weights})
    if not lora_layers(model):
        source = settings_file(adapter_dir)
        lora = lora_config_from_peft(cfg, paths, source)
        try:
            apply_lora(model, lora)
        except ConfigError as e:  # its targets or layers name no module of this model
            raise ModelError(f"{source}: {peft_terms(str(e))}") from None
    for path in paths:
        _assign(model, path, weights, adapter_dir)
    template = adapter_chat_template(adapter_dir)
    if template is not None and getattr(model, "tokenizer", None) is not None:
        model.tokenizer.set_chat_template(template, str(adapter_dir))  # as the run rendered them
    if getattr(model, "base_identity", None):  # shapes fit: is it the base it was trained on?
        check_base(adapter_dir, model.base_identity)
    return model


def _assign(model, path, weights, adapter_dir):
    try:
        layer = model.get_module(path)
    except (AttributeError, IndexError, ValueError):
        raise ModelError(f"{adapter_dir}: adapter has weights for {path!r}, which this model "
                         "does not have") from None
    if not isinstance(layer, LoraLinear):
        raise ModelError(f"{adapter_dir}: {path} has adapter weights but no adapter layer")
    for name, attr in (("lora_A.weight", "lora_A"), ("lora_B.weight", "lora_B"),
                       (MAGNITUDE, "lora_magnitude_vector")):
        value = weights.get(f"{path}.{name}")
        if value is None:
            continue
        cur = getattr(layer, attr)
        if cur is None or tuple(cur.shape) != tuple(value.shape):
            want = None if cur is None else tuple(cur.shape)
            raise ModelError(f"{adapter_dir}: {path}.{name} has shape {tuple(value.shape)}, "
                             f"the model's adapter needs {want}")
        cur.data[...] = cur.device.xp.asarray(value, dtype=np.float32)
