"""Formats and sources through ``datasets``: chat (messages and ShareGPT), instruction,
prompt/completion, column mapping, truncation, packing exactness, mixtures, token folders and
every bad input named by file, record and field."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from llmtrain import data
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.models.build import byte_tokenizer

IM_END = 259  # the byte tokenizer's <|im_end|>

SHAREGPT = [
    {"id": f"c{i}", "conversations": [
        {"from": "system", "value": "You are Tiny."},
        {"from": "human", "value": f"Question {i}?"},
        {"from": "gpt", "value": f"Answer {i}."},
        {"from": "human", "value": "And then?"},
        {"from": "gpt", "value": f"Then {i * 7}."},
    ]} for i in range(12)]


def as_messages(conv: dict) -> list[dict]:
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in conv["conversations"]]


def cfg(path, **kw):
    from llmtrain.config.schema import DataConfig

    base = dict(name="t", format="chat", path=str(path), seq_len=256, val_fraction=0.25, template="chatml")
    base.update(kw)
    return OmegaConf.merge(OmegaConf.structured(DataConfig), base)


def all_samples(splits) -> list[tuple[list[int], list[int]]]:
    out = []
    for part in (splits.train, splits.val):
        for i in range(len(part)):
            out.append((list(map(int, part[i]["input_ids"])), list(map(int, part[i]["labels"]))))
    return sorted(out)


def chatml_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = data.formats.CHATML
    return tok


def test_chat_ids_equal_apply_chat_template_and_every_assistant_turn_is_trained(tmp_path):
    (tmp_path / "sharegpt.json").write_text(json.dumps(SHAREGPT))
    splits = data.load_splits(cfg(tmp_path / "sharegpt.json"), byte_tokenizer(), seed=0)
    tok = chatml_tokenizer()
    expected = []
    for conv in SHAREGPT:
        ids = list(tok.apply_chat_template(as_messages(conv), tokenize=True)["input_ids"])
        expected.append(ids)
    got = all_samples(splits)
    assert sorted(ids for ids, _ in got) == sorted(expected)
    for ids, labels in got:
        trained = [t for t, label in zip(ids, labels) if label != -100]
        assert all(label in (-100, t) for t, label in zip(ids, labels))
        i = int(tok.decode(ids).split("Question ")[1].split("?")[0])
        # Both assistant turns, each with its end-of-turn token; no system, user or newline tokens.
        assert tok.decode(trained) == f"Answer {i}.<|im_end|>Then {i * 7}.<|im_end|>"
        assert trained.count(IM_END) == 2


def test_messages_jsonl_parquet_and_save_to_disk_give_the_sharegpt_samples(tmp_path):
    (tmp_path / "sharegpt.json").write_text(json.dumps(SHAREGPT))
    rows = [{"messages": as_messages(c)} for c in SHAREGPT]
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "messages.parquet"))
    datasets.Dataset.from_list([{"dialog": r["messages"]} for r in rows]).save_to_disk(str(tmp_path / "saved"))
    reference = all_samples(data.load_splits(cfg(tmp_path / "sharegpt.json"), byte_tokenizer(), seed=0))
    for path, extra in ((tmp_path / "messages.jsonl", {}), (tmp_path / "messages.parquet", {}),
                        (tmp_path / "saved", {"columns": {"messages": "dialog"}})):
        assert all_samples(data.load_splits(cfg(path, **extra), byte_tokenizer(), seed=0)) == reference, path


def test_instruction_with_a_chat_template_ends_in_end_of_turn_and_export_stops_on_it(tmp_path):
    records = [{"instruction": f"Q{i}", "input": "", "output": f"A{i}"} for i in range(8)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    c = cfg(tmp_path / "a.json", format="instruction")
    tok = byte_tokenizer()
    for ids, labels in all_samples(data.load_splits(c, tok, seed=0)):
        trained = [t for t in labels if t != -100]
        assert trained[-1] == IM_END and tok.eos_token_id not in trained
    # Base tokenizer: EOS (256) differs from the end of turn (259); generation stops on both.
    assert data.end_token_ids(c, tok) == [IM_END, 256]
    assert data.end_token_ids(cfg(tmp_path / "a.json", format="instruction", template="alpaca"), tok) == [256]


def test_online_prompts_through_the_chat_template_end_completions_at_end_of_turn(tmp_path):
    """data=prompts rendered with the template's generation prompt: a sampled completion ends at
    the end of turn as a supervised answer does (before, only EOS ended it, so a GRPO completion
    ran past ``<|im_end|>`` and the export's generate did too); the Alpaca prompt has no turns."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}"}) + "\n" for i in range(4)))
    chatml, alpaca = (cfg(tmp_path / "p.jsonl", format="prompts", template=t) for t in ("chatml", "alpaca"))
    assert data.end_token_ids(chatml, data.apply_template_setting(chatml, byte_tokenizer())) == [IM_END, 256]
    assert data.end_token_ids(alpaca, data.apply_template_setting(alpaca, byte_tokenizer())) == [256]


def test_prompt_completion_trains_the_completion_and_eos_only(tmp_path):
    rows = [{"p": f"2+{i}=", "completion": str(2 + i)} for i in range(6)]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = cfg(tmp_path / "pc.jsonl", format="prompt_completion", columns={"prompt": "p"})
    tok = byte_tokenizer()
    for ids, labels in all_samples(data.load_splits(c, tok, seed=0)):
        prompt = tok.decode(ids).split("=")[0] + "="
        assert labels[:len(prompt)] == [-100] * len(prompt)
        assert labels[len(prompt):] == ids[len(prompt):] and ids[-1] == tok.eos_token_id


def test_truncation_right_and_drop_are_counted(tmp_path, caplog):
    records = [{"instruction": "q", "input": "", "output": "x" * n} for n in (5, 5, 5, 400, 400)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    right = data.load_splits(cfg(tmp_path / "a.json", format="instruction", template="alpaca"), byte_tokenizer(), 0)
    assert right.stats["t"]["truncated"] == 2 and right.stats["t"]["samples"] == 5
    assert max(len(ids) for ids, _ in all_samples(right)) == 256
    drop = data.load_splits(cfg(tmp_path / "a.json", format="instruction", template="alpaca", truncation="drop"),
                            byte_tokenizer(), 0)
    assert drop.stats["t"]["dropped_too_long"] == 2 and drop.stats["t"]["samples"] == 3
    assert "dropped 2 too long" in data.describe(drop)


def test_a_conversation_without_an_assistant_turn_is_dropped_and_counted(tmp_path):
    convs = SHAREGPT[:6] + [{"conversations": [{"from": "human", "value": "hello?"}]}]
    (tmp_path / "c.json").write_text(json.dumps(convs))
    splits = data.load_splits(cfg(tmp_path / "c.json"), byte_tokenizer(), seed=0)
    assert splits.stats["t"]["dropped_no_target"] == 1 and splits.stats["t"]["samples"] == 6
    (tmp_path / "none.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}] * 3))
    with pytest.raises(DataError, match=r"none.json: 0 of 3 records give a usable sample.*without an "
                                        r"assistant/target token 3"):
        data.load_splits(cfg(tmp_path / "none.json"), byte_tokenizer(), seed=0)


def _bad(conv_turn):
    return SHAREGPT[:4] + [{"conversations": [{"from": "human", "value": "hi"}, conv_turn]}]


@pytest.mark.parametrize("records,needle", [
    (_bad({"from": "robot", "value": "x"}), r"record 4 turn 1: from='robot' is not a known role; expected one of "
                                            r"human, user, gpt, assistant, system"),
    (_bad({"from": "gpt", "value": 7}), None),  # mixed types: named by the reader (row 4)
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}] * 3,
     r"record 0 turn 1: role='bot' is not a known role; expected one of system, user, assistant"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}]}] * 3,
     r"record 0 turn 1: 'content' must be a string, got list"),
    ([{"dialog": []}] * 3, r"format chat reads a 'messages' .* or 'conversations' .* column; its columns are "
                           r"\['dialog'\]. Map yours with data.columns.messages=COLUMN"),
])
def test_bad_chat_records_name_file_record_turn_and_field(tmp_path, records, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records))
    with pytest.raises(DataError) as err:
        data.load_splits(cfg(path), byte_tokenizer(), seed=0)
    assert "bad.json" in str(err.value)
    if needle:
        import re

        assert re.search(needle, str(err.value)), str(err.value)
    else:
        assert "row 4" in str(err.value) or "record 4" in str(err.value), str(err.value)


