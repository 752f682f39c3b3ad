"""Scoring completions: the reward functions' values of a step's completions, checked as TRL's
``GRPOTrainer`` takes them (a real number or None per completion, finite)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from llmtrain.rollout.rewards import RewardFunction


class RewardError(RuntimeError):
    """A reward function failed on the completions of a step (raised with the function's own
    exception as its cause, so the traceback shows where)."""


def reward_value(value: Any) -> float | None:
    """``value`` as a float when it is a real number as TRL's ``GRPOTrainer`` takes one (it
    converts a function's values with ``torch.tensor(..., dtype=float32)``): an int, float or
    bool (1.0 / 0.0, a pass/fail checker's natural answer), any :class:`numbers.Real` (numpy's
    scalars), or a 0-dimensional numpy array or torch tensor of one; None otherwise (a string,
    a complex number, an array of several values)."""
    if isinstance(value, (str, bytes)):
        return None  # float("0.5") would parse one; TRL refuses text
    dtype = getattr(value, "dtype", None)
    scalar = getattr(value, "ndim", None) == 0 and dtype is not None and (
        not dtype.is_complex if isinstance(dtype, torch.dtype) else getattr(dtype, "kind", "") in ("b", "i", "u", "f"))
    if not (isinstance(value, numbers.Real) or scalar):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range: infinite
        return float("inf")


def score(functions: list[RewardFunction], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]], where: str) -> torch.Tensor:
    """float64 ``[completions, functions]``: each function's values (NaN where it returned None).

    Raises:
        RewardError: a function raised, returned another number of values than completions, a
            value that is not a real number (:func:`reward_value`) or None, or one that is not
            finite (NaN, ±inf: an infinite reward makes every advantage of its batch NaN or 0)
            (``where`` says when: the step or the check).
    """
    table = torch.full((len(completions), len(functions)), float("nan"), dtype=torch.float64)
    for j, f in enumerate(functions):
        try:
            values = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # noqa: BLE001  (a user's function: any exception is its failure)
            raise RewardError(f"reward function {f.name} raised {type(err).__name__} {where}: {err}") from err
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise RewardError(f"reward function {f.name} returned {len(values)} values for {len(completions)} "
                              f"completions {where}: it must return one float (or None) per completion")
        for i, value in enumerate(values):
            if value is None:
                continue
            number = reward_value(value)
            if number is None or not math.isfinite(number):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise RewardError(f"reward function {f.name} returned {shown} for completion {i} {where}: rewards "
                                  "must be finite real numbers (float, int, bool or a numpy/torch scalar), or None "
                                  "where a function does not apply")
            table[i, j] = number
    return table
