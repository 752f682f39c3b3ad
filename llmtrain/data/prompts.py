"""Prompts for online RL (``data.format=prompts``): one prompt per record, which the rollout
completes (:mod:`llmtrain.rollout`), and the record's other columns, which reach the reward
functions by name (as TRL passes a dataset's columns).

A prompt is a string or an OpenAI message list (``role``/``content``). A message list is rendered
with the chat template and its generation prompt; a string is too when the tokenizer has a chat
template (``data.template=auto``, or ``chatml`` / a Jinja file), as one user message, or is the
Alpaca prompt's instruction (``data.template=alpaca``); otherwise it is the text itself (TRL's
"standard" prompts). A sample is ``{"prompt_ids": [...], "record": i, **the record}``.

Image prompts (an image-text model): a message-list prompt with ``{"type": "image"}`` parts and an
``images`` column (``data.columns.images`` maps another) of paths relative to the data file's
folder, TRL's conversational vision layout. The prompt's ids have each image placeholder expanded
into the image's tokens (:func:`llmtrain.data.vision.encode_image_prompt`), and the sample's
``images`` holds the absolute paths, which the rollout reads again for generation and for the
policy's forward. Such a prompt's trailing assistant turns are left out (of its ids and of the
``prompt`` the reward functions and the completion logs get): in an SFT-layout file such as the
digits' they hold the reference answer, which the ``answer`` column gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmtrain.common.errors import ConfigError, DataError
from llmtrain.data.formats import alpaca_prompt
from llmtrain.data.sources import column, record_errors
from llmtrain.data.vision import encode_image_prompt, image_paths, images_column
from llmtrain.config.schema import mapped_columns


def render(prompt: Any, tokenizer: Any, template: str, where: str) -> list[int]:
    """The token ids the model is prompted with (see the module).

    Raises:
        DataError: the prompt is neither a string nor a message list, or its template fails.
        ConfigError: a message list and a tokenizer without a chat template.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if template == "alpaca":
            return tokenizer(alpaca_prompt(prompt.strip(), ""), add_special_tokens=False)["input_ids"]
        if not has_template:
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        prompt = [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        raise DataError(f"{where}: the prompt must be a string or a list of {{role, content}} messages, got "
                        f"{type(prompt).__name__}")
    if not has_template:
        raise ConfigError(f"{where}: a message-list prompt needs a chat template, and this tokenizer has none; set "
                          "data.template=chatml or data.template=/path/to/template.jinja")
    try:
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001  (Jinja's errors)
        raise DataError(f"{where}: the chat template failed on this prompt: {err}") from None
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def encode_prompts(records: Any, src: Any, data_cfg: Any, tokenizer: Any, key: str, where: str,
                   budget: int) -> tuple[Any, dict[str, int]]:
    """Every record's prompt as token ids, beside the record's columns.

    ``budget``: the tokens a prompt may have (``data.seq_len`` - ``rollout.max_completion_length``).
    A longer prompt is an error naming it, or (``data.truncation=drop``) dropped and counted: a
    prompt cut short would ask another question.

    Returns:
        (``datasets.Dataset`` of samples, counts ``{"records", "dropped_too_long"}``).

    Raises:
        DataError: a prompt that is empty or too long (naming the record, its length and the
            fixes), not a string or message list, or fewer than 2 usable prompts.
    """
    name = column(records, src, "prompt", key, "prompts", where)
    # Only a mapped answer column must exist: the records need one only for the gsm8k reward,
    # whose start-up check names it (llmtrain.rollout.build_rewards).
    answer = column(records, src, "answer", key, "prompts", where) if "answer" in mapped_columns(src.columns) else None
    drop = data_cfg.truncation == "drop"
    lengths: list[int] = []
    images = images_column(records, src)
    path = Path(str(src.path)).expanduser()
    base = path if path.is_dir() else path.parent  # relative image paths: next to the data file

    def encode(record: dict, index: int) -> dict:
        # Every column decoded now (a lazy row decodes only what is read): a record that is not
        # UTF-8 fails here, named, and not when a reward function reads its answer mid-run.
        record = dict(record)
        paths = image_paths(record.get(images), base, f"{where} record {index}", images) if images else []
        if paths:
            if not isinstance(record[name], list):
                raise DataError(f"{where} record {index}: a prompt with images is a message list with "
                                "{'type': 'image'} parts, one per path of field " + repr(images))
            turns = list(record[name])
            while turns and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant":
                turns.pop()  # the reference answer of an SFT-layout file: not the prompt (logged, rewarded)
            ids = encode_image_prompt(turns, paths, tokenizer, f"{where} record {index}")
            extra = {"images": [str(p) for p in paths], name: turns}
        else:
            ids = render(record[name], tokenizer, str(data_cfg.template), f"{where} record {index}")
            extra = {"images": []} if images else {}
        if not ids:  # nothing to continue from: the model cannot sample a first token
            raise DataError(f"{where} record {index}: the prompt ({name!r}) is empty; give every record a prompt")
        if len(ids) > budget and not drop:
            raise DataError(f"{where} record {index}: the prompt has {len(ids)} tokens, over the {budget} that "
                            f"data.seq_len={data_cfg.seq_len} leaves beside rollout.max_completion_length; raise "
                            "data.seq_len, lower rollout.max_completion_length, or set data.truncation=drop to drop "
                            "such prompts")
        return {"prompt_ids": ids, "record": index, **extra}

    with record_errors(where):  # a record refused names its line; one not UTF-8 names its byte
        encoded = records.map(encode, with_indices=True, desc=f"encode {src.name}")
    lengths = [len(ids) for ids in encoded["prompt_ids"]]
    keep = [i for i, n in enumerate(lengths) if n <= budget]
    samples = encoded.select(keep)
    # The reward functions get each record's columns by their field names (prompt, answer).
    for field, mapped in (("prompt", name), ("answer", answer)):
        if mapped is None or mapped == field:
            continue
        if field in samples.column_names:
            raise DataError(f"{where}: {key}.columns.{field}={mapped} reads the {field} from {mapped!r}, but the "
                            f"records also have a {field!r} column, which the reward functions would get under the "
                            "same name; rename one")
        samples = samples.rename_column(mapped, field)
    counts = {"records": len(records), "dropped_too_long": len(records) - len(keep)}
    if len(records) < 2:
        raise DataError(f"{where}: {len(records)} record(s); online RL needs at least 2 prompts (one to train on, one "
                        "held out)")
    if len(samples) < 2:
        raise DataError(f"{where}: {len(samples)} of {len(records)} prompts fit in {budget} tokens (data.seq_len - "
                        "rollout.max_completion_length); need at least 2 (one to train, one to validate): raise "
                        "data.seq_len or lower rollout.max_completion_length")
    return samples, counts


class PromptCollator:
    """A micro-batch of prompts: the samples themselves, in order (the rollout turns each into its
    group of completions)."""

    def __call__(self, samples: list[dict]) -> dict[str, list[dict]]:
        return {"prompts": list(samples)}
