"""A second objective, defined outside the package as a user would: next-token cross-entropy
with a weight per target token, read from the batch. It proves the objective seam: it trains on
every engine (DDP, FSDP2, ZeRO-3, pipeline) without an engine knowing it, and the step's loss
is the global batch's weighted mean ``sum(w * CE) / sum(w)`` whatever the split.

Select it with ``objective.target=tests.token_weighted:TokenWeighted`` (the repository root on
``PYTHONPATH``, as the suite's subprocesses have it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.objectives import LossSums, Objective


def token_weights(input_ids: torch.Tensor) -> torch.Tensor:
    """Weight of each token ``[B, T]``: 1, 2 or 3 by its id (any deterministic rule will do)."""
    return 1.0 + (input_ids % 3).to(torch.float32)


class TokenWeighted(Objective):
    """``sum_t w_t CE_t / sum_t w_t`` over the global batch's target tokens; metric ``accuracy``:
    the weighted share of targets the argmax predicts."""

    carries = {"labels": IGNORE_INDEX, "token_weights": 0.0}
    metric_names = ("accuracy",)

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**batch, "token_weights": token_weights(batch["input_ids"])}

    @staticmethod
    def _target_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # The weight of the token each position predicts, zero where that token carries no loss.
        labels = batch["labels"][:, 1:]
        return batch["token_weights"][:, 1:] * (labels != IGNORE_INDEX)

    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._target_weights(batch).sum()

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        logits, labels = output[:, :-1].float(), batch["labels"][:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="none").view_as(labels)
        weights = self._target_weights(batch)
        correct = (logits.argmax(-1) == labels).to(torch.float32)
        return LossSums((weights * ce).sum(), {"accuracy": (weights * correct).sum()})
