"""Framed ``torch.save`` archives (``llmtrain.checkpoint.format.archive_frames``) and the DCP writer that
uses them. The references are torch's own: ``torch.save``'s bytes for each tensor, and DCP's
stock ``FileSystemWriter``'s files and metadata for a whole state dict."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from llmtrain.checkpoint.format import archive_frames, dcp_writer
from llmtrain.engine import dcp_state


def _torch_save(tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _framed(tensor) -> bytes:
    buffer = io.BytesIO()
    archive_frames.write_tensor(buffer, tensor)
    return buffer.getvalue()


@pytest.fixture
def no_crc32():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


FRAMED = {
    "matrix": lambda: torch.randn(288, 576),
    "bf16": lambda: torch.randn(3).bfloat16(),
    "scalar": lambda: torch.tensor(3.0),
    # as long as the archive's 6-byte "byteorder" record: the data must still be found by its header
    "six bytes": lambda: torch.arange(6, dtype=torch.uint8),
    "bool": lambda: torch.tensor([True, False, True]),
    "int64 with a unit dim": lambda: torch.randint(0, 5, (7, 1, 3)),
    "exactly 64 KiB": lambda: torch.randn(16384),
    "just over 64 KiB": lambda: torch.randn(16385),
    "odd unit stride": lambda: torch.randn(1, 4).t(),  # contiguous, strides (1, 1)
    "complex": lambda: torch.randn(5, dtype=torch.complex64),
    "fp8": lambda: torch.randn(8).to(torch.float8_e4m3fn),
}
NOT_FRAMED = {
    "view into a larger storage": lambda: torch.randn(10)[2:5],
    "transposed": lambda: torch.randn(3, 4).t(),
    "conjugated": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "requires grad": lambda: torch.randn(3, requires_grad=True),
    "parameter": lambda: torch.nn.Parameter(torch.randn(3)),
    "empty": lambda: torch.zeros(0, 3),
    "python attribute": lambda: _with_attribute(torch.randn(3)),
}


def _with_attribute(tensor):
    tensor.note = "kept by torch.save"
    return tensor


@pytest.mark.parametrize("name", FRAMED)
def test_a_framed_archive_is_torch_saves_bytes_and_loads_back(name, no_crc32):
    tensor = FRAMED[name]()
    assert archive_frames.frame_for(tensor) is not None, name
    twice = [_framed(tensor), _framed(tensor)]  # the second from the cached frame
    assert twice[0] == twice[1] == _torch_save(tensor)
    loaded = torch.load(io.BytesIO(twice[0]), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.stride() == tensor.stride()
    assert torch.equal(loaded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", NOT_FRAMED)
def test_what_cannot_be_framed_goes_to_torch_save(name, no_crc32):
    tensor = NOT_FRAMED[name]()
    assert archive_frames.frame_for(tensor) is None
    assert _framed(tensor) == _torch_save(tensor)


def test_nothing_is_framed_while_the_zip_crc32s_are_on():
    """A CRC-32 depends on the data, so a frame could not hold it."""
    assert torch.serialization.get_crc32_options()
    tensor = torch.randn(4, 4)
    assert archive_frames.frame_for(tensor) is None
    assert _framed(tensor) == _torch_save(tensor)


def test_the_dcp_writer_writes_dcps_own_files_byte_for_byte(tmp_path, no_crc32, monkeypatch):
    """llmtrain's writer against DCP's stock ``FileSystemWriter`` on the same state dict, both
    without CRC-32s: the same data files byte for byte and the same offsets and lengths in the
    metadata; DCP's stock reader loads llmtrain's files. Once the layouts' frames are cached, only
    the item that cannot be framed (the transposed one) goes through ``torch.save``."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(64, 32), "b": torch.randn(32).bfloat16(), "step": torch.tensor(7.0),
             "view": torch.randn(20)[5:9], "transposed": torch.randn(7, 5).t(), "object": {"epoch": 3}}
    with dcp_state._single_process_is_intended():
        dcp.save(state, checkpoint_id=str(tmp_path / "stock"), storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))
        dcp.save(state, checkpoint_id=str(tmp_path / "ours"), storage_writer=dcp_writer.writer(tmp_path / "ours"))
    dcp_writer.take_written(tmp_path / "ours")
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, *a, **k: saved.append(obj) or real_save(obj, *a, **k))
    with dcp_state._single_process_is_intended():
        dcp.save(state, checkpoint_id=str(tmp_path / "again"), storage_writer=dcp_writer.writer(tmp_path / "again"))
    monkeypatch.undo()
    dcp_writer.take_written(tmp_path / "again")
    assert [tuple(t.shape) for t in saved if isinstance(t, torch.Tensor)] == [(5, 7)]
    files = sorted(p.name for p in (tmp_path / "stock").glob("*.distcp"))
    assert files == sorted(p.name for p in (tmp_path / "ours").glob("*.distcp")) == ["__0_0.distcp"]
    assert (tmp_path / "ours" / files[0]).read_bytes() == (tmp_path / "stock" / files[0]).read_bytes()

    def where(folder):
        with open(folder / ".metadata", "rb") as handle:
            metadata = pickle.load(handle)
        return {index.fqn: (info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()}

    assert where(tmp_path / "ours") == where(tmp_path / "stock")
    loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0} for k, v in state.items()}
    with dcp_state._single_process_is_intended():
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ours"))
    for name, value in state.items():
        assert torch.equal(loaded[name], value) if isinstance(value, torch.Tensor) else loaded[name] == value, name


def test_each_data_file_is_whole_on_disk_when_it_is_synced(tmp_path, monkeypatch, no_crc32):
    """The framed writer does not flush after each item as ``torch.save`` does: the file's tail
    (the last archive's central directory) must reach the file before its fsync."""
    import os

    import torch.distributed.checkpoint as dcp

    at_sync = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: at_sync.append(os.fstat(fd).st_size) or real_fsync(fd))
    with dcp_state._single_process_is_intended():
        dcp.save({"w": torch.randn(64, 32), "b": torch.randn(32)}, checkpoint_id=str(tmp_path),
                 storage_writer=dcp_writer.writer(tmp_path))
    dcp_writer.take_written(tmp_path)
    assert at_sync[0] == (tmp_path / "__0_0.distcp").stat().st_size


def test_skip_data_is_left_to_torch_save(no_crc32):
    """Inside ``torch.serialization.skip_data`` torch.save writes no tensor bytes; a frame would."""
    tensor = torch.randn(8, 8)
    archive_frames.frame_for(tensor)  # a frame cached for the layout beforehand
    with torch.serialization.skip_data():
        assert archive_frames.frame_for(tensor) is None
        assert _framed(tensor) == _torch_save(tensor)
