"""Run configuration: YAML sections validated by pydantic models, with readable errors."""
from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .config_errors import format_errors, section_model, suggest
from .config_yaml import StrictLoader, check_relative_paths, read_yaml
from .data.formats import FORMATS as DATA_FORMATS
from .data.formats import check_fields
from .device import DEFAULT_SCRATCH_MIB
from .errors import ConfigError
from .quant import FORMATS
from .quant.presets import PRESETS
from .quant.registry import FIXED_BLOCK

# quant.format: a format of the registry, a mixed preset (a format per tensor, quant/presets.py),
# or "none" for float32 base weights.
FormatName = Literal[(*FORMATS, *PRESETS, "none")]
EmbeddingFormat = Literal[("auto", "float", *FORMATS)]


def _to_float(value: Any) -> Any:
    """Numbers stay, numeric strings (PyYAML reads `1e-5` as one) become floats."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")  # noqa: TRY004 (pydantic)
    return value


def _to_int(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected an integer, got {value!r}")  # noqa: TRY004 (pydantic)
    return value


Num = Annotated[float, BeforeValidator(_to_float)]
Int = Annotated[int, BeforeValidator(_to_int)]


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, inf/nan are rejected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=True)


class QuantConfig(_Section):
    """How base weights are stored: a packed format and its block size."""

    format: FormatName = "nf4"
    block_size: Int = Field(64, ge=16, le=4096)
    double_quant: bool = True
    # the embedding and LM head: "auto" (q8_0 when the linear weights are packed, else float),
    # "float" (float32; 16-bit GGUF ones stay 16-bit) or a format of their own
    embeddings: EmbeddingFormat = "auto"

    @model_validator(mode="after")
    def _gguf_block(self) -> QuantConfig:
        fixed = FIXED_BLOCK.get(self.format)
        if fixed is not None:
            if "block_size" in self.model_fields_set and self.block_size != fixed:
                raise ValueError(f"block_size: {self.format} uses blocks of {fixed}, "
                                 f"got {self.block_size}")
            self.block_size = fixed
        elif self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        return self


class LoraConfig(_Section):
    """Which modules get an adapter, with what rank, scaling and initialisation."""

    rank: Int = Field(16, ge=1)
    alpha: Num = Field(32.0, gt=0)
    dropout: Num = Field(0.0, ge=0.0, lt=1.0)
    targets: list[str] | str = ["q_proj", "k_proj", "v_proj", "o_proj"]
    layers: list[Int] | None = None
    rank_pattern: dict[str, Int] = {}
    alpha_pattern: dict[str, Num] = {}
    use_rslora: bool = False
    use_dora: bool = False
    init: Literal["kaiming", "gaussian", "loftq"] = "kaiming"
    loftq_iter: Int = Field(1, ge=1)  # LoftQ's alternations of quantization and SVD
    start_from: str | None = None  # an adapter whose weights the new adapters start from

    @model_validator(mode="after")
    def _check_start(self) -> LoraConfig:
        if self.start_from is not None and self.init == "loftq":
            raise ValueError("start_from: a run starts from an adapter's weights or from "
                             "LoftQ's, not both (set init: kaiming)")
        return self

    @field_validator("targets", mode="before")
    @classmethod
    def _check_targets(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise ValueError("expected module-name suffixes, 'all-linear' or a regex, got ''")
            if value != "all-linear":
                _compile(value)
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v
                                                               for v in value):
            return list(value)
        raise ValueError("expected a non-empty list of module-name suffixes, 'all-linear' or a "
                         f"regex string, got {value!r}")

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value or min(value) < 0 or len(set(value)) != len(value):
            raise ValueError(f"expected null or distinct layer indices >= 0, got {value!r}")
        return sorted(value)

    @field_validator("rank_pattern", "alpha_pattern")
    @classmethod
    def _check_patterns(cls, value: dict) -> dict:
        for key, v in value.items():
            _compile(key)
            if v <= 0:
                raise ValueError(f"{key}: must be > 0, got {v}")
        return value

    def scaling(self, rank: int | None = None, alpha: float | None = None) -> float:
        """The adapter output scale for this config (see lora_scale)."""
        return lora_scale(self.alpha if alpha is None else alpha,
                          self.rank if rank is None else rank, self.use_rslora)


def lora_scale(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """The LoRA output scale s in y = Wx + s·BAx: alpha/r, or alpha/sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class DataConfig(_Section):
    """Where the training text comes from and how it becomes token rows."""

    train: str = Field(min_length=1)
    valid: str | None = None
    val_size: int | float = 0
    format: Literal[("auto", *DATA_FORMATS)] = "auto"
    max_seq_len: Int = Field(512, ge=2)
    train_on_inputs: bool = False
    packing: bool = False
    shuffle: bool = True
    # chat/alpaca records: the model's own template, or this one (a jinja string or a file path)
    chat_template: str | None = None
    # the records' own key for a key a format reads, e.g. {prompt: question, completion: answer}
    fields: Annotated[dict[str, str], AfterValidator(check_fields)] = {}

    @field_validator("val_size", mode="before")
    @classmethod
    def _check_val_size(cls, value: Any) -> Any:
        value = _to_float(value)
        if value < 0 or (value >= 1 and not float(value).is_integer()):
            raise ValueError(f"expected a count >= 0 or a fraction in [0, 1), got {value}")
        return int(value) if value >= 1 or value == 0 else float(value)

    @model_validator(mode="after")
    def _one_validation_source(self) -> DataConfig:
        if self.valid is not None and self.val_size:
            raise ValueError("set either valid (a file) or val_size (a split), not both")
        return self


