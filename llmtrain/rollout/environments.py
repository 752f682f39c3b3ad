"""Multi-turn episodes (``rollout.environment``): the model writes a turn, an environment answers
it (a tool's output), the model continues with that answer in its context, until it ends its
completion, the environment says done, ``rollout.max_turns`` turns are written, or the episode
fills ``rollout.max_completion_length`` tokens.

An episode is one completion of the rollout: its token ids are the model's turns and the
environment's answers in order, and ``Completion.env_mask`` marks which tokens the model wrote
(1) and which the environment did (0): the loss and its normaliser count the model's tokens only
(the environment's are in the context, with no loss and no gradient; TRL's ``tool_mask``,
verifiers' ``completion_mask``). Each turn is one call of the run's rollout engine for every
episode still going, so any engine (``hf`` under any layout, ``vllm``, your own) runs episodes;
the environment's stop strings (:attr:`Environment.stop`) end a model's turn.

* :class:`Environment`: the interface (``reset`` with a prompt's record, ``step`` with the model's
  turn; returns a :class:`Turn`).
* :class:`Calculator` (``rollout.environment=calculator``): the model writes an arithmetic
  expression between ``<calc>`` and ``</calc>``; the environment evaluates it (a parsed syntax tree
  of numbers and + - * / // % ** and parentheses, with size limits: never ``eval`` of model text)
  and answers ``<result>N</result>``; a malformed call is answered with the error and counted as a
  tool error, never a crash.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from llmtrain.common.errors import ConfigError, import_object
from llmtrain.parallel import distributed
from llmtrain.parallel.distributed import derived_seed
from llmtrain.rollout.generate import Completion

import torch


@dataclass
class Turn:
    """The environment's answer to one model turn.

    Attributes:
        observation: text appended to the episode after the model's turn (a tool's output), or
            None: nothing to add.
        reward: a reward for this turn (summed over the episode's turns into its
            ``environment`` reward), or None.
        done: the episode ends after this turn.
        tool_calls, tool_errors: tool calls the turn made, and how many of them failed.
    """

    observation: str | None = None
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(ABC):
    """What answers a model's turns (see the module). Built once per rank as ``Class(cfg)``;
    ``reset`` and ``step`` run on the rank that holds the prompt, in the training process: keep
    them cheap, and never ``eval`` the model's text.

    Class attributes:
        stop: strings that end a model's turn (kept in it), e.g. a tool call's closing tag.
        gives_rewards: ``step`` returns rewards: they become the ``environment`` reward function
            (weight 1, beside ``reward.functions``).
    """

    stop: tuple[str, ...] = ()
    gives_rewards: bool = False

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    def reset(self, sample: dict) -> Any:
        """The state of a new episode on ``sample`` (the prompt's record: ``prompt``,
        ``prompt_ids``, ``record`` and the data's other columns). Default: None."""
        return None

    def episodes(self, engine: Any, policy: Any, samples: list[dict], seeds: list[list[int | None]], max_turns: int,
                 budget: int, tokenizer: Any) -> list[list[Completion]]:
        """One episode per seed of each sample: by default :func:`run_episodes` driving
        :meth:`reset` and :meth:`step`; an environment with its own rollout loop (a verifiers
        one: :mod:`llmtrain.rollout.verifiers_env`) overrides it. Collective call."""
        return run_episodes(engine, policy, self, samples, seeds, max_turns, budget, tokenizer)

    @abstractmethod
    def step(self, state: Any, text: str) -> Turn:
        """Answer the model's latest turn ``text`` (decoded, special tokens skipped). An exception
        here stops the run naming the environment; report a bad tool call as a
        :class:`Turn` with ``tool_errors`` instead."""


# ---- the calculator ---------------------------------------------------------------------------
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15


class CalculatorError(ValueError):
    """An expression the calculator refuses (its message is the tool's answer)."""


def calculate(expression: str) -> float | int:
    """The value of an arithmetic ``expression``: numbers (``1,000`` commas and ``$`` allowed),
    ``+ - * / // % **``, parentheses. Parsed with :mod:`ast` and walked node by node; nothing
    is executed.

    Raises:
        CalculatorError: anything else (names, calls, strings), over 200 characters, division by
            zero, an exponent over 64, or a value over 1e15 in magnitude.
    """
    text = expression.strip().replace(",", "").replace("$", "").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > MAX_MAGNITUDE):
                raise CalculatorError("exponent too large")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            if isinstance(out, complex) or not math.isfinite(float(abs(out))) or abs(out) > MAX_MAGNITUDE:
                raise CalculatorError("result out of range")
            return out
        raise CalculatorError("only numbers and + - * / // % ** ( ) are allowed")

    return value(tree)


def format_number(number: float | int) -> str:
    """``12`` for 12.0, else up to 6 decimals without trailing zeros."""
    if float(number).is_integer():
        return str(int(number))
    return f"{number:.6f}".rstrip("0").rstrip(".")


class Calculator(Environment):
    """``rollout.environment=calculator``: see the module. A turn that ends with a ``<calc>``
    call is answered with ``<result>N</result>`` (or ``<result>error: ...</result>``, a tool
    error); a turn without one ends the episode (the final answer; the reward functions score
    the whole episode's text, e.g. ``reward.functions=[gsm8k]``)."""

    stop = ("</calc>",)

    def step(self, state: Any, text: str) -> Turn:
        calls = CALL.findall(text)
        if not calls:
            return Turn(done=True)
        try:
            answer = format_number(calculate(calls[-1]))
        except CalculatorError as err:
            return Turn(observation=f"<result>error: {err}</result>\n", tool_calls=1, tool_errors=1)
        return Turn(observation=f"<result>{answer}</result>\n", tool_calls=1)


ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": Calculator}


