"""Group relative policy optimisation (GRPO; Shao et al. 2024, DeepSeekMath section 4.1) and its
corrections, on completions the rollout sampled from the policy (:mod:`llmtrain.rollout`).

A micro-batch holds completions, one per row (its prompt, then the completion; right-padded),
and carries per token:

* ``labels``: the completion's tokens (-100 on the prompt and on padding);
* ``completion_mask``: 1.0 where a completion token counts in the loss (0 on every token of a
  truncated completion under ``mask_truncated_completions``, DAPO section 3.3);
* ``advantages``: the completion's advantage on each of its tokens (:func:`group_advantages`);
* ``old_logps``: log π_old of each completion token, the policy that sampled it, when it may
  differ from the current one (``num_iterations`` > 1); on-policy the current log-probs,
  detached, stand in (as TRL does);
* ``ref_logps``: the reference policy's log-probs (``beta`` > 0);
* ``behaviour_logps``: log π_behaviour of each completion token, the policy that actually sampled
  it, where that may differ from π_old (asynchronous generation: weights one or more steps old;
  vLLM: other kernels, weights up to ``sync_every - 1`` steps old). The surrogate is then weighted
  per token by the truncated importance weight w = clip(π_old / π_behaviour, min, max) (TIS: Yao
  et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; TRL
  1.16's ``vllm_importance_sampling_mode``, whose modes and bounds :class:`GRPO` takes as
  ``sampling_correction``), before the KL term is added, as TRL does.

Per token, with r = π_θ / π_old (token level), or exp of its masked mean log over the
completion (sequence level, GSPO: Zheng et al. 2025, eq. 7), the clipped surrogate (PPO:
Schulman et al. 2017, eq. 7, with clip-higher's ε_high, DAPO section 3.1) and the k3 estimate of
KL to the reference (Schulman 2020; GRPO eq. 4, weighted by r as TRL 1.16's
``use_bias_correction_kl``)::

    ℓ_t = -min(r A, clip(r, 1 - ε, 1 + ε_high) A) + β (exp(ref - logp) - (ref - logp) - 1) r

The loss's normalisation (``loss_type``, TRL 1.16's definitions) is over the global batch,
whatever the micro-batch, accumulation and data-parallel split (:meth:`GRPO.normaliser`):
``grpo`` each completion's token mean, then the mean over completions; ``dapo`` the sum over
all completion tokens of the global batch over their number (DAPO eq. 8); ``dr_grpo`` the same
sum over completions × ``max_completion_length`` (Dr. GRPO: Liu et al. 2025, section 3.2);
``bnpo`` each micro-batch's token mean, then the mean over micro-batches (TRL's "local active
tokens": it depends on the micro-batch by definition).

Log-probs are of the logits divided by the sampling temperature, the distribution the rollout
sampled from (as TRL). Where the engine installs the label head (``trainer.logits_at_labels_only``,
:mod:`llmtrain.models.chunked_loss`), the policy's, the old policy's and the reference's log-probs
and the entropy come from the output layer run on the completion positions only, in chunks of
positions recomputed in backward (TRL's ``selective_log_softmax``, without ever holding the
micro-batch's ``[rows, seq, vocab]`` logits); elsewhere (pipeline stages, other model types) from
whole logits, with the same values. Metrics under TRL's names: ``entropy``, ``kl`` (``beta`` > 0),
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``: means over the
global batch's completion tokens (over completions at sequence level).
"""

from __future__ import annotations

from typing import Any

import torch

from llmtrain.common.errors import ConfigError
from llmtrain.common.labels import IGNORE_INDEX
from llmtrain.config.schema import GRPO_ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATORS
from llmtrain.config.schema import GRPO_IMPORTANCE_LEVELS as IMPORTANCE_LEVELS
from llmtrain.config.schema import GRPO_LOSS_TYPES as LOSS_TYPES
from llmtrain.config.schema import GRPO_SAMPLING_CORRECTIONS as SAMPLING_CORRECTIONS
from llmtrain.config.schema import GRPO_SCALE_REWARDS as SCALE_REWARDS
from llmtrain.objectives.base import LossSums, Objective
from llmtrain.objectives.preference import completion_token_logps

