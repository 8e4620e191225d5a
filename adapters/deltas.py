"""A PEFT-format adapter read as weight deltas by module path: what merge and export-gguf apply.

The scale of each module is the one load_adapter gives it (alpha or its alpha_pattern entry,
over r or sqrt(r) with rsLoRA, r from the stored lora_A), so a merged weight computes what the
adapted model computed."""
import numpy as np

from ..config import lora_scale
from ..errors import ConfigError, ModelError
from ..kernels import quantize
from ..lora_targets import pattern_value
from ..models.tensors import EMBEDDING_WEIGHTS
from .loftq import loftq_fit
from .peft_io import (
    MAGNITUDE,
    adapter_chat_template,
    check_base,
    is_lora_key,
    lora_config_from_peft,
    not_lora_weight,
    read_adapter,
    recorded_base,
    settings_file,
    strip_key,
)

BASES = ("float", "quantized")  # what a float base weight is merged into: W, or deq(Q(W))


class AdapterDeltas:
    """{module path: (A (r, in), B (out, r), magnitude (out,) or None)} of an adapter folder."""

    def __init__(self, adapter_dir, base_config=None):
        """base_config: the base's ModelConfig, which a llama.cpp LoRA GGUF needs."""
        self.path = str(adapter_dir)
        self.config, tensors = read_adapter(adapter_dir, base_config)
        self.chat_template = adapter_chat_template(adapter_dir)  # None: the base's stays
        self.recorded = recorded_base(adapter_dir) or {}  # the base it was trained on
        self.trained_quant = self.recorded.get("quant") or {}
        weights = {strip_key(k).removesuffix(".weight"): v for k, v in tensors.items()}
        self.other = sorted(k for k in weights if not is_lora_key(k))  # e.g. modules_to_save
        paths = sorted({k.rsplit(".lora_", 1)[0] for k in weights if is_lora_key(k)})
        self.lora = lora_config_from_peft(self.config, paths, settings_file(adapter_dir))
        self.modules = {}
        for p in paths:
            a, b = weights.get(f"{p}.lora_A"), weights.get(f"{p}.lora_B")
            if a is None or b is None or a.shape[0] != b.shape[1]:
                raise ModelError(f"{self.path}: {p} needs lora_A (r, in) and lora_B (out, r) "
                                 "of the same r")
            mag = weights.get(f"{p}.{MAGNITUDE}")
            self.modules[p] = (a.astype(np.float32, copy=False), b.astype(np.float32, copy=False),
                               None if mag is None else mag.astype(np.float32, copy=False))

    @property
    def has_dora(self):
        return any(m[2] is not None for m in self.modules.values())

    def scale(self, path):
        """The output scale s of y = Wx + s·BAx for module `path`."""
        rank = self.modules[path][0].shape[0]
        alpha = pattern_value(path, self.lora.alpha_pattern, self.lora.alpha)
        return lora_scale(alpha, rank, self.lora.use_rslora)

    def check_mergeable(self, source):
        """ModelError unless the adapter holds LoRA / DoRA weights alone, each fitting `source`."""
        if self.other:
            raise ModelError(not_lora_weight(self.path, self.other[0]))
        self.check_shapes(source)

    def check_shapes(self, source):
        """ModelError unless every adapted module is a weight of the model source `source` with
        the (out, in) shape lora_B @ lora_A makes: an adapter of another model is refused."""
        names = set(source.names())
        for path, (a, b, _) in sorted(self.modules.items()):
            if f"{path}.weight" not in names:
                raise ModelError(f"{self.path}: the adapter has weights for {path!r}, which "
                                 f"{source.path} does not have: not this adapter's base")
            shape = tuple(source.shape(f"{path}.weight"))
            if shape != (b.shape[0], a.shape[1]):
                raise ModelError(f"{self.path}: {path} adapts a ({b.shape[0]}, {a.shape[1]}) "
                                 f"weight, {source.path} has {shape}: not this adapter's base")

    def load_into(self, model):
        """Set the adapters apply_lora gave `model` to this adapter's weights (a run that
        continues training it: lora.start_from). Each module it adapts must be one the run
        adapts, with its rank and its scale; the run's other adapters keep their start."""
        if self.config.get("init_lora_weights") == "loftq":
            raise ConfigError(f"lora.start_from: {self.path} is a LoftQ adapter, fitted to a "
                              "base LoftQ changed; start from it with lora.init: loftq instead")
        if self.other:
            raise ConfigError(f"lora.start_from: {not_lora_weight(self.path, self.other[0])}")
        for path, (a, b, mag) in sorted(self.modules.items()):
            layer = model.get_module(path) if path in model.lora_paths else None
            if layer is None:
                raise ConfigError(f"lora.start_from: {self.path} adapts {path}, which "
                                  "lora.targets / lora.layers leave out")
            have = (layer.rank, float(layer.scale), layer.lora_magnitude_vector is not None)
            want = (a.shape[0], float(self.scale(path)), mag is not None)
            if have[0] != want[0] or not np.isclose(have[1], want[1], rtol=1e-6) \
                    or have[2] != want[2]:
                raise ConfigError(f"lora.start_from: {path} has rank {want[0]}, scale "
                                  f"{want[1]:g}{', DoRA' * want[2]} in {self.path}; the run's "
                                  f"lora section gives rank {have[0]}, scale {have[1]:g}"
                                  f"{', DoRA' * have[2]}")
            xp = layer.lora_A.device.xp
            layer.lora_A.data[...] = xp.asarray(a)
            layer.lora_B.data[...] = xp.asarray(b)
            if mag is not None:
                layer.lora_magnitude_vector.data[...] = xp.asarray(mag)
        return model

    def check_base(self, identity):
        """Warn when `identity` is not the base the adapter recorded (peft_io.check_base)."""
        check_base(self.path, identity, self.recorded)

    def base_mode(self, requested=None):
        """"float" (merge into W, what PEFT, Unsloth and the QLoRA authors do) or "quantized"
        (into deq(Q(W)), the weights the adapter was trained against: the default for LoftQ,
        whose adapter is fitted to W - deq(Q(W)))."""
        loftq = self.config.get("init_lora_weights") == "loftq"
        mode = requested or ("quantized" if loftq else "float")
        if mode not in BASES:
            raise ModelError(f"--base must be one of {', '.join(BASES)}, got {mode!r}")
        if mode == "quantized" and not self.trained_quant.get("format"):
            why = "it was trained on float weights" if self.trained_quant else \
                "it does not record the quantization it was trained with"
            raise ModelError(f"{self.path}: cannot merge into the quantized base: {why}")
        return mode

    def as_trained(self, w, name):
        """A float weight (N, K) as the training run held it: deq(Q(w)) in the format the
        adapter records, or — for a LoftQ adapter of more than one iteration — the base its
        LoftQ iterations chose (replayed: the SVD is deterministic). The embedding and LM head
        take the format recorded for them (`quant.embeddings`); none recorded: w itself."""
        q, path = self.trained_quant, name.removesuffix(".weight")
        if name in EMBEDDING_WEIGHTS:
            fmt = q.get("embeddings")
            return w if not fmt else quantize(w, fmt, name=name).dequantize()
        iters = int((self.config.get("loftq_config") or {}).get("loftq_iter", 1))
        if self.config.get("init_lora_weights") == "loftq" and iters > 1 and path in self.modules:
            rank = self.modules[path][0].shape[0]
            return loftq_fit(w, q, rank, self.scale(path), iters, name)[2].dequantize()
        return quantize(w, q["format"], block_size=q.get("block_size"),
                        double_quant=bool(q.get("double_quant")), name=name).dequantize()

    def merged_rows(self, path, w, rows=None):
        """W + s·B·A for the rows `rows` (an index array or slice; all when None) of module
        `path`, whose base rows are `w` (r, in) float32; DoRA rescales each row to its learned
        magnitude. Rows are independent, so a weight can be merged a block of rows at a time."""
        a, b, mag = self.modules[path]
        sel = slice(None) if rows is None else rows
        w = w + np.float32(self.scale(path)) * (b[sel] @ a)
        if mag is not None:
            w *= (mag[sel] / np.linalg.norm(w, axis=1))[:, None]
        return w


