"""The CUDA device path: its RNG (state saved as data, replayed in checkpoints and recomputed
dropout), its memory peak, the GPU scratch in the plan, and on a real GPU a whole tiny
fine-tune with a checkpoint and a bit-exact resume, and the cuBLAS-tiled products."""
import json
import shutil

import model_factory as mf
import numpy as np
import packlora.device as device_mod
import pytest
from packlora import Device, kernels
from packlora.errors import DeviceError
from packlora.kernels.cuda import ops as cuda_ops
from packlora.memory import plan
from packlora.quant import quantize
from packlora.rng import CountingRng
from packlora.tracker import MemoryTracker
from packlora.training.run import finetune
from packlora.training.trainer import Trainer
from gguf_blocks import random_packed
from test_trainer import _Crash, chat_data, losses, run_cfg


def test_counting_rng_state_replays_the_same_draws():
    rng = CountingRng(np, seed=7)
    rng.random((3,), dtype=np.float32)
    state = json.loads(json.dumps(rng.state))         # a checkpoint stores it as JSON
    first = [rng.random((4, 5), dtype=np.float32), rng.standard_normal((6,), dtype=np.float32),
             rng.uniform(-1, 1, size=(2, 2))]
    rng.state = state
    again = [rng.random((4, 5), dtype=np.float32), rng.standard_normal((6,), dtype=np.float32),
             rng.uniform(-1, 1, size=(2, 2))]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], rng.random((4, 5), dtype=np.float32))
    assert not np.array_equal(CountingRng(np, 8).random(5), CountingRng(np, 7).random(5))
    with pytest.raises(ValueError, match="not a CountingRng state"):
        rng.state = {"bit_generator": "PCG64"}
    older = {k: v for k, v in state.items() if k != "bits"}  # saved before Philox
    with pytest.warns(UserWarning, match="drew from the array module's default generator"):
        rng.state = older


def _crashing_after(step):
    """Trainer.train_step, crashing when the trainer reaches `step`."""
    orig = Trainer.train_step

    def crashing(self):
        if self.step == step:
            raise _Crash("power cut")
        return orig(self)
    return crashing


def _crash_after(monkeypatch, step):
    orig = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", _crashing_after(step))
    return orig


def test_gpu_rng_through_checkpointing_and_resume_on_the_cpu(tiny, tmp_path, monkeypatch):
    """The GPU's generator (CountingRng) given to the CPU device: dropout masks recomputed
    under gradient checkpointing and a resume from a checkpoint replay it exactly."""
    monkeypatch.setattr(device_mod, "_make_rng", lambda kind, xp, seed: CountingRng(xp, seed))

    def cfg(out, gc):
        c = run_cfg(tiny, out, max_steps=5, save_every=2, grad_checkpointing=gc)
        c["lora"]["dropout"] = 0.2
        return c
    plain = finetune(cfg(tmp_path / "plain", False), progress=False)
    ckpt = finetune(cfg(tmp_path / "gc", True), progress=False)
    assert losses(plain) == losses(ckpt)
    orig = _crash_after(monkeypatch, 3)
    with pytest.raises(_Crash):
        finetune(cfg(tmp_path / "b", True), progress=False)
    monkeypatch.setattr(Trainer, "train_step", orig)
    c = cfg(tmp_path / "b", True)
    c["resume"] = "auto"
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-2" / "trainer_state.json")
                       .read_text())
    assert "counting_rng" in json.dumps(state)
    assert losses(finetune(c, progress=False)) == losses(ckpt)[2:]


def test_resume_on_the_other_kind_of_device_seeds_from_the_saved_state(tiny, tmp_path,
                                                                       monkeypatch):
    """A GPU checkpoint (its generator state is CountingRng's) resumed on the CPU, as
    resume_allow: [device] lets a user: that stream cannot go on here, so the CPU's generator is
    seeded from the saved state, with a warning; the same resume twice trains the same."""
    def cfg(out):
        c = run_cfg(tiny, out, max_steps=4, save_every=2)
        c["lora"]["dropout"] = 0.2
        return c
    with monkeypatch.context() as m:
        m.setattr(device_mod, "_make_rng", lambda kind, xp, seed: CountingRng(xp, seed))
        m.setattr(Trainer, "train_step", _crashing_after(3))
        with pytest.raises(_Crash):
            finetune(cfg(tmp_path / "gpu"), progress=False)
    runs = []
    for name in ("a", "b"):
        shutil.copytree(tmp_path / "gpu", tmp_path / name)
        c = {**cfg(tmp_path / name), "resume": "auto"}
        with pytest.warns(UserWarning, match=r"random state is another device's \(cuda\)"):
            runs.append(losses(finetune(c, progress=False)))
    assert len(runs[0]) == 2 and all(np.isfinite(runs[0])) and runs[0] == runs[1]
    dev = Device.cpu()                                  # and a CPU state on a GPU's generator
    state = dev.rng_state()
    with monkeypatch.context() as m:
        m.setattr(device_mod, "_make_rng", lambda kind, xp, seed: CountingRng(xp, seed))
        dev.seed(0)
        with pytest.warns(UserWarning, match=r"another device's \(cpu\)"):
            dev.set_rng_state(state)
        assert isinstance(dev.rng, CountingRng)
    dev.seed(0)  # the CPU's own generator again, for the tests after this one


