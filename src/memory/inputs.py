"""What a memory plan needs, read from a run config and the model's header alone (no weights)."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig, load_config, parse_config
from ..device import DEFAULT_SCRATCH_CAP
from ..errors import ModelError
from ..lora_targets import targets_for
from ..models.config import ModelConfig
from ..models.files import read_json
from ..models.gguf_file import hf_name, open_gguf
from ..models.load import quant_spec
from ..models.resolve import resolve_source
from ..quant import packed_nbytes

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GGUF_PACKED = ("Q4_0", "Q4_1", "Q8_0")
_MODEL_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


@dataclass
class Storage:
    """How one base tensor is held after load_model: packed (format, block, dq) or float32."""

    shape: tuple
    format: str | None = None  # None: a float32 array
    block_size: int | None = None
    double_quant: bool = False

    @property
    def nbytes(self) -> int:
        if self.format is None:
            n = 4
            for d in self.shape:
                n *= int(d)
            return n
        return packed_nbytes(self.format, self.shape, self.block_size, self.double_quant)

    @property
    def packed(self) -> bool:
        return self.format is not None


@dataclass
class PlanInputs:
    """Everything the planner reads: architecture, storage of each base tensor, adapters, shapes."""

    model: object  # models.config.ModelConfig
    source: str
    linears: dict  # path -> Storage (frozen base linear weights, incl. lm_head)
    others: dict  # name -> Storage (embedding, norms, biases, an untied head)
    adapters: dict  # path -> lora_targets.Target
    batch: int
    seq: int
    grad_checkpointing: bool
    loss_chunk: int
    grad_accum: int = 1
    device: str = "cpu"
    scratch_cap: int = DEFAULT_SCRATCH_CAP
    run: dict = field(default_factory=dict)  # the run settings, for the report
    _grads_per_block: list | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_storage(self) -> Storage:
        return self.others.get("lm_head.weight") or self.others["model.embed_tokens.weight"]


# ----------------------------------------------------------------------------- model headers

def _is_model_dict(obj) -> bool:
    return isinstance(obj, dict) and all(k in obj for k in _MODEL_KEYS)


class _Header:
    """Config and per-tensor stored types of a model source, without reading tensor data."""

    def __init__(self, source):
        self.kinds = {}  # hf tensor name -> (kind, shape); kind "F32" or a packed description
        self.names = None  # set of tensor names when known
        if _is_model_dict(source):
            self.path = "<model config dict>"
            self.config = ModelConfig.from_hf(source, self.path)
            return
        path = Path(source).expanduser()
        if path.is_file() and path.name.endswith(".json"):
            self._hf_config(path)
            return
        path = resolve_source(source)
        if path.is_dir():
            from ..models.sources import PACKED_FILE
            if (path / PACKED_FILE).is_file():
                self._packed_folder(path, path / PACKED_FILE)
            else:
                self._hf_config(path / "config.json")
        else:
            self._gguf(path)

    def _hf_config(self, cfg_path):
        self.path = str(cfg_path)
        self.config = ModelConfig.from_hf(read_json(Path(cfg_path)), self.path)

    def _gguf(self, path):
        f = open_gguf(path)
        self.path, self.config = str(path), f.config
        self.names = set()
        for name in f.tensor_names():
            hf = hf_name(name)
            if hf is None:
                continue
            kind, shape, _ = f.tensor(name)  # a view of the memory map; nothing is read
            self.names.add(hf)
            self.kinds[hf] = ({"format": kind.lower(), "block_size": 32, "double_quant": False}
                              if kind in GGUF_PACKED else "F32", shape)

    def _packed_folder(self, folder, packed_file):
        self._hf_config(folder / "config.json")
        header = _safetensors_header(packed_file)
        described = json.loads(header.get("__metadata__", {}).get("packlora", "{}"))
        self.names = set(described)
        for name, desc in described.items():
            self.kinds[name] = ({k: desc[k] for k in ("format", "block_size", "double_quant")},
                                tuple(desc["shape"]))
        for name, entry in header.items():
            if name != "__metadata__" and not any(name.startswith(p + ".") for p in described):
                self.names.add(name)
                self.kinds[name] = ("F32", tuple(entry["shape"]))

    def has(self, name) -> bool:
        return self.names is None or name in self.names

    def storage(self, name, shape, quant, quantize=True) -> Storage:
        """Mirror of load.py: stored-packed stays packed; floats get the run's format."""
        kind = self.kinds.get(name, ("F32", shape))[0]
        if kind != "F32":
            return Storage(tuple(shape), kind["format"], kind["block_size"], kind["double_quant"])
        if quantize and quant["format"] is not None:
            return Storage(tuple(shape), quant["format"], quant["block_size"],
                           quant["double_quant"])
        return Storage(tuple(shape))


