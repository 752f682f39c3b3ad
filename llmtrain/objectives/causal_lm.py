"""Next-token prediction (causal language modelling): the default objective, for pre-training
and supervised fine-tuning alike (prompt tokens carry label -100 and no loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtrain.objectives.base import LossSums, Objective

from llmtrain.common.labels import IGNORE_INDEX


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32 scalar) of ``logits`` ``[B, T, V]`` against
    ``labels`` ``[B, T]`` shifted by one; labels of -100 are ignored. ``logits`` may instead be
    the chunked head's ``[B, T]`` next-label log-probs (:mod:`llmtrain.models.chunked_loss`)."""
    if logits.dim() == 2:
        return -logits[:, :-1].sum()
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss in ``labels`` ``[B, T]`` after the one-token shift, as a 0-dim
    tensor on ``labels``' device (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def count_target_tokens(labels: torch.Tensor) -> int:
    """:func:`target_tokens` as a Python int."""
    return int(target_tokens(labels))


class CausalLM(Objective):
    """Mean next-token cross-entropy over the global batch's target tokens: each micro-batch gives
    ``sum(CE)``, the normaliser counts target tokens (``labels != -100`` after the shift)."""

    carries = {"labels": IGNORE_INDEX}
    label_logps_only = True

    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return target_tokens(batch["labels"])

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        return LossSums(token_cross_entropy_sum(output, batch["labels"]))
