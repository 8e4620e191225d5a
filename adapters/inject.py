"""apply_lora: find target linear layers by name, wrap them in LoraLinear, initialise adapters."""
import numpy as np

from ..config_coerce import lora_config
from ..errors import ConfigError
from ..lora_targets import targets_for
from ..nn import Linear, PackedLinear
from ..tensor import Tensor
from .deltas import AdapterDeltas
from .loftq import loftq_init
from .lora import LoraLinear


def linear_modules(model):
    """(path, module) of every frozen linear layer that can carry an adapter."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Linear, PackedLinear))]


def adapter_targets(model, cfg):
    """The Targets (path, shape, rank, alpha, ...) the config selects among the model's linear
    layers (lora_targets.targets_for holds the rules)."""
    return targets_for([(p, m.out_features, m.in_features) for p, m in linear_modules(model)],
                       lora_config(cfg))


def select_targets(model, cfg):
    """Paths of the linear layers the config (a LoraConfig or a dict of its fields) targets;
    unknown names are a ConfigError."""
    return [t.path for t in adapter_targets(model, cfg)]


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
    YAML's `lora:` section). The adapters start fresh, or from the weights of the adapter its
    start_from names (AdapterDeltas.load_into: the modules, ranks and scales must agree).
    Returns the model."""
    cfg = lora_config(cfg)
    if getattr(model, "lora_paths", None):
        raise ConfigError(f"the model already has LoRA adapters on {len(model.lora_paths)} "
                          "modules; apply_lora wraps a model once (load_adapter replaces their "
                          "weights; a new configuration needs a freshly loaded model)")
    device = model.device
    for _, p in model.named_parameters():
        p.requires_grad = False
    init = cfg.init
    targets = adapter_targets(model, cfg)
    mem = device.memory
    for t in targets:
        path = t.path
        layer = LoraLinear(model.get_module(path), t.rank, t.alpha, t.dropout, t.rslora, t.dora)
        if init == "loftq":
            a, b = loftq_init(model, path, layer, cfg.loftq_iter)
        else:
            a, b = _init_adapter(layer, init, device)
        with mem.category("adapters"):
            layer.lora_A = Tensor(device.xp.asarray(a), device).require_grad()
            layer.lora_B = Tensor(device.xp.asarray(b), device).require_grad()
        if layer.use_dora:
            layer.init_dora(device)
        model.set_module(path, layer)
    model.lora_config = cfg
    model.lora_paths = [t.path for t in targets]
    if cfg.start_from:
        AdapterDeltas(cfg.start_from, model.config).load_into(model)
    return model
