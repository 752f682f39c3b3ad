"""The token loss shared by every engine and schedule (pipeline last stages included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding), as in PyTorch/HF


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32 scalar) of ``logits`` ``[B, T, V]`` against
    ``labels`` ``[B, T]`` shifted by one; labels of -100 are ignored."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a loss in ``labels`` ``[B, T]`` after the one-token shift, as a 0-dim
    tensor on ``labels``' device (no host sync)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def count_target_tokens(labels: torch.Tensor) -> int:
    """:func:`target_tokens` as a Python int."""
    return int(target_tokens(labels))
