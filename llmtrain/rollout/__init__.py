"""Online RL's rollouts: completions sampled from the policy under its layout (:mod:`.engines`,
:mod:`.generate`, seeded per completion), scored by reward functions (:mod:`.rewards`), and laid
out as the objective's training micro-batches with group-relative advantages (:mod:`.rollout`).

Sits beside the engines (it drives an engine's ``generation_model`` and ``forward`` without
importing one): may import objectives, data, parallel's process-group helpers, config and common;
never engines, models or parallel plans (``.importlinter``).
"""

from __future__ import annotations

from typing import Any

from llmtrain.common.errors import ConfigError, import_object
from llmtrain.common.images import image_token_id, processor_of
from llmtrain.config.schema import mapped_columns
from llmtrain.rollout import rewards
from llmtrain.rollout.engines import PolicySampler, RolloutEngine
from llmtrain.rollout import environments, verifiers_env
from llmtrain.rollout.environments import Environment
from llmtrain.rollout.generate import Sampling, SamplingInterrupted
from llmtrain.rollout.rollout import Rollout
from llmtrain.rollout.scoring import RewardError, score
from llmtrain.rollout.vllm_engine import VLLMEngine

__all__ = ["Environment", "Rollout", "RolloutEngine", "RewardError", "SamplingInterrupted", "build_environment",
           "build_rewards", "build_rollout_engine", "build_sampler", "check_answers", "environment_reward"]

ENGINES: dict[str, type[RolloutEngine]] = {"hf": PolicySampler, "vllm": VLLMEngine}


def build_rewards(cfg: Any, samples: list[dict], device: Any = "cpu", answers: list[Any] | None = None
                  ) -> list[rewards.RewardFunction]:
    """``reward.functions`` built and tried once on ``samples`` (two prompts of the data, each with
    two placeholder completions, ``""`` and ``"0"``), so that a function that cannot be imported,
    raises, returns another number of values or a value that is not a finite number fails before
    anything is written. ``answers``: the ``answer`` column of the data's first records (default:
    the samples'), which the ``gsm8k`` reward needs a number in (:func:`check_answers`).

    Raises:
        ConfigError: a function that cannot be built (:func:`rewards.build`), a built-in whose
            column the data lacks (``gsm8k`` without ``answer``, which ``data.columns.answer``
            maps), or ``gsm8k`` with answers that hold no number.
        RewardError: a function failed the check (naming it and what it returned).
    """
    functions = rewards.build(list(cfg.reward.functions), list(cfg.reward.weights), int(cfg.rollout.max_completion_length),
                              device)
    prompts, completions, ids, columns = [], [], [], {}
    extra = [k for k in samples[0] if k not in ("prompt", "prompt_ids", "record")] if samples else []
    for k, f in enumerate(functions):
        missing = [c for c in f.columns if c not in extra]
        if missing and samples:  # it would score nothing: every reward None, every advantage 0
            raise ConfigError(f"reward.functions[{k}]={f.name} reads each record's {missing[0]!r} column, which the "
                              f"records of data.path do not have (theirs: {', '.join(extra) or 'none'} besides the "
                              f"prompt); map the column holding them with data.columns.{missing[0]}=YOUR_COLUMN")
        if f.fn is rewards.gsm8k_reward and samples:  # the answer reward takes any string
            check_answers(k, cfg, answers if answers is not None else [s.get("answer") for s in samples])
    for sample in samples:
        for text in ("", "0"):
            prompts.append(sample["prompt"])
            completions.append([{"role": "assistant", "content": text}] if isinstance(sample["prompt"], list) else text)
            ids.append([])
            for key in extra:
                columns.setdefault(key, []).append(sample.get(key))
    score(functions, prompts, completions, ids, columns,
          "in the start-up check (2 prompts of the data, each with placeholder completions '' and '0')")
    return functions


