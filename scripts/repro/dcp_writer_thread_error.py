"""Minimal reproductions (for upstream torch.distributed.checkpoint reports), one process, CPU,
a few seconds:

1. ``FileSystemWriter(thread_count=2)``: an error in the writer thread that is not the caller's
   is printed and dropped (``filesystem._write_files_from_queue`` ends the thread on it, and
   ``_write_data`` joins the thread and returns the results it has). ``dcp.save`` then completes
   and writes ``.metadata`` without that thread's items; the checkpoint cannot be loaded. A fix
   on torch's side: catch the thread's exception and re-raise it in ``_write_data``.
2. ``DefaultSavePlanner(enable_plan_caching=True)``: ``planner_helpers._compare_save_plans``
   compares names, offsets and sizes but not ``TensorProperties``, so a second save of the same
   names and shapes in another dtype reuses the first save's metadata, which states the old dtype.

llmtrain works around both in ``llmtrain/checkpoint/format/`` (``dcp_writer._CompleteWriter``,
``plan_cache.CachedSavePlanner``).

    python scripts/repro/dcp_writer_thread_error.py
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
root = Path(tempfile.mkdtemp())
state = {f"w{i}": torch.randn(64, 64) for i in range(8)}

# 1. A writer thread's error is dropped.
real_open = io.open


def failing_in_the_second_thread(path, mode="r", *args, **kwargs):
    if "w" in mode and str(path).endswith(".distcp"):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(28, "No space left on device (simulated)")
        time.sleep(0.5)  # the second thread takes the other file meanwhile
    return real_open(path, mode, *args, **kwargs)


io.open = failing_in_the_second_thread  # what pathlib.Path.open, and so DCP, calls
try:
    dcp.save(state, storage_writer=FileSystemWriter(str(root / "threads"), thread_count=2))
finally:
    io.open = real_open
stored = FileSystemReader(str(root / "threads")).read_metadata().storage_data
print(f"1. dcp.save returned normally although a writer thread failed (its traceback is above): .metadata "
      f"locates {len(stored)} of the {len(state)} tensors")
try:
    dcp.load({k: torch.zeros_like(v) for k, v in state.items()}, checkpoint_id=str(root / "threads"))
    print("   ... and the checkpoint loads")
except BaseException as err:  # CheckpointException is a BaseException
    print(f"   ... and loading it fails: {type(err).__name__}: {str(err).splitlines()[-1]}")

# 2. The plan cache keeps the first save's dtype.
for name, values in (("fp32", state), ("bf16", {k: v.bfloat16() for k, v in state.items()})):
    dcp.save(values, checkpoint_id=str(root / name), planner=DefaultSavePlanner(enable_plan_caching=True))
dtypes = {m.properties.dtype for m in FileSystemReader(str(root / "bf16")).read_metadata().state_dict_metadata.values()}
print(f"2. metadata of the bf16 save states {sorted(map(str, dtypes))} (expected torch.bfloat16)")