def test_a_misspelt_mapped_column_names_the_closest_one(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "q", "outptu": "a"}) + "\n")
    with pytest.raises(DataError, match=r"data.columns.output=answer names the column 'answer', which is missing; "
                                        r"its columns are \['instruction', 'outptu'\]"):
        data.load_splits(cfg(tmp_path / "a.jsonl", format="instruction", columns={"output": "answer"}),
                         byte_tokenizer(), seed=0)
    with pytest.raises(DataError, match=r"column 'output', which is missing \(did you mean 'outptu'\?\)"):
        data.load_splits(cfg(tmp_path / "a.jsonl", format="instruction"), byte_tokenizer(), seed=0)


@pytest.mark.parametrize("name,content,needle", [
    ("empty.jsonl", b"", r"empty.jsonl is empty"),
    ("fake.parquet", b"not parquet at all", r"fake.parquet is not a Parquet file"),
    ("bad.json", b'[{"messages": ', r"bad.json line 1: invalid JSON: Expecting value at column 15"),
])
def test_unreadable_files_are_named(tmp_path, name, content, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=needle):
        data.load_splits(cfg(tmp_path / name), byte_tokenizer(), seed=0)


def _cut_jsonl(path):
    """150 good records, line 151 cut short, then 20 more good ones."""
    good = [json.dumps({"text": f"record {i}: some words to train on"}) for i in range(170)]
    path.write_text("\n".join(good[:150] + ['{"text": "abc'] + good[150:]) + "\n")
    return path


