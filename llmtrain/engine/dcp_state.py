"""Model and optimizer state through torch Distributed Checkpoint (DCP), for every torch engine.

State is keyed by the model's own parameter names (``model.layers.3.mlp.up_proj.weight``) and
the optimizer state is flattened per parameter (``state.<name>.exp_avg``), so nothing depends on
the layout that wrote it: DCP reshards on
load between one process, DDP, FSDP2 shards, tensor-parallel DTensors and pipeline stages
(each stage loads only the names it holds). Written files (``__<rank>_0.distcp``, ``.metadata``,
``scheduler.pt``) sit in the checkpoint's engine folder, covered by its completion marker; they
are written in the checkpoint format's own way (:mod:`llmtrain.checkpoint.format`: checksums
taken while writing, framed tensor archives, the save-plan cache).
"""

from __future__ import annotations

import contextlib
import errno
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from llmtrain.checkpoint.format import dcp_writer, plan_cache
from llmtrain.parallel import distributed

# Frozen parameters (LoRA's base, model.freeze) are not saved: they come from the model's source
# again on resume (llmtrain.models.adapters), so a LoRA checkpoint is adapter-sized.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Loading sets the trainable tensors only (dcp.load above has already required every one of
# them): strict=False lets the frozen ones, which come from the model's source, stay as they are.
LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)
METADATA = ".metadata"
# The optimizer's hyperparameters, flattened per parameter (``param_groups.<name>.lr``, a dozen
# per parameter): they are not written. DCP would store each as its own item, one torch.save
# apiece (hundreds per checkpoint, most of a small model's save time), and they are the
# config's values, which a resume must keep (llmtrain.checkpoint.resume.config_differences); the LR
# comes from the scheduler's state. On load the live optimizer's own values fill them.
_HYPERPARAMETERS = "param_groups."
# {alias: name} of the tied weights a checkpoint holds under one name (:func:`_state`).
_ALIASES = "tied_aliases"
# dcp.async_save on one process warns from its thread, outside _single_process_is_intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, "
                        "assuming the intent is to save in a single process")


