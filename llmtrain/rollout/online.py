"""An online objective's parts for the trainer (GRPO, on-policy distillation), set up in one call
(:func:`setup_online`): the sampler (:func:`llmtrain.rollout.build_sampler`), the reward
functions tried before anything is written, the multi-turn environment, distillation's teacher
(checked, then laid out by the engine), the step's :class:`~llmtrain.rollout.rollout.Rollout`
and its held-out evaluation with progress.

What only the layers above may do is handed in as functions: building a model or reading its
config (:mod:`llmtrain.models`), writing the policy for a server (:mod:`llmtrain.checkpoint`) and
the held-out loss (:mod:`llmtrain.evaluation`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain import data
from llmtrain.common.errors import ConfigError
from llmtrain.monitoring import console
from llmtrain.objectives import Objective, reference
from llmtrain.rollout import build_environment, build_rewards, build_sampler, environment_reward
from llmtrain.rollout.progress import counting
from llmtrain.rollout.rollout import Rollout
from llmtrain.rollout.scoring import RewardError


class Online:
    """An online objective's sampler, reward functions and environment (from :func:`setup_online`),
    and what the trainer builds from them once the engine exists: the teacher
    (:meth:`setup_teacher`), the rollout (:meth:`setup_rollout`), the held-out evaluation
    (:meth:`held_out_rewards`)."""

    def __init__(self, cfg: Any, objective: Objective, tokenizer: Any, env: Any, dims: Any, phases: Any,
                 sampler: Any, functions: list, environment: Any):
        self.cfg, self.objective, self.tokenizer, self.env, self.dims, self.phases = (cfg, objective, tokenizer, env,
                                                                                      dims, phases)
        self.sampler, self.functions, self.environment = sampler, functions, environment
        self.teacher: Any = None  # distillation's LiveReference, once set up

    def setup_teacher(self, engine: Any, build: Callable[[Any], torch.nn.Module]) -> reference.LiveReference:
        """The objective's own frozen reference model (distillation's teacher) built by
        ``build(model_cfg)`` and laid out like a reference copy by ``engine``. Collective call.

        Raises:
            ConfigError: an engine that cannot lay it out.
        """
        teacher = self.objective.reference_model()
        self.phases.begin("teacher", f"objective.teacher={self.objective.teacher} (model source {teacher.source})")
        forward = engine.frozen_copy(lambda: build(teacher), teacher.source == "config")
        if forward is None:
            raise ConfigError(f"objective.teacher: the {type(engine).__name__} engine of recipe "
                              f"{self.cfg.recipe.name} cannot lay out a frozen teacher; use a data-parallel, ZeRO or "
                              "FSDP recipe")
        self.teacher = reference.LiveReference(forward, self.objective.reference_outputs)
        return self.teacher

    def setup_rollout(self, engine: Any, micro_batches: Any, run_dir: Path, log_table: Callable[[list, int], None],
                      held_out_loss: Callable[[list[dict]], dict[str, float]], saved: dict[str, torch.Tensor],
                      rank_state: dict[str, Callable]) -> Rollout:
        """The step's batch source: completions of the data's prompts sampled and scored
        (:class:`Rollout`), continued from a resumed checkpoint's ``saved`` state and registered in
        the checkpoints' ``rank_state``. ``held_out_loss(batches)``: the held-out loss of prepared
        batches (distillation's held-out KL to the teacher)."""
        def divergence(batches: list[dict]) -> dict[str, float]:
            """Distillation's held-out loss: the teacher's outputs on greedy completions of the
            held-out prompts, then the objective's loss over them (``val/loss``: the per-token KL)."""
            batches = [self.objective.prepare(b) for b in batches]
            reference.annotate_batches(self.teacher, engine, batches, self.env.device, self.objective.reference_key)
            return held_out_loss(batches)

        rollout = Rollout(self.cfg, engine, self.objective, self.sampler, micro_batches, self.tokenizer,
                          data.pad_id_of(self.tokenizer), self.functions, run_dir, self.env.is_main, log_table,
                          self.environment, divergence if self.objective.reference_model() is not None else None)
        rollout.load_state_dict(saved)
        rank_state["rollout"] = rollout.state_dict
        return rollout

    def held_out_rewards(self, rollout: Rollout, val_batches: list[dict], progress_bar: bool) -> dict[str, float]:
        """The held-out evaluation (:meth:`Rollout.evaluate`) with rank 0's progress through its
        prompts (a bar on a terminal, else lines): minutes on a CPU."""
        prompts = sum(len(b["prompts"]) for b in val_batches)
        share = " (rank 0's share)" if self.dims.dp > 1 else ""
        progress = console.CountProgress(f"held-out evaluation{share}", prompts, "prompts", self.env.is_main,
                                         progress_bar and console.interactive())
        with counting(self.sampler, progress):
            return rollout.evaluate(val_batches)

    def close(self) -> None:
        """Stop what the rollout engine started (a vLLM server); idempotent."""
        self.sampler.close()


def held_out_detail(cfg: Any, online: bool) -> str:
    """What the first evaluation does, for its start-up line."""
    if not online:
        return f"held-out loss of up to {cfg.trainer.eval_samples} samples"
    return (f"a greedy completion of each of up to {cfg.trainer.eval_samples} held-out prompts (trainer.eval_samples), "
            f"up to {cfg.rollout.max_completion_length} tokens each; trainer.eval_every=0 skips it")


def setup_online(cfg: Any, objective: Objective, tokenizer: Any, splits: Any, env: Any, dims: Any, phases: Any,
                 vocab_of: Callable[[Any], int], vocab_size: int,
                 publish: Callable[[Path, str, list[int]], Any]) -> Online | None:
    """An online objective's sampler, reward functions (each tried on two prompts before
    anything is written: :func:`llmtrain.rollout.build_rewards`) and multi-turn environment, with
    distillation's teacher checked (``vocab_of(model_cfg)``: its vocabulary size, against the
    student's ``vocab_size``); None for other objectives. ``publish(directory, part, end_ids)``
    writes the policy for an engine that serves it elsewhere (vLLM).

    Raises:
        ConfigError: a rollout engine, reward function or environment that cannot be built, a
            reward function that fails the try, or a teacher of another vocabulary.
    """
    if not objective.online:
        return None
    if objective.reference_model() is not None:
        _check_teacher(cfg, objective, vocab_of, vocab_size)
    probe = [splits.train[i] for i in range(min(2, len(splits.train)))]
    _check_image_prompts(cfg, probe)
    end_ids = data.end_token_ids(cfg.data, tokenizer)
    sampler = build_sampler(cfg, tokenizer, end_ids)
    sampler.check()
    sampler.publish = lambda directory, part: publish(directory, part, end_ids)
    if getattr(objective, "lmbda", 1.0) < 1 and probe and "completion" not in probe[0]:
        raise ConfigError(f"objective.lmbda={objective.lmbda}: the batches the student does not sample are the "
                          "data's own completions, read from each record's 'completion' column, which the records "
                          f"of data.path lack (theirs: {', '.join(k for k in probe[0] if k != 'prompt_ids')}); add "
                          "it or set objective.lmbda=1")
    # gsm8k's answers are checked over more records than the probe: a few may lack a number.
    answers = [splits.train[i].get("answer") for i in range(min(64, len(splits.train)))] \
        if probe and "answer" in probe[0] else None
    try:
        functions = build_rewards(cfg, probe, env.device, answers) if cfg.reward.functions else []
    except RewardError as err:
        raise ConfigError(f"reward.functions: {err}") from err.__cause__
    environment = build_environment(cfg)
    if environment is not None and environment.gives_rewards:  # one more function: weighted, logged
        functions.append(environment_reward())
    if not functions and objective.reference_model() is None:
        raise ConfigError(f"reward.functions is empty and rollout.environment={cfg.rollout.environment} gives no "
                          "rewards: give at least one reward function, e.g. reward.functions=[gsm8k]")
    return Online(cfg, objective, tokenizer, env, dims, phases, sampler, functions, environment)


def _check_image_prompts(cfg: Any, probe: list[dict]) -> None:
    """Image prompts (samples with ``images``: :mod:`llmtrain.data.prompts`) sample on the ``hf``
    and ``vllm`` engines (vLLM where it serves the architecture:
    :func:`llmtrain.rollout.vllm_images.check_architecture`), one sequence per row, single-turn:
    what is not built for them yet is refused.

    Raises:
        ConfigError: image prompts with another ``rollout.engine`` (one of your own),
            ``rollout.packing`` or a multi-turn ``rollout.environment`` (each naming the field).
    """
    if not probe or "images" not in probe[0]:  # (every sample has it when the data has an images column)
        return
    r = cfg.rollout
    for field, value, fine, fix in (("rollout.engine", r.engine, ("hf", "vllm"), "rollout.engine=hf"),
                                    ("rollout.packing", r.packing, (False,), "rollout.packing=false"),
                                    ("rollout.environment", r.environment or "", ("",), "leave rollout.environment unset")):
        if value not in fine:
            value = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(f"{field}={value}: image prompts (the data's images column) are sampled on the hf "
                              f"and vllm engines only, one sequence per row, single-turn, for now; {fix}")


def _check_teacher(cfg: Any, objective: Objective, vocab_of: Callable[[Any], int], vocab_size: int) -> None:
    """A distillation teacher that exists and shares the student's vocabulary (read from the
    two model configs), before anything is written.

    Raises:
        ConfigError: naming the teacher and both vocabulary sizes.
    """
    width = vocab_of(objective.reference_model())
    if width != vocab_size:
        raise ConfigError(f"objective.teacher={objective.teacher!r} has {width} logits per token, the student "
                          f"model {cfg.model.name} {vocab_size}: distillation compares the two "
                          "distributions token by token, so they need one tokenizer and vocabulary")
