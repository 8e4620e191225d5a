"""One run at a time in an output_dir. The same command started twice (two terminals, a job
resubmitted while the first still runs) would otherwise mix the two runs' checkpoints, metrics
and adapter in one folder, or, with overwrite: true, delete the running one's files. finetune()
takes the lock and train() (which finetune calls, and the Python API calls alone) takes it
again: a process that holds a folder's lock enters it again freely."""
import os
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows: runs take no lock there
    fcntl = None

_HELD = {}  # folder (resolved) -> how many blocks of this process hold its lock


@contextmanager
def output_dir_lock(output_dir, held=True):
    """Hold an exclusive lock on the folder `output_dir` (flock on the folder itself: the
    system drops it when the process ends, however it ends) while the block runs; a ConfigError
    when another process holds it. Folders made for it are removed again when the block leaves
    them empty (a run stopped by its config or data writes nothing). held=False: no lock (an
    MPI rank other than 0, which writes nothing there). Where the path is taken by a file, or
    the file system has no locks, the block runs without one."""
    out = Path(output_dir)
    held = held and fcntl is not None
    made = _make(out) if held else []
    key = out.resolve() if held and out.is_dir() else None
    fd = _lock(out) if key is not None and key not in _HELD else None
    if key is not None:
        _HELD[key] = _HELD.get(key, 0) + 1
    try:
        yield
    finally:
        if key is not None:
            _HELD[key] -= 1
            if not _HELD[key]:
                del _HELD[key]
        if fd is not None:
            os.close(fd)  # releases the lock
        _remove_if_empty(made)


def _make(out):
    """The folders made for `out`, innermost first ([] if it was there, or a file is in the way:
    the run's own check names that file)."""
    new = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError:
        return []
    return new


def _lock(out):
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"output_dir: {out} is in use by another packlora run (still "
                          "training, or writing its adapter); wait for it to end, or give "
                          "another folder") from None
    except OSError:  # no flock here (some network file systems): run without the lock
        os.close(fd)
        return None
    return fd


def _remove_if_empty(made):
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # files in it (the run wrote), or already gone
            return
