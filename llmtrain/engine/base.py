"""The engine boundary: everything the training loop asks of a parallelism backend, and the
pieces every backend shares (optimizer, LR schedule, autocast, clipping).

Loss contract: :meth:`Engine.accumulate_gradients` gets one rank's micro-batches of a step and
the normaliser of the whole global batch (target tokens for next-token training: all
micro-batches, all data-parallel ranks). Each micro-batch's summed loss, computed by the run's
:class:`~llmtrain.objectives.Objective`, is divided by that number, so the accumulated gradient
is that of the global batch's mean loss; the engine undoes whatever averaging over data-parallel
ranks or accumulation steps its backend applies. Ranks of one data-parallel group (its tensor-,
pipeline- and context-parallel peers, ``dims.data_replicas`` of them) see the same samples and
report the same loss. Engines never import a loss: the objective is handed to them.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmtrain.parallel.distributed import DistEnv
from llmtrain.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from llmtrain.objectives import Objective
    from llmtrain.objectives.base import LossSums


def _declares_label_logps_only(objective: Any) -> bool:
    """Whether the default label head may feed ``objective`` label log-probs: a built-in objective
    with ``label_logps_only``, or a user's class that sets it itself. A user's subclass of
    ``CausalLM`` or ``DPO`` inherits the flag but may read the vocabulary in its own ``loss_sums``
    (a z-loss, label smoothing); it keeps whole logits unless it declares the flag (or sets
    ``trainer.loss_chunk_tokens``)."""
    cls = type(objective)
    return bool(objective.label_logps_only) and (cls.__module__.startswith("llmtrain.objectives")
                                                 or "label_logps_only" in vars(cls))


def lr_lambda(trainer_cfg: Any) -> Callable[[int], float]:
    """Multiplier of the base learning rate for optimizer step ``s`` (0-based).

    Linear warmup ``(s + 1) / warmup_steps``, then cosine decay to ``min_lr_ratio`` at
    ``max_steps`` (Loshchilov & Hutter, "SGDR", ICLR 2017, eq. 5, one cycle without restarts).
    """
    warmup, total, floor = trainer_cfg.warmup_steps, trainer_cfg.max_steps, trainer_cfg.min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def apply_schedule(optimizer, scheduler) -> None:
    """Set each group's learning rate from the *current* schedule at the restored step.

    A loaded LambdaLR keeps the rate it last computed, which came from the saved run's schedule;
    after ``trainer.max_steps`` was raised that rate is stale for the first resumed step. With an
    unchanged schedule this recomputes the identical value (same expression as LambdaLR).
    """
    rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def advance_schedule_only(scheduler) -> None:
    """Step the LR schedule for an update that was dropped (``trainer.nonfinite=skip``). torch
    warns when a scheduler steps before its optimizer ever has; here that is the intent: the
    schedule follows trainer steps, skipped or not."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        scheduler.step()


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's forward for ``batch``. Packed rows carry ``position_ids``
    restarting at each sample: then the attention mask is left out, so ``transformers`` builds
    block-diagonal causal attention from the positions (``masking_utils.find_packed_sequence_indices``;
    it needs no cache, hence ``use_cache=False``). Unpacked batches pass their padding mask. A
    vision-language batch's image tensors (``pixel_values`` and the family's others,
    :data:`llmtrain.common.images.IMAGE_INPUTS`) go to the forward as they are."""
    from llmtrain.common.images import IMAGE_INPUTS

    images = {key: batch[key] for key in IMAGE_INPUTS if key in batch}
    if "position_ids" in batch:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False, **images}
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **images}


def param_groups(model: torch.nn.Module, weight_decay: float, scales: dict[int, float] | None = None,
                 lr: float | None = None) -> list[dict]:
    """AdamW groups of the trainable parameters: decay on matrices and embeddings, none on 1-D
    tensors (norms, biases); a group left empty is omitted. ``scales``: ``id(parameter) ->``
    learning-rate multiplier (``model.lr_multipliers``, :func:`llmtrain.models.parts.multipliers`):
    each multiplier other than 1 gets its own pair of groups with ``lr = lr * multiplier``, which
    the LR schedule then scales like every group (LambdaLR keeps each group's initial rate)."""
    scales = scales or {}
    groups: dict[tuple[float, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            # ZeRO-3 flattens partitions to 1-D; ds_shape keeps the logical shape.
            decays = len(getattr(p, "ds_shape", p.shape)) >= 2
            groups.setdefault((scales.get(id(p), 1.0), decays), []).append(p)
    out = []
    for scale in sorted({s for s, _ in groups}, key=lambda s: (s != 1.0, s)):
        for decays in (True, False):
            # An empty group (LoRA trains matrices only) breaks DCP's flattened optimizer state on load.
            if groups.get((scale, decays)):
                group = {"params": groups[(scale, decays)], "weight_decay": weight_decay if decays else 0.0}
                if scale != 1.0:
                    group["lr"] = lr * scale
                out.append(group)
    return out


def clip_gradients(params, grad_clip: float) -> float:
    """Clip the gradients of ``params`` to global L2 norm ``grad_clip`` (0 = measure only) with
    ``torch.nn.utils.clip_grad_norm_``; returns the norm before clipping."""
    return float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))


def first_step_count(optimizer: torch.optim.Optimizer) -> int:
    """Updates an Adam-style optimizer has applied: the ``step`` of its parameter states (0
    before the first, as torch creates state lazily)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def build_adamw(groups: list[dict], trainer_cfg: Any, **options: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``groups`` (:func:`param_groups`) with the trainer's learning
    rate, betas and epsilon (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR
    2019); ``options`` pass through (``foreach``).

    Unless ``foreach`` is given, the fused kernel runs where torch has one (floating-point
    parameters on CPU or CUDA), as Hugging Face Trainer's default ``adamw_torch_fused`` does: on
    CPU, torch's default is otherwise a per-tensor loop of a dozen elementwise passes (14-16 ms
    a step against 4.1 ms fused for a 3 M-parameter model, BENCHMARKS.md)."""
    t = trainer_cfg
    params = [p for group in groups for p in group["params"]]
    if options.get("foreach") is None and params and all(
            p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params):
        options = {**options, "fused": True}
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **options)


