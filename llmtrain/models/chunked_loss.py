"""A memory-lean output layer: next-token log-probabilities computed chunk by chunk from the last
hidden states, so neither the ``[tokens, vocab]`` logits nor their gradient ever exist whole.

The same technique as DeepSpeed's ``TiledFusedLogitsLoss``, Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy (Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models", 2024): per chunk of ``trainer.loss_chunk_tokens`` tokens, ``logits = h W^T``,
the log-sum-exp and the target's logit are taken and the logits dropped; backward recomputes each
chunk's logits and forms ``d logits = g (onehot - softmax)``, then ``dh = d logits W`` and
``dW += d logits^T h``. Peak extra memory is one chunk's logits (and their gradient) instead of
all tokens', at the cost of one more output-layer matmul per token in backward.

Own code rather than a library: DeepSpeed's ``TiledFusedLogitsLoss`` takes a loss function over
whole logits chunks and has no tensor-parallel (vocab-sharded) head; Liger needs Triton (GPU);
Cut Cross-Entropy's kernels need Triton too (its ``torch_compile`` fallback has no vocab-parallel
head either). Here a tensor-parallel head sharded along the vocabulary (``ColwiseParallel``,
Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, section 3) reduces the
log-sum-exp and the target logit over the tensor-parallel group instead of gathering logits.

The head is swapped in place (``lm_head.forward``), so parameter names, FSDP2 units, ZeRO-3
hooks and tensor-parallel wrapping are unchanged; while no targets are set it is the plain
output layer.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from llmtrain.common.labels import IGNORE_INDEX


def _reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(x, op=op, group=group)
    return x


class ChunkedLabelLogps(torch.autograd.Function):
    """``log softmax((h W^T + b) / temperature)[target]`` per token, chunk by chunk.

    Inputs: ``hidden`` ``[N, H]``; ``weight`` ``[V_local, H]`` (this rank's vocabulary rows,
    starting at ``vocab_start``); ``bias`` ``[V_local]`` or None; ``targets`` ``[N]`` token ids
    (``-100`` = none); ``chunk`` tokens per chunk; ``group``: the tensor-parallel group the
    vocabulary is sharded over (None = whole vocabulary here); optionally ``temperature`` (the
    logits are divided by it, as a sampler's are: GRPO's log-probs are of the distribution the
    rollout sampled from) and ``entropy`` (also return each token's entropy). Output fp32 ``[N]``
    (0 where the target is -100); with ``entropy`` the pair (that, fp32 ``[N]`` entropies
    ``H = log S - sum_v e_v s_v / S`` with ``s = z - max z``, ``e = exp s``, ``S = sum e``,
    0 where the target is -100; not differentiable: a metric). The gradient of the log-probs
    with respect to the logits is ``(onehot - softmax(z / T)) / T``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, group, vocab_start, temperature=1.0, entropy=False):
        import torch.distributed as dist

        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        n, v_local = hidden.shape[0], weight.shape[0]
        out = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropies = torch.zeros(n, dtype=torch.float32, device=hidden.device) if entropy else None
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            logits = ChunkedLabelLogps._logits(hidden[start:stop], weight, bias, temperature)
            local = targets[start:stop] - vocab_start
            mine = (local >= 0) & (local < v_local)
            picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None])[:, 0] * mine
            picked = _reduce(picked, dist.ReduceOp.SUM, group)
            peak = _reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, group)
            valid = targets[start:stop] != IGNORE_INDEX
            # In place: one chunk of logits is the only [chunk, vocab] tensor alive (two with entropy).
            shifted = logits.sub_(peak[:, None])
            if entropy:
                exps = torch.exp(shifted)
                total = _reduce(exps.sum(dim=1), dist.ReduceOp.SUM, group)
                weighted = _reduce(exps.mul_(shifted).sum(dim=1), dist.ReduceOp.SUM, group)
                del exps
                entropies[start:stop] = torch.where(valid, torch.log(total) - weighted / total, 0.0)
            else:
                total = _reduce(shifted.exp_().sum(dim=1), dist.ReduceOp.SUM, group)
            del logits, shifted
            lse = peak + torch.log(total)
            out[start:stop] = torch.where(valid, picked - lse, torch.zeros_like(lse))
            lses[start:stop] = lse
        ctx.save_for_backward(hidden, weight, bias, targets, lses)
        ctx.chunk, ctx.group, ctx.vocab_start, ctx.temperature = chunk, group, vocab_start, float(temperature)
        if entropy:
            ctx.mark_non_differentiable(entropies)
            return out, entropies
        return out

    @staticmethod
    def _logits(hidden, weight, bias, temperature=1.0):
        logits = (hidden @ weight.t()).float()
        if bias is not None:
            logits += bias
        if temperature != 1.0:
            logits.div_(temperature)
        return logits

    @staticmethod
    def backward(ctx, grad, *entropy_grad):
        import torch.distributed as dist

        hidden, weight, bias, targets, lses = ctx.saved_tensors
        grad = grad.reshape(-1) / ctx.temperature  # d(z / T) / dz
        enabled, dtype, device = ctx.autocast
        grad_hidden = torch.empty_like(hidden)
        # A frozen output layer (LoRA) needs no d W: skip its matmul, as costly as the forward's.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        grad_bias = (torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
                     if bias is not None and ctx.needs_input_grad[2] else None)
        v_local = weight.shape[0]
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                stop = min(hidden.shape[0], start + ctx.chunk)
                h = hidden[start:stop]
                g = (grad[start:stop] * (targets[start:stop] != IGNORE_INDEX)).float()
                # softmax x -g, in place over the recomputed logits (one [chunk, vocab] tensor)
                d_logits = ChunkedLabelLogps._logits(h, weight, bias, ctx.temperature).sub_(
                    lses[start:stop, None]).exp_()
                d_logits.mul_(-g[:, None])
                local = targets[start:stop] - ctx.vocab_start
                mine = (local >= 0) & (local < v_local)
                rows = torch.nonzero(mine)[:, 0]
                d_logits[rows, local[rows]] += g[rows]
                grad_hidden[start:stop] = (d_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (d_logits.t() @ h.float())
                if grad_bias is not None:
                    grad_bias += d_logits.sum(0)
        _reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)  # each rank's vocabulary rows add to dh
        # Trailing Nones for temperature and entropy (torch drops those past the inputs given).
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None, None, None, None, None, None, None)


