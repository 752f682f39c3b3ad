"""Checksums taken while a checkpoint is written (no second read of its files), the host copy
background saves reuse, and the engine's DCP round trip around them. The references are
independent: the file's bytes read back and hashed (the protocol's reader), torch's own
``torch.load``, and the tensors the engine held when it saved."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from llmtrain.checkpoint.protocol import CheckpointManager, _checksum, verify
from llmtrain.checkpoint.state import TrainState
from llmtrain.checkpoint.format import dcp_writer, plan_cache
from llmtrain.engine import dcp_state
from llmtrain.parallel.distributed import DistEnv

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _engine(seed: int):
    from conftest import make_cfg
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.models.build import build_model
    from llmtrain.objectives import CausalLM

    engine = TorchEngine(make_cfg(["trainer.max_steps=10"]), ENV, accumulation_steps=1, objective=CausalLM())
    engine.setup(build_model(engine.cfg.model, seed=seed))
    return engine


def _train_step(engine, scale: float) -> None:
    for p in engine.model.parameters():
        p.grad = torch.full_like(p, scale)
    engine.step()


def _snapshot(engine) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in engine.model.state_dict().items()}
    for i, state in engine.optimizer.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.clone() for k, v in state.items()})
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["xxh3", "sha256"])
def test_checksums_taken_while_writing_equal_the_files_read_back(kind, tmp_path):
    engine = _engine(1)
    _train_step(engine, 0.5)
    folder = tmp_path / "tmp-step"
    dcp_writer.hash_writes(folder, kind)
    engine.save_checkpoint(folder / "engine")
    written = dcp_writer.take_written(folder)
    # DCP's data file and its metadata (written as .metadata.tmp, then renamed) were hashed.
    assert {"engine/__0_0.distcp", "engine/.metadata"} <= set(written)
    for rel, (size, digest) in written.items():
        assert size == (folder / rel).stat().st_size
        assert digest == _checksum(folder / rel, kind), rel
    assert dcp_writer.take_written(folder) == {}  # taken once; the folder is forgotten


def test_hashed_writer_matches_hashlib_and_follows_renames(tmp_path):
    dcp_writer.hash_writes(tmp_path, "sha256")
    chunks = [b"abc" * 1000, torch.arange(7, dtype=torch.float32).numpy().tobytes(), b""]
    with dcp_writer.hashed_open(tmp_path / "f.tmp") as f:
        for chunk in chunks:
            f.write(memoryview(chunk))
    with dcp_writer.hashed_open(tmp_path / "gone") as f:
        f.write(b"x")
    fs = dcp_writer._HashingFileSystem()
    fs.rename(tmp_path / "f.tmp", tmp_path / "f.bin")  # as DCP renames .metadata.tmp
    fs.rm_file(tmp_path / "gone")
    written = dcp_writer.take_written(tmp_path)
    assert written == {"f.bin": (len(b"".join(chunks)), hashlib.sha256(b"".join(chunks)).hexdigest())}
    with dcp_writer.hashed_open(tmp_path / "h.bin") as f:
        assert not hasattr(f, "digest")  # the folder is no longer registered: a plain file


class _DCPEngine:
    """The torch engine's save and load, as the protocol calls them."""

    def __init__(self, engine, storage_writer=None):
        self.engine, self.storage_writer = engine, storage_writer

    def save_checkpoint(self, directory: Path, background: bool = False):
        e = self.engine
        writer = self.storage_writer(directory) if self.storage_writer else None
        return dcp_state.save(directory, [e.model], [e.optimizer], e.scheduler, True, background, writer)

    def load_checkpoint(self, directory: Path, saved_world_size: int) -> None:
        self.engine.load_checkpoint(directory, saved_world_size)


