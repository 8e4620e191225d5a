"""Atomic file writes: temp file in the same folder, fsync, rename — a crash leaves the old file.
What appears under the user's name gets the mode any new file of theirs would (the umask's), or
keeps the mode of the file it replaces."""
import contextlib
import json
import os
import shutil
import stat
import struct
import tempfile

import numpy as np
from safetensors import safe_open

# safetensors' names for the numpy dtypes (bfloat16 arrives as uint16 bits, named by its writer).
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
                      "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


@contextlib.contextmanager
def atomic_path(path, suffix=""):
    """Yields a temp path next to `path`; on success it is fsynced and renamed over `path`.
    On any error the temp file is removed and `path` is untouched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=folder)  # mode 0600
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, _mode_for(path))
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


@contextlib.contextmanager
def atomic_folder(path):
    """Yields a temp folder next to `path` to fill (its files written atomically); on success it
    is renamed to `path`, or, where `path` is an empty folder (the user's own, perhaps their
    working directory), its files are moved into it. On any error the temp folder is removed
    and `path` is untouched. Errors name `path`, not the temp folder."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)  # mode 0700
    try:
        yield tmp
        if os.path.isdir(path):
            for name in sorted(os.listdir(tmp)):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
            os.rmdir(tmp)
            _fsync_dir(path)
        else:
            os.chmod(tmp, 0o777 & ~_umask())
            os.replace(tmp, path)
        _fsync_dir(parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        name = e.filename if isinstance(e.filename, str) else path
        raise OSError(e.errno, e.strerror or str(e), name.replace(tmp, path, 1)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _mode_for(path):
    """The mode a file written to `path` gets: the one it had (a rewrite keeps a chmod), else
    the mode the umask gives any new file."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask():
    """The process's umask (read by setting it; the most private one meanwhile)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


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


def safetensors_header(entries, metadata=None):
    """The bytes before a safetensors file's data: its 8-byte little-endian length, then JSON
    placing each (name, dtype code, shape, nbytes) entry at consecutive offsets in the order
    given, padded with spaces to a multiple of 8.

    The metadata's keys are sorted. safetensors' own writer orders them by a hash seeded per
    process, so two runs that trained the same bits wrote adapter files that differed."""
    header, offset = {}, 0
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"safetensors metadata maps str to str, got {key!r}: "
                                f"{type(value).__name__}")
        header["__metadata__"] = dict(sorted(metadata.items()))
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": [int(n) for n in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def save_safetensors(path, arrays, metadata=None):
    """numpy (or cupy) arrays -> a safetensors file, atomically. The same arrays and metadata
    give the same bytes: the largest items first, then by name (safetensors' own order, which
    keeps every tensor aligned to its item size), each written from its own buffer."""
    host = {name: _host(a) for name, a in arrays.items()}
    names = sorted(host, key=lambda name: (-host[name].dtype.itemsize, name))
    entries = []
    for name in names:
        a = host[name]
        if a.dtype.name not in SAFETENSORS_DTYPES:
            raise TypeError(f"{path}: tensor {name!r} has dtype {a.dtype}, which safetensors "
                            f"does not store")
        entries.append((name, SAFETENSORS_DTYPES[a.dtype.name], a.shape, a.nbytes))
    with atomic_path(path, ".safetensors") as tmp, open(tmp, "wb") as f:
        f.write(safetensors_header(entries, metadata))
        for name in names:
            f.write(host[name].data)


def _host(a):
    """A little-endian C-contiguous numpy array of `a` (copied off the GPU if it is there)."""
    a = a.get() if hasattr(a, "get") else np.asarray(a)
    return np.require(a, a.dtype.newbyteorder("<"), "C")
