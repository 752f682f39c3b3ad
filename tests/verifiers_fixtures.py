"""Locally defined verifiers environments for ``tests/test_verifiers_env.py`` (no hub, no
client): ``rollout.environment=tests.verifiers_fixtures:single_turn`` (a ``vf.SingleTurnEnv``)
and ``...:multi_turn`` (a ``vf.MultiTurnEnv`` subclass that answers each wrong reply and stops
once the reply holds the answer)."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

SYSTEM = "Answer with the number."


def _dataset():
    return Dataset.from_list([{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)])


def digit_share(completion, parser, **_) -> float:
    """The share of digits in the parsed answer (partial credit, so groups' rewards differ)."""
    text = parser.parse_answer(completion) or ""
    return sum(c.isdigit() for c in text) / max(1, len(text))


def exact(completion, answer, parser, **_) -> float:
    return float((parser.parse_answer(completion) or "").strip() == answer)


def rubric() -> vf.Rubric:
    return vf.Rubric(funcs=[digit_share, exact], weights=[1.0, 0.5], parser=vf.Parser())


def single_turn() -> vf.SingleTurnEnv:
    return vf.SingleTurnEnv(dataset=_dataset(), system_prompt=SYSTEM, parser=vf.Parser(), rubric=rubric())


def feedback(turn: int) -> str:
    """The environment's answer after the model's turn ``turn`` (1, 2, ...)."""
    return f"No, try again (turn {turn})."


class Guess(vf.MultiTurnEnv):
    """Answers each reply without the answer with :func:`feedback`; done once a reply holds it."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=feedback(len(state["trajectory"])))]

    @vf.stop
    async def answered(self, state, **kwargs) -> bool:
        if not state["trajectory"]:
            return False
        return state["answer"] in (self.parser.parse_answer(state["trajectory"][-1]["completion"]) or "")


def multi_turn() -> Guess:
    return Guess(dataset=_dataset(), system_prompt=SYSTEM, parser=vf.Parser(), rubric=rubric(), max_turns=3)


def feedback_text() -> str:
    """Not an environment (a factory's wrong return, for the refusal test)."""
    return feedback(1)


def load_environment(**kwargs) -> Guess:
    """What ``vf.load_environment("verifiers_fixtures")`` calls: ``rollout.environment=verifiers:verifiers_fixtures``
    (with ``tests/`` on the Python path, as an installed environment package would be)."""
    return multi_turn()


class Broken(Guess):
    """``env_response`` raises: a plain exception (``vf_error=False``) or a verifiers error."""

    def __init__(self, vf_error: bool, **kwargs):
        super().__init__(**kwargs)
        self.vf_error = vf_error

    async def env_response(self, messages, state, **kwargs):
        raise (vf.Error if self.vf_error else KeyError)("the tool is down")


def broken(vf_error: bool) -> Broken:
    return Broken(vf_error, dataset=_dataset(), system_prompt=SYSTEM, parser=vf.Parser(), rubric=rubric(), max_turns=3)
