"""Atomic file writes: temp file in the same folder, fsync, rename — a crash leaves the old file."""
import contextlib
import json
import os
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yields a temp path next to `path`; on success it is fsynced and renamed over `path`.
    On any error the temp file is removed and `path` is untouched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except OSError as e:  # name the file the user knows, not the temp file
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror or str(e), path) from e
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(folder):
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path, text):
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def write_json(path, obj):
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_safetensors(path):
    """{name: numpy array} of a safetensors file, each tensor copied out of a mapping of its
    own: safetensors' load_file maps the whole file while it copies, so a process reading an
    adapter briefly holds it twice (the file's pages and the arrays)."""
    with safe_open(str(path), framework="numpy") as f:
        keys = list(f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    out = {}
    for key in keys:
        with safe_open(str(path), framework="numpy") as f:
            out[key] = f.get_tensor(key)
    return out


def save_safetensors(path, arrays, metadata=None):
    """numpy arrays -> a safetensors file, atomically."""
    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: _host(v) for k, v in arrays.items()}, tmp, metadata=metadata)


def _host(a):
    a = a.get() if hasattr(a, "get") else a
    return np.ascontiguousarray(a)
