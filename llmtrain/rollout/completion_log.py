"""The completions file of a step, ``run_dir/completions/step_N.jsonl``: the first
``rollout.log_completions`` completions of the step's global batch with their rewards and
advantages, every data-parallel rank's gathered to rank 0 in the global order."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.parallel import distributed
from llmtrain.rollout.generate import Completion
from llmtrain.rollout.rewards import RewardFunction


def records(step: int, rank: int, samples: list[dict], groups: list[list[Completion]], table: torch.Tensor,
            rewards: torch.Tensor, advantages: torch.Tensor, functions: list[RewardFunction], tokenizer: Any,
            limit: int) -> list[dict]:
    """This rank's first ``limit`` completions (prompt, then completion within its group) as
    records: the prompt, the decoded completion, each function's reward (``table`` ``[completions,
    functions]``), the reward and the advantage (``rewards``, ``advantages`` ``[prompts, G]``),
    the data-parallel ``rank`` that sampled it, and a multi-turn episode's turns."""
    rows, k = [], 0
    for p, (sample, group) in enumerate(zip(samples, groups)):
        for i, completion in enumerate(group):
            if len(rows) < limit:
                rows.append({
                    "step": step, "rank": rank, "record": sample.get("record"), "prompt": sample["prompt"],
                    "completion": tokenizer.decode(completion.ids, skip_special_tokens=True),
                    "tokens": len(completion.ids), "truncated": completion.truncated,
                    "rewards": {f.name: (None if math.isnan(float(table[k, j])) else float(table[k, j]))
                                for j, f in enumerate(functions)},
                    "reward": None if math.isnan(float(rewards[p, i])) else float(rewards[p, i]),
                    "advantage": float(advantages[p, i]), **transcript(completion, tokenizer)})
            k += 1
    return rows


def write(step: int, rank: int, rows: list[dict], limit: int, run_dir: Path, is_main: bool,
          on_completions: Callable[[list[dict], int], None] | None) -> None:
    """Every data-parallel rank's ``rows`` (:func:`records`) gathered to rank 0, which writes the
    first ``limit`` to ``run_dir/completions/step_{step}.jsonl`` and hands them to
    ``on_completions`` (the trainer's tracker). Collective call."""
    gathered = distributed.gather_objects((rank, rows))
    if gathered is None or not is_main:
        return
    # Ranks hold contiguous slices of the global batch in data-parallel rank order; the
    # tensor/pipeline peers of a data-parallel rank hold its rows again.
    parts: dict[int, list[dict]] = {}
    for source, part in gathered:
        parts.setdefault(source, part)
    rows = [row for source in sorted(parts) for row in parts[source]][:limit]
    folder = run_dir / "completions"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step_{step}.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows),
                                               encoding="utf-8")
    if on_completions is not None:
        on_completions(rows, step)


def transcript(completion: Completion, tokenizer: Any) -> dict:
    """A multi-turn episode's turns for the completions file: ``{"turns": [{"role": "assistant" |
    "tool", "text": ...}, ...], "tool_calls": n, "tool_errors": n}``; empty for a single turn."""
    if completion.env_mask is None:
        return {}
    turns, start = [], 0
    for end in range(1, len(completion.ids) + 1):
        if end == len(completion.ids) or completion.env_mask[end] != completion.env_mask[start]:
            turns.append({"role": "assistant" if completion.env_mask[start] else "tool",
                          "text": tokenizer.decode(completion.ids[start:end], skip_special_tokens=True)})
            start = end
    return {"turns": turns, "tool_calls": completion.tool_calls, "tool_errors": completion.tool_errors}
