"""What a run says while it starts: each start-up phase as it begins and its wall time at the
end (:class:`StartupPhases`), what loading the model and setting up the engine will do, the
layout's long-context and expert-parallel details, and a partial run's trainable parameters."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from llmtrain.models import adapters
from llmtrain.parallel.dims import ParallelDims

log = logging.getLogger("llmtrain")


class StartupInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) during start-up, before the loop's own handler (which saves at the next
    step's end) is in place: the message names the phase and what the run folder holds (still a
    KeyboardInterrupt, so nothing that catches Exception swallows it).
    ``python -m llmtrain`` prints it as one line and exits with status 130 (128 + SIGINT, the
    shell's status of a Ctrl-C): nothing was trained or saved."""


class StartupPhases:
    """Start-up named as it goes: rank 0 logs each phase as it begins (``start-up: model (GGUF:
    dequantizing …) …``) and, at :meth:`done`, every phase's wall time in seconds, so minutes of
    loading, tokenizing or compiling are never silent."""

    def __init__(self, on: bool):
        self.on, self.seconds = on, {}
        self._current: str | None = None
        self._began = time.time()

    def begin(self, name: str, detail: str = "") -> None:
        self._end()
        self._current, self._began = name, time.time()
        if self.on:
            log.info("start-up: %s%s ...", name, f" ({detail})" if detail else "")

    @property
    def current(self) -> str | None:
        """The phase under way (None before the first and after :meth:`done`)."""
        return self._current

    def _end(self) -> None:
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + time.time() - self._began
            self._current = None

    def done(self, total_s: float) -> None:
        self._end()
        if self.on:
            log.info("start-up: ready in %.1f s (%s)", total_s,
                     ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items()))


def model_detail(model_cfg: Any) -> str:
    """What loading ``model`` does, for its start-up line."""
    if model_cfg.source == "gguf":
        from llmtrain.models import gguf_cache

        if gguf_cache.cache_root() is not None:  # converted by the tokenizer phase, if not by an earlier run
            return f"model.source=gguf: {model_cfg.gguf_file} as converted once into {gguf_cache.cache_root()}"
        return f"model.source=gguf: reading and dequantizing {model_cfg.gguf_file or 'the GGUF file'}"
    if model_cfg.source == "pretrained":
        return f"model.source=pretrained: loading {model_cfg.path}"
    return "model.source=config: initialised from the seed"


def engine_detail(cfg: Any) -> str:
    """What setting up the engine does, for its start-up line; for DeepSpeed, where its compiled
    ops are cached (one folder per Python/torch/DeepSpeed version, llmtrain.parallel.distributed) and
    whether this run compiles them. Only optimizer offload compiles one (DeepSpeed's CPU Adam);
    the other DeepSpeed recipes step a ``torch.optim.AdamW`` and build nothing."""
    if cfg.recipe.engine != "deepspeed":
        return f"{cfg.recipe.name} on the torch engine"
    if not cfg.recipe.offload_optimizer:
        return f"DeepSpeed ZeRO-{cfg.recipe.zero_stage}"
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")).expanduser()
    built = cache.is_dir() and any(cache.glob("*/*.so"))
    return (f"DeepSpeed ZeRO-{cfg.recipe.zero_stage} with optimizer offload; compiled ops cached in {cache}"
            + ("" if built else "; this first run with these versions compiles them (CPU Adam: 1-2 min, once)"))


def log_trainable(engine, cfg: Any, dims: ParallelDims, is_main: bool) -> None:
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


def long_context_detail(cfg: Any, dims: ParallelDims) -> str:
    """The start-up line's context-parallel, sequence-parallel, chunked-loss and expert-parallel settings."""
    parts = []
    if dims.cp > 1:
        parts.append(f" x cp {dims.cp} ({cfg.recipe.cp_style}; FSDP2 shards over dp_shard x cp = {dims.dp_shard * dims.cp}"
                     if cfg.recipe.engine == "torch" else f" x cp {dims.cp} ({cfg.recipe.cp_style}; ZeRO over every rank")
        parts[-1] += ")"
    if cfg.recipe.get("tp_sequence_parallel"):
        parts.append(" with sequence parallelism inside tp")
    if cfg.trainer.get("loss_chunk_tokens"):
        parts.append(f"; loss in chunks of {cfg.trainer.loss_chunk_tokens} tokens")
    elif not cfg.trainer.get("logits_at_labels_only", True):
        parts.append("; whole logits (trainer.logits_at_labels_only=false)")
    if dims.ep > 1:
        parts.append(f"; experts split over ep {dims.ep} ranks of dp_shard (all-to-all), each FSDP-sharded over the "
                     f"other {dims.dp_replicate * dims.dp_shard // dims.ep}")
    return "".join(parts)


def log_run(cfg: Any, dims: ParallelDims, world_size: int, num_parameters: int, splits: Any, objective: str,
            accumulation: int, precision_reason: str) -> None:
    """The run's start-up line: model, data, objective, recipe and layout, batch, precision."""
    t = cfg.trainer
    log.info("model %s: %.2f M parameters; data %s: %s train / %d val samples; objective %s; recipe %s "
             "(engine %s, ZeRO %d) on %d rank(s) = dp %d (replicate %d x shard %d) x tp %d x pp %d%s%s; "
             "global batch %d = micro %d x accumulation %d x dp %d; precision %s (%s)",
             cfg.model.name, num_parameters / 1e6, cfg.data.name, "streamed" if splits.streaming else len(splits.train), len(splits.val), objective,
             cfg.recipe.name, cfg.recipe.engine, cfg.recipe.zero_stage, world_size, dims.dp, dims.dp_replicate,
             dims.dp_shard, dims.tp, dims.pp,
             f" ({cfg.recipe.pp_schedule}, {cfg.recipe.pp_stages_per_rank} stage(s) per rank)" if dims.pp > 1 else "",
             long_context_detail(cfg, dims), t.global_batch_size, t.micro_batch_size, accumulation, dims.dp,
             t.precision, precision_reason)


def interrupted_line(phases: StartupPhases | None, close: Callable[[], str]) -> str:
    """The one line of a start-up that SIGINT stopped, saying where (``phases``' current phase),
    after ``close()`` has closed what start-up had opened (it returns what the run folder keeps,
    for the line's end). A second Ctrl-C does not cut ``close()`` short."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        where = f"during {phases.current}" if phases is not None and phases.current else "before the first step"
        left = close()
    finally:
        signal.signal(signal.SIGINT, previous)
    return f"SIGINT (Ctrl-C) in start-up, {where}: nothing was trained{left}"
