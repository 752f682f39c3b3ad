"""Loading a checkpoint runs none of its code: RNG files are read with ``torch.load(weights_only=True)``,
DeepSpeed files are checked the same way (DeepSpeed's own classes allow-listed) before DeepSpeed's
loaders unpickle them; RNG files of the older format (numpy's state as a pickled array) still resume."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FAST, assert_ok, read_metrics, run_cli
from llmtrain.checkpoint.protocol import CheckpointManager, _checksum, verify
from llmtrain.checkpoint.state import RNG_FORMAT, TrainState, capture_rng, read_rng, restore_rng
from llmtrain.parallel.distributed import DistEnv
from llmtrain.common.errors import ResumeError

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


class Payload:
    """Runs code when unpickled (``weights_only=False``): writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def crafted_rng_file(path: Path, marker: Path) -> None:
    """An RNG file that looks like llmtrain's older format and carries a pickle payload."""
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "extra": Payload(marker)}, path)


def old_format_rng_file(path: Path) -> None:
    """Rewrite ``path`` (a current RNG file) with the same states as llmtrain wrote them before
    the format had a version: ``random.getstate()`` and ``np.random.get_state()`` as they come."""
    restore_rng(read_rng(path))
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)


def reseal(checkpoint_dir: Path) -> None:
    """Rewrite ``COMPLETE.json`` for the files as they are now: a crafted checkpoint verifies."""
    marker = checkpoint_dir / "COMPLETE.json"
    files = json.loads(marker.read_text())["files"]
    for rel in files:
        path = checkpoint_dir / rel
        files[rel] = {"bytes": path.stat().st_size, "xxh3_128": _checksum(path, "xxh3")}
    marker.write_text(json.dumps({"files": files}))
    assert verify(checkpoint_dir) is None


def draws() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.randn()),
            torch.rand(4).tolist())


def test_rng_files_hold_tensors_and_plain_types_only_and_restore_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # cached Gaussians in both states
    torch.save(capture_rng(), tmp_path / "rank_0.pt")
    want = draws()
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rank_0.pt") == []
    state = torch.load(tmp_path / "rank_0.pt", weights_only=True)  # torch's default allow-list suffices
    assert state["format"] == RNG_FORMAT
    restore_rng(state)
    assert draws() == want


def test_an_old_format_rng_file_loads_with_weights_only_and_restores_exactly(tmp_path):
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / "rank_0.pt")  # capture_rng before the format had a version
    want = draws()
    state = read_rng(tmp_path / "rank_0.pt")
    assert "format" not in state and isinstance(state["numpy"][1], np.ndarray)
    restore_rng(state)
    assert draws() == want


class StubEngine:
    def __init__(self):
        self.loaded = []

    def save_checkpoint(self, directory: Path, background: bool = False):
        directory.mkdir(parents=True)
        torch.save({"w": torch.arange(4)}, directory / "state.pt")

    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        self.loaded.append(directory)


def test_a_pickle_payload_in_an_rng_file_is_refused_and_never_runs(tmp_path):
    manager = CheckpointManager(tmp_path / "run", ENV, keep=3)
    path = manager.save(StubEngine(), TrainState(step=2, global_batch_size=1), "x: 1\n")
    # The payload is real: an unrestricted load runs it.
    crafted_rng_file(tmp_path / "probe.pt", tmp_path / "probe-ran")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert (tmp_path / "probe-ran").is_file()

    marker = tmp_path / "payload-ran"
    crafted_rng_file(path / "rank_0.pt", marker)
    reseal(path)
    engine = StubEngine()
    with pytest.raises(ResumeError) as err:
        manager.load(engine, path)
    assert f"refusing RNG file {path / 'rank_0.pt'}" in str(err.value)
    assert "GLOBAL exec" in str(err.value) and "load only checkpoints you trust" in str(err.value)
    assert not marker.exists()
    assert engine.loaded == []  # refused before the engine state was touched


def test_a_pickle_payload_in_a_deepspeed_file_is_refused_and_never_runs(tmp_path):
    from llmtrain.engine.deepspeed_engine import check_checkpoint_files, unsafe_checkpoint_file

    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    torch.save({"module": {"w": torch.ones(2)}, "ds_version": "0.19"}, engine_dir / "mp_rank_00_model_states.pt")
    assert unsafe_checkpoint_file(engine_dir) is None
    marker = tmp_path / "payload-ran"
    torch.save({"optimizer_state_dict": {"x": Payload(marker)}},
               engine_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ResumeError) as err:
        check_checkpoint_files(engine_dir)
    assert f"refusing DeepSpeed checkpoint {engine_dir}: {engine_dir / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'}" \
        in str(err.value)
    assert "GLOBAL exec" in str(err.value) and "load only checkpoints you trust" in str(err.value)
    assert not marker.exists()


