"""The memory plan: byte counts by hand on a tiny model, agreement with a measured step, the CLI."""
import json
import math

import numpy as np
import pytest
from gradcheck import traced
from packlora.adapters.loftq import loftq_fit
from packlora.memory import CATEGORIES
from packlora.memory import plan as mem_plan
from packlora.memory.planner import FUSED_MAX_M, FUSED_MAX_M_BWD, tile_plan

V, D, H, HKV, HD, F, L = 128, 64, 4, 2, 16, 96, 2
TINY = {"model_type": "llama", "vocab_size": V, "hidden_size": D, "intermediate_size": F,
        "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": HKV,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SHAPES = {"q": (H * HD, D), "k": (HKV * HD, D), "v": (HKV * HD, D), "o": (D, H * HD),
          "gate": (F, D), "up": (F, D), "down": (D, F)}
LLAMA2_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def hand_packed(fmt, n, k, bs, dq):
    """Bytes of one packed (n, k) weight, from the format descriptions in DESIGN.md."""
    numel = n * k
    if fmt == "none":
        return 4 * numel
    if fmt in ("q4_0", "q4_1", "q8_0"):
        return n * (k // 32) * {"q4_0": 18, "q4_1": 20, "q8_0": 34}[fmt]
    blocks = -(-numel // bs)
    if fmt == "int8":
        return numel + 4 * blocks
    codes = -(-numel // 2)
    if not dq:
        return codes + 4 * blocks
    return codes + blocks + 256 * 4 + 4 * -(-blocks // 256) + 4  # 8-bit absmax, code, scales


def _plan(overrides, **kw):
    return mem_plan(TINY, ["lora.targets=all-linear", "lora.rank=4"] + list(overrides), **kw)


FORMATS = [("nf4", 64, True), ("nf4", 64, False), ("nf4", 32, True), ("fp4", 128, True),
           ("fp4", 64, False), ("int8", 64, False), ("q4_0", 32, False), ("q4_1", 32, False),
           ("q8_0", 32, False), ("none", 64, False)]


@pytest.mark.parametrize("fmt,bs,dq", FORMATS)
def test_base_bytes_by_hand(fmt, bs, dq):
    ov = [f"quant.format={fmt}", f"quant.double_quant={str(dq).lower()}"]
    if fmt not in ("q4_0", "q4_1", "q8_0"):
        ov.append(f"quant.block_size={bs}")
    cats = _plan(ov)["plan"]["categories"]
    assert cats["base_packed"] == L * sum(hand_packed(fmt, n, k, bs, dq)
                                          for n, k in SHAPES.values())
    # embedding and untied head in Q8_0 under packed linears (quant.embeddings: auto), float32
    # without; plus 2L+1 norms
    emb = hand_packed("none" if fmt == "none" else "q8_0", V, D, 32, False)
    assert cats["base_other"] == 2 * emb + (2 * L + 1) * D * 4


@pytest.mark.parametrize("fmt,embeddings,want", [("nf4", "float", "none"), ("nf4", "q4_0", "q4_0"),
                                                 ("nf4", "auto", "q8_0"),
                                                 ("none", "auto", "none")])
def test_embedding_format_is_its_own_choice(fmt, embeddings, want):
    rep = _plan([f"quant.format={fmt}", f"quant.embeddings={embeddings}"])
    emb = 2 * hand_packed(want, V, D, 32, False)
    assert rep["plan"]["categories"]["base_other"] == emb + (2 * L + 1) * D * 4
    # the report says which format the embedding and head take (None: float32)
    assert rep["run"]["quant"]["embeddings"] == (None if want == "none" else want)
    held = rep["run"]["held"]
    assert held["embeddings"] == {"float32" if want == "none" else want: 2}
    assert held["linears"] == {"float32" if fmt == "none" else fmt: len(SHAPES) * L}


def test_report_names_the_formats_a_gguf_is_held_in():
    """A GGUF's linears stay in their stored type whatever quant.format says (it applies to
    float weights): the report counts the types the file stores (read by gguf's reader)."""
    from collections import Counter

    from gguf import GGUFReader
    from model_factory import smollm_path
    from packlora.memory.report import print_report, report_dict
    from rich.console import Console
    stored = Counter(t.tensor_type.name.lower() for t in GGUFReader(smollm_path()).tensors
                     if t.name.startswith("blk.") and t.name.endswith(".weight")
                     and "norm" not in t.name)
    rep = report_dict("smollm2-135m-instruct", ["quant.format=nf4"])
    assert rep["run"]["held"]["linears"] == dict(stored) and "nf4" not in stored
    console = Console(width=400, record=True)
    print_report(rep, console)
    (fmt,) = stored
    assert f"linears in {fmt}, embedding and head in" in console.export_text()


def test_adapter_grads_optimizer_logits_kv_by_hand():
    rep = _plan(["data.max_seq_len=32", "train.batch_size=3", "train.loss_chunk=40"])
    cats, m = rep["plan"]["categories"], 3 * 32
    adapters = L * 4 * sum(n + k for n, k in SHAPES.values()) * 4
    assert cats["adapters"] == adapters
    assert cats["grads"] == adapters
    assert cats["optimizer"] == 2 * adapters
    assert cats["logits"] == 40 * V * 4
    assert cats["kv_cache"] == 0 and cats["workspace"] == 0
    assert rep["plan"]["generation"]["kv_cache"] == 2 * L * 3 * 32 * HKV * HD * 4
    assert rep["plan"]["activations_detail"]["logits_full"] == m * V * 4


def test_step_in_backward_plans_one_blocks_grads():
    """train.step_in_backward frees each adapter gradient as it is applied: the grads category
    is one block's adapters, and the optimizer step holds none."""
    ov = ["data.max_seq_len=32", "train.batch_size=3", "train.step_in_backward=true",
          "train.max_grad_norm=null"]
    plan = _plan(ov)["plan"]
    adapters = L * 4 * sum(n + k for n, k in SHAPES.values()) * 4
    assert plan["categories"]["adapters"] == adapters
    assert plan["categories"]["grads"] == adapters // L
    assert _plan(ov[:2])["plan"]["categories"]["grads"] == adapters


def hand_block(b, t, r, input_tracked, remade=True):
    """Activation bytes one decoder block keeps for backward (all-linear LoRA, no dropout).
    The tape keeps only what ops save, never an intermediate just because it was an input.
    remade: the down projection's LoRA remakes silu(gate)*up (not in a checkpoint's
    recompute, which keeps it)."""
    m = b * t
    floats = ((3 + input_tracked) * m * D  # block input (norm1, if recorded), norm1 out, h1,
                                           # norm2 out
              + 3 * m * H * HD          # grouped q, attention out, its (B, T, H*D) copy
              + 2 * m * HKV * HD        # contiguous k and v
              + (2 if remade else 3) * m * F  # gate, up (and silu(gate)*up unless remade)
              + 7 * m * r               # x @ A.T per adapter
              + m * (2 if input_tracked else 1)  # rms factors (norm1 unrecorded in block 0)
              + b * H * t)              # attention log-sum-exp
    return 4 * floats  # the causal mask is built per block of scores: nothing T x T is kept


@pytest.mark.parametrize("b,t", [(1, 16), (2, 24)])
def test_activations_by_hand(b, t):
    ov = [f"train.batch_size={b}", f"data.max_seq_len={t}"]
    m, md = b * t, b * t * D * 4
    # final norm input and factors, its output (live during the loss), the loss's dh, targets
    tail = 3 * md + 4 * m + 8 * m
    off = _plan(ov)["plan"]
    want = hand_block(b, t, 4, False) + hand_block(b, t, 4, True) + tail
    assert off["categories"]["activations"] == want
    assert off["peak_at"].startswith("forward end")
    on = _plan(ov + ["train.grad_checkpointing=true"])["plan"]
    fwd = L * md + tail  # each checkpoint keeps its block's input
    last = L * md + hand_block(b, t, 4, True, False) + 8 * m  # inputs kept + block recomputed
    first = 2 * md + hand_block(b, t, 4, False, False) + 8 * m  # + block 1's input, referenced
    assert on["categories"]["activations"] == max(fwd, last, first)
    adapters = on["categories"]["adapters"]
    assert on["categories"]["grads"] == adapters + md  # the incoming block-input gradient
    assert on["checkpointing"]["off"]["peak_bytes"] == off["peak_bytes"]


def test_scratch_tiles_follow_kernels():
    """The plan uses the kernels' own tile choice; tiles stay within the cap, take whole rows of
    W in the forward while `a` is cache-sized, else keep the output's whole width when a
    reduction chunk of RC_MIN (or of BLAS's reduction block) fits, run whole BLAS blocks per
    chunk where the block is known, and respect the alignments."""
    from packlora.kernels.cpu import ops, tiled
    assert (FUSED_MAX_M, FUSED_MAX_M_BWD) == (ops.FUSED_MAX_M, ops.FUSED_MAX_M_BWD)
    assert tile_plan is tiled.plan
    cap = 1 << 20
    for block, m in [(None, None), (448, None), (320, None), (448, 64), (448, 4096)]:
        for P, R, ap, ar in [(1536, 576, 1, 32), (576, 1536, 32, 1), (49152, 576, 1, 32),
                             (4096, 4096, 1, 32), (11008, 4096, 1, 32), (4096, 11008, 32, 1)]:
            fwd_m = m if ap == 1 else None  # whole rows of W are the forward's option
            pc, rc = tile_plan(P, R, cap, ap, ar, block, fwd_m)
            assert pc * rc <= cap and pc % ap == 0 and (rc % ar == 0 or rc == R)
            whole_rows = (fwd_m is not None and 4 * fwd_m * R <= tiled.WHOLE_ROWS_A_MAX
                          and cap // R >= tiled.WHOLE_ROWS_MIN)
            if whole_rows and P * R > cap:
                assert rc == R and pc < P
            elif cap // P >= (block or tiled.RC_MIN):
                assert pc == P
            if block and rc < R:
                assert rc % block == 0
        assert tile_plan(64, 96, 100, 1, 32, block) == (1, 96)  # a tiny cap still splits the width
    assert tile_plan(4096, 4096, 2 << 20, 1, 32, 448) == (4096, 448)
    assert tile_plan(4096, 4096, 2 << 20, 1, 32, None) == (4096, 512)
    assert tile_plan(4096, 4096, 2 << 20, 1, 32, 448, m=512) == (512, 4096)
    assert tile_plan(4096, 4096, 2 << 20, 1, 32, 448, m=2048) == (4096, 448)
    assert tile_plan(4096, 11008, 2 << 20, 1, 32, 448, m=512) == (512, 4032)  # blocks of rows


def test_llama2_7b_qlora_plan(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    rep = mem_plan("configs/llama2-7b-qlora.yaml", model=str(tmp_path))
    cats = rep["plan"]["categories"]
    per_layer = (4 * hand_packed("nf4", 4096, 4096, 64, True)
                 + 3 * hand_packed("nf4", 11008, 4096, 64, True))
    assert cats["base_packed"] == 32 * per_layer
    assert cats["adapters"] == 32 * 64 * (4 * 8192 + 3 * 15104) * 4
    # cuda: above 16 rows a tile of W's rows, at most the GPU's default 64 MiB, goes to cuBLAS
    assert cats["dense_scratch"] == 64 << 20
    assert rep["run"]["grad_checkpointing"] and rep["run"]["batch_size"] == 1
    assert rep["plan"]["peak_bytes"] == sum(rep["plan"]["at_peak"].values())
    alts = rep["dense_alternatives"]
    assert set(alts) == {"whole_model_fp32", "whole_model_bf16", "per_layer_dequant",
                         "dense_effective_weight"}
    assert alts["whole_model_fp32"]["ratio_to_packlora"] > alts["whole_model_bf16"][
        "ratio_to_packlora"] > 1
    # the largest packed weight: the Q8_0 LM head (quant.embeddings: auto)
    assert alts["per_layer_dequant"]["extra_bytes"] == 32000 * 4096 * 4 - cats["dense_scratch"]
    # the same from a config.json path and from the dict; 70B plans as well
    same = mem_plan(str(tmp_path / "config.json"),
                    ["quant.double_quant=true", "lora.rank=64", "lora.targets=all-linear",
                     "train.batch_size=1", "data.max_seq_len=512"])
    assert same["plan"]["categories"]["base_packed"] == cats["base_packed"]
    big = dict(LLAMA2_7B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8)
    assert mem_plan(big)["plan"]["peak_bytes"] > 35e9


def test_gguf_header_keeps_stored_formats(tmp_path):
    from model_factory import HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, VOCAB, write_gguf
    from packlora.models.gguf_file import open_gguf
    from packlora.models.sources import open_source
    path, _ = write_gguf(tmp_path / "m.gguf", "llama", "Q4_1")
    cats = mem_plan(str(path))["plan"]["categories"]
    d, hd = HIDDEN, HIDDEN // HEADS
    shapes = [(HEADS * hd, d), (KV_HEADS * hd, d), (KV_HEADS * hd, d), (d, HEADS * hd),
              (INTER, d), (INTER, d), (d, INTER)]
    assert cats["base_packed"] == LAYERS * sum(hand_packed("q4_1", n, k, 32, False)
                                               for n, k in shapes)
    f = open_gguf(path)
    stored = sum(f.tensor(n)[2].nbytes for n in ("token_embd.weight", "output.weight"))
    assert cats["base_other"] == stored + (2 * LAYERS + 1) * d * 4
    assert stored == 2 * hand_packed("q4_1", VOCAB, d, 32, False)
    # a GPU plan prices the fused kernels' partial sums by the stored blocks (it raised TypeError:
    # the GGUF's specs named no block size)
    held = open_source(path).stored_tensors()
    assert {spec.block_size for spec in held.values() if spec.packed} == {32}
    gpu = mem_plan(str(path), ["device=cuda"])["plan"]["categories"]
    assert gpu["base_packed"] == cats["base_packed"] and gpu["dense_scratch"] > 0


# -- measured ---------------------------------------------------------------------------------
MEAS = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A small random Llama HF folder (no tokenizer) and a run config dict for it."""
    from safetensors.numpy import save_file
    folder = tmp_path_factory.mktemp("memmodel")
    cfg = dict(TINY, **MEAS)
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], 32
    shapes = {"self_attn.q_proj": (4 * hd, d), "self_attn.k_proj": (2 * hd, d),
              "self_attn.v_proj": (2 * hd, d), "self_attn.o_proj": (d, 4 * hd),
              "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    w = {"model.embed_tokens.weight": (256, d), "lm_head.weight": (256, d)}
    for i in range(cfg["num_hidden_layers"]):
        w.update({f"model.layers.{i}.{k}.weight": s for k, s in shapes.items()})
    arrays = {n: (rng.standard_normal(s) / math.sqrt(s[1])).astype(np.float32)
              for n, s in w.items()}
    arrays["model.norm.weight"] = np.ones(d, np.float32)
    for i in range(cfg["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            arrays[f"model.layers.{i}.{n}.weight"] = np.ones(d, np.float32)
    save_file(arrays, str(folder / "model.safetensors"))
    return {"model": str(folder), "device": "cpu",
            "quant": {"format": "nf4", "block_size": 64, "double_quant": True},
            "lora": {"rank": 8, "alpha": 16, "targets": "all-linear"},
            "data": {"train": "unused.jsonl", "max_seq_len": 64},
            "train": {"batch_size": 4, "max_steps": 2, "lr": 1e-3}}


@pytest.mark.parametrize("ckpt", [False, True])
def test_plan_matches_measured_step(tiny_run, ckpt):
    from packlora.memory import measure
    # loss_chunk=32: small logits chunks, so the check below is about everything else
    rep = measure(tiny_run, 1, [f"train.grad_checkpointing={str(ckpt).lower()}",
                                "train.loss_chunk=32"])
    plan, meas = rep["plan"], rep["measured"]
    assert abs(meas["plan_error_pct"]) <= 10.0, (plan["categories"], meas["categories"])
    for c in ("base_packed", "base_other", "adapters", "optimizer", "logits", "dense_scratch"):
        assert plan["categories"][c] == meas["categories"][c], c
    for c in ("activations", "grads"):
        assert abs(meas["category_error_pct"][c]) <= 10.0, (c, meas["category_error_pct"])
    # the step's own memory (window) seen by the tracker and by tracemalloc agree; with
    # checkpointing the untracked backward temporaries of one block (attention scores, SwiGLU
    # and LoRA input gradients) are a larger share of this small model's step
    win, proc = meas["window_peak_bytes"], meas["process_window_peak_bytes"]
    assert 0 < proc - win <= (0.20 if ckpt else 0.10) * proc, (win, proc)
    assert meas["metrics_jsonl_mem_peak"]["activations"] > 0
    # the process's peaks before the measured steps (VmHWM resets there): loading, then loading
    # and the warm-up step
    assert meas["rss_before_load_bytes"] <= meas["rss_load_peak_bytes"] \
        <= meas["rss_warmup_peak_bytes"]


def test_cli_json_and_plot(tiny_run, tmp_path, capsys):
    import yaml
    from packlora.cli import main
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run))
    png = tmp_path / "mem.png"
    assert main(["memory-report", str(cfg), "train.batch_size=2", "--json",
                 "--plot", str(png)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep["plan"]["categories"]) == set(CATEGORIES)
    assert isinstance(rep["plan"]["peak_bytes"], int) and rep["plan"]["peak_at"]
    for alt in rep["dense_alternatives"].values():
        assert alt["peak_bytes"] > 0 and alt["ratio_to_packlora"] > 0
    assert png.stat().st_size > 1000
    assert main(["memory-report", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "price of dense expansion" in out and "RAM this run needs" in out
    assert "-0.0" not in out  # a few KiB less than packlora shows as 0.0
    svg = tmp_path / "mem.svg"
    assert main(["memory-report", str(cfg), "--plot", str(svg)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {svg}\n")
    assert svg.read_text().lstrip().startswith("<?xml") and not (tmp_path / "mem.svg.png").exists()
    for bad, words in ((tmp_path / "mem.txt", "give a file ending in .png, .svg, .pdf"),
                       (tmp_path, "a folder, not a file")):
        assert main(["memory-report", str(cfg), "--plot", str(bad)]) == 2
        cap = capsys.readouterr()
        assert cap.err == f"packlora: error: --plot {bad}: {words}\n" and not cap.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.png", "mem.svg", "run.yaml"]


def test_report_mib_rounds_to_a_plain_zero():
    from packlora.memory.report import mib
    assert (mib(-20_000), mib(0), mib(-(2**20)), mib(3 * 2**30), mib(None)) == \
        ("0.0", "0.0", "-1.0", "3,072.0", "—")


def test_process_overhead_measured_once_and_added(tmp_path, monkeypatch):
    """The report adds what the process holds itself — measured by a tiny training step in a
    fresh interpreter, once per machine (cached) — to the plan: the RAM the run needs."""
    from packlora.memory import process
    from packlora.memory.report import report_dict
    monkeypatch.setenv("PACKLORA_CACHE", str(tmp_path))
    rep = report_dict(TINY, ["lora.targets=all-linear", "lora.rank=4"])
    extra = rep["process"]["bytes"]
    assert 100 << 20 < extra < 2 << 30  # an interpreter with numpy, Numba and its kernels
    assert rep["process"]["rss_estimate_bytes"] == rep["plan"]["peak_bytes"] + extra
    assert len(list(tmp_path.glob("process-*.json"))) == 1
    # the merge plan's compiled code: what loading the K-quant searches adds to a fresh process
    merge = rep["plan"]["merge"]
    assert 1 << 20 < merge["compiled_code"] < 1 << 30
    assert merge["peak_bytes"] == sum(v for k, v in merge.items() if k != "peak_bytes")
    assert len(list(tmp_path.glob("kernels-*.json"))) == 1
    monkeypatch.setattr(process.subprocess, "run", None)  # a second report reads the caches
    again = report_dict(TINY, [])
    assert again["process"]["bytes"] == extra
    assert again["plan"]["merge"]["compiled_code"] == merge["compiled_code"]
    # changed kernel sources (a new commit under the same version string) measure anew
    probes = []
    monkeypatch.setattr(process, "_probe", lambda probe: probes.append(probe) or 7 << 20)
    monkeypatch.setattr(process, "kernel_sources_hash", lambda: "changed")
    assert report_dict(TINY, [])["process"]["bytes"] == 7 << 20
    assert sorted(probes) == ["quantizer"] * 2 + ["training"] * 2
    assert len(list(tmp_path.glob("process-*.json"))) == 2
    # the planner alone (a training run's memory check) measures neither
    monkeypatch.setenv("PACKLORA_CACHE", str(tmp_path / "fresh"))
    assert "compiled_code" not in mem_plan(TINY, [])["plan"]["merge"]
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("iters", [1, 2])
def test_loftq_init_plans_its_svd_workspace(iters):
    """The plan's LoftQ phase: the largest layer's SVD workspace, against what loftq_fit holds
    under tracemalloc for that layer (LAPACK's own work is outside tracemalloc: the plan is
    above it, by at most that)."""
    rep = _plan(["lora.init=loftq", f"lora.loftq_iter={iters}"])["plan"]
    assert "loftq_init" not in _plan([])["plan"]
    ws = rep["loftq_init"]["svd_workspace"]
    n, k = SHAPES["gate"]
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    loftq_fit(w.copy(), {"format": "nf4", "block_size": 64, "double_quant": True}, 4, 2.0,
              iters)  # a first call compiles or loads kernels: not the fit's memory
    with traced() as peak:
        loftq_fit(w.copy(), {"format": "nf4", "block_size": 64, "double_quant": True}, 4, 2.0,
                  iters)
    peak = peak[0]
    m = min(n, k)
    assert peak <= ws <= peak + 4 * n * k + 8 * 4 * m * m  # + the source float, + gesdd's work
    st = rep["categories"]
    assert rep["loftq_init"]["peak_bytes"] == (st["base_packed"] + st["base_other"]
                                               + st["adapters"] + ws)
