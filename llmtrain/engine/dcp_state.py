"""Model and optimizer state through torch Distributed Checkpoint (DCP), for every torch engine.

State is keyed by the model's own parameter names (``model.layers.3.mlp.up_proj.weight``) and
the optimizer state is flattened per parameter (``state.<name>.exp_avg``), so nothing depends on
the layout that wrote it: DCP reshards on
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

from llmtrain.parallel import distributed

# Frozen parameters (LoRA's base, model.freeze) are not saved: they come from the model's source
# again on resume (llmtrain.models.adapters), so a LoRA checkpoint is adapter-sized.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Loading sets the trainable tensors only (dcp.load above has already required every one of
# them): strict=False lets the frozen ones, which come from the model's source, stay as they are.
LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
METADATA = ".metadata"
# The optimizer's hyperparameters, flattened per parameter (``param_groups.<name>.lr``, a dozen
# per parameter): they are not written. DCP would store each as its own item, one torch.save
# apiece (hundreds per checkpoint, most of a small model's save time), and they are the
# config's values, which a resume must keep (llmtrain.checkpoint.resume.config_differences); the LR
# comes from the scheduler's state. On load the live optimizer's own values fill them.
_HYPERPARAMETERS = "param_groups."


def is_dcp_checkpoint(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def _model_state(part: nn.Module) -> dict:
    """``part``'s state dict without frozen parameters. DCP's ``ignore_frozen_params`` misses the
    second name of a tied weight (``lm_head.weight`` tied to a frozen embedding), so every alias
    is filtered here."""
    frozen = {name for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(part, options=OPTIONS).items() if k not in frozen}


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, dict]:
    """(the state DCP saves and loads, the optimizer hyperparameters it leaves out)."""
    model: dict = {}
    optim: dict = {}
    for part, opt in zip(parts, optimizers):
        model.update(_model_state(part))
        optim.update(get_optimizer_state_dict(part, opt, options=OPTIONS))
    hyper = {k: optim.pop(k) for k in [k for k in optim if k.startswith(_HYPERPARAMETERS)]}
    return {"model": model, "optimizer": optim}, hyper


_checkpoint_group = None


def _background_group():
    """A gloo process group of its own for background saves: their collectives run in DCP's
    writer thread while the training loop makes its own on the default group, and two threads
    must never interleave calls on one group."""
    global _checkpoint_group
    import torch.distributed as dist

    if _checkpoint_group is None and distributed.is_initialized():
        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns when it runs without a process group; for one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], scheduler,
         is_main: bool, background: bool = False, storage_writer=None):
    """Write model parts, their optimizers and the LR scheduler into ``directory``. Collective.

    ``background``: copy the state to host memory now and write it in a thread (DCP
    ``async_save``); returns the future that completes when this rank's files are written
    (None for a synchronous save). The LR scheduler's small file is written at once.
    """
    directory.mkdir(parents=True, exist_ok=True)
    state, _ = _state(parts, optimizers)
    future = None
    with _single_process_is_intended():
        if background:
            future = dcp.async_save(state, checkpoint_id=str(directory), process_group=_background_group(),
                                    storage_writer=storage_writer or _fault_writer(directory))
        else:
            dcp.save(state, checkpoint_id=str(directory), storage_writer=storage_writer)
    if is_main:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    return future


def _fault_writer(directory: Path):
    """Test hook: with ``LLMTRAIN_FAULT=background_write:<step>`` a background save of step
    ``<step>`` kills its process from the writer thread once this rank's data file is written
    and before DCP's metadata is, while training has moved on."""
    import os

    step = directory.parent.name.removeprefix(".tmp-step_")
    if os.environ.get("LLMTRAIN_FAULT") != f"background_write:{step}":
        return None

    class KilledMidWrite(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
            return written

    return KilledMidWrite(str(directory))


def load(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], schedulers) -> None:
    """Load what :func:`save` wrote, by any layout, into this layout. Collective.

    Raises:
        ResumeError: the checkpoint lacks tensors this model needs or their shapes differ.
    """
    from llmtrain.common.errors import ResumeError

    state, hyper = _state(parts, optimizers)
    try:
        with _single_process_is_intended():
            dcp.load(state, checkpoint_id=str(directory))
    except Exception as err:  # DCP raises CheckpointException wrapping per-rank errors
        raise ResumeError(f"checkpoint {directory.parent} does not fit this model/optimizer: {err}") from err
    for part, opt in zip(parts, optimizers):
        own = _model_state(part).keys()
        set_model_state_dict(part, {k: v for k, v in state["model"].items() if k in own}, options=LOAD_OPTIONS)
        set_optimizer_state_dict(part, opt, optim_state_dict={**state["optimizer"], **hyper}, options=OPTIONS)
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
