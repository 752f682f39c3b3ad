"""DCP's file writer as llmtrain writes checkpoints: every file checksummed as it is written
(:func:`hash_writes`, :func:`take_written`, :func:`hashed_open`; the completion marker holds the
checksums), tensor items as framed ``torch.save`` archives (:mod:`.archive_frames`), a save that
fails when a writer thread failed (:class:`_CompleteWriter`) and names the OSError behind it
(:func:`write_error`). The engines' DCP state (:mod:`llmtrain.engine.dcp_state`) and DeepSpeed's
shards write through it; the protocol (:mod:`llmtrain.checkpoint.protocol`) registers and takes
the checksums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import os
import queue
import threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

# ---------------------------------------------------------------- checksums while writing
# The completion marker needs a checksum of every file. Hashing the bytes as they are handed to
# the file, in the same pass, costs one sweep of memory; hashing afterwards re-reads every file
# (a second pass over the page cache, as large as the checkpoint). Both see the same bytes: a
# re-read comes from the page cache too, not from the disk. The protocol registers the folder
# and the checksum kind (:func:`hash_writes`) and takes the results when it seals
# (:func:`take_written`); files written any other way are hashed by reading them, as before.
_hash_lock = threading.Lock()
_hash_dirs: dict[str, str] = {}  # folder being written -> checksum kind
_written: dict[str, tuple[int, str, str]] = {}  # file -> (bytes, kind, hex digest)
# folder -> the first OSError a hashed file in it met (disk full, quota): torch.save masks it with
# its own "unexpected pos" error, and a DCP writer thread's error does not reach the caller.
_write_errors: dict[str, OSError] = {}


def new_digest(kind: str):
    """A fresh hash object of checksum ``kind``: ``xxh3`` (XXH3-128) or ``sha256``."""
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "xxh3":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum kind {kind!r}: xxh3 or sha256 (trainer.checkpoint_hash)")


def hash_writes(directory: Path, kind: str) -> None:
    """Files written under ``directory`` through :func:`hashed_open` (DCP's files, DeepSpeed's
    shards) get checksum ``kind`` of their bytes as written, until :func:`take_written`."""
    new_digest(kind)  # refuse an unknown kind now, not in a writer thread
    with _hash_lock:
        _hash_dirs[os.path.abspath(directory)] = kind


def take_written(directory: Path) -> dict[str, tuple[int, str]]:
    """{path relative to ``directory``: (bytes, hex digest)} of the files hashed while written
    under it, with the kind :func:`hash_writes` registered; forgets them and the folder."""
    root = os.path.abspath(directory)
    with _hash_lock:
        kind = _hash_dirs.pop(root, None)
        mine = [p for p in _written if p.startswith(root + os.sep)]
        taken = {p: _written.pop(p) for p in mine}
    return {os.path.relpath(p, root).replace(os.sep, "/"): (size, digest)
            for p, (size, k, digest) in taken.items() if k == kind}


def _kind_for(path: str) -> str | None:
    with _hash_lock:
        for folder, kind in _hash_dirs.items():
            if path.startswith(folder + os.sep):
                return kind
    return None


# torch.save computes a CRC-32 of every record of its zip archive: 0.17 s per 800 MB on a 2-core
# CPU, a tenth of a checkpoint's save. A file written through hashed_open gets a checksum of its
# own (XXH3-128 or SHA-256) that the completion marker holds and every resume verifies before
# reading, so the CRC-32 adds nothing there. torch's switch (``set_crc32_options``) holds per
# thread (its config values are ContextVars), so each thread that opens a hashed file turns it
# off for itself and back to its own previous value once its last hashed file closes: DCP's
# writer threads each write their archives without CRC-32s, and nothing else any thread writes
# (the LR scheduler's and RNG files, a user's torch.save) changes. A torch whose config is
# process-wide instead keeps its CRC-32s: switching it there would reach every thread.
_crc_threads = threading.local()  # per thread: hashed files open, the switch's value before


def _crc_switch_is_per_thread() -> bool:
    from contextvars import ContextVar

    from torch.utils.serialization import config

    entry = getattr(config, "_config", {}).get("save.compute_crc32")
    return isinstance(getattr(entry, "user_override", None), ContextVar)


_CRC_PER_THREAD = _crc_switch_is_per_thread()


def _stop_zip_crc() -> bool:
    """Turn the CRC-32s off for this thread; whether it did (then :func:`_restore_zip_crc`)."""
    if not _CRC_PER_THREAD:
        return False
    depth = getattr(_crc_threads, "open", 0)
    if depth == 0:
        _crc_threads.before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
    _crc_threads.open = depth + 1
    return True


def _restore_zip_crc() -> None:
    _crc_threads.open -= 1
    if _crc_threads.open == 0:
        torch.serialization.set_crc32_options(_crc_threads.before)


class _HashingWriter(io.RawIOBase):
    """A write-only file that updates a checksum with every byte written, in order. No seek: a
    file written out of order could not be hashed in one pass. While it is open, ``torch.save``
    in the thread that opened it writes no zip CRC-32s (the checksum covers the file). It is
    closed in that thread (DCP's writers and DeepSpeed's checkpoint engine do): a close from
    another thread leaves the opening thread's CRC-32s off."""

    def __init__(self, raw, path: str, kind: str):
        super().__init__()
        self.raw, self.path, self.kind = raw, path, kind
        self.digest, self.size = new_digest(kind), 0
        # The thread whose switch was turned off (None: left on); only it can turn it back.
        self._crc_thread = threading.get_ident() if _stop_zip_crc() else None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self.raw.write(view)
        except OSError as err:
            with _hash_lock:
                _write_errors.setdefault(os.path.dirname(self.path), err)
            raise
        written = len(view) if written is None else written
        self.digest.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:  # IOBase.close flushes once more, after the file is closed
            self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.raw.close()
            with _hash_lock:
                _written[self.path] = (self.size, self.kind, self.digest.hexdigest())
        finally:
            if self._crc_thread == threading.get_ident():
                _restore_zip_crc()
            super().close()