def test_a_gpu_input_for_a_host_weight_is_refused_in_words():
    class GpuArray:  # what the kernels' entry point sees of a cupy array
        __cuda_array_interface__ = {}
    w = quantize(np.ones((4, 64), np.float32), "q8_0")
    calls = [lambda: kernels.linear_fwd(GpuArray(), w), lambda: kernels.linear_bwd(GpuArray(), w),
             lambda: kernels.gather_rows(w, GpuArray(), np.empty((1, 64), np.float32))]
    for call in calls:
        with pytest.raises(DeviceError, match=r"input's device GPU \(cupy\); move it with "
                                              r"w.to_device\(dev\)"):
            call()


class _Pool:
    """cupy's memory pool as the tracker sees it: used bytes, no peak of its own."""

    def __init__(self):
        self.used = 1000

    def used_bytes(self):
        return self.used


class _HookBase:
    """cupy.cuda.MemoryHook as the tracker uses it: entered hooks, keyed by their names (a
    second of one name is refused, as cupy does), hear of each pool malloc on any GPU."""
    entered = {}

    def __enter__(self):
        if self.name in _HookBase.entered:
            raise KeyError(f"memory hook {self.name} already exists")
        _HookBase.entered[self.name] = self
        return self

    def __exit__(self, *exc):
        del _HookBase.entered[self.name]


def _pool_malloc(pool, nbytes, device_id=0):
    pool.used += nbytes
    for hook in list(_HookBase.entered.values()):
        hook.malloc_postprocess(device_id=device_id, size=nbytes, mem_size=nbytes)


def test_gpu_process_peak_counts_what_no_category_tracks():
    pool = _Pool()
    mem = MemoryTracker("cuda", pool, _HookBase)
    mem.start_process_measure()
    _pool_malloc(pool, 1 << 20)          # a temporary of cupy's own (no tracked array)
    pool.used -= 1 << 20
    assert mem.process_measure() == (1000, 1000 + (1 << 20))
    mem.stop_process_measure()
    assert _HookBase.entered == {} and mem.process_measure() == (None, None)
    _pool_malloc(pool, 1 << 22)          # not measuring: not heard
    pool.used -= 1 << 22
    mem.start_process_measure()
    assert mem.process_measure() == (1000, 1000)
    mem.stop_process_measure()


class _SharedPool:
    """cupy's default pool: one object for every GPU, its used bytes the current GPU's."""

    def __init__(self):
        self.used, self.current = {0: 1000, 1: 2000}, 0

    def used_bytes(self):
        return self.used[self.current]


def test_gpu_process_peaks_of_two_gpus_measured_at_once():
    """Each tracker's hook has a name of its own and samples its own GPU's allocations only."""
    pool = _SharedPool()
    mems = [MemoryTracker("cuda", pool, _HookBase, gpu) for gpu in (0, 1)]
    for mem in mems:
        mem.start_process_measure()
    pool.current = 1                                # GPU 1 allocates (and is current)
    pool.used[1] += 1 << 20
    for hook in list(_HookBase.entered.values()):
        hook.malloc_postprocess(device_id=1, size=1 << 20, mem_size=1 << 20)
    pool.used[1] -= 1 << 20
    pool.current = 0
    assert [mem.process_measure()[1] for mem in mems] == [1000, 2000 + (1 << 20)]
    for mem in mems:
        mem.stop_process_measure()
    assert _HookBase.entered == {}


