"""Reward functions of online RL (``reward.functions``, ``reward.weights``).

Each function is called as TRL calls one (``GRPOTrainer``'s ``reward_funcs``)::

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **the data's other columns)

with one entry per completion in every list (a prompt repeated for each of its completions) and
returns one float per completion, or None where it does not apply. A completion is a string, or
``[{"role": "assistant", "content": text}]`` when its prompt is a message list. The reward is
the weighted sum of the functions' values (None counted as 0, as TRL's ``nansum``), each also
logged under its own name.

Built-ins (a name, optionally ``name:argument``):

* ``gsm8k``: 1.0 when the completion's final number equals the ``answer`` column's (the number
  after GSM8K's ``#### `` marker; ``data.columns.answer`` maps a column of another name); the completion's final number is the first after its own
  ``####``, else its last number (:func:`final_number`). With ``math-verify`` installed the two are compared by it.
* ``answer``: 1.0 when the completion's final answer equals the ``answer`` column's (any dataset;
  ``data.columns.answer`` maps a column of another name), else 0.0; None where the record's answer
  is null. The final answer of a text (:func:`final_answer`) is the content of its last
  ``\\boxed{...}``, else what follows its last ``####``, else its last non-empty line. The two
  are compared as numbers when both final answers hold one (each one's last number, commas and
  dollar signs dropped: "7", "7.0", "#### 7" and "The answer is 7." all read 7; equal within
  1e-6), else as strings, stripped of spaces and a trailing period (case kept).
* ``format[:REGEX]``: 1.0 when the completion matches the regular expression (``re.search``;
  default GSM8K's final line ``#### N`` at the end).
* ``length[:CACHE]``: DAPO's soft overlong penalty (Yu et al. 2025, eq. 13): 0 up to
  ``max_completion_length - CACHE`` tokens, then falling linearly to -1 at the limit
  (default CACHE: a quarter of the limit).
* ``model:FOLDER``: a sequence-classification model's score of prompt + completion
  (``AutoModelForSequenceClassification``; llmtrain's ``objective=reward`` export is one).

Model output is text and is never evaluated as code.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.common.errors import ConfigError, did_you_mean, import_object

GSM8K_MARKER = "####"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _number(text: str, index: int = -1) -> float | None:
    match = _NUMBER.findall(text or "")
    if not match:
        return None
    try:
        return float(match[index].replace(",", "").replace("$", ""))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The number a GSM8K-style answer gives: the first number after the last ``####`` (lm-eval's
    gsm8k "strict-match"), else the text's last number ("flexible-extract"); commas and dollar
    signs dropped; None without one."""
    if GSM8K_MARKER in text:
        return _number(text.rsplit(GSM8K_MARKER, 1)[1], index=0)
    return _number(text)


def _text(completion: Any) -> str:
    """A completion's text: itself, or the content of its assistant message."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """The content of the text's last ``\\boxed{...}`` (braces inside balanced), or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for k in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[begin:k]
    return None  # unclosed: no boxed answer


def final_answer(text: str) -> str:
    """A text's final answer, as the ``answer`` reward reads it: the content of its last
    ``\\boxed{...}`` (the MATH convention), else what follows its last ``####`` (GSM8K's), else its
    last non-empty line; stripped of spaces and of one trailing period."""
    text = str(text or "")
    boxed = _last_boxed(text)
    if boxed is not None:
        found = boxed
    elif GSM8K_MARKER in text:
        found = text.rsplit(GSM8K_MARKER, 1)[1]
    else:
        found = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    found = found.strip()
    return found[:-1].rstrip() if found.endswith(".") else found


def answer_matches(completion: str, reference: str) -> bool:
    """Whether ``completion``'s final answer equals ``reference``'s (:func:`final_answer` of each):
    as numbers (each's last number, equal within 1e-6) when both hold one, else as strings."""
    got, expected = final_answer(completion), final_answer(reference)
    got_number, expected_number = _number(got), _number(expected)
    if got_number is not None and expected_number is not None:
        return math.isclose(got_number, expected_number, rel_tol=0, abs_tol=1e-6)
    return got == expected


def answer_reward(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float | None]:
    """The ``answer`` reward: 1.0 where the completion's final answer matches the record's
    ``answer`` (:func:`answer_matches`), else 0.0; None where the record's answer is null."""
    if answer is None:
        return [None] * len(completions)
    return [None if reference is None else float(answer_matches(_text(completion), str(reference)))
            for completion, reference in zip(completions, answer)]


def gsm8k_reward(completions: list[Any], answer: list[str] | None = None, **_: Any) -> list[float | None]:
    """1.0 where the completion's final number equals the reference answer's, else 0.0; None
    where the record has no answer (see the module)."""
    if answer is None:
        return [None] * len(completions)
    try:
        import math_verify
    except ImportError:
        math_verify = None
    out: list[float | None] = []
    for completion, reference in zip(completions, answer):
        expected = final_number(str(reference))
        got = final_number(_text(completion))
        if expected is None:
            out.append(None)
        elif math_verify is not None and got is not None:
            out.append(float(math_verify.verify(math_verify.parse(str(expected)), math_verify.parse(str(got)))))
        else:
            out.append(float(got is not None and math.isclose(got, expected, rel_tol=0, abs_tol=1e-6)))
    return out


def format_reward(completions: list[Any], pattern: str = r"####\s*-?\$?\d[\d,]*(?:\.\d+)?\s*\Z", **_: Any
                  ) -> list[float]:
    """1.0 where ``pattern`` is found in the completion (``re.search``, multi-line), else 0.0; the
    default: GSM8K's ``#### N`` ending the completion."""
    compiled = re.compile(pattern, re.MULTILINE | re.DOTALL)
    return [float(bool(compiled.search(_text(c)))) for c in completions]


