"""The memory plan: bytes per category and the step's peak, from the config alone (no weights)."""
from ..adapters.loftq import fit_workspace_bytes
from ..kernels import (
    CPU_GEMM_ACCUMULATES,
    CUDA_FUSED_MAX_M,
    FUSED_MAX_M,
    FUSED_MAX_M_BWD,
    column_align,
    cuda_scratch_need,
    tile_plan,
)
from ..lora_targets import layer_index
from ..tracker import CATEGORIES
from ..training.states import state_nbytes
from .activations import F32, BlockModel
from .dense_prices import dense_alternatives
from .inputs import plan_inputs
from .merge_plan import merge_plan

# ----------------------------------------------------------------------------- dense scratch


def scratch_need(storage, m, cap, backward, cuda=False):
    """Scratch bytes of one packed matmul with m rows: one tile as the kernels' own planner
    chooses it (on the CPU 0 on the small-batch paths, which the kernels take up to
    FUSED_MAX_M rows; on a GPU there the partial sums of a reduction split over blocks)."""
    if not storage.packed:
        return 0
    if cuda:
        return cuda_scratch_need(*storage.shape, m, F32 * cap, storage.block_size, backward)
    if m <= (FUSED_MAX_M_BWD if backward else FUSED_MAX_M):
        return 0
    n, k = storage.shape
    align = column_align(k, storage.format)
    pc, rc = tile_plan(k, n, cap, align, 1) if backward else tile_plan(n, k, cap, 1, align, m=m)
    return F32 * pc * rc