class TrainConfig(_Section):
    """Optimiser, schedule, length of the run, evaluation and checkpoint cadence."""

    max_steps: Int | None = Field(200, ge=1)
    epochs: Int | None = Field(None, ge=1)
    batch_size: Int = Field(4, ge=1)
    grad_accum: Int = Field(1, ge=1)
    lr: Num = Field(2.0e-4, gt=0)
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"  # 8-bit: bitsandbytes' blockwise states
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: Int = Field(10, ge=0)
    warmup_ratio: Num | None = Field(None, ge=0.0, lt=1.0)
    weight_decay: Num = Field(0.0, ge=0.0)
    betas: tuple[Num, Num] = (0.9, 0.999)
    eps: Num = Field(1.0e-8, gt=0)
    max_grad_norm: Num | None = Field(1.0, gt=0)
    # apply each adapter gradient the moment backward completes it, and free it: no step holds
    # every gradient at once (grad_accum 1 only; no global norm exists to clip by)
    step_in_backward: bool = False
    grad_checkpointing: bool = False
    eval_every: Int = Field(50, ge=0)
    save_every: Int = Field(50, ge=0)
    keep_last: Int | None = Field(2, ge=1)
    log_every: Int = Field(1, ge=1)
    seed: Int = Field(0, ge=0)
    loss_chunk: Int = Field(256, ge=1)

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _length_and_warmup(self) -> TrainConfig:
        given = self.model_fields_set
        if self.epochs is not None and "max_steps" not in given:
            self.max_steps = None  # epochs given alone replaces the default step count
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of max_steps and epochs "
                             f"(got max_steps={self.max_steps}, epochs={self.epochs})")
        if self.warmup_ratio is not None:
            if "warmup_steps" not in given:
                self.warmup_steps = 0
            elif self.warmup_steps:
                raise ValueError("set either warmup_steps or warmup_ratio, not both")
        if self.step_in_backward and self.grad_accum > 1:
            raise ValueError("step_in_backward applies each gradient as backward completes it; "
                             "it needs grad_accum: 1")
        if self.step_in_backward and self.max_grad_norm is not None:
            raise ValueError("step_in_backward applies each gradient before the global norm "
                             "exists: set max_grad_norm: null (no clipping)")
        return self

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps in the run, given how many steps one epoch takes."""
        return self.max_steps if self.max_steps is not None else self.epochs * steps_per_epoch

    def warmup(self, total_steps: int) -> int:
        """Warmup length in steps (from warmup_ratio when set)."""
        if self.warmup_ratio is not None:
            return round(self.warmup_ratio * total_steps)
        return self.warmup_steps


class RunConfig(_Section):
    """A whole run: model, device, quantization, adapter, data, training, output."""

    model: str = Field(min_length=1)
    device: str = "cpu"
    quant: QuantConfig = Field(default_factory=QuantConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    resume: str | None = None
    resume_allow: list[str] = []  # settings (key paths, or "data") a resume may find changed
    overwrite: bool = False
    # dense scratch cap of the packed kernels; unset: the device's default (DEFAULT_SCRATCH_MIB)
    scratch_mib: Int | None = Field(None, ge=1, le=4096)
    tf32: bool = False  # GPU float32 products on TF32 tensor cores (Device.set_tf32)
    output_dir: str = Field("runs/run", min_length=1)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ValueError(f"expected 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value

    @field_validator("tf32")
    @classmethod
    def _tf32_on_a_gpu(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("device") == "cpu":  # (a bad device is its own error)
            raise ValueError("needs device cuda (TF32 is a tensor-core format of NVIDIA GPUs; "
                             "the CPU computes in float32)")
        return value

    @model_validator(mode="after")
    def _device_scratch(self) -> RunConfig:
        if self.scratch_mib is None:
            self.scratch_mib = DEFAULT_SCRATCH_MIB[self.device.split(":")[0]]
        return self

    @field_validator("resume_allow")
    @classmethod
    def _check_allowed_keys(cls, value: list[str]) -> list[str]:
        for key in value:
            problem = None if key in ("data", "world_size") else key_path_problem(key.split("."))
            if problem:  # a typo would allow nothing, and the resume would be refused
                raise ValueError(f"{problem}; give setting key paths (train.max_steps), or "
                                 "data for the training data")
        return value

    @field_validator("resume")
    @classmethod
    def _check_resume(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("expected null, 'auto' or a checkpoint path, got ''")
        return value

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The resolved config as YAML text; also written to `path` when given."""
        text = yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False,
                              default_flow_style=None)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


