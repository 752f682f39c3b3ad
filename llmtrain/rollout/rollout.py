"""One generation batch of online RL: this rank's prompts sampled G times each with the policy's
current weights, scored by the reward functions, turned into group-relative advantages and laid
out as the objective's training micro-batches (:mod:`llmtrain.objectives.grpo`'s carries).

Each prompt's G completions (a group) are sampled on the rank that holds the prompt, so group
statistics need no communication; the batch-wide numbers (``scale_rewards=batch``'s standard
deviation, the logged means) come from one all-reduce. A generation batch trains
``objective.num_iterations`` optimizer steps (μ, GRPO section 4.2): it is kept, with the policy's
log-probs at sampling time, until then, and a checkpoint taken in between holds it
(:meth:`Rollout.state_dict`), so a resume continues with the same completions.

With ``rollout.async_generation`` the batches of the next ``max_staleness`` steps are sampled
before (``hf``) or during (an engine that overlaps: vLLM) the step, with its weights; each
completion keeps its sampling policy's log-probs for the objective's importance correction, and
a checkpoint holds the batches sampled ahead. A multi-turn ``rollout.environment`` makes each
completion an episode (:mod:`llmtrain.rollout.environments`); ``rollout.packing`` packs the
training rows (:meth:`Rollout._layout`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llmtrain.common.images import IMAGE_INPUTS, processor_of
from llmtrain.data.vision import image_tensors
from llmtrain.objectives.grpo import group_advantages, nanstd
from llmtrain.parallel import distributed
from llmtrain.parallel.distributed import derived_seed
import llmtrain.rollout.completion_log as completion_log
import llmtrain.rollout.layout as layout
import llmtrain.rollout.progress as progress
from llmtrain.rollout.engines import RolloutEngine
from llmtrain.rollout.environments import Environment
from llmtrain.rollout.generate import Completion, SamplingInterrupted, completion_seed
from llmtrain.rollout.rewards import RewardFunction
from llmtrain.rollout.scoring import score

log = logging.getLogger("llmtrain")

# The tensors of a training micro-batch that a checkpoint keeps for a pending generation batch.
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "completion_mask", "advantages", "old_logps", "behaviour_logps")


@dataclass
class GenerationBatch:
    """This rank's share of one generation batch: its training micro-batches (host tensors, every
    carry but ``ref_logps`` filled), the batch's index, and its metrics (global; logged once, at the
    step that sampled it)."""

    generation: int
    batches: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass
class Sampled:
    """A generation batch's completions before scoring: ``groups`` (one list per sample of
    ``micro_batches``, flattened) or the :class:`~concurrent.futures.Future` of an engine sampling
    them in the background, and ``sampled_at``, the optimizer steps done by the weights that
    sample them (its staleness at step k is ``k - sampled_at``)."""

    generation: int
    sampled_at: int
    micro_batches: list[list[dict]]
    groups: "list[list[Completion]] | Future"
    on_policy: bool = True  # False: the data's own completions (distillation's λ < 1)



class Rollout:
    """Samples, scores and lays out the generation batches of an online objective (see the
    module): the trainer's batch source (:meth:`for_step`), its held-out evaluation
    (:meth:`evaluate`) and a checkpoint's per-rank state (:meth:`state_dict`).

    Args:
        cfg: the run's config (``rollout``, ``trainer.seed``).
        engine: the training engine (:class:`~llmtrain.engine.base.Engine`): its ``forward``
            for the sampling policy's log-probs, ``accumulation_steps``, device and dims.
        objective: the online objective (GRPO's fields).
        sampler: the :class:`~llmtrain.rollout.engines.RolloutEngine` that writes completions.
        prompts: this rank's prompt micro-batches (``{"prompts": [sample, ...]}``), one per call of
            ``next``, from the first generation batch still to sample.
        tokenizer: decodes completions for the reward functions.
        pad_id: right padding of the training micro-batches.
        functions: the reward functions.
        run_dir, is_main: where rank 0 writes ``completions/step_N.jsonl`` (every rank's, gathered).
        on_completions: called on rank 0 with those records and the step (1-based) after each
            file is written (the trainer's tracker: a wandb table).
        environment: multi-turn episodes' environment (:mod:`llmtrain.rollout.environments`),
            None for single-turn completions; its rewards reach the functions as the
            ``environment_reward`` column.
        held_out: the objective's held-out loss of micro-batches laid out from the greedy
            completions (distillation's KL to the teacher); its metrics join the evaluation's.
            Collective call.
    """

    def __init__(self, cfg: Any, engine: Any, objective: Any, sampler: RolloutEngine, prompts: Iterator[dict],
                 tokenizer: Any, pad_id: int, functions: list[RewardFunction], run_dir: Path, is_main: bool,
                 on_completions: Callable[[list[dict], int], None] | None = None, environment: Environment | None = None,
                 held_out: Callable[[list[dict[str, torch.Tensor]]], dict[str, float]] | None = None):
        self.cfg, self.engine, self.objective, self.sampler, self.prompts = cfg, engine, objective, sampler, prompts
        self.tokenizer, self.pad_id, self.functions = tokenizer, pad_id, functions
        self.run_dir, self.is_main, self.on_completions = run_dir, is_main, on_completions
        self.seed = cfg.trainer.seed
        self.environment = environment
        self.held_out = held_out
        self.group = objective.num_generations
        self.log_completions = int(cfg.rollout.log_completions)
        self.pending: GenerationBatch | None = None
        rollout = cfg.rollout
        self.asynchronous = bool(rollout.async_generation) and int(rollout.max_staleness) > 0
        self.staleness = int(rollout.max_staleness) if self.asynchronous else 0
        self.packing = bool(rollout.packing)
        # Generation batches sampled ahead, by generation (asynchronous generation; else the one being made).
        self.sampled: dict[int, Sampled] = {}
        self.warned_unscorable = False
        # Where a slow step's sampling progress goes instead of the log (the step bar's postfix).
        self.show: Callable[[str], None] | None = None
        # The preemption signal's name once one came (None: none): a step's sampling stops for it
        # (:meth:`_sample_step`). Set by the trainer.
        self.stop_when: Callable[[], str | None] | None = None

    # ---- a training step -------------------------------------------------------------------
    def for_step(self, step: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """The host micro-batches of optimizer step ``step`` (0-based) and the metrics to log with
        it (empty on steps that reuse a generation batch). A new generation batch every
        ``num_iterations`` steps; with ``rollout.async_generation`` the batches of the next
        ``max_staleness`` generations are sampled (or started) first, with this step's weights.
        Each generation reads ``accumulation`` prompt micro-batches. Collective call.

        Raises:
            SamplingInterrupted: a preemption signal came while the step sampled
                (:meth:`_sample_step`); what the call had sampled is dropped, so the rollout's
                state is that of the end of step ``step - 1`` (its prompt stream aside: a resume
                reads it from the train state).
        """
        generation = step // self.objective.num_iterations
        if self.pending is not None and self.pending.generation == generation:
            return self.pending.batches, {}
        started = time.perf_counter()
        self._resolve()  # in-flight samples finish before new weights go to their engine
        last = -(-int(self.cfg.trainer.max_steps) // self.objective.num_iterations) - 1
        before = set(self.sampled)
        try:
            for g in range(generation, min(generation + self.staleness, max(last, generation)) + 1):
                if g not in self.sampled:
                    self.sampled[g] = self._start(g, step)
        except SamplingInterrupted:
            for g in set(self.sampled) - before:  # sampled by this step, which never trains
                del self.sampled[g]
            raise
        entry = self.sampled.pop(generation)
        if isinstance(entry.groups, Future):  # started in this call (the first step): wait for it alone
            entry.groups = self._checked(entry.groups.result(), self._seeds_shape(entry.micro_batches))
        sampled = time.perf_counter()
        self.pending = self._finish(entry, step)
        metrics = {**self.pending.metrics, "rollout/generation_s": sampled - started,
                   "rollout/staleness": float(step - entry.sampled_at), **self.sampler.metrics()}
        return self.pending.batches, metrics

    def _start(self, generation: int, step: int) -> "Sampled":
        """Sample generation ``generation``'s completions with the current weights (optimizer
        step ``step``): in the background where the engine can (asynchronous generation with
        an engine that :attr:`~llmtrain.rollout.engines.RolloutEngine.overlaps`), else now; under
        asynchronous generation each completion then gets its sampling log-probs from the
        policy itself when the engine reports none."""
        micro_batches = [next(self.prompts)["prompts"] for _ in range(self.engine.accumulation_steps)]
        samples = [sample for micro in micro_batches for sample in micro]
        seeds = self._seeds(samples, generation)
        lmbda = float(getattr(self.objective, "lmbda", 1.0))
        if lmbda < 1 and random.Random(derived_seed(self.seed, "lmbda", generation)).random() >= lmbda:
            return Sampled(generation, step, micro_batches, self._data_completions(samples, seeds), on_policy=False)
        if self.asynchronous and self.sampler.overlaps and self.environment is None:
            self.engine.train(False)
            try:
                future = self.sampler.submit(self.engine, samples, seeds)
            finally:
                self.engine.train(True)
            return Sampled(generation, step, micro_batches, future)
        with self._sampling_progress(step, len(samples)):
            groups = self._sample_step(samples, seeds, step)
        if self.asynchronous and not all(c.logps is not None for group in groups for c in group):
            self._behaviour_logps(micro_batches, groups)
        return Sampled(generation, step, micro_batches, groups)

    def _sample_step(self, samples: list[dict], seeds: list[list[int | None]], step: int) -> list[list[Completion]]:
        """A step's completions (:meth:`_sample`), given up at the engine's next decode step once
        :attr:`stop_when` names a signal, so a preemption need not wait out minutes of sampling.
        The engine asks a local flag (ranks decode different numbers of steps, with no
        collectives between them); then every rank, interrupted or done, joins one all-reduce of
        whether any was interrupted, and all drop the step together or none does. Multi-turn
        episodes (one engine call per turn, each with a collective) and tensor-parallel peers
        (each decode forward is one) sample to the end: a signal there waits for the step's end.
        Collective call.

        Raises:
            SamplingInterrupted: on every rank, when any rank's sampling stopped.
        """
        stop_when = self.stop_when
        if stop_when is None or self.environment is not None or self.engine.dims.tp > 1:
            return self._sample(samples, seeds)
        self.sampler.stop_when = lambda: stop_when() is not None
        stopped: SamplingInterrupted | None = None
        try:
            groups = self._sample(samples, seeds)
        except SamplingInterrupted as err:
            stopped = err
        finally:
            self.sampler.stop_when = None
        flag = torch.tensor([float(stopped is not None)], dtype=torch.float64, device=self.engine.env.device)
        if float(distributed.all_reduce_sum(flag)[0]) == 0:
            return groups
        if self.is_main:
            log.warning("%s while step %d sampled (%s): the step is dropped; saving the state of step %d's end",
                        stop_when() or "a stop signal on another rank", step + 1,
                        stopped or "another rank stopped", step)
        raise SamplingInterrupted(f"step {step + 1}'s sampling stopped by {stop_when() or 'another rank'}")

    def _sampling_progress(self, step: int, prompts: int) -> contextlib.AbstractContextManager:
        """Rank 0's progress through this step's prompts while they are sampled
        (:func:`~llmtrain.rollout.progress.sampling_progress`); not for multi-turn episodes."""
        share = " (rank 0's share)" if self.engine.dims.dp > 1 else ""  # tp/pp/cp ranks sample every prompt
        return progress.sampling_progress(self.sampler, f"step {step + 1}, sampling{share}", prompts,
                                          self.is_main and self.environment is None, self.show)

    def _data_completions(self, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        """Each sample's own ``completion`` column (tokenized, ending with the end token, cut at
        ``rollout.max_completion_length``), once per seed: a batch the policy did not sample."""
        end = getattr(self.tokenizer, "eos_token_id", None)
        end_ids = sorted(self.sampler.sampling.end_ids)
        end = end if end is not None else (end_ids[0] if end_ids else None)
        limit = int(self.cfg.rollout.max_completion_length)
        groups = []
        for sample, row in zip(samples, seeds):
            ids = list(self.tokenizer(str(sample["completion"]), add_special_tokens=False)["input_ids"])
            ids += [end] if end is not None else []
            groups.append([Completion(ids[:limit], truncated=len(ids) > limit) for _ in row])
        return groups

    def _resolve(self) -> None:
        """Wait for every sample in flight (its groups checked)."""
        for entry in self.sampled.values():
            if isinstance(entry.groups, Future):
                entry.groups = self._checked(entry.groups.result(), self._seeds_shape(entry.micro_batches))

    def _finish(self, entry: "Sampled", step: int) -> GenerationBatch:
        """Score, weigh and lay out a sampled generation batch (see the module)."""
        micro_batches, groups = entry.micro_batches, entry.groups
        assert not isinstance(groups, Future)
        samples = [sample for micro in micro_batches for sample in micro]
        started = time.perf_counter()
        table = self._score(samples, groups, f"at step {step + 1}")
        rewards = self._weighted(table).view(len(samples), self.group)
        scored = time.perf_counter()
        stats = self._global_stats(table, rewards, groups)
        advantages = group_advantages(rewards, self.objective.estimator, self.objective.scale_rewards,
                                      batch_std=stats.pop("_batch_std"))
        batches, k = [], 0
        for micro in micro_batches:
            rows = [(sample, completion, float(advantages[k + j, i]))
                    for j, sample in enumerate(micro) for i, completion in enumerate(groups[k + j])]
            batches.append(self._layout(rows))
            k += len(micro)
        # The engine's own log-probs, to compare with the policy's: only when it sampled with these weights.
        check = not self.asynchronous and any(c.logps is not None for group in groups for c in group)
        if not self.objective.on_policy or check:
            # The sampling policy's log-probs: kept for μ > 1 steps, and compared with an engine's own.
            self._old_logps(batches)
        metrics = {**stats, **self._episode_stats(groups, "train"), "rollout/reward_s": scored - started}
        if float(getattr(self.objective, "lmbda", 1.0)) < 1:
            metrics["rollout/on_policy"] = float(entry.on_policy)
        if check:
            metrics.update(self._logp_check(batches, micro_batches, groups))
        if self.log_completions:  # every rank: its completions are gathered to rank 0
            self._write_completions(entry.generation * self.objective.num_iterations + 1, samples, groups, table,
                                    rewards, advantages)
        return GenerationBatch(entry.generation, batches, metrics)

    def _seeds(self, samples: list[dict], generation: int, greedy: bool = False) -> list[list[int | None]]:
        """Each sample's seeds: G seeded ones (:func:`completion_seed` of the prompt's record and
        CRC32, so the same prompt gets the same seeds on any layout), or one greedy (None)."""
        if greedy:
            return [[None] for _ in samples]
        seeds = []
        for sample in samples:
            prompt = int(sample.get("record", 0)) * 2**32 + zlib.crc32(str(list(sample["prompt_ids"])).encode())
            seeds.append([completion_seed(self.seed, generation, prompt, k) for k in range(self.group)])
        return seeds

    def _seeds_shape(self, micro_batches: list[list[dict]]) -> list[int]:
        return [self.group for micro in micro_batches for _ in micro]

    def _behaviour_logps(self, micro_batches: list[list[dict]], groups: list[list[Completion]]) -> None:
        """Each completion's log-probs under the weights that sampled it (now), from the policy
        itself (for an engine that reports none), stored as the completion's ``logps``."""
        batches, k = [], 0
        for micro in micro_batches:
            batches.append(self._layout([(sample, c, 0.0) for j, sample in enumerate(micro) for c in groups[k + j]]))
            k += len(micro)
        self._old_logps(batches)
        k = 0
        for micro, batch in zip(micro_batches, batches):
            rows = [(sample, c) for j, sample in enumerate(micro) for c in groups[k + j]]
            for (_, completion), logps in zip(rows, self._completion_logps(batch, rows)):
                completion.logps = logps.tolist()
            k += len(micro)

    def _sample(self, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        """The engine's completions of ``samples``, one per seed, in eval mode. Collective call."""
        self.engine.train(False)
        try:
            if self.environment is not None:
                ro = self.cfg.rollout
                groups = self.environment.episodes(self.sampler, self.engine, samples, seeds, int(ro.max_turns),
                                                   int(ro.max_completion_length), self.tokenizer)
            else:
                groups = self.sampler.sample(self.engine, samples, seeds)
        finally:
            self.engine.train(True)
        return self._checked(groups, [len(row) for row in seeds])

    def _checked(self, groups: list[list[Completion]], sizes: list[int]) -> list[list[Completion]]:
        wrong = [i for i, (group, size) in enumerate(zip(groups, sizes)) if len(group) != size]
        if len(groups) != len(sizes) or wrong:
            raise RuntimeError(f"rollout.engine={self.cfg.rollout.engine} returned {len(groups)} groups for "
                               f"{len(sizes)} prompts (or a group of another size than its seeds)")
        return groups

    def _score(self, samples: list[dict], groups: list[list[Completion]], where: str) -> torch.Tensor:
        prompts, completions, ids, columns = [], [], [], {}
        extra = [k for k in samples[0] if k not in ("prompt", "prompt_ids", "record")] if samples else []
        for sample, group in zip(samples, groups):
            for completion in group:
                text = self.tokenizer.decode(completion.ids, skip_special_tokens=True)
                prompts.append(sample["prompt"])
                completions.append([{"role": "assistant", "content": text}] if isinstance(sample["prompt"], list)
                                   else text)
                ids.append(list(completion.ids))
                for key in extra:
                    columns.setdefault(key, []).append(sample.get(key))
                if self.environment is not None and self.environment.gives_rewards:
                    columns.setdefault("environment_reward", []).append(completion.env_reward)
        return score(self.functions, prompts, completions, ids, columns, where)

    def _weighted(self, table: torch.Tensor) -> torch.Tensor:
        """Each completion's reward: the weighted sum of its functions' values, None as 0, and NaN
        where every function returned None (unscorable: left out of its group's statistics, with
        advantage 0), as TRL 1.16."""
        if not self.functions:  # distillation without rewards: nothing to weigh, nothing to warn about
            return torch.zeros(len(table), dtype=torch.float64)
        weights = torch.tensor([f.weight for f in self.functions], dtype=torch.float64)
        rewards = torch.nan_to_num(table * weights, nan=0.0).sum(dim=1)
        unscorable = torch.isnan(table).all(dim=1)
        if bool(unscorable.any()) and not self.warned_unscorable:
            self.warned_unscorable = True  # once a run: TRL warns at every step
            log.warning("every reward function returned None for %d of %d completions (rank %d; first seen here, not "
                        "repeated): they get advantage 0 and no reward in train/reward; make at least one function "
                        "score every completion", int(unscorable.sum()), len(table), self.engine.dp_rank)
        return rewards.masked_fill(unscorable, float("nan"))

    def _episode_stats(self, groups: list[list[Completion]], prefix: str) -> dict[str, float]:
        """Multi-turn episodes' means over every rank's episodes (one all-reduce): model turns,
        tool calls and tool errors per episode, and the share of tool calls that failed."""
        if self.environment is None:
            return {}
        episodes = [c for group in groups for c in group]
        sums = torch.tensor([len(episodes), sum(c.turns for c in episodes), sum(c.tool_calls for c in episodes),
                             sum(c.tool_errors for c in episodes)], dtype=torch.float64, device=self.engine.env.device)
        n, turns, calls, errors = (distributed.all_reduce_sum(sums).cpu() / self.engine.dims.data_replicas).tolist()
        n = max(n, 1.0)
        return {f"{prefix}/episodes/turns_mean": turns / n, f"{prefix}/episodes/tool_calls_mean": calls / n,
                f"{prefix}/episodes/tool_errors_mean": errors / n,
                f"{prefix}/episodes/tool_error_rate": errors / calls if calls else 0.0}

    def _global_stats(self, table: torch.Tensor, rewards: torch.Tensor, groups: list[list[Completion]]) -> dict:
        """TRL's rollout metrics over every rank's completions (one all-reduce, one max): the
        reward's mean and unbiased standard deviation over the scored completions, the share of
        groups whose rewards do not vary (of the batch, under ``scale_rewards=batch``), each
        function's mean and standard deviation where it applied, the completions' lengths."""
        lengths = torch.tensor([len(c.ids) for g in groups for c in g], dtype=torch.float64)
        truncated = torch.tensor([float(c.truncated) for g in groups for c in g], dtype=torch.float64)
        flat = rewards.flatten()
        scored = ~torch.isnan(flat)
        values = torch.nan_to_num(flat, nan=0.0)
        group_std = nanstd(rewards, dim=1) if self.group > 1 else torch.zeros(len(rewards), dtype=torch.float64)
        flat_zero_std = torch.isclose(group_std, torch.zeros_like(group_std)).sum()
        present = ~torch.isnan(table)
        fvalues = torch.nan_to_num(table, nan=0.0)
        sums = torch.cat([torch.tensor([scored.sum(), values.sum(), (values ** 2).sum(), float(flat_zero_std),
                                        float(len(rewards)), float(flat.numel()), lengths.sum(), truncated.sum()],
                                       dtype=torch.float64),
                          present.sum(0).double(), fvalues.sum(0), (fvalues ** 2).sum(0)])
        device = self.engine.env.device
        sums = distributed.all_reduce_sum(sums.to(device)).cpu()
        extremes = distributed.all_reduce_max(torch.tensor([lengths.max() if len(lengths) else 0.0,
                                                            -(lengths.min() if len(lengths) else 0.0)],
                                                           dtype=torch.float64, device=device)).cpu()
        sums = sums / self.engine.dims.data_replicas  # tensor/pipeline peers hold the same prompts
        n, total, squares, zero_std, prompts, completions, length_sum, truncated_sum = sums[:8].tolist()
        fn = len(self.functions)
        counts, fsum, fsq = sums[8:8 + fn], sums[8 + fn:8 + 2 * fn], sums[8 + 2 * fn:]
        batch_std = math.sqrt(max((squares - total * total / n) / (n - 1), 0.0)) if n > 1 else float("nan")
        if self.objective.scale_rewards == "batch":
            zero_std = prompts * float(abs(batch_std) <= 1e-8)
        metrics = {"train/reward": total / n if n else float("nan"), "train/reward_std": batch_std,
                   "train/frac_reward_zero_std": zero_std / prompts,
                   "train/completions/mean_length": length_sum / completions,
                   "train/completions/max_length": float(extremes[0]),
                   "train/completions/min_length": float(-extremes[1]),
                   "train/completions/clipped_ratio": truncated_sum / completions, "_batch_std": batch_std}
        for j, f in enumerate(self.functions):
            c = float(counts[j])
            mean = float(fsum[j]) / c if c else float("nan")
            var = (float(fsq[j]) - c * mean * mean) / (c - 1) if c > 1 else float("nan")
            metrics[f"train/rewards/{f.name}/mean"] = mean
            metrics[f"train/rewards/{f.name}/std"] = math.sqrt(max(var, 0.0)) if c > 1 else float("nan")
        return metrics

    def _layout(self, rows: list[tuple[dict, Completion, float]]) -> dict[str, torch.Tensor]:
        """One training micro-batch of ``rows`` (:func:`~llmtrain.rollout.layout.training_batch`,
        packed into rows of ``data.seq_len`` with ``rollout.packing``), with image prompts' pixels
        row by row for the policy's (and the old policy's) forward."""
        batch = layout.training_batch(rows, self.pad_id, self.objective, self._capacity())
        images = [s.get("images") or [] for s, _, _ in rows]
        if any(images):  # a text-only rollout needs no processor
            batch.update(image_tensors(processor_of(self.tokenizer), images))
        return batch

    def _capacity(self) -> int | None:
        """A packed row's tokens (``data.seq_len``) with ``rollout.packing``, else None."""
        return int(self.cfg.data.seq_len) if self.packing else None

    def _completion_logps(self, batch: dict[str, torch.Tensor], rows: list[tuple[dict, Completion]]) -> list[
            torch.Tensor]:
        """Each completion's ``old_logps`` from a batch :meth:`_layout` made of ``rows`` (in order)."""
        return layout.completion_logps(batch, rows, self._capacity())

    @torch.no_grad()
    def _old_logps(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """The sampling policy's log-probs of each completion token (every rank the same number of
        forwards: ZeRO-3 and FSDP2 gather in each)."""
        device = self.engine.env.device
        for batch in batches:
            with self.engine.labelling(on_device := {k: v.to(device) for k, v in batch.items()}):
                logits = self.engine.forward(on_device)
            batch["old_logps"] = self.objective.token_logps(logits, on_device["labels"]).cpu()

    def _logp_check(self, batches: list[dict[str, torch.Tensor]], micro_batches: list[list[dict]],
                    groups: list[list[Completion]]) -> dict[str, float]:
        """The largest and the mean absolute difference, over every rank's sampled tokens, between
        the log-probs the rollout engine reported and the policy's own (``old_logps``, just
        computed): near 0 when the engine samples with the policy's weights (TRL logs the same
        as ``sampling/sampling_logp_difference``)."""
        largest, total, count, k = 0.0, 0.0, 0, 0
        for micro, batch in zip(micro_batches, batches):
            rows = [(sample, c) for j, sample in enumerate(micro) for c in groups[k + j]]
            for (_, completion), ours in zip(rows, self._completion_logps(batch, rows)):
                if completion.logps is None or not completion.ids:
                    continue
                diff = (ours.double() - torch.tensor(completion.logps, dtype=torch.float64)).abs()
                if completion.env_mask is not None:  # the model's tokens only
                    diff = diff[torch.tensor(completion.env_mask, dtype=torch.bool)]
                if diff.numel():
                    largest, total, count = max(largest, float(diff.max())), total + float(diff.sum()), \
                        count + diff.numel()
            k += len(micro)
        device = self.engine.env.device
        sums = distributed.all_reduce_sum(torch.tensor([total, float(count)], dtype=torch.float64, device=device))
        peak = distributed.all_reduce_max(torch.tensor([largest], dtype=torch.float64, device=device))
        return {"rollout/logp_diff_max": float(peak[0]),
                "rollout/logp_diff_mean": float(sums[0] / sums[1]) if float(sums[1]) else float("nan")}

    def _write_completions(self, step: int, samples: list[dict], groups: list[list[Completion]], table: torch.Tensor,
                           rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """``run_dir/completions/step_N.jsonl`` (:mod:`~llmtrain.rollout.completion_log`). Collective call."""
        rows = completion_log.records(step, self.engine.dp_rank, samples, groups, table, rewards, advantages,
                                      self.functions, self.tokenizer, self.log_completions)
        completion_log.write(step, self.engine.dp_rank, rows, self.log_completions, self.run_dir, self.is_main,
                             self.on_completions)

    # ---- evaluation ---------------------------------------------------------------------------
    def evaluate(self, prompt_batches: list[dict]) -> dict[str, float]:
        """Held-out mean reward of greedy completions (pass@1 for a 0/1 checker) over every rank's
        prompts with its standard error (the sample standard deviation over sqrt(prompts)), each
        function's mean, and the completions' mean length, as ``val/...``.
        Collective call."""
        self._resolve()  # the engine may load new weights for this: nothing may be in flight
        samples = [sample for batch in prompt_batches for sample in batch["prompts"]]
        groups = self._sample(samples, self._seeds(samples, 0, greedy=True))
        table = self._score(samples, groups, "in the held-out evaluation") if samples else \
            torch.zeros(0, len(self.functions), dtype=torch.float64)
        rewards = torch.nan_to_num(self._weighted(table), nan=0.0)  # pass@1: an unscorable completion fails
        present = ~torch.isnan(table)
        lengths = float(sum(len(g[0].ids) for g in groups))
        sums = torch.cat([torch.tensor([float(len(samples)), float(rewards.sum()), lengths,
                                        float((rewards ** 2).sum())], dtype=torch.float64),
                          present.sum(0).double(), torch.nan_to_num(table, nan=0.0).sum(0)])
        sums = distributed.all_reduce_sum(sums.to(self.engine.env.device)).cpu() / self.engine.dims.data_replicas
        n = max(float(sums[0]), 1.0)
        mean = float(sums[1]) / n
        variance = (float(sums[3]) - n * mean * mean) / (n - 1) if n > 1 else float("nan")
        fn = len(self.functions)
        metrics = {"val/reward": mean, "val/reward_stderr": math.sqrt(max(variance, 0.0) / n),
                   "val/completions/mean_length": float(sums[2]) / n, "val/prompts": int(sums[0])}
        for j, f in enumerate(self.functions):
            c = float(sums[4 + j])
            metrics[f"val/rewards/{f.name}/mean"] = float(sums[4 + fn + j]) / c if c else float("nan")
        metrics.update(self._episode_stats(groups, "val"))
        if self.held_out is not None:
            batches, k = [], 0
            for batch in prompt_batches:
                micro = batch["prompts"]
                if micro:
                    batches.append(self._layout([(s, g[0], 0.0) for s, g in zip(micro, groups[k:k + len(micro)])]))
                k += len(micro)
            metrics.update(self.held_out(batches))
        return metrics

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's part of the rollout that optimizer step ``step`` (done) leaves to later steps
        (empty when nothing is): the pending generation batch when ``num_iterations`` steps train
        it and some are left (its micro-batches' tensors, flat: ``b{i}.{key}``, and its index),
        and the generation batches asynchronous generation sampled ahead (``s{g}.*``: their
        prompts as JSON, completions, sampling log-probs and the step that sampled them; waited
        for if in flight). Ahead-sampled batches are kept, not re-sampled on resume: the weights
        that sampled them are gone by then."""
        mu = self.objective.num_iterations
        flat: dict[str, torch.Tensor] = {}
        if self.pending is not None and step % mu != 0 and step // mu == self.pending.generation:
            flat["generation"] = torch.tensor([self.pending.generation])
            for i, batch in enumerate(self.pending.batches):
                for key in (*BATCH_KEYS, *IMAGE_INPUTS):
                    if key in batch:  # (image tensors only in image prompts' batches)
                        flat[f"b{i}.{key}"] = batch[key].contiguous()
        self._resolve()
        for g, entry in self.sampled.items():
            flat.update(_flatten_sampled(entry, f"s{g}."))
        return flat

    def load_state_dict(self, flat: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state_dict` saved (nothing to do for an empty one); prompts of the
        restored ahead-sampled batches are skipped in the prompt stream (they were read)."""
        if not flat:
            return
        if "generation" in flat:
            count = 1 + max(int(k.split(".")[0][1:]) for k in flat if k.startswith("b"))
            batches = []
            for i in range(count):
                batch = {key: flat[f"b{i}.{key}"] for key in (*BATCH_KEYS, *IMAGE_INPUTS) if f"b{i}.{key}" in flat}
                for key in ("ref_logps", "behaviour_logps"):
                    batch.setdefault(key, torch.zeros(batch["input_ids"].shape, dtype=torch.float32))
                batches.append(batch)
            self.pending = GenerationBatch(int(flat["generation"][0]), batches, {})
        for g in sorted({int(k.split(".")[0][1:]) for k in flat if k.startswith("s")}):
            self.sampled[g] = _unflatten_sampled(flat, f"s{g}.", g)
            for _ in range(self.engine.accumulation_steps):
                next(self.prompts)


def _flatten_sampled(entry: Sampled, prefix: str) -> dict[str, torch.Tensor]:
    """A :class:`Sampled` (groups resolved) as tensors under ``prefix`` (see
    :meth:`Rollout.state_dict`)."""
    completions = [c for group in entry.groups for c in group]
    prompts = [[{k: v for k, v in sample.items()} for sample in micro] for micro in entry.micro_batches]
    text = json.dumps({"micro_batches": prompts, "group_sizes": [len(g) for g in entry.groups]}, default=str)
    return {prefix + "prompts_json": torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8),
            prefix + "sampled_at": torch.tensor([entry.sampled_at, int(entry.on_policy)], dtype=torch.int64),
            prefix + "lengths": torch.tensor([len(c.ids) for c in completions], dtype=torch.int64),
            prefix + "ids": torch.tensor([t for c in completions for t in c.ids], dtype=torch.int64),
            prefix + "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.uint8),
            prefix + "has_logps": torch.tensor([c.logps is not None for c in completions], dtype=torch.uint8),
            prefix + "logps": torch.tensor([v for c in completions for v in (c.logps if c.logps is not None
                                                                            else [0.0] * len(c.ids))],
                                           dtype=torch.float64),
            # Multi-turn episodes: which tokens the model wrote, and the episode's counts and reward.
            prefix + "env_mask": torch.tensor([v for c in completions for v in (c.env_mask if c.env_mask is not None
                                                                                else [1] * len(c.ids))],
                                              dtype=torch.uint8),
            prefix + "episode": torch.tensor([[float(c.env_mask is not None), c.turns, c.tool_calls, c.tool_errors,
                                               float("nan") if c.env_reward is None else c.env_reward]
                                              for c in completions], dtype=torch.float64).reshape(-1, 5)}


def _unflatten_sampled(flat: dict[str, torch.Tensor], prefix: str, generation: int) -> Sampled:
    meta = json.loads(bytes(flat[prefix + "prompts_json"].tolist()).decode("utf-8"))
    lengths, ids, logps = flat[prefix + "lengths"].tolist(), flat[prefix + "ids"].tolist(), flat[prefix + "logps"].tolist()
    truncated, has = flat[prefix + "truncated"].tolist(), flat[prefix + "has_logps"].tolist()
    masks, episodes = flat[prefix + "env_mask"].tolist(), flat[prefix + "episode"].tolist()
    completions, at = [], 0
    for n, cut, present, (multi, turns, calls, errors, reward) in zip(lengths, truncated, has, episodes):
        completions.append(Completion(ids[at:at + n], bool(cut), logps[at:at + n] if present else None,
                                      env_mask=masks[at:at + n] if multi else None, turns=int(turns),
                                      tool_calls=int(calls), tool_errors=int(errors),
                                      env_reward=None if math.isnan(reward) else reward))
        at += n
    groups, at = [], 0
    for size in meta["group_sizes"]:
        groups.append(completions[at:at + size])
        at += size
    sampled_at, on_policy = flat[prefix + "sampled_at"].tolist()
    return Sampled(generation, sampled_at, meta["micro_batches"], groups, bool(on_policy))