def _shape_only(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


class LabelHead:
    """The output layer of a causal LM, swapped to return label log-probs while :attr:`targets` is set.

    Set :attr:`targets` (``[B, T]``: the token each position predicts, -100 for none) before a
    forward; the model's ``logits`` are then fp32 ``[B, T]`` log-probabilities of those targets
    (0 where -100). With :attr:`targets` None the head is the plain output layer.

    Only positions that carry a label reach the output layer: prompt tokens of supervised
    fine-tuning and preference pairs, padding and each row's last position are dropped before the
    ``[tokens, vocab]`` matmul and its log-softmax, which Hugging Face models compute for every
    position. The same idea as TRL's ``use_logits_to_keep`` (which keeps a common suffix of each
    batch), per token here. ``chunk_tokens`` 0 runs the head's own forward (adapters and wrappers
    included) on the kept rows and takes ``cross_entropy``'s per-token values, the kernels Hugging
    Face's loss uses; > 0 (or a vocabulary-sharded head) goes through :class:`ChunkedLabelLogps`.
    Selecting the rows reads their count on the host (a device sync per forward on GPU).

    While set, :attr:`temperature` divides the logits before the log-softmax and :attr:`entropy`
    asks for each labelled position's entropy of that distribution too, left in :attr:`entropies`
    (fp32 ``[B, T]``, detached, 0 where no label; :meth:`take_entropies`): GRPO's log-probs and
    entropy metric. ``bounded`` (GRPO's head): with ``chunk_tokens`` 0, a plain ``nn.Linear`` layer
    still runs in chunks of :func:`bounded_chunk_tokens` (a chunk's fp32 logits within
    :data:`BOUNDED_CHUNK_BYTES`), so the step's full-vocabulary memory is one chunk's, not the
    completions' (an adapted layer keeps the whole path).
    """

    def __init__(self, head: torch.nn.Module, chunk_tokens: int, bounded: bool = False):
        self.head, self.chunk, self.bounded = head, int(chunk_tokens), bool(bounded)
        self.targets: torch.Tensor | None = None
        self.temperature, self.entropy = 1.0, False
        self.entropies: torch.Tensor | None = None
        plain = head.forward
        owner = self

        def forward(module, hidden):
            if owner.targets is None:
                return plain(hidden)
            return owner._label_logps(module, hidden, owner.targets, plain)

        head.forward = types.MethodType(forward, head)

    @contextlib.contextmanager
    def targeting(self, labels: torch.Tensor, temperature: float = 1.0):
        """:attr:`targets` set from ``labels`` ``[B, T]`` (each position's next label, -100 at the
        row end) and :attr:`temperature` while the block runs, reset after it, raising or not."""
        self.targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        self.temperature = float(temperature)
        try:
            yield self
        finally:
            self.targets, self.temperature = None, 1.0

    def take_entropies(self) -> torch.Tensor | None:
        """The :attr:`entropies` of the last forward (fp32 ``[B, T]``), cleared; None if none."""
        out, self.entropies = self.entropies, None
        return out

    def _chunk_for(self, module: torch.nn.Module, vocab_local: int) -> int:
        """Tokens per chunk: ``chunk_tokens``, else with ``bounded`` and a plain linear layer
        :func:`bounded_chunk_tokens` of its ``vocab_local`` output rows (with the entropy's
        second copy), else 0 (the layer's own forward on every kept row)."""
        if self.chunk or not self.bounded:
            return self.chunk
        if not isinstance(module, torch.nn.Linear):  # FSDP2 subclasses it
            return 0
        return bounded_chunk_tokens(vocab_local, copies=2 if self.entropy else 1)

    def _label_logps(self, module: torch.nn.Module, hidden, targets: torch.Tensor, plain):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        weight, bias = module.weight, getattr(module, "bias", None)
        group, start, mesh = None, 0, None
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            if any(isinstance(p, Shard) for p in weight.placements):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                group = mesh.get_group()
                start = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)[1][0]
            weight = weight.to_local()
            bias = bias.to_local() if isinstance(bias, DTensor) else bias
        if isinstance(hidden, DTensor):
            mesh = hidden.device_mesh
            hidden = hidden.to_local()
        rows, length = hidden.shape[:2]
        flat = targets.reshape(-1).to(hidden.device)
        if _shape_only(hidden):  # the planner's fake or meta tensors: no values to select rows by
            kept = torch.arange(flat.numel(), device=hidden.device)
        else:
            kept = (flat != IGNORE_INDEX).nonzero()[:, 0]
        # A micro-batch without labels still runs one row through the head (its log-prob times 0),
        # so the head's parameters get a (zero) gradient as under plain logits: DDP, FSDP2 and
        # ZeRO reduce every parameter's gradient on every rank.
        empty = kept.numel() == 0
        if empty:
            kept = torch.zeros(1, dtype=torch.long, device=hidden.device)
        # Pre-training leaves only each row's last position unlabelled: then the head takes every
        # row as it is (those few logits cost less than the gather and scatter of the rest).
        every = kept.numel() >= flat.numel() - rows
        picked = hidden.reshape(rows * length, -1)
        if not every:
            picked = picked.index_select(0, kept)
        wanted = flat if every else flat.index_select(0, kept)
        if empty:
            wanted = wanted.clamp(min=0)
        chunk, entropy = self._chunk_for(module, weight.shape[0]), None
        if chunk == 0 and mesh is None:
            logits = plain(picked).float()
            if self.temperature != 1.0:
                logits = logits / self.temperature
            logps = -F.cross_entropy(logits, wanted, ignore_index=IGNORE_INDEX, reduction="none")
            if self.entropy:
                with torch.no_grad():
                    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
                    entropy = logz[:, 0] - (torch.exp(logits - logz) * logits).sum(-1)
            del logits
        else:
            logps = ChunkedLabelLogps.apply(picked, weight, bias, wanted, chunk or picked.shape[0], group, start,
                                            self.temperature, self.entropy)
            if self.entropy:
                logps, entropy = logps
        if empty:
            logps = logps * 0
        if entropy is not None:
            self.entropies = self._scatter(entropy.detach() * (wanted != IGNORE_INDEX) * (not empty), every, kept,
                                           rows, length)
        whole = self._scatter(logps, every, kept, rows, length)
        if mesh is not None:  # ColwiseParallel's output hook expects a DTensor; the values are whole
            whole = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
        return whole

    @staticmethod
    def _scatter(values: torch.Tensor, every: bool, kept: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """``values`` of the kept positions (``[kept]``) back to fp32 ``[rows, length]``, 0 elsewhere.
        A fresh tensor, not a view of another: FSDP2 warns about views it returns."""
        if every:
            return values.reshape(rows, length).clone()
        return torch.zeros(rows, length, dtype=torch.float32, device=values.device).index_put(
            (kept // length, kept % length), values)


# Bytes of fp32 logits a bounded head (:class:`LabelHead`) holds at once when
# ``trainer.loss_chunk_tokens`` is 0 (both of the forward's chunk-sized tensors where it takes the
# entropy too). Sized in bytes, not tokens, so the bound is the same whatever the vocabulary:
# at 49,152 entries 42 tokens a chunk with the entropy (85 without); the [chunk, hidden] x
# [hidden, vocab] matmul still runs at full speed at that many rows on a CPU.
BOUNDED_CHUNK_BYTES = 16 * 2**20


def bounded_chunk_tokens(vocab: int, copies: int = 2) -> int:
    """Tokens per chunk of a bounded head over ``vocab`` output rows (this rank's share of the
    vocabulary): as many as keep ``copies`` chunk-sized fp32 ``[tokens, vocab]`` tensors within
    :data:`BOUNDED_CHUNK_BYTES` (2: GRPO's forward with its entropy's exponentials), at least 1."""
    return max(1, BOUNDED_CHUNK_BYTES // (copies * 4 * max(1, int(vocab))))


# Model types whose causal-LM forward returns the output layer's result unchanged
# (``logits = self.lm_head(hidden)``, then only Hugging Face's loss), checked in transformers'
# modeling files: the label head is on by default for these (``trainer.logits_at_labels_only``).
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi",
                                    "phi3", "olmo2", "smollm3", "gemma", "starcoder2", "deepseek_v3", "glm4"})


def head_transform(hf_config) -> str | None:
    """What the model's forward does to the output layer's result, as ``field=value``, or None.

    Gemma-2/3 soft-cap the logits (``final_logit_softcapping``), Cohere multiplies them
    (``logit_scale``), Granite divides them (``logits_scaling``): the label head returns log-probs,
    which such a forward would transform as if they were logits.
    """
    for field, identity in (("final_logit_softcapping", (None, 0)), ("logit_scale", (None, 1)),
                            ("logits_scaling", (None, 1))):
        value = getattr(hf_config, field, None)
        if value not in identity:
            return f"{field}={value}"
    return None


def check_model(hf_config) -> None:
    """Refuse ``trainer.loss_chunk_tokens`` for a model whose forward transforms the head's output
    (:func:`head_transform`).

    Raises:
        ConfigError: naming the model field.
    """
    from llmtrain.common.errors import ConfigError

    transform = head_transform(hf_config)
    if transform:
        raise ConfigError(f"trainer.loss_chunk_tokens with a model whose forward transforms the output layer's logits "
                          f"({transform}): the chunked head returns log-probs, not logits; set "
                          "trainer.loss_chunk_tokens=0")


def applies_by_default(model: torch.nn.Module) -> bool:
    """Whether ``trainer.logits_at_labels_only`` installs the label head on ``model``: a model type
    in :data:`PLAIN_HEAD_MODEL_TYPES` with an output embedding and no :func:`head_transform`."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES and head_transform(config) is None
            and model.get_output_embeddings() is not None)


def install(model: torch.nn.Module, chunk_tokens: int, bounded: bool = False) -> LabelHead:
    """Swap ``model``'s output embedding (``get_output_embeddings()``) for a :class:`LabelHead`
    (``chunk_tokens`` 0: whole, or with ``bounded`` chunks of :func:`bounded_chunk_tokens`;
    > 0: :class:`ChunkedLabelLogps` chunks of that many tokens).

    Raises:
        ValueError: the model has no output embedding (a classification head).
        ConfigError: see :func:`check_model`; ``chunk_tokens`` > 0 with an output layer that is
            not a plain ``nn.Linear`` (a PEFT adapter or ``modules_to_save`` copy on ``lm_head``),
            whose weight alone is not the layer.
    """
    check_model(model.config)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embedding for trainer.loss_chunk_tokens")
    if chunk_tokens and not isinstance(head, torch.nn.Linear):
        from llmtrain.common.errors import ConfigError

        raise ConfigError(f"trainer.loss_chunk_tokens={chunk_tokens} with an output layer of type {type(head).__name__} "
                          "(an adapter or a trained copy on lm_head): the chunks read the plain weight; leave lm_head "
                          "out of peft.target_modules / modules_to_save or set trainer.loss_chunk_tokens=0")
    return LabelHead(head, chunk_tokens, bounded)
