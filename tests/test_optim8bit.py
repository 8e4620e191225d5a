"""8-bit AdamW (train.optimizer: adamw_8bit): both moments in bitsandbytes' blockwise 8-bit
form. The state codec against a numpy reference written here (nearest entry of the map per
value, blocks of 256), convergence against float32 AdamW, bit-exact resume."""
import model_factory as mf
import numpy as np
import pytest
import test_trainer as tt
from packlora import Device
from packlora.quant.codebooks import DYNAMIC_MAP, DYNAMIC_MAP_UNSIGNED
from packlora.tensor import Tensor
from packlora.training import optim, states
from packlora.training.run import finetune
from packlora.training.trainer import Trainer
from safetensors.numpy import load_file


def test_the_unsigned_map():
    u = DYNAMIC_MAP_UNSIGNED
    assert u.shape == (256,) and np.all(np.diff(u) > 0) and u[0] == 0 and u[-1] == 1
    # decade i holds 2^(i+1) midpoints of linspace(0.1, 1) times 10^(i-6): 254 values + 0, 1
    for i in range(7):
        lo, hi = 10.0 ** (i - 6) * 0.1, 10.0 ** (i - 6)
        assert ((u > lo) & (u < hi)).sum() == 2 ** (i + 1)


def _reference(x, code):
    """Codes and decoded values: per 256-block absmax, each value to its nearest map entry."""
    n = x.size
    blocks = np.concatenate([x, np.zeros(-n % 256, np.float32)]).reshape(-1, 256)
    absmax = np.abs(blocks).max(axis=1)
    y = (blocks / np.where(absmax > 0, absmax, 1)[:, None]).reshape(-1)[:n]
    codes = np.abs(y[:, None] - code[None, :]).argmin(axis=1)
    return codes, code[codes] * np.repeat(absmax, 256)[:n]


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [4096, 5000])  # whole blocks, and a ragged last block
def test_state_codec_against_numpy(signed, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.logspace(-6, 0, n)).astype(np.float32)
    x = x if signed else np.abs(x)
    st = states.BlockState8bit((n,), Device.cpu().memory, np, signed)
    st.store(x)
    codes, values = _reference(x, DYNAMIC_MAP if signed else DYNAMIC_MAP_UNSIGNED)
    np.testing.assert_array_equal(st.codes, codes)
    np.testing.assert_allclose(st.load(), values, rtol=1e-6, atol=0)
    assert states.state_nbytes(n, 8) == st.codes.nbytes + st.absmax.nbytes


def test_small_tensors_keep_float32_states():
    mem = Device.cpu().memory
    assert isinstance(states.make_state((64, 63), 8, mem, np, True), states.FloatState)
    assert isinstance(states.make_state((64, 64), 8, mem, np, True), states.BlockState8bit)
    assert states.state_nbytes(4095, 8) == 4 * 4095


def test_8bit_adamw_trains_like_float32_adamw(tmp_path, monkeypatch):
    """The tiny chat model fine-tuned with both: the 8-bit run's losses follow the float32
    run's within a few percent, and it learns as much."""
    monkeypatch.setattr(states, "MIN_8BIT_SIZE", 0)  # the tiny model's adapters are small
    setup = _setup(tmp_path)
    runs = {opt: finetune(tt.run_cfg(setup, tmp_path / opt, max_steps=18, lr=1e-2,
                                     optimizer=opt), progress=False)
            for opt in ("adamw", "adamw_8bit")}
    full, eight = (tt.losses(runs[o]) for o in ("adamw", "adamw_8bit"))
    assert eight[-1] < 0.7 * eight[0]  # it learned
    np.testing.assert_allclose(eight, full, rtol=0.05)


def _setup(tmp_path):
    return {"model": str(mf.tiny_chat_model(tmp_path / "m")),
            "train": str(tt.chat_data(tmp_path / "train.jsonl", 12)),
            "valid": str(tt.chat_data(tmp_path / "valid.jsonl", 3, seed=1))}


def test_8bit_resume_is_bit_exact(tmp_path, monkeypatch):
    """Stopped after step 4 (checkpoint at 3) and resumed: the losses and adapters of a run
    never stopped, bit for bit; the checkpoint holds the 8-bit codes themselves."""
    monkeypatch.setattr(states, "MIN_8BIT_SIZE", 0)  # the tiny model's adapters are small
    setup = _setup(tmp_path)

    def cfg(out):
        return tt.run_cfg(setup, out, max_steps=7, save_every=3, optimizer="adamw_8bit")
    whole = finetune(cfg(tmp_path / "a"), progress=False)
    orig = Trainer.train_step

    def crashing(self):
        if self.step == 4:
            raise RuntimeError("power cut")
        return orig(self)
    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(RuntimeError, match="power cut"):
        finetune(cfg(tmp_path / "b"), progress=False)
    monkeypatch.setattr(Trainer, "train_step", orig)
    saved = load_file(str(tmp_path / "b" / "checkpoints" / "step-3" / "optimizer.safetensors"))
    assert any(k.endswith(".exp_avg.codes") and v.dtype == np.uint8 for k, v in saved.items())
    c = cfg(tmp_path / "b")
    c["resume"] = "auto"
    resumed = finetune(c, progress=False)
    assert [r["step"] for r in resumed.history] == [4, 5, 6, 7]
    assert tt.losses(resumed) == tt.losses(whole)[3:]
    for (n, p), (_, q) in zip(whole.model.trainable(), resumed.model.trainable()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fused_8bit_update_is_the_array_path_bit_for_bit(monkeypatch, wd):
    """The CPU's fused kernel (decode, update, re-encode per block) against the array
    expressions it replaces: the same weights, codes and block maxima after several steps, on a
    ragged tensor with magnitudes over six decades and a block of zeros."""
    dev = Device.cpu()
    rng = np.random.default_rng(7)
    start = (rng.standard_normal(5000) * np.logspace(-6, 0, 5000)).astype(np.float32)
    grads = [(rng.standard_normal(5000) * np.logspace(0, -6, 5000)).astype(np.float32)
             for _ in range(4)]
    for g in grads:
        g[256:512] = 0.0

    def run(fused):
        if not fused:
            monkeypatch.setattr(optim, "adamw8_update", lambda *a: False)
        p = Tensor(start.copy(), dev)
        opt = optim.AdamW([("p", p)], lr=1e-2, weight_decay=wd, state_bits=8)
        for g in grads:
            p.grad = Tensor(g, dev)
            opt.step()
        monkeypatch.undo()
        return p.numpy(), opt.state_arrays()

    (wf, sf), (wa, sa) = run(True), run(False)
    np.testing.assert_array_equal(wf, wa)
    assert sf.keys() == sa.keys() and len(sf) == 4
    for k in sf:
        np.testing.assert_array_equal(sf[k], sa[k], err_msg=k)
    assert not np.array_equal(wf, start)
