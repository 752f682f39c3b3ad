"""How a generation batch's completions become a training micro-batch: each prompt then its
completion in a row, right-padded, or with ``rollout.packing`` several sequences per row of
``data.seq_len`` tokens, with the carries the objective reads (:mod:`llmtrain.objectives.grpo`)."""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.rollout.generate import Completion


def placements_of(lengths: list[int], capacity: int | None) -> list[tuple[int, int]]:
    """Where each sequence (prompt + completion, of ``lengths`` tokens) of a micro-batch goes:
    ``(row, offset)``. One per row (``capacity`` None), or packed: first fit, in order, into rows
    of ``capacity`` tokens (deterministic: the same sequences pack the same way)."""
    if capacity is None:
        return [(i, 0) for i in range(len(lengths))]
    used: list[int] = []
    out = []
    for n in lengths:
        row = next((r for r, taken in enumerate(used) if taken + n <= capacity), len(used))
        if row == len(used):
            used.append(0)
        out.append((row, used[row]))
        used[row] += n
    return out


def training_batch(rows: list[tuple[dict, Completion, float]], pad_id: int, objective: Any,
                   capacity: int | None) -> dict[str, torch.Tensor]:
    """One training micro-batch of ``rows`` (sample, completion, advantage): each row its prompt
    then its completion, right-padded with ``pad_id``; or packed into rows of ``capacity`` tokens
    (:func:`placements_of`), each sequence with positions from 0 (``position_ids``: the model
    attends within each sequence only) and its own ``segment`` id, padding one more sequence at
    the row's end. ``objective``: GRPO's fields (``mask_truncated``, ``behaviour``). Text only:
    the caller adds an image prompt's pixels."""
    lengths = [len(s["prompt_ids"]) + len(c.ids) for s, c, _ in rows]
    placements = placements_of(lengths, capacity)
    used = [0] * (1 + max(r for r, _ in placements))
    for (r, offset), n in zip(placements, lengths):
        used[r] = max(used[r], offset + n)
    shape = (len(used), max(used))
    batch = {"input_ids": torch.full(shape, pad_id, dtype=torch.long),
             "attention_mask": torch.zeros(shape, dtype=torch.long),
             "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.long),
             "completion_mask": torch.zeros(shape, dtype=torch.float32),
             "advantages": torch.zeros(shape, dtype=torch.float32),
             "old_logps": torch.zeros(shape, dtype=torch.float32),
             "ref_logps": torch.zeros(shape, dtype=torch.float32),
             "behaviour_logps": torch.zeros(shape, dtype=torch.float32),
             "segment": torch.full(shape, -1, dtype=torch.long)}
    for j, ((sample, completion, advantage), (i, at)) in enumerate(zip(rows, placements)):
        p, c = len(sample["prompt_ids"]), len(completion.ids)
        batch["input_ids"][i, at:at + p + c] = torch.tensor(list(sample["prompt_ids"]) + completion.ids)
        batch["attention_mask"][i, at:at + p + c] = 1
        batch["segment"][i, at:at + p + c] = j
        start = at + p
        batch["labels"][i, start:start + c] = torch.tensor(completion.ids)
        keep = not (completion.truncated and objective.mask_truncated)
        batch["completion_mask"][i, start:start + c] = float(keep)
        if completion.env_mask is not None:  # the environment's tokens: context, no loss
            batch["completion_mask"][i, start:start + c] *= torch.tensor(completion.env_mask, dtype=torch.float32)
        batch["advantages"][i, start:start + c] = advantage
        if objective.behaviour and completion.logps is not None:
            batch["behaviour_logps"][i, start:start + c] = torch.tensor(completion.logps, dtype=torch.float32)
    if capacity is not None:
        positions = torch.zeros(shape, dtype=torch.long)
        for (i, at), n in zip(placements, lengths):
            positions[i, at:at + n] = torch.arange(n)
        for i, end in enumerate(used):
            positions[i, end:] = torch.arange(shape[1] - end)
        batch["position_ids"] = positions
    return batch


def completion_logps(batch: dict[str, torch.Tensor], rows: list[tuple[dict, Completion]],
                     capacity: int | None) -> list[torch.Tensor]:
    """Each completion's ``old_logps`` from a batch :func:`training_batch` made of ``rows`` (in
    order, with the same ``capacity``)."""
    lengths = [len(s["prompt_ids"]) + len(c.ids) for s, c in rows]
    return [batch["old_logps"][i, at + len(s["prompt_ids"]):at + len(s["prompt_ids"]) + len(c.ids)]
            for (s, c), (i, at) in zip(rows, placements_of(lengths, capacity))]