def test_torch_save_writes_no_zip_crc32_into_hashed_files_only_and_restores_the_switch(tmp_path):
    """torch.save's per-record CRC-32 is skipped inside files the marker checksums anyway, while
    any is open in this thread (two at once); torch.load still reads them; the thread's switch
    returns to what the user had, on or off."""
    import zipfile

    def crcs(path):
        return {info.CRC for info in zipfile.ZipFile(path).infolist() if info.file_size}

    values = torch.arange(1000.0)
    dcp_writer.hash_writes(tmp_path, "xxh3")
    try:
        first, second = dcp_writer.hashed_open(tmp_path / "a.pt"), dcp_writer.hashed_open(tmp_path / "b.pt")
        torch.save(values, first)
        first.close()
        assert not torch.serialization.get_crc32_options()  # b.pt is still being written
        torch.save(values, second)
        second.close()
        assert torch.serialization.get_crc32_options()
        torch.save(values, tmp_path / "plain.pt")
        torch.serialization.set_crc32_options(False)  # a user's own choice survives
        with dcp_writer.hashed_open(tmp_path / "c.pt"):
            pass
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)
        written = dcp_writer.take_written(tmp_path)
    assert crcs(tmp_path / "a.pt") == crcs(tmp_path / "b.pt") == {0}
    assert 0 not in crcs(tmp_path / "plain.pt")
    for name in ("a.pt", "b.pt"):
        assert torch.equal(torch.load(tmp_path / name, weights_only=True), values)
        assert written[name][1] == _checksum(tmp_path / name, "xxh3")


def test_every_writer_thread_skips_the_crc32_and_no_other_file_does(tmp_path, monkeypatch):
    """torch's CRC-32 switch holds per thread: with two DCP writer threads (and a background
    save's thread) every archive in every data file has CRC 0, while the LR scheduler's file,
    written by the caller's thread after DCP, keeps its CRC-32s, and the switch ends as it began."""
    import io
    import zipfile

    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setattr(dcp_writer, "writer_threads", lambda: 2)
    engine = _engine(1)
    _train_step(engine, 0.5)
    folder = tmp_path / "tmp-step"
    dcp_writer.hash_writes(folder, "xxh3")
    try:
        for name in ("first", "sync"):  # a second save: the caller's thread opens its file first or second
            engine.save_checkpoint(folder / name)
        engine.save_checkpoint(folder / "background", background=True).result()
    finally:
        dcp_writer.take_written(folder)
    assert torch.serialization.get_crc32_options()
    for sub, files in (("sync", 2), ("background", 1)):
        storage = FileSystemReader(str(folder / sub)).read_metadata().storage_data.values()
        data = {name: (folder / sub / name).read_bytes() for name in {info.relative_path for info in storage}}
        assert len(data) == files, sub
        crcs = {record.CRC for info in storage
                for record in zipfile.ZipFile(io.BytesIO(data[info.relative_path][info.offset:info.offset + info.length])).infolist()
                if record.file_size}
        assert crcs == {0}, sub
        assert 0 not in {record.CRC for record in zipfile.ZipFile(folder / sub / "scheduler.pt").infolist()
                         if record.file_size}, sub


@pytest.mark.parametrize("background", [False, True])
def test_a_checkpoint_sealed_from_write_time_checksums_round_trips_and_catches_damage(background, tmp_path):
    source = _engine(1)
    _train_step(source, 0.5)
    manager = CheckpointManager(tmp_path, ENV, keep=3)
    state = TrainState(step=2, consumed_samples=2, global_batch_size=1)
    path = manager.save(_DCPEngine(source), state, "x: 1\n", background=background) or manager.finish_background()
    saved = _snapshot(source)
    files = json.loads((path / "COMPLETE.json").read_text())["files"]
    for rel, meta in files.items():  # every listed checksum is the file's own, read back
        assert meta == {"bytes": (path / rel).stat().st_size, "xxh3_128": _checksum(path / rel, "xxh3")}, rel
    assert verify(path) is None
    target = _engine(2)
    assert not torch.equal(next(target.model.parameters()), next(source.model.parameters()))
    CheckpointManager(tmp_path, ENV, keep=3).load(_DCPEngine(target), path)
    _assert_same(_snapshot(target), saved)
    assert target.lr() == source.lr()
    data = path / "engine" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    data.write_bytes(bytes(raw))
    assert verify(path) == "checksum mismatch in engine/__0_0.distcp"
    data.write_bytes(bytes(raw[:-10]))
    assert verify(path).startswith("truncated file engine/__0_0.distcp")