def hashed_open(path: str | os.PathLike, mode: str = "wb"):
    """``open(path, mode)``; for a new file under a folder of :func:`hash_writes`, a writer that
    checksums its bytes on the way (recorded when it closes)."""
    path = os.path.abspath(path)
    kind = _kind_for(path) if mode == "wb" else None
    with _hash_lock:
        _written.pop(path, None)  # an older version of the file is no longer what is on disk
    raw = open(path, mode)
    return raw if kind is None else _HashingWriter(raw, path, kind)


def _moved(old: str | os.PathLike, new: str | os.PathLike | None) -> None:
    with _hash_lock:
        entry = _written.pop(os.path.abspath(old), None)
        if new is not None:
            _written.pop(os.path.abspath(new), None)
            if entry is not None:
                _written[os.path.abspath(new)] = entry


class _HashingFileSystem(FileSystem):
    """DCP's local file system with :func:`hashed_open` for the files it writes (data files and
    ``.metadata``, which DCP writes as ``.metadata.tmp`` and renames)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = hashed_open(path, mode)
        try:
            yield stream
        finally:
            stream.close()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        _moved(path, new_path)

    def rm_file(self, path) -> None:
        super().rm_file(path)
        _moved(path, None)


try:  # DCP's own per-file writing, which _CompleteWriter repeats with framed archives
    from torch.distributed.checkpoint.filesystem import (_item_size, _OverlappingCpuLoader, _SerialCpuLoader,
                                                         _StorageInfo, _write_item, SerializationFormat)
    from torch.distributed.checkpoint.planner import WriteItemType

    # The pieces as this module calls them; another torch's may differ: DCP's writer as it is then.
    if (list(inspect.signature(_write_item).parameters)[:6] != ["transforms", "stream", "data", "write_item",
                                                                "storage_key", "serialization_format"]
            or [f.name for f in dataclasses.fields(_StorageInfo)][:3] != ["relative_path", "offset", "length"]
            or "inflight_threshhold" not in inspect.signature(_OverlappingCpuLoader).parameters):
        _write_item = None
except ImportError:  # another torch: DCP's writer as it is
    _write_item = None
# False: DCP's own writer, one torch.save per item (scripts/bench/checkpoint.py --stock-writer
# times the two side by side).
FRAMED_ARCHIVES = True


def _write_files(writer: "dcp.FileSystemWriter", planner: SavePlanner, file_queue, result_queue) -> None:
    """DCP's ``_write_files_from_queue`` for a writer without stream extensions, each tensor's
    archive written by :func:`llmtrain.checkpoint.format.archive_frames.write_tensor` (the same bytes as
    DCP's ``torch.save``, framed: three writes instead of about forty, no pickling). Byte items,
    the loader that copies ahead from an accelerator, the order of items, the offsets and sizes
    recorded, the check that every tensor reached the CPU and the flush and fsync are DCP's."""
    from llmtrain.checkpoint.format.archive_frames import write_tensor

    accelerator = torch.cuda.is_available() or getattr(getattr(torch, torch._C._get_privateuse1_backend_name(), None),
                                                       "is_available", lambda: False)()
    try:
        while True:
            path, storage_key, items = file_queue.get_nowait()
            if writer.thread_count == 1 and accelerator and writer.per_thread_copy_ahead > 0:
                loader = _OverlappingCpuLoader(planner.resolve_data, inflight_threshhold=writer.per_thread_copy_ahead)
            else:
                loader = _SerialCpuLoader(planner.resolve_data)
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    loader.add(_item_size(item), item)
            loader.start_loading()
            results = []
            with writer.fs.create_stream(path, "wb") as stream:
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:
                        results.append(_write_item(writer.transforms, stream, planner.resolve_data(item), item,
                                                   storage_key, writer.serialization_format))
                for tensor, item in loader.values():
                    if not tensor.is_cpu:
                        raise AssertionError(f"DCP's loader left {item.index.fqn} on {tensor.device}, not the CPU")
                    offset = stream.tell()
                    write_tensor(stream, tensor)
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(storage_key, offset, length)))
                stream.flush()  # torch.save flushed after each item; the tail must be on disk before the sync
                if writer.sync_files:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, io.UnsupportedOperation):
                        os.sync()
            result_queue.put(results)
    except queue.Empty:
        pass


