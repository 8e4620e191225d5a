"""Adapters in the PEFT format (adapter_model.safetensors + adapter_config.json), and reading
llama.cpp LoRA GGUFs in that form; load_adapter is in load.py."""
import json
import warnings
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..config_coerce import lora_config
from ..errors import ConfigError, ModelError
from ..fileio import load_safetensors, save_safetensors, write_json, write_text
from ..lora_targets import layer_index
from ..models.identity import base_mismatch, identity_metadata, recorded_identity
from ..models.resolve import is_gguf
from ..nn import Linear, PackedLinear
from ..quant import REGISTRY
from ..run_layout import CONFIG, TEMPLATE, WEIGHTS, step_dirs
from ..tokenizer import chat_template_text, read_chat_template
from .gguf_lora import is_adapter_gguf, read_gguf_lora
from .lora import LoraLinear

PREFIX = "base_model.model."
MAGNITUDE = "lora_magnitude_vector"  # DoRA's per-row magnitude, PEFT's name
PEFT_DEFAULT_RANK = 8  # peft.LoraConfig's defaults for a key its adapter_config.json omits
PEFT_DEFAULT_ALPHA = 8
# LoraConfig's field -> adapter_config.json's key, where the two differ
_PEFT_KEYS = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules",
              "layers": "layers_to_transform"}


def lora_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def adapter_state(model):
    """{PEFT key: float32 numpy array} of every adapter tensor."""
    out = {}
    for path, layer in lora_layers(model):
        out[f"{PREFIX}{path}.lora_A.weight"] = layer.lora_A.numpy().astype(np.float32)
        out[f"{PREFIX}{path}.lora_B.weight"] = layer.lora_B.numpy().astype(np.float32)
        if layer.lora_magnitude_vector is not None:
            out[f"{PREFIX}{path}.{MAGNITUDE}"] = layer.lora_magnitude_vector.numpy()
    return out


# PEFT's init_lora_weights that subtract the adapter's start from the base weights (the
# adapter's file holds no record of those weights)
BASE_REWRITING_INITS = ("pissa", "olora", "corda")
# packlora's lora.init -> PEFT's init_lora_weights (kaiming-uniform A, zero B is PEFT's True)
PEFT_INIT = {"kaiming": True, "gaussian": "gaussian", "loftq": "loftq"}


def adapter_config(model):
    layers = lora_layers(model)
    if not layers:
        raise ModelError("the model has no LoRA adapters; call apply_lora first")
    first = layers[0][1]
    chosen_layers = model.lora_config.layers
    targets = _target_modules(model, [p for p, _ in layers], chosen_layers)
    rank_pattern = {p: m.rank for p, m in layers if m.rank != first.rank}
    alpha_pattern = {p: m.alpha for p, m in layers if m.alpha != first.alpha}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank,
        "lora_alpha": first.alpha, "lora_dropout": first.dropout, "target_modules": targets,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "use_rslora": first.use_rslora, "use_dora": first.use_dora, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": chosen_layers,
        "init_lora_weights": PEFT_INIT.get(model.lora_config.init, True),
        "base_model_name_or_path": str(getattr(model, "source_name", "")
                                       or getattr(model, "source", "")),
        "revision": None,
        **_loftq_fields(model),
    }


def _loftq_fields(model):
    """PEFT refuses init_lora_weights "loftq" without a loftq_config: the bits of the base the
    adapter was fitted to, and how many alternations LoftQ ran."""
    if model.lora_config.init != "loftq":
        return {}
    fmt = (getattr(model, "quant", None) or {}).get("format")
    bits = REGISTRY[fmt].layout.code_bits if fmt in REGISTRY else 4
    return {"loftq_config": {"loftq_bits": bits, "loftq_iter": model.lora_config.loftq_iter}}


def _target_modules(model, paths, layers):
    """Module-name suffixes (PEFT's usual form) when, with `layers`, they select exactly the
    adapted modules; otherwise (a regex picked some of them) the full module paths."""
    suffixes = sorted({p.rsplit(".", 1)[-1] for p in paths})
    adapted = set(paths)
    linear = [n for n, m in model.named_modules() if isinstance(m, (Linear, PackedLinear))
              and n.rsplit(".", 1)[0] not in adapted] + list(paths)  # bases inside adapters out
    wanted = set(layers) if layers is not None else None
    chosen = set()
    for n in linear:
        if n.rsplit(".", 1)[-1] in suffixes and (wanted is None or layer_index(n) in wanted):
            chosen.add(n)
    return suffixes if chosen == adapted else sorted(paths)