def test_deepspeed_reads_its_files_through_the_weights_only_loader_on_resume(tmp_path):
    # What DeepSpeed's own checkpoint engine gets inside a same-size resume: the payload is
    # refused by torch's weights_only unpickler even if the earlier check were skipped; the
    # tensors come back equal (mapped from a zip file; read from a legacy-format one), and the
    # engine's own load is back afterwards.
    import pickle

    import llmtrain.parallel.distributed  # noqa: F401  (DS_ACCELERATOR before deepspeed)
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from llmtrain.engine.deepspeed_engine import _weights_only_loads

    state = {"optimizer_state_dict": {"exp_avg": torch.arange(6.0).view(2, 3).t(), "zero_stage": ZeroStageEnum.weights},
             "ds_version": "0.19"}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    marker = tmp_path / "payload-ran"
    torch.save({"optimizer_state_dict": {"x": Payload(marker)}}, tmp_path / "crafted.pt")
    engine = TorchCheckpointEngine()
    with _weights_only_loads(engine):
        for name in ("zip.pt", "legacy.pt"):
            got = engine.load(str(tmp_path / name), map_location=torch.device("cpu"))
            torch.testing.assert_close(got["optimizer_state_dict"]["exp_avg"], state["optimizer_state_dict"]["exp_avg"],
                                       rtol=0, atol=0)
            assert got["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.weights
        with pytest.raises(pickle.UnpicklingError, match="exec"):
            engine.load(str(tmp_path / "crafted.pt"), map_location="cpu")
    assert not marker.exists()
    assert "load" not in vars(engine)  # the class's own method again


def test_optimizer_state_loaded_from_a_mapped_file_gets_memory_of_its_own(tmp_path):
    # torch's Optimizer.load_state_dict keeps a CPU fp32 moment as the very tensor it was given,
    # so after a mapped DeepSpeed load it would stay a view of the checkpoint file (kept open,
    # its space not freed when pruned) unless the engine copies it out.
    from llmtrain.engine.deepspeed_engine import _own_optimizer_state

    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.randn(4, 3)
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optim.pt")
    mapped = torch.load(tmp_path / "optim.pt", mmap=True, weights_only=True)
    fresh = torch.optim.AdamW([param], lr=0.1)
    fresh.load_state_dict(mapped)
    moment = fresh.state[param]["exp_avg"]
    assert moment.data_ptr() == mapped["state"][0]["exp_avg"].data_ptr()  # the premise: still the mapped tensor
    _own_optimizer_state(fresh)
    for key, value in fresh.state[param].items():
        assert value.data_ptr() != mapped["state"][0][key].data_ptr(), key
        torch.testing.assert_close(value, optimizer.state[param][key], rtol=0, atol=0)


# One process, torch engine, dropout on (the RNG streams matter), a checkpoint every 2 steps.
RESUME = FAST + ["trainer.max_steps=4", "trainer.save_every=2", "trainer.global_batch_size=8",
                 "trainer.micro_batch_size=4", "model.architecture.attention_dropout=0.1", "trainer.export_hf=false"]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trust") / "ref"
    assert_ok(run_cli(RESUME + [f"run_dir={run_dir}"]))
    return run_dir


def test_resume_refuses_a_crafted_rank_file_naming_it_and_runs_nothing(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    step_dir = run_dir / "checkpoints" / "step_4"
    marker = tmp_path / "payload-ran"
    crafted_rng_file(step_dir / "rank_0.pt", marker)
    reseal(step_dir)
    proc = run_cli(RESUME + ["trainer.max_steps=6", f"run_dir={run_dir}"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"refusing RNG file {step_dir / 'rank_0.pt'}" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]  # nothing written


def test_an_old_format_checkpoint_resumes_exactly_with_a_warning(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    step_dir = run_dir / "checkpoints" / "step_2"
    old_format_rng_file(step_dir / "rank_0.pt")
    reseal(step_dir)
    assert "numpy._core.multiarray._reconstruct" in torch.serialization.get_unsafe_globals_in_checkpoint(
        step_dir / "rank_0.pt")
    proc = run_cli(RESUME + ["trainer.resume=2", f"run_dir={run_dir}"])
    assert_ok(proc)
    assert "stores RNG states in llmtrain's older format" in proc.stderr + proc.stdout
    want, got = _losses(reference), _losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == want[s] for s in (3, 4)), (got, want)  # bitwise: dropout streams restored
    # The resumed run saves in the current format.
    assert torch.load(run_dir / "checkpoints" / "step_4" / "rank_0.pt", weights_only=True)["format"] == \
        RNG_FORMAT