def build_environment(cfg: Any, adapt: Callable[[Any, Any, str], Environment | None] | None = None
                      ) -> Environment | None:
    """``rollout.environment``'s environment ("": none, single-turn completions). ``adapt(cfg, obj,
    spec)``: an :class:`Environment` for an imported ``obj`` that is not one (a function returning
    another library's environment), or None.

    Raises:
        ConfigError: an unknown name, or a ``module:Class`` that cannot be imported or is not an
            :class:`Environment` (nor anything ``adapt`` takes).
    """
    spec = str(cfg.rollout.get("environment", "") or "")
    if not spec:
        return None
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec](cfg)
    if ":" not in spec:
        raise ConfigError(f"rollout.environment={spec!r} is neither a built-in environment "
                          f"({', '.join(ENVIRONMENTS)}) nor module:Class")
    cls = import_object(spec, "rollout.environment", "importable.module:Class")
    adapted = None if isinstance(cls, type) or adapt is None else adapt(cfg, cls, spec)
    if adapted is not None:
        return adapted
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"rollout.environment={spec!r} is not a subclass of llmtrain.rollout.environments.Environment")
    return cls(cfg)


# ---- running episodes -------------------------------------------------------------------------
@dataclass
class _Episode:
    sample: dict
    seed: int | None
    state: Any
    ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logps: list[float] | None = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None
    done: bool = False
    truncated: bool = False


class EnvironmentFailure(RuntimeError):
    """The environment raised (its own exception is the cause)."""


def run_episodes(engine: Any, policy: Any, environment: Environment, samples: list[dict],
                 seeds: list[list[int | None]], max_turns: int, budget: int, tokenizer: Any) -> list[list[Completion]]:
    """One episode per seed of each sample (see the module), as completions with ``env_mask``,
    ``turns``, ``tool_calls``, ``tool_errors`` and ``env_reward`` filled. Turn t of a seeded
    episode samples with a seed derived from the episode's and t; a greedy one (None) stays
    greedy. ``budget``: the episode's tokens (model and environment), ``max_turns`` its model
    turns. Every rank makes the same number of engine calls (one per turn while any rank's
    episode goes on). Collective call.

    Raises:
        EnvironmentFailure: the environment's ``reset`` or ``step`` raised.
    """
    episodes: list[list[_Episode]] = []
    name = type(environment).__name__
    for sample, row in zip(samples, seeds):
        try:
            episodes.append([_Episode(sample, seed, environment.reset(sample)) for seed in row])
        except Exception as err:  # noqa: BLE001  (a user's environment)
            raise EnvironmentFailure(f"rollout.environment {name}.reset raised {type(err).__name__}: {err}") from err
    flat = [e for group in episodes for e in group]
    sampling = engine.sampling
    base_stop, base_max = sampling.stop, sampling.max_new
    sampling.stop = tuple(dict.fromkeys((*base_stop, *environment.stop)))
    device = policy.env.device
    try:
        for turn in range(max_turns):
            active = [e for e in flat if not e.done]
            if not int(distributed.all_reduce_max(torch.tensor(len(active), device=device))):
                break
            sampling.max_new = max([budget - len(e.ids) for e in active], default=1)
            contexts = [{**e.sample, "prompt_ids": list(e.sample["prompt_ids"]) + e.ids} for e in active]
            turn_seeds = [[None if e.seed is None else derived_seed(e.seed, "turn", turn)] for e in active]
            outputs = engine.sample(policy, contexts, turn_seeds)
            for episode, group in zip(active, outputs):
                _advance(episode, group[0], environment, tokenizer, sampling, budget, turn + 1 == max_turns, name)
    finally:
        sampling.stop, sampling.max_new = base_stop, base_max
    return [[Completion(e.ids, e.truncated, e.logps, env_mask=e.env_mask, turns=e.turns, tool_calls=e.tool_calls,
                        tool_errors=e.tool_errors, env_reward=e.reward) for e in group] for group in episodes]


def _advance(e: _Episode, completion: Completion, environment: Environment, tokenizer: Any, sampling: Any,
             budget: int, last_turn: bool, name: str) -> None:
    """Append one model turn (and the environment's answer) to episode ``e``."""
    room = budget - len(e.ids)
    ids = list(completion.ids)[:room]
    cut = len(completion.ids) > room or (completion.truncated and len(ids) == room)
    e.ids += ids
    e.env_mask += [1] * len(ids)
    if e.logps is not None:
        e.logps = e.logps + list(completion.logps[:len(ids)]) if completion.logps is not None else None
    e.turns += 1
    ended = bool(ids) and ids[-1] in sampling.end_ids
    try:
        answer = environment.step(e.state, tokenizer.decode(ids, skip_special_tokens=True))
    except Exception as err:  # noqa: BLE001  (a user's environment)
        raise EnvironmentFailure(f"rollout.environment {name}.step raised {type(err).__name__}: {err}") from err
    e.tool_calls += int(answer.tool_calls)
    e.tool_errors += int(answer.tool_errors)
    if answer.reward is not None:
        e.reward = float(answer.reward) + (e.reward or 0.0)
    if cut:
        e.done, e.truncated = True, True
        return
    if ended or answer.done or answer.observation is None or last_turn or not completion.ids:
        e.done = True
        return
    observation = list(tokenizer(answer.observation, add_special_tokens=False)["input_ids"])
    room = budget - len(e.ids)
    if len(observation) >= room:  # no room left for the model to answer it
        e.ids += observation[:room]
        e.env_mask += [0] * min(len(observation), room)
        if e.logps is not None:
            e.logps += [0.0] * min(len(observation), room)
        e.done, e.truncated = True, True
        return
    e.ids += observation
    e.env_mask += [0] * len(observation)
    if e.logps is not None:
        e.logps += [0.0] * len(observation)
