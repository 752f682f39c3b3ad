"""Records -> training samples: instruction, chat and prompt/completion encoders, chat templates
and the end-of-turn token.

A sample is ``{"input_ids": list[int], "labels": list[int]}`` (same length, at most ``seq_len``);
labels are -100 where no loss is taken. Chat conversations are rendered with the tokenizer's
chat template and tokenized exactly as ``tokenizer.apply_chat_template(messages, tokenize=True)``
does, so the token ids equal the tokenizer's own rendering; the loss is on every assistant turn up
to and including its end-of-turn token, and on nothing else (see :class:`ChatEncoder`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from llmtrain.config.schema import canonical_format
from llmtrain.data.sources import column, record_errors
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.labels import IGNORE_INDEX

log = logging.getLogger("llmtrain")

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. Write a response that "
    "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}"
    "### Response:\n"
)


def alpaca_prompt(instruction: str, context: str = "") -> str:
    """The Alpaca prompt (``data.template=alpaca``) of an instruction and its optional input."""
    return ALPACA_PROMPT.format(with_input=", paired with an input that provides further context" if context else "",
                                instruction=instruction, input_block=f"### Input:\n{context}\n\n" if context else "")


# ChatML (as in Qwen and SmolLM2): `data.template=chatml` for tokenizers without a template.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NAMED_TEMPLATES = {"chatml": CHATML}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MESSAGE_ROLES = ("system", "user", "assistant")


def apply_template_setting(data_cfg: Any, tokenizer: Any) -> Any:
    """Install ``data.template`` on ``tokenizer`` when it names a template (``chatml``) or a Jinja
    file; the exported tokenizer then carries the template training used. Returns ``tokenizer``."""
    template = str(data_cfg.template)
    if template in NAMED_TEMPLATES:
        tokenizer.chat_template = NAMED_TEMPLATES[template]
    elif template.endswith((".jinja", ".j2")):
        text = Path(template).expanduser().read_text(encoding="utf-8")
        if not text.strip():
            raise ConfigError(f"data.template={template} is empty; give a Jinja chat template")
        tokenizer.chat_template = text
    return tokenizer


def uses_chat_template(data_cfg: Any, fmt: str, tokenizer: Any) -> bool:
    """Whether samples of format ``fmt`` are rendered with the chat template.

    Raises:
        ConfigError: the format needs a chat template and the tokenizer has none (names
            ``data.template`` and its values).
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if fmt == "chat" and data_cfg.template == "alpaca":
        raise ConfigError("data.template=alpaca is the Alpaca prompt for instruction records; data.format=chat needs a "
                          "chat template: data.template=auto (the tokenizer's), chatml, or a .jinja file")
    kind = canonical_format(fmt)
    if kind == "chat" or (kind == "instruction" and data_cfg.template == "chat"):
        if not has:
            raise ConfigError(
                f"data.format={fmt} renders conversations with a chat template, and this tokenizer has none. "
                "Set data.template=chatml (the built-in ChatML template) or data.template=/path/to/template.jinja"
                + ("" if fmt == "chat" else ", or data.template=alpaca for the Alpaca prompt"))
        return True
    return kind == "instruction" and data_cfg.template != "alpaca" and has


def render(tokenizer: Any, messages: list[dict], generation_prompt: bool, where: str) -> str:
    """``apply_chat_template(..., tokenize=False)``; a template that fails is a data error.

    Raises:
        DataError: the template raised (names ``where`` and the template's message).
    """
    return _apply_template(tokenizer, messages, where, tokenize=False, add_generation_prompt=generation_prompt)


def _apply_template(tokenizer: Any, messages: list[dict], where: str, **kwargs: Any) -> Any:
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as err:  # noqa: BLE001 - jinja2's TemplateError and whatever a template raises
        if type(err).__module__.split(".")[0] != "jinja2" and not isinstance(err, (TypeError, ValueError)):
            raise
        raise DataError(f"{where or 'data.template'}: the chat template failed: {type(err).__name__}: {err} "
                        "(check data.template)") from err


