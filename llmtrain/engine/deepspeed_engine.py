"""DeepSpeed engine: ZeRO stages 0-3 with optional CPU offload.

The DeepSpeed JSON is generated from the typed recipe and trainer config by
:func:`deepspeed_config` (one source of truth: no ``"auto"`` values to keep in sync).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

import llmtrain.parallel.distributed  # noqa: F401  (sets DS_ACCELERATOR=cpu without CUDA before deepspeed loads)
from llmtrain.engine.deepspeed_imports import import_deepspeed
from llmtrain.engine.base import (Engine, apply_schedule, clip_gradients, first_step_count, lr_lambda,
                                  model_inputs, param_groups, replicated_frozen_copy)
from llmtrain.engine.optimizers import build_optimizer, group_scales


def communication_sizes(recipe: Any, hidden_size: int) -> dict[str, int]:
    """DeepSpeed's bucket, prefetch and persistence sizes (elements) for a model of
    ``hidden_size``; a recipe field that is set wins over the derived value.

    The rule is the one Hugging Face's DeepSpeed integration applies to ``"auto"`` values
    (transformers ``integrations/deepspeed.py``, ``trainer_config_finalize``): reduce and
    all-gather buckets of hidden² elements, a ZeRO-3 prefetch of 0.9 × hidden², and parameters
    under 10 × hidden elements (norms, biases) kept gathered. DeepSpeed's own defaults (5e7 and
    5e8 elements) are sized for multi-billion-parameter models: on a small model one bucket
    alone outweighs the sharded model state.
    """
    derived = {"reduce_bucket_size": hidden_size * hidden_size,
               "allgather_bucket_size": hidden_size * hidden_size,
               "prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
               "param_persistence_threshold": 10 * hidden_size}
    return {k: v if getattr(recipe, k, None) is None else int(getattr(recipe, k)) for k, v in derived.items()}


def deepspeed_config(cfg: Any, world_size: int, accumulation_steps: int) -> dict:
    """DeepSpeed config dict for ``cfg.recipe``, ``cfg.trainer`` and the model's size.

    Batch sizes: ``train_batch_size`` = micro-batch × accumulation × world size (samples).
    Communication sizes: :func:`communication_sizes`. With optimizer offload DeepSpeed builds
    its CPU AdamW (``DeepSpeedCPUAdam``) from the ``optimizer`` section; otherwise the engine
    passes a ``torch.optim.AdamW``.
    """
    from llmtrain.models.build import model_config
    from llmtrain.models.vision import text_config

    r, t = cfg.recipe, cfg.trainer
    # An image-text model sizes its buckets by its language model, the larger part.
    sizes = communication_sizes(r, text_config(model_config(cfg.model)).hidden_size)
    zero: dict[str, Any] = {"stage": r.zero_stage, "overlap_comm": r.overlap_comm,
                            "reduce_bucket_size": sizes["reduce_bucket_size"]}
    if r.zero_stage in (1, 2):
        zero.update(allgather_bucket_size=sizes["allgather_bucket_size"], contiguous_gradients=True,
                    use_multi_rank_bucket_allreduce=r.multi_rank_bucket_allreduce)
    if r.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True,
                    stage3_prefetch_bucket_size=sizes["prefetch_bucket_size"],
                    stage3_param_persistence_threshold=sizes["param_persistence_threshold"])
        if r.max_live_parameters is not None:
            zero["stage3_max_live_parameters"] = int(r.max_live_parameters)
        if r.max_reuse_distance is not None:
            zero["stage3_max_reuse_distance"] = int(r.max_reuse_distance)
    if r.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if r.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_batch_size": t.micro_batch_size * accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        # ZeRO-0 runs the plain torch optimizer, for which DeepSpeed clips without keeping the
        # norm: the engine clips itself there (DeepSpeedEngine.backward).
        "gradient_clipping": t.grad_clip if r.zero_stage >= 1 else 0.0,
        "bf16": {"enabled": t.precision == "bf16" and r.zero_stage >= 1},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if t.precision == "bf16" and r.zero_stage >= 1:
        # Accumulate and reduce gradients in fp32 (DeepSpeed's default is the model dtype, bf16:
        # each of the accumulation steps would round the running sum to 8 mantissa bits).
        # DeepSpeed supports this mix under ZeRO only.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    elif t.precision == "bf16":
        # ZeRO-0: DeepSpeed's bf16 mode would accumulate gradients in bf16 (it allows fp32
        # accumulation only under ZeRO) and its wrapper optimizer takes one zero-gradient step at
        # set-up (an extra weight decay, a shifted bias correction). torch autocast instead keeps
        # fp32 parameters, gradients and optimizer state and computes the matmuls in bf16, as the
        # torch engine does.
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if r.offload_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {
            "lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay}}
    return config


class DeepSpeedEngine(Engine):
    """Wraps ``deepspeed.initialize``. DeepSpeed averages gradients over data-parallel ranks and
    (by default) divides by the accumulation steps; backward passes ``scale_wrt_gas=False`` and
    scales by the world size so the accumulated gradient is that of the global-batch sum. With
    ``recipe.cp`` > 1, ZeRO still partitions over every rank (its average then spans the cp
    peers, whose losses cover parts of the same rows, as DeepSpeed's ALST does)."""

    def __init__(self, cfg: Any, env, accumulation_steps: int, dims=None, *, objective):
        super().__init__(cfg, env, accumulation_steps, dims, objective=objective)
        self.ds_config = deepspeed_config(cfg, env.world_size, accumulation_steps)
        self._hf_ds_config = None
        from llmtrain.models.adapters import is_partial

        self._partial = is_partial(cfg)
        from llmtrain.monitoring.console import stdout_to_debug_log

        # DeepSpeed prints "<op> built successfully" on every CPU launch: keep it out of the log.
        with stdout_to_debug_log("deepspeed"):
            deepspeed = import_deepspeed()
            # Adopt the existing torch process group; zero.Init reads the world size from it.
            deepspeed.init_distributed(dist_backend=env.backend)

    @property
    def dp_rank(self) -> int:
        return self.env.rank // self.dims.cp  # a row's cp peers read the same samples

    def model_init_context(self):
        import contextlib

        if self.cfg.recipe.zero_stage == 3:
            # transformers builds models inside deepspeed.zero.Init while this object is alive.
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(self.ds_config)
        return contextlib.nullcontext()

    def setup(self, model: torch.nn.Module) -> None:
        import deepspeed

        t = self.cfg.trainer
        if t.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # With an optimizer section (offload) DeepSpeed builds its own AdamW over the groups.
        optimizer = (build_optimizer(model, t, model_cfg=self.cfg.model)
                     if "optimizer" not in self.ds_config else None)
        if self.dims.cp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            # ZeRO partitions over every rank; the cp peers of a row are neighbouring ranks.
            mesh = init_device_mesh(self.env.device.type, (self.env.world_size // self.dims.cp, self.dims.cp),
                                    mesh_dim_names=("dp", "cp"))
            self._install_context_parallel(model, mesh["cp"].get_group())
        self._install_label_head(model)
        self._install_router_monitors([model], model)
        if self.routers and self.cfg.recipe.zero_stage == 3:
            self._mark_sparse_blocks_leaf(model)
        schedule = lr_lambda(t)
        fp32_initial = self._fp32_initial_values(model)
        groups = (param_groups(model, t.weight_decay, group_scales(model, self.cfg.model), t.lr)
                  if optimizer is None else None)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=groups,
            config=self.ds_config, dist_init_required=self.env.world_size > 1,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
        if self.cfg.recipe.compile:
            # Per decoder layer and after initialize (ZeRO-3's gather hooks are installed by then),
            # as accelerate's regional compilation does under DeepSpeed; the torch engines compile
            # the same layers.
            from llmtrain.parallel.parallelize import apply_compile, decoder_layers

            apply_compile(decoder_layers(self.ds.module))
        # Models built later (the export's fresh copy) must not be partitioned.
        self._hf_ds_config = None
        if self._partial:
            self._exclude_frozen_aliases()
        if fp32_initial is not None:
            from deepspeed.utils import safe_set_full_fp32_param

            for name, param in self.ds.module.named_parameters():
                if param.requires_grad:  # frozen parameters have no master copy
                    safe_set_full_fp32_param(param, fp32_initial(name, param).to(self.env.device))
        self._report_duplicate_master_copy()

    @staticmethod
    def _mark_sparse_blocks_leaf(model: torch.nn.Module) -> None:
        """ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``, as DeepSpeed documents
        for Mixtral and Qwen MoE): a sparse block's parameters are gathered together once per
        forward, not by per-module hooks that a token-dependent expert loop may call on some
        ranks only (which would hang the all-gathers)."""
        from deepspeed.utils import set_z3_leaf_modules

        from llmtrain.models.moe import sparse_blocks

        set_z3_leaf_modules(model, sorted({type(block) for _, block in sparse_blocks(model)}, key=lambda c: c.__name__))

    def frozen_copy(self, build, from_config=None):
        """ZeRO-3: the copy is built partitioned and wrapped by a DeepSpeed engine without an
        optimizer (TRL's ``prepare_deepspeed`` for its reference model); ZeRO 0-2 hold whole
        weights on every rank, and so does the copy: under bf16 ZeRO-1/2 in bf16 parameters (fp32
        buffers), as DeepSpeed casts the policy's working copy, so at step 1 the two compute the
        same logits; ZeRO-0's bf16 is autocast over fp32 weights, and so is the copy's."""
        import deepspeed

        if self.cfg.recipe.zero_stage != 3:
            return replicated_frozen_copy(build, self.env.device, self.cfg.trainer.precision,
                                          bf16_weights=self.ds_config["bf16"]["enabled"])
        config = {key: self.ds_config[key] for key in ("train_micro_batch_size_per_gpu", "bf16", "zero_optimization",
                                                       "steps_per_print", "wall_clock_breakdown")}
        config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                       if not k.startswith("offload_optimizer")}
        config["train_batch_size"] = self.ds_config["train_micro_batch_size_per_gpu"] * self.env.world_size
        config["gradient_accumulation_steps"] = 1
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(config)  # noqa: F841 - transformers builds inside zero.Init while it lives
        copy = build().requires_grad_(False)
        del keep
        wrapped, *_ = deepspeed.initialize(model=copy, config=config, dist_init_required=self.env.world_size > 1)
        wrapped.eval()

        def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.no_grad():
                return wrapped(**model_inputs(batch)).logits
        return forward

    def _report_duplicate_master_copy(self) -> None:
        """Say so in the debug log (``hydra.verbose=llmtrain``) when DeepSpeed ZeRO-3 keeps a
        second fp32 copy of the parameter partitions in an fp32 run. Its code means to share them
        (``stage3.py``, ``_create_fp32_partitions``), but compares a ``torch.device`` with the
        device-name string, which is never equal, so every rank holds 4Ψ/N bytes more than ZeRO
        theory (scripts/repro/deepspeed_zero3_fp32_copy.py)."""
        opt = getattr(self.ds, "optimizer", None)
        working = getattr(opt, "fp16_partitioned_groups_flat", None)
        master = getattr(opt, "fp32_partitioned_groups_flat", None)
        if not working or not master or self.cfg.trainer.precision != "fp32" or not self.env.is_main:
            return
        duplicated = sum(m.numel() * m.element_size() for w, m in zip(working, master)
                         if m.numel() and w.dtype == m.dtype and m.data_ptr() != w.data_ptr())
        if duplicated:
            import logging

            # Debug level: every fp32 ZeRO-3 run has it, and there is nothing to do about it.
            logging.getLogger("llmtrain").debug(
                "DeepSpeed ZeRO-3 keeps a second fp32 copy of this rank's parameter partition in an fp32 run "
                "(%.1f MiB per rank beyond ZeRO theory; a DeepSpeed device-comparison bug, see "
                "scripts/repro/deepspeed_zero3_fp32_copy.py)", duplicated / 2**20)

    def _exclude_frozen_aliases(self) -> None:
        """DeepSpeed's ``exclude_frozen_parameters`` walks ``named_parameters()``, which names a tied
        weight once: the frozen embedding is dropped but its alias ``lm_head.weight`` (a whole
        vocabulary matrix) stays in every checkpoint. Drop every alias of a frozen parameter."""
        ds = self.ds
        module_state_dict = ds.module_state_dict
        frozen = {name for name, p in ds.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

        def without_frozen(*args, exclude_frozen_parameters=False, **kwargs):
            state = module_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
            if exclude_frozen_parameters and state is not None:
                for name in frozen & set(state):
                    del state[name]
            return state

        ds.module_state_dict = without_frozen

    def _fp32_initial_values(self, model: torch.nn.Module):
        """Under bf16 ZeRO, DeepSpeed casts the model to bf16 and copies the fp32 master weights
        from the *rounded* values (up to 2^-9 relative off the initial weights). Returns
        ``(name, param) -> fp32 initial tensor`` to put the true initial weights into the master
        copy, or None when there is nothing to fix (fp32, ZeRO-0) or no fp32 copy exists (a
        pretrained model built partitioned under ZeRO-3 arrives in bf16)."""
        t, stage = self.cfg.trainer, self.cfg.recipe.zero_stage
        if t.precision != "bf16" or stage == 0:
            return None
        if stage == 3:
            if self.cfg.model.source != "config":
                return None
            from llmtrain.models.build import initial_value

            std = float(getattr(model.config, "initializer_range", 0.02))
            return lambda name, param: initial_value(name, param.ds_shape, t.seed, std)
        fp32 = {name: p.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}
        return lambda name, param: fp32[name]

    @property
    def model(self) -> torch.nn.Module:
        return self.ds.module

    @contextlib.contextmanager
    def generation_model(self):
        """ZeRO-3: every parameter gathered for the duration (``GatheredParameters``) and the
        engine's fetch/release hooks taken off, so the sampling loop's forwards make no collectives
        (TRL's ``unwrap_model_for_generation``); the hooks are put back after, with the parameter
        coordinator's trace invalidated (the generation forwards are not the training order).
        ZeRO 0-2 hold whole weights."""
        if self.cfg.recipe.zero_stage != 3:
            yield self.model
            return
        import deepspeed

        offload = getattr(self.ds.optimizer, "parameter_offload", self.ds.optimizer)
        with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
            for param in self.model.parameters():
                param.ds_active_sub_modules.clear()
            for hook in [*offload.forward_hooks, *offload.backward_hooks]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            # The start-of-forward hook checks the module order across ranks (a broadcast) until a
            # trace is recorded: ranks decoding different numbers of tokens would wait on each other.
            start = offload.fwd_pre_hook
            start_hook = offload.module._forward_pre_hooks.get(start.id)
            start.remove()
            try:
                yield self.model
            finally:
                coordinator = getattr(offload, "param_coordinator", None)
                if coordinator is not None and not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                if start_hook is not None:
                    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start_hook)
                offload._register_deepspeed_module(offload.module)

    def generation_autocast(self):
        # DeepSpeed's bf16 runs keep bf16 working weights: the gathered model computes in them.
        return contextlib.nullcontext()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.ds(**model_inputs(batch)).logits

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss * self.env.world_size, scale_wrt_gas=False)
        if self.cfg.recipe.zero_stage == 0 and self.ds.is_gradient_accumulation_boundary():
            # Gradients are all-reduced and whole on every rank: the global norm, clipped as the
            # torch engine clips.
            params = [p for p in self.ds.module.parameters() if p.grad is not None]
            self._zero0_norm = clip_gradients(params, self.cfg.trainer.grad_clip)
        if not self.ds.is_gradient_accumulation_boundary():
            # DeepSpeed counts micro-batches in its step(); before the boundary it only advances
            # that count. The update itself is applied in step() below.
            self.ds.step()

    def step(self, keep_update=None) -> float:
        # keep_update is refused for DeepSpeed at validation: DeepSpeed's norm is only known
        # inside the step that applies the update, too late to drop it.
        self.ds.step()
        norm = self._zero0_norm if self.cfg.recipe.zero_stage == 0 else self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save_checkpoint(self, directory: Path, background: bool = False):
        # background: refused at validation (trainer.async_checkpoint needs engine=torch).
        # save_latest=True writes DeepSpeed's tag file "latest" (contents: "engine") into the
        # checkpoint folder itself, next to the zero_to_fp32.py it copies there, so that script
        # runs as its usage line says (`python zero_to_fp32.py . OUT`); the completion marker lists
        # it like any other file and still alone says which checkpoints are complete.
        # Frozen parameters (LoRA's base, model.freeze) come from the model's source on resume.
        with _hashed_saves(self.ds.checkpoint_engine):
            self.ds.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=True,
                                    exclude_frozen_parameters=self._partial)

    def prepare_resume(self, directory: Path, saved_world_size: int) -> None:
        """On a world-size change, convert the ZeRO checkpoint to DeepSpeed's universal format
        (once, on rank 0, into ``checkpoints/.universal/step_<N>``) and load from there.
        ``ds_to_universal`` unpickles: the files are checked first (:func:`check_checkpoint_files`).

        Raises:
            ResumeError: a file holds pickled objects beyond DeepSpeed's checkpoint classes.
        """
        if saved_world_size == self.env.world_size:
            return
        from llmtrain.parallel import distributed

        check_checkpoint_files(directory, self.env)
        step_dir = directory.parent
        self._universal_dir = step_dir.parent / ".universal" / step_dir.name
        self.ds_config["checkpoint"] = {"load_universal": True}
        if self.env.is_main and not self._universal_dir.is_dir():
            _convert_to_universal(directory, self._universal_dir)
        distributed.barrier()

    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        universal = saved_world_size != self.env.world_size
        source = self._universal_dir if universal else directory
        check_checkpoint_files(source, self.env)
        if universal and self.env.is_main:
            import logging

            logging.getLogger("llmtrain").info(
                "loading %s with DeepSpeed's universal-checkpoint loader, which unpickles its files (torch.load "
                "weights_only=False); they passed a weights_only=True check against DeepSpeed's own checkpoint "
                "classes first. Load only checkpoints you trust", source)
        weight_decays = [group["weight_decay"] for group in self.ds.optimizer.param_groups]
        with _weights_only_loads(self.ds.checkpoint_engine) as mapped:
            path, _ = self.ds.load_checkpoint(str(source.parent), tag=source.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True, load_module_strict=not self._partial)
        if mapped:
            _own_optimizer_state(getattr(self.ds.optimizer, "optimizer", self.ds.optimizer))
        if universal:
            # DeepSpeed 0.19's ZeRO-3 universal load copies param group 0's hyperparameters into
            # every group, which would decay norms and biases; the recipe's values are the truth.
            for group, weight_decay in zip(self.ds.optimizer.param_groups, weight_decays):
                group["weight_decay"] = weight_decay
            # It also gives every parameter group the *same* step tensor, which torch's AdamW then
            # increments once per group per step (wrong bias correction): unshare it.
            for param_state in getattr(self.ds.optimizer, "optimizer", self.ds.optimizer).state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()
        if path is None:
            from llmtrain.common.errors import ResumeError

            raise ResumeError(f"DeepSpeed could not load {source}")
        apply_schedule(self.scheduler.optimizer, self.scheduler)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The fp32 master weights (not the bf16 working copy), consolidated on rank 0."""
        from deepspeed.utils import safe_get_full_fp32_param

        if self.cfg.recipe.zero_stage == 3:
            state = self.ds._zero3_consolidated_16bit_state_dict()
        else:
            state = self.ds.module.state_dict()
        masters, by_param = {}, {}
        # Every alias of a tied weight (lm_head.weight and the embedding) gets the master value.
        # In fp32 the working weights are the master values: nothing to gather twice.
        bf16 = self.cfg.trainer.precision == "bf16"
        aliases = self.ds.module.named_parameters(remove_duplicate=False) if bf16 else []
        for name, param in aliases:
            if id(param) not in by_param:
                master = safe_get_full_fp32_param(param)  # collective under ZeRO-3
                by_param[id(param)] = None if master is None else master.detach().float().cpu()
            if by_param[id(param)] is not None:
                masters[name] = by_param[id(param)]
        if not self.env.is_main:
            return None
        return {k: masters.get(k, v.detach().float().cpu()) for k, v in state.items()}

    def train(self, mode: bool = True) -> None:
        super().train(mode)
        offload = getattr(self.ds.optimizer, "parameter_offload", None)  # ZeRO-3 only
        if mode and offload is not None:
            # ZeRO-3 records the order in which modules fetch parameters and prefetches (and
            # keeps gathered) by it; one coordinator serves evaluation and training, and a
            # forward-only evaluation left its trace behind: every later step then re-gathered
            # in backward (3Ψ instead of 2Ψ and 1.9x the all-gathers per step, measured with
            # scripts/bench/comm.py). Release the parameters and record the trace afresh.
            self.ds.empty_partition_cache()
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()

    def close(self) -> None:
        # DeepSpeed's optimizers hold worker threads and hooks: left to interpreter exit, a rank
        # could abort ("terminate called without an active exception") after a finished run.
        self.ds.destroy()

    def optimizer_step_count(self) -> int:
        inner = self.ds.optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        return first_step_count(inner)


def _convert_to_universal(engine_dir: Path, out_dir: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` on ``engine_dir``, written to a temporary folder and
    renamed into place, so an interrupted conversion is redone rather than half-used."""
    import logging
    import shutil
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    logging.getLogger("llmtrain").info("converting %s to DeepSpeed's universal format in %s", engine_dir, out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    ds_to_universal(SimpleNamespace(input_folder=str(engine_dir), output_folder=str(tmp), num_extract_workers=1,
                                    num_merge_workers=1, keep_temp_folder=False, strict=True,
                                    inject_missing_state=True))
    tmp.rename(out_dir)


def checkpoint_safe_globals() -> list[Any]:
    """The classes DeepSpeed (0.19) pickles into its checkpoint files besides tensors and plain
    types: ZeRO's loss scaler (``LossScaler``, ``DynamicLossScaler``), ``ZeroStageEnum`` and the
    fragment addresses of parameter slices. Unpickling them only sets attributes (no code from the
    file runs), so they are allow-listed for ``torch.load(weights_only=True)``."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _hashed_saves(checkpoint_engine):
    """DeepSpeed's torch checkpoint engine writing each shard through
    :func:`llmtrain.checkpoint.format.dcp_writer.hashed_open`, so the completion marker's checksums come from
    the bytes as written instead of a second read of every shard. Other checkpoint engines
    (Nebula, decoupled writers) are left as they are: their files are hashed by reading."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from llmtrain.checkpoint.format.dcp_writer import hashed_open

    # The legacy (non-zip) format writes storages straight to the file descriptor, past the hash.
    if type(checkpoint_engine) is not TorchCheckpointEngine or not checkpoint_engine.zipfile_serialization:
        yield
        return

    def save(state_dict, path):
        with hashed_open(path, "wb") as f:
            torch.save(state_dict, f)

    checkpoint_engine.save = save
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's own method again


@contextlib.contextmanager
def _weights_only_loads(checkpoint_engine):
    """DeepSpeed's torch checkpoint engine reading each file with ``torch.load(weights_only=True,
    mmap=True)`` and :func:`checkpoint_safe_globals` instead of its ``weights_only=False``: what
    :func:`check_checkpoint_files` let through is then all DeepSpeed can build, and the tensor data
    is mapped from the file rather than read into fresh memory first (DeepSpeed copies it into
    its partitions anyway; 810 MB per rank at 135 M under ZeRO-3). A legacy-format file (no zip
    archive, so nothing to map) is read without ``mmap``. Other checkpoint engines are left alone.
    Covers ``load_checkpoint`` of the same world size; the universal loader opens its files itself.
    Yields the list of the files it mapped (filled as DeepSpeed loads them)."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    mapped: list[str] = []
    if type(checkpoint_engine) is not TorchCheckpointEngine:
        yield mapped
        return
    allowed = checkpoint_safe_globals()

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            with open(path, "rb") as f:
                mappable = torch.serialization._is_zipfile(f)
            if mappable:
                mapped.append(str(path))
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mappable)

    checkpoint_engine.load = load
    try:
        yield mapped
    finally:
        del checkpoint_engine.load  # the class's own method again


def _own_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give each CPU tensor of ``optimizer.state`` memory of its own. torch's
    ``Optimizer.load_state_dict`` keeps a loaded tensor as it is when its dtype and device already
    match the parameter's, so after a mapped load the Adam moments (ZeRO-1/2 and offload: on the
    CPU) would stay views of the checkpoint file: a pruned checkpoint's space would not come back
    until the process exits (``.nfs*`` files on NFS), and a file damaged under a running job
    would fault it. The copy costs what the first step's copy-on-write would have."""
    for param_state in optimizer.state.values():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                param_state[key] = value.clone()


def unsafe_checkpoint_file(directory: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Why DeepSpeed's loaders must not open ``directory``, or None: each torch file (``*.pt``,
    recursively; this rank's share, every ``world_size``-th by name) must load with
    ``torch.load(weights_only=True)`` and :func:`checkpoint_safe_globals`. The tensor data is
    memory-mapped, not read. DeepSpeed's ``zero_to_fp32``, ``ds_to_universal`` and universal
    loader unpickle with ``weights_only=False`` (its ``load_checkpoint`` of the same world size
    reads through :func:`_weights_only_loads`); a file that passes this check holds nothing they
    could run."""
    import pickle

    from llmtrain.common.safe_load import load_weights_only, unpickling_reason

    files = sorted(p for p in Path(directory).rglob("*.pt") if p.is_file())
    allowed = checkpoint_safe_globals()
    for path in files[rank::world_size]:
        try:
            load_weights_only(path, allowed, mmap=True)
        except pickle.UnpicklingError as err:
            return (f"{path} holds pickled objects beyond tensors, plain types and DeepSpeed's checkpoint classes "
                    f"({unpickling_reason(err)}); it was not loaded and none of it ran")
        except (RuntimeError, OSError, EOFError, ValueError) as err:
            return f"{path} is not a readable torch file ({str(err).splitlines()[0] if str(err) else err!r})"
    return None


def check_checkpoint_files(directory: Path, env=None) -> None:
    """Refuse a DeepSpeed checkpoint folder before DeepSpeed's loaders unpickle it
    (:func:`unsafe_checkpoint_file`), the files split over the ranks of ``env`` (a
    :class:`llmtrain.parallel.distributed.DistEnv`; None: this process checks them all). Collective when
    a process group is up: every rank raises the same error.

    Raises:
        ResumeError: naming the file and what it holds; load only checkpoints you trust.
    """
    import torch.distributed as dist

    from llmtrain.parallel import distributed
    from llmtrain.common.errors import ResumeError

    collective = env is not None and distributed.is_initialized()
    problem = unsafe_checkpoint_file(directory, env.rank if collective else 0, env.world_size if collective else 1)
    if collective:
        problems: list[Any] = [None] * env.world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise ResumeError(f"refusing DeepSpeed checkpoint {directory}: {problem}. DeepSpeed's export and universal "
                          "loaders unpickle their files (code in them would run); load only checkpoints you trust, e.g. one you wrote "
                          "yourself (trainer.resume=<step or path>)")
