"""Data: tokenizer, packing, instruction masking, and the rank-independent sample order."""

from __future__ import annotations

import json
import pytest
from omegaconf import OmegaConf

from llmtrain import data
from llmtrain.models.build import byte_tokenizer


def text_cfg(path, seq_len=8, **kw):
    from llmtrain.config.schema import DataConfig

    base = dict(name="t", format="text", path=str(path), glob="*.txt", seq_len=seq_len, val_fraction=0.25,
                template="alpaca")
    base.update(kw)
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base)


def test_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    text = "def f(x):\n    return 'héllo' + \"\\t\"  # ünïcode ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 257, 260)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [258, 259]


def test_text_is_packed_into_full_blocks_with_eos_between_documents(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("defgh")
    (tmp_path / "c.txt").write_text("ij")
    tok = byte_tokenizer()
    splits = data.load_splits(text_cfg(tmp_path, seq_len=4), tok, seed=0)
    blocks = sorted([list(s["input_ids"]) for s in splits.train] + [list(s["input_ids"]) for s in splits.val])
    stream = list(b"abc") + [256] + list(b"defgh") + [256] + list(b"ij") + [256]
    expected = sorted(stream[i:i + 4] for i in range(0, len(stream) - 3, 4))
    assert blocks == expected
    assert len(splits.val) == 1 and len(splits.train) == 2


@pytest.mark.parametrize("content,needle", [(None, "does not exist"), ("", "holds no text"),
                                            ("  \n\n ", "holds no text")])
def test_text_errors_name_the_path(tmp_path, content, needle):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(data.DataError, match=needle) as err:
        data.load_splits(text_cfg(path), byte_tokenizer(), seed=0)
    assert "data.path" in str(err.value) and "corpus.txt" in str(err.value)


@pytest.mark.parametrize("name,fmt,key,path,example", [
    ("alpaca", "alpaca", "data", "mine.json", "alpaca_data.json"),
    ("tinyshakespeare", "text", "data", "input.txt", "input.txt"),
    ("prompts", "prompts", "data", "gsm8k_train.jsonl.gz", "gsm8k_train.jsonl"),
    ("chat", "chat", "data", "talks.json", "sharegpt.json"),
    ("sharegpt", "chat", "data.datasets.1", "sharegpt.json", "sharegpt.json"),  # data=mix's second source
    ("preference", "preference", "data", "pairs.jsonl", "hh_rlhf_harmless_test.jsonl.gz"),
    ("text", "text", "data", "gsm8k_test.jsonl", "gsm8k_test.jsonl"),  # an example file under another preset
    ("text", "text", "data", "corpus.txt", None)])
def test_a_missing_file_points_at_the_downloads_when_it_is_an_example(tmp_path, name, fmt, key, path, example):
    """A path that does not exist: one line naming the field and the path, and for a preset shown
    with a downloadable example file (or a path that names one), that file and the downloads table."""
    from llmtrain.data.sources import source_files

    with pytest.raises(data.DataError) as err:
        source_files(text_cfg(tmp_path / path, name=name, format=fmt), key)
    own = f"set {key}.path=/path/to/your/file"
    fix = own if example is None else f"download the example file {example} (see docs/data.md#downloads) or {own}"
    assert str(err.value) == f"{key}.path: {tmp_path / path} does not exist (data={name}); {fix}"


@pytest.mark.parametrize("content,needle", [(None, "does not exist"), ("", "is empty"),
                                            ("{not json", "alpaca.json line 1: invalid JSON: Expecting property name"),
                                            ('[{"x": 1}]', r"reads the column 'instruction', which is missing; its "
                                                           r"columns are \['x'\]")])
def test_alpaca_errors_name_the_path(tmp_path, content, needle):
    path = tmp_path / "alpaca.json"
    if content is not None:
        path.write_text(content)
    cfg = text_cfg(path, format="alpaca", seq_len=64)
    with pytest.raises(data.DataError, match=needle):
        data.load_splits(cfg, byte_tokenizer(), seed=0)


def test_instruction_prompt_is_masked_and_eos_label_kept_when_pad_is_eos():
    tok = byte_tokenizer()
    tok.pad_token = tok.eos_token  # the SmolLM2 situation: pad id == EOS id
    rec = {"instruction": "Add.", "input": "1+1", "output": "2"}
    enc = data.encode_instruction(rec, tok, seq_len=512, use_chat=False)
    prompt = data.ALPACA_PROMPT.format(with_input=", paired with an input that provides further context",
                                       instruction="Add.", input_block="### Input:\n1+1\n\n")
    n_prompt = len(prompt.encode())
    assert enc["input_ids"] == list(prompt.encode()) + [ord("2"), tok.eos_token_id]
    assert enc["labels"] == [-100] * n_prompt + [ord("2"), tok.eos_token_id]
    batch = data.Collator(tok.pad_token_id)([enc, data.encode_instruction(
        {"instruction": "Say a long thing.", "output": "x" * 40}, tok, 512, False)])
    assert batch["labels"][0, n_prompt + 1] == tok.eos_token_id  # real EOS is trained
    assert (batch["labels"][0, n_prompt + 2:] == -100).all()     # padding (same id) is not
    assert (batch["input_ids"][0, n_prompt + 2:] == tok.eos_token_id).all()
    assert batch["attention_mask"][0].sum() == n_prompt + 2


def test_record_whose_response_is_truncated_away_is_dropped():
    tok = byte_tokenizer()
    rec = {"instruction": "x" * 100, "output": "y"}
    assert data.encode_instruction(rec, tok, seq_len=50, use_chat=False) is None


def test_alpaca_file_loads_and_splits(tmp_path):
    records = [{"instruction": f"Q{i}", "input": "", "output": f"A{i}"} for i in range(20)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    splits = data.load_splits(text_cfg(tmp_path / "a.json", format="alpaca", seq_len=256, val_fraction=0.1),
                              byte_tokenizer(), seed=3)
    assert (len(splits.train), len(splits.val)) == (18, 2)


def test_global_order_visits_every_sample_once_per_epoch():
    order = data.GlobalSampleOrder(10, seed=7, shuffle=True)
    epoch0, epoch1 = [order[g] for g in range(10)], [order[g] for g in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # reshuffled each epoch
    assert [data.GlobalSampleOrder(10, 7, True)[g] for g in range(15, 20)] == epoch1[5:]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_step_batches_are_independent_of_world_size(world):
    """Union over ranks of each step's samples equals the one-rank step: global batch 8."""
    order = data.GlobalSampleOrder(13, seed=1, shuffle=True)
    def step_samples(world_size, micro):
        accumulation = 8 // (micro * world_size)
        per_step = []
        for step in range(5):
            got = []
            for rank in range(world_size):
                s = data.StepBatchSampler(order, micro, accumulation, rank, world_size, 0, 5)
                for micro_batch in s.global_indices(step):
                    got += micro_batch
            per_step.append(sorted(got))
        return per_step
    assert step_samples(world, 2 if world < 4 else 1) == step_samples(1, 8)
    assert step_samples(1, 8)[0] == list(range(8)) and step_samples(1, 8)[1] == list(range(8, 16))


def test_sampler_resumes_at_a_step():
    order = data.GlobalSampleOrder(13, seed=1, shuffle=True)
    full = list(data.StepBatchSampler(order, 2, 2, 0, 2, start_step=0, max_steps=6))
    resumed = list(data.StepBatchSampler(order, 2, 2, 0, 2, start_step=4, max_steps=6))
    assert resumed == full[8:]


def test_val_batches_are_sharded_across_ranks(tmp_path):
    tok = byte_tokenizer()
    val = [{"input_ids": [i] * 3, "labels": [i] * 3} for i in range(7)]
    splits = data.Splits(train=None, val=val)
    seen = []
    for rank in range(2):
        for b in data.val_batches(splits, tok, micro_batch=2, max_samples=6, dp_rank=rank, dp_size=2):
            seen += b["input_ids"][:, 0].tolist()
    assert sorted(seen) == list(range(6))


@pytest.mark.parametrize("bad,needle", [({"instruction": "x", "output": None}, "record 12"),
                                        ({"instruction": 5, "output": "y"}, "record 12"),
                                        ({"instruction": "x"}, "record 12")])
def test_every_alpaca_record_is_checked(tmp_path, bad, needle):
    records = [{"instruction": f"Q{i}", "input": "", "output": f"A{i}"} for i in range(12)] + [bad]
    (tmp_path / "a.json").write_text(json.dumps(records))
    with pytest.raises(data.DataError, match=needle):
        data.load_splits(text_cfg(tmp_path / "a.json", format="alpaca", seq_len=64), byte_tokenizer(), seed=0)


def test_alpaca_non_utf8_and_folder_paths_are_reported(tmp_path):
    (tmp_path / "a.json").write_bytes(b"\xff\xfe[\x00")
    with pytest.raises(data.DataError, match="a.json could not be read as json: it is not UTF-8"):
        data.load_splits(text_cfg(tmp_path / "a.json", format="alpaca", seq_len=64), byte_tokenizer(), seed=0)
    # A folder is read as all its record files; the bad one is named.
    with pytest.raises(data.DataError, match="a.json could not be read as json: it is not UTF-8"):
        data.load_splits(text_cfg(tmp_path, format="alpaca", seq_len=64), byte_tokenizer(), seed=0)


RECORDS = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"}] * 4


def _jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


@pytest.mark.parametrize("name,write", [
    ("records.json", lambda p: p.write_text(json.dumps(RECORDS, indent=2))),
    ("records.jsonl", lambda p: p.write_text(_jsonl(RECORDS))),
    ("records.JSONL", lambda p: p.write_text("\n\n" + _jsonl(RECORDS))),
    ("bom.json", lambda p: p.write_text("\ufeff" + json.dumps(RECORDS), encoding="utf-8")),
    ("records.ndjson", lambda p: p.write_text(_jsonl(RECORDS))),
    ("records.jsonl.gz", lambda p: p.write_bytes(__import__("gzip").compress(_jsonl(RECORDS).encode()))),
])
def test_text_format_reads_json_records_by_column_and_names_a_missing_one(tmp_path, name, write):
    # The failing case seen by a user: data=tinyshakespeare data.path=alpaca.json trained on raw JSON.
    path = tmp_path / name
    write(path)
    with pytest.raises(data.DataError, match=r"format text reads the column 'text', which is missing; its columns "
                                             r"are \['instruction', 'input', 'output'\].*data.columns.text=YOUR_COLUMN"
                                             r", or read these records as data.format=instruction") as err:
        data.load_splits(text_cfg(path), byte_tokenizer(), seed=0)
    assert str(path) in str(err.value)
    splits = data.load_splits(text_cfg(path, columns={"text": "output"}, seq_len=2), byte_tokenizer(), seed=0)
    assert len(splits.train) + len(splits.val) == 4  # four documents "5" + EOS: 8 tokens, blocks of 2


def test_text_format_refuses_json_lines_saved_as_txt(tmp_path):
    path = tmp_path / "lines-saved-as.txt"
    path.write_text(_jsonl(RECORDS))
    with pytest.raises(data.DataError, match=r"JSON records with fields \['input', 'instruction', "
                                             r"'output'\].*data.columns.text=FIELD") as err:
        data.load_splits(text_cfg(path), byte_tokenizer(), seed=0)
    assert str(path) in str(err.value)


def test_text_format_reads_a_parquet_column(tmp_path):
    import datasets

    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_list([{"content": "abc"}, {"content": "defg"}]).to_parquet(str(path))
    splits = data.load_splits(text_cfg(path, columns={"text": "content"}, seq_len=3), byte_tokenizer(), seed=0)
    blocks = [list(map(int, splits.train[i]["input_ids"])) for i in range(len(splits.train))]
    blocks += [list(map(int, splits.val[i]["input_ids"])) for i in range(len(splits.val))]
    eos = byte_tokenizer().eos_token_id
    assert sorted(blocks) == sorted([[97, 98, 99], [eos, 100, 101], [102, 103, eos]])


def test_max_bytes_caps_the_raw_text_read_not_whole_files(tmp_path):
    """A single 1.1 MB file with max_bytes=6000 gives 6000 bytes of text (it was read whole); a
    cut inside a multi-byte character ends before it; a compressed file counts its text."""
    import gzip

    (tmp_path / "big.txt").write_text("abcdefghij" * 110_000)
    docs = data.text_documents(text_cfg(tmp_path / "big.txt", max_bytes=6000), "data")
    assert [len(d["text"]) for d in docs] == [6000]
    splits = data.load_splits(text_cfg(tmp_path / "big.txt", max_bytes=6000, seq_len=7), byte_tokenizer(), seed=0)
    assert len(splits.train) + len(splits.val) == 6001 // 7  # 6000 bytes + EOS, in blocks of 7
    (tmp_path / "u.txt").write_text("é" * 1000)  # two bytes each
    assert data.text_documents(text_cfg(tmp_path / "u.txt", max_bytes=7), "data")["text"] == ["ééé"]
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.txt").write_text("first\n")
    (folder / "b.txt").write_text("second file")
    assert data.text_documents(text_cfg(folder, max_bytes=10), "data")["text"] == ["first\n", "seco"]
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write("z" * 50_000)
    assert [len(t) for t in data.text_documents(text_cfg(tmp_path / "c.txt.gz", max_bytes=1234), "data")["text"]] == [1234]


def test_a_prepared_token_folder_holds_out_the_blocks_its_text_holds_out(tmp_path):
    """data=tokens and data=text share val_fraction, so a folder from llmtrain.prepare validates on
    the very blocks the raw text would (same blocks, same split of the same count)."""
    from conftest import make_cfg

    fractions = {name: make_cfg([f"data={name}"]).data.val_fraction for name in ("text", "tokens")}
    assert fractions["text"] == fractions["tokens"], fractions
    (tmp_path / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(300)))
    text = text_cfg(tmp_path / "corpus.txt", seq_len=16, val_fraction=fractions["text"])
    tok = byte_tokenizer()
    data.write_token_folder(data.text_documents(text, "data"), tok, tmp_path / "tokens", num_proc=1, source="test")
    tokens = text_cfg(tmp_path / "tokens", format="tokens", seq_len=16, val_fraction=fractions["tokens"])

    def ids(part):
        return [list(map(int, part[i]["input_ids"])) for i in range(len(part))]
    raw, prepared = data.load_splits(text, tok, seed=5), data.load_splits(tokens, tok, seed=5)
    assert len(raw.val) == max(1, round((len(raw.train) + len(raw.val)) * fractions["text"])) > 1
    assert ids(prepared.val) == ids(raw.val) and ids(prepared.train) == ids(raw.train)


@pytest.mark.parametrize("fmt,name", [("alpaca", "t.jsonl.gz"), ("text", "t.txt.gz"), ("alpaca", "t.jsonl.xz")])
def test_a_truncated_or_plain_compressed_file_is_one_line_naming_it(tmp_path, fmt, name):
    """A download cut short (gzip's EOFError, raised again by the JSON locator) and a plain file
    named .gz (BadGzipFile) were double tracebacks; the data.max_bytes head of a text file too."""
    import gzip
    import lzma

    compress = lzma.compress if name.endswith(".xz") else gzip.compress
    body = (_jsonl([{"instruction": f"Add {i} and 3.", "output": str(i + 3)} for i in range(2000)]) if fmt == "alpaca"
            else "".join(f"line {i}: the quick brown fox {i * i}\n" for i in range(5000))).encode()
    path = tmp_path / name
    assert len(compress(body)) > 2000
    path.write_bytes(compress(body)[:1000])
    kind = "xz" if name.endswith(".xz") else "gzip"
    for max_bytes in (None, 10_000):
        with pytest.raises(data.DataError, match=rf"^data.path: {path} is truncated or damaged {kind} data \(.*\); "
                                                 r"re-download it \(see docs/data.md#downloads\) or compress it "
                                                 r"again$"):
            data.load_splits(text_cfg(path, format=fmt, max_bytes=max_bytes), byte_tokenizer(), seed=0)
    path.write_bytes(body)
    with pytest.raises(data.DataError, match=rf"^data.path: {path} is not {kind} data \(it does not start with "
                                             rf"{kind}'s magic bytes\): a plain file named {path.suffix}\? rename "
                                             r"it without "):
        data.load_splits(text_cfg(path, format=fmt), byte_tokenizer(), seed=0)


def test_a_refused_json_lines_record_is_named_by_its_line(tmp_path):
    """A null field on line 51 was "record 50" (the 0-based index) while JSON errors say "line":
    JSON lines name the line (blank lines counted, as an editor shows them) and, in a folder, the
    file; a JSON array keeps the record index."""
    lines = [json.dumps(r) for r in RECORDS * 20]
    lines[50] = json.dumps({"instruction": "x", "output": None})
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(data.DataError, match=rf"^data.path: {tmp_path / 'a.jsonl'} line 51: field 'output' is missing"):
        data.load_splits(text_cfg(tmp_path / "a.jsonl", format="alpaca", seq_len=64), byte_tokenizer(), seed=0)
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:10]) + "\n\n  \n" + "\n".join(lines[10:]) + "\n")
    with pytest.raises(data.DataError, match=rf"{tmp_path / 'a.jsonl'} line 53: field 'output' is missing"):
        data.load_splits(text_cfg(tmp_path / "a.jsonl", format="alpaca", seq_len=64), byte_tokenizer(), seed=0)
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (folder / "b.jsonl").write_text("\n".join(lines[40:]) + "\n")
    with pytest.raises(data.DataError, match=rf"^data.path: {folder / 'b.jsonl'} line 11: field 'output' is missing"):
        data.load_splits(text_cfg(folder, format="alpaca", seq_len=64), byte_tokenizer(), seed=0)
    (tmp_path / "a.json").write_text(json.dumps([json.loads(line) for line in lines], indent=1))
    with pytest.raises(data.DataError, match=rf"^data.path: {tmp_path / 'a.json'} record 50: field 'output' is "
                                             r"missing"):
        data.load_splits(text_cfg(tmp_path / "a.json", format="alpaca", seq_len=64), byte_tokenizer(), seed=0)
