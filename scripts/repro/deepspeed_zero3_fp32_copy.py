"""Minimal reproduction (for an upstream DeepSpeed report): ZeRO-3 in fp32 keeps a second fp32
copy of every parameter partition although its code means to share it.

``deepspeed/runtime/zero/stage3.py`` (``_create_fp32_partitions``) reuses the working partition
as the master copy when ``fp16_partitioned_groups_flat[i].dtype == master dtype and
fp16_partitioned_groups_flat[i].device == self.device``. ``self.device`` is the *string*
``get_accelerator().current_device_name()`` (``"cpu"``, ``"cuda:0"``), and a ``torch.device``
never equals a string, so the branch is dead and every fp32 run holds 4Ψ/N extra bytes per
rank (the 1.26x of ZeRO theory that ``scripts/bench/comm.py`` measures for zero3). A fix on
DeepSpeed's side: compare ``torch.device(self.device)``.

    python scripts/repro/deepspeed_zero3_fp32_copy.py      # one process, CPU, ~1 minute
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed  # noqa: E402
import torch  # noqa: E402

print("torch.device('cpu') == 'cpu':", torch.device("cpu") == "cpu")
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={
    "train_batch_size": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True})
opt = engine.optimizer
working, master = opt.fp16_partitioned_groups_flat[0], opt.fp32_partitioned_groups_flat[0]
print(f"working partition: {working.dtype} on {working.device!r}; optimizer device: {opt.device!r}")
print("master copy shares the working partition:", master.data_ptr() == working.data_ptr(),
      f"(extra bytes: {0 if master.data_ptr() == working.data_ptr() else master.numel() * master.element_size()})")