def test_gpu_process_measure_is_a_peak_not_the_current_total():
    pool = _Pool()
    mem = MemoryTracker("cuda", pool, _HookBase)
    assert mem.process_measure() == (None, None)      # off until measuring starts
    mem.start_process_measure()
    _pool_malloc(pool, 4096)                          # a tracked array's allocation
    big = mem.track(np.zeros(1024, np.float32), "activations")   # sampled: 5096 used
    pool.used -= 4096
    del big
    assert mem.process_measure() == (1000, 5096)
    mem.reset_peak()
    assert mem.process_measure() == (1000, 1000)
    mem.stop_process_measure()


def test_plan_counts_the_gpu_tile_for_large_batches(tmp_path):
    model = mf.tiny_chat_model(tmp_path / "model")
    cfg = {"model": str(model), "quant": {"format": "nf4"}, "lora": {"rank": 4},
           "data": {"train": str(chat_data(tmp_path / "t.jsonl", 4)), "max_seq_len": 32},
           "train": {"batch_size": 1}, "output_dir": str(tmp_path / "o")}
    def scratch(tokens):
        p = plan({**cfg, "device": "cuda", "scratch_mib": 1}, batch_size=1, seq_len=tokens)
        return p["plan"]["categories"]["dense_scratch"]
    # M <= 16: fused kernels; the largest is the Q8_0 LM head's backward, dh (m, HIDDEN) summed
    # over the vocabulary in parts, beyond the LoRA products' rows (M x q_proj's width). The
    # head sees only the rows with a target, any count up to 16: at m <= 4 the GEMV backward
    # splits the vocabulary into more parts than the tile does at 16 (on this tiny head more
    # bytes than the head itself). M = 32: a tile of a whole W (the cap holds it), the largest
    # the LM head's (vocab, HIDDEN), or the head's parts when 16 or fewer rows have a target
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert vocab > mf.INTER
    (_, _, parts), _ = cuda_ops._tile_grid(16, mf.HIDDEN, vocab, cuda_ops.SMALL_M_TILE)
    assert parts > 1
    head = max(4 * cuda_ops.parts_elems(m, vocab, mf.HIDDEN, 32, True, (1 << 20) // 4)
               for m in range(1, 17))
    assert head > 4 * parts * 16 * mf.HIDDEN
    assert scratch(16) == head
    assert scratch(32) == max(head, 4 * vocab * mf.HIDDEN)


# ------------------------------------------------------------------------------- a real GPU
def _cupy():
    try:
        import cupy
    except ImportError:
        pytest.skip("no CUDA GPU: cupy not installed (the kernels run in the simulator instead: "
                    "test_kernels_cuda.py)")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA GPU: no device found")
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"no CUDA GPU: {e}")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nf4", "q4_k", "q8_0"])
@pytest.mark.parametrize("m", [1, 4, 16, 17, 300])
def test_gpu_products_through_the_entry_point(fmt, m):
    """M <= 4: the GEMV kernels; M <= 16: the fused tile (reduction split across blocks);
    above: decoded tiles of at most the scratch cap, multiplied by cuBLAS. Inputs are strided
    views."""
    cp = _cupy()
    rng = np.random.default_rng(2)
    n, k = 700, 1024
    w = (random_packed(fmt, n, k, rng) if fmt == "q4_k" else
         quantize(rng.standard_normal((n, k)).astype(np.float32), fmt, double_quant=True
                  if fmt == "nf4" else False))
    dev = Device.cuda(0)
    dev.set_scratch_cap(1 << 20)                      # 256 rows of K = 1024: three tiles
    wd = w.to_device(dev)
    dense = cp.asarray(w.dequantize())                                  # (N, K)
    # strided views (every other row, or column, of a wider array): no path may assume rows
    x = cp.asarray(rng.standard_normal((2 * m, k + 3)).astype(np.float32))[::2, 1:k + 1]
    dy = cp.asarray(rng.standard_normal((m, 2 * n)).astype(np.float32))[:, ::2]  # (M, N)
    for got, ref in [(kernels.linear_fwd(x, wd, device=dev), x @ dense.T),
                     (kernels.linear_bwd(dy, wd, device=dev), dy @ dense)]:
        err = float(cp.abs(got - ref).max() / cp.abs(ref).max())
        assert err < 1e-4, f"{fmt} M={m}: rel err {err}"
    assert dev.memory.current["dense_scratch"] <= 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda-run")
    return {"model": str(mf.tiny_chat_model(d / "model")),
            "train": str(chat_data(d / "train.jsonl", 12)),
            "valid": str(chat_data(d / "valid.jsonl", 3, seed=1)), "dir": d}


