"""What a checkpoint was trained on — the resolved settings and the training data — so a resume
that would silently continue a different run is refused, naming what changed."""
import hashlib

import numpy as np

from ..errors import TrainingError

# Settings that change where files go or how often the run reports, not what it computes.
NOT_COMPARED = ("resume", "overwrite", "output_dir", "resume_allow", "train.eval_every",
                "train.save_every", "train.keep_last", "train.log_every", "data.valid")


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def settings(config):
    """{key path: value} of a RunConfig (or a dict of one) that the training result depends on."""
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    flat = _flatten(data)
    return {k: v for k, v in sorted(flat.items())
            if not any(k == n or k.startswith(n + ".") for n in NOT_COMPARED)}


def data_digest(examples):
    """{count, sha256} over every training example's token ids and labels, in order."""
    h = hashlib.sha256()
    for ex in examples:
        for arr in (ex.input_ids, ex.labels):
            a = np.ascontiguousarray(np.asarray(arr, dtype=np.int64))
            h.update(len(a).to_bytes(8, "little"))
            h.update(a.tobytes())
    return {"count": len(examples), "sha256": h.hexdigest()}


def fingerprint(config, examples, world_size=1):
    """What resume compares: the settings (with the number of processes) and the data."""
    return {"settings": None if config is None else {**settings(config), "world_size": world_size},
            "data": data_digest(examples)}


def default_settings(config):
    """The settings a config of this kind holds by default (a dict config: none), and one
    process: what a checkpoint ran with that was written before a setting existed."""
    defaults = settings(type(config).model_construct()) if hasattr(config, "model_dump") else {}
    return {**defaults, "world_size": 1}


def check_resume(saved, current, allow=(), where="checkpoint", defaults=None):
    """TrainingError naming every difference between the checkpoint's fingerprint and this run's,
    except keys listed in `allow` (a key path, a section such as 'train' for all its keys, or
    'data' for the training data). A setting the checkpoint does not record (newer than it)
    counts as its value in `defaults`."""
    if not saved or not current:
        return  # a checkpoint from before fingerprints: nothing to compare
    allow, defaults = set(allow), defaults or {}
    changed = {}  # key -> what changed
    old, new = saved.get("settings"), current.get("settings")
    if old is not None and new is not None:
        for key in sorted(set(old) | set(new)):
            before = old[key] if key in old else defaults.get(key)
            allowed = any(key == a or key.startswith(a + ".") for a in allow)
            if before != new.get(key) and not allowed:
                changed[key] = f"{key}: {before!r} -> {new.get(key)!r}"
    a, b = saved.get("data") or {}, current.get("data") or {}
    if a != b and "data" not in allow:
        changed["data"] = (f"the training data: {a.get('count')} examples (sha256 "
                           f"{str(a.get('sha256'))[:12]}) -> {b.get('count')} (sha256 "
                           f"{str(b.get('sha256'))[:12]})")
    if changed:
        raise TrainingError(
            f"resume: this run differs from the one that wrote {where}: "
            + "; ".join(changed.values()) + ". Resume with the settings it had, or allow the "
            f"change with resume_allow: [{', '.join(changed)}]")
