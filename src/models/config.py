"""Architecture hyper-parameters of a decoder model, read from HF config.json or GGUF metadata."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import ModelError

SUPPORTED_HF_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_HF_ARCH_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # bias on q/k/v projections (Qwen2/2.5)
    qk_norm: bool = False             # RMSNorm on q and k per head (Qwen3)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    source: str = field(default="", repr=False, compare=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"{self.source}: num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        _check_rope_scaling(self.rope_scaling, self.source)

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config.json dict (llama, mistral, qwen2, qwen3)."""
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_HF_TYPES:
            raise ModelError(f"{source}: model_type {mtype!r} is not supported; supported model "
                             f"types: {', '.join(SUPPORTED_HF_TYPES)}")
        _refuse_unimplemented(cfg, source)
        f = _Fields(cfg, source, "", "missing key '{}' in the model config")
        hidden, heads = f.whole("hidden_size"), f.whole("num_attention_heads")
        return cls(
            model_type=mtype, vocab_size=f.whole("vocab_size"), hidden_size=hidden,
            intermediate_size=f.whole("intermediate_size"),
            num_layers=f.whole("num_hidden_layers"), num_heads=heads,
            num_kv_heads=f.whole("num_key_value_heads", heads),
            head_dim=f.head_dim("head_dim", hidden, heads, "hidden_size"),
            rope_theta=f.real("rope_theta", 10000.0),
            rope_scaling=_hf_rope_scaling(cfg.get("rope_scaling"), source),
            rms_norm_eps=f.real("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=_hf_attention_bias(cfg, mtype, source),
            qk_norm=mtype == "qwen3",
            max_position_embeddings=f.whole("max_position_embeddings", 2048),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=cfg.get("eos_token_id"),
            source=source)

    @classmethod
    def from_gguf(cls, fields: dict, source: str = "model.gguf",
                  tensor_names=None) -> ModelConfig:
        """Build from GGUF metadata; tensor_names (if given) decide tying, biases and qk-norm."""
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise ModelError(f"{source}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_GGUF_ARCHS)}")
        names = set(tensor_names) if tensor_names is not None else None
        f = _Fields(fields, source, f"{arch}.", "missing GGUF metadata key '{}'")
        hidden, heads = f.whole("embedding_length"), f.whole("attention.head_count")
        return cls(
            model_type="llama" if arch == "mistral" else arch,
            vocab_size=f.whole("vocab_size", len(fields.get("tokenizer.ggml.tokens", [])) or None),
            hidden_size=hidden,
            intermediate_size=f.whole("feed_forward_length"),
            num_layers=f.whole("block_count"), num_heads=heads,
            num_kv_heads=f.whole("attention.head_count_kv", heads),
            head_dim=f.head_dim("attention.key_length", hidden, heads, "embedding_length"),
            rope_theta=f.real("rope.freq_base", 10000.0),
            rope_scaling=_gguf_rope_scaling(fields, arch, source),
            rms_norm_eps=f.real("attention.layer_norm_rms_epsilon", 1e-6),
            tie_word_embeddings=names is not None and "output.weight" not in names,
            attention_bias=("blk.0.attn_q.bias" in names) if names is not None else arch == "qwen2",
            qk_norm=("blk.0.attn_q_norm.weight" in names) if names is not None else arch == "qwen3",
            max_position_embeddings=f.whole("context_length", 2048),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"), source=source)

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers (and from_hf) can read back."""
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "freq_factors":
            raise ModelError(f"{self.source}: RoPE frequency factors from a GGUF file have no "
                             "config.json form")
        out = {
            "architectures": [_HF_ARCH_CLASS[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        return out

    def as_dict(self) -> dict:
        return asdict(self)


class _Fields:
    """Numbers read from a config.json dict or GGUF metadata (keys after `prefix`); a missing,
    non-numeric or out-of-range value is a ModelError naming the file and the key."""

    def __init__(self, values: dict, source: str, prefix: str, missing: str):
        self.values, self.source, self.prefix, self.missing = values, source, prefix, missing

    def _get(self, key, default):
        value = self.values.get(self.prefix + key)
        if value is None and default is None:
            raise ModelError(f"{self.source}: {self.missing.format(self.prefix + key)}")
        return default if value is None else value

    def whole(self, key: str, default=None) -> int:
        """A count (>= 1): a layer count, a width, a number of heads."""
        value = self._get(key, default)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and math.isfinite(value) and value == int(value) and value >= 1:
            return int(value)
        raise ModelError(f"{self.source}: '{self.prefix}{key}' must be a whole number >= 1, "
                         f"got {value!r}")

    def real(self, key: str, default: float) -> float:
        """A finite positive number: a RoPE base, a norm epsilon."""
        value = self._get(key, default)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) \
                and math.isfinite(value) and value > 0:
            return float(value)
        raise ModelError(f"{self.source}: '{self.prefix}{key}' must be a finite number > 0, "
                         f"got {value!r}")

    def head_dim(self, key: str, hidden: int, heads: int, hidden_key: str) -> int:
        """The file's head width `key`, else hidden / heads (which must divide)."""
        if self.values.get(self.prefix + key) is not None:
            return self.whole(key)
        if hidden % heads:
            raise ModelError(f"{self.source}: '{self.prefix}{hidden_key}' ({hidden}) is not a "
                             f"multiple of the {heads} attention heads, and no head width "
                             f"'{self.prefix}{key}' is given")
        return hidden // heads


def _refuse_unimplemented(cfg: dict, source: str) -> None:
    """config.json fields that would change the model in ways packlora does not implement are
    errors naming the field, never dropped: another activation, MLP biases, a sliding window
    narrower than the model's positions (Mistral v0.1; Qwen2 ships one switched off)."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation"))
    if act not in (None, "silu", "swish"):
        raise ModelError(f"{source}: hidden_act={act!r} is not supported (packlora's MLP is "
                         "SwiGLU with silu)")
    if cfg.get("mlp_bias"):
        raise ModelError(f"{source}: mlp_bias=true (biases on gate/up/down_proj) is not supported")
    window = cfg.get("sliding_window")
    used = cfg.get("use_sliding_window", True) is not False
    if used and window is not None and int(window) < int(cfg.get("max_position_embeddings",
                                                                     0) or 0):
        raise ModelError(f"{source}: sliding_window={window} (sliding-window attention) is not "
                         "supported; packlora attends over the whole sequence")


def _hf_attention_bias(cfg: dict, mtype: str, source: str) -> bool:
    if mtype == "qwen2":
        return True  # Qwen2 always has q/k/v biases (and none on o_proj)
    bias = bool(cfg.get("attention_bias", False))
    if bias and mtype == "llama":
        raise ModelError(f"{source}: attention_bias=true on a llama model (bias on o_proj too) "
                         "is not supported")
    return bias


def _hf_rope_scaling(rs: dict | None, source: str) -> dict | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(rs["factor"])}
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rs]
        if missing:
            raise ModelError(f"{source}: rope_scaling of type llama3 lacks {', '.join(missing)}")
        out = {"rope_type": "llama3"}
        out.update({k: float(rs[k]) for k in keys[:3]})
        out[keys[3]] = int(rs[keys[3]])
        return out
    raise ModelError(f"{source}: rope_scaling type {rope_type!r} is not supported "
                     "(supported: default, linear, llama3)")


def _gguf_rope_scaling(fields: dict, arch: str, source: str) -> dict | None:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    if kind not in ("none", None):
        raise ModelError(f"{source}: GGUF rope scaling type {kind!r} is not supported "
                         "(supported: none, linear)")
    return None


def _check_rope_scaling(rs: dict | None, source: str) -> None:
    if rs is not None and rs.get("rope_type") not in _ROPE_TYPES:
        raise ModelError(f"{source}: rope_scaling {rs!r} is not supported")


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies, float64 of length head_dim // 2, with the config's scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # (D/2,)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "freq_factors":  # llama.cpp's rope_freqs.weight: theta_i / factor_i
        factors = np.asarray(rs["factors"], dtype=np.float64)
        if factors.shape != inv_freq.shape:
            raise ModelError(f"{cfg.source}: rope_freqs has {factors.size} factors, expected "
                             f"{inv_freq.size}")
        return inv_freq / factors
    return _llama3_scaling(inv_freq, rs)


def _llama3_scaling(inv_freq: np.ndarray, rs: dict) -> np.ndarray:
    """Llama 3.1 RoPE: long wavelengths divided by factor, a smooth blend in between."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_ctx = rs["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)
