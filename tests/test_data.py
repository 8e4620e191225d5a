"""Tests for the data pipeline: formats, masks, truncation, errors, packing, batching, resume."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from packlora.config import DataConfig
from packlora.data import (
    IGNORE_INDEX,
    Batches,
    build_datasets,
    count_targets,
    count_tokens,
    load_dataset,
    pack_examples,
)
from packlora.errors import DataError, ModelError
from packlora.evaluate import read_eval_records

BOS, EOS, PAD, START, END = 1, 2, 0, 3, 4


class FakeTokenizer:
    """Character-level tokenizer with a ChatML-like template: ids are code points."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) if i >= 32 or i == 10 else f"<{i}>" for i in ids)

    def chat_token_masks(self, messages, untrained=()):
        ids, mask = [], []
        for i, m in enumerate(messages):
            head = [START] + self.encode(m["role"] + "\n")
            body = self.encode(m["content"]) + [END]
            tail = self.encode("\n")
            answer = m["role"] == "assistant" and i not in untrained
            ids += head + body + tail
            mask += [False] * len(head) + [answer] * len(body) + [False] * len(tail)
        return ids, mask


TOK = FakeTokenizer()


def write_jsonl(tmp_path, records, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def load(tmp_path, records, **cfg):
    path = write_jsonl(tmp_path, records)
    return load_dataset(path, TOK, DataConfig(train=str(path), **cfg))


def targets(example):
    return TOK.decode(example.labels[example.labels != IGNORE_INDEX])


def test_text_format_trains_on_everything(tmp_path):
    ds = load(tmp_path, [{"text": "hello"}])
    ex = ds[0]
    assert ds.format == "text" and ds.num_records == 1
    full = [ord(c) for c in "hello"] + [EOS]
    assert ex.input_ids.dtype == np.int32 and ex.labels.dtype == np.int64
    assert ex.input_ids.tolist() == full[:-1] and ex.labels.tolist() == full[1:]


def test_completion_masks_prompt(tmp_path):
    ex = load(tmp_path, [{"prompt": "Q:", "completion": "ok"}])[0]
    assert ex.input_ids.tolist() == [ord(c) for c in "Q:ok"]
    assert ex.labels.tolist() == [IGNORE_INDEX, ord("o"), ord("k"), EOS]
    ex = load(tmp_path, [{"prompt": "Q:", "completion": "ok"}], train_on_inputs=True)[0]
    assert ex.labels.tolist() == [ord(":"), ord("o"), ord("k"), EOS]


class BosTokenizer(FakeTokenizer):
    """Starts a sequence with BOS when asked to, as Llama 2 / Mistral / TinyLlama tokenizers
    (add_bos_token true) do."""

    def encode(self, text, add_special_tokens=False):
        return ([BOS] if add_special_tokens else []) + super().encode(text)


def test_text_and_completion_start_with_bos_when_the_tokenizer_adds_it(tmp_path):
    path = write_jsonl(tmp_path, [{"text": "hi"}])
    ex = load_dataset(path, BosTokenizer(), DataConfig(train=str(path)))[0]
    assert ex.input_ids.tolist() == [BOS, ord("h"), ord("i")]
    assert ex.labels.tolist() == [ord("h"), ord("i"), EOS]
    path = write_jsonl(tmp_path, [{"prompt": "Q", "completion": "ok"}], name="c.jsonl")
    ex = load_dataset(path, BosTokenizer(), DataConfig(train=str(path)))[0]
    assert ex.input_ids.tolist() == [BOS, ord("Q"), ord("o"), ord("k")]
    assert ex.labels.tolist() == [IGNORE_INDEX, ord("o"), ord("k"), EOS]


class EosTokenizer(BosTokenizer):
    """Ends a sequence with EOS itself when asked to (add_eos_token true)."""

    add_eos_token = True

    def encode(self, text, add_special_tokens=False):
        return super().encode(text, add_special_tokens) + ([EOS] if add_special_tokens else [])


def test_a_tokenizer_that_adds_eos_gets_one_eos(tmp_path):
    path = write_jsonl(tmp_path, [{"text": "hi"}])
    ex = load_dataset(path, EosTokenizer(), DataConfig(train=str(path)))[0]
    assert ex.input_ids.tolist() == [BOS, ord("h"), ord("i")]
    assert ex.labels.tolist() == [ord("h"), ord("i"), EOS]
    path = write_jsonl(tmp_path, [{"prompt": "Q", "completion": "ok"}], name="c.jsonl")
    ex = load_dataset(path, EosTokenizer(), DataConfig(train=str(path)))[0]
    assert ex.input_ids.tolist() == [BOS, ord("Q"), ord("o"), ord("k")]  # no EOS after Q
    assert ex.labels.tolist() == [IGNORE_INDEX, ord("o"), ord("k"), EOS]


def test_alpaca_renders_as_chat(tmp_path):
    ds = load(tmp_path, [{"instruction": "Add", "input": "1 2", "output": "3"},
                         {"instruction": "Hi", "input": "", "output": "yo"}])
    assert ds.format == "alpaca"
    text = TOK.decode(np.append(ds[0].input_ids, ds[0].labels[-1]))
    assert "user\nAdd\n\n1 2" in text
    assert "user\nHi<4>" in TOK.decode(ds[1].input_ids)
    assert targets(ds[0]) == "3<4>" and targets(ds[1]) == "yo<4>"


def test_chat_masks_all_assistant_turns(tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    ds = load(tmp_path, [{"messages": msgs, "id": 7}])
    assert ds.format == "chat" and targets(ds[0]) == "b<4>d<4>"
    ds = load(tmp_path, [{"messages": msgs}], train_on_inputs=True)
    assert ds[0].num_targets() == len(ds[0])


def test_sharegpt_records_train_as_the_same_chat(tmp_path):
    """ShareGPT records ({"conversations": [{"from": "human", "value": ...}]}, the format of
    many published fine-tuning sets, as Axolotl, LLaMA-Factory and Unsloth read it) could not
    be detected; they train as the chat their speakers name, and Unsloth's role/content form of
    them too."""
    turns = [("system", "system", "S"), ("human", "user", "a"), ("gpt", "assistant", "b"),
             ("user", "user", "c"), ("assistant", "assistant", "d")]
    chat = load(tmp_path, [{"messages": [{"role": r, "content": c} for _, r, c in turns]}])
    share = load(tmp_path, [{"conversations": [{"from": f, "value": c} for f, _, c in turns]}])
    again = load(tmp_path, [{"conversations": [{"role": r, "content": c} for _, r, c in turns]}])
    assert share.format == "sharegpt" and targets(share[0]) == "b<4>d<4>"
    for ds in (share, again):
        assert ds[0].input_ids.tolist() == chat[0].input_ids.tolist()
        assert ds[0].labels.tolist() == chat[0].labels.tolist()
    for turns, words in [([], "'conversations' must be a non-empty list of {'from', 'value'}"),
                         ([{"from": "observation", "value": "x"}],
                          r"conversations\[0\]\.from must be one of system, human, user, gpt, "
                          "assistant, got 'observation'"),
                         ([{"from": "human", "value": None}],
                          r"conversations\[0\]\.value must be a string, got NoneType"),
                         ([{"from": "human", "value": "x"}], "'conversations' has no assistant"),
                         ([{"from": ["gpt"], "value": "x"}],
                          r"conversations\[0\]\.from must be .*got \['gpt'\]"),
                         ([{"speaker": "gpt", "text": "x"}],
                          r"conversations\[0\] must be an object with 'from' and 'value'")]:
        with pytest.raises(DataError, match=rf"d\.jsonl:2: {words}"):
            load(tmp_path, [{"conversations": [{"from": "gpt", "value": "ok"}]},
                            {"conversations": turns}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing key 'conversations' \(format "
                                        r"'sharegpt'\)"):
        load(tmp_path, [{"messages": []}], format="sharegpt")
    records = read_eval_records(write_jsonl(tmp_path, [{"conversations": [
        {"from": "human", "value": "1+2"}, {"from": "gpt", "value": "3"}]}]))
    assert records[0][:2] == ([{"role": "user", "content": "1+2"}], "3")


def test_json_arrays_are_read_and_tables_say_how_to_convert(tmp_path):
    """A file that is one JSON array of records (Stanford Alpaca's alpaca_data.json, many
    exports) was a "bad JSON" at its first line; its records are read in order, errors naming
    the file's line or the record's index."""
    records = [{"instruction": "Add", "input": "1 2", "output": "3"},
               {"instruction": "Hi", "input": "", "output": "yo"}]
    lines = load(tmp_path, records)
    for text in (json.dumps(records, indent=4), "\n" + json.dumps(records),
                 "\ufeff" + json.dumps(records)):
        (tmp_path / "a.json").write_text(text, encoding="utf-8")
        array = load_dataset(tmp_path / "a.json", TOK, DataConfig(train="a.json"))
        assert [e.input_ids.tolist() for e in array] == [e.input_ids.tolist() for e in lines]
        assert [e.labels.tolist() for e in array] == [e.labels.tolist() for e in lines]
    for text, words in [(json.dumps(records, indent=4)[:-10], r"a\.json:10: bad JSON: "
                                                              "Unterminated string"),
                        (json.dumps([*records, 3]), r"a\.json\[2\]: expected a JSON object, "
                                                    "got int"),
                        (json.dumps([records[0], {"x": 1}]), r"a\.json\[1\]: missing key "
                                                             "'instruction'")]:
        (tmp_path / "a.json").write_text(text)
        with pytest.raises(DataError, match=words):
            load_dataset(tmp_path / "a.json", TOK, DataConfig(train="a.json"))
    with pytest.raises(DataError, match=r"d\.jsonl:2: expected a JSON object, got list"):
        load(tmp_path, [records[0], "[1]"])  # a list on a later line is still a bad record
    # a table was read as text: "not valid UTF-8" (Parquet) or "bad JSON" (CSV) at line 1
    for name, call in [("t.parquet", r"pandas\.read_parquet\('t\.parquet'\)\.to_json\("
                                     r"'t\.jsonl', orient='records', lines=True\)"),
                       ("t.CSV", r"pandas\.read_csv\('t\.CSV'\)"),
                       ("t.arrow", r"datasets\.Dataset\.from_file\('t\.arrow'\)")]:
        (tmp_path / name).write_bytes(b"PAR1\x00\x15" if name.endswith("parquet") else b"a,b\n")
        with pytest.raises(DataError, match=rf"{name}: a \.\w+ table; packlora reads JSONL "
                                            rf"records .*convert it first, e\.g\. {call}"):
            load_dataset(tmp_path / name, TOK, DataConfig(train=name))


def test_explicit_format_and_auto_detection_errors(tmp_path):
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing key 'completion'"):
        load(tmp_path, [{"prompt": "x", "text": "y"}], format="completion")
    with pytest.raises(DataError, match=r"d\.jsonl:1: cannot detect the format"):
        load(tmp_path, [{"foo": "x"}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing key 'text'"):
        load(tmp_path, [{"text": "a"}, {"prompt": "b", "completion": "c"}])


def test_fields_read_a_format_s_keys_under_the_records_own_names(tmp_path):
    """data.fields: GSM8K-style records ({"question", "answer"}) train as completions, or as
    chats through the template (alpaca's keys), row for row as the renamed records would; eval
    reads them alike; a mapped key a record lacks names the line, the key and the setting."""
    gsm = [{"question": "1+2?", "answer": "3", "id": 1}]
    want = load(tmp_path, [{"prompt": "1+2?", "completion": "3", "id": 1}])
    got = load(tmp_path, gsm, fields={"prompt": "question", "completion": "answer"})
    assert got.format == "completion"
    assert got[0].input_ids.tolist() == want[0].input_ids.tolist()
    assert got[0].labels.tolist() == want[0].labels.tolist()
    chat = load(tmp_path, gsm, fields={"instruction": "question", "output": "answer"})
    assert chat.format == "alpaca" and targets(chat[0]) == "3<4>"
    # the mapped key wins over a record's own key of that name
    body = load(tmp_path, [{"text": "x", "body": "hello"}], fields={"text": "body"})
    assert TOK.decode(body[0].input_ids) == "hello"
    fields = {"prompt": "question", "completion": "answer"}
    records = read_eval_records(write_jsonl(tmp_path, gsm), fields)
    assert records[0][:2] == ("1+2?", "3")
    with pytest.raises(DataError, match=r"d\.jsonl:2: no key 'answer' \(data\.fields\."
                                        r"completion\); the record has keys \['question'\]"):
        load(tmp_path, [*gsm, {"question": "x"}], fields=fields)
    optional = load(tmp_path, gsm, fields={"instruction": "question", "output": "answer",
                                           "input": "context"})   # alpaca's input may be absent
    assert optional[0].input_ids.tolist() == chat[0].input_ids.tolist()


def test_truncation_is_counted(tmp_path):
    ds = load(tmp_path, [{"text": "x" * 50}, {"text": "short"}, {"text": "y" * 10}],
              max_seq_len=10)
    assert ds.num_truncated == 1  # "y"*11 + eos is exactly max_seq_len + 1 tokens: kept whole
    assert [len(ex) for ex in ds] == [10, 5, 10]
    records = [{"prompt": "p" * 20, "completion": "c"}, {"prompt": "", "completion": "ok"}]
    ds = load(tmp_path, records, max_seq_len=8)
    assert ds.num_truncated == 1 and ds.num_dropped == 1 and len(ds) == 1
    with pytest.raises(DataError, match="none of the 1 records"):
        load(tmp_path, [{"prompt": "p" * 20, "completion": "c"}], max_seq_len=8)


@pytest.mark.parametrize("line, problem", [
    ('{"text": "a"', "bad JSON"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"txt": "a"}', "missing key 'text'"),
    ('{"text": 5}', "'text' must be a string, got int"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, problem):
    path = write_jsonl(tmp_path, [{"text": "ok"}, "", line])
    with pytest.raises(DataError) as info:
        load_dataset(path, TOK, DataConfig(train=str(path)))
    assert str(info.value).startswith(f"{path}:3: ") and problem in str(info.value)


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty list"),
    ([{"role": "bot", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
    ([{"role": "user", "content": "x"}], "no assistant message"),
])
def test_malformed_chat(tmp_path, messages, problem):
    with pytest.raises(DataError, match=r"d\.jsonl:1: ") as info:
        load(tmp_path, [{"messages": messages}])
    assert problem in str(info.value)


def test_a_file_saved_with_a_byte_order_mark_reads(tmp_path):
    """Notepad's "UTF-8 with BOM": line 1 was "bad JSON: Unexpected UTF-8 BOM"."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\r\n{"text": "hi"}\r\n')
    ds = load_dataset(path, TOK, DataConfig(train=str(path)))
    assert ds.num_records == 2 and ds[0].input_ids.tolist() == [ord(c) for c in "hello"]


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    """The file was decoded in 8 KiB chunks: every bad byte was blamed on line 1."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "hello"}\n' * 3 + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:4: not valid UTF-8"):
        load_dataset(path, TOK, DataConfig(train=str(path)))


def test_empty_and_missing_files(tmp_path):
    path = write_jsonl(tmp_path, ["", "  "])
    with pytest.raises(DataError, match="no records"):
        load_dataset(path, TOK, DataConfig(train=str(path)))
    with pytest.raises(DataError, match="nope.jsonl: dataset file not found"):
        load_dataset(tmp_path / "nope.jsonl", TOK, DataConfig(train="x"))
    with pytest.raises(DataError, match="^train: "):
        load_dataset(path, TOK, DataConfig(train=str(path)), source_name="train")


def texts(n, rng_seed=0):
    rng = np.random.default_rng(rng_seed)
    return [{"text": f"t{i}" + "z" * int(rng.integers(0, 9))} for i in range(n)]


def batch_list(batches, n):
    return [next(batches) for _ in range(n)]


def test_batches_pad_and_cover_each_epoch(tmp_path):
    ds = load(tmp_path, texts(10))
    b = Batches(ds, batch_size=4, seed=3, pad_id=PAD)
    assert len(b) == 3
    seen = []
    for ids, labels in b.epoch_batches():
        assert ids.dtype == np.int32 and labels.dtype == np.int64 and ids.shape == labels.shape
        lengths = (labels != IGNORE_INDEX).sum(1)
        assert ids.shape[1] == lengths.max()
        for row, n in zip(ids, lengths):
            assert (row[n:] == PAD).all()
            seen.append(TOK.decode(row[:n]))
    assert sorted(seen) == sorted(TOK.decode(ex.input_ids) for ex in ds)
    assert b.epoch == 0 and next(b)[0].shape[0] == 4 and b.epoch == 1


def test_shuffle_is_deterministic(tmp_path):
    ds = load(tmp_path, texts(12))
    a = batch_list(Batches(ds, 3, seed=5), 8)
    c = batch_list(Batches(ds, 3, seed=5), 8)
    d = batch_list(Batches(ds, 3, seed=6), 8)
    assert all((x[0] == y[0]).all() for x, y in zip(a, c))
    assert any(x[0].shape != y[0].shape or (x[0] != y[0]).any() for x, y in zip(a, d))
    first = batch_list(Batches(ds, 12, seed=5), 2)  # epochs 0 and 1 differ in order
    assert (first[0][0] != first[1][0]).any()
    plain = next(Batches(ds, 12, seed=5, shuffle=False))[0]
    assert TOK.decode(plain[0][:2]) == "t0" and TOK.decode(plain[11][:3]) == "t11"


def test_resume_continues_exactly(tmp_path):
    ds = load(tmp_path, texts(11))
    straight = batch_list(Batches(ds, 4, seed=9), 17)
    first = Batches(ds, 4, seed=9)
    head = batch_list(first, 7)  # stops in the middle of epoch 2
    state = json.loads(json.dumps(first.state_dict()))
    resumed = Batches(ds, 4, seed=0)
    resumed.load_state_dict(state)
    rest = batch_list(resumed, 10)
    for (x, y), (u, v) in zip(straight, head + rest):
        assert (x == u).all() and (y == v).all()
    with pytest.raises(DataError, match="batch_size"):
        Batches(ds, 5, seed=9).load_state_dict(state)


def test_val_size_split(tmp_path):
    path = write_jsonl(tmp_path, texts(20))
    train, valid, stats = build_datasets(DataConfig(train=str(path), val_size=5), TOK, seed=1)
    assert len(train) == 15 and len(valid) == 5
    names = lambda ds: {TOK.decode(ex.input_ids) for ex in ds}
    assert not names(train) & names(valid) and len(names(train) | names(valid)) == 20
    again = build_datasets(DataConfig(train=str(path), val_size=5), TOK, seed=1)[1]
    assert names(again) == names(valid)
    other = build_datasets(DataConfig(train=str(path), val_size=5), TOK, seed=2)[1]
    assert names(other) != names(valid)
    assert len(build_datasets(DataConfig(train=str(path), val_size=0.25), TOK, seed=1)[1]) == 5
    assert stats.train_rows == 15 and stats.valid_rows == 5
    assert stats.train_tokens == count_tokens(train) and stats.truncated == 0
    with pytest.raises(DataError, match="leaving none"):
        build_datasets(DataConfig(train=str(path), val_size=20), TOK, seed=1)


def test_valid_file_and_no_validation(tmp_path):
    train_path = write_jsonl(tmp_path, texts(6), "train.jsonl")
    valid_path = write_jsonl(tmp_path, texts(2, 1), "valid.jsonl")
    cfg = DataConfig(train=str(train_path), valid=str(valid_path))
    train, valid, _ = build_datasets(cfg, TOK, seed=0)
    assert len(train) == 6 and len(valid) == 2 and valid.name == str(valid_path)
    assert build_datasets(DataConfig(train=str(train_path)), TOK, seed=0)[1] is None


def test_packing_keeps_targets_and_marks_segments(tmp_path):
    path = write_jsonl(tmp_path, texts(30))
    cfg = DataConfig(train=str(path), max_seq_len=24, packing=True)
    packed, _, stats = build_datasets(cfg, TOK, seed=0)
    plain = load_dataset(path, TOK, cfg)
    assert stats.packed and len(packed) < len(plain)
    assert all(len(row) <= 24 for row in packed)
    assert count_tokens(packed) == count_tokens(plain)
    assert count_targets(packed) == count_targets(plain)
    for row in packed:
        seg = row.segment_ids
        assert seg[0] == 1 and (np.diff(seg) >= 0).all() and (np.diff(seg) <= 1).all()
    ids, labels, seg = next(Batches(packed, 4, seed=0, segments=True, pad_multiple=8))
    assert ids.shape[1] % 8 == 0 and ((seg == 0) == (labels == IGNORE_INDEX)).all()
    rows = pack_examples(plain[:3], max_seq_len=100)
    assert len(rows) == 1 and rows[0].segment_ids.max() == 3


ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"


def demo_generator():
    spec = importlib.util.spec_from_file_location("make_demo_data",
                                                  ROOT / "scripts" / "make_demo_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_files_match_generator():
    gen = demo_generator()
    splits = gen.build()
    names = {}
    for split, rows in splits.items():
        lines = (DEMO / f"{split}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == rows
        names[split] = set()
        for row in rows:
            record = json.loads(row["messages"][2]["content"])
            assert row["messages"][2]["content"] == gen.answer(**record)
            assert record["name"] in row["messages"][1]["content"]
            names[split].update(record["name"].split())
    assert not names["test"] & (names["train"] | names["valid"])
    assert [len(splits[s]) for s in ("train", "valid", "test")] == [400, 40, 100]


@pytest.mark.slow
def test_demo_fits_64_tokens_with_real_tokenizer():
    try:
        from packlora.models.gguf_file import open_gguf
        from packlora.models.resolve import resolve_source
        tok = open_gguf(resolve_source("smollm2-135m-instruct")).tokenizer
    except (ImportError, ModelError, OSError) as exc:  # the packaged model is optional
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    cfg = DataConfig(train=str(DEMO / "train.jsonl"), valid=str(DEMO / "valid.jsonl"),
                     max_seq_len=64)
    train, valid, stats = build_datasets(cfg, tok, seed=0)
    assert stats.format == "chat" and stats.truncated == 0 and stats.dropped == 0
    assert max(len(ex) for ex in train) <= 63 and len(valid) == 40
    first = json.loads((DEMO / "train.jsonl").read_text().splitlines()[0])
    expected = first["messages"][2]["content"]
    assert tok.decode(train[0].labels[train[0].labels != IGNORE_INDEX]).startswith(expected)
