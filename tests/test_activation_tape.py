"""The memory plan's activation model checked against a real tape: a tiny model runs its
decoder blocks with autodiff on, and the bytes each block's Function nodes save (views resolved
to the arrays that own them, parameters left out) must equal the planner's bytes per block —
with and without gradient checkpointing, with and without dropout, with DoRA."""
import model_factory as mf
import numpy as np
import pytest
from packlora import Device
from packlora.adapters import apply_lora
from packlora.autodiff import Function, keeping_outputs
from packlora.memory.activations import BlockModel
from packlora.memory.inputs import plan_inputs
from packlora.memory.planner import activation_detail
from packlora.models import load_model
from packlora.ops import checkpoint
from packlora.ops.checkpoint import Checkpoint
from packlora.tensor import Tensor

B, T = 2, 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path, _ = mf.write_hf(tmp_path_factory.mktemp("tape") / "m", "llama")
    return path


def _owner(a):
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _nodes(out, seen):
    """Function nodes reachable from `out` that are not in `seen` (earlier blocks)."""
    stack, found = [out._fn], []
    while stack:
        fn = stack.pop()
        if not isinstance(fn, Function) or id(fn) in seen:
            continue
        seen.add(id(fn))
        found.append(fn)
        stack.extend(fn.parents)
    return found


def _bytes(fns, skip, extra=False):
    """Bytes of the distinct arrays the nodes save (or, with extra, keep as DoRA's `pre`),
    owners in `skip` left out; counted owners join `skip`."""
    total = 0
    for fn in fns:
        arrays = [fn.__dict__.get("pre")] if extra else list(fn.saved)
        for a in arrays:
            if not isinstance(a, np.ndarray):
                continue
            o = _owner(a)
            if id(o) not in skip:
                skip.add(id(o))
                total += o.nbytes
    return total


def _setup(folder, lora):
    run = {"model": str(folder), "quant": {"format": "nf4"}, "lora": lora,
           "data": {"train": "unused.jsonl", "max_seq_len": T}, "train": {"batch_size": B}}
    dev = Device.cpu().autodiff()
    dev.seed(0)
    model = apply_lora(load_model(folder, dev, quant=run["quant"], with_tokenizer=False),
                       run["lora"])
    ids = (np.arange(B * T, dtype=np.int32) * 7 % mf.VOCAB).reshape(B, T)
    cos, sin = model.rope_tables(0, T)
    skip = {id(_owner(p.data)) for _, p in model.named_parameters()}
    skip |= {id(_owner(cos)), id(_owner(sin))}
    h = model.model.embed_tokens(ids, dev)
    return BlockModel(plan_inputs(run)), model, h, (cos, sin), skip


LORAS = {"lora": {"targets": "all-linear", "rank": 4},
         "dropout": {"targets": "all-linear", "rank": 4, "dropout": 0.1},
         "dora": {"targets": ["q_proj", "v_proj", "down_proj"], "rank": 4, "use_dora": True},
         "some": {"targets": ["k_proj", "up_proj"], "rank": 2, "rank_pattern": {"up_proj": 3}}}


@pytest.mark.parametrize("lora", list(LORAS))
def test_block_activations_equal_the_tape(folder, lora):
    bm, model, h, rope, skip = _setup(folder, LORAS[lora])
    g = bm.forward(False)
    seen = set()
    for i, layer in enumerate(model.model.layers):
        h = layer(h, *rope)
        fns = _nodes(h, seen)
        # what the nodes save, and DoRA's pre-activation kept on its op: both are tracked
        held = _bytes(fns, skip) + _bytes(fns, skip, extra=True)
        assert held == g.held(i) - g.held(i - 1), (lora, i)
        assert g.held(i, tracked=False) == 0
    # the report's "one block, all activations kept" is the last block's, as the tape has it
    assert activation_detail(bm.inp)["per_block"] == held, lora


@pytest.mark.parametrize("lora", list(LORAS))
def test_checkpointed_blocks_equal_the_tape(folder, lora):
    bm, model, h, rope, skip = _setup(folder, LORAS[lora])
    g = bm.forward(True)
    seen = set()
    for i, layer in enumerate(model.model.layers):
        h = checkpoint(layer, h, *rope)
        (fn,) = _nodes(h, seen)
        assert isinstance(fn, Checkpoint) and fn.saved == ()
        assert _owner(fn.x).nbytes == g.held(i) - g.held(i - 1)  # the block's input only
        # the recompute in backward: the same block re-run with recording
        x = Tensor(fn.x, model.device)
        if fn.needs[0]:
            x.require_grad()
        with keeping_outputs():  # as Checkpoint.backward re-runs it
            out = fn.block(x, *fn.args)
        rec_skip = skip | {id(_owner(fn.x))}
        nodes, counted = _nodes(out, set()), set(rec_skip)
        saved = _bytes(nodes, counted) + _bytes(nodes, counted, extra=True)
        rec, untracked = bm.recompute(i, fn.needs[0])
        assert saved == rec - out.data.nbytes, (lora, i)
        assert untracked == 0
