"""Preference and reward objectives on pairs of sequences (``data.format=preference``).

A micro-batch of pairs (laid out by :class:`llmtrain.data.preference.PairCollator`, unpacked or
packed) carries, per token, ``labels`` (completion tokens; -100 elsewhere) and ``segment`` (the
sequence a token belongs to, prompt included: pair ``j``'s chosen is ``2j``, its rejected
``2j + 1``; -1 on padding),
plus per-sequence numbers placed on a sequence's first completion token: the reference
log-probs ``ref_logps`` (precomputed, or filled per token by the live reference before the step)
and the reward margin ``margin``. Summing a per-token quantity over a segment gives the
sequence's, so packed rows and padded rows give the same sums.

Normalisation: the loss is the mean over the global batch's pairs (:meth:`PairObjective.normaliser`
counts a micro-batch's pairs), whatever the micro-batch, accumulation and data-parallel split.
Metrics are TRL's (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
``rewards/margins``, ``logps/chosen``, ``logps/rejected``), means over the same pairs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.objectives.base import LossSums, Objective
from llmtrain.objectives.preference_losses import (PairLosses, dpo_losses, kto_losses, orpo_losses, reward_losses,
                                                   simpo_losses)

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


def completion_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, seq]``: at position ``t``, log π(label_t | tokens before t) for completion
    tokens (labels != -100), 0 elsewhere and at ``t = 0``. ``logits`` ``[rows, seq, vocab]``, or
    the chunked head's ``[rows, seq]`` next-label log-probs (:mod:`llmtrain.models.chunked_loss`)."""
    if logits.dim() == 2:
        return F.pad(logits[:, :-1], (1, 0))
    targets = labels[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="none").view_as(targets)
    return F.pad(-nll, (1, 0))


