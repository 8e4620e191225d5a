"""`packlora merge ... --out model.gguf`: base + adapter as one self-contained GGUF.

Tensors stream one at a time, and the ones that change a block of rows at a time: the stored
rows are read from the file (not through a memory map, so the process does not grow by the
size of the base), decoded to float32, merged (W + s·B·A, DoRA's row rescale), re-quantized
and written. Untouched tensors are copied byte for byte. Each linear weight keeps the type it
had in a GGUF base unless `quantize` names another (a type, or a llama.cpp-style preset); an
embedding and LM head stored in float take it as llama.cpp's quantizer would (`_other_type`)."""
import os
import zlib

import numpy as np
from gguf import GGMLQuantizationType as GGML

from ..adapters.deltas import AdapterDeltas
from ..errors import ModelError
from ..models.gguf_file import gguf_name, hf_name
from ..models.identity import base_identity
from ..models.tensors import EMBEDDING_WEIGHTS, PROJECTIONS, linear_place
from ..quant import BY_GGUF_NAME, REGISTRY
from ..quant.presets import PRESETS, embedding_format, fit_rows, preset_format
from ..quant.regrid import requantize_on_grid
from .codec import decode_rows, encode_rows
from .layout import BaseLayout
from .metadata import chat_template_kv, file_type_kv, gguf_base_kv, hf_base_kv
from .stream import GGUFStream, TensorPlan, check_new_output

FLOAT_TYPES = {"f32": GGML.F32, "f16": GGML.F16, "bf16": GGML.BF16}
CHUNK_ELEMS = 1 << 20  # values merged at a time
# Bytes per value of that chunk at its peak (decoded, merged, re-quantized: the temporaries of
# regrid and of the K-quant searches), measured with tracemalloc: 36-52 B for every type
# (tests/test_merge_memory.py holds the merge to it).
WORKSET_BYTES_PER_VALUE = 56
COPY_STEP = 1 << 24  # bytes an untouched tensor is copied by
TARGETS = tuple(dict.fromkeys((*PRESETS, *FLOAT_TYPES, *(
    f.name for f in BY_GGUF_NAME.values()))))


class Job:
    """How one output tensor is made: copied from a GGUF base (`copy`), or produced in float
    (merged and/or re-quantized) as `out_type`."""

    def __init__(self, hf, gguf, shape, in_type, out_type, merge, copy, as_trained=False):
        self.hf, self.gguf, self.shape = hf, gguf, tuple(shape)
        self.in_type, self.out_type, self.merge, self.copy = in_type, out_type, merge, copy
        self.as_trained = as_trained  # a float weight taken as deq(Q(W)), as training held it


def _linear_place(hf, cfg):
    """`linear_place` of a linear weight, None for any other tensor."""
    for proj in PROJECTIONS:
        if hf is not None and hf.endswith(f".{proj}.weight"):
            return linear_place(cfg, proj, int(hf.split(".")[2]))
    return None


def out_type(quantize_to, place, k, stored):
    """The GGML type a linear weight is written in: the preset's pick, or the named type with
    llama.cpp's fallback for rows a K-quant cannot hold, or (no choice) the stored type."""
    if quantize_to is None:
        return stored
    if quantize_to in FLOAT_TYPES:
        return FLOAT_TYPES[quantize_to]
    fmt = preset_format(quantize_to, *place, k) if quantize_to in PRESETS else quantize_to
    return REGISTRY[fit_rows(fmt, k)].gguf_type


def plan_jobs(base, modules, quantize_to, mode):
    """The Job of every tensor of `base` (a BaseLayout), in the output's order; `modules`: the
    adapted modules' names (those merged)."""
    cfg = base.config
    jobs = []
    names = base.gguf.tensor_names() if base.gguf else sorted(
        base.source.names(), key=_hf_order)
    hfs = [hf_name(name) if base.gguf else name for name in names]
    tied = EMBEDDING_WEIGHTS[1] not in hfs  # llama.cpp: tied until it sees an output.weight
    for name, hf in zip(names, hfs, strict=True):
        gguf = name if base.gguf else gguf_name(name)
        stored, shape, _ = base.gguf.tensor(name) if base.gguf else ("F32", base.shape(name),
                                                                          None)
        in_type = GGML[stored]
        place = _linear_place(hf, cfg)
        merge = hf is not None and hf.removesuffix(".weight") in modules
        new = (out_type(quantize_to, place, shape[-1], in_type) if place else
               _other_type(quantize_to, hf, shape, in_type, tied))
        as_trained = (mode == "quantized" and (place is not None or hf in EMBEDDING_WEIGHTS)
                      and in_type in FLOAT_TYPES.values())
        copy = base.gguf is not None and not merge and not as_trained and new == in_type
        jobs.append(Job(hf, gguf, shape, in_type, new, merge, copy, as_trained))
    return jobs


def _other_type(quantize_to, hf, shape, stored, tied):
    """The GGML type of a tensor other than a linear weight. Norms, whatever is stored
    quantized, and all of a GGUF base without `quantize`: as stored (an HF base's in F32). The
    embedding and LM head stored in float: the float type named, under a preset llama.cpp's
    pick (`embedding_format`), under a quantized type Q8_0 (llama.cpp's converter at --outtype
    q8_0)."""
    if len(shape) == 1 or quantize_to is None or stored not in FLOAT_TYPES.values():
        return stored
    if quantize_to in FLOAT_TYPES:
        return FLOAT_TYPES[quantize_to]
    if quantize_to in PRESETS and hf in EMBEDDING_WEIGHTS:
        head = tied or hf == EMBEDDING_WEIGHTS[1]
        return REGISTRY[embedding_format(quantize_to, shape[-1], head)].gguf_type
    return GGML.Q8_0


