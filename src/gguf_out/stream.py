"""Write a GGUF file tensor by tensor: metadata and tensor infos first (the `gguf` package's
writer), then each tensor's bytes as they are produced, in bounded pieces, so no tensor needs
to be whole in memory. The file appears under its name only when complete."""
import contextlib
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from ..errors import ModelError
from ..fileio import atomic_path

ALIGNMENT_KEY = "general.alignment"


class TensorPlan:
    """One tensor to be written: GGUF name, logical shape (out, in) and GGML type."""

    def __init__(self, name, shape, ggml_type: GGMLQuantizationType):
        self.name, self.shape, self.type = name, tuple(int(d) for d in shape), ggml_type

    @property
    def nbytes(self):
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        return rows * _row_bytes(self.type, self.shape[-1])


def _row_bytes(ggml_type, k):
    elems, nbytes = GGML_QUANT_SIZES[ggml_type]
    if k % elems:
        raise ModelError(f"a row of {k} values cannot be stored as {ggml_type.name} "
                         f"(blocks of {elems})")
    return k // elems * nbytes


def check_new_output(path) -> Path:
    """The output path, refused when something is already there (nothing is overwritten)."""
    path = Path(path)
    if path.exists():
        raise ModelError(f"{path}: the output file exists; remove it or choose another --out")
    if path.suffix.lower() != ".gguf":
        raise ModelError(f"{path}: a GGUF output needs a .gguf name")
    return path


class GGUFStream:
    """`with GGUFStream(path, arch, kv, tensors) as out: out.write(name, bytes_or_array)...`.

    kv: [(key, value, GGUFValueType, sub type or None)] (general.architecture is the writer's
    own); tensors: [TensorPlan] in file order. Each tensor's bytes are given with write() in
    one or more pieces, in the planned order; a short or long tensor is an error."""

    def __init__(self, path, arch, kv, tensors):
        self.path = check_new_output(path)
        self.arch, self.kv, self.tensors = arch, list(kv), list(tensors)
        self._stack = contextlib.ExitStack()
        self._fout = None
        self._left = None  # bytes still owed to the current tensor
        self._index = -1
        self.alignment = 32

    def __enter__(self):
        try:
            self._open()
        except BaseException as e:  # no __exit__ after a failed __enter__: unwind here
            self._stack.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def _open(self):
        tmp = self._stack.enter_context(atomic_path(self.path, ".gguf"))
        writer = GGUFWriter(tmp, self.arch)
        self._stack.callback(writer.close)
        for key, value, vtype, sub in self.kv:
            if key == ALIGNMENT_KEY:
                writer.data_alignment = self.alignment = int(value)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in self.tensors:
            writer.add_tensor_info(t.name, _byte_shape(t), np.dtype(np.uint8), t.nbytes, t.type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        self._fout = writer.fout[0]

    def write(self, name, data):
        """Append bytes of tensor `name` (the current one, or the next in the plan)."""
        if self._left == 0 or self._left is None:
            self._next(name)
        elif name != self.tensors[self._index].name:
            raise ModelError(f"{self.path}: tensor {self.tensors[self._index].name!r} is "
                             f"{self._left} bytes short")
        raw = memoryview(np.ascontiguousarray(data)).cast("B")
        if len(raw) > self._left:
            raise ModelError(f"{self.path}: tensor {name!r} got {len(raw) - self._left} bytes "
                             "more than its shape and type hold")
        self._fout.write(raw)
        self._left -= len(raw)

    def _next(self, name):
        self._index += 1
        if self._index >= len(self.tensors) or self.tensors[self._index].name != name:
            want = self.tensors[self._index].name if self._index < len(self.tensors) else None
            raise ModelError(f"{self.path}: tensor {name!r} written out of order (next: {want!r})")
        self._pad()
        self._left = self.tensors[self._index].nbytes

    def _pad(self):
        pos = self._fout.tell()
        self._fout.write(b"\0" * (-pos % self.alignment))

    def __exit__(self, kind, err, tb):
        if kind is None and (self._left or self._index + 1 != len(self.tensors)):
            done = self._index + (0 if self._left else 1)
            err = ModelError(f"{self.path}: only {done} of {len(self.tensors)} tensors written")
            self._stack.__exit__(type(err), err, None)
            raise err
        if kind is None:
            self._pad()
        return self._stack.__exit__(kind, err, tb)


def _byte_shape(t):
    """The (rows..., bytes per row) shape GGUFWriter turns back into the logical shape."""
    return (*t.shape[:-1], _row_bytes(t.type, t.shape[-1]))
