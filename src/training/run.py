"""finetune: one RunConfig (or YAML path) -> a trained adapter in output_dir."""
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..adapters import apply_lora, save_adapter
from ..adapters.peft_io import (
    CONFIG,
    TEMPLATE,
    WEIGHTS,
    adapter_chat_template,
    check_adapter_path,
    check_base,
)
from ..config import resolve_config
from ..data import build_datasets
from ..device import Device
from ..errors import ConfigError, ModelError, PackloraError, TrainingError
from ..lora_targets import check_patterns
from ..models import load_model
from .checkpoints import list_checkpoints, named_checkpoint_problem, what_is_kept
from .distributed import World
from .fingerprint import data_digest
from .output_lock import output_dir_lock
from .trainer import RUN_CONFIG, train

_RUN_FILES = ("metrics.jsonl", "checkpoints", WEIGHTS, CONFIG, TEMPLATE, RUN_CONFIG, "loss.png")
_RUN_MARKS = ("metrics.jsonl", "checkpoints", RUN_CONFIG)  # written by a run alone, first


@dataclass
class FinetuneResult:
    model: object
    history: list
    output_dir: Path
    data_stats: object
    rank: int = 0  # of an MPI run: rank 0 wrote output_dir


def check_output_dir(cfg):
    """The files of an earlier run in output_dir that this one replaces (overwrite: true); a
    ConfigError when they would be mixed with this run's (neither resume nor overwrite), when
    output_dir is a file, or when a resume path is no complete checkpoint: before anything
    loads."""
    out = Path(cfg.output_dir)
    taken = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if taken is not None:  # before the model loads, not at the first write
        raise ConfigError(f"output_dir: {taken} is a file, not a folder" +
                          (f" (in the path {out})" if taken != out else ""))
    if cfg.resume not in (None, "auto") and (why := named_checkpoint_problem(cfg.resume)):
        raise ConfigError(f"resume: {cfg.resume}: {why}")  # before the model loads
    existing = [n for n in _RUN_FILES if (out / n).exists()]
    _check_no_other_files(out, existing)
    if not existing or _continues(cfg.resume, out):
        return []
    if not cfg.overwrite:
        elsewhere = f" (resume: {cfg.resume} is another folder's checkpoint)" if cfg.resume else ""
        raise ConfigError(f"output_dir: {out} already holds a run ({', '.join(existing)})"
                          f"{elsewhere}; set resume: auto to continue it, or overwrite: true "
                          "to replace it")
    return existing


def _check_no_other_files(out, existing):
    """A folder of no run (a model's, a PEFT adapter's, any with files in it) is no output_dir:
    a run would mix its files in, and write over a chat_template.jinja or adapter there."""
    if any(n in existing for n in _RUN_MARKS) or not out.is_dir():
        return
    other = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if other:
        shown = ", ".join(other[:4]) + (", ..." if len(other) > 4 else "")
        raise ConfigError(f"output_dir: {out} holds files of no packlora run ({shown}); give a "
                          "new or empty folder")


def _continues(resume, out):
    """Whether `resume` continues the run in `out`: auto, or one of its own checkpoints."""
    if resume is None:
        return False
    if str(resume) == "auto":
        return True
    return Path(resume).resolve().is_relative_to((out / "checkpoints").resolve())


def clear_output_dir(out, replaced):
    """output_dir, ready: the replaced run's files go only once this run has loaded its model
    and data, so a bad data line does not cost the run it was to replace."""
    for name in replaced:
        p = out / name
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def finetune(config_or_path, overrides=(), progress=True, world=None):
    """Run a fine-tune from a YAML path, a dict or a RunConfig. Returns a FinetuneResult.
    Under an MPI launcher this process is one rank of a data-parallel run (`world`, detected
    by default); an error on any rank then ends every rank."""
    world = World.detect() if world is None else world
    cfg = None
    try:
        cfg = resolve_config(config_or_path, overrides)
        with output_dir_lock(cfg.output_dir, held=world.is_main):  # rank 0 alone writes there
            return _finetune(cfg, progress, world)
    except BaseException as e:
        if world.size > 1:
            print(f"packlora: error on rank {world.rank} of {world.size}: {e}", file=sys.stderr,
                  flush=True)
            world.abort(2 if isinstance(e, PackloraError) else 3)
        if isinstance(e, KeyboardInterrupt) and cfg is not None and not e.args:
            raise KeyboardInterrupt(what_is_kept(cfg.output_dir)) from None  # Ctrl-C, SIGTERM
        raise


