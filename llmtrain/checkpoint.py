"""Checkpoints and export to a Hugging Face folder.

Layout: ``RUN_DIR/checkpoints/step_<N>/`` holds the engine-native (sharded where the engine
shards) state; ``RUN_DIR/hf/`` holds the exported model (safetensors) and tokenizer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from llmtrain import distributed
from llmtrain.engine import Engine
from llmtrain.models import model_config

log = logging.getLogger("llmtrain")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def save(engine: Engine, run_dir: Path, step: int, client_state: dict) -> Path:
    """Save engine state for ``step`` (collective: every rank calls it)."""
    directory = checkpoint_dir(run_dir, step)
    engine.save_checkpoint(directory, client_state)
    distributed.barrier()
    return directory


def export_hf(engine: Engine, model_cfg: Any, tokenizer: Any, out_dir: Path) -> Path | None:
    """Write a ``from_pretrained``-loadable folder (safetensors) from the engine's weights.

    ZeRO-3 partitions are gathered into one state dict on rank 0. The weights are copied into a
    fresh model built from the config, which also re-ties input and output embeddings (and works
    for GGUF-loaded models, whose ``save_pretrained`` refuses). Collective call; returns the folder
    on rank 0 and None elsewhere.
    """
    state = engine.full_state_dict()
    if not engine.env.is_main:
        return None
    from transformers import AutoModelForCausalLM

    config = model_config(model_cfg)
    for attribute in ("quantization_config",):  # GGUF metadata: the export is plain fp32
        if hasattr(config, attribute):
            delattr(config, attribute)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = fresh.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"export: state dict does not match {config.model_type}: missing "
                           f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    fresh.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir

