"""Importing DeepSpeed for training, without what llmtrain never runs: DeepSpeed's autotuner's
mlflow, its CPU inference all-reduce op's build, its Muon kernels' compilation; and with its op
builds linked where the Python environment's path has a space.

Each costs every DeepSpeed rank at start-up (measured on the 2-core development machine, CPU
time): mlflow 1.4 s, the Muon module 1.0 s (``torch.compile`` decorators import Inductor), the
shared-memory op ~90 s of g++ on a machine's first launch. May import: torch, deepspeed,
llmtrain.common.
"""

from __future__ import annotations

import contextlib
import sys
import types


def import_deepspeed():
    """``import deepspeed`` for llmtrain's DeepSpeed engine (see the module's docstring); returns
    the module."""
    _link_torch_libs_without_spaces()
    with _without_mlflow():
        import deepspeed

    _skip_inference_all_reduce_op(deepspeed)
    _stub_deepspeed_muon()
    return deepspeed


@contextlib.contextmanager
def _without_mlflow():
    """Context: ``import mlflow`` fails, unless mlflow is imported already (a tracker's backend).

    DeepSpeed's autotuner, imported with ``deepspeed`` and never run by llmtrain, imports mlflow
    where it is installed (the ``tracking`` extra): 1.4 s of CPU time, 3 s of wall clock per rank
    on the 2-core development machine, at every DeepSpeed start-up. Importing deepspeed inside
    this context leaves it out; llmtrain's MLflow tracker imports mlflow itself afterwards."""
    import sys

    if "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # the import system's "known absent" entry
    try:
        yield
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def _link_torch_libs_without_spaces() -> None:
    """Let DeepSpeed JIT-build its CPU ops (CPU Adam for ZeRO offload) when the Python
    environment lives under a path with a space.

    ``torch.utils.cpp_extension`` quotes include paths but writes ``-L<torch/lib>`` unquoted into
    the ninja file, so the link fails (``ld: cannot find space/.../torch/lib``). The flag is read
    from the module's ``TORCH_LIB_PATH`` when an op is built: point it at a symlink in llmtrain's
    cache, whose path has no space. Created atomically, so ranks may race.
    """
    import hashlib
    import os

    import torch.utils.cpp_extension as cpp_extension

    from llmtrain.common.paths import CACHE_DIR

    real = cpp_extension.TORCH_LIB_PATH
    link = CACHE_DIR / "torch-lib" / hashlib.sha256(real.encode()).hexdigest()[:16]
    if " " not in real or " " in str(link):
        return  # nothing to fix, or no space-free place to fix it from
    if not link.is_symlink():
        link.parent.mkdir(parents=True, exist_ok=True)
        pending = link.with_name(f"{link.name}.{os.getpid()}")
        pending.symlink_to(real, target_is_directory=True)
        os.replace(pending, link)
    cpp_extension.TORCH_LIB_PATH = str(link)


def _skip_inference_all_reduce_op(deepspeed) -> None:
    """On DeepSpeed's CPU accelerator, do not JIT-build its shared-memory all-reduce op.

    ``deepspeed.init_distributed`` builds ``deepspeed_shm_comm`` (``build_shm_op`` in
    ``deepspeed/comm/torch.py``) whenever its op table calls it compatible: about 90 s of g++ on a
    machine's first DeepSpeed launch. The op serves only ``inference_all_reduce`` (AutoTP
    inference), which falls back to ``torch.distributed.all_reduce`` without it; training's
    collectives go through the torch process group either way. DeepSpeed keeps the op table as a
    module attribute so that edits to it persist (``deepspeed/ops/__init__.py``): mark the op
    unavailable there. Other accelerators have no such builder and are left alone.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# DeepSpeed's Muon modules (deepspeed/runtime/zero/muon/), which llmtrain never builds an
# optimizer from (its Muon is llmtrain.engine.optimizers').
_MUON_OPTIMIZER = "deepspeed.runtime.zero.muon.muon_optimizer"
_MUON_UPDATE = "deepspeed.runtime.zero.muon.original_muon"


def _stub_deepspeed_muon() -> None:
    """Stand-ins for DeepSpeed's Muon modules, unless they are imported already.

    ZeRO's optimizers import ``MuonWithAuxAdam`` to test ``isinstance(optimizer, ...)`` when they
    are built (stages 1-3, bf16) and ZeRO 1-2 again in every gradient reduction and partition
    flattening (``stage_1_and_2.py``); importing the real module applies ``torch.compile``
    decorators, which import Inductor: 1.0 s of CPU time and 2.5-3 s of wall clock per rank on a
    loaded 2-core machine, for a test that is always false in llmtrain (no DeepSpeed Muon
    optimizer exists in a process where the module was never imported). The stand-in class has no
    instances; the stand-in update raises, should a DeepSpeed path ever reach it."""
    if sys.modules.get(_MUON_OPTIMIZER) is not None or sys.modules.get(_MUON_UPDATE) is not None:
        return  # the real modules (and perhaps a real optimizer) are in this process
    optimizer = types.ModuleType(_MUON_OPTIMIZER, "llmtrain's stand-in: DeepSpeed's Muon is not used (engine/deepspeed_imports.py)")

    class MuonWithAuxAdam:  # noqa: D401  (nothing is an instance: llmtrain never builds one)
        """Stand-in for DeepSpeed's Muon optimizer, which llmtrain never builds."""

    MuonWithAuxAdam.__module__ = _MUON_OPTIMIZER
    optimizer.MuonWithAuxAdam = MuonWithAuxAdam
    update = types.ModuleType(_MUON_UPDATE, optimizer.__doc__)

    def muon_update(*args, **kwargs):
        raise RuntimeError("DeepSpeed's Muon update called under llmtrain, which never builds DeepSpeed's Muon "
                           "optimizer (llmtrain/engine/deepspeed_imports.py)")

    update.muon_update = muon_update
    sys.modules[_MUON_OPTIMIZER], sys.modules[_MUON_UPDATE] = optimizer, update