def save_adapter(model, out_dir):
    """Write the adapter of `model` to `out_dir` in the PEFT format (atomically, file by file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    identity = getattr(model, "base_identity", None)
    meta = {"format": "pt", **(identity_metadata(identity) if identity else {})}
    save_safetensors(out / WEIGHTS, adapter_state(model), metadata=meta)
    write_json(out / CONFIG, adapter_config(model))
    tok = getattr(model, "tokenizer", None)
    if tok is not None and tok.has_chat_template:  # data.chat_template, or the base's own
        write_text(out / TEMPLATE, tok.chat_template)
    return out


def adapter_chat_template(adapter_dir):
    """The chat template an adapter folder was trained with: its chat_template.jinja, else the
    chat_template of a tokenizer_config.json beside it (transformers' Trainer, TRL and Axolotl
    save the tokenizer with the adapter); None when it has neither."""
    folder = Path(adapter_dir)
    path = folder / TEMPLATE
    if path.is_file():
        return read_chat_template(path)
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read the chat template ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return chat_template_text(cfg.get("chat_template"), path)


def check_adapter_path(adapter_dir):
    """(config path, weights path) of a PEFT adapter folder, or None for a llama.cpp LoRA GGUF;
    a ModelError when it is neither (cheap: callers check before a base model loads)."""
    d = Path(adapter_dir)
    if d.is_file():
        gguf = is_gguf(d)  # by name or first bytes: an Ollama blob has no .gguf name
        if gguf and is_adapter_gguf(d):
            return None
        what = "a model GGUF" if gguf else "a file"
        raise ModelError(f"{d}: {what}, not an adapter ({CONFIG} + {WEIGHTS}: a run's "
                         "output_dir, a checkpoint, a PEFT adapter folder; or a llama.cpp "
                         "LoRA GGUF)")
    cfg_path, w_path = d / CONFIG, d / WEIGHTS
    kept = _checkpoint_adapters(d) if not cfg_path.is_file() else []
    if kept:
        raise ModelError(f"{d}: the run has no final adapter (a run writes it when it ends); "
                         f"its newest checkpoint holds the adapter so far: give {kept[-1]}, or "
                         "resume the run")
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ModelError(f"{p}: adapter file not found")
    return cfg_path, w_path


def _checkpoint_adapters(run_dir):
    """The checkpoint folders of an unfinished run in `run_dir` that hold an adapter, oldest
    first."""
    return [p for _, p in step_dirs(run_dir) if (p / CONFIG).is_file() and (p / WEIGHTS).is_file()]


def read_adapter(adapter_dir, base_config=None):
    """(config dict, {key: array}) of a PEFT adapter folder or a llama.cpp LoRA GGUF, with clear
    errors. A GGUF needs `base_config` (the ModelConfig of its base: its Q/K head counts)."""
    paths = check_adapter_path(adapter_dir)
    if paths is None:
        if base_config is None:
            raise ModelError(f"{adapter_dir}: a llama.cpp LoRA GGUF is read with its base "
                             "model (for the row order of its Q/K tensors)")
        cfg, tensors = read_gguf_lora(adapter_dir, base_config)
        w_path = adapter_dir
    else:
        cfg, tensors = _read_peft(*paths)
        w_path = paths[1]
    for key, value in tensors.items():
        _check_weights(w_path, key, value)
    return cfg, tensors


def settings_file(adapter_dir) -> str:
    """Where an adapter's settings are read from: its adapter_config.json, or the GGUF."""
    paths = check_adapter_path(adapter_dir)
    return str(adapter_dir if paths is None else paths[0])


def _read_peft(cfg_path, w_path):
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    try:
        tensors = load_safetensors(w_path)
    except Exception as e:  # safetensors raises its own error types on damaged files
        raise ModelError(f"{w_path}: cannot read adapter weights ({e})") from None
    return cfg, tensors


class BaseMismatchWarning(UserWarning):
    """An adapter is used with a base other than the one it was trained on."""


def recorded_base(adapter_dir):
    """The base record save_adapter put in the adapter's weights file, or None (an adapter from
    PEFT or an older packlora, or a file read_adapter will report as damaged)."""
    try:
        with safe_open(str(Path(adapter_dir) / WEIGHTS), framework="numpy") as f:
            return recorded_identity(f.metadata())
    except Exception:  # noqa: BLE001 - read_adapter reports a damaged file with its reason
        return None


