"""``torch.save`` archives of single tensors, framed without ``torch.save``.

DCP's file writer stores every tensor item as a ``torch.save`` archive of its own (a zip with
``data.pkl``, ``byteorder``, ``data/0`` and a few small records) so that its reader can
``torch.load`` any item alone. SmolLM2-135M's FSDP2 shard state is 818 items a rank; each
``torch.save`` pickles the tensor's rebuild call and hands the file about 40 small writes, which
went through DCP's stream wrapper and llmtrain's checksumming writer one by one: 32 k Python
writes a save, 0.2-0.3 s of the rank's time besides copying the data.

With its zip CRC-32s off (every file llmtrain writes through
:func:`llmtrain.checkpoint.format.dcp_writer.hashed_open` has a checksum of its own, so it turns them off),
such an archive is the same bytes before and after the tensor's data for every tensor of the
same dtype, shape and strides: the pickle names no data, the record offsets depend on sizes
only, and the serialization id is derived from the (zero) CRC-32s. :func:`write_tensor` takes
those two frames from one ``torch.save`` of an uninitialised tensor of the layout (cached per
process) and writes ``head``, the tensor's bytes and ``tail``: three writes, no pickling, the
same file byte for byte (``tests/test_archive_frames.py`` compares them with ``torch.save``'s
output and with DCP's stock writer's files). Anything it cannot frame that way goes to
``torch.save``.
"""

from __future__ import annotations

import io
import struct
from typing import NamedTuple

import torch

# Writes at least this large are not kept while a frame is recorded: the one of them that follows
# the ``data/0`` record's local header is the tensor's data.
_LARGE_WRITE = 1 << 16
_LOCAL_HEADER = b"PK\x03\x04"


class ArchiveFrame(NamedTuple):
    """The bytes of a ``torch.save`` archive of one tensor around its data (``head`` ends where
    the ``data/0`` record's bytes begin, ``tail`` follows them to the archive's end)."""

    head: bytes
    tail: bytes


# layout key -> frame (None: not frameable). Writer threads may record one layout twice; the
# frames are equal, and a dict assignment is atomic.
_frames: dict[tuple, ArchiveFrame | None] = {}


def _crc32_on() -> bool:
    getter = getattr(torch.serialization, "get_crc32_options", None)
    return True if getter is None else bool(getter())


def _skipping_data() -> bool:
    tls = getattr(torch.serialization, "_serialization_tls", None)
    return bool(getattr(tls, "skip_data", False))


def _layout_key(tensor: torch.Tensor) -> tuple | None:
    """What the archive's bytes outside the data depend on, for a tensor this module frames;
    None for one it leaves to ``torch.save`` (a subclass, a view into a larger storage, a
    non-contiguous, quantized, conjugated, negated or empty tensor, one with autograd state or
    Python attributes, or any tensor while this thread's zip CRC-32s are on or inside
    ``torch.serialization.skip_data``)."""
    if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.device.type != "cpu"
            or tensor.requires_grad or tensor.grad_fn is not None or tensor.is_quantized or tensor.is_nested
            or tensor.is_conj() or tensor.is_neg() or tensor.numel() == 0 or tensor.storage_offset() != 0
            or not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.nbytes
            or tensor.__dict__ or _crc32_on() or _skipping_data()):
        return None
    from torch.utils.serialization import config

    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), getattr(config.save, "storage_alignment", None))


class _Recorder(io.RawIOBase):
    """A sink that keeps the small writes it is handed and only the length of large ones."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes | int] = []
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        self.writes.append(view.nbytes if view.nbytes >= _LARGE_WRITE else bytes(view))
        self.position += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.position


def _ends_with_data_header(head: bytes) -> bool:
    """Whether ``head`` ends exactly where a zip local header for a ``.../data/0`` record ends."""
    start = head.rfind(_LOCAL_HEADER)
    if start < 0 or len(head) - start < 30:
        return False
    name_length, extra_length = struct.unpack_from("<HH", head, start + 26)
    name = head[start + 30:start + 30 + name_length]
    return start + 30 + name_length + extra_length == len(head) and name.endswith(b"/data/0")


def _record_frame(tensor: torch.Tensor) -> ArchiveFrame | None:
    """The frame of ``tensor``'s layout, from one ``torch.save`` of an uninitialised tensor of
    it; None when the archive does not have the one ``data/0`` record this module expects."""
    template = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
    recorder = _Recorder()
    torch.save(template, recorder)
    writes = recorder.writes
    found = None
    for index, write in enumerate(writes):
        length = write if isinstance(write, int) else len(write)
        if length != tensor.nbytes:
            continue
        head = writes[:index]
        if any(isinstance(w, int) for w in head):
            return None
        head_bytes = b"".join(head)
        if _ends_with_data_header(head_bytes):
            if found is not None:
                return None
            found = index, head_bytes
    if found is None:
        return None
    index, head_bytes = found
    tail = writes[index + 1:]
    if any(isinstance(w, int) for w in tail):
        return None
    return ArchiveFrame(head_bytes, b"".join(tail))


def frame_for(tensor: torch.Tensor) -> ArchiveFrame | None:
    """The cached frame for ``tensor``'s layout, or None where ``torch.save`` must write it."""
    key = _layout_key(tensor)
    if key is None:
        return None
    frame = _frames.get(key, ...)
    if frame is ...:
        frame = _record_frame(tensor)
        if _crc32_on():  # switched on meanwhile (a torch whose switch is process-wide): nothing cached
            return None
        _frames[key] = frame
    return frame


def write_tensor(stream, tensor: torch.Tensor) -> None:
    """Write the bytes ``torch.save(tensor, stream)`` writes, framed where it can be
    (:func:`frame_for`), else through ``torch.save``. ``tensor`` lives on the CPU. Unlike
    ``torch.save`` it does not flush ``stream``: the caller flushes before it syncs."""
    frame = frame_for(tensor)
    if frame is None:
        torch.save(tensor, stream)
        return
    stream.write(frame.head)
    stream.write(tensor.reshape(-1).view(torch.uint8).numpy())
    stream.write(frame.tail)