ADVANTAGE_EPS = 1e-4  # TRL's: the std a group's rewards are divided by is std + 1e-4


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased (n - 1) standard deviation of ``values`` ignoring NaNs (TRL's ``nanstd``):
    NaN where fewer than 2 values are present."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance)
    return std if keepdim else (std.squeeze() if dim is None else std.squeeze(dim))


def group_advantages(rewards: torch.Tensor, estimator: str = "grpo", scale: str = "group",
                     batch_std: float | None = None) -> torch.Tensor:
    """Advantages of ``rewards`` float64 ``[prompts, G]`` (G completions of each prompt; NaN for a
    completion no reward function applied to, whose advantage is 0 and which the group's
    statistics leave out, as TRL 1.16's).

    ``grpo`` (GRPO section 4.1.2): each reward minus its group's mean; ``rloo`` (leave-one-out,
    Ahmadian et al. 2024, section 3.2): minus the mean of the group's other G - 1 rewards, which is
    G / (G - 1) times the former. ``scale``: divided by the group's standard deviation (``group``,
    GRPO), by the whole batch's (``batch``: ``batch_std``, computed over every rank's rewards), or
    not (``none``, Dr. GRPO section 3.1), each + 1e-4 (TRL). Standard deviations are unbiased
    (n - 1), as TRL's.
    """
    g = rewards.shape[1]
    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if estimator == "rloo":
        centred = centred * (g / (g - 1))
    if scale == "group":
        centred = centred / (nanstd(rewards, dim=1, keepdim=True) + ADVANTAGE_EPS)
    elif scale == "batch":
        centred = centred / ((batch_std if batch_std is not None else float(nanstd(rewards))) + ADVANTAGE_EPS)
    return torch.nan_to_num(centred, nan=0.0)


def token_entropies(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, seq]``: at position t the entropy of the distribution that predicts token t
    (from the logits at t - 1); 0 at t = 0."""
    logits = logits[:, :-1].float()
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(logits - logz)
    entropy = logz.squeeze(-1) - (probs * logits).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0))


class GRPO(Objective):
    """``objective=grpo``: see the module. ``cfg``: the ``objective`` section; :meth:`setup` reads
    the rollout's sampling temperature and ``max_completion_length`` from the run's config.

    Raises (at construction):
        ConfigError: an unknown ``loss_type``, importance level, reward scaling or estimator.
    """

    carries = {"labels": IGNORE_INDEX, "completion_mask": 0.0, "advantages": 0.0, "old_logps": 0.0, "ref_logps": 0.0,
               "behaviour_logps": 0.0, "segment": -1}
    reports_perplexity = False
    counted_unit = None
    online = True
    # The loss reads each completion token's tempered log-prob and the entropy (label_temperature):
    # the label head hands both without whole logits.
    label_logps_only = True
    label_entropy = True
    # Whether reward.functions are required (their advantages are the loss's signal).
    needs_rewards = True

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        get = (lambda key, default: cfg.get(key, default)) if cfg is not None else (lambda key, default: default)
        self.loss_type = str(get("loss_type", "dapo"))
        self.epsilon = float(get("epsilon", 0.2))
        high = get("epsilon_high", None)
        self.epsilon_high = float(high) if high is not None else self.epsilon
        self.level = str(get("importance_sampling_level", "token"))
        self.beta = float(get("beta", 0.0))
        self.num_iterations = int(get("num_iterations", 1))
        self.scale_rewards = str(get("scale_rewards", "group"))
        self.estimator = str(get("advantage_estimator", "grpo"))
        self.num_generations = int(get("num_generations", 8))
        self.mask_truncated = bool(get("mask_truncated_completions", False))
        self.correction = str(get("sampling_correction", "token_truncate"))
        self.correction_max = float(get("sampling_correction_max", 3.0))
        low = get("sampling_correction_min", None)
        self.correction_min = float(low) if low is not None else None
        # Whether batches carry a sampling policy other than π_old (set by setup from the rollout).
        self.behaviour = False
        for value, allowed, key in ((self.loss_type, LOSS_TYPES, "loss_type"),
                                    (self.level, IMPORTANCE_LEVELS, "importance_sampling_level"),
                                    (self.scale_rewards, SCALE_REWARDS, "scale_rewards"),
                                    (self.estimator, ADVANTAGE_ESTIMATORS, "advantage_estimator"),
                                    (self.correction, SAMPLING_CORRECTIONS, "sampling_correction")):
            if value not in allowed:
                raise ConfigError(f"objective.{key}={value!r} must be one of {', '.join(allowed)}")
        self.temperature = 1.0
        self.max_completion_length = 256
        clipped = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
        self.metric_names = ("entropy", *(("kl",) if self.beta else ()), *clipped, "_tokens", "_sequences")
        # Token means over the global batch's completion tokens; the clip ratios at sequence
        # level over its completions (TRL's global_masked_mean). "_" metrics are denominators only.
        per_sequence = self.level == "sequence"
        self.metric_denominators = {"entropy": "_tokens", "kl": "_tokens",
                                    **{name: "_sequences" if per_sequence else "_tokens" for name in clipped}}

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        """A reference policy only for the KL term (``beta`` > 0; 0: none is built)."""
        return self.beta != 0.0

    @property
    def label_temperature(self) -> float:  # type: ignore[override]
        """The label head divides the logits by the sampling temperature (see the module)."""
        return self.temperature

    @property
    def steps_per_batch(self) -> int:
        """μ (``num_iterations``): optimizer steps per generation batch."""
        return self.num_iterations

    @property
    def on_policy(self) -> bool:
        """Each generation batch trains one optimizer step: π_old is the current policy."""
        return self.num_iterations == 1

    def setup(self, cfg: Any) -> None:
        """Read the sampling temperature (the log-probs are the tempered distribution's),
        ``max_completion_length`` (``dr_grpo``'s constant) and whether the sampling policy may
        differ from π_old (:meth:`samples_off_policy`) from the run's ``rollout`` section."""
        rollout = cfg.get("rollout") if cfg is not None else None
        if rollout is not None:
            self.temperature = float(rollout.temperature)
            self.max_completion_length = int(rollout.max_completion_length)
            self.correct_sampling(self.samples_off_policy(rollout))

    @staticmethod
    def samples_off_policy(rollout: Any) -> bool:
        """Whether ``rollout``'s completions may come from a policy other than π_old: generated
        asynchronously (``max_staleness`` > 0), or by vLLM (other kernels, older weights)."""
        return bool(rollout.async_generation and int(rollout.max_staleness) > 0) or str(rollout.engine) == "vllm"

    def correct_sampling(self, on: bool) -> None:
        """Weight the surrogate by π_old / π_behaviour (``behaviour_logps``) when ``on`` and
        ``sampling_correction`` is not ``none``; its metrics join :attr:`metric_names`."""
        self.behaviour = on and self.correction != "none"
        if self.behaviour and "importance_ratio/mean" not in self.metric_names:
            self.metric_names = (*self.metric_names[:-2], "importance_ratio/mean", "importance_ratio/corrected",
                                 *self.metric_names[-2:])
            unit = "_sequences" if self.correction.startswith("sequence") else "_tokens"
            self.metric_denominators = {**self.metric_denominators, "importance_ratio/mean": unit,
                                        "importance_ratio/corrected": unit}

    def importance_weights(self, old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                           segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The truncated importance weights of ``sampling_correction`` (TRL 1.16's
        ``vllm_importance_sampling_mode``): ``(w, ratio, corrected)``, each ``[rows, seq]``: the
        weight, the uncorrected ratio π_old / π_behaviour, and 1.0 where a bound changed it; per
        token (token modes), or each completion's (sequence modes: of its log-ratio summed over
        ``mask``, on every token of ``segment``'s completion). All detached."""
        diff = ((old - behaviour) * mask).detach()
        if self.correction.startswith("sequence"):
            diff = per_completion(diff, segment, broadcast=True)
        ratio = torch.exp(diff)
        low = self.correction_min if self.correction_min is not None else 0.0
        outside = (ratio > self.correction_max) | (ratio < low)
        if self.correction.endswith("truncate"):
            weight = ratio.clamp(min=low, max=self.correction_max)
        else:
            weight = ratio.masked_fill(outside, 0.0)
        return weight, ratio, outside.to(ratio.dtype)

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shape = batch["input_ids"].shape
        for key in ("completion_mask", "advantages", "old_logps", "ref_logps", "behaviour_logps"):
            batch.setdefault(key, torch.zeros(shape, dtype=torch.float32))
        batch.setdefault("segment", torch.arange(shape[0])[:, None].expand(shape).contiguous())
        return batch

    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's share of the global batch's normaliser (see the module): its
        completions (``grpo``), completion tokens (``dapo``), completions × ``max_completion_length``
        (``dr_grpo``), or 1 (``bnpo``: one token mean per micro-batch)."""
        completions = completion_segments(batch)[1].sum()
        if self.loss_type == "grpo":
            return completions
        if self.loss_type == "dr_grpo":
            return completions * self.max_completion_length
        if self.loss_type == "dapo":
            return batch["completion_mask"].sum()
        return (completions > 0).to(completions.dtype)

    def token_logps(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 ``[rows, seq]``: each completion token's log-prob under the tempered policy, from
        ``[rows, seq, vocab]`` logits or the label head's ``[rows, seq]`` next-label log-probs
        (already tempered: :attr:`label_temperature`)."""
        if logits.dim() == 2:
            return completion_token_logps(logits, labels)
        return completion_token_logps(logits.float() / self.temperature, labels)

    def _logps_entropies(self, output: torch.Tensor, batch: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``[rows, seq]`` each completion token's tempered log-prob (with grad) and the
        entropy of the tempered distribution it was drawn from (0 at t = 0), from whole logits
        ``[rows, seq, vocab]`` or from the label head's log-probs and its ``label_entropy``."""
        if output.dim() == 2:
            entropies = torch.nn.functional.pad(batch["label_entropy"][:, :-1], (1, 0))
            return completion_token_logps(output, batch["labels"]), entropies
        logits = output.float() / self.temperature
        logps = completion_token_logps(logits, batch["labels"])
        with torch.no_grad():
            entropies = token_entropies(logits)
        return logps, entropies

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        labels, mask, advantages = batch["labels"], batch["completion_mask"], batch["advantages"]
        segment, first = completion_segments(batch)
        logps, entropies = self._logps_entropies(output, batch)
        old = logps.detach() if self.on_policy else batch["old_logps"]
        log_ratio = logps - old
        if self.level == "sequence":  # each completion's masked mean log-ratio, on each of its tokens
            log_ratio = per_completion(log_ratio * mask, segment, broadcast=True) / per_completion(
                mask, segment, broadcast=True).clamp(min=1.0)
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        metrics: dict[str, torch.Tensor] = {}
        if self.behaviour:
            weight, behaviour_ratio, corrected = self.importance_weights(old, batch["behaviour_logps"], mask, segment)
            per_token = per_token * weight
            unit = first.float() if self.correction.startswith("sequence") else mask
            metrics["importance_ratio/mean"] = (behaviour_ratio * unit).sum()
            metrics["importance_ratio/corrected"] = (corrected * unit).sum()
        if self.beta:
            gap = batch["ref_logps"] - logps
            kl = (torch.exp(gap) - gap - 1) * ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = (kl.detach() * mask).sum()
        masked = per_token * mask
        if self.loss_type == "grpo":
            loss = (per_completion(masked, segment) / per_completion(mask, segment).clamp(min=1.0)).sum()
        elif self.loss_type == "bnpo":
            loss = masked.sum() / mask.sum().clamp(min=1.0)
        else:
            loss = masked.sum()
        with torch.no_grad():
            metrics["entropy"] = (entropies * mask).sum()
            # At sequence level one decision per completion (its ratio and advantage are the same
            # on all its tokens): counted on its first token.
            weigh = first.float() if self.level == "sequence" else mask
            low = ((ratio < 1 - self.epsilon) & (advantages < 0)).float()
            high = ((ratio > 1 + self.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"] = (low * weigh).sum()
            metrics["clip_ratio/high_mean"] = (high * weigh).sum()
            metrics["clip_ratio/region_mean"] = (torch.maximum(low, high) * weigh).sum()
            metrics["_tokens"] = mask.sum()
            metrics["_sequences"] = first.sum().to(torch.float32)
        return LossSums(loss, metrics)


def completion_segments(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which completion each token belongs to: ``(segment, first)``, int64 ``[rows, seq]`` ids
    (the batch's ``segment`` where packed rows hold several completions, else the row; -1 off
    the completions' tokens) and bool ``[rows, seq]``, True on each completion's first token."""
    labels = batch["labels"]
    completion = labels != IGNORE_INDEX
    segment = batch.get("segment")
    if segment is None:
        segment = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(labels)
    segment = segment.masked_fill(~completion, -1)
    before = torch.nn.functional.pad(segment[:, :-1], (1, 0), value=-1)
    return segment, completion & (segment != before)


def per_completion(values: torch.Tensor, segment: torch.Tensor, broadcast: bool = False) -> torch.Tensor:
    """``values`` ``[rows, seq]`` summed over each completion of ``segment``
    (:func:`completion_segments`): ``[rows * seq]`` sums by id (0 for ids no token has; no host
    sync for the number of completions), or with ``broadcast`` each token's completion's sum
    ``[rows, seq]`` (0 off the completions). Differentiable."""
    keep = segment >= 0
    sums = torch.zeros(segment.numel(), dtype=values.dtype, device=values.device).index_add(
        0, segment[keep], values[keep])
    if not broadcast:
        return sums
    return torch.where(keep, sums[segment.clamp(min=0)], torch.zeros((), dtype=values.dtype, device=values.device))
