"""The checkpoint protocol in-process: marker validation and pruning around damaged folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmtrain import checkpoint
from llmtrain.distributed import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


class FileEngine:
    """Stands in for an engine: one tensor file per save."""

    def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        torch.save(torch.arange(10), directory / "state.pt")


def save(manager, step: int) -> Path:
    return manager.save(FileEngine(), checkpoint.TrainState(step=step, consumed_samples=step, global_batch_size=1), "x: 1\n")


def test_marker_lists_every_file_and_verifies(tmp_path):
    path = save(checkpoint.CheckpointManager(tmp_path, ENV, keep=3), 2)
    listed = set(json.loads((path / "COMPLETE.json").read_text())["files"])
    assert listed == {"engine/state.pt", "rank_0.pt", "trainer_state.json", "config.yaml"}
    assert checkpoint.verify(path) is None


def test_malformed_markers_are_reported_not_raised(tmp_path):
    path = save(checkpoint.CheckpointManager(tmp_path, ENV, keep=3), 2)
    (path / "COMPLETE.json").write_text('{"files": []}')
    assert "unreadable completion marker" in checkpoint.verify(path)
    (path / "COMPLETE.json").write_text('{"files": {}}')
    assert "lists no engine/ files" in checkpoint.verify(path)


def test_pruning_never_counts_a_damaged_checkpoint(tmp_path):
    manager = checkpoint.CheckpointManager(tmp_path, ENV, keep=1)
    damaged = save(manager, 12)
    state = damaged / "engine" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    assert "checksum mismatch" in checkpoint.verify(damaged)
    fresh = checkpoint.CheckpointManager(tmp_path, ENV, keep=1)  # a new process: knows nothing
    good = save(fresh, 6)
    assert good.is_dir() and checkpoint.verify(good) is None
    assert damaged.is_dir()  # left for inspection, not counted as complete
