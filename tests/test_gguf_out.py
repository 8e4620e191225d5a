"""Adapters and merged models written as GGUF, read back with the `gguf` package's reader (an
independent implementation of the format): llama.cpp's adapter layout and scale rule, the
converter's Q/K row permutation (model_factory.llama_permute), bytes of untouched tensors,
and the errors for what cannot be written. llama.cpp itself runs them in
test_llama_cpp_adapters.py."""
import os
import signal
import subprocess
import sys
import warnings

import gguf
import model_factory as mf
import numpy as np
import pytest
from packlora import (
    Device,
    apply_lora,
    export_gguf_adapter,
    load_adapter,
    load_model,
    merge,
    save_adapter,
    without_autodiff,
)
from packlora.adapters.peft_io import BaseMismatchWarning
from packlora.cli import main
from packlora.errors import ModelError
from packlora.gguf_out.merge import TARGETS
from packlora.gguf_out.metadata import FILE_TYPES
from packlora.gguf_out.stream import GGUFStream
from safetensors.numpy import load_file, save_file

MERGES = [("h", "e"), ("l", "l"), ("1", "2"), ("he", "ll")]  # a tokenizer llama.cpp can load
LORA = {"use_rslora": True, "alpha_pattern": {"o_proj": 3.0}, "rank_pattern": {"down_proj": 2}}


def _adapter(base, out, quant="none", seed=0, **lora):
    """A random ("trained") adapter on every linear layer of `base`, saved to `out`."""
    dev = Device.cpu().autodiff()
    dev.seed(seed)
    model = load_model(base, dev, quant=quant)
    apply_lora(model, {"targets": "all-linear", "rank": 4, "alpha": 8, **lora})
    rng = np.random.default_rng(seed)
    for _, p in model.trainable():
        p.data[...] = (0.1 * rng.standard_normal(p.shape)).astype(np.float32) if p.ndim == 2 \
            else p.data * 1.2
    save_adapter(model, out)
    return model


def _peft_modules(adapter):
    """{module path: (A, B)} straight from the PEFT file."""
    w = load_file(str(adapter / "adapter_model.safetensors"))
    pre = "base_model.model."
    return {k[len(pre):-len(".lora_A.weight")]: (v, w[k.replace("lora_A", "lora_B")])
            for k, v in w.items() if k.endswith(".lora_A.weight")}


def _peft_scale(path, rank, lora):
    """PEFT's scaling, written out here: alpha (or its pattern) over r, or sqrt(r) for rsLoRA."""
    alpha = next((v for k, v in lora.get("alpha_pattern", {}).items() if path.endswith(k)), 8)
    return alpha / (np.sqrt(rank) if lora.get("use_rslora") else rank)


def _gguf_order(path, rows, arch):
    """Rows of `path`'s delta in the GGUF's order: llama files permute Q and K."""
    if arch != "llama" or not path.endswith(("q_proj", "k_proj")):
        return rows
    return mf.llama_permute(rows, mf.HEADS if path.endswith("q_proj") else mf.KV_HEADS)


def _read(path):
    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("lora", [{}, LORA], ids=["lora", "rslora-patterns"])
def test_adapter_gguf_holds_what_llama_cpp_applies(tmp_path, arch, lora):
    base, _ = mf.write_gguf(tmp_path / "base.gguf", arch)
    _adapter(base, tmp_path / "ad", **lora)
    out = export_gguf_adapter(tmp_path / "ad", tmp_path / "ad.gguf", model=base)
    r, tensors = _read(out)
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["general.architecture"].contents() == arch
    alpha = float(r.fields["adapter.lora.alpha"].contents())
    peft = _peft_modules(tmp_path / "ad")
    names = {f"{mf.to_gguf_name(p + '.weight')}.lora_{x}" for p in peft for x in "ab"}
    assert set(tensors) == names
    for path, (a, b) in peft.items():
        name = mf.to_gguf_name(path + ".weight")
        la, lb = tensors[name + ".lora_a"].data, tensors[name + ".lora_b"].data
        assert la.shape == a.shape and lb.shape == b.shape          # (r, n_in), (n_out, r)
        # llama.cpp: W x + (alpha / r) * lora_b @ (lora_a @ x), r = lora_b's row length
        theirs = np.float32(alpha) / np.float32(lb.shape[1]) * (lb @ la)
        want = _gguf_order(path, _peft_scale(path, a.shape[0], lora) * (b @ a), arch)
        np.testing.assert_allclose(theirs, want, rtol=1e-5, atol=1e-7)