def run_device(cfg, world=None):
    """The recording device a run (one rank of `world`) trains on, set as its config says:
    seeded, its scratch cap (also dropping a scratch an earlier run grew), TF32 on or off."""
    device = (Device.parse(cfg.device) if world is None else world.device(cfg.device)).autodiff()
    device.seed(cfg.train.seed)
    device.set_scratch_cap(cfg.scratch_mib << 20)
    device.set_tf32(cfg.tf32)
    return device


def _finetune(cfg, progress, world):
    world.check_same("configs", cfg.model_dump(mode="json"))
    main = world.is_main  # rank 0 alone writes
    out = Path(cfg.output_dir)
    replaced = check_output_dir(cfg) if main else []
    device = run_device(cfg, world)
    if cfg.lora.start_from:
        try:
            check_adapter_path(cfg.lora.start_from)  # before the model loads
        except ModelError as e:
            raise ConfigError(f"lora.start_from: {e}") from None
    model = load_model(cfg.model, device, quant=cfg.quant)
    apply_lora(model, cfg.lora)  # the same initial adapter on every rank (or start_from's)
    check_patterns(cfg.lora, model.lora_paths)
    if cfg.lora.start_from:
        _started_from(model, cfg.lora.start_from, keep_template=cfg.data.chat_template is None)
    if world.size > 1:  # then a dropout stream of its own per rank
        device.seed(int(np.random.SeedSequence([cfg.train.seed, world.rank]).generate_state(1)[0]))
    train_ex, valid_ex, stats = build_datasets(cfg.data, model.tokenizer, cfg.train.seed)
    _check_same_files(world, model, train_ex, valid_ex)
    if main:
        clear_output_dir(out, replaced)
        _warn_past_context(cfg.model, model.config.max_position_embeddings, train_ex, valid_ex)
        _warn_batch_past_data(cfg.train.batch_size, len(train_ex))
    if progress and main:
        ranks = f" on {world.size} ranks" if world.size > 1 else ""
        print(f"packlora: {len(train_ex)} training examples{ranks}, "
              f"{len(valid_ex) if valid_ex else 0} validation; {stats.as_dict()}", flush=True)
    history = train(model, train_ex, cfg.train, valid_ex, out, cfg.resume,
                    model.tokenizer.pad_token_id, progress, cfg, world)
    if main:
        _save_final(model, out)
    return FinetuneResult(model, history, out, stats, world.rank)


def _check_same_files(world, model, train_ex, valid_ex):
    """Each rank reads the model and the data on its own machine: the same config may find other
    files there. ConfigError on every rank unless the ranks read the same."""
    if world.size == 1:
        return
    base = {k: model.base_identity[k] for k in ("size", "sample_sha256")}
    hint = "each rank reads {} on its own machine: give every rank the same files"
    world.check_same("base models", base, hint.format("the model"))
    world.check_same("training data", [data_digest(train_ex), data_digest(valid_ex or [])],
                     hint.format("data.train and data.valid"))


def _started_from(model, adapter, keep_template):
    """After apply_lora gave the run `adapter`'s weights (lora.start_from): with keep_template
    (no data.chat_template) its rows are rendered in the chat template it was trained with, and
    an adapter trained on another base is said."""
    template = adapter_chat_template(adapter)
    if keep_template and template and model.tokenizer is not None:
        model.tokenizer.set_chat_template(template, f"lora.start_from ({adapter})")
    if getattr(model, "base_identity", None):
        check_base(adapter, model.base_identity)


def _warn_past_context(name, context, *sets):
    """Rows longer than the base's context train it on positions it never saw: a context
    extension, if meant; otherwise a data.max_seq_len set too high."""
    longest = max((len(ex) for rows in sets if rows for ex in rows), default=0)
    if longest > context:
        warnings.warn(f"data: rows of up to {longest} tokens are longer than the context of "
                      f"{name} ({context} positions); set data.max_seq_len: {context} unless "
                      "the run is meant to extend the context", stacklevel=2)


def _warn_batch_past_data(batch_size, rows):
    """A batch larger than the training set is the whole set, every step."""
    if batch_size > rows:
        warnings.warn(f"train.batch_size: {batch_size} is more than the {rows} training rows; "
                      f"every step takes all {rows}", stacklevel=2)


def _save_final(model, out):
    try:
        save_adapter(model, out)
    except OSError as e:  # a full disk, a read-only folder: the checkpoints still hold the run
        kept = list_checkpoints(out)
        where = f"; the last checkpoint {kept[-1][1]} holds the trained adapter" if kept else ""
        raise TrainingError(f"cannot write the adapter to {out}: {e.strerror or e}{where}") \
            from e