class _CompleteWriter(dcp.FileSystemWriter):
    """DCP's file writer that fails when an item of this rank's plan was not written. With more
    than one thread, DCP's writer threads other than the caller's end on an error without passing
    it on (the thread's traceback is printed), and the save would otherwise complete with
    metadata that lacks that thread's items.

    Its files are DCP's, written by :func:`_write_files` (framed archives) where this torch has
    the pieces and the writer has no stream extensions."""

    def _write_data(self, planner, file_queue):
        if (not FRAMED_ARCHIVES or _write_item is None or self.transforms.extensions
                or getattr(self, "serialization_format", None) != SerializationFormat.TORCH_SAVE):
            return super()._write_data(planner, file_queue)
        result_queue: queue.Queue = queue.Queue()
        threads = [threading.Thread(target=_write_files, args=(self, planner, file_queue, result_queue))
                   for _ in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        _write_files(self, planner, file_queue, result_queue)
        for thread in threads:
            thread.join()
        results = []
        while not result_queue.empty():
            results += result_queue.get_nowait()
        done: Future = Future()
        done.set_result(results)
        return done

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        results = written.wait()
        missing = len({item.index for item in plan.items} - {result.index for result in results})
        if missing:
            raise OSError(f"DCP wrote {len(plan.items) - missing} of this rank's {len(plan.items)} items into "
                          f"{self.path}: a writer thread failed (its traceback is printed above)")
        return written


def write_error(directory: Path, err: BaseException) -> OSError | None:
    """The OSError behind a failed save into ``directory``: the first a hashed file there met,
    else the first in ``err``'s chain (DCP's per-rank failures included), else None."""
    with _hash_lock:
        found = _write_errors.pop(os.path.abspath(directory), None)
    seen, todo = set(), [err]
    while todo and found is None:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            found = e
        failures = getattr(e, "failures", None) if isinstance(e, CheckpointException) else None
        todo += [e.__cause__, e.__context__] + [failure[0] for failure in (failures or {}).values()]
    return found


def writer(directory: Path, cls=None, threads: int = 1) -> "dcp.FileSystemWriter":
    """DCP's file writer for ``directory`` (``threads`` files per rank, each written by a thread
    of its own, fsynced) whose files are checksummed as they are written (:func:`hash_writes`).

    Raises (from the save): OSError when a writer thread failed (:class:`_CompleteWriter`)."""
    made = (cls or _CompleteWriter)(str(directory), thread_count=threads)
    made.fs = _HashingFileSystem()
    return made


def writer_threads() -> int:
    """Writer threads for a synchronous save: the cores this process may use divided among the
    node's ranks (``LOCAL_WORLD_SIZE``), 1 to 4. A save's time is copying into the page cache and
    fsync, both outside the GIL, so a rank with a spare core writes two files at once. SmolLM2-135M
    on one process of a 2-core CPU: 1.07 s against 1.62 s with one thread (medians of 8
    alternating saves); 2 ranks on the same 2 cores gained nothing (1.96 s against 2.04 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(4, cores // ranks))


def fault_writer(directory: Path):
    """Test hook: with ``LLMTRAIN_FAULT=background_write:<step>`` a background save of step
    ``<step>`` kills its process from the writer thread once this rank's data file is written
    and before DCP's metadata is, while training has moved on."""
    import os

    step = directory.parent.name.removeprefix(".tmp-step_")
    if os.environ.get("LLMTRAIN_FAULT") != f"background_write:{step}":
        return None

    class KilledMidWrite(_CompleteWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            written.wait()
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
            return written

    return writer(directory, KilledMidWrite)