class _MappedReader(dcp.FileSystemReader):
    """DCP's file reader that copies each tensor straight from the memory-mapped file into its
    target, where DCP's stock reader reads every item into a fresh buffer and ``torch.load``-s it
    (a zip archive and a ``weights_only`` unpickling per item: SmolLM2-135M holds 1,089) before
    copying it into the target. That was 1.0 s of a 1.4 s load on one process.

    The files are DCP's own (each item a ``torch.save`` archive), so any DCP tool still reads
    them. An item's tensor is described by its archive's ``data.pkl``, whose bytes are the same
    for every item of one dtype, shape and strides: the first item with given ``data.pkl`` bytes
    is unpickled by ``torch.load(weights_only=True)`` as DCP does, onto the meta device (no data
    read), which gives the layout; every item is then viewed at its ``data/0`` record's offset in
    the mapping, found from the archive's central directory (:class:`_StoredZip`).
    An item that is not a single-storage tensor archive in this machine's byte order, or that
    went through a storage transform, is left to DCP's reader."""

    def read_data(self, plan, planner):
        import dataclasses
        import mmap
        import sys

        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.distributed.checkpoint.utils import _create_file_view

        rest, per_file = [], {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                rest.append(req)
            else:
                per_file.setdefault(info.relative_path, []).append(req)
        layouts: dict[bytes, tuple | None] = {}
        for relative_path, reqs in per_file.items():
            with open(self.fs.concat_path(self.path, relative_path), "rb") as file:
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    for req in reqs:
                        info = self.storage_data[req.storage_index]
                        view = _create_file_view(file, info.offset, info.length)
                        try:
                            archive = _StoredZip(mapped, info.offset, info.length)
                        except ValueError:  # not a plain stored archive: torch's own zip reader decides
                            archive = torch._C.PyTorchFileReader(view)
                        if (sorted(r for r in archive.get_all_records() if r.startswith("data/")) != ["data/0"]
                                or not archive.has_record("byteorder")
                                or archive.get_record("byteorder") != sys.byteorder.encode()):
                            rest.append(req)
                            continue
                        tensor = _mapped_or_loaded(archive, view, mapped, info.offset, layouts)
                        try:
                            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                            target = planner.resolve_tensor(req).detach()
                            if target.size() != tensor.size():
                                raise RuntimeError(f"{req.storage_index.fqn}: stored {tuple(tensor.size())}, "
                                                   f"model needs {tuple(target.size())}")
                            target.copy_(tensor)
                        finally:
                            del tensor  # the mapping closes only once no view into it is left
                        planner.commit_tensor(req, target)
                finally:
                    try:
                        mapped.close()
                    except BufferError:  # a view is still held by an error on its way up: let that error out
                        pass
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done = torch.futures.Future()
        done.set_result(None)
        return done


class _StoredZip:
    """The records of one uncompressed zip archive (a ``torch.save`` item: ``data.pkl``,
    ``byteorder``, ``data/0``, ...) at bytes ``[start, start + length)`` of ``mapped``, read from
    its central directory in place: the part of ``torch._C.PyTorchFileReader``'s interface
    :class:`_MappedReader` uses, without its dozens of small reads through a Python file view per
    item (0.13 s of a 0.75 s SmolLM2-135M load on one process). Names are given without the
    archive's folder prefix, as torch's reader gives them. Layout: PKWARE APPNOTE.TXT 6.3,
    sections 4.3.7 (local header), 4.3.12 (central directory), 4.3.14-16 (zip64 and the end record).

    Raises:
        ValueError: anything but a plain archive of stored (uncompressed) records, all in one
            folder, each named once, that lie inside the item (and the item inside the file):
            the caller then hands the item to torch's reader.
    """

    def __init__(self, mapped, start: int, length: int) -> None:
        if start < 0 or length < 22 or start + length > len(mapped):
            raise ValueError("the item lies outside the file")
        self._mapped, self._start, self._records = mapped, start, {}
        try:
            self._read_directory(start, length)
        except (struct.error, UnicodeDecodeError) as err:
            raise ValueError(f"damaged archive: {err}") from err

    def _read_directory(self, start: int, length: int) -> None:
        mapped, end = self._mapped, start + length
        if mapped[end - 22:end - 18] != b"PK\x05\x06":  # no end record there (or a comment)
            raise ValueError("no end-of-central-directory record at the item's end")
        count, cd_size, cd_offset = struct.unpack_from("<HII", mapped, end - 12)
        if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
            if length < 42 or mapped[end - 42:end - 38] != b"PK\x06\x07":
                raise ValueError("zip64 end record without its locator")
            (z64,) = struct.unpack_from("<Q", mapped, end - 34)
            if z64 + 56 > length or mapped[start + z64:start + z64 + 4] != b"PK\x06\x06":
                raise ValueError("zip64 end record outside the item")
            count, cd_size, cd_offset = struct.unpack_from("<QQQ", mapped, start + z64 + 32)
        at, prefix = start + cd_offset, None
        for _ in range(count):
            if at + 46 > end or mapped[at:at + 4] != b"PK\x01\x02":
                raise ValueError("damaged central directory")
            method, = struct.unpack_from("<H", mapped, at + 10)
            size, usize, name_len, extra_len, comment_len = struct.unpack_from("<IIHHH", mapped, at + 20)
            local, = struct.unpack_from("<I", mapped, at + 42)
            if method != 0 or size != usize or 0xFFFFFFFF in (size, local):
                raise ValueError("a compressed or zip64-sized record")
            folder, slash, name = bytes(mapped[at + 46:at + 46 + name_len]).decode().partition("/")
            # torch's reader wants every record in one folder and reads the first of two equal
            # names: anything else is left to it rather than guessed at.
            if not slash or prefix not in (None, folder) or name in self._records:
                raise ValueError("records outside one folder, or a name twice")
            prefix = folder
            at += 46 + name_len + extra_len + comment_len
            header = start + local
            if local + 30 > length or mapped[header:header + 4] != b"PK\x03\x04":
                raise ValueError("a record's local header is outside the item")
            local_name, local_extra = struct.unpack_from("<HH", mapped, header + 26)
            data = local + 30 + local_name + local_extra
            if data + size > length:
                raise ValueError("a record runs past the item's end")
            self._records[name] = (data, size)

    def get_all_records(self) -> list[str]:
        return list(self._records)

    def has_record(self, name: str) -> bool:
        return name in self._records

    def get_record(self, name: str) -> bytes:
        offset, size = self._records[name]
        return bytes(self._mapped[self._start + offset:self._start + offset + size])

    def get_record_offset(self, name: str) -> int:
        """Bytes from the archive's start to the record's data."""
        return self._records[name][0]

    def get_record_size(self, name: str) -> int:
        return self._records[name][1]


def _mapped_or_loaded(archive, view, mapped, start: int, layouts: dict[bytes, tuple | None]) -> torch.Tensor:
    """The tensor of one ``torch.save`` archive at byte ``start`` of the ``mapped`` file: a view
    into the mapping at its ``data/0`` record, laid out as its ``data.pkl`` says. The first
    archive with given ``data.pkl`` bytes is loaded onto the meta device
    (``torch.load(weights_only=True)``, which then reads no data) for the layout, kept in
    ``layouts`` for the others. Only plain tensors' layouts are kept: a conjugate or negative
    bit, a quantizer or a subclass is part of the pickle, not of the bytes, and such an archive
    is read by ``torch.load`` onto the CPU."""
    key = archive.get_record("data.pkl")
    if key not in layouts:
        # The layout alone: on the meta device torch.load reads data.pkl and not the data.
        view.seek(0)
        try:
            meta = torch.load(view, map_location="meta", weights_only=True)
        except Exception:  # noqa: BLE001 - anything it cannot place on meta is torch.load's to read below
            meta = None
        plain = (type(meta) is torch.Tensor and not meta.is_conj() and not meta.is_neg() and not meta.is_quantized
                 and meta.untyped_storage().nbytes() == archive.get_record_size("data/0") > 0)
        # None: archives with this pickle are torch.load's to read, without asking again.
        layouts[key] = (meta.dtype, meta.size(), meta.stride(), meta.storage_offset(),
                        meta.untyped_storage().nbytes()) if plain else None
    layout = layouts[key]
    if layout is not None and archive.get_record_size("data/0") == layout[-1]:
        dtype, size, stride, storage_offset, nbytes = layout
        with warnings.catch_warnings():  # read-only mapping: the view is only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes,
                                    offset=start + archive.get_record_offset("data/0"))
        return flat.view(dtype).as_strided(size, stride, storage_offset)
    view.seek(0)
    return torch.load(view, map_location="cpu", weights_only=True)