def segment_sums(values: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """Sum of ``values`` ``[rows, seq]`` over each segment id ``0..count-1`` of ``segment``
    ``[rows, seq]`` (ids < 0 ignored): float64 ``[count]``."""
    keep = segment >= 0
    out = torch.zeros(count, dtype=torch.float64, device=values.device)
    return out.index_add(0, segment[keep], values[keep].to(torch.float64))


class PairObjective(Objective):
    """Shared pair bookkeeping: per-sequence log-probs, pair counts, TRL's metrics."""

    carries = {"labels": IGNORE_INDEX, "segment": -1, "ref_logps": 0.0, "margin": 0.0, "desirable": 0.0}
    metric_names = PAIR_METRICS
    reports_perplexity = False
    needs_reference = False
    counted_unit = "pairs"

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        get = (lambda key, default: cfg.get(key, default)) if cfg is not None else (lambda key, default: default)
        self.beta = float(get("beta", 0.1))
        self.loss_type = str(get("loss_type", "sigmoid"))
        self.label_smoothing = float(get("label_smoothing", 0.0))
        self.gamma = float(get("gamma", 1.0))
        self.center_coefficient = float(get("center_coefficient", 0.0))
        self.use_margin = bool(get("margin_column", False))
        self.desirable_weight = float(get("desirable_weight", 1.0))
        self.undesirable_weight = float(get("undesirable_weight", 1.0))

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shape = batch["input_ids"].shape
        batch.setdefault("segment", torch.full(shape, -1, dtype=torch.long))
        batch.setdefault("margin", torch.zeros(shape, dtype=torch.float32))
        batch.setdefault("ref_logps", torch.zeros(shape, dtype=torch.float32))
        batch.setdefault("desirable", torch.zeros(shape, dtype=torch.float32))
        return batch

    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pairs of the micro-batch: its segments are numbered ``0..2P-1``."""
        return torch.div(batch["segment"].max().clamp(min=-1) + 1, 2, rounding_mode="floor")

    @staticmethod
    def count(batch: dict[str, torch.Tensor]) -> int:
        """Sequences (2 × pairs) of the micro-batch (a host sync)."""
        return int(batch["segment"].max().clamp(min=-1)) + 1

    def sequence_logps(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs, completion token counts, reference log-probs), each float64 ``[2P]``,
        sequence ``2j`` the chosen and ``2j + 1`` the rejected completion of pair ``j``."""
        n = self.count(batch)
        segment, labels = batch["segment"], batch["labels"]
        logps = segment_sums(completion_token_logps(logits, labels), segment, n)
        # A row's first token predicts nothing (no logits before it): not counted, as in TRL.
        completion = (labels != IGNORE_INDEX).to(torch.float32)
        completion[:, 0] = 0
        tokens = segment_sums(completion, segment, n)
        ref = segment_sums(batch["ref_logps"], segment, n)
        return logps, tokens, ref

    def pair_sums(self, pairs: PairLosses, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict:
        """TRL's metrics summed over the micro-batch's pairs."""
        margins = pairs.chosen_rewards - pairs.rejected_rewards
        return {"rewards/chosen": pairs.chosen_rewards.sum(), "rewards/rejected": pairs.rejected_rewards.sum(),
                "rewards/accuracies": (margins > 0).to(torch.float64).sum(), "rewards/margins": margins.sum(),
                "logps/chosen": chosen_logps.detach().sum(), "logps/rejected": rejected_logps.detach().sum()}


class DPO(PairObjective):
    """Direct preference optimisation (Rafailov et al. 2023) and its pairwise family: the
    ``objective.loss_type`` of :func:`~llmtrain.objectives.preference_losses.dpo_losses`, against a
    frozen reference policy whose log-probs arrive in ``ref_logps``."""

    needs_reference = True
    label_logps_only = True

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        logps, tokens, ref = self.sequence_logps(output, batch)
        c, r = logps[0::2], logps[1::2]
        pairs = dpo_losses(c, r, ref[0::2], ref[1::2], self.beta, self.loss_type, self.label_smoothing,
                           tokens[0::2], tokens[1::2])
        return LossSums(pairs.losses.sum(), self.pair_sums(pairs, c, r))


class SimPO(PairObjective):
    """SimPO (Meng et al. 2024): reference-free, length-normalised, with margin ``objective.gamma``
    (:func:`~llmtrain.objectives.preference_losses.simpo_losses`). ``logps/*`` are per-token
    means, as TRL logs them for SimPO and ORPO."""

    label_logps_only = True

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        logps, tokens, _ = self.sequence_logps(output, batch)
        c, r = logps[0::2], logps[1::2]
        pairs = simpo_losses(c, r, tokens[0::2], tokens[1::2], self.beta, self.gamma, self.label_smoothing)
        # logps/* are per-token means here, as TRL's CPOTrainer logs them for SimPO.
        return LossSums(pairs.losses.sum(), self.pair_sums(pairs, c / tokens[0::2].clamp(min=1),
                                                           r / tokens[1::2].clamp(min=1)))


class ORPO(PairObjective):
    """ORPO (Hong et al. 2024, eq. 6): per pair, the chosen sequence's mean per-token NLL (the SFT
    term) plus λ (``objective.beta``) times the odds-ratio loss; reference-free. The NLL is over
    the whole chosen sequence, prompt included, as the authors' code and TRL's ``ORPOTrainer``
    compute it (``objective.nll_on_prompt=false``: over the completion only). Reads the batch's
    ``input_ids`` (the prompt's targets). Also logs, as TRL names them, ``nll_loss``,
    ``log_odds_chosen`` (log odds(y_w|x) − log odds(y_l|x)) and ``log_odds_ratio`` (its log σ),
    means over pairs."""

    metric_names = PAIR_METRICS + ("nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        self.nll_on_prompt = bool(cfg.get("nll_on_prompt", True)) if cfg is not None else True

    def _chosen_nll(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """Mean per-token NLL of each chosen sequence (float64 ``[pairs]``), prompt included."""
        segment = batch["segment"]
        # Token t+1 is predicted from t only inside one sequence (packed rows hold several).
        same = (segment[:, 1:] >= 0) & (segment[:, 1:] == segment[:, :-1])
        targets = batch["input_ids"][:, 1:].masked_fill(~same, IGNORE_INDEX)
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="none").view_as(targets)
        scored = segment[:, 1:].masked_fill(~same, -1)
        sums = segment_sums(nll, scored, n)[0::2]
        return sums / segment_sums(same.to(torch.float32), scored, n)[0::2].clamp(min=1)

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        logps, tokens, _ = self.sequence_logps(output, batch)
        c, r = logps[0::2], logps[1::2]
        pairs, log_odds = orpo_losses(c, r, tokens[0::2], tokens[1::2], self.beta)
        nll = (self._chosen_nll(output, batch, self.count(batch)) if self.nll_on_prompt
               else -c / tokens[0::2].clamp(min=1))
        sums = self.pair_sums(pairs, c / tokens[0::2].clamp(min=1), r / tokens[1::2].clamp(min=1))  # as TRL's ORPO
        sums.update({"nll_loss": nll.detach().sum(), "log_odds_ratio": F.logsigmoid(log_odds).sum(),
                     "log_odds_chosen": log_odds.sum()})
        return LossSums((nll + pairs.losses).sum(), sums)


class Reward(PairObjective):
    """A reward model: a sequence-classification head's score per sequence (``model_output``
    ``"scores"``: the model's ``[rows, 1]`` logits, read at each row's last token), trained with the
    Bradley-Terry loss, optional margin and centering term
    (:func:`~llmtrain.objectives.preference_losses.reward_losses`). ``rewards/chosen`` and
    ``rewards/rejected`` are the mean scores, ``rewards/accuracies`` the share of pairs scored in
    order (TRL's ``accuracy``), ``rewards/margins`` the mean score difference (no ``logps/*``: a score is no log-probability)."""

    model_output = "scores"
    metric_names = PAIR_METRICS[:4]  # a score is no log-probability

    def check_supported(self, engine_name: str) -> None:
        """Every engine returns the model's ``logits``; a classification model's are the scores."""

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        n = self.count(batch)
        row_segment = batch["segment"].max(dim=1).values  # unpacked: one sequence per row
        keep = row_segment >= 0
        scores = torch.zeros(n, dtype=torch.float64, device=output.device).index_add(
            0, row_segment[keep], output[keep, 0].to(torch.float64))
        c, r = scores[0::2], scores[1::2]
        margin = segment_sums(batch["margin"], batch["segment"], n)[0::2] if self.use_margin else None
        pairs = reward_losses(c, r, margin, self.center_coefficient)
        sums = self.pair_sums(pairs, c, r)
        return LossSums(pairs.losses.sum(), {name: sums[name] for name in self.metric_names})


class KTO(PairObjective):
    """KTO (Ethayarajh et al. 2024, eq. 8) on unpaired examples, against a frozen reference
    (:func:`~llmtrain.objectives.preference_losses.kto_losses`), with TRL's ``KTOTrainer``
    estimate of the reference point z₀: the mean over the micro-batch of log π − log π_ref of
    mismatched (prompt, completion) examples (each prompt with the previous example's
    completion; :meth:`llmtrain.data.preference.PairCollator._kto_rows`), clamped at 0 and
    detached. z₀ is a micro-batch statistic (TRL's too, averaged over its ranks), so unlike the
    pairwise objectives KTO's loss depends on the micro-batch size; the mean over examples is
    over the global batch. Segments: example ``j`` is ``2j``, its KL sequence ``2j + 1``, so the
    pair normaliser counts examples.

    Metrics as TRL names them: ``rewards/chosen`` and ``logps/chosen`` are means over the
    desirable examples, ``rewards/rejected`` and ``logps/rejected`` over the undesirable ones,
    ``kl`` the micro-batches' z₀ weighted by their examples, ``share/desirable`` and
    ``share/undesirable`` the share of each kind."""

    needs_reference = True
    label_logps_only = True
    counted_unit = "examples"
    metric_names = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl", "share/desirable",
                    "share/undesirable")
    metric_denominators = {"rewards/chosen": "share/desirable", "logps/chosen": "share/desirable",
                           "rewards/rejected": "share/undesirable", "logps/rejected": "share/undesirable"}

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        logps, _, ref = self.sequence_logps(output, batch)
        n = self.count(batch)
        x, ref_x = logps[0::2], ref[0::2]
        kl = (logps[1::2] - ref[1::2]).mean().detach().clamp(min=0)
        desirable = segment_sums(batch["desirable"], batch["segment"], n)[0::2] > 0.5
        pairs = kto_losses(x, ref_x, desirable, kl, self.beta, self.desirable_weight, self.undesirable_weight)
        chosen, rejected = desirable.to(torch.float64), (~desirable).to(torch.float64)
        sums = {"rewards/chosen": pairs.chosen_rewards.nan_to_num().sum(),
                "rewards/rejected": pairs.rejected_rewards.nan_to_num().sum(),
                "logps/chosen": (x.detach() * chosen).sum(), "logps/rejected": (x.detach() * rejected).sum(),
                "kl": kl * len(x), "share/desirable": chosen.sum(), "share/undesirable": rejected.sum()}
        return LossSums(pairs.losses.sum(), sums)
