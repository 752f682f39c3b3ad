"""Sampling a group of completions from a ``transformers`` causal LM, seeded per completion.

Each completion draws its tokens from a ``torch.Generator`` of its own, seeded from the run's
seed, the generation batch, the prompt's record and the completion's index
(:func:`completion_seed`), and a group is decoded as one batch of its G rows (the same prompt,
so no padding): what a completion becomes depends on the weights and on nothing else, not the
number of ranks, the recipe or which other prompts share the step. Sampling follows
``transformers``' processors: logits / temperature, then top-k, then top-p (nucleus, the smallest
set whose probability reaches ``top_p``, at least one token), then a draw (``torch.multinomial``
on the CPU with the completion's generator); greedy (temperature 0) takes the arg max.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from llmtrain.parallel.distributed import derived_seed


def completion_seed(seed: int, generation: int, record: int, index: int) -> int:
    """The seed of completion ``index`` of prompt ``record`` in generation batch ``generation``."""
    return derived_seed(seed, "rollout", generation, record, index)


@dataclass
class Sampling:
    """How to draw tokens: ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off),
    at most ``max_new`` tokens, ending at any of ``end_ids`` (kept) or once the text contains one
    of ``stop`` (kept); never one of ``suppress`` (an image-text model's image token: in a
    completion it would stand for an image that the forward has no pixels for, and the model's
    forward refuses a batch whose image tokens and images do not match)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new: int = 256
    end_ids: frozenset[int] = field(default_factory=frozenset)
    stop: tuple[str, ...] = ()
    suppress: frozenset[int] = field(default_factory=frozenset)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from fp32 ``logits`` ``[vocab]`` (CPU) under ``sampling`` (see the module)."""
    if sampling.suppress:  # as transformers' SuppressTokensLogitsProcessor: -inf, before anything else
        logits = logits.clone()
        logits[[t for t in sampling.suppress if t < logits.numel()]] = float("-inf")
    if sampling.temperature == 0 or generator is None:
        return int(torch.argmax(logits))
    scores = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.numel():
        threshold = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= sampling.top_p  # keep the smallest set reaching top_p
        drop[0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))


@dataclass
class Completion:
    """A sampled completion: its token ids, whether ``max_new`` cut it short, and (from engines
    that report them) each token's log-prob under the sampling distribution. A multi-turn
    episode (:mod:`llmtrain.rollout.environments`) also has ``env_mask`` (1 per token the model
    wrote, 0 per token of the environment's answers), its model ``turns``, ``tool_calls``,
    ``tool_errors`` and the environment's summed reward (``env_reward``, None: none given)."""

    ids: list[int]
    truncated: bool
    logps: list[float] | None = None
    env_mask: list[int] | None = None
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which the model's forward takes its KV cache: ``cache`` (transformers 5.24
    on), else ``past_key_values``. Wrappers (peft, FSDP2) are looked through to the first module
    whose forward names either."""
    for module in model.modules():
        parameters = inspect.signature(type(module).forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return "past_key_values"


@torch.no_grad()
def sample_group(model: torch.nn.Module, prompt_ids: list[int], seeds: list[int | None], sampling: Sampling,
                 device: torch.device, decode: Callable[[list[int]], str] | None = None,
                 autocast: Callable[[], ContextManager] | None = None,
                 images: dict[str, torch.Tensor] | None = None) -> list[Completion]:
    """One completion per seed of ``prompt_ids``, decoded as one batch with a KV cache (``model``
    in eval mode; no collectives: call it where the model's weights are whole on this rank).
    A seed of None decodes greedily. ``decode`` (ids -> text) is needed for ``sampling.stop``.
    ``images``: an image-text prompt's image tensors for one row (the image processor's, e.g.
    ``pixel_values``), repeated for each row of the group and given to the prompt's forward only:
    later steps read the image tokens' keys and values from the cache."""
    from transformers import DynamicCache

    rows = len(seeds)
    generators = [torch.Generator().manual_seed(s) if s is not None and sampling.temperature else None for s in seeds]
    ids = torch.tensor([prompt_ids] * rows, dtype=torch.long, device=device)
    cache = {cache_argument(model): DynamicCache()}
    # Every family's image tensors lead with the row (Idefics3) or the image (LLaVA): G copies of
    # one row's are the group's, in row order.
    pixels = {k: v.to(device).repeat(rows, *[1] * (v.dim() - 1)) for k, v in (images or {}).items()}
    context = autocast or torch.no_grad
    with context():
        logits = model(input_ids=ids, use_cache=True, **cache, **pixels).logits[:, -1].float().cpu()
    out: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for _ in range(sampling.max_new):
        step = []
        for row in range(rows):
            if done[row]:
                step.append(out[row][-1])  # finished rows feed their last token; its output is unused
                continue
            token = next_token(logits[row], sampling, generators[row])
            out[row].append(token)
            step.append(token)
            if token in sampling.end_ids or (sampling.stop and decode is not None and
                                             any(s in decode(out[row]) for s in sampling.stop)):
                done[row] = True
        if all(done):
            break
        with context():
            logits = model(input_ids=torch.tensor(step, device=device)[:, None], use_cache=True,
                           **cache).logits[:, -1].float().cpu()
    return [Completion(ids, truncated=not finished) for ids, finished in zip(out, done)]