def test_background_saves_reuse_the_host_copy_and_write_the_current_values(tmp_path):
    """The staging buffers outlive a save: the second background save must write step 2's
    values, not step 1's left in them."""
    source = _engine(1)
    manager = CheckpointManager(tmp_path, ENV, keep=3)
    paths, snapshots = [], []
    for step in (1, 2):
        _train_step(source, 0.5 * step)
        snapshots.append(_snapshot(source))
        assert manager.save(_DCPEngine(source), TrainState(step=step, global_batch_size=1), "x: 1\n",
                            background=True) is None
        staged = dcp_state._staging["state"]
        paths.append(manager.finish_background())
    assert staged is dcp_state._staging["state"]  # the same buffers both times
    assert not torch.equal(snapshots[0]["model.model.embed_tokens.weight"],
                           snapshots[1]["model.model.embed_tokens.weight"])
    for path, expected in zip(paths, snapshots):
        target = _engine(3)
        manager.load(_DCPEngine(target), path)
        _assert_same(_snapshot(target), expected)


def test_a_checkpoint_of_the_previous_version_still_loads(tmp_path):
    """Before this version the engine wrote through DCP's stock writer and the protocol hashed
    every file by reading it back; such a checkpoint verifies and loads the same."""
    import torch.distributed.checkpoint as dcp

    source = _engine(1)
    _train_step(source, 0.25)
    path = CheckpointManager(tmp_path, ENV, keep=3).save(
        _DCPEngine(source, storage_writer=lambda d: dcp.FileSystemWriter(str(d))), TrainState(step=4, global_batch_size=1),
        "x: 1\n")
    assert verify(path) is None
    target = _engine(2)
    CheckpointManager(tmp_path, ENV, keep=3).load(_DCPEngine(target), path)
    _assert_same(_snapshot(target), _snapshot(source))


@pytest.mark.parametrize("older", [False, True], ids=["tied-once", "tied-twice-before"])
def test_a_tied_embedding_is_written_once_and_every_reader_gets_both_names(older, tmp_path, monkeypatch):
    """tiny_llama ties ``lm_head.weight`` to ``model.embed_tokens.weight``: the checkpoint holds
    the tensor once (DCP's own metadata is the reference), a resume ties it again, and the whole
    model read back for export has both names equal to the source model's ``state_dict()``. A
    checkpoint from before (both names written) loads the same."""
    import torch.distributed.checkpoint as dcp

    if older:
        monkeypatch.setattr(dcp_state, "_aliases", lambda part: {})
    source = _engine(1)
    assert source.model.lm_head.weight is source.model.model.embed_tokens.weight
    _train_step(source, 0.25)
    path = CheckpointManager(tmp_path, ENV, keep=3).save(_DCPEngine(source), TrainState(step=4, global_batch_size=1), "x: 1\n")
    monkeypatch.undo()
    stored = dcp.FileSystemReader(str(path / "engine")).read_metadata().state_dict_metadata
    assert ("model.lm_head.weight" in stored) is older and "model.model.embed_tokens.weight" in stored
    target = _engine(2)
    CheckpointManager(tmp_path, ENV, keep=3).load(_DCPEngine(target), path)
    assert target.model.lm_head.weight is target.model.model.embed_tokens.weight
    _assert_same(_snapshot(target), _snapshot(source))
    whole = dcp_state.consolidated_model(path / "engine")
    _assert_same(whole, dict(source.model.state_dict()))


