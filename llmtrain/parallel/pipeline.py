"""Pipeline parallelism for any Hugging Face decoder (embedding → decoder layers → norm → head).

:func:`split_stages` cuts the model into ``pp x stages_per_rank`` stages of contiguous decoder
layers; stage ``s`` runs on pipeline rank ``s % pp`` (looped placement, as the interleaved 1F1B
schedule expects). A stage is a :class:`DecoderStage` that keeps the model's own module names
(``model.layers.5...``), so checkpoints written by any layout load into any other.

Tied input/output embeddings (``lm_head.weight is embed_tokens.weight``) sit on the first and
the last stage: the last stage keeps its copy registered under the embedding's name, and
:class:`TiedWeightSync` sums the two gradients after backward (Megatron-LM's embedding
all-reduce, Shoeybi et al. 2019), so both copies take identical optimizer steps.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from llmtrain.common.errors import ConfigError

REQUIRED_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def base_model(module: nn.Module) -> nn.Module:
    """The decoder body (``model.model`` for Llama/Qwen2/Mistral; the same for a stage)."""
    return getattr(module, module.base_model_prefix)


def check_pipeline_support(model: nn.Module) -> None:
    """Raises ConfigError unless ``model`` has the embed/layers/norm/rotary/lm_head layout."""
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    missing = [p for p in REQUIRED_PARTS if body is None or not hasattr(body, p)]
    if not hasattr(model, "lm_head"):
        missing.append("lm_head")
    if missing:
        raise ConfigError(f"recipe.pp > 1: model type {model.config.model_type!r} lacks {', '.join(missing)}; "
                          "llmtrain pipelines decoders laid out as embed_tokens / layers / norm / rotary_emb / "
                          "lm_head (Llama, Qwen2, Mistral, ...). Use recipe.pp=1 for this model")


def stage_layer_ids(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous, balanced decoder-layer indices per stage (earlier stages take the remainder)."""
    size, extra = divmod(num_layers, num_stages)
    ids, start = [], 0
    for s in range(num_stages):
        n = size + (1 if s < extra else 0)
        ids.append(list(range(start, start + n)))
        start += n
    return ids


class DecoderStage(nn.Module):
    """One pipeline stage of a causal LM: (embedding) → some decoder layers → (norm → head).

    Input: token ids ``[micro_batch, seq]`` on the first stage, hidden states
    ``[micro_batch, seq, hidden]`` elsewhere. Output: hidden states, or logits
    ``[micro_batch, seq, vocab]`` on the last stage. Attention is causal without a padding mask,
    which is exact for right-padded batches (llmtrain's collator): real tokens never attend to
    later positions, and padded positions carry no loss.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool):
        super().__init__()
        self.base_model_prefix = model.base_model_prefix
        self.config = model.config
        body = base_model(model)
        holder = nn.Module()
        tied = model.lm_head.weight is body.embed_tokens.weight
        if is_first or (is_last and tied):
            holder.embed_tokens = body.embed_tokens
        holder.layers = nn.ModuleDict({str(i): body.layers[i] for i in layer_ids})
        holder.rotary_emb = body.rotary_emb
        if is_last:
            holder.norm = body.norm
        # The body first: a tied weight then takes the embedding's name, as in the full model.
        setattr(self, self.base_model_prefix, holder)
        if is_last:
            self.lm_head = model.lm_head
        self.is_first, self.is_last = is_first, is_last
        self.holds_tied_weight = tied and (is_first or is_last)
    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of a tied embedding (the first stage's is the one counted in
        the gradient norm), or None."""
        return base_model(self).embed_tokens.weight if self.holds_tied_weight and not self.is_first else None

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor | None = None,
                token_mask: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x``: token ids ``[B, T]`` (first stage) or hidden states ``[B, T, hidden]``.
        ``position_ids`` ``[B, T]``: packed rows' positions, restarting at each sample, so that
        attention stays inside it (every stage gets them: the schedule splits keyword arguments
        into micro-batches for all stages); None: ``0..T-1``.

        Mixture-of-experts models (the engine sets ``self.router``, a
        :class:`llmtrain.models.moe.RouterMonitor`): ``token_mask`` ``[B, T]`` marks real tokens, and
        every stage returns ``(output, router sums)``, the load-balancing loss's sums over the
        MoE layers of this stage and all earlier ones (``carried``: the previous stage's), so
        the last stage's loss sees the whole model's, with gradients back through the stages."""
        router = getattr(self, "router", None)
        if router is not None:
            router.begin(token_mask, torch.is_grad_enabled())
        out = self._layers(x, position_ids)
        if router is None:
            return out
        sums = router.end(x.device)
        return out, (sums + carried[0] if carried else sums)

    def _layers(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        body = base_model(self)
        h = body.embed_tokens(x) if self.is_first else x
        positions = position_ids if position_ids is not None else torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = body.rotary_emb(h, position_ids=positions)
        layer_types = getattr(self.config, "layer_types", None)
        masks: dict[str, Any] = {}
        for index, layer in body.layers.items():
            kind = layer_types[int(index)] if layer_types else "full_attention"
            if kind not in masks:
                make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                masks[kind] = make(config=self.config, inputs_embeds=h, attention_mask=None, cache=None,
                                   position_ids=positions)
            h = layer(h, attention_mask=masks[kind], position_ids=positions, position_embeddings=rotary)
            if isinstance(h, tuple):
                h = h[0]
        if self.is_last:
            return self.lm_head(body.norm(h))
        return h


def split_stages(model: nn.Module, pp: int, pp_rank: int, stages_per_rank: int) -> list[tuple[int, DecoderStage]]:
    """This pipeline rank's stages as ``(stage index, module)``, in increasing stage order."""
    check_pipeline_support(model)
    num_stages = pp * stages_per_rank
    ids = stage_layer_ids(model.config.num_hidden_layers, num_stages)
    return [(s, DecoderStage(model, ids[s], s == 0, s == num_stages - 1))
            for s in range(pp_rank, num_stages, pp)]


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn: Callable):
    """A ``torch.distributed.pipelining`` schedule. ``scale_grads=False``: ``loss_fn(output,
    target)`` is already normalised by the global batch's normaliser (the loss contract of every
    engine; the engine's objective computes it).

    GPipe (Huang et al. 2019): all forwards, then all backwards; 1F1B (Narayanan et al. 2021):
    one forward one backward in steady state, activations of at most ``pp`` micro-batches live;
    interleaved 1F1B (Narayanan et al., SC'21, section 2.2): ``v`` stages per rank shrink the
    bubble from (p-1)/(m+p-1) to (p-1)/(v*m+p-1).
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    schedule = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return schedule(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


def pack_targets(carried: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, torch.dtype]]]:
    """One tensor for a schedule's ``target`` (torch's schedules split a single tensor into
    micro-batches along dim 0) from the objective's per-token tensors ``[N, T]``: the tensor itself
    when there is one, else all of them stacked as float64 ``[N, T, K]`` (exact for integer labels
    below 2**53). Returns the target and the layout :func:`unpack_targets` reads back."""
    layout = [(key, t.dtype) for key, t in carried.items()]
    if len(carried) == 1:
        return next(iter(carried.values())), layout
    return torch.stack([t.to(torch.float64) for t in carried.values()], dim=-1), layout


def unpack_targets(target: torch.Tensor, layout: list[tuple[str, torch.dtype]]) -> dict[str, torch.Tensor]:
    """The per-token tensors of one micro-batch from its slice of :func:`pack_targets`' target."""
    if len(layout) == 1:
        return {layout[0][0]: target}
    return {key: target[..., k].to(dtype) for k, (key, dtype) in enumerate(layout)}