def length_penalty(completion_ids: list[list[int]], max_completion_length: int, cache: int | None = None, **_: Any
                   ) -> list[float]:
    """DAPO's soft overlong penalty (eq. 13) of each completion's token count (see the module)."""
    cache = cache if cache is not None else max(1, max_completion_length // 4)
    start = max_completion_length - cache
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / cache) for ids in completion_ids]


class RewardModel:
    """``model:FOLDER``: the first logit of a sequence-classification model on prompt + completion
    and an end token, as llmtrain's ``objective=reward`` trains and scores (its export reads each
    row's last token that is not ``config.pad_token_id``). A message-list prompt is rendered with
    the completion as the assistant's turn through the reward model's chat template (its
    messages' contents joined without one). Scored 16 texts a batch, right-padded."""

    BATCH = 16

    def __init__(self, folder: str, device: torch.device | str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder).to(device).eval()
        self.device = device
        pads = (self.model.config.pad_token_id, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id)
        self.pad = next((p for p in pads if p is not None), 0)

    def _ids(self, prompt: Any, completion: Any) -> list[int]:
        if isinstance(prompt, list):
            turn = completion if isinstance(completion, list) else [{"role": "assistant", "content": _text(completion)}]
            messages = prompt + turn
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            else:
                text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        else:
            text = str(prompt) + _text(completion)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        eos = self.tokenizer.eos_token_id
        return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids

    @torch.no_grad()
    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        rows = [self._ids(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for k in range(0, len(rows), self.BATCH):
            chunk = rows[k:k + self.BATCH]
            longest = max(len(r) for r in chunk)
            ids = torch.tensor([r + [self.pad] * (longest - len(r)) for r in chunk], device=self.device)
            mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in chunk], device=self.device)
            scores += self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores


BUILT_IN = {"answer", "gsm8k", "format", "length", "model"}


@dataclass
class RewardFunction:
    """One of ``reward.functions``: its name as logged (``rewards/NAME/mean``), the callable, its
    weight, and the data columns it cannot score without (a built-in's; checked at start-up)."""

    name: str
    fn: Callable[..., list[Any]]
    weight: float
    columns: tuple[str, ...] = ()


def build(functions: list[str], weights: list[float], max_completion_length: int,
          device: torch.device | str = "cpu") -> list[RewardFunction]:
    """The reward functions ``reward.functions`` names (see the module), with their weights.

    Raises:
        ConfigError: no function, an unknown built-in argument, a ``module:function`` that cannot
            be imported or is not callable, a reward model folder that does not exist, or weights
            that do not match the functions (each naming the field and the fix).
    """
    if not functions:
        raise ConfigError("reward.functions is empty: an online objective needs at least one reward function, e.g. "
                          "reward.functions=[gsm8k] or reward.functions=[my_module:my_reward]")
    if weights and len(weights) != len(functions):
        raise ConfigError(f"reward.weights has {len(weights)} values for {len(functions)} reward.functions; give one "
                          "weight per function (or none: 1 each)")
    built = []
    for k, spec in enumerate(functions):
        name, _, argument = str(spec).partition(":")
        weight = float(weights[k]) if weights else 1.0
        if name == "gsm8k" and not argument:
            built.append(RewardFunction("gsm8k", gsm8k_reward, weight, columns=("answer",)))
        elif name == "answer" and not argument:
            built.append(RewardFunction("answer", answer_reward, weight, columns=("answer",)))
        elif name == "format":
            pattern = argument or None
            try:
                re.compile(pattern or "")
            except re.error as err:
                raise ConfigError(f"reward.functions[{k}]={spec!r}: not a regular expression ({err})") from None
            built.append(RewardFunction("format", partial(format_reward, pattern=pattern) if pattern else format_reward,
                                        weight))
        elif name == "length":
            if argument and not argument.isdigit():
                raise ConfigError(f"reward.functions[{k}]={spec!r}: the argument is the penalty's window in tokens, "
                                  "e.g. length:64")
            cache = int(argument) if argument else None
            if cache is not None and not 0 < cache <= max_completion_length:
                raise ConfigError(f"reward.functions[{k}]={spec!r}: the window must be in 1..rollout.max_completion_"
                                  f"length={max_completion_length}")
            built.append(RewardFunction("length", partial(length_penalty, max_completion_length=max_completion_length,
                                                          cache=cache), weight))
        elif name == "model":
            if not argument or not Path(argument).expanduser().is_dir():
                raise ConfigError(f"reward.functions[{k}]={spec!r}: give a reward model's folder, model:FOLDER (an "
                                  "AutoModelForSequenceClassification, e.g. an objective=reward run's hf/)")
            built.append(RewardFunction("model", RewardModel(str(Path(argument).expanduser()), device), weight))
        else:
            fn = _import(spec, k)
            built.append(RewardFunction(getattr(fn, "__name__", argument), fn, weight))
    seen: dict[str, int] = {}
    for f in built:  # two functions of one name log apart: format, format_1
        count = seen.get(f.name, 0)
        seen[f.name] = count + 1
        if count:
            f.name = f"{f.name}_{count}"
    return built


def _import(spec: str, k: int) -> Callable[..., list[Any]]:
    if ":" not in spec:
        raise ConfigError(f"reward.functions[{k}]={spec!r}: {did_you_mean(spec, BUILT_IN)}it is neither a built-in "
                          f"({', '.join(sorted(BUILT_IN))}) nor module:function")
    fn = import_object(spec, f"reward.functions[{k}]", "importable.module:function (on every rank's Python path)")
    if not callable(fn):
        raise ConfigError(f"reward.functions[{k}]={spec!r} is not callable")
    return fn