def build_scheduler(optimizer: torch.optim.Optimizer, trainer_cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of :func:`lr_lambda` on ``optimizer``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(trainer_cfg))


def autocast(device: torch.device, precision: str):
    """The forward's autocast context: bf16 under ``trainer.precision=bf16``, off for fp32
    (parameters and master weights stay fp32 either way)."""
    enabled = precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16 if enabled else torch.float32, enabled=enabled)


def replicated_frozen_copy(build: Callable[[], torch.nn.Module], device: torch.device, precision: str,
                           bf16_weights: bool = False) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """A frozen copy built whole on ``device`` (layouts that hold whole weights on every rank:
    one process, DDP, ZeRO 0-2) and its forward: ``batch -> logits`` without gradients, under
    the run's :func:`autocast`; with ``bf16_weights`` (the policy computes on bf16 weights: the torch
    engine's bf16 casts, DeepSpeed's bf16 working copy under ZeRO-1/2) its fp32 parameters are cast to bf16 once and it runs
    without autocast, so at step 1 its logits equal the policy's bit for bit (buffers, such as
    RoPE's inverse frequencies, stay fp32 as they do in the policy)."""
    copy = build().to(device).eval().requires_grad_(False)
    if bf16_weights:
        for param in copy.parameters():
            if param.dtype == torch.float32:
                param.data = param.data.to(torch.bfloat16)

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad(), autocast(device, "fp32" if bf16_weights else precision):
            return copy(**model_inputs(batch)).logits
    return forward