def test_a_cut_jsonl_line_is_named_once_by_file_and_line(tmp_path, capfd, caplog):
    bad = _cut_jsonl(tmp_path / "BAD.jsonl")
    with pytest.raises(DataError) as err:
        data.load_splits(cfg(bad, format="text"), byte_tokenizer(), seed=0)
    assert str(err.value) == (f"data.path: {bad} line 151: invalid JSON: Unterminated string starting at column 10; "
                              "each line must hold one whole JSON object")
    out, errs = capfd.readouterr()
    assert "Failed to load JSON" not in out + errs + caplog.text  # datasets' own row-150 lines are silenced
    # A JSON document (an array) names the line of the error.
    (tmp_path / "doc.json").write_text('[{"text": "a"},\n {"text": "b"}\n {"text": "c"}]\n')
    with pytest.raises(DataError, match=r"doc.json line 3: invalid JSON: Expecting ',' delimiter at column 2$"):
        data.load_splits(cfg(tmp_path / "doc.json", format="text"), byte_tokenizer(), seed=0)


def test_a_cut_jsonl_line_is_one_line_from_the_command_line(tmp_path):
    from conftest import run_cli

    bad = _cut_jsonl(tmp_path / "BAD.jsonl")
    proc = run_cli(["tracker=none", "data=text", f"data.path={bad}", "trainer.max_steps=1",
                    f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    message = (f"llmtrain: error: data.path: {bad} line 151: invalid JSON: Unterminated string starting at column 10; "
               "each line must hold one whole JSON object")
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [message]
    # stdout holds only the start-up phase lines: no datasets parse errors, no second message.
    assert "JSON" not in proc.stdout and "row 150" not in proc.stdout, proc.stdout
    assert not (tmp_path / "run").exists()


def test_chat_without_a_template_names_data_template(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(SHAREGPT))
    with pytest.raises(ConfigError, match=r"data.format=chat .* this tokenizer has none. Set data.template=chatml "
                                          r".* or data.template=/path/to/template.jinja"):
        data.load_splits(cfg(tmp_path / "c.json", template="auto"), byte_tokenizer(), seed=0)
    jinja = tmp_path / "t.jinja"
    jinja.write_text(data.formats.CHATML)
    via_file = all_samples(data.load_splits(cfg(tmp_path / "c.json", template=str(jinja)), byte_tokenizer(), 0))
    assert via_file == all_samples(data.load_splits(cfg(tmp_path / "c.json"), byte_tokenizer(), 0))


def test_an_unreachable_hub_id_gives_one_error_saying_what_to_do(monkeypatch):
    monkeypatch.setattr(data.sources, "hub_reachable", lambda timeout_s=3.0: False)
    with pytest.raises(DataError, match=r"data.path='someone/no-such-set' is not a local file or folder, and the "
                                        r"Hugging Face Hub cannot be reached .*datasets.load_dataset\('someone/"
                                        r"no-such-set', name='x', split='train'\).save_to_disk\('DIR'\)"):
        data.load_splits(cfg("someone/no-such-set", subset="x"), byte_tokenizer(), seed=0)


# ---- packing: per-sample token losses equal unpacked ones ----

def _tiny_model():
    from llmtrain.models.build import model_config
    from tests.conftest import make_cfg
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(make_cfg([]).model)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def _token_losses(logits, labels):
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100,
                                             reduction="none")


@pytest.mark.parametrize("fmt", ["chat", "instruction"])
def test_packed_rows_give_each_sample_its_unpacked_token_losses(tmp_path, fmt):
    from llmtrain.engine import model_inputs
    from llmtrain.parallel.pipeline import split_stages

    if fmt == "chat":
        (tmp_path / "d.json").write_text(json.dumps(SHAREGPT))
    else:
        (tmp_path / "d.json").write_text(json.dumps(
            [{"instruction": f"Say {i}", "input": "x" * i, "output": "y" * (3 * i + 1)} for i in range(12)]))
    c = cfg(tmp_path / "d.json", format=fmt, packing=True, val_fraction=0.1)
    splits = data.load_splits(c, byte_tokenizer(), seed=0)
    unpacked = data.load_splits(cfg(tmp_path / "d.json", format=fmt, val_fraction=0.1), byte_tokenizer(), seed=0)
    assert len(splits.train) < len(unpacked.train)  # several samples share a row
    model = _tiny_model()
    stages = [stage for r in range(2) for _, stage in split_stages(model, 2, r, 1)]
    reference = {}
    with torch.no_grad():
        for i in range(len(unpacked.train)):
            s = unpacked.train[i]
            ids, labels = torch.tensor([s["input_ids"]]), torch.tensor([s["labels"]])
            reference[tuple(s["input_ids"])] = _token_losses(model(input_ids=ids).logits, labels)
        matched = 0
        for k in range(len(splits.train)):
            batch = data.Collator(257)([splits.train[k]])
            logits = model(**model_inputs(batch)).logits
            # The pipeline-parallel path: every stage is given the positions.
            piped = stages[1](stages[0](batch["input_ids"], position_ids=batch["position_ids"]),
                              position_ids=batch["position_ids"])
            assert torch.allclose(piped, logits, atol=1e-5)
            losses = _token_losses(logits, batch["labels"])
            starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
            for a, b in zip(starts, starts[1:]):
                key = tuple(batch["input_ids"][0, a:b].tolist())
                # Token j's loss sits at j-1; the first token of a sample predicts nothing.
                assert torch.allclose(losses[a:b - 1], reference[key], atol=1e-5), key
                matched += 1
    assert matched == len(unpacked.train)


def test_document_masking_restarts_positions_after_each_eos(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("defgh")
    (tmp_path / "c.txt").write_text("ijklmnopq")
    c = cfg(tmp_path, format="text", glob="*.txt", seq_len=10, document_masking=True, val_fraction=0.1)
    splits = data.load_splits(c, byte_tokenizer(), seed=0)
    rows = [splits.train[i] for i in range(len(splits.train))] + [splits.val[i] for i in range(len(splits.val))]
    row = next(r for r in rows if int(r["input_ids"][0]) == ord("a"))
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert row["labels"].tolist()[4] == -100 and row["labels"].tolist()[3] == 256


# ---- mixtures ----

def test_mixture_order_follows_weights_and_is_rank_independent():
    order = data.MixtureOrder([50, 20], [0.7, 0.3], seed=3, shuffle=True)
    sources = [order.source_of(g) for g in range(10000)]
    assert abs(sources.count(0) / 10000 - 0.7) < 0.02
    again = data.MixtureOrder([50, 20], [0.7, 0.3], seed=3, shuffle=True)
    assert [again[g] for g in range(9000, 9100)] == [order[g] for g in range(9000, 9100)]
    # Each source visits all its samples once per its own epoch.
    firsts = [order[g] for g in range(10000) if sources[g] == 1][:20]
    assert sorted(firsts) == list(range(50, 70))


def test_mixture_weights_must_match_the_datasets():
    from llmtrain.config.validate import validate_data
    from tests.conftest import make_cfg

    c = make_cfg(["data=mix", "data.datasets.0.path=a.json", "data.datasets.1.path=b.json", "data.weights=[1]"])
    with pytest.raises(ConfigError, match=r"data.weights has 1 value\(s\) for 2 data.datasets"):
        validate_data(c.data)
    c = make_cfg(["data=mix", "data.datasets.0.path=a.json", "data.datasets.1.path=b.json", "data.weights=[1,-1]"])
    with pytest.raises(ConfigError, match=r"data.weights=\[1.0, -1.0\] must be finite and >= 0"):
        validate_data(c.data)
    c = make_cfg(["data=mix", "data.datasets.0.path=a.json"])
    with pytest.raises(ConfigError, match=r"data.datasets.1.path must be set"):
        validate_data(c.data)


# ---- token folders ----

def test_a_token_folder_from_another_tokenizer_is_refused_naming_both(tmp_path):
    from transformers import PreTrainedTokenizerFast

    docs = datasets.Dataset.from_list([{"text": "hello world"}] * 4)
    data.write_token_folder(docs, byte_tokenizer(), tmp_path / "tok", num_proc=1, source="test")
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    other = PreTrainedTokenizerFast(tokenizer_object=other.backend_tokenizer, eos_token="<|endoftext|>")
    with pytest.raises(DataError, match=r"tok was tokenized with .*sha256 [0-9a-f]{12}\), but this run's tokenizer is "
                                        r".*sha256 [0-9a-f]{12}\); prepare the folder again"):
        data.load_splits(cfg(tmp_path / "tok", format="tokens", seq_len=4), other, seed=0)
    splits = data.load_splits(cfg(tmp_path / "tok", format="tokens", seq_len=4), byte_tokenizer(), seed=0)
    assert len(splits.train) + len(splits.val) == (12 * 4) // 4


def test_the_export_stops_generation_on_every_end_token_training_taught(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from llmtrain.checkpoint.export import save_hf_folder
    from tests.conftest import make_cfg

    c = make_cfg(["data=chat", f"data.path={tmp_path / 'c.json'}", "data.template=chatml"])
    tok = data.apply_template_setting(c.data, byte_tokenizer())
    model = _tiny_model()
    save_hf_folder(model.state_dict(), c.model, tok, tmp_path / "hf", data.end_token_ids(c.data, tok))
    assert GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == [IM_END, 256]
    # The exported tokenizer carries the template training rendered with.
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == data.formats.CHATML
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").generation_config.eos_token_id == [IM_END, 256]


def test_the_split_covers_every_sample_once_and_stores_only_the_validation_indices():
    import numpy as np

    from llmtrain.data import _split

    train, val = _split(1000, 0.05, seed=4)
    got = [train[k] for k in range(len(train))]
    assert len(val) == 50 and sorted(got + val.tolist()) == list(range(1000)) and got == sorted(got)
    assert train._shift.nbytes == 50 * 8
    again_train, again_val = _split(1000, 0.05, seed=4)
    assert np.array_equal(again_val, val) and not np.array_equal(_split(1000, 0.05, seed=5)[1], val)
    with pytest.raises(IndexError):
        train[len(train)]


# ---- break-it findings: each was a traceback, a silent run or a misleading count ----

def _token_folder(tmp_path):
    docs = datasets.Dataset.from_list([{"text": "hello world, " * 20}] * 8)
    data.write_token_folder(docs, byte_tokenizer(), tmp_path / "tok", num_proc=1, source="test")
    return tmp_path / "tok"


@pytest.mark.parametrize("damage,needle", [
    (lambda f: (f / "tokens.bin").write_bytes((f / "tokens.bin").read_bytes()[:-3]), r"holds \d+ bytes, but manifest"),
    (lambda f: (f / "manifest.json").write_text("{"), "manifest.json is not valid JSON"),
    (lambda f: (f / "manifest.json").write_text(json.dumps(dict(json.loads((f / "manifest.json").read_text()),
                                                               dtype="uint32"))), r"holds \d+ bytes, but manifest"),
    (lambda f: (f / "manifest.json").write_text(json.dumps(dict(json.loads((f / "manifest.json").read_text()),
                                                               eos_token_id=999))), "the manifest was edited"),
])
def test_a_damaged_token_folder_is_refused(tmp_path, damage, needle):
    folder = _token_folder(tmp_path)
    damage(folder)
    with pytest.raises(DataError, match=needle):
        data.load_splits(cfg(folder, format="tokens", seq_len=8), byte_tokenizer(), seed=0)


def test_text_and_records_that_are_not_utf8_are_named(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)
    with pytest.raises(DataError, match=r"latin1.txt could not be read as text: it is not UTF-8 .* convert it to UTF-8"):
        data.load_splits(cfg(tmp_path / "latin1.txt", format="text", seq_len=8), byte_tokenizer(), seed=0)
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps({"instruction": "x", "output": "y"}).encode() + b"\n" +
                                            '{"instruction": "caf\xe9", "output": "y"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="latin1.jsonl: a record is not UTF-8 text"):
        data.load_splits(cfg(tmp_path / "latin1.jsonl", format="instruction"), byte_tokenizer(), seed=0)


@pytest.mark.parametrize("fmt,fields", [("prompts", ("prompt", "answer")),
                                        ("preference", ("prompt", "chosen", "rejected")),
                                        ("kto", ("prompt", "completion"))])
def test_prompts_and_preference_records_that_are_not_utf8_are_named(tmp_path, fmt, fields):
    """Arrow decodes a JSON file's strings lazily: prompts and preference data gave a 70-line
    UnicodeDecodeError from their encoding pass; one line, as instruction data's, with the line."""
    good = [{**{f: f"{f} {i}" for f in fields}, **({"label": i % 2 == 0} if fmt == "kto" else {})} for i in range(6)]
    bad = json.dumps({**good[0], fields[-1]: "caf\u00e9"}).replace("\\u00e9", "\xe9").encode("latin-1")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in good[:3]) + bad + b"\n" +
                     b"".join(json.dumps(r).encode() + b"\n" for r in good[3:]))
    column = bad.index(b"\xe9") + 1
    with pytest.raises(DataError, match=rf"^data.path: {path}: a record is not UTF-8 text \(line 4 column {column}: "
                                        r"byte 0xe9\); convert the file to UTF-8 \(e.g. iconv -f latin1 -t utf-8\)$"):
        data.load_splits(cfg(path, format=fmt, seq_len=128, max_prompt_tokens=32), byte_tokenizer(), seed=0,
                         prompt_budget=64 if fmt == "prompts" else None)


def test_a_failing_chat_template_names_the_record_and_the_template(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(SHAREGPT))
    (tmp_path / "raise.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' and "
                                          "m['content'].startswith('Question 3') %}{{ raise_exception('no 3s') }}"
                                          "{% endif %}{% endfor %}")
    with pytest.raises(DataError, match=r"record 3: the chat template failed: TemplateError: no 3s"):
        data.load_splits(cfg(tmp_path / "c.json", template=str(tmp_path / "raise.jinja")), byte_tokenizer(), seed=0)
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ConfigError, match="empty.jinja is empty"):
        data.load_splits(cfg(tmp_path / "c.json", template=str(tmp_path / "empty.jinja")), byte_tokenizer(), seed=0)
    with pytest.raises(ConfigError, match="data.template=alpaca is the Alpaca prompt for instruction records"):
        data.load_splits(cfg(tmp_path / "c.json", template="alpaca"), byte_tokenizer(), seed=0)


def test_an_explicitly_mapped_optional_column_must_exist(tmp_path):
    (tmp_path / "a.csv").write_text("instruction,output\nq1,a1\nq2,a2\nq3,a3\n")
    with pytest.raises(DataError, match="data.columns.input=nosuch names the column 'nosuch', which is missing"):
        data.load_splits(cfg(tmp_path / "a.csv", format="instruction", columns={"input": "nosuch"}), byte_tokenizer(), 0)


def test_samples_cut_before_their_first_target_are_counted_as_such(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(SHAREGPT))
    with pytest.raises(DataError, match=r"truncated 0, dropped as too long 0, cut before their first target token 12, "
                                        r"without an assistant/target token 0\); need at least 2; raise data.seq_len"):
        data.load_splits(cfg(tmp_path / "c.json", seq_len=8), byte_tokenizer(), seed=0)


def test_mixture_weights_must_be_finite():
    from llmtrain.config.validate import validate_data
    from tests.conftest import make_cfg

    c = make_cfg(["data=mix", "data.datasets.0.path=a.json", "data.datasets.1.path=b.json", "data.weights=[inf,1]"])
    with pytest.raises(ConfigError, match=r"data.weights=\[inf, 1.0\] must be finite"):
        validate_data(c.data)
