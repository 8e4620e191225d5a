"""What a memory plan needs, read from a run config and the model's header alone (no weights)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig, load_config, parse_config
from ..device import DEFAULT_SCRATCH_CAP
from ..errors import ModelError
from ..lora_targets import check_patterns, targets_for
from ..models.config import ModelConfig
from ..models.sources import read_header
from ..models.tensors import EMBEDDING_WEIGHTS, held_formats, model_tensors, quant_record
from ..training.distributed import check_global_batch
from ..training.states import STATE_BITS

_MODEL_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


@dataclass
class PlanInputs:
    """Everything the planner reads: architecture, storage of each base tensor, adapters, shapes."""

    model: object  # models.config.ModelConfig
    source: str
    linears: dict  # module path -> models.tensors.TensorSpec (the decoder's frozen projections)
    others: dict  # name -> TensorSpec (embedding, norms, biases, an untied head)
    adapters: dict  # path -> lora_targets.Target
    batch: int
    seq: int
    grad_checkpointing: bool
    loss_chunk: int
    grad_accum: int = 1
    packed: bool = False  # data.packing: the attention mask is per row
    state_bits: int = 32  # AdamW's moments: 32 (adamw) or 8 (adamw_8bit)
    step_in_backward: bool = False  # train.step_in_backward: each grad freed as it completes
    device: str = "cpu"
    scratch_cap: int = DEFAULT_SCRATCH_CAP
    ranks: int = 1  # data-parallel ranks: `batch` is then this rank's share of the global batch
    run: dict = field(default_factory=dict)  # the run settings, for the report
    _grads_per_block: list | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_storage(self):
        return self.others.get("lm_head.weight") or self.others["model.embed_tokens.weight"]


# ----------------------------------------------------------------------------- tensors

def _is_model_dict(obj) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in _MODEL_KEYS)


def _header(source):
    """(path, ModelConfig, stored TensorSpecs or None) of a model dict or any model source."""
    if _is_model_dict(source):
        path = "<model config dict>"
        return path, ModelConfig.from_hf(source, path), None
    return read_header(source)


def base_tensors(config, stored, quant):
    """(linears, others): TensorSpec of every frozen tensor, as load_model holds it; linears by
    module path (the decoder's projections), others by tensor name (embedding, norms, biases,
    an untied head)."""
    linears, others = {}, {}
    for spec in model_tensors(config, quant, stored):
        if spec.category == "base_packed":
            linears[spec.name.removesuffix(".weight")] = spec
        else:
            others[spec.name] = spec
    return linears, others


def adapters_for(linears, others, lora):
    """path -> Target for the layers the LoRA config targets (the rules of apply_lora)."""
    modules = [(path, *st.shape) for path, st in linears.items()]
    if "lm_head.weight" in others:
        modules.append(("lm_head", *others["lm_head.weight"].shape))
    return {t.path: t for t in targets_for(modules, lora)}


# ----------------------------------------------------------------------------- run configs

def _run_config(config, overrides):
    """A RunConfig from a RunConfig, YAML path or run dict; None if `config` names a model."""
    if isinstance(config, RunConfig):
        return parse_config(config.model_dump(), overrides, "<RunConfig>") if overrides else config
    if _is_model_dict(config):
        return None
    if isinstance(config, dict):
        return parse_config(config, overrides)
    path = Path(str(config)).expanduser()
    if path.suffix.lower() in (".yaml", ".yml"):
        return load_config(path, overrides)
    return None


def plan_inputs(config, overrides=(), model=None, batch_size=None, seq_len=None,
                grad_checkpointing=None, scratch_cap=None, ranks=1) -> PlanInputs:
    """Resolve `config` (RunConfig, YAML path, run dict, model config dict, config.json path,
    model folder, .gguf file or model name) into PlanInputs. `model` replaces the run's model
    source; the keyword shapes override the run's train/data settings; with `ranks` > 1 the plan
    is one rank's of a data-parallel run (its share of the global batch)."""
    run = _run_config(config, overrides)
    if run is None:  # a model alone: the run defaults (QLoRA NF4 + double quant)
        model = config if model is None else model
        run = parse_config({"model": "<model>", "data": {"train": "<none>"}}, overrides)
    source = run.model if model is None else model
    try:
        path, config, stored = _header(source)
    except ModelError as e:
        raise ModelError(f"{e} (the memory plan needs only the config: pass model=<folder with "
                         "config.json | config.json | dict>)") from None
    linears, others = base_tensors(config, stored, run.quant)
    adapters = adapters_for(linears, others, run.lora)
    check_patterns(run.lora, list(adapters))  # a mistyped key would be planned at lora.rank
    tr = run.train
    batch, ranks = int(batch_size or tr.batch_size), int(ranks)
    check_global_batch(batch, ranks)
    inputs = PlanInputs(
        model=config, source=path, linears=linears, others=others, ranks=ranks,
        adapters=adapters, batch=batch // ranks,
        seq=int(seq_len or run.data.max_seq_len),
        grad_checkpointing=bool(tr.grad_checkpointing if grad_checkpointing is None
                                else grad_checkpointing),
        loss_chunk=int(tr.loss_chunk), grad_accum=int(tr.grad_accum),
        packed=bool(run.data.packing), state_bits=STATE_BITS[tr.optimizer],
        step_in_backward=bool(tr.step_in_backward),
        device=run.device.split(":")[0],
        scratch_cap=int(scratch_cap or run.scratch_mib << 20))
    inputs.run = {"model": path, "device": run.device,
                  "quant": quant_record(run.quant, config.hidden_size),
                  "held": {"linears": held_formats(linears.values()), "embeddings": held_formats(
                      others[n] for n in EMBEDDING_WEIGHTS if n in others)},
                  "lora": {"rank": run.lora.rank, "targets": run.lora.targets,
                           "dropout": run.lora.dropout, "use_dora": run.lora.use_dora,
                           "init": run.lora.init, "loftq_iter": run.lora.loftq_iter},
                  "batch_size": inputs.batch, "seq_len": inputs.seq, "ranks": ranks,
                  "grad_checkpointing": inputs.grad_checkpointing,
                  "loss_chunk": inputs.loss_chunk, "grad_accum": inputs.grad_accum}
    return inputs
