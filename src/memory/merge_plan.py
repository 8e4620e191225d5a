"""What `packlora merge --adapter RUN --out model.gguf` holds at its peak, from the plan's
inputs: users run out of memory in merges more than anywhere else.

The merge streams (gguf_out/merge.py). Throughout, the process holds itself (interpreter,
numpy, packlora: measured in this process now) and the adapter's tensors (read one tensor at a
time, fileio.load_safetensors, so the file is never mapped in whole beside them). Each changed
weight passes a bounded chunk of rows at a time through decode, merge and re-quantization, and
untouched tensors are copied in fixed pieces. Reading a GGUF base with pread keeps its pages out
of the process; a Hugging Face base's tensor is read whole (and, for Q/K in llama's layout,
copied once into the GGUF's row order)."""
import math

from ..gguf_out.merge import CHUNK_ELEMS, COPY_STEP, WORKSET_BYTES_PER_VALUE
from ..models.resolve import is_gguf
from ..tracker import rss_now

F32 = 4


def adapter_bytes(adapters) -> int:
    """float32 lora_A, lora_B (and DoRA magnitudes) of every planned adapter."""
    return sum(F32 * (t.rank * (t.n_in + t.n_out) + (t.n_out if t.dora else 0))
               for t in adapters.values())


def merge_plan(inp) -> dict:
    """{process, adapter, working_set, whole_tensor, copy_buffer, peak_bytes} of merging this
    run's adapter into its base as a GGUF file."""
    gguf = is_gguf(inp.source)
    largest = max(math.prod(s.shape) for s in (*inp.linears.values(), *inp.others.values()))
    parts = {"process": rss_now() or 0, "adapter": adapter_bytes(inp.adapters),
             "working_set": CHUNK_ELEMS * WORKSET_BYTES_PER_VALUE,
             "whole_tensor": 0 if gguf else 2 * F32 * largest,
             "copy_buffer": COPY_STEP if gguf else 0}
    return {**parts, "peak_bytes": sum(parts.values())}
