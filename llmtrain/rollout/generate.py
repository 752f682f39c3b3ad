"""Sampling completions from a ``transformers`` causal LM, seeded per completion.

Each completion draws its tokens from a ``torch.Generator`` of its own, seeded from the run's
seed, the generation batch, the prompt's record and the completion's index
(:func:`completion_seed`): what a completion becomes depends on the weights and on nothing else,
not the number of ranks, the recipe or which other prompts share the step.

Text prompts decode together (:func:`sample_rows`) in batches of a **fixed shape**: always
``rows`` rows (dummy rows fill a short batch) and every prompt left-padded to the same width
(one more than the longest prompt of the call's global prompt set, the same on every layout).
On a CPU (fp32 and bf16, one thread) a row's logits are then bit for bit the same whichever rows
share its batch and whichever row it is, where changing the row count or the padded width
changes them by ~1e-6 (fp32; GEMM kernels pick their blocking by shape): BENCHMARKS.md
"Batched sampling". The one extra pad column keeps the attention mask from ever being all ones,
which ``transformers`` would drop for causal attention, another kernel with other rounding.
Image prompts decode one prompt's group of G rows at a time (:func:`sample_group`, no padding).
A batch of whole groups (``sample_batch``'s ``group``) prefills each prompt once, ``rows / G``
rows of the same width, and copies the KV cache to the group's rows (a GRPO step's prefill is the
larger part of its sampling at 16 rows x ~140 columns x 64 new tokens). Its decoder GEMMs then
have another row count; on this CPU that changed no bit of the cache (SmolLM2-135M with LoRA at
4 against 16 rows; the test model), and the output layer is given the rows' copies laid out as
the whole batch's prefill would give them (:func:`_repeated_rows`), so its logits round as that
prefill's: a contiguous copy moved them by ~1e-6.

Sampling follows ``transformers``' processors on the whole batch at once: logits / temperature,
then top-k, then top-p (nucleus, the smallest set whose probability reaches ``top_p``, at least
one token), then one draw per row (:func:`choose`): ``torch.multinomial``'s, from the row's
generator; greedy (temperature 0, or no seed) takes the arg max.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

from llmtrain.parallel.distributed import derived_seed


class SamplingInterrupted(Exception):
    """The sampling loop stopped before its end because its ``stop_when`` said so (a preemption
    signal came while a step sampled): nothing it sampled is returned."""


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


def choose(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row (int64 ``[rows]``) from fp32 ``logits`` ``[rows, vocab]`` (CPU) under
    ``sampling`` (see the module); row r greedy where ``generators[r]`` is None. Each operation
    works along the vocabulary only, so a row's token does not depend on the other rows."""
    if sampling.suppress:  # as transformers' SuppressTokensLogitsProcessor: -inf, before anything else
        logits = logits.clone()
        logits[:, [t for t in sampling.suppress if t < logits.shape[-1]]] = float("-inf")
    greedy = torch.argmax(logits, dim=-1)
    seeded = [r for r, g in enumerate(generators) if g is not None]
    if sampling.temperature == 0 or not seeded:
        return greedy
    scores = logits[seeded] / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        threshold = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p  # keep the smallest set reaching top_p
        drop[:, 0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    # torch.multinomial's own draw of one sample (its exponential race: the arg max of p / q, q
    # exponential), with each row's q from that row's generator: the token torch.multinomial
    # would draw row by row, for every row at once. Not an inverse CDF of one uniform: that
    # moves to the neighbouring token id whenever rounding moves a CDF boundary past the
    # uniform, and a 2-rank zero3 run's weights (rounding apart from 1 process's) did so at step 5.
    probs = torch.softmax(scores, dim=-1)
    noise = torch.empty_like(probs)
    for i, r in enumerate(seeded):
        noise[i].exponential_(1, generator=generators[r])
    greedy[seeded] = torch.argmax(probs / noise, dim=-1)
    return greedy


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


def keep_last(model: torch.nn.Module) -> dict:
    """The forward keyword that computes logits at the last position only (``logits_to_keep=1``:
    the prefill needs no others), where the model's forward takes it; else nothing."""
    for module in model.modules():
        if "logits_to_keep" in inspect.signature(type(module).forward).parameters:
            return {"logits_to_keep": 1}
    return {}


@torch.no_grad()
def sample_group(model: torch.nn.Module, prompt_ids: list[int], seeds: list[int | None], sampling: Sampling,
                 device: torch.device, decode: Callable[[list[int]], str] | None = None,
                 autocast: Callable[[], ContextManager] | None = None,
                 images: dict[str, torch.Tensor] | None = None,
                 stop_when: Callable[[], bool] | None = None) -> list[Completion]:
    """One completion per seed of ``prompt_ids``, decoded as one batch with a KV cache (``model``
    in eval mode; no collectives: call it where the model's weights are whole on this rank).
    A seed of None decodes greedily. ``decode`` (ids -> text) is needed for ``sampling.stop``.
    ``stop_when``: asked before each decode step; True raises :class:`SamplingInterrupted`.
    ``images``: an image-text prompt's image tensors for one row (the image processor's, e.g.
    ``pixel_values``), repeated for each row of the group and given to the prompt's forward only:
    later steps read the image tokens' keys and values from the cache."""
    from transformers import DynamicCache

    rows = len(seeds)
    ids = torch.tensor([prompt_ids] * rows, dtype=torch.long, device=device)
    cache = {cache_argument(model): DynamicCache()}
    # Every family's image tensors lead with the row (Idefics3) or the image (LLaVA): G copies of
    # one row's are the group's, in row order.
    pixels = {k: v.to(device).repeat(rows, *[1] * (v.dim() - 1)) for k, v in (images or {}).items()}
    context = autocast or torch.no_grad
    with context():
        logits = model(input_ids=ids, use_cache=True, **cache, **pixels, **keep_last(model)).logits[:, -1].float().cpu()
    return _decode(model, logits, cache, None, seeds, rows, sampling, device, decode, context, stop_when)


@torch.no_grad()
def sample_batch(model: torch.nn.Module, prompts: list[list[int]], seeds: list[int | None], sampling: Sampling,
                 device: torch.device, rows: int, width: int, decode: Callable[[list[int]], str] | None = None,
                 autocast: Callable[[], ContextManager] | None = None,
                 stop_when: Callable[[], bool] | None = None, group: int = 1) -> list[Completion]:
    """One completion per (prompt, seed) pair, decoded as one batch of the fixed shape ``rows`` x
    ``width + 1`` (see the module): each prompt left-padded to ``width + 1`` tokens (positions
    count from its first real token), ``rows - len(prompts)`` dummy rows (one token, greedy,
    never returned) after them. ``width``: the longest prompt of every rank's. ``model`` in eval mode, weights whole on this rank (no collectives);
    ``decode`` and ``stop_when`` as :func:`sample_group`'s. ``group`` (dividing ``rows``): the
    prompts come in runs of ``group`` copies of one prompt (a GRPO group's rows), and the prefill
    runs once per run, ``rows / group`` rows of the same fixed width, its KV cache and logits then
    repeated to the ``rows`` rows (``Cache.batch_repeat_interleave``; see the module).

    Raises:
        ValueError: more prompts than ``rows``, one longer than ``width``, or ``group`` not
            dividing ``rows`` or the prompts not in runs of ``group`` copies.
    """
    from transformers import DynamicCache

    if len(prompts) > rows or any(len(p) > width for p in prompts):
        raise ValueError(f"sample_batch: {len(prompts)} prompts (at most {rows}) of up to "
                         f"{max(map(len, prompts), default=0)} tokens (at most {width})")
    if rows % group or len(prompts) % group or any(list(prompts[k]) != list(prompts[k - k % group])
                                                   for k in range(len(prompts))):
        raise ValueError(f"sample_batch: group={group} must divide rows={rows} and the {len(prompts)} prompts must "
                         f"come in runs of {group} copies of one prompt")
    columns = width + 1  # a pad column in every row: the mask is never all ones (see the module)
    slots = rows // group
    ids = torch.zeros(slots, columns, dtype=torch.long)
    mask = torch.zeros(slots, columns, dtype=torch.long)
    for r, prompt in enumerate(list(prompts[::group]) + [[0]] * (slots - len(prompts) // group)):
        ids[r, columns - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[r, columns - len(prompt):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = {cache_argument(model): DynamicCache()}
    context = autocast or torch.no_grad
    head = model.get_output_embeddings() if group > 1 and hasattr(model, "get_output_embeddings") else None
    hook = None if head is None else head.register_forward_pre_hook(
        lambda _, args: (_repeated_rows(args[0], group), *args[1:]))
    try:
        with context():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                           use_cache=True, **cache, **keep_last(model)).logits[:, -1].float().cpu()
    finally:
        if hook is not None:
            hook.remove()
    if group > 1:  # each run's rows decode from copies of its one prefill
        next(iter(cache.values())).batch_repeat_interleave(group)
        mask, positions = mask.repeat_interleave(group, dim=0), positions.repeat_interleave(group, dim=0)
        logits = logits if head is not None else logits.repeat_interleave(group, dim=0)
    padded = (mask.to(device), positions[:, -1:].to(device))
    return _decode(model, logits, cache, padded, list(seeds) + [None] * (rows - len(prompts)), len(prompts),
                   sampling, device, decode, context, stop_when)


def _repeated_rows(hidden: torch.Tensor, group: int) -> torch.Tensor:
    """``hidden`` (the output layer's input, ``[slots, positions, features]``, a view of the
    prefill's hidden states) with each row repeated ``group`` times, laid out as the same view of
    a prefill of every row would be (its strides and storage offset): the output layer's product
    then has that prefill's shape and memory layout, so its rounding is that one's (a contiguous
    copy rounds the logits differently, ~1e-6 relative in fp32)."""
    rows = hidden.shape[0] * group
    size, stride, offset = (rows, *hidden.shape[1:]), (hidden.stride(0), *hidden.stride()[1:]), hidden.storage_offset()
    span = offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1
    out = hidden.new_empty(span).as_strided(size, stride, offset)
    out.copy_(hidden.repeat_interleave(group, dim=0))
    return out


def _decode(model: torch.nn.Module, logits: torch.Tensor, cache: dict, padded: tuple[torch.Tensor, torch.Tensor] | None,
            seeds: list[int | None], live: int, sampling: Sampling, device: torch.device,
            decode: Callable[[list[int]], str] | None, context: Callable[[], ContextManager],
            stop_when: Callable[[], bool] | None = None) -> list[Completion]:
    """The decoding loop after a prefill that gave ``logits`` (fp32 ``[rows, vocab]``) and filled
    ``cache``: a token per row per step (:func:`choose`), until each of the first ``live`` rows
    (the others: dummies, not returned) has ended or ``sampling.max_new``. ``padded``: a left-padded batch's attention mask ``[rows, width]`` and
    last positions ``[rows, 1]`` (None: no padding). Finished rows stay in the batch (its shape
    must not change) and feed their draws, which nothing reads. ``stop_when``: asked before each
    step (a local flag, no collective: ranks decode different numbers of steps); True raises
    :class:`SamplingInterrupted`.

    Raises:
        SamplingInterrupted: ``stop_when`` said so.
    """
    rows = len(seeds)
    generators = [torch.Generator().manual_seed(s) if s is not None and sampling.temperature else None for s in seeds]
    mask, position = padded if padded is not None else (None, None)
    out: list[list[int]] = [[] for _ in range(live)]
    done = [False] * live
    for step in range(sampling.max_new):
        if stop_when is not None and stop_when():
            raise SamplingInterrupted(f"stopped at decode step {step + 1} of at most {sampling.max_new}")
        tokens = choose(logits, sampling, generators)
        for row, token in enumerate(tokens[:live].tolist()):
            if done[row]:
                continue
            out[row].append(token)
            if token in sampling.end_ids or (sampling.stop and decode is not None and
                                             any(s in decode(out[row]) for s in sampling.stop)):
                done[row] = True
        if all(done) or step + 1 == sampling.max_new:  # (the last token's logits would go unread)
            break
        padding: dict = {}
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            position = position + 1
            padding = {"attention_mask": mask, "position_ids": position}
        with context():
            logits = model(input_ids=tokens.to(device)[:, None], use_cache=True, **cache,
                           **padding).logits[:, -1].float().cpu()
    return [Completion(ids, truncated=not finished) for ids, finished in zip(out, done)]
