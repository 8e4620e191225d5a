"""A base model without a chat template trained with data.chat_template: the template travels
with the adapter, so generate / eval (--adapter), a folder merge and a GGUF merge render prompts
as the training run did; read back with gguf's own reader and as plain JSON."""
import json

import model_factory as mf
import pytest
from gguf import GGUFReader
from packlora import generate_batch, load_adapter, load_model, load_tokenizer, merge
from packlora.adapters.peft_io import TEMPLATE
from packlora.data.dataset import use_chat_template
from packlora.errors import DataError, ModelError
from packlora.evaluate import exact_match, read_eval_records
from packlora.training.run import finetune

TEMPLATE_TEXT = ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:{% endif %}")
CHAT = [{"role": "user", "content": "1+2"}]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run on a tiny model whose tokenizer has no chat template."""
    tmp = tmp_path_factory.mktemp("template")
    files = mf.sums_run_files(tmp, 2, 2)
    mf.tiny_chat_model(files / "model", merges=[("1", "+")])  # merges: a GGUF vocabulary needs some
    cfg_path = files / "model" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    (tmp / "t.jinja").write_text(TEMPLATE_TEXT)
    finetune({"model": str(files / "model"), "quant": {"format": "q8_0"},
              "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj", "v_proj"]},
              "data": {"train": str(files / "train.jsonl"), "max_seq_len": 64,
                       "chat_template": str(tmp / "t.jinja")},
              "train": {"max_steps": 2, "batch_size": 2, "lr": 1e-3, "save_every": 2},
              "output_dir": str(tmp / "run")}, progress=False)
    return files / "model", tmp / "run"


def test_the_adapter_and_its_checkpoints_carry_the_template(run):
    _, out = run
    assert (out / TEMPLATE).read_text() == TEMPLATE_TEXT
    step = out / "checkpoints" / "step-2"
    assert (step / TEMPLATE).read_text() == TEMPLATE_TEXT
    assert TEMPLATE in json.loads((step / "manifest.json").read_text())["files"]


def test_loading_the_adapter_renders_prompts_as_training_did(run):
    base, out = run
    model = load_model(base, quant="q8_0")
    assert "<|im_start|>" in model.tokenizer.apply_chat_template(CHAT)  # ChatML fallback
    load_adapter(model, out)
    assert model.tokenizer.apply_chat_template(CHAT) == "### user: 1+2\n### assistant:"


def test_an_adapter_saved_with_its_tokenizer_brings_its_template(run, tmp_path):
    """transformers' Trainer (TRL, Axolotl) saves tokenizer_config.json beside the adapter, its
    chat_template a string or a list of named templates."""
    base, out = run
    for i, value in enumerate([TEMPLATE_TEXT, [{"name": "default", "template": TEMPLATE_TEXT},
                                               {"name": "tool_use", "template": "x"}]]):
        peft = tmp_path / f"peft{i}"
        peft.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (peft / name).write_bytes((out / name).read_bytes())
        (peft / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        model = load_adapter(load_model(base, quant="q8_0"), peft)
        assert model.tokenizer.apply_chat_template(CHAT) == "### user: 1+2\n### assistant:"


def test_merges_carry_the_template(run, tmp_path):
    base, out = run
    merge(base, out, tmp_path / "folder")
    cfg = json.loads((tmp_path / "folder" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TEMPLATE_TEXT
    merge(base, out, tmp_path / "m.gguf", quantize="f16")
    field = GGUFReader(tmp_path / "m.gguf").fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == TEMPLATE_TEXT


def test_a_run_started_from_the_adapter_trains_in_its_template(run, tmp_path):
    """lora.start_from with no data.chat_template: the rows are rendered as the adapter was
    trained (this base has no template of its own, so they could not be rendered at all)."""
    base, out = run
    finetune({"model": str(base), "quant": {"format": "q8_0"},
              "lora": {"rank": 2, "alpha": 4, "targets": ["q_proj", "v_proj"],
                       "start_from": str(out)},
              "data": {"train": str(base.parent / "train.jsonl"), "max_seq_len": 64},
              "train": {"max_steps": 1, "batch_size": 2, "lr": 1e-3},
              "output_dir": str(tmp_path / "again")}, progress=False)
    assert (tmp_path / "again" / TEMPLATE).read_text() == TEMPLATE_TEXT


def test_data_chat_template_long_inline_or_a_bad_file(run, tmp_path):
    """An inline template with a line past 255 characters was taken for a path and failed with
    "File name too long"; a folder was used as the template text itself; a file that is not
    UTF-8 was an internal error; a file's Jinja error named the base's tokenizer.json."""
    tok = load_tokenizer(run[0])
    long_line = TEMPLATE_TEXT.replace("\n", "") + "{# " + "x" * 300 + " #}"
    use_chat_template(tok, long_line)
    assert tok.apply_chat_template(CHAT) == "### user: 1+2### assistant:"
    with pytest.raises(DataError, match=f"^data.chat_template: {tmp_path}: a folder"):
        use_chat_template(tok, str(tmp_path))
    (tmp_path / "latin1.jinja").write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jinja: not UTF-8 text"):
        use_chat_template(tok, str(tmp_path / "latin1.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    use_chat_template(tok, str(tmp_path / "broken.jinja"))
    with pytest.raises(ModelError, match=r"^data.chat_template \(.*broken\.jinja\): the chat "
                                         r"template is not valid Jinja \(line 1\)"):
        tok.apply_chat_template(CHAT)
    with pytest.raises(DataError, match="data.chat_template: chat-ml: cannot read it"):
        use_chat_template(tok, "chat-ml")  # no jinja tag: a path, and this one is missing


ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != loop.index0 is even %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
             "### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}### assistant:{% endif %}")


def test_a_record_the_template_refuses_is_named(run, tmp_path):
    """A template's raise_exception (roles that do not alternate, in many models' templates)
    named the template only, not the record or the prompt that set it off."""
    base, _ = run
    data = tmp_path / "d.jsonl"
    rows = [[("user", "1+2"), ("assistant", "3")], [("assistant", "1+2"), ("assistant", "3")]]
    data.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in row]})
                            + "\n" for row in rows))
    with pytest.raises(DataError, match=r"^.*d\.jsonl:2: data\.chat_template: chat template "
                                        "failed: Conversation roles must alternate"):
        finetune({"model": str(base), "lora": {"rank": 2, "targets": ["q_proj"]},
                  "data": {"train": str(data), "chat_template": ALTERNATE},
                  "output_dir": str(tmp_path / "out")}, progress=False)
    assert not (tmp_path / "out").exists()
    model = load_model(base, quant="q8_0")
    use_chat_template(model.tokenizer, ALTERNATE)
    with pytest.raises(DataError, match="^generation: prompt 1: data.chat_template: chat "
                                        "template failed: Conversation roles must alternate"):
        generate_batch(model, [CHAT, [{"role": "assistant", "content": "1+2"}]])
    # eval named the prompt's index among those it generated, not the record's line
    with pytest.raises(DataError, match=r"^generation: .*d\.jsonl:2: data\.chat_template: chat "
                                        "template failed: Conversation roles must alternate"):
        exact_match(model, read_eval_records(data))
