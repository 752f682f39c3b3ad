"""Rollout engines (``rollout.engine``): what turns prompts into completions for an online
objective. The seam is :class:`RolloutEngine`'s one method; the rest of a generation batch
(rewards, advantages, layout, checkpoints) is :class:`llmtrain.rollout.rollout.Rollout`'s.

* ``hf`` (:class:`PolicySampler`, the default): llmtrain's sampling loop
  (:mod:`llmtrain.rollout.generate`) on the policy's own weights under the run's layout (the
  engine's :meth:`~llmtrain.engine.base.Engine.generation_model`: whole on DDP and ZeRO 0-2,
  gathered under ZeRO-3 and FSDP2, tensor-parallel peers in lockstep; LoRA through the adapted
  model). A rank's text prompts decode together, ``rollout.generation_batch`` rows at a time,
  every batch of one fixed shape on every layout (:func:`~llmtrain.rollout.generate.sample_batch`);
  image prompts one group at a time, their pixels given to the group's prompt forward.
* ``vllm`` (:class:`llmtrain.rollout.vllm_engine.VLLMEngine`): a vLLM server in its own Python
  environment, started and stopped by llmtrain (or one you run), the policy's weights sent to it
  after optimizer steps.
* ``module:Class``: a subclass of :class:`RolloutEngine` of your own, built as
  ``Class(cfg, tokenizer, sampling)`` (a server's client, or fixed completions in a test).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

from llmtrain.common.images import processor_of
from llmtrain.data.vision import image_tensors
from llmtrain.parallel import distributed
from llmtrain.rollout.generate import Completion, Sampling, sample_batch, sample_group


class RolloutEngine(ABC):
    """Samples completions. ``cfg``: the run's config; ``tokenizer``: the policy's; ``sampling``:
    ``rollout``'s fields (:class:`~llmtrain.rollout.generate.Sampling`)."""

    # Whether the engine samples from weights of its own (a server's), so that asynchronous
    # generation can sample while the policy trains: :meth:`submit` returns before it is done.
    overlaps = False

    def __init__(self, cfg: Any, tokenizer: Any, sampling: Sampling):
        self.cfg, self.tokenizer, self.sampling = cfg, tokenizer, sampling
        # publish(directory, part): writes the policy's current weights for an engine that serves
        # them elsewhere (part "model" or "adapter"; collective call). Set by the trainer.
        self.publish: Callable[[Path, str], Any] | None = None
        # on_sampled(n): n more prompts' completions done, for a progress line (the held-out
        # evaluation's); engines that sample everything at once need not call it.
        self.on_sampled: Callable[[int], Any] | None = None
        # stop_when(): True once the step being sampled is to be dropped (a preemption signal;
        # set by the rollout around a step's sampling only). An engine that asks it raises
        # :class:`~llmtrain.rollout.generate.SamplingInterrupted` and may leave its work half
        # done; one that never asks samples to the end, as before.
        self.stop_when: Callable[[], bool] | None = None

    def check(self) -> None:
        """Called before anything is written: raise ConfigError for what cannot work (a server
        that cannot be reached, an environment without its package). Nothing by default."""

    def close(self) -> None:
        """Release what the engine started (a server): at the end of the run and on errors."""

    def metrics(self) -> dict[str, float]:
        """The engine's own figures for the step's metrics (a server's restarts, its weight sync's
        seconds), rank 0's; none by default."""
        return {}

    @abstractmethod
    def sample(self, policy: Any, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        """For each sample (``{"prompt_ids": [...], "record": i, "prompt": ..., **columns}``) one
        completion per entry of its ``seeds`` list: sampled with that seed (the same seed must give
        the same completion, whatever else the call holds), or greedy where it is None.

        ``policy``: the training engine (:class:`~llmtrain.engine.base.Engine`), in eval mode; an
        engine that samples from the policy's weights reads them from it. Every rank calls this
        at the same time (a collective call where the weights are sharded), each with its own
        samples, possibly none.
        """

    def submit(self, policy: Any, samples: list[dict], seeds: list[list[int | None]]) -> Future:
        """:meth:`sample` started, its result a Future: an engine that :attr:`overlaps` sends the
        policy's current weights (collective) and returns while its requests run; the default
        samples now. The policy may train before the Future is read, so an engine that overlaps
        must report each token's sampling log-probs (``Completion.logps``)."""
        future: Future = Future()
        future.set_result(self.sample(policy, samples, seeds))
        return future


class PolicySampler(RolloutEngine):
    """``rollout.engine=hf``: see the module."""

    def sample(self, policy: Any, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.sampling.stop else None
        groups: list[list[Completion]] = [[] for _ in samples]
        text = [i for i, sample in enumerate(samples) if not sample.get("images")]
        # Every batch is padded to the longest text prompt of every rank's: one width on every layout.
        longest = max((len(samples[i]["prompt_ids"]) for i in text), default=0)
        width = int(distributed.all_reduce_max(torch.tensor([longest], device=policy.env.device))[0])
        with policy.generation_model() as model:
            model.eval()
            self._text_batches(model, policy, samples, seeds, text, width, decode, groups)
            processor = processor_of(self.tokenizer)
            for i, sample in enumerate(samples):
                if i in text:
                    continue
                # An image prompt's pixels, read as the training batch reads them (one row's).
                images = image_tensors(processor, [sample["images"]])
                groups[i] = sample_group(model, list(sample["prompt_ids"]), seeds[i], self.sampling,
                                         policy.env.device, decode, policy.generation_autocast, images,
                                         self.stop_when)
                if self.on_sampled is not None:
                    self.on_sampled(1)
        return groups

    def _text_batches(self, model: Any, policy: Any, samples: list[dict], seeds: list[list[int | None]],
                      text: list[int], width: int, decode: Any, groups: list[list[Completion]]) -> None:
        """The completions of the text prompts ``text`` (indices into ``samples``) into ``groups``:
        their (prompt, seed) rows in order, ``rollout.generation_batch`` at a time; a prompt counts
        as sampled (``on_sampled``) with the batch that ends its group. Where every prompt has the
        same number G of seeds and G divides the batch, every batch holds whole groups (each rank's
        rows start at a group) and prefills each prompt once (``sample_batch``'s ``group``): the
        same shape on every layout, as G and the batch are the run's."""
        rows = [(i, seed) for i in text for seed in seeds[i]]
        size = int(self.cfg.rollout.generation_batch)
        sizes = {len(seeds[i]) for i in text}
        group = next(iter(sizes)) if len(sizes) == 1 else 1
        group = group if group >= 1 and size % group == 0 else 1
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            out = sample_batch(model, [list(samples[i]["prompt_ids"]) for i, _ in chunk], [s for _, s in chunk],
                               self.sampling, policy.env.device, size, width, decode, policy.generation_autocast,
                               self.stop_when, group)
            for (i, _), completion in zip(chunk, out):
                groups[i].append(completion)
            finished = sum(1 for i in dict.fromkeys(i for i, _ in chunk) if len(groups[i]) == len(seeds[i]))
            if self.on_sampled is not None and finished:
                self.on_sampled(finished)
