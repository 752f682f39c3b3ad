"""The training run: sequences config validation, data, model, engine, loop, tracking, checkpoints.

The loss of an optimizer step is the mean token cross-entropy over the whole global batch:
each micro-batch contributes ``sum(CE) / N`` where ``N`` counts the target tokens of all
micro-batches on all ranks, so gradient accumulation and data parallelism give exactly the
gradient of one big batch, whatever the padding.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from llmtrain import adapters, checkpoint, console, data, distributed, flops, goodput
from llmtrain.config import ConfigError, gradient_accumulation_steps, validate
from llmtrain.errors import TrainingStopped
from llmtrain.engine import build_engine
from llmtrain.loss import count_target_tokens, target_tokens, token_cross_entropy_sum  # noqa: F401  (public here too)
from llmtrain.models import build_model, build_tokenizer, check_sequence_length, model_config
from llmtrain.parallel_dims import ParallelDims
from llmtrain.preemption import Preemption
from llmtrain.tracking import Tracker

log = logging.getLogger("llmtrain")


def forward_backward(engine, batches: list[dict[str, torch.Tensor]],
                     also_sum: Callable[[], tuple[float, ...]] | tuple[float, ...] = ()) -> tuple[float, int, list[float]]:
    """Accumulate the gradient of one optimizer step over this rank's micro-batches.

    Each micro-batch's summed cross-entropy is divided by the target-token count of the whole
    global batch (all micro-batches, all data-parallel ranks; one all-reduce before backward),
    so the accumulated gradient is that of the global batch's mean token loss, independent of
    how it is split. Tensor/pipeline-parallel peers hold the same samples, so world sums are
    divided by ``dims.data_replicas``.

    ``also_sum``: this rank's other per-step scalars (the sample digest, preemption flags, peak
    memory), or a function returning them, called after backward; summed over ranks in the same
    all-reduce as the loss, so a step makes two collectives of its own whatever the loop reports.

    Returns:
        (global mean token loss, tokens in the global batch including prompt tokens, the world
        sums of ``also_sum`` (not divided by the replicas)).
    """
    replicas = engine.dims.data_replicas
    device = batches[0]["input_ids"].device
    # Counted on the device (no host sync per micro-batch); the one sync is the normaliser's.
    counts = torch.stack([sum(target_tokens(b["labels"]) for b in batches),
                          sum(b["attention_mask"].sum() for b in batches)]).to(torch.float64)
    targets, tokens = (distributed.all_reduce_sum(counts) / replicas).tolist()
    loss_sum = engine.forward_backward(batches, targets)
    extra = also_sum() if callable(also_sum) else also_sum
    sums = distributed.all_reduce_sum(torch.cat([loss_sum.reshape(1).to(torch.float64),
                                                 torch.tensor(extra, dtype=torch.float64, device=device)]))
    loss, *others = sums.tolist()  # the step's one host sync after backward
    return loss / replicas / targets, int(tokens), others


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_streams(seed: int, dp_rank: int, pp_rank: int, start_step: int) -> int:
    """Seed this rank's random stream (dropout) for the training loop; returns the stream seed.

    Scheme: one stream per (data-parallel rank, pipeline rank), so data-parallel ranks draw
    different masks for their different samples and each pipeline stage its own (as Megatron-LM
    and torchtitan seed pipeline stages apart; unlike their default, data-parallel ranks differ
    too, because llmtrain's initialisation never draws from this stream: parameters come from
    (seed, parameter name), see :func:`llmtrain.models.init_weights`). Tensor-parallel ranks share
    this stream, so dropout on replicated activations agrees across the TP group; inside
    attention, whose activations are sharded over it, each TP rank draws its own
    (:func:`llmtrain.parallelize.apply_tp_rng`, the role of Megatron-LM's model-parallel RNG
    tracker).
    Exact resume restores each rank's saved state instead; a resume on another world size (whose
    saved states do not map onto the new ranks) reseeds with the resumed step mixed in, so no
    rank replays the masks of step 0. Rank (0, 0) of a fresh run keeps ``seed`` itself, so a
    single process draws exactly what it always did.
    """
    if (dp_rank, pp_rank, start_step) == (0, 0, 0):
        stream = seed
    else:
        stream = distributed.derived_seed(seed, f"dp{dp_rank}", f"pp{pp_rank}", f"step{start_step}")
    seed_everything(stream)
    return stream


def _memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: CUDA allocator peak, or the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


@torch.no_grad()
def evaluate(engine, batches: list[dict], device: torch.device) -> dict[str, float]:
    """Validation loss (mean token CE over all ranks' batches) and perplexity = exp(loss).

    Ranks with fewer batches run forwards on a batch without targets, so every rank makes the
    same number of forward passes (ZeRO-3 gathers parameters collectively in each one).
    """
    engine.train(False)
    replicas = engine.dims.data_replicas
    most = distributed.all_reduce_max(torch.tensor(len(batches), device=device))
    no_targets = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
                  "labels": torch.full((1, 2), data.IGNORE_INDEX, dtype=torch.long)}
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in list(batches) + [no_targets] * (int(most) - len(batches)):
        batch = {k: v.to(device) for k, v in batch.items()}
        totals[0] += engine.eval_loss_sum(batch)
        totals[1] += count_target_tokens(batch["labels"])
    distributed.all_reduce_sum(totals)
    totals /= replicas
    engine.train(True)
    loss = float(totals[0] / totals[1].clamp(min=1))
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 50.0))}


def _check_resumable(resume_from: Path, cfg: Any, checkpoints: checkpoint.CheckpointManager, is_main: bool,
                     fingerprint: str | None = None) -> None:
    """Resuming continues the *same* run: refuse a checkpoint whose model, data, recipe or
    optimisation settings differ from the current config (naming each difference), or whose
    trainable parameters (LoRA, ``model.freeze``) were trained on other base weights. A
    torch-engine run may change its parallel layout; that is said in the log."""
    saved = checkpoints.read_state(resume_from)
    if saved.base_fingerprint and fingerprint and saved.base_fingerprint != fingerprint:
        raise checkpoint.ResumeError(
            f"checkpoint {resume_from} holds adapters/trainable parameters trained on base weights "
            f"{saved.base_fingerprint}, but model {cfg.model.name} (source {cfg.model.source}, path {cfg.model.path}) "
            f"has weights {fingerprint}: resume with the base it was trained on, or start a new run_dir")
    if saved.global_batch_size != cfg.trainer.global_batch_size:
        raise checkpoint.ResumeError(
            f"checkpoint {resume_from} was trained with trainer.global_batch_size={saved.global_batch_size}; "
            f"resume it with the same value (got {cfg.trainer.global_batch_size}) so steps and samples line up")
    current = OmegaConf.to_container(cfg, resolve=True)
    differences = checkpoint.config_differences(resume_from, current)
    if differences:
        raise checkpoint.ResumeError(
            f"checkpoint {resume_from} belongs to a run with other settings ({'; '.join(differences)}). "
            "To continue it, use its settings; to start a new run, set a new run_dir (or name)")
    if not is_main:
        return
    ignored = checkpoint.keys_outside_schema(resume_from, current)
    if ignored:
        log.warning("checkpoint %s stores settings that are not config fields and were never used (%s); "
                    "ignoring them", resume_from, ", ".join(ignored))
    layout = checkpoint.layout_changes(resume_from, current)
    if layout:
        log.warning("resuming %s with another parallel layout (%s): the Distributed Checkpoint is resharded",
                    resume_from, "; ".join(layout))
    if saved.step >= cfg.trainer.max_steps:
        log.warning("checkpoint %s is at step %d >= trainer.max_steps=%d: nothing to train (raise "
                    "trainer.max_steps to continue); exporting only", resume_from, saved.step,
                    cfg.trainer.max_steps)


def _run_dir(cfg: Any) -> Path:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return Path(HydraConfig.get().runtime.output_dir)  # one folder per sweep job
    return Path(cfg.run_dir)


def _split_sums(step: tuple[float, int, list[float]], world_size: int) -> tuple[float, int, list[float], list[float]]:
    """:func:`forward_backward`'s result with the world-size memory vector at the end of its
    sums split off: (loss, tokens, the other sums, bytes per rank)."""
    loss, tokens, sums = step
    return loss, tokens, sums[:-world_size], sums[-world_size:]


def _sample_digest(batches: list[dict[str, torch.Tensor]]) -> float:
    """Order-free fingerprint of the samples in ``batches``: sum of CRC32s of their real tokens."""
    return float(sum(zlib.crc32(row[mask.bool()].numpy().tobytes())
                     for b in batches for row, mask in zip(b["input_ids"], b["attention_mask"])))


def train(cfg: Any) -> dict[str, Any]:
    """Run (or resume) training as configured; returns a summary (per-step losses, lrs, paths).

    Order: validate → resolve the resume checkpoint → data → model → engine → load checkpoint →
    run directory and tracker → loop (step, log, evaluate, save, preemption) → export.

    Raises:
        ConfigError, data.DataError, models.ModelSourceError, distributed.LaunchError,
            checkpoint.ResumeError: bad input, raised before anything is written.
    """
    process_started = time.time()
    # Read-only: the run uses exactly the composed config that `--cfg job --resolve` prints.
    OmegaConf.set_readonly(cfg, True)
    env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
    validate(cfg, env.world_size)
    if cfg.recipe.auto and env.world_size > 1:
        _check_same_layout(cfg, env.device)
    console.configure_library_output(env.is_main, console.interactive())
    t = cfg.trainer
    dims = ParallelDims.from_recipe(cfg.recipe, env.world_size)
    accumulation = gradient_accumulation_steps(t, dims.dp)
    seed_everything(t.seed)
    run_dir = _run_dir(cfg)
    tokenizer = build_tokenizer(cfg.model)
    # The model's limits against the tokenizer and the data, before the data is tokenized.
    hf_config = model_config(cfg.model)
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(f"model.architecture.vocab_size={hf_config.vocab_size} is smaller than the tokenizer's "
                          f"{len(tokenizer)} tokens; raise it to at least {len(tokenizer)}")
    too_long = check_sequence_length(hf_config, cfg.data.seq_len)
    if too_long and env.is_main:
        log.warning("%s", too_long)
    splits = data.load_splits(cfg.data, tokenizer, t.seed)
    checkpoints = checkpoint.CheckpointManager(run_dir, env, t.keep_checkpoints)
    resume_from = checkpoints.resolve(t.resume)
    partial = adapters.is_partial(cfg)  # LoRA or model.freeze: some parameters stay frozen
    fingerprint = adapters.base_fingerprint(cfg.model, t.seed) if partial else None
    if resume_from is not None:
        _check_resumable(resume_from, cfg, checkpoints, env.is_main, fingerprint)
    dims.check_model_config(hf_config, cfg.recipe.pp_stages_per_rank)
    engine = build_engine(cfg, env, accumulation, dims)
    with engine.model_init_context():
        model = build_model(cfg.model, t.seed)
        if partial:
            adapters.apply(model, cfg)  # LoRA layers in place; frozen parameters marked
    if resume_from is not None:
        checkpoints.prepare(engine, resume_from)
    engine.setup(model)
    engine.train(True)
    state, rng = checkpoint.TrainState(world_size=env.world_size, global_batch_size=t.global_batch_size,
                                       base_fingerprint=fingerprint), None
    if resume_from is not None:
        state, rng = checkpoints.load(engine, resume_from)
        state.parent = resume_from.name
        checkpoints.start_branch(resume_from)
        _dump_loaded_model(engine)
    start_step = state.step
    _check_optimizer_steps(engine, state)

    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if env.is_main:
        checkpoint.lock_run_dir(run_dir)
        (run_dir / "config.yaml").write_text(config_yaml)
    tracker = Tracker(cfg.tracker, run_dir, cfg.name, OmegaConf.to_container(cfg, resolve=True), env.is_main,
                      resume_step=state.step if resume_from else None, run_id=state.tracker_run_id,
                      config_yaml=config_yaml, mlflow_run_id=state.mlflow_run_id)
    goodput.account_restart(state, tracker.redone_records, process_started, resumed=resume_from is not None)
    if env.is_main:
        goodput.timeline_event(run_dir, "start", fresh=resume_from is None, step=state.step,
                               resumed_from=resume_from.name if resume_from else None, world_size=env.world_size,
                               recipe=cfg.recipe.name)
    num_parameters = engine.num_parameters()  # collective on some engines
    if env.is_main:
        log.info("model %s: %.2f M parameters; data %s: %d train / %d val samples; recipe %s "
                 "(engine %s, ZeRO %d) on %d rank(s) = dp %d (replicate %d x shard %d) x tp %d x pp %d%s; "
                 "global batch %d = micro %d x accumulation %d x dp %d",
                 cfg.model.name, num_parameters / 1e6, cfg.data.name, len(splits.train),
                 len(splits.val), cfg.recipe.name, cfg.recipe.engine, cfg.recipe.zero_stage, env.world_size,
                 dims.dp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp,
                 f" ({cfg.recipe.pp_schedule}, {cfg.recipe.pp_stages_per_rank} stage(s) per rank)" if dims.pp > 1 else "",
                 t.global_batch_size, t.micro_batch_size, accumulation, dims.dp)

        log.info("%s", data.describe(splits))
    if partial:
        _log_trainable(engine, cfg, dims, env.is_main)
    loader, sampler = data.train_loader(splits, tokenizer, cfg.data, t.seed, t.micro_batch_size, accumulation,
                                        engine.dp_rank, dims.dp, start_step=start_step, max_steps=t.max_steps)
    micro_batches = iter(loader)
    # Model FLOPs per token (PaLM appendix B) at data.seq_len; MFU where the device's peak is known.
    frozen, adapter = flops.partial_training_counts(engine.model) if partial else (0, 0)
    flops_per_token = flops.flops_per_token(hf_config, cfg.data.seq_len, frozen, adapter)
    peak = flops.peak_tflops(env.device, t.precision, t.peak_tflops)
    val_batches = data.val_batches(splits, tokenizer, t.micro_batch_size, t.eval_samples, engine.dp_rank, dims.dp)
    summary: dict[str, Any] = {"losses": [], "lrs": [], "run_dir": str(run_dir), "start_step": start_step}
    eval_s_at_start = state.eval_s
    if resume_from is None:
        eval_started = time.perf_counter()
        summary["initial_val"] = evaluate(engine, val_batches, env.device)
        state.eval_s += time.perf_counter() - eval_started
        tracker.log(summary["initial_val"], step=0)
        if env.is_main:
            log.info("eval at step 0: val loss %.4f (ppl %.2f)", summary["initial_val"]["val/loss"],
                     summary["initial_val"]["val/perplexity"])
    # After everything that draws random numbers at start-up: the dropout streams of the loop.
    if rng is not None:
        checkpoint.restore_rng(rng)
    else:
        seed_streams(t.seed, engine.dp_rank, getattr(engine, "pp_rank", 0), start_step)
    preemption = Preemption(t.preempt_signal, t.save_every_minutes)
    progress = console.Progress(t.progress_bar and env.is_main, t.max_steps, start_step, t.log_every)

    summary["checkpoint_stalls_s"] = []  # [step, seconds the loop waited for its save] per save

    def save(background: bool) -> None:
        started = time.perf_counter()
        state.saved_unix = time.time()
        state.tracker_run_id, state.mlflow_run_id = tracker.run_id, tracker.mlflow_run_id
        state.world_size, state.global_batch_size = env.world_size, t.global_batch_size
        tracker.flush()  # every step up to this checkpoint is on disk before the checkpoint counts
        written = checkpoints.save(engine, state, config_yaml, t.checkpoint_hash, background)
        if written is not None:
            summary["checkpoint"] = str(written)
            tracker.commit(state.step)
        state.parent = f"step_{state.step}"  # the next checkpoint continues this one
        preemption.saved()
        stall = time.perf_counter() - started
        summary["checkpoint_stalls_s"].append([state.step, stall])
        state.checkpoint_s += stall

    def seal_background() -> None:  # every rank's background write is done: make it count
        started = time.perf_counter()
        sealed = checkpoints.finish_background()
        summary["checkpoint"] = str(sealed)
        tracker.commit(checkpoint.step_of(sealed))
        sealing = time.perf_counter() - started
        summary["checkpoint_stalls_s"][-1][1] += sealing
        state.checkpoint_s += sealing

    skipped_in_a_row = 0
    state.startup_s += time.time() - process_started - (state.eval_s - eval_s_at_start)  # the step-0 eval is eval
    for step in range(start_step, t.max_steps):
        started = time.perf_counter()
        host_batches = [next(micro_batches) for _ in range(accumulation)]
        # Fingerprint on the host copies: on an accelerator this avoids a device-to-host sync.
        local_digest = _sample_digest(host_batches)
        batches = [{k: v.to(env.device) for k, v in b.items()} for b in host_batches]
        lr = engine.lr()
        def step_scalars() -> tuple[float, ...]:
            # Read after backward. Peak memory travels in this rank's slot of a world-size
            # vector: the sum gives every rank's figure, so the max and the rank holding it cost
            # no collective of their own.
            memory_slots = [0.0] * env.world_size
            memory_slots[env.rank] = float(_memory_bytes(env.device))
            return local_digest, *preemption.local_flags(), checkpoints.background_written(), *memory_slots

        loss, tokens, (digest, *preempt_flags, written), memory = _split_sums(
            forward_backward(engine, batches, step_scalars), env.world_size)
        digest /= dims.data_replicas
        stop, save_by_time = preemption.decide(preempt_flags)
        # Loss and gradient norm are global values every rank holds: checking them needs no collective.
        spike = _loss_spike(loss, state, t.spike_factor)
        grad_norm = engine.step(keep_update=(lambda norm: math.isfinite(norm) and math.isfinite(loss) and not spike)
                                if t.nonfinite == "skip" else None)
        healthy = math.isfinite(loss) and math.isfinite(grad_norm) and not spike
        if healthy:
            state.loss_ema = loss if not state.loss_ema_steps else 0.9 * state.loss_ema + 0.1 * loss
            state.loss_ema_steps += 1
        skipped_in_a_row = 0 if healthy else skipped_in_a_row + 1
        elapsed = time.perf_counter() - started
        done = step + 1
        state.step, state.consumed_samples = done, done * t.global_batch_size
        state.skipped_updates += int(not healthy and t.nonfinite == "skip")
        state.tokens_seen += tokens
        state.productive_s += elapsed
        summary["losses"].append(loss)
        summary["lrs"].append(lr)

        metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                   "train/tokens_per_s": tokens / elapsed, "train/step_time_s": elapsed,
                   "train/tokens_seen": state.tokens_seen, "train/samples_seen": state.consumed_samples,
                   "data/sample_digest": digest, "memory/peak_bytes": max(memory),
                   "memory/peak_rank": memory.index(max(memory)),
                   **flops.achieved(tokens / elapsed, flops_per_token, env.world_size, peak)}
        if summary["checkpoint_stalls_s"] and summary["checkpoint_stalls_s"][-1][0] == step:
            metrics["checkpoint/stall_s"] = summary["checkpoint_stalls_s"][-1][1]  # the previous step's save
        if len(splits.names) > 1:  # a mixture: every rank knows the global order, no collective needed
            counts = sampler.source_counts(step, len(splits.names))
            metrics.update({f"data/source/{name}_samples": n for name, n in zip(splits.names, counts)})
        progress.update(done, loss, lr, grad_norm, tokens / elapsed)
        metrics.update(goodput.time_metrics(state))
        if (t.eval_every and done % t.eval_every == 0) or done == t.max_steps:
            eval_started = time.perf_counter()
            metrics.update(evaluate(engine, val_batches, env.device))
            state.eval_s += time.perf_counter() - eval_started
            if env.is_main:
                log.info("eval at step %d: val loss %.4f (ppl %.2f), train loss %.4f", done,
                         metrics["val/loss"], metrics["val/perplexity"], loss)
        if done == t.max_steps:
            summary["final_val"] = {k: metrics[k] for k in ("val/loss", "val/perplexity")}
        if not healthy:
            metrics["train/skipped_update"] = int(t.nonfinite == "skip")
        if (t.log_every and done % t.log_every == 0) or "val/loss" in metrics or not healthy:
            tracker.log(metrics, step=done)
        if not healthy:
            _on_nonfinite(t, done, loss, grad_norm, spike, skipped_in_a_row,
                          summary.get("checkpoint") or (str(resume_from) if resume_from else None),
                          lambda: (checkpoints.finish_background(), progress.close(), preemption.restore(),
                                   tracker.finish(complete=False)))
        _check_optimizer_steps(engine, state)
        if written == env.world_size:
            seal_background()
        if stop or save_by_time or (t.save_every and done % t.save_every == 0) or done == t.max_steps:
            # The last save and a preemption's are synchronous: the process ends after them.
            save(background=t.async_checkpoint and not stop and done < t.max_steps)
        if stop:
            if env.is_main:
                log.warning("preempted (%s): saved step %d; rerun the same command to continue",
                            preemption.requested or "signal on another rank", done)
            summary["preempted_at"] = done
            break

    if sealed := checkpoints.finish_background():  # defensive: the last save is synchronous
        summary["checkpoint"] = str(sealed)
        tracker.commit(checkpoint.step_of(sealed))
    preemption.restore()
    progress.close()
    if t.export_hf and "preempted_at" not in summary:
        written = checkpoint.export_hf(engine, cfg, tokenizer, run_dir, data.end_token_ids(cfg.data, tokenizer))
        summary.update(written)
        if written:
            log.info("exported: %s", "; ".join(f"{path} ({kind})" for kind, path in written.items()))
    # Teardown in dependency order: the tracker (rank 0's files and threads), the engine's
    # threads and buffers, and then (by the caller, after every rank is here) the process group.
    if env.is_main:
        goodput.timeline_event(run_dir, "end", step=state.step,
                               reason="preempted" if "preempted_at" in summary else "finished")
        if cfg.tracker.report and (png := _write_report(run_dir)):
            summary["report"] = png
            tracker.log_files([run_dir / "report.png", run_dir / "report.md"])  # MLflow, wandb: as run files
    tracker.finish()
    engine.close()
    distributed.barrier()
    return summary


def _log_trainable(engine, cfg: Any, dims: ParallelDims, is_main: bool) -> None:
    """Start-up line of partial training: trainable parameters and their share (as peft's
    ``print_trainable_parameters`` puts it) and this rank's model-state bytes."""
    trainable, total = adapters.summary(engine.model)
    shards = dims.dp if cfg.recipe.zero_stage in (1, 2) else 1
    frozen_bytes, trainable_bytes = adapters.model_state_bytes(engine.model, shards)
    if is_main:
        log.info("trainable params: %s || all params: %s || trainable%%: %.4f; model state on rank 0: frozen "
                 "%.1f MiB (parameters only) + trainable %.2f MiB (parameters, gradients, Adam moments)",
                 f"{trainable:,}", f"{total:,}", 100 * trainable / max(1, total), frozen_bytes / 2**20,
                 trainable_bytes / 2**20)


def _check_optimizer_steps(engine, state: checkpoint.TrainState) -> None:
    """The optimizer has applied exactly one update per trainer step (less the skipped ones):
    an extra update at set-up (DeepSpeed's bf16 ZeRO-0 wrapper once took one) would add a weight
    decay and shift Adam's bias correction unseen.

    Raises:
        RuntimeError: the counts differ (a bug in an engine, not bad input).
    """
    expected, taken = state.step - state.skipped_updates, engine.optimizer_step_count()
    if taken != expected:
        raise RuntimeError(f"the optimizer has applied {taken} updates at trainer step {state.step} "
                           f"({state.skipped_updates} skipped): expected {expected}")


SPIKE_AFTER_STEPS = 10  # healthy steps in the running mean before trainer.spike_factor applies


def _loss_spike(loss: float, state: checkpoint.TrainState, factor: float) -> str | None:
    """Why ``loss`` counts as a spike (``trainer.spike_factor`` x the running mean of healthy
    losses, once ``SPIKE_AFTER_STEPS`` fed it), else None."""
    if factor and state.loss_ema_steps >= SPIKE_AFTER_STEPS and loss > factor * state.loss_ema:
        return f"is above trainer.spike_factor={factor} x the running mean loss {state.loss_ema:.4f}"
    return None


def _check_same_layout(cfg: Any, device: torch.device) -> None:
    """``+recipe=auto`` decides on every rank from its own device memory: ranks whose memory
    differs could choose different layouts, which would hang the first collective.

    Raises:
        ConfigError: the ranks chose differently.
    """
    choice = f"{cfg.recipe.name}|{cfg.trainer.micro_batch_size}|{cfg.trainer.activation_checkpointing}"
    mine = torch.tensor(float(zlib.crc32(choice.encode())), dtype=torch.float64, device=device)
    if distributed.all_reduce_max(mine.clone()).item() != -distributed.all_reduce_max(-mine).item():
        raise ConfigError(f"+recipe=auto chose different layouts on different ranks (this one: {choice}): their "
                          "device memory differs; set recipe.device_memory to the smallest device's")


def _write_report(run_dir: Path) -> str | None:
    """``report.png`` / ``report.md`` (llmtrain.report) of the run so far; a failure to plot is a
    warning, never a failed run."""
    from llmtrain import report

    try:
        png, _ = report.write_report(run_dir)
    except Exception as err:  # noqa: BLE001  (matplotlib missing or a plotting error)
        log.warning("could not write the run report (%s); `python -m llmtrain.report %s` retries", err, run_dir)
        return None
    log.info("run report: %s and %s", png, png.with_suffix(".md"))
    return str(png)


def _on_nonfinite(t: Any, step: int, loss: float, grad_norm: float, spike: str | None, skipped_in_a_row: int,
                  last_healthy: str | None, close: Any) -> None:
    """Apply ``trainer.nonfinite`` to a step whose loss or gradient norm is not finite, or whose
    loss is a spike (``spike``: why, see :func:`_loss_spike`): with
    ``skip`` (the update was already dropped) log it until ``max_skipped_steps`` in a row;
    otherwise close the run's outputs and raise before anything is saved or exported.

    Raises:
        TrainingStopped: naming the step, the values and the last healthy checkpoint.
    """
    values = (f"loss spike: train loss {loss} {spike}, grad norm {grad_norm}" if spike else
              f"non-finite train loss {loss}, grad norm {grad_norm}")
    if t.nonfinite == "skip" and skipped_in_a_row < t.max_skipped_steps:
        log.warning("step %d: %s: update skipped (%d in a row; trainer.max_skipped_steps=%d)",
                    step, values, skipped_in_a_row, t.max_skipped_steps)
        return
    close()
    why = (f"{skipped_in_a_row} updates in a row were skipped (trainer.max_skipped_steps={t.max_skipped_steps})"
           if t.nonfinite == "skip" else "trainer.nonfinite=stop")
    restart = (f"the last healthy checkpoint is {last_healthy}: resume from it (trainer.resume=auto) with a lower "
               "trainer.lr or stronger clipping" if last_healthy else
               "no checkpoint was written before it: lower trainer.lr or raise trainer.warmup_steps")
    raise TrainingStopped(f"step {step}: {values} ({why}); nothing was saved or exported from this state; "
                          f"{restart}")


def _dump_loaded_model(engine) -> None:
    """Debugging aid: LLMTRAIN_DUMP_AFTER_LOAD=FILE writes the just-loaded model's consolidated
    state dict (``torch.save``), to compare a resume against its checkpoint. Collective call."""
    path = os.environ.get("LLMTRAIN_DUMP_AFTER_LOAD")
    if path:
        state = engine.full_state_dict()
        if state is not None:
            torch.save(state, path)