def is_dcp_checkpoint(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def _model_and_optimizer_state(part: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``part``'s state dict without frozen parameters, and its optimizer's, from one
    ``get_state_dict`` (one pass over the module tree for both: 8 ms of SmolLM2-135M's load).
    DCP's ``ignore_frozen_params`` misses the second name of a tied weight (``lm_head.weight``
    tied to a frozen embedding), so every alias is filtered here."""
    frozen = {name for name, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
    model, optim = get_state_dict(part, optimizer, options=OPTIONS)
    return {k: v for k, v in model.items() if k not in frozen}, optim


def _aliases(part: nn.Module) -> dict[str, str]:
    """{second name: first name} of every parameter ``part`` holds under two names (a tied
    output embedding: ``lm_head.weight`` is ``model.embed_tokens.weight``), in state-dict names.
    Found by parameter identity, so every data-parallel rank finds the same ones."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    first: dict[int, str] = {}
    aliases = {}
    for name, param in part.named_parameters(remove_duplicate=False):
        (fqn,) = _get_fqns(part, name)
        if id(param) in first and fqn != first[id(param)]:
            aliases[fqn] = first[id(param)]
        first.setdefault(id(param), fqn)
    return aliases


class _State(NamedTuple):
    """What :func:`save` writes and :func:`load` reads, built from the live parts."""

    tensors: dict  # {"model": ..., "optimizer": ...}: what DCP saves and loads
    hyper: dict  # the optimizer hyperparameters left out (_HYPERPARAMETERS)
    aliases: dict  # {alias: name} of the tied weights held once
    owned: list[set[str]]  # each part's model-state names in ``tensors["model"]``


def _state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> _State:
    """The state of ``parts`` and their ``optimizers`` as DCP sees it.

    A tied weight is written and read under its first name only: writing it under both (DCP
    would) costs the embedding again, 108 MiB of SmolLM2-135M's 1.6 GiB, on every save and load."""
    model: dict = {}
    optim: dict = {}
    aliases: dict = {}
    owned = []
    for part, opt in zip(parts, optimizers):
        own, optimizer_state = _model_and_optimizer_state(part, opt)
        mine = {alias: name for alias, name in _aliases(part).items() if alias in own and name in own}
        kept = {k: v for k, v in own.items() if k not in mine}
        model.update(kept)
        owned.append(set(kept))
        aliases.update(mine)
        optim.update(optimizer_state)
    hyper = {k: optim.pop(k) for k in [k for k in optim if k.startswith(_HYPERPARAMETERS)]}
    return _State({"model": model, "optimizer": optim}, hyper, aliases, owned)


_checkpoint_group = None


def _background_group():
    """A gloo process group of its own for background saves: their collectives run in DCP's
    writer thread while the training loop makes its own on the default group, and two threads
    must never interleave calls on one group."""
    global _checkpoint_group
    import torch.distributed as dist

    if _checkpoint_group is None and distributed.is_initialized():
        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


@contextlib.contextmanager
def _single_process_is_intended():
    """DCP warns when it runs without a process group; for one process that is the intent. (A
    background save warns from its writer thread, after this context has ended: the module-wide
    filter below covers that one.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextlib.contextmanager
def _one_thread():
    """Tensor copies on one intra-op thread. A checkpoint copies a thousand tensors or more
    (SmolLM2-135M: 1,089), each a fork/join over the OpenMP pool; on a busy host a descheduled
    pool thread stalls every one of them: loading SmolLM2-135M's state took 6.4 s on 2 threads
    and 2.3 s on one (2 shared cores). A copy is bound by memory bandwidth, which one thread
    nearly fills."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_staging: dict = {}  # the host copy background saves write from: {"layout": ..., "state": ...}


def _stage(state: dict) -> dict:
    """``state`` copied into host buffers kept from the previous background save (allocated
    on the first, or when the layout changed). Fresh buffers each time cost a page fault per
    page: staging SmolLM2-135M's 1.6 GiB took 9 s that way on 2 shared cores. The buffers hold
    12 bytes per trained parameter between saves; the caller finishes the previous background
    write before staging the next (:meth:`llmtrain.checkpoint.protocol.CheckpointManager.save`)."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    def layout(tree):
        return {k: layout(v) if isinstance(v, dict) else
                (tuple(v.shape), v.dtype, type(v).__name__) if isinstance(v, torch.Tensor) else type(v).__name__
                for k, v in tree.items()}

    shape = layout(state)
    with _one_thread():
        if _staging.get("layout") != shape:
            _staging.clear()
            _staging.update(layout=shape, state=_create_cpu_state_dict(state))
        return _copy_state_dict(state, _staging["state"])


class _AlreadyStaged:
    """DCP's stager protocol for a state dict :func:`_stage` already copied to host memory."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], scheduler,
         is_main: bool, background: bool = False, storage_writer=None):
    """Write model parts, their optimizers and the LR scheduler into ``directory``. Collective.

    ``background``: copy the state to host memory now (:func:`_stage`) and write it in a
    thread (DCP ``async_save``); returns the future that completes when this rank's files are
    written (None for a synchronous save). The LR scheduler's small file is written at once.
    Files go through :func:`writer` (checksummed as written) unless ``storage_writer`` is given.
    """
    directory.mkdir(parents=True, exist_ok=True)
    built = _state(parts, optimizers)
    state = built.tensors
    if built.aliases:  # for readers of the whole checkpoint (consolidated_model); a resume does not need it
        state = {**state, _ALIASES: built.aliases}
    future = None
    try:
        with _single_process_is_intended():
            if background:
                future = dcp.async_save(_stage(state), checkpoint_id=str(directory), process_group=_background_group(),
                                        storage_writer=storage_writer or dcp_writer.fault_writer(directory) or dcp_writer.writer(directory),
                                        async_stager=_AlreadyStaged(), planner=plan_cache.CachedSavePlanner())
                future.add_done_callback(lambda done: done.exception() is not None and plan_cache.drop_plan_cache())
            else:
                # Training waits for this one, so it may take the cores; a background save keeps
                # one writer thread, as the training step needs them.
                dcp.save(state, checkpoint_id=str(directory),
                         storage_writer=storage_writer or dcp_writer.writer(directory, threads=dcp_writer.writer_threads()),
                         planner=plan_cache.CachedSavePlanner())
    except BaseException as err:
        plan_cache.drop_plan_cache()
        cause = None if isinstance(err, (KeyboardInterrupt, SystemExit)) else dcp_writer.write_error(directory, err)
        if cause is not None:
            full = cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
            fix = ("free space there (a checkpoint takes about 12 bytes per trained parameter: docs/checkpoints.md#checkpoints-and-resume, Disk use)"
                   if full else "make the folder writable") + " or set run_dir elsewhere"
            raise OSError(cause.errno, f"writing the checkpoint into {directory} failed: {cause.strerror} "
                          f"({cause.filename or 'a DCP data file'}); {fix}") from err
        raise
    if is_main:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    return future


def load(directory: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], schedulers) -> None:
    """Load what :func:`save` wrote, by any layout, into this layout. Collective.

    Raises:
        ResumeError: the checkpoint lacks tensors this model needs or their shapes differ.
    """
    from llmtrain.common.errors import ResumeError

    # A checkpoint from before tied weights were written once holds the alias too; it is not read.
    built = _state(parts, optimizers)
    state = built.tensors
    try:
        with _single_process_is_intended(), _one_thread():
            dcp.load(state, checkpoint_id=str(directory), storage_reader=_MappedReader(str(directory)))
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException (per-rank errors) is a BaseException
        raise ResumeError(f"checkpoint {directory.parent} does not fit this model/optimizer: {err}") from err
    with _one_thread():
        for part, opt, own in zip(parts, optimizers, built.owned):
            # DCP loaded in place where the state dict's tensor is the parameter itself (plain
            # tensors, FSDP2's sharded DTensors): copying it onto itself again would cost a pass
            # over the weights. The others (copies the state dict made) are set.
            live = {_storage(p) for p in part.parameters()}
            rest = {k: state["model"][k] for k in own if _storage(state["model"][k]) not in live}
            if rest:
                set_model_state_dict(part, rest, options=LOAD_OPTIONS)
            set_optimizer_state_dict(part, opt, optim_state_dict={**state["optimizer"], **built.hyper}, options=OPTIONS)
    saved = torch.load(directory / "scheduler.pt", weights_only=True)
    for scheduler in schedulers:
        scheduler.load_state_dict(saved)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's local data (a DTensor's shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.data_ptr(), local.untyped_storage().nbytes()


def consolidated_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict from a DCP engine folder, in one process (export, tests)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/full.pt")
        full = torch.load(f"{tmp}/full.pt", weights_only=True)
    model = full["model"]
    model.update({alias: model[name] for alias, name in full.get(_ALIASES, {}).items()})
    return model
