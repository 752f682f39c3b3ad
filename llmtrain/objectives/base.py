"""The objective interface every engine and pipeline schedule calls (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch

from llmtrain.common.errors import ConfigError


@dataclass
class LossSums:
    """One micro-batch's loss, summed (not averaged) over its loss units.

    Attributes:
        loss: fp32 0-dim tensor with a graph: the summed loss (e.g. token cross-entropy summed
            over target tokens). Engines divide it by the global batch's normaliser.
        metrics: 0-dim tensors, summed over the same units, keyed by the objective's
            ``metric_names``; logged as ``train/NAME`` (``val/NAME`` in evaluation) after the
            same world sum and division by the normaliser as the loss.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(ABC):
    """A training objective.

    Class attributes:
        carries: batch keys the loss reads besides the model output, each ``[micro_batch, seq]``,
            with the value that pads them (the pipeline engine right-pads a step's micro-batches to
            one length and hands these keys to its last stage).
        model_output: what the loss needs from the model: ``"logits"`` (``[B, T, V]``). A loss
            that reads the last hidden states and the output head (to avoid the full logits) will
            declare ``"hidden"``; no engine provides it yet, and :func:`check_supported` says so.
        metric_names: names of :attr:`LossSums.metrics`, in the order engines stack them.
        reports_perplexity: exp(loss) is a perplexity (next-token losses), logged as such.
        needs_reference: the loss reads ``ref_logps``, the frozen reference policy's per-token
            log-probs, which the trainer fills in before each step (or precomputes).
        counted_unit: the normaliser's unit (``"pairs"``), when evaluation logs its held-out count
            as ``val/UNIT`` (for a standard error of a held-out mean); None: not logged.
        metric_denominators: ``{metric: other metric}``: the logged value is the metric's world sum
            over the other's (a mean over a subset, e.g. KTO's desirable examples) rather than over
            the normaliser.
        label_logps_only: the loss reads the logits only through each position's log-probability
            of the next label (``labels[:, t + 1]``), so engines with a label head
            (``trainer.logits_at_labels_only``, the default for built-in objectives and for classes
            that set this themselves, or ``trainer.loss_chunk_tokens``) hand :meth:`loss_sums`
            fp32 ``[B, T]`` label log-probs (0 where the label is -100, and at the last position)
            instead of ``[B, T, V]`` logits (:mod:`llmtrain.models.chunked_loss`); tell them apart
            by ``output.dim()``.
        label_temperature: with the label head, the log-probs are of the logits divided by this
            (GRPO's sampling temperature; 1 for every other built-in).
        label_entropy: with the label head, the loss also reads each position's entropy of that
            distribution (GRPO's metric): engines hand it in the batch as ``label_entropy`` (fp32
            ``[B, T]``, aligned as the label log-probs), and the head runs in chunks of positions
            (:class:`llmtrain.models.chunked_loss.LabelHead`'s ``bounded``).
        online: the trainer samples the objective's batches from the policy (an online RL
            objective; :mod:`llmtrain.rollout`) instead of reading them from the data, which then
            holds prompts.
        reference_key: the batch key the trainer puts the live reference's outputs under
            (``ref_logps``; a distillation teacher's ``teacher_logps``).
    """

    def average(self, sums: dict[str, float], normaliser: float) -> dict[str, float]:
        """The logged metric values from their world sums (``sums``, keyed by name) and the
        normaliser's: each over the normaliser, or over its :attr:`metric_denominators` metric's
        sum (NaN where that is 0)."""
        out = {}
        for name, total in sums.items():
            other = self.metric_denominators.get(name)
            if other is None:
                out[name] = total / normaliser
            else:
                out[name] = total / sums[other] if sums[other] else float("nan")
        return out

    carries: ClassVar[Mapping[str, float]] = {"labels": -100}
    model_output: ClassVar[str] = "logits"
    metric_names: ClassVar[tuple[str, ...]] = ()
    # Whether exp(loss) means anything (the trainer then logs val/perplexity).
    reports_perplexity: ClassVar[bool] = True
    # Whether batches need the reference policy's log-probs (``ref_logps``) before the step.
    needs_reference: ClassVar[bool] = False
    # What the normaliser counts, when evaluation should log the count (``val/pairs``).
    counted_unit: ClassVar[str | None] = None
    # Metrics averaged over another metric's sum instead of the normaliser (name -> denominator).
    metric_denominators: ClassVar[Mapping[str, str]] = {}
    # Whether loss_sums also accepts [B, T] next-label log-probs (the label head, llmtrain.models.chunked_loss).
    label_logps_only: ClassVar[bool] = False
    # The label head's temperature, and whether it also hands the loss each position's entropy.
    label_temperature: float = 1.0
    label_entropy: ClassVar[bool] = False
    # Whether batches are sampled from the policy (online RL) rather than read from the data.
    online: ClassVar[bool] = False
    # The batch key the live reference's outputs go to (a distillation teacher's: its own).
    reference_key: ClassVar[str] = "ref_logps"

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    def reference_model(self) -> Any | None:
        """The model config of a frozen model other than the policy that the live reference runs
        (distillation's teacher), or None: the reference, if any, is the policy's own
        (:mod:`llmtrain.objectives.reference`). Its outputs go to :attr:`reference_key` through
        :meth:`reference_outputs`."""
        return None

    def reference_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What the loss reads from :meth:`reference_model`'s logits (``[rows, seq, vocab]``):
        defined by objectives that name such a model."""
        raise NotImplementedError(f"objective {self.name!r} names no reference model")

    def setup(self, run_cfg: Any) -> None:
        """Read what the loss needs from other sections of the run's config (``run_cfg``), once,
        before training; the default reads nothing."""

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps that train on one batch of the data (GRPO's ``num_iterations``): the
        data loader yields one every that many steps."""
        return 1

    @property
    def name(self) -> str:
        """``objective.name`` (a built-in's name, or the label of ``objective.target``), else the
        class name."""
        return (self.cfg.get("name") if self.cfg is not None else None) or type(self).__name__

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add what the loss needs to a host micro-batch from the data loader (``input_ids``,
        ``labels``, ``attention_mask``, packed rows' ``position_ids``, each ``[micro_batch, seq]``),
        before it moves to the device: every key of :attr:`carries` that the loader does not
        yield is made here, as a ``[micro_batch, seq]`` tensor. Runs on training and validation
        batches alike (and the evaluator's filler batch without targets); keep the loader's keys.
        The default adds nothing."""
        return batch

    @abstractmethod
    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """0-dim tensor on the batch's device: this micro-batch's share of the normaliser (target
        tokens for next-token losses; pairs for preference losses). No host sync. Summed over the
        global batch it divides the loss and every metric, and must be > 0."""

    @abstractmethod
    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        """The summed loss and metrics of one micro-batch from the model ``output`` (see
        :attr:`model_output`) and the batch's :attr:`carries` tensors: read only those (a pipeline's
        last stage gets nothing else, right-padded with the :attr:`carries` pad values)."""

    def stacked(self, sums: LossSums) -> torch.Tensor:
        """float64 vector ``[1 + len(metric_names)]``: loss then metrics, detached (what engines
        accumulate over micro-batches and the trainer all-reduces).

        Raises:
            KeyError: ``sums.metrics`` lacks one of :attr:`metric_names` (named with the objective).
        """
        missing = [name for name in self.metric_names if name not in sums.metrics]
        if missing:
            raise KeyError(f"objective {self.name!r} declares metric_names {list(self.metric_names)} but its "
                           f"loss_sums returned no {', '.join(missing)}")
        values = [sums.loss.detach()] + [sums.metrics[name].detach() for name in self.metric_names]
        return torch.stack([v.reshape(()).to(torch.float64) for v in values])

    def check_supported(self, engine_name: str) -> None:
        """Refuse an objective whose :attr:`model_output` no engine provides yet.

        Raises:
            ConfigError: naming the objective and what it needs.
        """
        if self.model_output != "logits":
            raise ConfigError(f"objective {self.name!r} needs model_output={self.model_output!r}, which the "
                              f"{engine_name} engine does not provide (only logits)")
