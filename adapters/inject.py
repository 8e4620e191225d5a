"""apply_lora: find target linear layers by name, wrap them in LoraLinear, initialise adapters."""
import re

import numpy as np

from ..config_coerce import lora_config
from ..errors import ConfigError
from ..lora_targets import matches, pattern_value
from ..nn import Linear, PackedLinear
from ..tensor import Tensor
from .loftq import loftq_init
from .lora import LoraLinear

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def linear_modules(model):
    """(path, module) of every frozen linear layer that can carry an adapter."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear, PackedLinear))]


def select_targets(model, cfg):
    """Paths of the linear layers the config (a LoraConfig or a dict of its fields) targets;
    unknown names are a ConfigError."""
    cfg = lora_config(cfg)
    targets, layers = cfg.targets, cfg.layers
    found = []
    for path, _ in linear_modules(model):
        if not matches(path, targets):
            continue
        m = _LAYER_RE.search(path)
        if layers is not None and (m is None or int(m.group(1)) not in set(layers)):
            continue
        found.append(path)
    if isinstance(targets, list):
        suffixes = {p.rsplit(".", 1)[-1] for p, _ in linear_modules(model)}
        missing = [t for t in targets if not any(p == t or p.endswith("." + t) for p in found)]
        if missing:
            raise ConfigError(f"lora.targets: no module named {missing[0]!r}; available linear "
                              f"modules: {', '.join(sorted(suffixes))}")
    if not found:
        raise ConfigError(f"lora.targets: {targets!r} matched no linear module")
    return found


def _init_adapter(layer, init, device):
    r, k, n = layer.rank, layer.in_features, layer.out_features
    rng = device.rng
    if init == "gaussian":
        a = rng.standard_normal((r, k), dtype=np.float32) / np.float32(r)
    else:  # kaiming-uniform with a = sqrt(5) -> bound 1/sqrt(fan_in), PEFT's default
        bound = 1.0 / np.sqrt(k)
        a = rng.uniform(-bound, bound, size=(r, k)).astype(np.float32)
    b = device.xp.zeros((n, r), dtype=np.float32)
    return a, b


def apply_lora(model, cfg):
    """Wrap the targeted linear layers of `model` in LoRA/DoRA adapters; freeze everything else.
    `cfg` is a packlora.LoraConfig (or a dict with its fields, validated with the defaults of
    YAML's `lora:` section). Returns the model."""
    cfg = lora_config(cfg)
    device = model.device
    for _, p in model.named_parameters():
        p.requires_grad = False
    init = cfg.init
    paths = select_targets(model, cfg)
    mem = device.memory
    for path in paths:
        base = model.get_module(path)
        rank = int(pattern_value(path, cfg.rank_pattern, cfg.rank))
        alpha = float(pattern_value(path, cfg.alpha_pattern, cfg.alpha))
        layer = LoraLinear(base, rank, alpha, cfg.dropout, cfg.use_rslora, cfg.use_dora)
        if init == "loftq":
            a, b = loftq_init(model, path, layer)
        else:
            a, b = _init_adapter(layer, init, device)
        with mem.category("adapters"):
            layer.lora_A = Tensor(device.xp.asarray(a), device).require_grad()
            layer.lora_B = Tensor(device.xp.asarray(b), device).require_grad()
        if layer.use_dora:
            layer.init_dora(device)
        model.set_module(path, layer)
    model.lora_config = cfg
    model.lora_paths = paths
    return model