def _safetensors_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


# ----------------------------------------------------------------------------- tensors

def base_tensors(header, quant):
    """(linears, others): Storage of every frozen tensor, as load_model would place it."""
    cfg = header.config
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    outs = {"self_attn.q_proj": cfg.num_heads * hd, "self_attn.k_proj": cfg.num_kv_heads * hd,
            "self_attn.v_proj": cfg.num_kv_heads * hd, "self_attn.o_proj": d,
            "mlp.gate_proj": f, "mlp.up_proj": f, "mlp.down_proj": d}
    ins = {"self_attn.o_proj": cfg.num_heads * hd, "mlp.down_proj": f}
    linears, others = {}, {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for proj in PROJ:
            name = f"{p}.{proj}"
            linears[name] = header.storage(f"{name}.weight", (outs[proj], ins.get(proj, d)), quant)
            if cfg.attention_bias and proj in PROJ[:3]:
                others[f"{name}.bias"] = Storage((outs[proj],))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            others[f"{p}.{norm}.weight"] = Storage((d,))
        if cfg.qk_norm:
            others[f"{p}.self_attn.q_norm.weight"] = Storage((hd,))
            others[f"{p}.self_attn.k_norm.weight"] = Storage((hd,))
    emb = "model.embed_tokens.weight"
    others[emb] = header.storage(emb, (cfg.vocab_size, d), quant, quantize=False)
    others["model.norm.weight"] = Storage((d,))
    if not cfg.tie_word_embeddings and header.has("lm_head.weight"):
        others["lm_head.weight"] = header.storage("lm_head.weight", (cfg.vocab_size, d), quant,
                                                  quantize=False)
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
                grad_checkpointing=None, scratch_cap=None) -> PlanInputs:
    """Resolve `config` (RunConfig, YAML path, run dict, model config dict, config.json path,
    model folder, .gguf file or model name) into PlanInputs. `model` replaces the run's model
    source; the keyword shapes override the run's train/data settings."""
    run = _run_config(config, overrides)
    if run is None:  # a model alone: the run defaults (QLoRA NF4 + double quant)
        model = config if model is None else model
        run = parse_config({"model": "<model>", "data": {"train": "<none>"}}, overrides)
    source = run.model if model is None else model
    try:
        header = _Header(source)
    except ModelError as e:
        raise ModelError(f"{e} (the memory plan needs only the config: pass model=<folder with "
                         "config.json | config.json | dict>)") from None
    quant = quant_spec(run.quant)
    linears, others = base_tensors(header, quant)
    adapters = adapters_for(linears, others, run.lora)
    tr = run.train
    inputs = PlanInputs(
        model=header.config, source=header.path, linears=linears, others=others,
        adapters=adapters, batch=int(batch_size or tr.batch_size),
        seq=int(seq_len or run.data.max_seq_len),
        grad_checkpointing=bool(tr.grad_checkpointing if grad_checkpointing is None
                                else grad_checkpointing),
        loss_chunk=int(tr.loss_chunk), grad_accum=int(tr.grad_accum),
        device=run.device.split(":")[0], scratch_cap=int(scratch_cap or run.scratch_mib << 20))
    inputs.run = {"model": header.path, "device": run.device, "quant": quant,
                  "lora": {"rank": run.lora.rank, "targets": run.lora.targets,
                           "dropout": run.lora.dropout, "use_dora": run.lora.use_dora},
                  "batch_size": inputs.batch, "seq_len": inputs.seq,
                  "grad_checkpointing": inputs.grad_checkpointing,
                  "loss_chunk": inputs.loss_chunk, "grad_accum": inputs.grad_accum}
    return inputs
