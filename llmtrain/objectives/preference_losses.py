"""Per-pair (or per-example) preference and reward losses, from sequence log-probabilities.

Work in progress for the preference objectives (issue 23): these are the losses only, as pure
functions of tensors of shape ``[pairs]``; the objectives that gather the log-probabilities from a
micro-batch, the reference model and the data layouts build on them. Each returns the per-pair
loss (the objective sums it and divides by the global batch's pair count, the normalisation
contract of :mod:`llmtrain.objectives`) and the detached rewards TRL logs.

Conventions follow TRL 1.16 (``trl.trainer.dpo_trainer``, ``cpo_trainer``, ``orpo_trainer``,
``kto_trainer``, ``reward_trainer``) so that the objectives can be checked against its trainers:
a sequence log-probability is the sum over its completion tokens, and ``*_tokens`` are the
completion token counts where a loss normalises by length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


@dataclass(frozen=True)
class PairLosses:
    """``losses``: per pair (or example), shape ``[n]``, with gradient. ``chosen_rewards`` and
    ``rejected_rewards``: the implicit rewards, shape ``[n]``, detached (TRL's
    ``rewards/chosen``, ``rewards/rejected``; their difference is ``rewards/margins`` and its sign
    ``rewards/accuracies``)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0, chosen_tokens: torch.Tensor | None = None,
               rejected_tokens: torch.Tensor | None = None) -> PairLosses:
    """DPO and its pairwise family, with Δ = (log π(y_w|x) − log π_ref(y_w|x)) − (log π(y_l|x) −
    log π_ref(y_l|x)), all tensors of shape ``[pairs]`` (sequence log-probs, nats):

    * ``sigmoid``: −log σ(βΔ) (Rafailov et al. 2023, eq. 7); with ``label_smoothing`` ε the
      conservative DPO of Mitchell (2023): −(1−ε) log σ(βΔ) − ε log σ(−βΔ).
    * ``hinge``: max(0, 1 − βΔ) (SLiC-HF, Zhao et al. 2023, eq. 1 with δ = 1/β).
    * ``ipo``: (Δ̄ − 1/(2β))² (Azar et al. 2023, eq. 17), Δ̄ with each log-ratio divided by its
      completion's token count (``chosen_tokens``, ``rejected_tokens``), as TRL does (its authors'
      normalised form).
    * ``robust``: (−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε) (Chowdhury et al. 2024, eq. 6).

    Rewards: β (log π − log π_ref) of each completion.

    Raises:
        ValueError: an unknown ``loss_type``, ``ipo`` without token counts, or ``robust`` with
            ε ≥ 0.5.
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type=ipo normalises by completion length: pass chosen_tokens and rejected_tokens")
        normalised = (chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1))
        losses = (normalised - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        if not 0 <= eps < 0.5:
            raise ValueError(f"loss_type=robust needs 0 <= label_smoothing < 0.5, not {eps}")
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    else:
        raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    return PairLosses(losses, (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach())


def simpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
                 rejected_tokens: torch.Tensor, beta: float = 2.0, gamma: float = 1.0,
                 label_smoothing: float = 0.0) -> PairLosses:
    """SimPO (Meng et al. 2024, eq. 6): −log σ(β/|y_w| log π(y_w|x) − β/|y_l| log π(y_l|x) − γ),
    reference-free, with margin γ (TRL's CPO ``simpo_gamma``; the paper's typical β = 2, γ/β =
    0.5) and optional label smoothing as in conservative DPO. Rewards: β × the length-normalised
    log-prob of each completion. Shapes ``[pairs]``."""
    chosen_avg = chosen_logps / chosen_tokens.clamp(min=1)
    rejected_avg = rejected_logps / rejected_tokens.clamp(min=1)
    logits = chosen_avg - rejected_avg - gamma / beta
    eps = label_smoothing
    losses = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
    return PairLosses(losses, (beta * chosen_avg).detach(), (beta * rejected_avg).detach())


def orpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
                rejected_tokens: torch.Tensor, beta: float = 0.1) -> tuple[PairLosses, torch.Tensor]:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4-7), per pair: −λ log σ(log odds(y_w|x) −
    log odds(y_l|x)), odds(y|x) = P/(1−P) with P the mean per-token probability exp(log π / |y|),
    λ = ``beta`` (TRL's name; the paper's λ, default 0.1). The full ORPO loss adds the chosen
    completion's per-token NLL (the SFT term, eq. 6), which the objective computes from the
    logits. Returns the pair losses (rewards: β × the mean per-token log-prob, as TRL logs them)
    and the log odds ratios (TRL's ``log_odds_ratio``), shapes ``[pairs]``."""
    chosen_avg = chosen_logps / chosen_tokens.clamp(min=1)
    rejected_avg = rejected_logps / rejected_tokens.clamp(min=1)
    log_odds = (chosen_avg - rejected_avg) - (torch.log1p(-torch.exp(chosen_avg)) -
                                              torch.log1p(-torch.exp(rejected_avg)))
    losses = -beta * F.logsigmoid(log_odds)
    return PairLosses(losses, (beta * chosen_avg).detach(), (beta * rejected_avg).detach()), log_odds.detach()


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
               beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PairLosses:
    """KTO (Ethayarajh et al. 2024, eq. 8), per example, unpaired: with r = log π(y|x) − log
    π_ref(y|x) and the reference point z₀ = ``kl`` (the batch's KL estimate from mismatched
    pairs, clamped at 0 and detached, a scalar), a desirable example costs λ_D (1 − σ(β(r − z₀)))
    and an undesirable one λ_U (1 − σ(β(z₀ − r))). ``logps``, ``ref_logps``: ``[examples]``;
    ``desirable``: bool ``[examples]``. Rewards: β r, reported in ``chosen_rewards`` for the
    desirable examples and ``rejected_rewards`` for the others (NaN elsewhere)."""
    reward = logps - ref_logps
    z0 = kl.detach().clamp(min=0)
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (reward - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - reward))))
    scaled = (beta * reward).detach()
    nan = torch.full_like(scaled, float("nan"))
    return PairLosses(losses, torch.where(desirable, scaled, nan), torch.where(desirable, nan, scaled))


def reward_losses(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | None = None,
                  center_rewards_coefficient: float = 0.0) -> PairLosses:
    """Bradley–Terry reward-model loss (Ouyang et al. 2022, eq. 1): −log σ(r(x,y_w) − r(x,y_l) −
    m) with an optional per-pair margin m (Llama 2, Touvron et al. 2023, eq. 2), plus the centering
    term c (r_w + r_l)² (Eisenstein et al. 2023), per pair. Scores: the classification head's
    scalar per sequence, shape ``[pairs]``."""
    difference = chosen_scores - rejected_scores
    if margin is not None:
        difference = difference - margin
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient:
        losses = losses + center_rewards_coefficient * (chosen_scores + rejected_scores) ** 2
    return PairLosses(losses, chosen_scores.detach(), rejected_scores.detach())