def check_base(adapter_dir, identity, recorded=None):
    """Warn (BaseMismatchWarning) when the base `identity` (models.identity.base_identity) is
    not the one the adapter at `adapter_dir` recorded (`recorded`, when already read); an
    adapter without a record passes."""
    recorded = recorded_base(adapter_dir) if recorded is None else recorded
    why = base_mismatch(recorded, identity)
    if why:
        warnings.warn(f"{adapter_dir}: the adapter {why}", BaseMismatchWarning, stacklevel=3)


def _check_weights(path, key, value):
    """Adapter tensors are floating point and finite; a NaN or Inf would only surface later,
    deep inside a kernel."""
    if value.dtype.kind != "f":
        raise ModelError(f"{path}: tensor {key!r} has dtype {value.dtype}; adapter weights are "
                         "floating point")
    bad = int(np.size(value) - np.isfinite(value).sum())
    if bad:
        raise ModelError(f"{path}: tensor {key!r} has {bad} NaN or infinite value(s); the "
                         "adapter is damaged (or was saved from a diverged run)")


def is_lora_key(key):
    """Whether a (stripped) adapter key is a LoRA / DoRA weight, not a whole trained module
    (modules_to_save) or an embedding's."""
    return ".lora_A" in key or ".lora_B" in key or key.endswith(MAGNITUDE)


def not_lora_weight(adapter, key) -> str:
    """Why an adapter weight that is_lora_key refuses cannot be used (applied, merged, exported
    or trained on)."""
    return (f"{adapter}: {key!r} is no LoRA or DoRA weight of a linear layer (a whole trained "
            "module, modules_to_save, or an embedding's adapter); packlora takes LoRA and DoRA "
            "weights only")


def strip_key(key):
    """A PEFT key without its model prefix and adapter name."""
    key = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return key.replace(".default.", ".")  # keys saved with an adapter name


def lora_config_from_peft(cfg, paths, source=CONFIG):
    """The LoraConfig of a PEFT adapter_config dict whose weights adapt `paths`. PEFT's defaults
    fill what the file leaves out (r 8, lora_alpha 8); its pattern keys match whole module-name
    suffixes, and the first that matches wins (lora_targets.pattern_value). A value the file
    cannot hold is a ModelError naming `source` and the file's own key."""
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise ModelError(f"{source}: peft_type {kind!r} is no LoRA adapter; packlora reads "
                         "peft_type LORA (with DoRA and rsLoRA)")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise ModelError(f"{source}: init_lora_weights {init!r}: PEFT made this adapter on a base "
                         "it rewrote (PiSSA, OLoRA, CorDA), and it is wrong on any other; have "
                         "PEFT save it as plain LoRA (save_pretrained with "
                         "path_initial_model_for_weight_conversion) and give that one")
    targets = cfg.get("target_modules") or sorted({p.rsplit(".", 1)[-1] for p in paths})
    layers = cfg.get("layers_to_transform")
    try:
        lora = lora_config({
            "rank": cfg.get("r", PEFT_DEFAULT_RANK),
            "alpha": cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA),
            "targets": targets, "layers": [layers] if isinstance(layers, int) else layers,
            "rank_pattern": cfg.get("rank_pattern") or {},
            "alpha_pattern": cfg.get("alpha_pattern") or {},
            "use_rslora": cfg.get("use_rslora", False), "use_dora": cfg.get("use_dora", False),
            "dropout": 0.0})
    except ConfigError as e:
        raise ModelError(f"{source}: {peft_terms(str(e))}") from None
    return lora.model_copy(update={"rank_pattern": _anchored(lora.rank_pattern),
                                   "alpha_pattern": _anchored(lora.alpha_pattern)})


def peft_terms(message: str) -> str:
    """A LoraConfig error ("lora: alpha: ...", "lora.targets: ...") in the key names of
    adapter_config.json ("lora_alpha: ...", "target_modules: ...")."""
    field, sep, problem = message.removeprefix("lora: ").removeprefix("lora.").partition(": ")
    name, dot, rest = field.partition(".")
    return f"{_PEFT_KEYS.get(name, name)}{dot}{rest}{sep}{problem}"


def _anchored(patterns):
    return {rf"(^|\.){k}$": v for k, v in (patterns or {}).items()}
