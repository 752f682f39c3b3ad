"""On-policy distillation (``objective=distill``): the student (the policy) samples completions of
the prompts (:mod:`llmtrain.rollout`, as GRPO's), a frozen teacher scores every position of them,
and the loss is the per-token reverse KL from the student to the teacher over the whole vocabulary
(generalised knowledge distillation with β = 1: Agarwal et al. 2024, "On-policy distillation of
language models", eq. 2 and algorithm 1; the on-policy distillation recipe of Lu et al. 2025,
Thinking Machines, with the KL summed over the vocabulary rather than estimated from the sampled
token)::

    loss = Σ_t Σ_v p_s(v | x_<t) (log p_s(v | x_<t) - log p_t(v | x_<t)) / (completion tokens)

over the model's completion tokens of the global batch (p = softmax of the logits over the
sampling temperature, for student and teacher alike). Its gradient is the exact gradient of that
sum for the fixed sampled sequences (GKD's; the sequences' dependence on the student is not
differentiated, as in GKD). With ``lmbda`` < 1 a generation batch is, with probability 1 - λ
(seeded per batch: the same choice on every rank), the data's own completions (the prompts'
``completion`` column) instead of the student's samples: GKD's mixture of on-policy and fixed
data (section 3.2).

The teacher (``teacher``: a model group name of ``conf/model``, e.g. ``smollm2_135m``, or a
Hugging Face folder) is laid out like a frozen reference copy
(:meth:`llmtrain.engine.base.Engine.frozen_copy`: sharded under ZeRO-3 and FSDP2, replicated
elsewhere) and must share the student's tokenizer (its logits' width is checked at start-up).
Its log-probs reach the loss as the ``teacher_logps`` carry, ``[rows, seq, vocab]`` fp32 (at
position t the distribution that predicts token t): a micro-batch's share is rows × seq × vocab
× 4 bytes. Reward functions are optional: they are logged, not trained on.

Metrics: ``teacher_kl`` (the loss's per-token KL, also logged on its own), ``sampled_kl`` (the
sampled tokens' log p_s - log p_t, the one-sample estimate the 2025 recipe uses), ``entropy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llmtrain.common.errors import ConfigError
from llmtrain.objectives.base import LossSums
from llmtrain.objectives.grpo import GRPO, completion_segments, token_entropies

CONF_MODELS = Path(__file__).resolve().parents[2] / "conf" / "model"


def teacher_model_config(spec: str) -> Any:
    """The teacher's model config from ``objective.teacher``: a Hugging Face folder
    (``source=pretrained``), or the name of a ``conf/model`` group.

    Raises:
        ConfigError: empty, or neither an existing folder nor a model group (naming both fixes).
    """
    from omegaconf import OmegaConf

    from llmtrain.config.schema import ModelConfig

    if not spec:
        raise ConfigError("objective=distill needs objective.teacher: a conf/model group name (e.g. smollm2_135m) or "
                          "a Hugging Face model folder")
    base = OmegaConf.structured(ModelConfig)
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return OmegaConf.merge(base, {"name": "teacher", "source": "pretrained", "path": str(folder.resolve())})
    group = CONF_MODELS / f"{spec}.yaml"
    if group.is_file():
        return OmegaConf.merge(base, OmegaConf.load(group))
    raise ConfigError(f"objective.teacher={spec!r} is neither a folder nor a model group of conf/model "
                      f"({', '.join(sorted(p.stem for p in CONF_MODELS.glob('*.yaml')))}); give a Hugging Face folder "
                      "(e.g. a `python -m llmtrain.export` output) or a group name")


class Distill(GRPO):
    """``objective=distill``: see the module. The rollout's fields (``num_generations``,
    ``mask_truncated_completions``) are GRPO's; ``teacher`` and ``lmbda`` its own."""

    carries = {**GRPO.carries, "teacher_logps": 0.0}
    reference_key = "teacher_logps"
    needs_rewards = False
    # The loss reads the whole tempered distribution (the KL to the teacher's), not GRPO's label log-probs.
    label_logps_only = False
    label_entropy = False

    def __init__(self, cfg: Any = None):
        get = (lambda key, default: cfg.get(key, default)) if cfg is not None else (lambda key, default: default)
        # GRPO's rollout fields only: its loss fields (loss_type, beta, ...) do not apply here.
        super().__init__({"name": "distill", "num_generations": int(get("num_generations", 1)), "loss_type": "dapo",
                          "mask_truncated_completions": bool(get("mask_truncated_completions", False)),
                          "sampling_correction": "none"})
        self.cfg = cfg
        self.teacher = str(get("teacher", "") or "")
        self.lmbda = float(get("lmbda", 1.0))
        self.num_iterations = 1
        self.metric_names = ("teacher_kl", "sampled_kl", "entropy", "_tokens", "_sequences")
        self.metric_denominators = {"teacher_kl": "_tokens", "sampled_kl": "_tokens", "entropy": "_tokens"}

    @property
    def needs_reference(self) -> bool:  # type: ignore[override]
        """The teacher is built and run like a reference (its outputs under :attr:`reference_key`)."""
        return True

    def correct_sampling(self, on: bool) -> None:
        """No importance correction: the loss is a divergence on fixed sequences, not a
        policy-gradient surrogate, so which policy sampled them does not bias it."""
        self.behaviour = False

    def reference_model(self) -> Any:
        """The teacher's model config (:func:`teacher_model_config`)."""
        return teacher_model_config(self.teacher)

    def reference_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 ``[rows, seq, vocab]``: at position t the teacher's tempered log-distribution over
        token t (from its logits at t - 1); 0 at t = 0."""
        logps = F.log_softmax(logits[:, :-1].float() / self.temperature, dim=-1)
        return F.pad(logps, (0, 0, 1, 0))

    def normaliser(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's model-written completion tokens (the loss is their mean KL)."""
        return batch["completion_mask"].sum()

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch = super().prepare(batch)
        batch.setdefault("teacher_logps", torch.zeros((*batch["input_ids"].shape, 1), dtype=torch.float32))
        return batch

    def loss_sums(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossSums:
        labels, mask = batch["labels"], batch["completion_mask"]
        teacher = batch["teacher_logps"]
        if teacher.shape[-1] not in (1, output.shape[-1]):  # 1: a batch without targets (evaluation's filler)
            raise ConfigError(f"objective.teacher={self.teacher!r} has {teacher.shape[-1]} logits per token, the "
                              f"student {output.shape[-1]}: distillation needs one vocabulary (the same tokenizer)")
        student = F.log_softmax(output[:, :-1].float() / self.temperature, dim=-1)
        student = F.pad(student, (0, 0, 1, 0))  # position t: the distribution over token t
        kl = (student.exp() * (student - teacher)).sum(-1)  # [rows, seq]
        loss = (kl * mask).sum()
        with torch.no_grad():
            targets = labels.clamp(min=0)[..., None]
            sampled = (student.gather(-1, targets) - teacher.gather(-1, targets))[..., 0]
            metrics = {"teacher_kl": (kl.detach() * mask).sum(), "sampled_kl": (sampled * mask).sum(),
                       "entropy": (token_entropies(output.float() / self.temperature) * mask).sum(),
                       "_tokens": mask.sum(),
                       "_sequences": completion_segments(batch)[1].sum().to(torch.float32)}
        return LossSums(loss, metrics)
