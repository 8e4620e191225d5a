"""Training checkpoints: output_dir/checkpoints/step-N/ with the adapter, optimizer and state.

A checkpoint is written into `step-N.tmp/` (each file atomically) and the folder is renamed to
`step-N` only when complete, so a crash or a full disk never leaves a half checkpoint behind
and the previous one stays valid.
"""
import json
import re
import shutil
from pathlib import Path

from safetensors.numpy import load_file

from ..adapters import load_adapter, save_adapter
from ..errors import TrainingError
from ..fileio import _fsync_dir, save_safetensors, write_json

STATE, OPTIM = "trainer_state.json", "optimizer.safetensors"
_STEP_RE = re.compile(r"^step-(\d+)$")


def checkpoint_root(output_dir):
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir):
    """Complete checkpoints as (step, path), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(output_dir, step, model, optimizer, state, keep_last=None):
    """Write checkpoint `step`; drop older ones beyond keep_last. Returns its path."""
    root = checkpoint_root(output_dir)
    final = root / f"step-{step}"
    tmp = root / f"step-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_adapter(model, tmp)
        save_safetensors(tmp / OPTIM, optimizer.state_arrays(), metadata={"step": str(optimizer.t)})
        write_json(tmp / STATE, state)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _fsync_dir(root)
    except OSError as e:  # e.g. a full disk: name it, and point at the checkpoint still valid
        shutil.rmtree(tmp, ignore_errors=True)
        prev = list_checkpoints(output_dir)
        kept = f"; the previous checkpoint {prev[-1][1]} is intact" if prev else ""
        raise TrainingError(f"cannot write checkpoint {final}: {e.strerror or e}{kept}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last:
        for _, old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume(output_dir, resume):
    """The checkpoint folder to resume from: `auto` (newest complete one, or None) or a path."""
    if resume in (None, "", False):
        return None
    if str(resume) == "auto":
        found = list_checkpoints(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / STATE).is_file():
        raise TrainingError(f"resume: {path} is not a complete checkpoint (no {STATE})")
    return path


def load_checkpoint(path, model, optimizer):
    """Restore adapter weights and optimizer state; returns the trainer state dict."""

    path = Path(path)
    load_adapter(model, path)
    try:
        arrays = load_file(str(path / OPTIM))
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except Exception as e:  # a damaged file names itself
        raise TrainingError(f"{path}: cannot read checkpoint ({e})") from None
    try:
        optimizer.load_state_arrays(arrays, state["optimizer_step"])
    except KeyError as e:
        raise TrainingError(f"{path / OPTIM}: {e.args[0]}; the checkpoint was written for "
                            "other adapters than this run's") from None
    return state