def _hf_order(name):
    """llama.cpp's converter order: embedding, the blocks in order, final norm, head."""
    parts = name.split(".")
    layer = int(parts[2]) if name.startswith("model.layers.") else None
    rank = 0 if "embed_tokens" in name else 1 if layer is not None else 2
    return rank, layer or 0, name


def merge_to_gguf(model, adapter, out, quantize_to=None, base_mode=None):
    """Write base `model` (name, HF folder or .gguf) with the PEFT adapter `adapter` merged in
    as a GGUF file at `out`; `quantize_to`: a type or preset for the linear weights (default:
    each keeps its type from a GGUF base; F16 for an HF base). base_mode: what float linear
    weights are merged into, "float" (W) or "quantized" (deq(Q(W)) as training held them; the
    default for LoftQ adapters); stored-quantized weights are their own trained base. Returns
    the output path."""
    if quantize_to is not None and quantize_to not in TARGETS:
        raise ModelError(f"--quantize for a GGUF output must be one of {', '.join(TARGETS)}, "
                         f"got {quantize_to!r}")
    out = check_new_output(out)
    base = BaseLayout.open(model)
    deltas = AdapterDeltas(adapter, base.config)
    mode = deltas.base_mode(base_mode)
    if base.gguf is None and quantize_to is None:
        quantize_to = "f16"
    deltas.check_mergeable(base.source)
    jobs = plan_jobs(base, deltas.modules, quantize_to, mode)
    deltas.check_base(base_identity(model, base.path, None))  # shapes fit: is it its base?
    kv = gguf_base_kv(base.gguf) if base.gguf else hf_base_kv(base, model)
    kv = file_type_kv(kv, quantize_to) if quantize_to is not None else kv
    kv = chat_template_kv(kv, deltas.chat_template) if deltas.chat_template else kv
    plans = [TensorPlan(j.gguf, j.shape, j.out_type) for j in jobs]
    reader = _Reader(base)
    try:
        with GGUFStream(out, base.arch, kv, plans) as f:
            for j in jobs:
                pieces = reader.raw_pieces(j) if j.copy else _merged_pieces(base, deltas, j,
                                                                             reader)
                for piece in pieces:
                    f.write(j.gguf, piece)
    finally:
        reader.close()
    return out


class _Reader:
    """Stored bytes of a GGUF base's tensors, read with pread: the pages read are the kernel's
    cache, not this process's memory."""

    def __init__(self, base):
        self.base = base
        self.fd = os.open(base.gguf.path, os.O_RDONLY) if base.gguf else None

    def close(self):
        if self.fd is not None:
            os.close(self.fd)

    def raw_pieces(self, job, step=COPY_STEP):
        offset, n = self.base.gguf.tensor_location(job.gguf)
        for at in range(0, n, step):
            yield os.pread(self.fd, min(step, n - at), offset + at)

    def raw_rows(self, job, r0, r1):
        """The stored bytes of rows r0:r1, (rows, bytes per row) uint8."""
        offset, n = self.base.gguf.tensor_location(job.gguf)
        row_bytes = n // job.shape[0]
        raw = os.pread(self.fd, (r1 - r0) * row_bytes, offset + r0 * row_bytes)
        return np.frombuffer(raw, np.uint8).reshape(r1 - r0, row_bytes)


def _on_own_grid(job):
    """Whether a merged weight goes back onto the grid it is stored on (see quant.regrid)."""
    fmt = BY_GGUF_NAME.get(job.in_type.name)
    return job.merge and job.out_type == job.in_type and fmt is not None and not fmt.float16


def _whole_in_gguf_order(base, deltas, job, reader):
    """A tensor read whole (an HF base's, or one merged into deq(Q(W))) in the GGUF's row order;
    deq(Q(W)) is taken in HF row order, as training quantized it."""
    order = base.gguf_rows(job.hf, job.shape[0])
    if base.gguf is None:
        whole = np.asarray(base.source.get(job.hf), np.float32)
    else:
        whole = decode_rows(job.in_type, job.shape, reader.raw_rows(job, 0, job.shape[0]))
        whole = whole if order is None else whole[np.argsort(order)]
    if job.as_trained:
        whole = deltas.as_trained(whole, job.hf)
    return whole if order is None else whole[order]


def _merged_pieces(base, deltas, job, reader):
    """The output bytes of one float-path tensor, a block of rows at a time."""
    whole = None
    if base.gguf is None or job.as_trained:
        whole = _whole_in_gguf_order(base, deltas, job, reader)
        if whole.ndim == 1:
            yield encode_rows(job.out_type, whole, job.gguf)
            return
    rows, k = job.shape
    hf_rows = base.gguf_rows(job.hf, rows) if job.merge else None
    step = max(1, CHUNK_ELEMS // k)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        raw = None if whole is not None else reader.raw_rows(job, r0, r1)
        w = whole[r0:r1] if whole is not None else decode_rows(job.in_type, (r1 - r0, k), raw)
        if job.merge:
            sel = slice(r0, r1) if hf_rows is None else hf_rows[r0:r1]
            w = deltas.merged_rows(job.hf.removesuffix(".weight"), w, sel)
        if raw is not None and _on_own_grid(job):
            rng = np.random.default_rng([zlib.crc32(job.gguf.encode()), r0])  # reproducible
            yield requantize_on_grid(BY_GGUF_NAME[job.in_type.name].name, raw, w, rng)
        else:
            yield encode_rows(job.out_type, w, job.gguf)
