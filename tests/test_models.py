"""Model correctness: tiny random Llama/Mistral/Qwen2/Qwen3 models from HF folders and GGUF files
against an independent float64 numpy forward; loss, checkpointing, KV cache and bad files."""
import json
import math

import model_factory as mf
import numpy as np
import pytest
from packlora import Device, LoraConfig, apply_lora, kernels
from packlora.errors import ModelError
from packlora.generate import generate_ids
from packlora.models import KVCache, ModelConfig, load_model
from packlora.nn import Linear, PackedLinear
from packlora.tensor import Tensor

ARCHS = list(mf.ARCHS)
GGUF_ARCHS = ["llama", "llama_tied", "llama3", "mistral", "qwen2", "qwen3"]
B, T = 2, 11


# --- the reference forward (float64, written from the model definitions) ---------------------
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def inv_freq_of(cfg):
    theta, dim = cfg.get("rope_theta", 10000.0), mf.HEAD_DIM
    if cfg.get("rope_scaling"):
        return mf.llama3_inv_freq(theta, dim, cfg["rope_scaling"])
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _attention(h, w, p, cfg, inv_freq):
    b, t, _ = h.shape
    nh, nkv, hd, eps = mf.HEADS, mf.KV_HEADS, mf.HEAD_DIM, cfg["rms_norm_eps"]

    def proj(name, n):
        y = h @ w[f"{p}.self_attn.{name}.weight"].T
        bias = w.get(f"{p}.self_attn.{name}.bias")
        return (y if bias is None else y + bias).reshape(b, t, n, hd)

    q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
    if cfg["model_type"] == "qwen3":
        q = _rms(q, w[f"{p}.self_attn.q_norm.weight"], eps)
        k = _rms(k, w[f"{p}.self_attn.k_norm.weight"], eps)
    ang = np.arange(t)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None, :]  # (1, T, 1, D)
    sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None, :]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    group = np.arange(nh) // (nh // nkv)
    k, v = k[:, :, group], v[:, :, group]  # (B, T, H, D)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", prob, v).reshape(b, t, nh * hd)
    return out @ w[f"{p}.self_attn.o_proj.weight"].T


