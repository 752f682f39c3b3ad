"""Reward functions and a rollout engine for the online RL tests, importable by every rank as
``tests.grpo_fixtures:NAME`` (the repository root is on each process's path).

A tiny random model's completions rarely satisfy a real checker, so every group would score the
same and train nothing; these rewards depend on the token ids, so groups differ."""

from __future__ import annotations

import os
import random
import time
import zlib

from llmtrain.rollout.engines import PolicySampler, RolloutEngine
from llmtrain.rollout.generate import Completion

EOS = 256  # the byte tokenizer's end token


def odd_tokens(completion_ids, **_):
    """The share of a completion's tokens that are odd ids (0 for an empty completion)."""
    return [sum(t % 2 for t in ids) / len(ids) if ids else 0.0 for ids in completion_ids]


def short(completion_ids, **_):
    """1.0 under 6 tokens, else None (does not apply): exercises None in the weighted sum."""
    return [1.0 if len(ids) < 6 else None for ids in completion_ids]


def answer_seen(completions, answer, **_):
    """1.0 when the completion holds the answer column's number: reads a data column."""
    return [float(a.split("####")[-1].strip() in c) for c, a in zip(completions, answer)]


def scores_nothing(completions, **_):
    """None for every completion: nothing is scorable."""
    return [None] * len(completions)


def raises_at_step_two(completions, completion_ids, **_):
    """Raises on the second training batch of 4 sampled completions it sees (the start-up check's
    placeholders have no ids; a held-out evaluation of 2 prompts has 2 completions)."""
    if len(completions) >= 4 and all(completion_ids):
        raises_at_step_two.calls = getattr(raises_at_step_two, "calls", 0) + 1
        if raises_at_step_two.calls >= 2:
            raise ValueError("checker crashed")
    return [0.5] * len(completions)


def wrong_count(completions, **_):
    return [1.0]


def not_a_number(completions, **_):
    return [float("nan")] * len(completions)


def infinite(completions, **_):
    return [float("inf")] * len(completions)


def text_values(completions, **_):
    """Numbers as text: TRL refuses them too."""
    return ["0.5"] * len(completions)


def numpy_values(completion_ids, **_):
    """A numpy array of float32, as a vectorised checker returns (TRL takes it)."""
    import numpy as np

    return np.array([len(ids) % 3 for ids in completion_ids], dtype=np.float32)


def fixed_completion(prompt_ids: list[int], index: int, max_length: int) -> list[int]:
    """Completion ``index`` of a prompt: random bytes seeded by the prompt and the index; about
    two in three end with EOS before ``max_length``, the others are cut at it. A prompt with ids
    past a byte (an image-text model's image tokens) is keyed by two bytes an id."""
    key = bytes(prompt_ids) if max(prompt_ids, default=0) < 256 else b"".join(t.to_bytes(2, "little") for t in prompt_ids)
    rng = random.Random(zlib.crc32(key + bytes([index])))
    if rng.random() < 0.65:
        return [rng.randrange(256) for _ in range(rng.randint(0, max_length - 2))] + [EOS]
    return [rng.randrange(256) for _ in range(max_length)]


class FixedCompletions(RolloutEngine):
    """``rollout.engine=tests.grpo_fixtures:FixedCompletions``: :func:`fixed_completion` for
    each seed, so a test hands TRL's ``GRPOTrainer`` (its ``rollout_func``) the same completions."""

    def sample(self, policy, samples, seeds):
        out = []
        for sample in samples:
            group = []
            for k in range(len(seeds[len(out)])):
                ids = fixed_completion(list(sample["prompt_ids"]), k, self.sampling.max_new)
                group.append(Completion(ids, truncated=ids[-1] != EOS))
            out.append(group)
        return out


class ScriptedCalculator(RolloutEngine):
    """``rollout.engine=tests.grpo_fixtures:ScriptedCalculator`` with ``rollout.environment=calculator``:
    plays the model's side of a calculator episode from the prompt "What is A+B?" (the byte
    tokenizer's text). First turn: a ``<calc>`` call, malformed (``A plus B``) for one seed in
    three; next turn, after the environment's ``<result>``: ``#### N`` and the end token, N the
    result (wrong by one for odd seeds). A turn never ends past ``max_new`` tokens."""

    def sample(self, policy, samples, seeds):
        out = []
        for sample, row in zip(samples, seeds):
            text = self.tokenizer.decode(list(sample["prompt_ids"]), skip_special_tokens=True)
            a, b = text.rsplit("What is ", 1)[1].split("?")[0].split("+")
            group = []
            for seed in row:
                seed = 0 if seed is None else seed
                if "<result>" not in text:
                    turn = f"<calc>{a} plus {b}</calc>" if seed % 3 == 0 else f"<calc>{a}+{b}</calc>"
                    ids = list(self.tokenizer(turn, add_special_tokens=False)["input_ids"])
                else:
                    result = text.rsplit("<result>", 1)[1].split("</result>")[0]
                    answer = str(int(result) + seed % 2) if result.isdigit() else "0"
                    ids = list(self.tokenizer(f"#### {answer}", add_special_tokens=False)["input_ids"]) + [EOS]
                cut = ids[:self.sampling.max_new]
                group.append(Completion(cut, truncated=len(cut) < len(ids)))
            out.append(group)
        return out


def constant(completions, **_):
    """0.5 for every completion: no group has any spread, so no step trains anything."""
    return [0.5] * len(completions)


class SlowPolicySampler(PolicySampler):
    """``rollout.engine=tests.grpo_fixtures:SlowPolicySampler``: the ``hf`` engine (the same
    completions), whose model forwards each sleep 1 s from its call number
    ``$LLMTRAIN_TEST_SLOW_FROM`` on (unset: never), so that a step samples for about 10 s, as a
    CPU's real sampling takes minutes; the first slow forward of rank ``$LLMTRAIN_TEST_MARKER_RANK``
    (default 0) writes the file ``$LLMTRAIN_TEST_SAMPLING_MARKER`` (``call N pid P``): that rank's
    step has started decoding."""

    calls = 0

    def sample(self, policy, samples, seeds):
        self.calls += 1
        slow_from = int(os.environ.get("LLMTRAIN_TEST_SLOW_FROM", "0"))
        if not slow_from or self.calls < slow_from:
            return super().sample(policy, samples, seeds)
        marker = os.environ.get("LLMTRAIN_TEST_SAMPLING_MARKER")
        if os.environ.get("RANK", "0") != os.environ.get("LLMTRAIN_TEST_MARKER_RANK", "0"):
            marker = None

        def slow(*_):
            if marker and not os.path.exists(marker):
                with open(marker, "w", encoding="utf-8") as file:
                    file.write(f"call {self.calls} pid {os.getpid()}\n")
            time.sleep(1.0)

        handle = policy.model.register_forward_pre_hook(slow)
        try:
            return super().sample(policy, samples, seeds)
        finally:
            handle.remove()
