"""The price of dense expansion: the same run priced as other toolkits hold the base weight."""
from .activations import F32

BF16 = 2


def _dense_base(inp, itemsize):
    """Bytes of every base tensor stored dense at `itemsize` bytes per element."""
    total = 0
    for st in list(inp.linears.values()) + list(inp.others.values()):
        n = 1
        for d in st.shape:
            n *= int(d)
        total += n * itemsize
    return total


def _numel(st):
    n, k = st.shape
    return int(n) * int(k)


def _entry(extra, peak, packlora_peak, how):
    return {"extra_bytes": int(extra), "peak_bytes": int(peak),
            "ratio_to_packlora": round(peak / packlora_peak, 4) if packlora_peak else None,
            "how": how}


def whole_model(inp, main, itemsize, label):
    """The whole base dense: packed storage and the bounded scratch replaced by dense arrays."""
    at = main["at_peak"]
    ours = at["base_packed"] + at["base_other"] + at["dense_scratch"]
    dense = _dense_base(inp, itemsize)
    peak = main["peak_bytes"] - ours + dense
    return _entry(dense - ours, peak, main["peak_bytes"],
                  f"all base tensors dense in {label}; activations and adapters as packlora's")


def per_layer_dequant(inp, main):
    """bitsandbytes / torchao / Unsloth at training batch sizes: each packed weight is expanded
    in full (float32 compute dtype) for its forward matmul and again for its backward matmul.
    One expansion is live at a time; at the peak the largest one is."""
    packed = [st for st in inp.linears.values() if st.packed]
    head = inp.head_storage
    if head.packed:
        packed.append(head)
    largest = max((_numel(st) for st in packed), default=0) * F32
    extra = largest - main["at_peak"]["dense_scratch"]
    return _entry(extra, main["peak_bytes"] + extra, main["peak_bytes"],
                  "the full dense weight of a layer per matmul (forward and backward), "
                  "instead of a bounded scratch tile")


def dense_effective_weight(inp, main):
    """Burn 0.22: W_eff = W + s·B·A built dense (float32) per adapted layer. W_eff is an input of
    the matmul on the tape, so it is kept until backward (per block when checkpointing), and
    backward materialises dW_eff (N, K) once more for the chain into A and B."""
    cfg = inp.model
    per_block = [0] * (cfg.num_layers + 1)
    largest = 0
    for path, ad in inp.adapters.items():
        st = inp.linears.get(path) or inp.head_storage
        layer = int(path.split(".")[2]) if path.startswith("model.") else cfg.num_layers
        per_block[layer] += _numel(st) * F32
        largest = max(largest, _numel(st) * F32)
    held = max(per_block) if inp.grad_checkpointing else sum(per_block)
    extra = held + largest - main["at_peak"]["dense_scratch"]
    return _entry(extra, main["peak_bytes"] + extra, main["peak_bytes"],
                  "W + s*B*A dense per adapted layer, kept for backward, plus its gradient")


def dense_alternatives(inp, main):
    return {"whole_model_fp32": whole_model(inp, main, F32, "float32"),
            "whole_model_bf16": whole_model(inp, main, BF16, "bfloat16"),
            "per_layer_dequant": per_layer_dequant(inp, main),
            "dense_effective_weight": dense_effective_weight(inp, main)}