def test_adapter_gguf_outtypes(tmp_path):
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama")
    _adapter(base, tmp_path / "ad")
    for outtype, want in (("f16", {"F16"}), ("q8_0", {"Q8_0", "F16"})):
        out = export_gguf_adapter(tmp_path / "ad", tmp_path / f"{outtype}.gguf", model=base,
                                  outtype=outtype)
        _, tensors = _read(out)
        types = {t.tensor_type.name for t in tensors.values()}
        assert types == want  # Q8_0 where rows hold whole blocks (lora_a), F16 for r = 4 rows
        a = tensors["blk.0.attn_v.weight.lora_a"]
        exact = _peft_modules(tmp_path / "ad")["model.layers.0.self_attn.v_proj"][0]
        deq = gguf.quants.dequantize(a.data, a.tensor_type).reshape(exact.shape)
        np.testing.assert_allclose(deq, exact, atol=np.abs(exact).max() / 100)


@pytest.mark.parametrize("quantize_to", [None, "f32", "q4_0"])
def test_merged_gguf_from_a_gguf_base(tmp_path, quantize_to):
    base, stored = mf.write_gguf(tmp_path / "base.gguf", "llama", "Q8_0")
    _adapter(base, tmp_path / "ad")
    out = merge(base, tmp_path / "ad", tmp_path / "m.gguf", quantize=quantize_to)
    r0, before = _read(base)
    r1, after = _read(out)
    assert list(before) == list(after)
    for key in r0.fields:
        if not key.startswith("GGUF.") and key != "general.file_type":
            assert r1.fields[key].contents() == r0.fields[key].contents(), key
    peft = _peft_modules(tmp_path / "ad")
    for name, t in before.items():
        path = next((p for p in peft if mf.to_gguf_name(p + ".weight") == name), None)
        if path is None and quantize_to is None or t.data.ndim == 1:
            assert after[name].data.tobytes() == t.data.tobytes(), name  # copied as stored
            continue
        a, b = peft[path] if path else (None, None)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        want = w if path is None else w + _gguf_order(path, _peft_scale(path, 4, {}) * (b @ a),
                                                      "llama")
        got = gguf.quants.dequantize(after[name].data, after[name].tensor_type)
        if quantize_to == "f32":
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:  # one step of the grid at most (past its ends: clipped), unbiased on the whole
            grid = w if quantize_to is None else want  # kept: the base's; new: the merged's
            amax = np.abs(grid).reshape(-1, 32).max(axis=1).repeat(32).reshape(want.shape)
            step = amax / (127 if quantize_to is None else 7)
            clipped = np.maximum(np.abs(want) - amax, 0)
            assert (np.abs(got - want) <= 1.01 * step + clipped).all(), name
            assert abs((got - want).mean()) < 0.05 * step.mean()


def test_every_quantize_choice_names_its_file_type(tmp_path):
    """--quantize iq4_xs: rows of 64 fall back to IQ4_NL (llama.cpp's choice), and the file's
    general.file_type says IQ4_XS, as for every other choice."""
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama", "Q8_0")
    _adapter(base, tmp_path / "ad")
    out = merge(base, tmp_path / "ad", tmp_path / "m.gguf", quantize="iq4_xs")
    r, after = _read(out)
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_IQ4_XS)
    assert {t.tensor_type.name for name, t in after.items()
            if name.startswith("blk.") and t.data.ndim == 2} == {"IQ4_NL"}
    assert set(TARGETS) <= set(FILE_TYPES)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_preset_quantizes_a_float_embedding_and_head_as_llama_cpp_does(tmp_path, arch):
    """An F16 GGUF base merged under q4_k_m: its embedding and head take the types llama.cpp's
    Q4_K_M gives rows of 64 (test_presets_llama_cpp.py holds the rule to llama.cpp's own
    files): the head and an embedding tied to it (Qwen2's here) Q8_0, an untied embedding Q5_0
    (Q4_K's fallback); each within one step of its grid of the stored weights."""
    base, stored = mf.write_gguf(tmp_path / "base.gguf", arch, "F16")
    _adapter(base, tmp_path / "ad")
    out = merge(base, tmp_path / "ad", tmp_path / "m.gguf", quantize="q4_k_m")
    _, after = _read(out)
    heads = {"model.embed_tokens.weight": "Q5_0" if arch == "llama" else "Q8_0"}
    heads.update({"lm_head.weight": "Q8_0"} if arch == "llama" else {})
    assert ("output.weight" in after) == (arch == "llama")
    for hf, qtype in heads.items():
        t = after[mf.to_gguf_name(hf)]
        assert t.tensor_type.name == qtype, hf
        w = stored[hf][1].astype(np.float32)                                  # (V, D)
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        amax = np.abs(w).reshape(-1, 32).max(axis=1).repeat(32).reshape(w.shape)
        step = amax / (16 if qtype == "Q5_0" else 127)
        assert (np.abs(got - w) <= 1.01 * step).all(), hf


def test_merged_gguf_from_an_hf_base(tmp_path):
    hf = mf.tiny_chat_model(tmp_path / "hf", merges=MERGES)
    model = _adapter(hf, tmp_path / "ad", **LORA)
    out = merge(hf, tmp_path / "ad", tmp_path / "m.gguf", quantize="f32")
    r, tensors = _read(out)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "llama" and f["llama.block_count"] == mf.LAYERS
    assert f["llama.attention.head_count_kv"] == mf.KV_HEADS
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"]
    tok = model.tokenizer
    assert f["tokenizer.ggml.tokens"][tok.eos_token_id] == "<|im_end|>"
    assert f["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert "im_start" in f["tokenizer.chat_template"]
    peft = _peft_modules(tmp_path / "ad")
    hf_w = load_file(str(hf / "model.safetensors"))
    path = "model.layers.1.self_attn.q_proj"
    a, b = peft[path]
    want = mf.llama_permute(hf_w[path + ".weight"] + _peft_scale(path, 4, LORA) * (b @ a),
                            mf.HEADS)
    np.testing.assert_allclose(tensors["blk.1.attn_q.weight"].data, want, rtol=1e-6, atol=1e-6)
    merged = load_model(out, quant="none")
    ids = np.array([tok.encode("<|im_start|>user\n1+2=3<|im_end|>")])
    with without_autodiff():
        want, got = model(ids).numpy(), merged(ids).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert merged.tokenizer.encode("hello 12") == tok.encode("hello 12")


def test_what_an_adapter_gguf_cannot_hold_is_refused(tmp_path):
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama")
    _adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(ModelError, match="DoRA.*merge"):
        export_gguf_adapter(tmp_path / "dora", tmp_path / "x.gguf", model=base)
    merged = merge(base, tmp_path / "dora", tmp_path / "dora.gguf", quantize="f32")
    assert merged.is_file()  # the merged export takes DoRA
    assert not (tmp_path / "x.gguf").exists()


def test_adapter_for_another_base(tmp_path, monkeypatch):
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama")
    _adapter(base, tmp_path / "ad")
    with monkeypatch.context() as m:
        m.setattr(mf, "INTER", 2 * mf.INTER)  # same names, wider MLP
        other, _ = mf.write_gguf(tmp_path / "wide.gguf", "llama")
    for fn in (lambda o: export_gguf_adapter(tmp_path / "ad", o, model=other),
               lambda o: merge(other, tmp_path / "ad", o)):
        with warnings.catch_warnings(), pytest.raises(ModelError, match="not this adapter's base"):
            warnings.simplefilter("error", BaseMismatchWarning)  # the error alone, no warning
            fn(tmp_path / "o.gguf")
        assert not (tmp_path / "o.gguf").exists()
    with warnings.catch_warnings(), pytest.raises(ModelError, match="has shape"):
        warnings.simplefilter("error", BaseMismatchWarning)
        load_adapter(load_model(other, quant="none"), tmp_path / "ad")
    same_shape, _ = mf.write_gguf(tmp_path / "b2.gguf", "llama",
                                  weights=mf.random_weights("llama", seed=7))
    with pytest.warns(BaseMismatchWarning, match="trained on"):
        export_gguf_adapter(tmp_path / "ad", tmp_path / "w.gguf", model=same_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the base it was trained on: no warning
        export_gguf_adapter(tmp_path / "ad", tmp_path / "ok.gguf", model=base)
        load_adapter(load_model(base, quant="none"), tmp_path / "ad")
    with pytest.warns(BaseMismatchWarning):
        load_adapter(load_model(same_shape, quant="none"), tmp_path / "ad")


def test_existing_output_and_interrupted_export(tmp_path, monkeypatch, capsys):
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama")
    _adapter(base, tmp_path / "ad")
    out = tmp_path / "ad.gguf"
    out.write_bytes(b"keep me")
    code = main(["export-gguf", str(tmp_path / "ad"), "--out", str(out), "--model", str(base)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "exists" in err and "\n" not in err
    assert out.read_bytes() == b"keep me"
    out.unlink()
    calls = []

    def dies(self, name, data):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, name, data)
    real = GGUFStream.write
    monkeypatch.setattr(GGUFStream, "write", dies)
    for cmd in (["export-gguf", str(tmp_path / "ad"), "--out", str(out), "--model", str(base)],
                ["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out",
                 str(out)]):
        calls.clear()
        assert main(cmd) == 130
        assert sorted(os.listdir(tmp_path)) == ["ad", "base.gguf"]  # no file, no temp file
    monkeypatch.setattr(GGUFStream, "write", real)
    assert main(["merge", "--model", str(base), "--adapter", str(tmp_path / "ad"), "--out",
                 str(out), "--quantize", "q4_k_m"]) == 0
    assert gguf.GGUFReader(str(out)).fields["general.file_type"].contents() == 15


@pytest.mark.parametrize("init", ["kaiming", "loftq", "loftq-3"])
def test_merging_into_the_base_the_adapter_was_trained_against(tmp_path, init):
    """A QLoRA adapter trained on NF4(W): merged into W by default (PEFT's merge), into
    deq(NF4(W)) with base="quantized" — then the merged model computes what the adapted packed
    model computed, its Q8_0 embedding and head (quant.embeddings: auto) replayed too. LoftQ
    adapters, fitted to W - deq(Q(W)), take the quantized base by default."""
    hf = mf.tiny_chat_model(tmp_path / "hf", merges=MERGES)
    loftq = {"init": "loftq", "loftq_iter": int(init[-1])} if init.startswith("loftq-") else {}
    model = _adapter(hf, tmp_path / "ad", quant="nf4", **({"init": init} | loftq))
    assert model.quant["embeddings"] == "q8_0" and model.lm_head.weight.format == "q8_0"
    ids = np.array([model.tokenizer.encode("<|im_start|>user\n1+2<|im_end|>")])

    def logits(m):
        with without_autodiff():
            return m(ids).numpy()
    want = logits(model)
    close = {"rtol": 1e-4, "atol": 1e-4 * np.abs(want).max()}
    for base, out in (("quantized", "q.gguf"), ("quantized", "q"), (None, "d.gguf")):
        path = merge(hf, tmp_path / "ad", tmp_path / out, quantize="f32" if out.endswith(
            ".gguf") else None, base=base)
        got = logits(load_model(path, quant="none"))
        if base == "quantized" or init.startswith("loftq"):
            np.testing.assert_allclose(got, want, **close)
        else:  # W + s·B·A: the float base, not the one trained on
            assert np.abs(got - want).max() > 10 * close["atol"]


def test_the_quantized_base_needs_the_adapter_s_record(tmp_path):
    hf = mf.tiny_chat_model(tmp_path / "hf")
    _adapter(hf, tmp_path / "ad", quant="nf4")
    meta = tmp_path / "ad" / "adapter_model.safetensors"
    save_file(load_file(str(meta)), str(meta), metadata={"format": "pt"})  # as PEFT writes it
    with pytest.raises(ModelError, match="does not record the quantization"):
        merge(hf, tmp_path / "ad", tmp_path / "m.gguf", base="quantized")
    with pytest.raises(ModelError, match="--base must be one of"):
        merge(hf, tmp_path / "ad", tmp_path / "m.gguf", base="nf4")


def test_a_write_that_fails_before_its_first_tensor_leaves_nothing(tmp_path):
    bad = [("general.tags", [], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)]
    with pytest.raises(ValueError, match="Empty array"):
        with GGUFStream(tmp_path / "x.gguf", "llama", bad, []):
            pass
    assert os.listdir(tmp_path) == []
    hf = mf.tiny_chat_model(tmp_path / "hf")  # a BPE without merges: llama.cpp cannot load it
    _adapter(hf, tmp_path / "ad")
    with pytest.raises(ModelError, match="no merges"):
        merge(hf, tmp_path / "ad", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_sigterm_mid_merge_leaves_no_file(tmp_path):
    """`kill` (SIGTERM) ends a merge as Ctrl-C does: the temp file goes too."""
    base, _ = mf.write_gguf(tmp_path / "base.gguf", "llama")
    _adapter(base, tmp_path / "ad")
    code = ("import sys, time; from packlora.gguf_out.stream import GGUFStream; "
            "real = GGUFStream.write; "
            "GGUFStream.write = lambda s, n, d: (print('writing', flush=True), time.sleep(60)); "
            "from packlora.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "merge", "--model", str(base),
                             "--adapter", str(tmp_path / "ad"), "--out",
                             str(tmp_path / "m.gguf")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"  # inside the write, temp file open
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    assert sorted(os.listdir(tmp_path)) == ["ad", "base.gguf"]