def test_the_mapped_reader_loads_what_dcps_own_reader_loads(tmp_path, monkeypatch):
    """The resume's reader against DCP's stock ``FileSystemReader`` on the same files: every
    tensor equal to what was saved (non-contiguous, bf16, integer, empty, objects), with one
    ``torch.load`` onto the meta device (no data read) per distinct tensor layout instead of one
    data-reading load per item."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.randn(64, 32), "b": torch.randn(64, 32), "c": torch.randn(64, 32),
             "transposed": torch.randn(7, 5).t(), "half": torch.randn(9).bfloat16(),
             "int": torch.arange(12).view(3, 4), "empty": torch.zeros(0, 3), "object": {"x": 1},
             # Same pickle for both, and the conjugate bit lives in it: never mapped
             "conj1": torch.randn(4, 3, dtype=torch.complex64).conj(), "conj2": torch.randn(4, 3, dtype=torch.complex64).conj()}
    quiet = dcp_state._single_process_is_intended
    with quiet():
        dcp.save(state, checkpoint_id=str(tmp_path), storage_writer=dcp_writer.writer(tmp_path))

    def blank():
        return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"x": 0} for k, v in state.items()}

    stock, mapped = blank(), blank()
    unpickled = []
    real_load = torch.load
    with quiet():
        dcp.load(stock, checkpoint_id=str(tmp_path))
        monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(str(k.get("map_location"))) or real_load(*a, **k))
        dcp.load(mapped, checkpoint_id=str(tmp_path), storage_reader=dcp_state._MappedReader(str(tmp_path)))
    monkeypatch.undo()
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(mapped[name], value) and torch.equal(stock[name], value), name
    assert mapped["object"] == stock["object"] == {"x": 1}
    # The layout of each distinct pickle, on meta: a's (b and c, the same layout, are mapped), the
    # transposed, bf16 and integer tensors', and the conjugated ones' (one pickle). Read with
    # their data: both conjugated ones (the bit lives in the pickle); the object through DCP's
    # own bytes path; the empty tensor has no item. DCP's stock reader reads all 9 with their data.
    assert sorted(unpickled) == ["None"] + ["cpu"] * 2 + ["meta"] * 5, " ".join(unpickled)


def _archive(tensor) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def test_a_repeated_save_reuses_its_plan_and_a_changed_dtype_does_not(tmp_path):
    """The second save of the same state sends no plan (DCP's plan cache) and writes the new
    values; a state of the same names and shapes in another dtype is planned again, so its
    metadata says bf16 (DCP's own plan comparison ignores dtypes and would keep fp32)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    sent = []

    class Recording(plan_cache.CachedSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            sent.append(plan.usable)
            return plan

    def save(state, folder):
        with dcp_state._single_process_is_intended():
            dcp.save(state, checkpoint_id=str(folder), storage_writer=dcp_writer.writer(folder), planner=Recording())

    def loaded(folder, like):
        blank = {k: torch.zeros_like(v) for k, v in like.items()}
        with dcp_state._single_process_is_intended():
            dcp.load(blank, checkpoint_id=str(folder), storage_reader=dcp_state._MappedReader(str(folder)))
        return blank

    plan_cache.drop_plan_cache()
    first = {"w": torch.randn(8, 4), "b": torch.randn(4)}
    second = {k: v + 1 for k, v in first.items()}
    halves = {k: v.bfloat16() for k, v in second.items()}
    try:
        for name, state in (("one", first), ("two", second), ("three", halves)):
            save(state, tmp_path / name)
    finally:
        plan_cache.drop_plan_cache()
    assert sent == [True, False, True]
    _assert_same(loaded(tmp_path / "two", second), second)
    _assert_same(loaded(tmp_path / "three", halves), halves)
    metadata = FileSystemReader(str(tmp_path / "three")).read_metadata()
    assert {metadata.state_dict_metadata[k].properties.dtype for k in halves} == {torch.bfloat16}


def test_a_failed_save_drops_the_plan_cache(tmp_path, monkeypatch):
    import threading

    engine = _engine(1)
    _train_step(engine, 0.5)
    engine.save_checkpoint(tmp_path / "good")
    from torch.distributed.checkpoint.planner import SavePlanner

    assert plan_cache.PLAN_CACHE in SavePlanner._cached_save_plan
    def full_disk(path, mode="wb"):
        raise OSError("disk full")

    monkeypatch.setattr(dcp_writer, "hashed_open", full_disk)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # a second writer thread's traceback
    with pytest.raises(BaseException, match="disk full"):  # DCP wraps it in CheckpointException
        engine.save_checkpoint(tmp_path / "bad")
    assert plan_cache.PLAN_CACHE not in SavePlanner._cached_save_plan
    monkeypatch.undo()
    _train_step(engine, 0.25)
    engine.save_checkpoint(tmp_path / "again")
    want = _snapshot(engine)
    _train_step(engine, 0.125)
    engine.load_checkpoint(tmp_path / "again", 1)
    _assert_same(_snapshot(engine), want)


def test_two_writer_threads_write_two_files_and_a_failing_thread_fails_the_save(tmp_path, monkeypatch):
    """A synchronous save on a rank with a spare core writes two files at once; they load back
    bit for bit. DCP's second writer thread does not pass its errors on: a save whose second
    thread failed must fail, not seal metadata without that thread's items."""
    import threading

    monkeypatch.setattr(dcp_writer, "writer_threads", lambda: 2)
    engine = _engine(1)
    _train_step(engine, 0.5)
    real_open = dcp_writer.hashed_open

    def helper_thread_fails(path, mode="wb"):
        if threading.current_thread() is not threading.main_thread():
            raise OSError("disk full")
        return real_open(path, mode)

    monkeypatch.setattr(dcp_writer, "hashed_open", helper_thread_fails)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's traceback, expected
    with pytest.raises(BaseException, match="wrote .* of this rank's .* items"):
        engine.save_checkpoint(tmp_path / "bad")
    monkeypatch.setattr(dcp_writer, "hashed_open", real_open)
    engine.save_checkpoint(tmp_path / "good")
    assert sorted(p.name for p in (tmp_path / "good").glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    want = _snapshot(engine)
    _train_step(engine, 0.25)
    engine.load_checkpoint(tmp_path / "good", 1)
    _assert_same(_snapshot(engine), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_full_disk_is_reported_as_one_not_as_torchs_zip_writer_error(threads, tmp_path, monkeypatch):
    """torch.save masks a failed write with "unexpected pos ..." from its zip writer, and DCP's
    second writer thread keeps its error to itself: the save names the folder and the OS error."""
    import errno
    import threading

    monkeypatch.setattr(dcp_writer, "writer_threads", lambda: threads)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    engine = _engine(1)
    _train_step(engine, 0.5)
    real_open = open

    class FillsUp:
        def __init__(self, path, mode):
            self.raw, self.room = real_open(path, mode), 2000

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    folder = tmp_path / "tmp-step"
    dcp_writer.hash_writes(folder, "xxh3")
    monkeypatch.setattr(dcp_writer, "open", lambda path, mode="r": FillsUp(path, mode) if mode == "wb" else real_open(path, mode),
                        raising=False)
    try:
        with pytest.raises(OSError, match=r"writing the checkpoint into .*engine failed: No space left on device") as err:
            engine.save_checkpoint(folder / "engine")
    finally:
        dcp_writer.take_written(folder)
    assert err.value.errno == errno.ENOSPC


def test_the_central_directory_parser_agrees_with_torchs_zip_reader(tmp_path):
    # _StoredZip reads an item's records in place; torch's own reader (PyTorchFileReader) is the
    # reference: the same records, bytes, data offsets and sizes, for items at odd offsets of one
    # file, and for an item whose end record defers to its zip64 record (as one over 4 GiB does).
    import mmap
    import struct

    from torch.distributed.checkpoint.utils import _create_file_view

    items = [_archive(t) for t in (torch.randn(5, 3), torch.randn(300, 70).t(), torch.arange(10, dtype=torch.bfloat16),
                                   torch.tensor(3), torch.zeros(0))]
    as_zip64 = bytearray(items[0])
    struct.pack_into("<HHII", as_zip64, len(as_zip64) - 14, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    items.append(bytes(as_zip64))
    path, spans, at = tmp_path / "items", [], 7
    path.write_bytes(b"x" * 7 + b"".join(items))
    for item in items:
        spans.append((at, len(item)))
        at += len(item)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        for start, length in spans:
            ours = dcp_state._StoredZip(mapped, start, length)
            torchs = torch._C.PyTorchFileReader(_create_file_view(file, start, length))
            assert sorted(ours.get_all_records()) == sorted(torchs.get_all_records())
            for name in torchs.get_all_records():
                assert ours.get_record(name) == torchs.get_record(name), name
                assert ours.get_record_offset(name) == torchs.get_record_offset(name), name
                assert ours.get_record_size(name) == torchs.get_record_size(name), name
            del ours
        # Not a stored archive where the reader looks (a compressed one, a truncated one, no
        # archive at all): ValueError, and torch's reader takes the item.
        import io
        import warnings
        import zipfile

        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as packed:
            packed.writestr("archive/data.pkl", b"x" * 100)
        twice, mixed = io.BytesIO(), io.BytesIO()
        with zipfile.ZipFile(twice, "w") as archive, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it writes
            archive.writestr("archive/data/0", b"\0" * 8)
            archive.writestr("archive/data/0", b"\1" * 8)
        with zipfile.ZipFile(mixed, "w") as archive:
            archive.writestr("archive/data.pkl", b"x")
            archive.writestr("other/data/0", b"\0" * 8)
        for bad in (buffer.getvalue(), twice.getvalue(), mixed.getvalue(), items[0][:-30], b"not an archive at all" * 3):
            bad_path = tmp_path / "bad"
            bad_path.write_bytes(bad)
            with open(bad_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                with pytest.raises(ValueError):
                    dcp_state._StoredZip(m, 0, len(bad))
                with pytest.raises(ValueError):  # an item said to run past the file's end
                    dcp_state._StoredZip(m, 1, len(bad))


def test_a_checkpoint_of_another_shape_is_a_resume_error_naming_the_checkpoint(tmp_path):
    from conftest import make_cfg
    from llmtrain.common.errors import ResumeError
    from llmtrain.engine.torch_engine import TorchEngine
    from llmtrain.models.build import build_model
    from llmtrain.objectives import CausalLM

    path = CheckpointManager(tmp_path, ENV, keep=3).save(_DCPEngine(_engine(1)), TrainState(step=1, global_batch_size=1), "x: 1\n")
    wider = TorchEngine(make_cfg(["trainer.max_steps=10", "model.architecture.intermediate_size=384"]), ENV,
                        accumulation_steps=1, objective=CausalLM())
    wider.setup(build_model(wider.cfg.model, seed=1))
    with pytest.raises(ResumeError, match="does not fit this model"):
        dcp_state.load(path / "engine", [wider.model], [wider.optimizer], [wider.scheduler])


def test_deepspeed_shards_are_hashed_as_torch_saves_them(tmp_path):
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from llmtrain.engine.deepspeed_engine import _hashed_saves

    engine = TorchCheckpointEngine()
    engine.zipfile_serialization = True
    state = {"weights": torch.randn(64, 8), "step": 3, "nested": {"m": torch.arange(5)}}
    dcp_writer.hash_writes(tmp_path, "xxh3")
    with _hashed_saves(engine):
        engine.save(state, str(tmp_path / "shard.pt"))
    assert "save" not in vars(engine)  # the class's own method again
    written = dcp_writer.take_written(tmp_path)
    assert written == {"shard.pt": ((tmp_path / "shard.pt").stat().st_size, _checksum(tmp_path / "shard.pt", "xxh3"))}
    loaded = torch.load(tmp_path / "shard.pt", weights_only=True)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3
    assert torch.equal(loaded["nested"]["m"], state["nested"]["m"])


def test_pruned_checkpoints_leave_at_once_and_are_deleted_in_the_background(tmp_path):
    from test_checkpoint_protocol import FileEngine

    manager = CheckpointManager(tmp_path, ENV, keep=1)
    root = tmp_path / "checkpoints"
    (root / ".deleting-step_1" / "engine").mkdir(parents=True)  # left by a process killed mid-delete
    for step in (2, 3):
        manager.save(FileEngine(), TrainState(step=step, global_batch_size=1), "x: 1\n")
        assert [p.name for p in root.glob("step_*")] == [f"step_{step}"]  # step_2 left as step_3 sealed
    assert manager.resolve("auto") == root / "step_3"
    manager.finish_pruning()
    assert sorted(p.name for p in root.iterdir()) == ["step_3"]
