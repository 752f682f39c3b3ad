"""Model and optimizer state through torch Distributed Checkpoint (DCP), for every torch engine.

State is keyed by the model's own parameter names (``model.layers.3.mlp.up_proj.weight``) and
the optimizer state is flattened per parameter (``state.<name>.exp_avg``,
``param_groups.<name>.lr``), so nothing depends on the layout that wrote it: DCP reshards on
load between one process, DDP, FSDP2 shards, tensor-parallel DTensors and pipeline stages
(each stage loads only the names it holds). Written files (``__<rank>_0.distcp``, ``.metadata``,
``scheduler.pt``) sit in the checkpoint's engine folder, covered by its completion marker.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

# Frozen parameters (LoRA's base, model.freeze) are not saved: they come from the model's source
# again on resume (llmtrain.adapters), so a LoRA checkpoint is adapter-sized.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Loading sets the trainable tensors only (dcp.load above has already required every one of
# them): strict=False lets the frozen ones, which come from the model's source, stay as they are.
LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
METADATA = ".metadata"


def is_dcp_checkpoint(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def _model_state(part: nn.Module) -> dict:
    """``part``'s state dict without frozen parameters. DCP's ``ignore_frozen_params`` misses the
    second name of a tied weight (``lm_head.weight`` tied to a frozen embedding), so every alias
    is filtered here."""
    frozen = {name for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(part, options=OPTIONS).items() if k not in frozen}


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    model: dict = {}
    optim: dict = {}
    for part, opt in zip(parts, optimizers):
        model.update(_model_state(part))
        optim.update(get_optimizer_state_dict(part, opt, options=OPTIONS))
    return {"model": model, "optimizer": optim}


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns when it runs without a process group; for one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], scheduler,
         is_main: bool) -> None:
    """Write model parts, their optimizers and the LR scheduler into ``directory``. Collective."""
    directory.mkdir(parents=True, exist_ok=True)
    with _single_process_is_intended():
        dcp.save(_state(parts, optimizers), checkpoint_id=str(directory))
    if is_main:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")


def load(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], schedulers) -> None:
    """Load what :func:`save` wrote, by any layout, into this layout. Collective.

    Raises:
        ResumeError: the checkpoint lacks tensors this model needs or their shapes differ.
    """
    from llmtrain.checkpoint import ResumeError

    state = _state(parts, optimizers)
    try:
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=str(directory))
    except Exception as err:  # DCP raises CheckpointException wrapping per-rank errors
        raise ResumeError(f"checkpoint {directory.parent} does not fit this model/optimizer: {err}") from err
    for part, opt in zip(parts, optimizers):
        own = _model_state(part).keys()
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in own}, options=LOAD_OPTIONS)
        set_optimizer_state_dict(part, opt, optim_state_dict=state["optimizer"], options=OPTIONS)
    saved = torch.load(directory / "scheduler.pt", weights_only=True)
    for scheduler in schedulers:
        scheduler.load_state_dict(saved)


def consolidated_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict from a DCP engine folder, in one process (export, tests)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/full.pt")
        return torch.load(f"{tmp}/full.pt", weights_only=True)["model"]