def reference_logits(w, cfg, ids):
    """Logits (B, T, V) in float64 from HF-named float weights."""
    w = {n: np.asarray(a, np.float64) for n, a in w.items()}
    eps, inv_freq = cfg["rms_norm_eps"], inv_freq_of(cfg)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(mf.LAYERS):
        p = f"model.layers.{i}"
        x = x + _attention(_rms(x, w[f"{p}.input_layernorm.weight"], eps), w, p, cfg, inv_freq)
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        g, u = h @ w[f"{p}.mlp.gate_proj.weight"].T, h @ w[f"{p}.mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[f"{p}.mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def reference_loss(logits, labels):
    z = logits[:, :-1].reshape(-1, logits.shape[-1])
    y = labels[:, 1:].reshape(-1)
    ok = y != -100
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    return float(((lse - z[np.arange(len(y)), np.where(ok, y, 0)]) * ok).sum() / ok.sum())


# --- cases -----------------------------------------------------------------------------------
def loaded_weights(model):
    """HF name -> float32 array of every weight the loaded model holds (packed ones decoded)."""
    out = {}
    for name, mod in model.named_modules():
        for attr in ("weight", "bias"):
            val = getattr(mod, attr, None)
            if val is None or not name:
                continue
            out[f"{name}.{attr}"] = val.numpy() if isinstance(val, Tensor) else val.dequantize()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Lazily written model files, one per (arch, kind)."""
    root, made = tmp_path_factory.mktemp("models"), {}

    def get(arch, kind):
        if (arch, kind) not in made:
            name = root / f"{arch}_{kind}"
            if kind.startswith("gguf_"):
                made[arch, kind] = mf.write_gguf(f"{name}.gguf", arch, kind[5:].upper())
            else:
                dtype = "BF16" if kind == "bf16" else "F32"
                shards = 3 if kind == "sharded" else 1
                made[arch, kind] = mf.write_hf(name, arch, dtype=dtype, shards=shards)
        return made[arch, kind]
    return get


QUANTS = {"none": "none", "nf4_dq": {"format": "nf4", "double_quant": True},
          "nf4": {"format": "nf4", "double_quant": False}, "int8": "int8"}
HF_CASES = ([(a, "f32", q) for a in ARCHS for q in QUANTS]
            + [("llama", "bf16", "none"), ("qwen3", "bf16", "nf4_dq"), ("qwen2", "sharded", "none"),
               ("llama3", "sharded", "int8")])
GGUF_CASES = ([(a, f"gguf_{q}", "none") for a in GGUF_ARCHS for q in ("q8_0", "q4_0", "q4_1")]
              + [("llama", "gguf_f16", "none"), ("qwen2", "gguf_bf16", "none")])


def _ids(seed=1, b=B, t=T):
    return np.random.default_rng(seed).integers(0, mf.VOCAB, size=(b, t))


def expected_weights(model, arch, kind, qname, stored):
    """The float weights the model must hold, derived without packlora where possible."""
    got = loaded_weights(model)
    if kind.startswith("gguf_"):
        want = mf.gguf_reference_weights(stored, arch)
        assert set(got) == set(want)
        for n in want:
            np.testing.assert_allclose(got[n], want[n], rtol=0, atol=1e-6, err_msg=n)
        return want
    assert set(got) == set(stored)
    if qname == "none":
        for n in stored:
            assert np.array_equal(got[n], stored[n]), n
        return stored
    bound = 0.02 if qname == "int8" else 0.15  # relative RMS error of the quantized weight
    for n, a in stored.items():
        module = model.get_module(n.rsplit(".", 1)[0])  # the Q8_0 embedding is packed too
        packed = isinstance(module, PackedLinear) or getattr(module, "packed", False)
        if packed and n.endswith("weight"):
            err = np.sqrt(((got[n] - a) ** 2).mean() / (a ** 2).mean())
            assert 0 < err < bound, (n, err)
        else:
            assert np.array_equal(got[n], a), n
    return got


def _check_packing(model, arch, kind, qname):
    """Which linears are packed, and in which format."""
    lin = model.model.layers[1].mlp.down_proj
    if kind.startswith("gguf_"):
        assert isinstance(lin, PackedLinear) and lin.weight.format == kind[5:]
        assert model.model.embed_tokens.packed
    elif qname == "none":
        assert isinstance(lin, Linear)
    else:
        fmt = QUANTS[qname] if isinstance(QUANTS[qname], str) else QUANTS[qname]["format"]
        assert isinstance(lin, PackedLinear) and lin.weight.format == fmt
        assert lin.weight.double_quant == (qname == "nf4_dq")
        assert model.model.embed_tokens.weight.format == "q8_0"  # quant.embeddings: auto


@pytest.mark.parametrize("arch,kind,qname", HF_CASES + GGUF_CASES)
def test_logits_and_loss_match_reference(files, arch, kind, qname):
    path, stored = files(arch, kind)
    model = load_model(path, quant=QUANTS[qname])
    assert model.tokenizer is None  # no tokenizer in the files: loading still works
    _check_packing(model, arch, kind, qname)
    cfg = mf.hf_config(arch)
    assert model.config.tie_word_embeddings == cfg["tie_word_embeddings"]
    assert model.config.attention_bias == (cfg["model_type"] == "qwen2")
    np.testing.assert_allclose(model._inv_freq, inv_freq_of(cfg), rtol=1e-6)
    want = expected_weights(model, arch, kind, qname, stored)
    ids = _ids()
    ref = reference_logits(want, cfg, ids)
    got = model(ids)
    assert isinstance(got, Tensor) and got.shape == (B, T, mf.VOCAB) and got.dtype == np.float32
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    labels = ids.copy()
    labels[0, :4] = -100
    labels[1, -3:] = -100
    loss = model.loss(ids, labels).item()
    assert loss == pytest.approx(reference_loss(ref, labels), rel=1e-5)


@pytest.mark.parametrize("kind", ["gguf_f16", "gguf_bf16"])
def test_16bit_gguf_kept_16bit_or_quantized_as_asked(files, kind):
    """F16 / BF16 linear weights stay 16-bit at rest under quant "none" (the test above checks
    their logits) and take the run's format otherwise; the embedding stays 16-bit under
    quant.embeddings "float" and becomes q8_0 under "auto" (the default); norms are float32."""
    path, _ = files("llama", kind)
    model = load_model(path, quant={"format": "nf4", "embeddings": "float"})
    assert model.model.layers[0].self_attn.q_proj.weight.format == "nf4"
    emb = model.model.embed_tokens.weight
    assert emb.format == kind[5:] and emb.nbytes == 2 * emb.numel
    auto = load_model(path, quant="nf4")
    assert auto.model.embed_tokens.weight.format == "q8_0"
    assert isinstance(model.model.norm.weight, Tensor)
    none = load_model(path, quant="none")
    w = none.model.layers[0].mlp.down_proj.weight
    assert w.format == kind[5:] and w.nbytes == 2 * w.numel


def test_quantized_differs_from_float(files):
    """The tolerance above is tight enough to see quantization: nf4 logits are not float ones."""
    path, stored = files("llama", "f32")
    ref = reference_logits(stored, mf.hf_config("llama"), _ids())
    got = load_model(path, quant="nf4")(_ids()).numpy()
    assert np.abs(got - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("arch,kind,qname", [("qwen3", "f32", "nf4_dq"),
                                             ("llama_tied", "gguf_q4_1", "none")])
def test_gradient_checkpointing_same_loss_and_grads(files, arch, kind, qname):
    path, _ = files(arch, kind)
    model = load_model(path, device=Device.cpu().autodiff(), quant=QUANTS[qname])
    params = [model.model.layers[0].post_attention_layernorm.weight,
              model.model.layers[1].input_layernorm.weight]
    for p in params:
        p.require_grad()
    ids = _ids(3)
    labels = ids.copy()
    labels[:, :3] = -100
    results = []
    for flag in (False, True):
        model.grad_checkpointing = flag
        for p in params:
            p.grad = None
        loss = model.loss(ids, labels)
        loss.backward()
        results.append((loss.item(), [p.grad.numpy().copy() for p in params]))
    (l0, g0), (l1, g1) = results
    assert l0 == l1
    for a, b in zip(g0, g1):
        assert np.abs(a).max() > 1e-4
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoint_recompute_skips_the_down_projection(files, monkeypatch):
    """Backward under checkpointing re-runs each layer for its tape only: every packed product
    is computed again except the MLP's down projection, whose output nothing reads there."""
    path, _ = files("llama", "f32")
    model = load_model(path, device=Device.cpu().autodiff(), quant=QUANTS["nf4"])
    apply_lora(model, LoraConfig(rank=2, alpha=4, targets=["q_proj", "down_proj"]))
    model.grad_checkpointing = True
    calls = []
    real = kernels.linear_fwd
    monkeypatch.setattr(kernels, "linear_fwd",
                        lambda x, w, **kw: calls.append(id(w)) or real(x, w, **kw))
    ids = _ids(4)
    loss = model.loss(ids, ids)
    forward, calls[:] = list(calls), []
    loss.backward()
    layers = model.model.layers
    downs = {id(layer.mlp.down_proj.weight) for layer in layers}
    ups = {id(layer.mlp.up_proj.weight) for layer in layers}
    assert sum(w in downs for w in forward) == len(layers)
    assert sum(w in ups for w in forward) == sum(w in ups for w in calls) == len(layers)
    assert not any(w in downs for w in calls)
    assert all(layer.mlp.down_proj.lora_B.grad is not None for layer in layers)


@pytest.mark.parametrize("arch,kind,qname,adapter", [("qwen2", "f32", "none", None),
                                                     ("llama3", "gguf_q8_0", "none", None),
                                                     ("qwen3", "f32", "int8", None),
                                                     ("llama3", "gguf_q8_0", "none", "lora"),
                                                     ("qwen3", "f32", "int8", "dora")])
def test_kv_cache_decoding_matches_full_forward(files, arch, kind, qname, adapter):
    """One-token steps (plain arrays, autodiff.plain_arrays) against the recorded forward."""
    path, _ = files(arch, kind)
    model = load_model(path, quant=QUANTS[qname])
    if adapter:
        apply_lora(model, {"targets": "all-linear", "rank": 2, "use_dora": adapter == "dora"})
        rng = np.random.default_rng(4)  # A too: its initialisation depends on the tests before
        for name, p in model.trainable():
            if name.endswith(("lora_A", "lora_B")):
                p.data[...] = 0.1 * rng.standard_normal(p.shape)
    ids = _ids(5, b=2, t=10)
    full = model(ids).numpy()  # (B, T, V)
    cache = KVCache(model.config, model.device, 2, 10)
    steps = [model.next_logits(ids[:, :4], cache).numpy()]
    for t in range(4, 10):
        steps.append(model.next_logits(ids[:, t:t + 1], cache).numpy())
    assert cache.length == 10
    np.testing.assert_allclose(np.stack(steps, 1), full[:, 3:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="KV cache full"):
        model.next_logits(ids[:, :1], cache)
    cache = KVCache(model.config, model.device, 2, 10)
    with kernels.int8_activations():  # generation's 8-bit x: close, not equal
        steps = [model.next_logits(ids[:, :4], cache).numpy()]
        steps += [model.next_logits(ids[:, t:t + 1], cache).numpy() for t in range(4, 10)]
    assert np.abs(np.stack(steps, 1) - full[:, 3:]).max() <= 0.06 * np.abs(full).max()  # <2.6%
    prompt = [int(i) for i in ids[0, :5]]
    out = generate_ids(model, prompt, max_new_tokens=6, int8_activations=False)
    seq = list(prompt)
    for _ in range(6):  # greedy by full forwards, no cache
        seq.append(int(np.argmax(model(np.asarray([seq])).numpy()[0, -1])))
    assert out == seq[5:]


def test_generation_stops_at_non_finite_logits(files):
    path, _ = files("llama3", "gguf_q8_0")
    model = load_model(path, quant=QUANTS["none"])
    apply_lora(model, {"targets": ["q_proj"], "rank": 2})
    next(p for name, p in model.trainable() if name.endswith("lora_B")).data[...] = np.nan
    with pytest.raises(ModelError, match=r"prompt 0: the logits of new token 1 are not finite"):
        generate_ids(model, [1, 2, 3], max_new_tokens=3)


# --- bad inputs ------------------------------------------------------------------------------
def test_missing_folder_and_unsupported_type(tmp_path):
    with pytest.raises(ModelError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    folder, _ = mf.write_hf(tmp_path / "gpt2", "llama", config={**mf.hf_config("llama"),
                                                                 "model_type": "gpt2"})
    with pytest.raises(ModelError, match=r"'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(folder)


@pytest.mark.parametrize("field,message", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"sliding_window": 64, "max_position_embeddings": 256}, "sliding_window=64"),
])
def test_config_fields_packlora_does_not_implement_are_refused(field, message):
    """A field that changes the model is an error naming it (it used to be dropped)."""
    with pytest.raises(ModelError, match=f"config.json: {message}"):
        ModelConfig.from_hf({**mf.hf_config("mistral"), **field}, "config.json")
    # the harmless forms load: silu, no MLP bias, a window switched off or wider than the model
    for ok in ({"hidden_act": "silu"}, {"mlp_bias": False},
               {"sliding_window": 32768, "use_sliding_window": False},
               {"sliding_window": 256, "max_position_embeddings": 256}):
        ModelConfig.from_hf({**mf.hf_config("mistral"), **ok}, "config.json")


def test_truncated_safetensors_and_gguf(tmp_path):
    folder, _ = mf.write_hf(tmp_path / "hf", "llama")
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ModelError, match=r"model\.safetensors.*truncated"):
        load_model(folder)
    path, _ = mf.write_gguf(tmp_path / "cut.gguf", "llama", "Q4_0")
    path.write_bytes(path.read_bytes()[:-700])
    with pytest.raises(ModelError, match=r"cut\.gguf.*truncated"):
        load_model(path)


def test_shape_disagreeing_with_config_names_tensor(tmp_path):
    cfg = {**mf.hf_config("llama"), "intermediate_size": 128}
    folder, _ = mf.write_hf(tmp_path / "bad", "llama", config=cfg)
    with pytest.raises(ModelError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*\(96, 64\)"):
        load_model(folder)
    weights = mf.random_weights("llama")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    folder, _ = mf.write_hf(tmp_path / "missing", "llama", weights=weights)
    missing = r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing"
    with pytest.raises(ModelError, match=missing):
        load_model(folder)


def test_config_json_fields_roundtrip(files):
    path, _ = files("qwen3", "f32")
    cfg = load_model(path, quant="none").config
    back = json.loads(json.dumps(cfg.to_hf_dict()))
    assert (back["model_type"], back["head_dim"], back["num_key_value_heads"]) == ("qwen3", 16, 2)