def _rows_bytes(m, n, cap_bytes):
    """Scratch of kernels.add_product on an (m, n) output: whole rows up to the cap."""
    return min(m, max(1, cap_bytes // (F32 * n))) * n * F32


def dense_scratch(inp):
    """The reused scratch grows to the largest tile any packed matmul (or LoRA product) of the
    step needs."""
    cap = inp.scratch_cap // F32
    need = 0
    for path, ad in inp.adapters.items():
        st = inp.linears.get(path) or inp.head_storage
        if ad.dora and st.packed:
            need = max(need, min(st.shape[0], max(1, cap // st.shape[1])) * st.shape[1] * F32)
    bm = BlockModel(inp)
    bm.forward(inp.grad_checkpointing)
    for i in range(inp.model.num_layers if inp.grad_checkpointing else 0):
        bm.recompute(i, i > 0)
    lora_scratch = inp.device != "cpu" or not CPU_GEMM_ACCUMULATES  # else BLAS accumulates in place
    for path, backward in bm.calls:  # LoRA: y += s·xa @ B.T, and dx += gxa @ A
        ad = inp.adapters.get(path)
        if ad is not None and lora_scratch:
            need = max(need, _rows_bytes(inp.tokens, ad.n_out, inp.scratch_cap))
            if backward and ad.dropout == 0:
                need = max(need, _rows_bytes(inp.tokens, ad.n_in, inp.scratch_cap))
    gpu = inp.device != "cpu"  # GPU: a tile of W's rows for cuBLAS above the fused sizes
    for path, backward in bm.calls:
        st = inp.linears[path]
        need = max(need, scratch_need(st, inp.tokens, cap, False, gpu))
        if backward:
            need = max(need, scratch_need(st, inp.tokens, cap, True, gpu))
    return max(need, _head_scratch(inp, cap, gpu))


def _head_scratch(inp, cap, gpu):
    """The head's products take a loss chunk of target rows at a time, the last one fewer: how
    many depends on the data, so on a GPU every count up to the fused sizes (whose reductions
    split into parts by the rows) is priced too."""
    rows = min(inp.loss_chunk, inp.tokens)
    counts = {rows, *range(1, min(rows, CUDA_FUSED_MAX_M) + 1)} if gpu else {rows}
    return max(scratch_need(inp.head_storage, m, cap, backward, gpu)
               for m in counts for backward in (False, True))


# ----------------------------------------------------------------------------- static parts

def static_categories(inp):
    base_packed = sum(st.nbytes for st in inp.linears.values())
    base_other = sum(st.nbytes for st in inp.others.values())
    adapters = sum(ad.params for ad in inp.adapters.values()) * F32
    optimizer = 2 * sum(state_nbytes(n, inp.state_bits) for ad in inp.adapters.values()
                        for n in ad.tensor_sizes)  # AdamW's two moments
    return {"base_packed": base_packed, "base_other": base_other,
            "dense_scratch": dense_scratch(inp), "adapters": adapters,
            "optimizer": optimizer, "workspace": allreduce_bytes(inp)}


def loftq_init_plan(inp):
    """LoftQ's initialisation, before training: the base and the adapters in place, plus one
    layer's SVD of its quantization error at a time (the largest sets the peak)."""
    iters = inp.run["lora"].get("loftq_iter", 1)
    svd = max(fit_workspace_bytes(ad.n_out, ad.n_in, iters) for ad in inp.adapters.values())
    st = static_categories(inp)
    held = st["base_packed"] + st["base_other"] + st["adapters"]
    return {"svd_workspace": svd, "peak_bytes": held + svd}


def allreduce_bytes(inp):
    """The flat float32 buffer a data-parallel run sums the adapter gradients in (0 alone)."""
    return sum(ad.params for ad in inp.adapters.values()) * F32 if inp.ranks > 1 else 0


def _grads_per_block(inp):
    """Adapter gradient bytes of each block, the head's adapters last (index num_layers)."""
    per = getattr(inp, "_grads_per_block", None)
    if per is None:
        per = [0] * (inp.model.num_layers + 1)
        for path, ad in inp.adapters.items():
            layer = layer_index(path)
            per[-1 if layer is None else layer] += ad.params * F32
        inp._grads_per_block = per
    return per


def _grads_after(inp, i):
    """Adapter gradient bytes of blocks > i (the head's adapters count as the last block)."""
    return sum(_grads_per_block(inp)[i + 1:])


def _grads_live(inp, i):
    """Adapter gradient bytes alive while block i runs its backward: every later block's, or
    only block i's own when train.step_in_backward applies and frees each as it completes."""
    if inp.step_in_backward:
        return _grads_per_block(inp)[i]
    return _grads_after(inp, i)


# ----------------------------------------------------------------------------- timeline

def timeline(inp, checkpointing):
    """[(moment, {category: bytes})] of one training step, in order."""
    cfg, bm = inp.model, BlockModel(inp)
    md = inp.tokens * cfg.hidden_size * F32
    targets = inp.tokens * 8  # int64 labels the loss keeps
    static = static_categories(inp)
    grads_all = _grads_after(inp, -1)
    accum = grads_all if inp.grad_accum > 1 else 0
    logits = min(inp.loss_chunk, inp.tokens) * cfg.vocab_size * F32
    g = bm.forward(checkpointing)

    def moment(name, act, grads, lg=0):
        cats = dict.fromkeys(CATEGORIES, 0)
        cats.update(static)
        cats.update(activations=act + targets, grads=grads, logits=lg)
        return name, cats

    # while the loss runs, its input (the final norm's output) is live next to dh and a chunk
    out = [moment("forward end (LM head + loss)", g.held() + md, accum, logits)]
    for i in reversed(range(cfg.num_layers)):
        grads = max(accum, _grads_live(inp, i))
        if checkpointing:
            rec, _ = bm.recompute(i, i > 0)
            after = md if i < cfg.num_layers - 1 else 0
            # the next block's input grad is a tracked leaf (g_in); that block's input itself
            # outlives its checkpoint: autodiff.backward's loop variable `p` still names it
            out.append(moment(f"backward (block {i}, recomputed)", g.held(i) + rec + after,
                              grads + after))
        else:
            out.append(moment(f"backward (block {i})", g.held(i), grads))
    out.append(moment("optimizer step", 0, 0 if inp.step_in_backward else grads_all))
    return out


def grads_peak(inp, checkpointing):
    """The grads category's own peak: with checkpointing a block's input grad is a tracked leaf
    too (x.grad inside the recompute, plus the incoming one)."""
    n = inp.model.num_layers
    if inp.step_in_backward:  # one block's at a time (the head's adapters are the last block's)
        total = max(_grads_per_block(inp))
    else:
        total = _grads_after(inp, -1)
    if not checkpointing:
        return total
    md = inp.tokens * inp.model.hidden_size * F32
    best = total + (md if n > 1 else 0)
    for i in range(1, n):
        best = max(best, _grads_live(inp, i - 1) + md + (md if i < n - 1 else 0))
    return best


def _mode_plan(inp, checkpointing):
    moments = timeline(inp, checkpointing)
    name, at = max(moments, key=lambda m: sum(m[1].values()))
    cats = {c: max(m[1][c] for m in moments) for c in CATEGORIES}
    cats["grads"] = grads_peak(inp, checkpointing)
    return {"categories": cats, "peak_bytes": int(sum(at.values())), "peak_at": name,
            "at_peak": at}


def activation_detail(inp):
    """Per-block activation bytes with and without checkpointing, and logits chunked vs full.
    per_block: what one block adds to the tape without checkpointing (its input, which its first
    norm saves, included); recompute_block: its checkpoint's recompute in backward."""
    bm = BlockModel(inp)
    cfg = inp.model
    last = cfg.num_layers - 1
    rec, _ = bm.recompute(last, True)
    kept, untracked = bm.block_held(last, True)
    md = inp.tokens * cfg.hidden_size * F32
    return {"per_block": kept, "per_block_untracked": untracked,
            "per_block_parent_only": bm.block_held(last, True, parent_only=True),
            "per_block_checkpointed": md, "recompute_block": rec,
            "logits_chunk": min(inp.loss_chunk, inp.tokens) * cfg.vocab_size * F32,
            "logits_full": inp.tokens * cfg.vocab_size * F32,
            "logits_full_with_grad": 2 * inp.tokens * cfg.vocab_size * F32}


def generation_plan(inp, static):
    """KV cache of generation for the run's batch and sequence (the cache is preallocated)."""
    cfg = inp.model
    kv = 2 * cfg.num_layers * inp.batch * inp.seq * cfg.num_kv_heads * cfg.head_dim * F32
    base = static["base_packed"] + static["base_other"] + static["adapters"]
    logits = inp.batch * cfg.vocab_size * F32
    return {"batch": inp.batch, "max_len": inp.seq, "kv_cache": kv,
            "peak_bytes": base + static["dense_scratch"] + kv + logits}


def plan_from_inputs(inp):
    """The plan dict (see `plan`) for resolved PlanInputs."""
    main = _mode_plan(inp, inp.grad_checkpointing)
    other = _mode_plan(inp, not inp.grad_checkpointing)
    on, off = (main, other) if inp.grad_checkpointing else (other, main)
    main["checkpointing"] = {"on": {"peak_bytes": on["peak_bytes"], "peak_at": on["peak_at"],
                                    "activations": on["categories"]["activations"]},
                             "off": {"peak_bytes": off["peak_bytes"], "peak_at": off["peak_at"],
                                     "activations": off["categories"]["activations"]}}
    main["activations_detail"] = activation_detail(inp)
    main["generation"] = generation_plan(inp, main["at_peak"])
    main["distributed"] = {"ranks": inp.ranks, "batch_per_rank": inp.batch,
                           "allreduce_bytes": allreduce_bytes(inp)}
    main["merge"] = merge_plan(inp)
    if inp.run["lora"].get("init") == "loftq":
        main["loftq_init"] = loftq_init_plan(inp)
    return {"run": inp.run, "plan": main, "dense_alternatives": dense_alternatives(inp, main)}


def plan(config, overrides=(), model=None, batch_size=None, seq_len=None,
         grad_checkpointing=None, ranks=1):
    """Plan the memory of a training step without loading weights.

    config: a RunConfig, YAML path or run dict, or a model alone (config.json dict or path,
    model folder, .gguf file, model name) planned with the run defaults. overrides: `key=value`
    strings as on the CLI. model: replaces the run's model source (e.g. a folder holding only
    config.json). Returns {"run", "plan": {"categories", "peak_bytes", "peak_at", ...},
    "dense_alternatives": {...}}. ranks: plan one rank of a data-parallel run of that many
    (its share of the global batch, plus the allreduce buffer under workspace).
    """
    inp = plan_inputs(config, overrides, model, batch_size, seq_len, grad_checkpointing,
                      ranks=ranks)
    return plan_from_inputs(inp)