class Engine(ABC):
    """A parallelism backend. Lifecycle: ``model_init_context()`` → build model → ``setup(model)``
    → per optimizer step: :meth:`accumulate_gradients` (``accumulate``/``forward``/objective/
    ``backward`` per micro-batch), then :meth:`step`; :meth:`close` at the end.

    Raises (at construction):
        ConfigError: the objective needs a model output this engine does not provide.
    """

    def __init__(self, cfg: Any, env: DistEnv, accumulation_steps: int, dims: ParallelDims | None = None, *,
                 objective: "Objective"):
        self.cfg, self.env, self.accumulation_steps = cfg, env, accumulation_steps
        self.dims = dims or ParallelDims(env.world_size, 1, 1, 1, env.world_size)
        self.objective = objective
        objective.check_supported(type(self).__name__)
        # Set by an engine's setup when recipe.cp > 1 (llmtrain.parallel.context_parallel.ContextParallel).
        self.context = None
        # Set by an engine's setup when the output layer computes label log-probs
        # (llmtrain.models.chunked_loss.LabelHead): trainer.logits_at_labels_only or loss_chunk_tokens.
        self.label_head = None
        # Set by an engine's setup when it stores frozen parameters in bf16 only (no fp32 values):
        # exports that need the base rebuild it from the model's source (checkpoint.export.trained_state).
        self.frozen_in_bf16 = False
        # Set by an engine's setup for a mixture-of-experts model (_install_router_monitors):
        # one llmtrain.models.moe.RouterMonitor per local model part, the MoeShape, the aux coefficient.
        self.routers: list = []
        self.moe_shape = None
        self.router_coef = 0.0
        self._router_sums: torch.Tensor | None = None
        self._aux_sum = 0.0
        if cfg.trainer.get("loss_chunk_tokens", 0) and not objective.label_logps_only:
            from llmtrain.common.errors import ConfigError

            raise ConfigError(f"trainer.loss_chunk_tokens={cfg.trainer.loss_chunk_tokens} with objective "
                              f"{objective.name!r}: its loss reads more of the output than each next label's "
                              "log-probability (label_logps_only=False); set trainer.loss_chunk_tokens=0")

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dims.dp`` data-parallel ranks (which samples it reads)."""
        return self.env.rank

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage group (0 without pipeline parallelism); seeds its dropout stream."""
        return 0

    def accumulate_gradients(self, batches: list[dict[str, torch.Tensor]], normaliser: float) -> torch.Tensor:
        """Accumulate the gradient of one optimizer step over this rank's micro-batches.

        Args:
            batches: micro-batches (``input_ids``, ``attention_mask`` and the objective's
                ``carries`` keys, each ``[micro_batch, seq]``) on the engine's device.
            normaliser: the objective's normaliser of the whole global batch (target tokens
                for next-token training).

        Returns:
            float64 ``[1 + len(objective.metric_names)]``: the summed loss of ``batches`` (not
            normalised), then the summed metrics.
        """
        sums = torch.zeros(1 + len(self.objective.metric_names), dtype=torch.float64, device=self.env.device)
        for k, batch in enumerate(batches):
            with self.accumulate(is_last_micro_batch=k == len(batches) - 1):
                out = self._loss_sums(batch, training=True)
                if self._router_sums is not None:
                    term, aux = self._router_loss(self._router_sums, normaliser)
                    out.loss = out.loss + term
                    self._aux_sum += aux
                self.backward(out.loss / normaliser)
            sums += self.objective.stacked(out)
        return self._whole_rows(sums)

    def _router_loss(self, router_sums: torch.Tensor, normaliser: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The load-balancing term of one micro-batch, on the loss's scale: ``coef * aux`` per
        micro-batch, averaged over the global batch's ``accumulation x dp`` micro-batches (which
        hold the same samples on any number of ranks, so the term does not depend on the
        layout), times ``normaliser`` because the caller divides the summed loss by it. Under
        context parallelism the micro-batch's sums are first added up over its cp ranks (with
        autograd), and each cp rank adds 1/cp of the term (the loss sums are summed over them).

        Returns:
            (the term, with grad; this rank's share of the unweighted aux value, float64 without
            grad, for ``moe/aux_loss``).
        """
        from llmtrain.models.moe import load_balancing_loss

        share = 1.0
        if self.context is not None:
            import torch.distributed.nn.functional as dist_nn

            router_sums = dist_nn.all_reduce(router_sums, group=self.context.group)
            share = 1.0 / self.dims.cp
        E = self.moe_shape.num_experts
        aux = load_balancing_loss(router_sums[:E], router_sums[E:2 * E], router_sums[2 * E], E)
        term = self.router_coef * aux * (normaliser * share / (self.accumulation_steps * self.dims.dp))
        return term, aux.detach().double() * share  # kept on the device: no host sync per micro-batch

    def router_counters(self) -> torch.Tensor | None:
        """This rank's router counters of the step (float64 ``[L (E + 3) + 1]``: tokens per
        expert, entropy sums, real tokens, dropped assignments per layer, then the summed aux
        loss), to be summed over the world and read by :func:`llmtrain.models.moe.step_metrics` (tensor
        parallel peers count alike: divide by tp); None for a dense model. Resets them."""
        if not self.routers:
            return None
        last = self.accumulation_steps if self.dims.pp > 1 else None  # one forward per micro-batch and stage
        flat = sum(router.take_step(last) for router in self.routers)
        aux, self._aux_sum = self._aux_sum, 0.0
        aux = torch.as_tensor(aux, dtype=torch.float64, device=self.env.device).reshape(1)
        return torch.cat([flat.to(self.env.device), aux])

    def _install_router_monitors(self, parts: list[torch.nn.Module], model: torch.nn.Module) -> None:
        """For a mixture-of-experts model: watch each part's routers (:class:`llmtrain.models.moe.RouterMonitor`,
        with ``model.moe_capacity_factor``'s limit) and fold the load-balancing loss into training
        (``model.router_aux_loss_coef``, default the model config's)."""
        from llmtrain.models.moe import RouterMonitor, moe_shape, router_aux_coef

        hf_config = model.config
        shape = moe_shape(hf_config, model)
        if shape is None:
            return
        self.moe_shape, self.router_coef = shape, router_aux_coef(self.cfg.model, hf_config)
        self.hf_layers = int(hf_config.num_hidden_layers)
        factor = float(self.cfg.model.get("moe_capacity_factor", 0.0) or 0.0)
        self.routers = [RouterMonitor(part, hf_config.num_hidden_layers, shape.num_experts, factor) for part in parts]

    @torch.no_grad()
    def eval_sums(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed loss and metrics (float64 ``[1 + len(objective.metric_names)]``) of one batch,
        without gradients."""
        return self._whole_rows(self.objective.stacked(self._loss_sums(batch)))

    def _loss_sums(self, batch: dict[str, torch.Tensor], training: bool = False) -> "LossSums":
        """The objective's sums of ``batch``; under context parallelism, of this rank's part of
        each row (:meth:`llmtrain.parallel.context_parallel.ContextParallel.split`). With a label head
        (:meth:`_install_label_head`) the model returns each position's next-label log-prob
        ``[B, T]`` instead of logits (of the logits over the objective's ``label_temperature``; with
        its ``label_entropy`` each position's entropy rides along as the batch's ``label_entropy``,
        fp32 ``[B, T]``). A mixture-of-experts model's routing sums of the forward
        are left in ``self._router_sums`` (``training``: counted in the step's router metrics)."""
        batch = self._padded_rows(batch)
        local = batch if self.context is None else self.context.split(batch, self.objective.carries)
        if self.routers:
            valid = batch["attention_mask"] if self.context is None else batch["attention_mask"][:, self.context._index]
            for router in self.routers:
                router.begin(valid, training)
        head = self.label_head
        if head is not None:
            labels = local["labels"]
            # Split rows already carry the next token's label one column on (see split).
            head.targets = (labels[:, 1:] if self.context is not None
                            else torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100))
            head.temperature, head.entropy = self.objective.label_temperature, self.objective.label_entropy
        try:
            output = self.forward(local)
        finally:
            entropies = None
            if head is not None:
                head.targets, head.temperature, head.entropy = None, 1.0, False
                entropies = head.take_entropies()
            if self.routers:
                self._router_sums = self.routers[0].end()
        if self.context is not None:
            output = self.context.pad_output(output)
            entropies = self.context.pad_output(entropies) if entropies is not None else None
        if entropies is not None:  # the objective's label_entropy, beside its label log-probs
            local = {**local, "label_entropy": entropies}
        return self.objective.loss_sums(output, local)

    def _padded_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` right-padded to a multiple of tp (``recipe.tp_sequence_parallel`` shards each
        rank's tokens evenly) times 2 cp (context parallelism's head and tail chunks): padding
        carries no loss and, coming after every real token, is not seen by causal attention."""
        multiple = (2 * self.dims.cp if self.dims.cp > 1 else 1) * (
            self.dims.tp if self.cfg.recipe.get("tp_sequence_parallel", False) else 1)
        extra = -batch["input_ids"].shape[1] % multiple
        if not extra:
            return batch
        pads = {"input_ids": 0, "attention_mask": 0, **self.objective.carries}
        out = {key: torch.nn.functional.pad(value, (0, extra), value=pads[key]) if key in pads else value
               for key, value in batch.items()}
        if "position_ids" in batch:
            last = batch["position_ids"][:, -1:]
            out["position_ids"] = torch.cat([batch["position_ids"], last + 1 + torch.arange(extra, device=last.device)], 1)
        return out

    def _install_label_head(self, model: torch.nn.Module) -> None:
        """The output layer computes next-label log-probs of the positions that carry a label
        (:class:`llmtrain.models.chunked_loss.LabelHead`): chunk by chunk with
        ``trainer.loss_chunk_tokens`` > 0; whole with ``trainer.logits_at_labels_only`` (the default)
        for an objective that reads only those (``label_logps_only``), without pipeline stages (the
        schedule's loss takes whole logits), on a model type whose forward leaves the head's output
        as it is (:func:`llmtrain.models.chunked_loss.applies_by_default`)."""
        from llmtrain.models.chunked_loss import applies_by_default, install

        t = self.cfg.trainer
        chunk, bounded = t.get("loss_chunk_tokens", 0), bool(self.objective.label_entropy)
        if chunk:
            self.label_head = install(model, chunk, bounded)
        elif (t.get("logits_at_labels_only", True) and _declares_label_logps_only(self.objective)
              and self.dims.pp == 1 and applies_by_default(model)):
            self.label_head = install(model, 0, bounded)

    def _install_context_parallel(self, model: torch.nn.Module, group) -> None:
        """Split rows over ``group`` (this rank's cp peers) with ``recipe.cp_style`` attention
        (the model was checked for it before the engine was built:
        :func:`llmtrain.parallel.context_parallel.check_model`)."""
        from llmtrain.parallel.context_parallel import ContextParallel, install

        self.context = ContextParallel(group, self.cfg.recipe.cp_style)
        install(model, self.context)

    def _whole_rows(self, sums: torch.Tensor) -> torch.Tensor:
        """Sums over whole rows: a context-parallel group's parts added up, so its ranks report
        the same loss as their tensor- and pipeline-parallel peers do (the loss contract)."""
        if self.context is not None:
            import torch.distributed as dist

            dist.all_reduce(sums, group=self.context.group)
        return sums

    def frozen_copy(self, build: Callable[[], torch.nn.Module], from_config: bool | None = None
                    ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
        """A frozen copy of the model (``build()`` makes it with its initial weights), laid out
        like the policy (sharded where the policy is), for a preference objective's reference or
        a distillation teacher (``build()`` then makes another model). ``from_config``: whether
        ``build()`` makes a model from a config (its weights from the seed) rather than reading
        pretrained weights; None: as the policy. Returns its forward (``batch -> logits``, no
        gradients, the run's autocast), or None where this engine cannot lay one out. Called
        after :meth:`setup`; collective call."""
        return None

    def labelling(self, batch: dict[str, torch.Tensor]):
        """Context in which the model's forward of ``batch`` (whole rows) returns ``[B, T]``
        next-label log-probs (of the logits over the objective's ``label_temperature``) where a label
        head is installed (:meth:`_install_label_head`), and
        logits as ever where none is."""
        if self.label_head is None:
            return contextlib.nullcontext()
        return self.label_head.targeting(batch["labels"], self.objective.label_temperature)

    def frozen_reference(self, build: Callable[[], torch.nn.Module]
                         ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
        """:meth:`frozen_copy` for a reference that reads next-label log-probs only: where the
        policy has a label head (:meth:`_install_label_head`), the copy gets the same kind before
        the engine lays it out, and its forward returns ``[B, T]`` label log-probs computed on the
        labelled rows (in the same chunks), as the policy's forward does; else its logits."""
        if self.label_head is None:
            return self.frozen_copy(build)
        from llmtrain.models.chunked_loss import install

        chunk, bounded, heads = self.label_head.chunk, self.label_head.bounded, []

        def built() -> torch.nn.Module:
            model = build()  # the policy's builder: the model type the policy's head was installed on
            heads.append(install(model, chunk, bounded))
            return model

        forward = self.frozen_copy(built)
        if forward is None:
            return None
        head = heads[0]

        def labelled(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with head.targeting(batch["labels"], self.objective.label_temperature):
                return forward(batch)
        return labelled

    def model_init_context(self):
        """Context in which the model is built (ZeRO-3 partitions parameters as they appear)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def generation_model(self):
        """Context yielding the model with whole weights on this rank, for an online objective's
        sampling loop: its forwards inside make no collectives, so ranks may decode different
        numbers of tokens (tensor-parallel peers decode the same prompts in lockstep). Entering and
        leaving are collective calls where weights are sharded (ZeRO-3, FSDP2 gather them for the
        duration: the whole model's bytes on every rank). Layouts with whole weights yield the
        model itself."""
        yield self.model

    def generation_autocast(self):
        """The autocast the sampling loop's forwards run under: the run's precision."""
        return autocast(self.env.device, self.cfg.trainer.precision)

    def prepare_resume(self, directory: Path, saved_world_size: int) -> None:
        """Called before :meth:`setup` when resuming from ``directory`` (the engine folder of a
        checkpoint written by ``saved_world_size`` ranks): a chance to convert the checkpoint or
        configure the backend for loading it. Collective call."""

    @abstractmethod
    def setup(self, model: torch.nn.Module) -> None:
        """Wrap the model, build optimizer and LR scheduler."""

    @property
    @abstractmethod
    def model(self) -> torch.nn.Module:
        """The unwrapped ``transformers`` model (parameters may be partitions under ZeRO-3)."""

    def accumulate(self, is_last_micro_batch: bool):
        """Context around one micro-batch's forward and backward; gradient sync on the last."""
        return contextlib.nullcontext()

    @abstractmethod
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits ``[micro_batch, seq, vocab]`` for ``batch`` (already on the engine's device)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of ``loss`` (a scalar normalised by the global batch's normaliser)."""

    @abstractmethod
    def step(self, keep_update: Callable[[float], bool] | None = None) -> float:
        """Clip, apply the optimizer and LR schedule, zero gradients; returns the pre-clip
        global gradient L2 norm.

        ``keep_update(norm)``: when given and False, the update is dropped (gradients zeroed,
        parameters and optimizer state untouched) while the LR schedule still advances. Engines
        that cannot decide before updating (DeepSpeed) refuse it at validation."""

    @abstractmethod
    def lr(self) -> float:
        """Learning rate of the next optimizer step."""

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)

    def close(self) -> None:
        """Release the backend's threads and buffers while the process group still exists (the
        trainer's teardown order: tracker, engine, process group). Collective call."""

    def optimizer_step_count(self) -> int:
        """Updates the optimizer has applied (Adam's ``step``); equals the trainer step after
        set-up and after every step, which the trainer checks."""
        return first_step_count(self.optimizer)

    @abstractmethod
    def save_checkpoint(self, directory: Path, background: bool = False):
        """Write model, optimizer and LR-scheduler state into ``directory`` (engine-native,
        sharded where the engine shards). Collective call.

        ``background`` (torch engines; ``trainer.async_checkpoint``): copy the state to host
        memory, return a ``concurrent.futures.Future`` that completes once this rank's files are
        written, and write them while training continues. Otherwise returns None when written."""

    @abstractmethod
    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        """Load what :meth:`save_checkpoint` wrote, possibly by another number of ranks.

        Raises:
            ResumeError: the state cannot be resharded to this world size.
        """

    def num_parameters(self) -> int:
        """Distinct parameters of the whole model (tied counted once), whatever the sharding.
        Collective call."""
        from llmtrain.models.build import count_parameters

        return count_parameters(self.model)

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated model state dict on rank 0 (None on other ranks). Collective call."""


def check_optimizer_steps(engine: Engine, state: Any) -> None:
    """The optimizer has applied exactly one update per trainer step (less the skipped ones):
    an extra update at set-up (DeepSpeed's bf16 ZeRO-0 wrapper once took one) would add a weight
    decay and shift Adam's bias correction unseen. ``state``: the train state (its ``step`` and
    ``skipped_updates``, :class:`llmtrain.checkpoint.state.TrainState`).

    Raises:
        RuntimeError: the counts differ (a bug in an engine, not bad input).
    """
    expected, taken = state.step - state.skipped_updates, engine.optimizer_step_count()
    if taken != expected:
        raise RuntimeError(f"the optimizer has applied {taken} updates at trainer step {state.step} "
                           f"({state.skipped_updates} skipped): expected {expected}")