def end_of_turn(tokenizer: Any) -> tuple[str | None, int | None]:
    """The token the chat template closes an assistant turn with (``<|im_end|>`` for ChatML), as
    (text, id), found by rendering a probe conversation; (None, None) when the template closes a
    turn with ordinary text only."""
    probe = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "XYZZY"}]
    full = render(tokenizer, probe, False, "data.template (rendering a probe user/assistant exchange)")
    if "XYZZY" not in full:
        raise DataError("data.template: the chat template does not render an assistant message's content, so no "
                        "turn can be trained; use a template that renders every message")
    after = full[full.rindex("XYZZY") + len("XYZZY"):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if ids and ids[0] in special:
        return tokenizer.decode([ids[0]]), ids[0]
    return None, None


def end_token_ids(data_cfg: Any, tokenizer: Any) -> list[int]:
    """Every token training teaches as the end of a response: the chat template's end-of-turn
    token (when samples or online-RL prompts go through the template) and the tokenizer's EOS.
    Sampling (``objective=grpo``) stops a completion at any of them, and the exported
    ``generation_config.json`` stops on all of them."""
    sources = list(data_cfg.datasets) or [data_cfg]
    ends: list[int] = []
    if any(_ends_turns(data_cfg, s.format, tokenizer) for s in sources):
        eot = end_of_turn(tokenizer)[1]
        if eot is not None:
            ends.append(eot)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ends:
        ends.append(tokenizer.eos_token_id)
    return ends


def _ends_turns(data_cfg: Any, fmt: str, tokenizer: Any) -> bool:
    """Whether responses to samples of format ``fmt`` end with the chat template's end-of-turn:
    chat and instruction data rendered with the template, and online-RL prompts
    (:mod:`llmtrain.data.prompts`), which the template renders with its generation prompt whenever
    the tokenizer has one (not with ``data.template=alpaca``); a sampled completion then ends at
    the end-of-turn, as the same model's supervised answers do."""
    kind = canonical_format(fmt)
    if kind == "prompts":
        return data_cfg.template != "alpaca" and bool(getattr(tokenizer, "chat_template", None))
    return kind in ("chat", "instruction") and uses_chat_template(data_cfg, fmt, tokenizer)


# ``{% generation %}`` (with any whitespace control): transformers' mark of assistant text.
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Stands in for an opening assistant turn's content, to find where the template puts it.
CONTENT_PROBE = "LLMTRAIN-CONTENT-PROBE-8c1f"


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}`` ...
    ``{% endgeneration %}``, the markers that transformers'
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` turns into a token mask (for
    a template without them that mask is all zeros)."""
    chat_template = getattr(tokenizer, "chat_template", None)
    if isinstance(chat_template, dict):  # named templates: a conversation without tools uses "default"
        chat_template = chat_template.get("default")
    return isinstance(chat_template, str) and GENERATION_MARKER.search(chat_template) is not None


def template_name(data_cfg: Any, tokenizer: Any) -> str:
    """How messages name the chat template in use: ``data.template=VALUE`` when that setting
    installed it (a named template or a Jinja file), else the tokenizer's own template."""
    setting = str(data_cfg.template)
    if setting in NAMED_TEMPLATES or setting.endswith((".jinja", ".j2")):
        return f"data.template={setting}"
    return f"{_own_template(tokenizer)} (data.template={setting})"


def _own_template(tokenizer: Any) -> str:
    return f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '') or '(unnamed)'}"


class ChatEncoder:
    """Tokenizes conversations with the chat template and labels every assistant turn: an
    assistant turn's text and the end-of-turn token closing it are trained, nothing else, whatever
    role opens the conversation.

    The token ids are ``apply_chat_template(messages, tokenize=True)``'s. Which are trained:

    * a template with ``{% generation %}`` markers: the template's own assistant mask
      (transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``), plus the
      end-of-turn token right after a marked run when the markers leave it out;
    * otherwise prefix differences. Assistant turn j starts where the rendering of turns 0..j-1
      with a generation prompt ends; an opening turn (j = 0) has no such prefix (rendering none
      gives ``""``, which would put a template's injected system prompt and the turn's header in
      the span: the kind of bug TRL PR #3224 fixed), so it starts where the template puts its content: the
      text before a probe string rendered in its place. The turn ends with the last end-of-turn
      token of the rendering of turns 0..j (or where that rendering ends, for a template closing
      turns with ordinary text). Tokens starting inside a turn's span are trained. Both renderings
      must agree with the whole conversation's rendering up to there; a template that renders a
      turn differently inside the conversation than as its last message (Qwen3 drops
      ``<think>...</think>`` from turns before the last user message; TRL issue #4147, PR #4201)
      has no such spans, and is refused unless it has generation markers.
    """

    def __init__(self, tokenizer: Any, template: str = ""):
        """``template``: how error messages name the chat template (see :func:`template_name`);
        default: the tokenizer's. Raises DataError as :func:`end_of_turn` does."""
        self.tokenizer = tokenizer
        self.template = template or _own_template(tokenizer)
        self.eot_text, self.eot_id = end_of_turn(tokenizer)
        self.marked = has_generation_markers(tokenizer)

    def __call__(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        """Token ids and labels of one conversation (``[{"role", "content"}]``): two lists of the
        same length, labels -100 outside assistant turns.

        Raises:
            DataError: the template failed, or it has no generation markers and renders an
                assistant turn or its context differently inside the whole conversation (names
                ``where``, the template and the fix).
        """
        if self.marked:
            return self._template_mask(messages, where)
        full = render(self.tokenizer, messages, False, where)
        spans = [self._span(messages, j, full, where) for j, turn in enumerate(messages) if turn["role"] == "assistant"]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        labels, k = [], 0
        for token, (start, _) in zip(enc["input_ids"], enc["offset_mapping"]):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            labels.append(token if k < len(spans) and spans[k][0] <= start < spans[k][1] else IGNORE_INDEX)
        return list(enc["input_ids"]), labels

    def _span(self, messages: list[dict], j: int, full: str, where: str) -> tuple[int, int]:
        """Characters of ``full`` that assistant turn ``j`` writes (see the class docstring)."""
        if j == 0:
            probe = render(self.tokenizer, [{**messages[0], "content": CONTENT_PROBE}, *messages[1:]], False, where)
            if CONTENT_PROBE not in probe:
                raise self._refuse(where, f"does not render assistant turn {j}'s content as given")
            prefix = probe[:probe.index(CONTENT_PROBE)]
        else:
            prefix = render(self.tokenizer, messages[:j], True, where)
        if not full.startswith(prefix):
            raise self._refuse(where, f"renders the turns before assistant turn {j} differently inside the whole "
                               "conversation")
        turn = render(self.tokenizer, messages[:j + 1], False, where)
        end = len(turn)
        if self.eot_text is not None:
            close = turn.rfind(self.eot_text, len(prefix), end)
            end = close + len(self.eot_text) if close >= 0 else end
        if end < len(prefix) or full[:end] != turn[:end]:
            raise self._refuse(where, f"renders assistant turn {j} differently inside the whole conversation than as "
                               "its last message")
        return len(prefix), end

    def _refuse(self, where: str, how: str) -> DataError:
        return DataError(
            f"{where}: {self.template} {how} (it re-renders earlier turns, as Qwen3's template drops <think> blocks "
            "from turns before the last user message), so the turn's tokens cannot be located, and the template has "
            "no {% generation %} markers. Set data.template to a .jinja copy of the template with "
            "{% generation %}...{% endgeneration %} around what the assistant writes (transformers' "
            "return_assistant_tokens_mask reads them), or to a template that renders each turn the same wherever "
            "it stands")

    def _template_mask(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        enc = _apply_template(self.tokenizer, messages, where, tokenize=True, return_dict=True,
                              return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        labels = [token if m or (token == self.eot_id and t > 0 and mask[t - 1]) else IGNORE_INDEX
                  for t, (token, m) in enumerate(zip(ids, mask))]
        return ids, labels


def conversation(record: dict, field: str, layout: str, where: str) -> list[dict]:
    """A record's turns as ``[{"role", "content"}]`` with roles system/user/assistant.

    ``layout``: ``messages`` (OpenAI role/content) or ``sharegpt`` (from/value, human/gpt/system).

    Raises:
        DataError: not a list of turns, a turn with an unknown role or non-string content (names
            the record, the turn index and the field).
    """
    turns = record[field]
    if not isinstance(turns, list):
        raise DataError(f"{where}: field {field!r} must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise DataError(f"{where}: field {field!r} is an empty conversation (no turns)")
    role_key, text_key = ("role", "content") if layout == "messages" else ("from", "value")
    allowed = MESSAGE_ROLES if layout == "messages" else tuple(SHAREGPT_ROLES)
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise DataError(f"{where} turn {j}: a {layout} turn needs the keys {role_key!r} and {text_key!r}, got "
                            f"{sorted(turn) if isinstance(turn, dict) else type(turn).__name__}")
        role, text = turn[role_key], turn[text_key]
        if role not in allowed:
            raise DataError(f"{where} turn {j}: {role_key}={role!r} is not a known role; expected one of "
                            f"{', '.join(allowed)}")
        if not isinstance(text, str):
            raise DataError(f"{where} turn {j}: {text_key!r} must be a string, got {type(text).__name__}")
        out.append({"role": role if layout == "messages" else SHAREGPT_ROLES[role], "content": text})
    return out


def chat_field(records: Any, src: Any, key: str, where: str) -> tuple[str, str]:
    """(column, layout) of a chat source: ``chat_layout`` or, when ``auto``, whichever of the
    ``messages`` and ``conversations`` columns is present."""
    from llmtrain.config.schema import mapped_columns

    mapped = mapped_columns(src.columns)
    if src.chat_layout == "messages" or (src.chat_layout == "auto" and "conversations" not in mapped and (
            "messages" in mapped or "messages" in records.column_names)):
        return column(records, src, "messages", key, "chat (messages layout)", where), "messages"
    if src.chat_layout == "sharegpt" or mapped.get("conversations", "conversations") in records.column_names:
        return column(records, src, "conversations", key, "chat (sharegpt layout)", where), "sharegpt"
    raise DataError(f"{where}: format chat reads a 'messages' (OpenAI role/content) or 'conversations' (ShareGPT "
                    f"from/value) column; its columns are {list(records.column_names)}. Map yours with "
                    f"{key}.columns.messages=COLUMN or {key}.columns.conversations=COLUMN")


def _text(record: dict, name: str, where: str, optional: bool = False) -> str:
    value = record.get(name)
    if value is None and optional:
        return ""
    if value is None:
        raise DataError(f"{where}: field {name!r} is missing (null)")
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def encoder(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str):
    """A function ``(record, index) -> (input_ids, labels) | None`` for the source's format; None
    means the record has nothing to train on (a conversation without an assistant turn)."""
    fmt = canonical_format(src.format)
    eos = tokenizer.eos_token_id
    if fmt == "chat":
        field, layout = chat_field(records, src, key, where)
        uses_chat_template(data_cfg, "chat", tokenizer)
        chat = ChatEncoder(tokenizer, template_name(data_cfg, tokenizer))

        def encode_chat(rec: dict, i: int):
            turns = conversation(rec, field, layout, f"{where} record {i}")
            if not any(t["role"] == "assistant" for t in turns):
                return None
            return chat(turns, f"{where} record {i}")
        return encode_chat
    if fmt == "instruction":
        cols = {f: column(records, src, f, key, "instruction", where) for f in ("instruction", "output")}
        from llmtrain.config.schema import mapped_columns

        # Optional, unless named: a column the user maps must exist.
        input_col = (column(records, src, "input", key, "instruction", where)
                     if "input" in mapped_columns(src.columns) else "input")
        use_chat = uses_chat_template(data_cfg, fmt, tokenizer)
        chat = ChatEncoder(tokenizer, template_name(data_cfg, tokenizer)) if use_chat else None

        def encode_instruction_record(rec: dict, i: int):
            at = f"{where} record {i}"
            instruction = _text(rec, cols["instruction"], at).strip()
            context = _text(rec, input_col, at, optional=True).strip()
            output = _text(rec, cols["output"], at).strip()
            if chat is not None:
                content = instruction + (f"\n\n{context}" if context else "")
                return chat([{"role": "user", "content": content}, {"role": "assistant", "content": output}], at)
            return prompt_and_response(tokenizer, alpaca_prompt(instruction, context), output, eos)
        return encode_instruction_record
    if fmt == "prompt_completion":
        cols = {f: column(records, src, f, key, "prompt_completion", where) for f in ("prompt", "completion")}

        def encode_prompt_completion(rec: dict, i: int):
            at = f"{where} record {i}"
            return prompt_and_response(tokenizer, _text(rec, cols["prompt"], at), _text(rec, cols["completion"], at), eos)
        return encode_prompt_completion
    raise ValueError(f"no record encoder for format {src.format}")


def prompt_and_response(tokenizer: Any, prompt: str, response: str, eos: int) -> tuple[list[int], list[int]]:
    """Prompt tokens (label -100) followed by response tokens and EOS (trained). EOS is appended
    as an id, so its label survives even when the pad token is EOS."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def fit_to_length(encoded: tuple[list[int], list[int]] | None, seq_len: int, drop_long: bool
                  ) -> tuple[list[int], list[int], str]:
    """Apply ``data.truncation`` to one encoded sample (None: nothing to train on).

    Returns:
        (ids, labels, outcome): outcome ``kept`` or ``truncated`` (the sample is used), or
        ``dropped_too_long`` (``drop`` mode), ``dropped_truncated_away`` (cut before its first
        target token) or ``dropped_no_target`` (never had one); dropped samples have empty lists.
    """
    if encoded is None:
        return [], [], "dropped_no_target"
    ids, labels = encoded
    outcome = "kept"
    if len(ids) > seq_len:
        if drop_long:
            return [], [], "dropped_too_long"
        outcome, ids, labels = "truncated", ids[:seq_len], labels[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return [], [], "dropped_truncated_away" if outcome == "truncated" else "dropped_no_target"
    return ids, labels, outcome


def encode_records(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str):
    """Encode every record of a source into samples, truncating (``data.truncation=right``) or
    dropping (``drop``) samples over ``data.seq_len``; samples without a target token are dropped.

    Returns:
        (``datasets.Dataset`` of ``input_ids``/``labels``, counts ``{"records", "truncated",
        "dropped_too_long", "dropped_truncated_away", "dropped_no_target"}``, see
        :func:`fit_to_length`).

    Raises:
        DataError: a malformed record (names file, record index and field), or no usable sample.
    """
    encode = encoder(records, src, data_cfg, tokenizer, key, where)
    seq_len, drop_long = data_cfg.seq_len, data_cfg.truncation == "drop"

    def encode_batch(batch: dict, indices: list[int]) -> dict:
        out: dict[str, list] = {"input_ids": [], "labels": [], "outcome": []}
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        for rec, i in zip(rows, indices):
            ids, labels, outcome = fit_to_length(encode(rec, i), seq_len, drop_long)
            out["outcome"].append(outcome)
            out["input_ids"].append(ids)
            out["labels"].append(labels)
        return out

    with record_errors(where):  # a record refused names its line; one not UTF-8 names its byte
        encoded = records.map(encode_batch, batched=True, with_indices=True, remove_columns=records.column_names,
                              num_proc=data_cfg.num_proc if 1 < data_cfg.num_proc <= len(records) // 2 else None,
                              desc=f"encode {src.name}")
    outcomes = encoded["outcome"]
    counts = {"records": len(records)}
    for kind in ("truncated", "dropped_too_long", "dropped_no_target", "dropped_truncated_away"):
        counts[kind] = outcomes.count(kind)
    keep = [i for i, o in enumerate(outcomes) if o in ("kept", "truncated")]
    samples = encoded.select(keep).remove_columns("outcome")
    if len(samples) < 2:
        raise DataError(f"{where}: {len(samples)} of {len(records)} records give a usable sample at "
                        f"data.seq_len={seq_len} (truncated {counts['truncated']}, dropped as too long "
                        f"{counts['dropped_too_long']}, cut before their first target token "
                        f"{counts['dropped_truncated_away']}, without an assistant/target token "
                        f"{counts['dropped_no_target']}); need at least 2"
                        + ("; raise data.seq_len" if counts["dropped_truncated_away"] + counts["dropped_too_long"] else ""))
    return samples, counts