def _compile(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regex {pattern!r}: {exc}") from None


# ----------------------------------------------------------------------------------- overrides

def key_path_problem(parts: list) -> str | None:
    """What is wrong with a key path of the run config (`train.max_steps` as its parts), with a
    suggestion; None when the schema has it."""
    cls = RunConfig
    for i, part in enumerate(parts):
        key = ".".join(parts[:i + 1])
        if part not in cls.model_fields:
            return f"{key}: unknown key" + suggest(part, cls.model_fields)
        ann = cls.model_fields[part].annotation
        cls = section_model(ann)
        if cls is None:
            if i + 1 < len(parts) and get_origin(ann) is not dict:
                return f"{key} is a value, not a section; cannot set {'.'.join(parts[i + 1:])}"
            return None
    return None


def apply_overrides(data: dict, overrides, source: str) -> tuple[dict, dict]:
    """A copy of `data` with `key.path=value` overrides set, and {loc: override} for errors."""
    merged, origins = copy.deepcopy(data), {}
    for text in [overrides] if isinstance(overrides, str) else overrides:
        key, sep, raw = str(text).partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"{source}: bad override '{text}': expected key.path=value")
        problem = key_path_problem(parts)  # not in the schema: with a suggestion
        if problem:
            raise ConfigError(f"{source}: override '{text}': {problem}")
        try:
            value = yaml.load(raw, Loader=StrictLoader)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: bad override '{text}': cannot parse value: "
                              f"{getattr(exc, 'problem', exc)}") from None
        node = merged
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        origins[tuple(parts)] = text
    return merged, origins


def parse_config(data: dict, overrides=(), source: str = "<dict>") -> RunConfig:
    """Validate a config dict (after applying `key.path=value` overrides) into a RunConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    merged, origins = apply_overrides(data, overrides, source)
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, RunConfig, source, origins)) from None


def load_config(path: str | Path, overrides=()) -> RunConfig:
    """Read a YAML run config, apply overrides (which win over the file) and validate it."""
    cfg = parse_config(read_yaml(path), overrides, source=str(path))
    check_relative_paths(cfg, path)
    return cfg


def resolve_config(config, overrides=()) -> RunConfig:
    """A RunConfig from a RunConfig, a run dict or a YAML path, with `key=value` overrides."""
    if isinstance(config, RunConfig):
        return parse_config(config.model_dump(), overrides, "<RunConfig>") if overrides else config
    if isinstance(config, dict):
        return parse_config(config, overrides)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"a run config is a YAML path, a dict or a RunConfig, not "
                        f"{type(config).__name__}")
    return load_config(config, overrides)