def check_answers(k: int, cfg: Any, answers: list[Any]) -> None:
    """The ``gsm8k`` reward (``reward.functions[k]``) scores a completion against the number its
    record's answer gives (:func:`rewards.final_number`, as the reward reads it); when no answer of
    ``answers`` (the data's first records) gives one, every completion would score None and the
    run would train nothing: refused.

    Raises:
        ConfigError: naming ``data.columns.answer``, the column, an answer read and what one
            looks like.
    """
    if any(rewards.final_number(str(a)) is not None for a in answers if a is not None):
        return
    sources = [(f"data.datasets.{i}", src) for i, src in enumerate(cfg.data.datasets)] if cfg.data.datasets else \
        [("data", cfg.data)]
    column = ", ".join(f"{key}.columns.answer={mapped_columns(src.columns).get('answer', 'answer')}"
                       for key, src in sources)
    first = next((repr(a) for a in answers if a is not None), "null")
    shown = first if len(first) <= 60 else first[:57] + "..."
    raise ConfigError(f"reward.functions[{k}]=gsm8k: no answer of the first {len(answers)} records, read from "
                      f"{column}, holds a number (e.g. {shown}), so every completion would score None and nothing "
                      "would train; map the column holding the reference answers, each ending in its number as "
                      "GSM8K's '#### 42'")


def build_environment(cfg: Any) -> Environment | None:
    """``rollout.environment``'s environment (:func:`llmtrain.rollout.environments.build_environment`),
    a verifiers one for ``verifiers:ENV_ID`` and for a ``module:function`` returning one
    (:mod:`llmtrain.rollout.verifiers_env`).

    Raises:
        ConfigError: an environment that cannot be built, naming ``rollout.environment``.
    """
    spec = str(cfg.rollout.get("environment", "") or "")
    if spec.startswith(verifiers_env.PREFIX):
        return verifiers_env.load(cfg, spec)
    return environments.build_environment(cfg, adapt=verifiers_env.adapt)


def environment_reward() -> rewards.RewardFunction:
    """The multi-turn environment's summed reward of each episode as a reward function named
    ``environment`` (weight 1; None where the environment gave none), read from the
    ``environment_reward`` column the rollout adds for it."""
    return rewards.RewardFunction("environment", lambda environment_reward, **_: list(environment_reward), 1.0)


def build_sampler(cfg: Any, tokenizer: Any, end_ids: list[int]) -> RolloutEngine:
    """``rollout.engine``'s sampler with the ``rollout`` section's sampling fields, ending
    completions at ``end_ids`` (the tokenizer's end tokens) and ``rollout.stop``, never sampling
    an image-text model's image token (:class:`Sampling`'s ``suppress``).

    Raises:
        ConfigError: an engine that cannot be built (:func:`build_rollout_engine`).
    """
    r = cfg.rollout
    processor = processor_of(tokenizer)
    image_token = image_token_id(processor) if processor is not None else None
    sampling = Sampling(temperature=float(r.temperature), top_k=int(r.top_k), top_p=float(r.top_p),
                        max_new=int(r.max_completion_length), end_ids=frozenset(end_ids), stop=tuple(r.stop),
                        suppress=frozenset([image_token] if image_token is not None else []))
    return build_rollout_engine(cfg, tokenizer, sampling)


def build_rollout_engine(cfg: Any, tokenizer: Any, sampling: Sampling) -> RolloutEngine:
    """The engine ``rollout.engine`` names (see the module).

    Raises:
        ConfigError: an unknown name, or a ``module:Class`` that cannot be imported or is not a
            :class:`RolloutEngine`.
    """
    spec = str(cfg.rollout.engine)
    if spec in ENGINES:
        return ENGINES[spec](cfg, tokenizer, sampling)
    if ":" not in spec:
        raise ConfigError(f"rollout.engine={spec!r} is neither a built-in engine ({', '.join(ENGINES)}) nor "
                          "module:Class")
    cls = import_object(spec, "rollout.engine", "importable.module:Class")
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise ConfigError(f"rollout.engine={spec!r} is not a subclass of llmtrain.rollout.engines.RolloutEngine")
    return cls(cfg, tokenizer, sampling)