@pytest.mark.gpu
def test_gpu_fine_tune_checkpoint_and_bit_exact_resume(tiny, tmp_path, monkeypatch):
    """Two-step checkpoints, dropout recomputed under gradient checkpointing, a crash after
    step 3 and `resume: auto`: the same losses to the bit; and close to the CPU's losses."""
    _cupy()

    def cfg(out, device="cuda"):
        c = run_cfg(tiny, out, max_steps=5, save_every=2, grad_checkpointing=True)
        c["lora"]["dropout"] = 0.1
        c["device"] = device
        return c
    whole = finetune(cfg(tmp_path / "a"), progress=False)
    assert all(np.isfinite(losses(whole)))
    orig = _crash_after(monkeypatch, 3)
    with pytest.raises(_Crash):
        finetune(cfg(tmp_path / "b"), progress=False)
    monkeypatch.setattr(Trainer, "train_step", orig)
    shutil.copytree(tmp_path / "b", tmp_path / "on-cpu")  # the GPU's step-2 checkpoint
    c = cfg(tmp_path / "b")
    c["resume"] = "auto"
    resumed = finetune(c, progress=False)
    assert losses(resumed) == losses(whole)[2:]
    c = {**cfg(tmp_path / "on-cpu", "cpu"), "resume": "auto",
         "resume_allow": ["device", "scratch_mib"]}
    with pytest.warns(UserWarning, match=r"another device's \(cuda\)"):
        on_cpu = losses(finetune(c, progress=False))
    assert len(on_cpu) == 3 and all(np.isfinite(on_cpu))  # steps 3 to 5, on the CPU
    cpu = finetune(cfg(tmp_path / "c", "cpu"), progress=False)
    assert abs(losses(cpu)[0] - losses(whole)[0]) < 1e-3 * abs(losses(cpu)[0])


@pytest.mark.gpu
def test_gpu_tf32_products_follow_cupys_switch():
    """TF32 on: the decoded-tile products (M > 16, cuBLAS) round their inputs to TF32 as cupy's
    own matmul then does: close to float32 and not equal to it. Off again: float32 as before."""
    cp = _cupy()
    dev = Device.cuda(0)
    if int(cp.cuda.Device(0).compute_capability) < 80:
        pytest.skip("no TF32 tensor cores on this GPU (compute capability below 8.0)")
    rng = np.random.default_rng(3)
    host = random_packed("q4_k", 300, 1024, rng)
    w, dense = host.to_device(dev), cp.asarray(host.dequantize())           # dense (N, K)
    x = cp.asarray(rng.standard_normal((40, 1024)).astype(np.float32))      # (M, K)
    dy = cp.asarray(rng.standard_normal((40, 300)).astype(np.float32))      # (M, N)

    def products():
        return (kernels.linear_fwd(x, w, device=dev), kernels.linear_bwd(dy, w, device=dev))
    dev.set_tf32(False)  # whatever CUPY_TF32 says
    f32 = products()
    try:
        dev.set_tf32(True)
        assert dev.tf32
        tf32, refs = products(), (x @ dense.T, dy @ dense)
    finally:
        dev.set_tf32(False)
    assert not dev.tf32
    again = products()
    for got, ref, plain, repeat in zip(tf32, refs, f32, again):
        scale = float(cp.abs(plain).max())
        assert float(cp.abs(got - ref).max()) / scale < 5e-3       # TF32 on both sides
        assert float(cp.abs(got - plain).max()) / scale > 1e-6     # not float32
        assert float(cp.abs(repeat - plain).max()) / scale < 1e-6  # float32 again


@pytest.mark.gpu
def test_gpu_fine_tune_with_tf32(tiny, tmp_path):
    """`tf32: true` in a run: its cuBLAS products on TF32 tensor cores, so losses that differ
    from the float32 run's, but little; the switch left as the run set it."""
    cp = _cupy()
    if int(cp.cuda.Device(0).compute_capability) < 80:
        pytest.skip("no TF32 tensor cores on this GPU (compute capability below 8.0)")

    def cfg(out, tf32):
        c = run_cfg(tiny, out, max_steps=3)
        c.update(device="cuda", tf32=tf32)
        return c
    try:
        f32 = losses(finetune(cfg(tmp_path / "f", False), progress=False))
        tf32 = losses(finetune(cfg(tmp_path / "t", True), progress=False))
        assert Device.cuda(0).tf32
    finally:
        Device.cuda(0).set_tf32(False)
    assert tf32 != f32
    assert all(abs(a - b) < 1e-2 * abs(a) for a, b in zip(f32, tf32))
