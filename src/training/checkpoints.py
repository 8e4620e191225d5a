"""Training checkpoints: output_dir/checkpoints/step-N/ with the adapter, optimizer and state.

A checkpoint is written into `step-N.tmp/` (each file atomically), its manifest (every file's
size and SHA-256) last, and the folder is renamed to `step-N` only then. A checkpoint is complete
when its manifest is there and every file has the size it names; resume verifies the hashes
before loading anything. Re-saving a step moves the old folder aside first (never deletes it
in place), so a kill at any instant leaves either the old or the new complete `step-N`, or
none — and resume then takes the newest complete one, saying which it skipped.
"""
import hashlib
import json
import shutil
from pathlib import Path


from ..adapters import load_adapter, save_adapter
from ..adapters.peft_io import CONFIG, WEIGHTS
from ..errors import TrainingError
from ..fileio import _fsync_dir, load_safetensors, save_safetensors, write_json
from ..run_layout import checkpoint_root, step_dirs

STATE, OPTIM, MANIFEST = "trainer_state.json", "optimizer.safetensors", "manifest.json"
FILES = (WEIGHTS, CONFIG, OPTIM, STATE)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_manifest(path):
    """The manifest's {file: {bytes, sha256}}, or None if it is missing or unreadable."""
    try:
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) and set(FILES) <= set(files) else None


def incomplete_reason(path):
    """Why `path` is not a complete checkpoint (None when it is): sizes only, no hashing."""
    if not path.is_dir():
        what = "a file" if path.exists() else "no such folder"
        return f"{what} (a checkpoint is a step-N folder under output_dir/checkpoints)"
    files = _read_manifest(path)
    if files is None:
        return f"no valid {MANIFEST} (not a checkpoint, or its write was interrupted)"
    for name, entry in files.items():
        p = path / name
        try:
            size = p.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {entry.get('bytes')}"
    return None


def named_checkpoint_problem(path):
    """Why the checkpoint `resume` names cannot be resumed from, or None; cheap (no hashing).
    A run folder or its checkpoints/ folder is said to hold checkpoints, naming them."""
    path = Path(path)
    if path.is_dir() and not (path / MANIFEST).exists():
        run = path.parent if path.name == "checkpoints" else path
        steps = [str(p.relative_to(path)) for _, p in step_dirs(run) if p.is_relative_to(path)]
        if steps:
            return (f"holds checkpoints ({', '.join(steps)}) but is not one: give one of them, "
                    "or resume: auto")
    return incomplete_reason(path)


def verify_checkpoint(path):
    """TrainingError unless every file of the checkpoint has the manifest's size and hash."""
    reason = incomplete_reason(path)
    if reason is None:
        for name, entry in _read_manifest(path).items():
            if _sha256(path / name) != entry.get("sha256"):
                reason = f"{name} does not match its SHA-256 in {MANIFEST} (damaged on disk)"
                break
    if reason is not None:
        raise TrainingError(f"{path}: cannot read checkpoint: {reason}")


def list_checkpoints(output_dir):
    """Complete checkpoints as (step, path), oldest first."""
    return [(s, p) for s, p in step_dirs(output_dir) if incomplete_reason(p) is None]


def start_over(output_dir, overwrite):
    """resume: auto found no checkpoint to continue. Starting at step 0 where a run is kept (its
    adapter, or checkpoints too damaged to read) would replace that run: a TrainingError unless
    overwrite, which first drops the unreadable checkpoints (the new run's would mix with them)."""
    out = Path(output_dir)
    steps = [p for _, p in step_dirs(out)]  # none of them could be read
    held = [str(p) for p in steps] + ([str(out / WEIGHTS)] if (out / WEIGHTS).is_file() else [])
    if held and not overwrite:
        raise TrainingError(f"resume: no checkpoint to continue in {out}, which holds a run "
                            f"({', '.join(held)}); starting over would replace it: set "
                            "overwrite: true for that")
    for p in steps:
        shutil.rmtree(p)


def what_is_kept(output_dir):
    """An interrupted run's last words: which checkpoint holds it and how to continue."""
    kept = list_checkpoints(output_dir)
    if not kept:
        return "no checkpoint was written yet (train.save_every): the steps so far are lost"
    step, path = kept[-1]
    return (f"{path} holds the run up to step {step}; the same command with resume=auto "
            "continues it")


def save_checkpoint(output_dir, step, model, optimizer, state, keep_last=None):
    """Write checkpoint `step`; drop older ones beyond keep_last. Returns its path."""
    root = checkpoint_root(output_dir)
    final, tmp, old = (root / f"step-{step}{s}" for s in ("", ".tmp", ".old"))
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    try:
        save_adapter(model, tmp)
        save_safetensors(tmp / OPTIM, optimizer.state_arrays(), metadata={"step": str(optimizer.t)})
        write_json(tmp / STATE, state)
        written = sorted(p.name for p in tmp.iterdir())  # FILES, and the chat template if any
        write_json(tmp / MANIFEST, {"step": step, "files": {
            n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)} for n in written}})
        if final.exists():
            final.rename(old)
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
    shutil.rmtree(old, ignore_errors=True)
    if keep_last:
        for _, stale in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def resume_candidates(output_dir, resume):
    """Checkpoint folders to try, best first, and notes on the step folders passed over:
    `auto` gives every step folder newest first (the caller skips unusable ones); a path gives
    that folder alone. None or '' gives nothing."""
    if resume in (None, "", False):
        return [], []
    if str(resume) != "auto":
        return [Path(resume)], []
    notes, out = [], []
    for step, path in reversed(step_dirs(output_dir)):
        reason = incomplete_reason(path)
        if reason is None:
            out.append(path)
        else:
            notes.append(f"skipped checkpoint {path}: {reason}")
    return out, notes


def read_state(path):
    """The trainer state of a checkpoint, after verifying every file (TrainingError when it is
    damaged or incomplete): what resume compares before anything is restored."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TrainingError(f"{path}: cannot read checkpoint ({e})") from None
    if not isinstance(state, dict):
        raise TrainingError(f"{path / STATE}: cannot read checkpoint (not a JSON object)")
    return state


def load_checkpoint(path, model, optimizer, state=None):
    """Restore adapter weights and optimizer state (the checkpoint verified first unless its
    `state`, read_state's, is given); returns the trainer state. A checkpoint that verifies
    but does not fit the model is a TrainingError too."""
    path = Path(path)
    state = read_state(path) if state is None else state
    try:
        load_adapter(model, path)
        arrays = load_safetensors(path / OPTIM)
    except Exception as e:  # a damaged file or another run's adapter names itself
        raise TrainingError(f"{path}: cannot read checkpoint ({e})") from None
    try:
        optimizer.load_state_arrays(arrays, state["optimizer_step"])
    except KeyError as e:
        raise TrainingError(f"{path / OPTIM}: {e.args[0]}; the checkpoint was written for "
                            "other adapters than this run's") from None
    return state
