"""Torch-native engine: FSDP2 (full or hybrid shard), tensor parallel and pipeline parallel over
one device mesh, for any Hugging Face decoder.

Set-up order (one owner per concern): ``ParallelDims`` → mesh → (pipeline split) → per model
part ``llmtrain.parallel.parallelize.parallelize`` (TP → activation checkpointing → compile → FSDP2) →
materialise and initialise the shards → optimizer and LR schedule. Models built from a config
are created on the meta device, so no rank ever holds the whole model; pretrained weights are
read on every rank and then sharded.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import llmtrain.engine.dcp_state as dcp_state
from llmtrain.engine.base import (Engine, advance_schedule_only, apply_schedule, autocast, build_scheduler,
                                  first_step_count, model_inputs)
from llmtrain.engine.optimizers import build_optimizer
from llmtrain.models.build import initial_value, parameter_numel


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)



@contextlib.contextmanager
def bf16_weights(model: nn.Module, enabled: bool):
    """The model's plain (non-DTensor) fp32 parameters held as bf16 for
    the duration, the fp32 tensors restored after, untouched (the master weights the optimizer
    steps). Why: a bf16 run's training forwards compute in bf16 under autocast anyway, but a
    sampling loop of one-token forwards pays autocast's per-call cast of every weight; decoding
    from bf16 weights was 2.4x faster than under autocast (and 1.9x faster than fp32) on a
    SmolLM2-135M-shaped model on this CPU: ``scripts/bench/rollout.py``. Costs a bf16 copy of the weights (2 bytes per parameter)
    while sampling. Buffers stay fp32 (RoPE's inverse frequencies rounded to bf16 would move every
    position); distributed tensors (tensor parallel) are left as they are."""
    if not enabled:
        yield model
        return
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for tensor in model.parameters():
                if tensor.dtype == torch.float32 and type(tensor) in (torch.Tensor, nn.Parameter):
                    saved.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(torch.bfloat16)
        yield model
    finally:
        for tensor, fp32 in saved:
            tensor.data = fp32


class NativeEngine(Engine):
    """FSDP2 / HSDP / TP / PP and their combinations on the mesh ``pp x dp_replicate x
    dp_shard x tp``. Gradients follow the loss contract: FSDP2 averages over the data-parallel
    ranks, so non-pipeline losses are scaled by ``dp``; pipeline schedules run with
    ``scale_grads=False`` and the same scaling in their loss function."""

    def __init__(self, cfg: Any, env, accumulation_steps: int, dims, *, objective):
        super().__init__(cfg, env, accumulation_steps, dims, objective=objective)
        self.mesh = dims.build_mesh(env.device.type)
        self._pp_rank = self.mesh.get_local_rank("pp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self._dp_rank = (self.mesh.get_local_rank("dp_replicate") * dims.dp_shard
                         + self.mesh.get_local_rank("dp_shard"))
        self.from_config = cfg.model.source == "config"

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def pp_rank(self) -> int:
        return self._pp_rank

    def model_init_context(self):
        if self.from_config:
            # Parameters on the meta device (no memory); buffers (rotary frequencies) are real.
            from accelerate import init_empty_weights

            return init_empty_weights(include_buffers=False)
        return contextlib.nullcontext()

    # ---- set-up ---------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        from llmtrain.parallel.parallelize import parallelize, tp_plan

        cfg, r, t = self.cfg, self.cfg.recipe, self.cfg.trainer
        self.hf_config = model.config
        # A reward model's classification head is not an output embedding: nothing to tie.
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False)) and model.get_output_embeddings() is not None
        self.tied_sync = None
        if self.tied:
            model.tie_weights()  # accelerate's meta-device init builds the two as separate tensors
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                raise RuntimeError("tie_word_embeddings=True but the output head is not tied after tie_weights()")
        plan = tp_plan(model, cfg.model.get("tp_plan")) if self.dims.tp > 1 else None
        if self.dims.pp > 1:
            from llmtrain.parallel.pipeline import split_stages

            self.stage_ids, self.parts = zip(*split_stages(model, self.dims.pp, self.pp_rank, r.pp_stages_per_rank))
            self.stage_ids, self.parts = list(self.stage_ids), list(self.parts)
        else:
            self.stage_ids, self.parts = [0], [model]
        if self.dims.cp > 1:
            self._install_context_parallel(model, self.mesh["cp"].get_group())
        self._install_label_head(model)
        buffers = [{n: b.detach().clone() for n, b in part.named_buffers()} for part in self.parts]
        for part in self.parts:
            parallelize(part, cfg, self.mesh, self.dims, plan)
        from llmtrain.parallel.parallelize import tp_replicated_params

        self._tp_grad_sum = [p for part in self.parts for p in tp_replicated_params(part, plan)] if plan else []
        for part, saved in zip(self.parts, buffers):
            self._materialize(part, saved)
        self._install_router_monitors(self.parts, model)
        if self.dims.pp > 1:
            for part, router in zip(self.parts, self.routers):
                part.router = router  # DecoderStage carries the router sums between stages
        self.optimizers, self.schedulers = [], []
        foreach = False if self.dims.tp > 1 else None  # TP mixes DTensor and plain params
        for part in self.parts:
            opt = build_optimizer(part, t, foreach=foreach, model_cfg=self.cfg.model)
            self.optimizers.append(opt)
            self.schedulers.append(build_scheduler(opt, t))
        if self.dims.pp > 1:
            self._setup_pipeline()
        if self.dims.tp > 1:
            self._check_tp_plan_runs()

    def frozen_copy(self, build, from_config=None):
        """The copy goes through the same ``parallelize`` (TP plan, FSDP2 shards) as the policy;
        not for pipeline layouts (no preference objective runs there). A pretrained copy is read
        whole, then sharded (only a config model starts on the meta device and is filled from
        the seed)."""
        if self.dims.pp > 1:
            return None
        from llmtrain.parallel.parallelize import parallelize, tp_plan

        meta = self.from_config if from_config is None else from_config
        with self.model_init_context() if meta else contextlib.nullcontext():
            copy = build()
        if self.tied:
            copy.tie_weights()
        plan = tp_plan(copy, self.cfg.model.get("tp_plan")) if self.dims.tp > 1 else None
        buffers = {n: b.detach().clone() for n, b in copy.named_buffers()}
        parallelize(copy, self.cfg, self.mesh, self.dims, plan)
        self._materialize(copy, buffers)
        copy.requires_grad_(False)
        copy.eval()

        def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.no_grad(), self._autocast():
                return copy(**model_inputs(batch)).logits
        return forward

    def _check_tp_plan_runs(self) -> None:
        """One tiny forward before anything is written: an inconsistent plan (say, a column-
        parallel projection feeding an unsharded one) fails here as a ConfigError, not later."""
        from llmtrain.common.errors import ConfigError

        ids = torch.zeros(1, 4 * self.dims.cp * self.dims.tp, dtype=torch.long, device=self.env.device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        try:
            self.train(False)
            with torch.no_grad():
                self._logits(self.context.split(batch, {}) if self.context is not None else batch)
        except RuntimeError as err:
            raise ConfigError(f"the tensor-parallel plan does not run on this model (check model.tp_plan): {err}") from err
        finally:
            self.train(True)

    @torch.no_grad()
    def _materialize(self, part: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
        """Allocate this rank's shards and fill them: from the seed per parameter name (config
        models: each rank computes a full tensor at a time and keeps its shard) or from the
        pretrained weights already in place."""
        if not any(p.is_meta for p in part.parameters()):
            part.to(self.env.device)
            return
        from torch.distributed.tensor import distribute_tensor

        part.to_empty(device=self.env.device)
        self._retie(part)
        std = float(getattr(self.hf_config, "initializer_range", 0.02))
        for name, param in part.named_parameters():
            full = initial_value(name, param.shape, self.cfg.trainer.seed, std).to(param.dtype)
            if _is_dtensor(param):
                param._local_tensor.copy_(distribute_tensor(full, param.device_mesh, param.placements)._local_tensor)
            else:
                param.copy_(full)
        for name, buf in part.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])

    def _retie(self, part: nn.Module) -> None:
        """``to_empty`` gives each module its own new tensor, splitting tied embeddings."""
        if not self.tied or not hasattr(part, "lm_head"):
            return
        from llmtrain.parallel.pipeline import base_model

        embed = getattr(base_model(part), "embed_tokens", None)
        if embed is not None and part.lm_head.weight is not embed.weight:
            part.lm_head.weight = embed.weight

    def _setup_pipeline(self) -> None:
        from llmtrain.parallel.pipeline import TiedWeightSync

        r = self.cfg.recipe
        self.pp_group = self.mesh["pp"].get_group()
        self.num_stages = self.dims.pp * r.pp_stages_per_rank
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self._normaliser = 1.0
        self._schedules: dict[int, Any] = {}  # padded step length -> its schedule
        if self.tied:
            self.tied_sync = TiedWeightSync(self.mesh, self.parts)
        ranks = dist.get_process_group_ranks(self.pp_group)
        self._last_stage_rank = ranks[(self.num_stages - 1) % self.dims.pp]

    def _schedule_for(self, length: int):
        """The pipeline schedule of steps padded to ``length``. Stages exchange fixed-shape
        activations, inferred at a schedule's first step, so each length gets its own
        (``PipelineStage`` objects are light; the model parts are shared)."""
        if length not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            from llmtrain.parallel.pipeline import build_schedule

            stages = [PipelineStage(part, s, self.num_stages, self.env.device, group=self.pp_group)
                      for s, part in zip(self.stage_ids, self.parts)]
            self._schedules[length] = build_schedule(self.cfg.recipe.pp_schedule, stages, self.accumulation_steps,
                                                     self._pipeline_loss)
        return self._schedules[length]

    def _pipeline_loss(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], target: torch.Tensor
                       ) -> torch.Tensor:
        """The schedule's loss of one micro-batch on the last stage: the objective's summed loss
        (plus a mixture-of-experts model's load-balancing term, from the router sums every stage
        added to) over the global normaliser, times ``dp`` as in :meth:`backward`; its sums are
        kept for the step's result."""
        from llmtrain.parallel.pipeline import unpack_targets

        logits, router_sums = output if isinstance(output, tuple) else (output, None)
        out = self.objective.loss_sums(logits, unpack_targets(target, self._target_layout))
        aux = 0.0
        if router_sums is not None:
            term, aux = self._router_loss(router_sums, self._normaliser)
            out.loss = out.loss + term
        loss = out.loss / self._normaliser * self.dims.dp
        self._pipeline_sums.append((loss, self.objective.stacked(out), aux))
        return loss

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    @contextlib.contextmanager
    def generation_model(self):
        """FSDP2: every FSDP module unsharded (all-gathered once, collectively) and kept so during
        the sampling loop (``reshard_after_forward`` off), so its forwards make no collectives;
        resharded after (bf16 runs gather bf16 weights: FSDP2's ``param_dtype``). Tensor parallel
        alone: the model as it is (peers decode in lockstep). Pipeline stages cannot decode a
        sequence alone: refused at validation. Tensor parallel without FSDP under
        ``trainer.precision=bf16`` decodes from bf16 weights (:func:`bf16_weights`; one process and
        DDP run on the torch engine, which samples on its bf16 weight casts)."""
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in self.parts[0].modules() if isinstance(m, FSDPModule)]
        if not sharded:
            with bf16_weights(self.parts[0], self.cfg.trainer.precision == "bf16"):
                yield self.parts[0]
            return
        for module in sharded:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield self.parts[0]
        finally:
            for module in sharded:
                module.reshard()
                module.set_reshard_after_forward(self.cfg.recipe.zero_stage == 3, recurse=False)

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def _autocast(self):
        return autocast(self.env.device, self.cfg.trainer.precision)

    # ---- one step -------------------------------------------------------------------------
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self._autocast():
            return self.parts[0](**model_inputs(batch)).logits

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.dims.dp_cp).backward()  # FSDP2 averages gradients over the dp x cp ranks

    def accumulate(self, is_last_micro_batch: bool):
        model = self.parts[0]
        if hasattr(model, "set_requires_gradient_sync"):
            # Reduce-scatter once per step, not per micro-batch.
            model.set_requires_gradient_sync(is_last_micro_batch)
        return contextlib.nullcontext()

    def accumulate_gradients(self, batches: list[dict[str, torch.Tensor]], normaliser: float) -> torch.Tensor:
        if self.dims.pp == 1:
            return super().accumulate_gradients(batches, normaliser)
        from llmtrain.parallel.pipeline import pack_targets

        input_ids, carried, positions = self._pipeline_batch(batches)
        target, self._target_layout = pack_targets(carried)
        self._normaliser = normaliser
        self._pipeline_sums: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        losses: list[torch.Tensor] = []
        with self._autocast():
            kwargs = {"target": target, "losses": losses} if self.has_last else {}
            if positions is not None:  # split into micro-batches for every stage by the schedule
                kwargs["position_ids"] = positions
            if self.routers:
                length = input_ids.shape[1]
                kwargs["token_mask"] = torch.cat([torch.nn.functional.pad(b["attention_mask"], (0, length - b["attention_mask"].shape[1]))
                                                  for b in batches])
            # return_outputs=False: the loss function sees each micro-batch's logits; keeping
            # them all for a merged output would hold accumulation x micro x seq x vocab floats
            # on the last stage (1 TB for Llama-3-8B at 512 micro-batches of 4096 tokens).
            self._schedule_for(input_ids.shape[1]).step(*([input_ids] if self.has_first else []), return_outputs=False,
                                                        **kwargs)
        sums = torch.zeros(1 + len(self.objective.metric_names), dtype=torch.float64, device=self.env.device)
        # The schedule's own losses are its micro-batches; a schedule's first step also calls the
        # loss function once to infer gradient shapes, which must not count.
        counted = {id(loss) for loss in losses}
        for loss, stacked, aux in self._pipeline_sums:
            if id(loss) in counted:
                sums += stacked
                self._aux_sum += aux
        self._pipeline_sums = []
        dist.broadcast(sums, src=self._last_stage_rank, group=self.pp_group)
        return sums

    def _pipeline_batch(self, batches: list[dict[str, torch.Tensor]]
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """Concatenate micro-batches, right-padded to one length: the step's longest micro-batch
        rounded up to a multiple of ``recipe.pp_pad_multiple`` (at most ``data.seq_len``), so short
        variable-length steps do not compute a full ``seq_len`` of padding while the number of
        distinct shapes (one pipeline schedule each) stays small. Every rank of a pipeline
        holds the same samples, so the stages agree on the length without communicating.
        Returns ``input_ids``, the objective's ``carries`` tensors (padded with their pad values,
        which carry no loss) and, for packed rows, ``position_ids`` (padding continues as one more
        sequence), each ``[micro_batches * micro_batch, length]``."""
        longest = max(b["input_ids"].shape[1] for b in batches)
        multiple = self.cfg.recipe.pp_pad_multiple
        seq = min(self.cfg.data.seq_len, -(-longest // multiple) * multiple)
        pads = self.objective.carries
        ids, carried, positions = [], {key: [] for key in pads}, []
        for b in batches:
            extra = seq - b["input_ids"].shape[1]
            # Any token id will do: padded positions come after every real token (causal
            # attention never looks at them) and their label is ignored.
            ids.append(torch.nn.functional.pad(b["input_ids"], (0, extra), value=0))
            for key, pad in pads.items():
                carried[key].append(torch.nn.functional.pad(b[key], (0, extra), value=pad))
            if "position_ids" in b:
                tail = torch.arange(extra, device=b["position_ids"].device).expand(len(b["position_ids"]), -1)
                positions.append(torch.cat([b["position_ids"], tail], dim=1))
        return (torch.cat(ids), {key: torch.cat(parts) for key, parts in carried.items()},
                torch.cat(positions) if positions else None)

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Logits of one batch under the run's autocast; with pipeline stages, by blocking
        send/recv through every stage (any batch shape) and only on the last stage's rank."""
        with self._autocast():
            if self.dims.pp == 1:
                return self.forward(batch)
            from llmtrain.parallel.pipeline import forward_only

            return forward_only(dict(zip(self.stage_ids, self.parts)), self.num_stages, self.pp_group,
                                batch["input_ids"], self.hf_config.hidden_size, batch.get("position_ids"))

    @torch.no_grad()
    def eval_sums(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.dims.pp == 1:
            with self._autocast():
                return super().eval_sums(batch)
        logits = self._logits(batch)
        sums = torch.zeros(1 + len(self.objective.metric_names), dtype=torch.float64, device=self.env.device)
        if logits is not None:
            sums += self.objective.stacked(self.objective.loss_sums(logits, batch))
        dist.broadcast(sums, src=self._last_stage_rank, group=self.pp_group)
        return sums

    def step(self, keep_update=None) -> float:
        if self.tied_sync is not None:
            self.tied_sync.sync()
        for p in self._tp_grad_sum:  # each TP rank's gradient of a per-head norm covers its own heads
            if p.grad is not None:
                dist.all_reduce(getattr(p.grad, "_local_tensor", p.grad), group=self.mesh["tp"].get_group())
        norm = self._grad_norm()
        if keep_update is not None and not keep_update(norm):
            for opt, sched in zip(self.optimizers, self.schedulers):
                advance_schedule_only(sched)
                opt.zero_grad(set_to_none=True)
            return norm
        clip = self.cfg.trainer.grad_clip
        if clip > 0:
            # Same coefficient as torch.nn.utils.clip_grad_norm_.
            coef = min(1.0, clip / (norm + 1e-6))
            if coef < 1.0:
                for part in self.parts:
                    for p in part.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return norm

    def _grad_norm(self) -> float:
        """Global L2 norm of all gradients: squares summed over local shards, then over the mesh
        dims each gradient is sharded on, then over pipeline stages (tied copy counted once)."""
        by_groups: dict[tuple, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64,
                                                                                device=self.env.device))
        for part in self.parts:
            skip = getattr(part, "tied_copy", None)
            for p in part.parameters():
                if p.grad is None or p is skip:
                    continue
                g = p.grad
                if _is_dtensor(g) and any(pl.is_partial() for pl in g.placements):
                    # Sequence-parallel norms leave their weight gradients as per-rank partial
                    # sums: reduce them once here, so the norm and the update see the total.
                    from torch.distributed.tensor import Replicate

                    g = p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl
                                                                for pl in g.placements])
                if _is_dtensor(g):
                    # Shard and FSDP2's _StridedShard (2D) both split the tensor: sum over them.
                    groups = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements)
                                   if not pl.is_replicate())
                    g = g._local_tensor
                else:
                    groups = ()
                by_groups[groups] += g.double().pow(2).sum()
        total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for groups, value in sorted(by_groups.items(), key=lambda kv: len(kv[0])):
            for group in groups:
                dist.all_reduce(value, group=group)
            total += value
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.pp_group)
        return float(total.sqrt())

    def lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"])  # torchao keeps lr as a tensor

    def optimizer_step_count(self) -> int:
        counts = {first_step_count(opt) for opt in self.optimizers}  # one optimizer per local stage
        return counts.pop() if len(counts) == 1 else -1

    # ---- checkpoints and export -----------------------------------------------------------
    def save_checkpoint(self, directory: Path, background: bool = False):
        return dcp_state.save(directory, self.parts, self.optimizers, self.schedulers[0], self.env.is_main, background)

    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        dcp_state.load(directory, self.parts, self.optimizers, self.schedulers)
        for opt, sched in zip(self.optimizers, self.schedulers):
            apply_schedule(opt, sched)

    def num_parameters(self) -> int:
        seen: dict[str, int] = {}
        for part in self.parts:
            for name, p in part.named_parameters():
                seen[name] = parameter_numel(p, name)  # DTensor numel is the global size; 4-bit codes as weights
        counts = [None] * self.env.world_size
        dist.all_gather_object(counts, seen)
        merged: dict[str, int] = {}
        for c in counts:
            merged.update(c)
        return sum(merged.values())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True)
        # One rank per pipeline stage group (dp and tp rank 0) contributes its stages' tensors;
        # every rank takes part in gathering them (a collective), only contributors copy to host.
        contribute = self._dp_rank == 0 and self.tp_rank == 0
        mine: dict[str, torch.Tensor] = {}
        import logging

        # Gathering an expert-parallel tensor (FSDP2 and ep both on dim 0) takes two all-gathers,
        # which torch logs as a warning per tensor and rank; it is the expected cost of an export.
        redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
        level = redistribute_log.level
        redistribute_log.setLevel(logging.ERROR)
        try:
            for part in self.parts:
                full = get_model_state_dict(part, options=options)
                if contribute:
                    mine.update({k: v.detach().cpu() for k, v in full.items()})
        finally:
            redistribute_log.setLevel(level)
        gathered = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(mine if contribute else None, gathered, dst=0)
        if not self.env.is_main:
            return None
        full: dict[str, torch.Tensor] = {}
        for sd in gathered:
            if sd:
                full.update(sd)
        return full