@torch.no_grad()
def forward_only(stages: dict[int, nn.Module], num_stages: int, pp_group, x: torch.Tensor,
                 hidden_size: int, position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Run one batch ``x`` ``[B, T]`` (with packed rows' ``position_ids``) through all stages
    with blocking send/recv (evaluation; any batch shape). Returns the logits on the rank of the
    last stage, None elsewhere."""
    ranks = dist.get_process_group_ranks(pp_group)
    pp, me = len(ranks), dist.get_rank(pp_group)
    h = None
    for s in range(num_stages):
        if s % pp != me:
            continue
        if s > 0:
            h = torch.empty(x.shape[0], x.shape[1], hidden_size, dtype=torch.float32, device=x.device)
            dist.recv(h, src=ranks[(s - 1) % pp], group=pp_group)
        out = stages[s](x if s == 0 else h, position_ids=position_ids)
        if isinstance(out, tuple):  # (output, router sums): no load-balancing loss without gradients
            out = out[0]
        if s == num_stages - 1:
            return out
        dist.send(out.float().contiguous(), dst=ranks[(s + 1) % pp], group=pp_group)
    return None


class TiedWeightSync:
    """Sums the gradient of the tied embedding between the first and the last stage.

    One process group per (dp_replicate, dp_shard, tp) coordinate joins the ranks holding stage 0
    and the last stage; created collectively by every rank, in the same order.
    """

    def __init__(self, mesh, parts: list[nn.Module]):
        grid = mesh.mesh  # [pp, dp_replicate, dp_shard, tp] global ranks
        first, last = grid[0].flatten().tolist(), grid[-1].flatten().tolist()
        self.group = None
        me = dist.get_rank()
        for a, b in zip(first, last):
            group = dist.new_group([a, b])
            if me in (a, b):
                self.group = group
        self.params = [base_model(part).embed_tokens.weight for part in parts if part.holds_tied_weight]

    def sync(self) -> None:
        for p in self.params:
            if p.grad is not None:
                # A DTensor gradient (FSDP shard) is synced shard by shard: both stages shard alike.
                dist.all_reduce(getattr(p.grad, "_local_tensor", p.grad), group=self.group)
