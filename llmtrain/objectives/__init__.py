"""Training objectives: what a micro-batch carries to the loss, what the model must return, and
the loss the optimizer minimises.

An :class:`Objective` is the one place a loss is defined. Engines and pipeline schedules call it
on the model's output and never import a loss, so a new objective (preference losses, a memory-
lean chunked loss, a test's token-weighted loss) is a new module here, picked by the Hydra group
``objective=NAME`` or by ``objective.target=module:Class``; no engine changes.

Normalisation contract (unchanged from next-token training): each micro-batch's summed loss is
divided by the normaliser of the whole global batch (:meth:`Objective.normaliser` summed over
every micro-batch on every data-parallel rank), so gradient accumulation and data parallelism
give exactly the gradient of one big batch, whatever the split.
"""

from __future__ import annotations

from typing import Any

from llmtrain.common.errors import ConfigError, import_object
from llmtrain.objectives.base import LossSums, Objective
from llmtrain.objectives.causal_lm import CausalLM
from llmtrain.objectives.distill import Distill
from llmtrain.objectives.grpo import GRPO
from llmtrain.objectives.preference import DPO, KTO, ORPO, PairObjective, Reward, SimPO

__all__ = ["BUILT_IN", "CausalLM", "DPO", "Distill", "GRPO", "KTO", "LossSums", "ORPO", "Objective", "PairObjective", "Reward", "SimPO",
           "build_objective"]

BUILT_IN: dict[str, type[Objective]] = {"causal_lm": CausalLM, "dpo": DPO, "simpo": SimPO, "orpo": ORPO,
                                        "reward": Reward, "kto": KTO, "grpo": GRPO,
                                        "distill": Distill}

# Names the trainer logs under train/ and val/ itself: an objective's metric must not overwrite them.
RESERVED_METRICS = frozenset({"loss", "perplexity", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens_seen",
                              "samples_seen", "skipped_update"})


def build_objective(objective_cfg: Any) -> Objective:
    """The objective ``objective_cfg`` names: ``objective.target`` (``"module:Class"``, a subclass
    of :class:`Objective` built with the config section) when set, else the built-in
    ``objective.name``.

    Raises:
        ConfigError: the name is unknown, or the target cannot be imported or is no Objective.
    """
    name = objective_cfg.get("name", "causal_lm") if objective_cfg is not None else "causal_lm"
    target = objective_cfg.get("target") if objective_cfg is not None else None
    if not target:
        if name not in BUILT_IN:
            raise ConfigError(f"objective.name={name!r} is not a built-in objective (choose one of "
                              f"{', '.join(sorted(BUILT_IN))}, or set objective.target=module:Class)")
        return BUILT_IN[name](objective_cfg)
    class_name = str(target).partition(":")[2]
    cls = import_object(target, "objective.target", "importable.module:ClassName")
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise ConfigError(f"objective.target={target!r} is not a subclass of llmtrain.objectives.Objective")
    try:
        objective = cls(objective_cfg)
    except TypeError as err:  # abstract methods left, or another constructor signature
        raise ConfigError(f"objective.target={target!r} cannot be built as {class_name}(objective_cfg): {err}") from None
    clashes = sorted(set(objective.metric_names) & RESERVED_METRICS)
    if clashes:
        raise ConfigError(f"objective.target={target!r} names metrics {clashes}, which the trainer logs itself "
                          f"(train/NAME, val/NAME); rename them")
    return objective
