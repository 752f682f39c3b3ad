"""The checkpoint protocol in-process: marker validation and pruning around damaged folders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmtrain.checkpoint.protocol import CheckpointManager, _share, verify
from llmtrain.checkpoint.resume import config_differences, keys_outside_schema
from llmtrain.checkpoint.state import TrainState
from llmtrain.parallel.distributed import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


class FileEngine:
    """Stands in for an engine: one tensor file per save."""

    def __init__(self):
        self.pending: list = []  # background writes not yet done: (future, directory)

    def save_checkpoint(self, directory: Path, background: bool = False):
        directory.mkdir(parents=True)
        if not background:
            torch.save(torch.arange(10), directory / "state.pt")
            return None
        from concurrent.futures import Future

        future = Future()
        self.pending.append((future, directory))
        return future

    def complete_writes(self) -> None:
        for future, directory in self.pending:
            torch.save(torch.arange(10), directory / "state.pt")
            future.set_result(None)
        self.pending.clear()


def save(manager, step: int, hash_kind: str = "xxh3") -> Path:
    return manager.save(FileEngine(), TrainState(step=step, consumed_samples=step, global_batch_size=1),
                        "x: 1\n", hash_kind)


def test_marker_lists_every_file_and_verifies(tmp_path):
    path = save(CheckpointManager(tmp_path, ENV, keep=3), 2)
    listed = set(json.loads((path / "COMPLETE.json").read_text())["files"])
    assert listed == {"engine/state.pt", "rank_0.pt", "trainer_state.json", "config.yaml"}
    assert verify(path) is None


def test_malformed_markers_are_reported_not_raised(tmp_path):
    path = save(CheckpointManager(tmp_path, ENV, keep=3), 2)
    (path / "COMPLETE.json").write_text('{"files": []}')
    assert "unreadable completion marker" in verify(path)
    (path / "COMPLETE.json").write_text('{"files": {}}')
    assert "lists no engine/ files" in verify(path)


def test_pruning_never_counts_a_damaged_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, ENV, keep=1)
    damaged = save(manager, 12)
    state = damaged / "engine" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    assert "checksum mismatch" in verify(damaged)
    fresh = CheckpointManager(tmp_path, ENV, keep=1)  # a new process: knows nothing
    good = save(fresh, 6)
    assert good.is_dir() and verify(good) is None
    assert damaged.is_dir()  # left for inspection, not counted as complete


def test_torch_engine_still_loads_and_exports_a_pre_dcp_checkpoint(tmp_path):
    """Checkpoints written before the move to Distributed Checkpoint (one ``state.pt``) resume."""
    from conftest import make_cfg
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.objectives import CausalLM
    from llmtrain.checkpoint.export import consolidated_state_dict
    from llmtrain.models.build import build_model

    cfg = make_cfg(["trainer.max_steps=10"])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    old = TorchEngine(cfg, env, accumulation_steps=1, objective=CausalLM())
    old.setup(build_model(cfg.model, seed=1))
    for p in old.model.parameters():
        p.grad = torch.ones_like(p)
    old.step()
    (tmp_path / "engine").mkdir()
    torch.save({"model": old.model.state_dict(), "optimizer": old.optimizer.state_dict(),
                "scheduler": old.scheduler.state_dict()}, tmp_path / "engine" / "state.pt")
    new = TorchEngine(cfg, env, accumulation_steps=1, objective=CausalLM())
    new.setup(build_model(cfg.model, seed=2))
    new.load_checkpoint(tmp_path / "engine", saved_world_size=1)
    for (name, a), b in zip(old.model.state_dict().items(), new.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert new.optimizer.state_dict()["state"][0]["step"] == 1 and new.lr() == old.lr()
    exported = consolidated_state_dict(tmp_path, "torch")
    assert all(torch.equal(exported[k], v) for k, v in old.model.state_dict().items())


def test_keys_stored_before_the_schema_was_closed_do_not_block_a_resume(tmp_path):
    # A run launched with +trainer.max_step=10 stored the key (ignored); refusing the resume
    # would say "use its settings", which the closed schema no longer accepts.
    from omegaconf import OmegaConf

    from conftest import make_cfg

    current = OmegaConf.to_container(make_cfg([]), resolve=True)
    saved = OmegaConf.to_container(make_cfg([]), resolve=True)
    saved["trainer"]["max_step"] = 10
    saved["traner"] = {"lr": 1}
    saved["model"]["architecture"]["rope_theta"] = 5.0  # free-form: still a real difference
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert keys_outside_schema(tmp_path, current) == ["trainer.max_step", "traner.lr"]
    assert config_differences(tmp_path, current) == ["model.architecture.rope_theta: 5.0 -> <absent>"]


def test_a_checkpoint_older_than_new_data_fields_still_resumes(tmp_path):
    # Written before data.columns/packing/... existed, with the old spelling format: alpaca.
    from omegaconf import OmegaConf

    from conftest import make_cfg

    current = OmegaConf.to_container(make_cfg(["data=alpaca", "data.path=a.json"]), resolve=True)
    saved = OmegaConf.to_container(make_cfg(["data=alpaca", "data.path=a.json"]), resolve=True)
    for key in ("columns", "packing", "document_masking", "truncation", "datasets", "weights", "subset", "split",
                "revision", "chat_layout", "num_proc"):
        del saved["data"][key]
    saved["data"]["format"] = "alpaca"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    assert config_differences(tmp_path, current) == []
    current["data"]["packing"] = True  # a new field away from its default changes the run
    assert config_differences(tmp_path, current) == ["data.packing: <absent> -> True"]


def test_each_rank_checksums_a_share_and_every_file_is_checked_once(tmp_path):
    path = save(CheckpointManager(tmp_path, ENV, keep=3), 2)
    files = sorted(path / rel for rel in json.loads((path / "COMPLETE.json").read_text())["files"])
    shares = [_share(files, rank, 3) for rank in range(3)]
    assert sorted(p for share in shares for p in share) == files  # each file exactly once
    largest = max(files, key=lambda p: p.stat().st_size)
    assert shares[0][0] == largest  # split by bytes: the largest goes first
    state = path / "engine" / "state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    state.write_bytes(bytes(raw))
    owner = next(r for r in range(3) if state in shares[r])
    problems = [verify(path, rank, 3) for rank in range(3)]
    assert problems[owner] == "checksum mismatch in engine/state.pt"
    # Sizes are checked by every rank; the checksum only by its owner: one read of each file in all.
    assert [p for r, p in enumerate(problems) if r != owner] == [None, None]


def test_sha256_markers_verify_and_catch_damage(tmp_path):
    path = save(CheckpointManager(tmp_path, ENV, keep=3), 2, hash_kind="sha256")
    files = json.loads((path / "COMPLETE.json").read_text())["files"]
    assert all(set(meta) == {"bytes", "sha256"} and len(meta["sha256"]) == 64 for meta in files.values())
    assert verify(path) is None
    (path / "config.yaml").write_text("x: 2\n")  # same size, other bytes
    assert verify(path) == "checksum mismatch in config.yaml"


def test_a_background_save_counts_only_once_its_write_finished(tmp_path):
    manager = CheckpointManager(tmp_path, ENV, keep=3)
    engine = FileEngine()
    state = TrainState(step=4, consumed_samples=4, global_batch_size=1)
    assert manager.save(engine, state, "x: 1\n", background=True) is None
    assert manager.background_written() == 0.0
    assert not (tmp_path / "checkpoints" / "step_4").exists()  # a kill now leaves no step_4
    assert manager.resolve("auto") is None
    engine.complete_writes()
    assert manager.background_written() == 1.0
    assert manager.finish_background() == tmp_path / "checkpoints" / "step_4"
    assert verify(tmp_path / "checkpoints" / "step_4") is None
    assert manager.background_written() == 0.0 and manager.finish_background() is None


def test_a_failed_background_write_is_raised_and_never_sealed(tmp_path):
    manager = CheckpointManager(tmp_path, ENV, keep=3)
    engine = FileEngine()
    manager.save(engine, TrainState(step=4, global_batch_size=1), "x: 1\n", background=True)
    engine.pending[0][0].set_exception(OSError(28, "No space left on device"))
    import pytest

    with pytest.raises(OSError, match="No space left"):
        manager.finish_background()
    assert not (tmp_path / "checkpoints" / "step_4").exists()
    assert (tmp_path / "checkpoints" / ".tmp-step_4").is_dir()


def test_a_killed_save_folder_is_removed_once_the_run_holds_the_lock(tmp_path, caplog):
    """A SIGKILL mid-save leaves ``.tmp-step_<N>`` for good (before: the rerun only warned that it
    ignored it); the rerun, holding the run's lock, removes llmtrain's own unfinished folders only."""
    import logging

    import llmtrain.checkpoint.protocol as protocol

    root = tmp_path / "checkpoints"
    save(CheckpointManager(tmp_path, ENV, keep=3), 10)
    (root / ".tmp-step_14" / "engine").mkdir(parents=True)
    (root / ".tmp-step_14" / "engine" / "shard.distcp").write_bytes(b"half")
    (root / ".tmp-step_notmine").mkdir()
    try:
        with caplog.at_level(logging.INFO, logger="llmtrain"):
            resumed = CheckpointManager(tmp_path, ENV, keep=3).resolve("auto")
    finally:
        held = [h for h in protocol._RUN_LOCKS if Path(h.name) == tmp_path / ".lock"]
        for handle in held:
            protocol._RUN_LOCKS.remove(handle)
            handle.close()
    assert resumed == root / "step_10"
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_notmine", "step_10"]
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert removed == [f"removed .tmp-step_14 in {root}: unfinished checkpoint of a save that was interrupted "
                       "(never complete, never resumed)"]


def test_a_killed_save_folder_stays_while_another_process_holds_the_lock(tmp_path):
    import fcntl

    import pytest

    from llmtrain.common.errors import ResumeError

    save(CheckpointManager(tmp_path, ENV, keep=3), 10)
    (tmp_path / "checkpoints" / ".tmp-step_14").mkdir()
    with open(tmp_path / ".lock", "a+") as other:  # another open file: flock conflicts as with another process
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ResumeError, match="in use by another llmtrain process"):
            CheckpointManager(tmp_path, ENV, keep=3).resolve("auto")
    assert (tmp_path / "checkpoints" / ".tmp-step_14").is_dir()


def test_the_crash_report_of_a_rerun_waits_for_announce(tmp_path, caplog):
    """``resume=auto: the previous process ... redone`` was logged as the checkpoints were opened,
    before start-up checks (a reward function's import error) could fail; now announce() says it,
    after the decision."""
    import logging

    import llmtrain.checkpoint.protocol as protocol
    from llmtrain.checkpoint.checkpointer import open_checkpoints

    from conftest import FAST, make_cfg

    (tmp_path / "timeline.jsonl").write_text(
        json.dumps({"event": "start", "time": 100.0, "step": 0, "host": "n1", "pid": 12708}) + "\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0, "time": 110.0}) + "\n")
    cfg = make_cfg(FAST + [f"run_dir={tmp_path}"])
    try:
        with caplog.at_level(logging.INFO, logger="llmtrain"):
            manager, resume_from, _ = open_checkpoints(tmp_path, cfg, ENV, None)
            opened = [r.getMessage() for r in caplog.records]
            manager.announce()
    finally:
        for handle in [h for h in protocol._RUN_LOCKS if Path(h.name) == tmp_path / ".lock"]:
            protocol._RUN_LOCKS.remove(handle)
            handle.close()
    assert resume_from is None and opened == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("resume=auto: no complete checkpoint in ")
    assert said[1].startswith("resume=auto: the previous process (started 1970-01-01 00:01:40 UTC on n1, pid 12708) "
                              "ended after step 1 without its final save"), said
    manager.announce()
    assert len(caplog.records) == 2  # once
