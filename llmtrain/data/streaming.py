"""``data.streaming=true``: sources read as streams of records (``datasets.load_dataset(...,
streaming=True)``), never whole: local or ``s3://`` JSON/JSONL/Parquet/CSV/text files and
folders, ``save_to_disk`` folders, Hub ids (where there is network).

Addressing is the map-style data's (:mod:`~llmtrain.data.order`): optimizer step ``s`` trains on
global samples ``[s*B, (s+1)*B)``, each rank on its contiguous slice. A source's stream yields its
samples in file order; its first ``data.val_samples`` samples are held out for validation (read
once at start-up) and the rest are its training samples, epoch after epoch, each epoch through a
buffer of ``data.shuffle_buffer`` samples shuffled by a generator seeded with ``(seed, epoch)``
(``data.shuffle=false``: file order). Training sample ``j`` of a source is therefore a function of
the files, the seed and the settings only. Every rank reads the whole stream and keeps its own
slices, so the samples of a step do not depend on the number of ranks, and the position of a run
is the one integer every checkpoint holds (``consumed_samples``): a resume at step ``s`` reads
forward to global sample ``s*B`` (re-reading, not training on, the samples before it) and
continues exactly, on any number of ranks. A mixture draws the source of ``g`` as
:class:`~llmtrain.data.order.MixtureOrder` does (the same seeded blocks), and the ``j``-th draw of
source ``k`` is that source's training sample ``j``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from llmtrain.common.errors import DataError
import llmtrain.data.remote as remote
from llmtrain.config.schema import canonical_format
from llmtrain.data.formats import encoder, fit_to_length
from llmtrain.data.order import MixtureOrder
from llmtrain.data.sources import (RECORD_BUILDERS, column, explain_error, file_kind, is_saved_dataset,
                                   looks_like_local_path, source_files)
from llmtrain.data.tokens import TokenBlocks

log = logging.getLogger("llmtrain")
# The formats a stream can feed: samples made from one record (or a run of documents) at a time.
STREAMED_FORMATS = ("text", "instruction", "chat", "prompt_completion")


def buffered_shuffle(items: Iterable[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """``items`` through a shuffle buffer of ``size``: once full, each new item replaces a random
    slot, whose item is yielded; at the end the rest are yielded in a random order. The algorithm
    of ``datasets``' ``IterableDataset.shuffle`` (``BufferShuffledExamplesIterable``), here over
    encoded samples, after the held-out ones, and seeded per epoch by the caller."""
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        i = int(rng.integers(0, size))
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer


def _files_of(src: Any, key: str) -> list[str]:
    """The files a source streams, in a deterministic order: local files as the map-style reader
    picks them, or the objects under an ``s3://`` URL (one object, or a prefix's record files)."""
    if not remote.is_url(src.path):
        return [str(f) for f in source_files(src, key)]
    remote.refuse_unsupported(str(src.path), f"{key}.path")
    url = str(src.path).rstrip("/")
    fs = remote.filesystem()
    if remote.call(lambda: fs.isfile(url), url, f"{key}.path"):
        return [url]
    found = remote.call(lambda: fs.find(url), url, f"{key}.path")
    kinds = ("", ".txt") if src.format == "text" else tuple(RECORD_BUILDERS)
    files = sorted(f"s3://{f}" for f in found if file_kind(Path(f)) in kinds or
                   (src.format == "text" and Path(f).match(src.glob)))
    if not files:
        raise DataError(f"{key}.path: no files to stream under {url}")
    return files


def open_records(src: Any, key: str) -> Any:
    """The records of a source as a ``datasets.IterableDataset`` (each iteration reads from the
    start). Plain-text files give one record ``{"text": file}`` per file, as the map-style reader does.

    Raises:
        DataError: the path does not exist, holds nothing to read, or the Hub cannot be reached.
    """
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()
    path = None if src.path is None else str(src.path)
    if path is not None and not remote.is_url(path) and not Path(path).expanduser().exists() \
            and not looks_like_local_path(path):
        try:
            return datasets.load_dataset(path, name=src.subset, split=src.split, revision=src.revision, streaming=True)
        except Exception as err:  # noqa: BLE001 - offline, no such dataset: one line
            raise DataError(f"{key}.path={path!r}: streaming the Hub dataset failed: {explain_error(err)}") from err
    if path is not None and not remote.is_url(path) and Path(path).expanduser().is_dir() \
            and is_saved_dataset(Path(path).expanduser()):
        saved = datasets.load_from_disk(str(Path(path).expanduser()))
        return (saved[src.split] if hasattr(saved, "keys") else saved).to_iterable_dataset()
    files = _files_of(src, key)
    kinds = {file_kind(Path(f)) for f in files}
    builders = {RECORD_BUILDERS.get(k, "text") for k in kinds}
    if len(builders) > 1:
        raise DataError(f"{key}.path: {path} mixes file formats ({', '.join(sorted(kinds))}); stream one format "
                        "per source (a mixture: data.datasets)")
    builder = builders.pop()
    kwargs = {"sample_by": "document", "encoding_errors": "replace" if path is None else "strict"} \
        if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)


def _first_columns(records: Any, src: Any, key: str) -> SimpleNamespace:
    """Stands for a record table in :func:`~llmtrain.data.formats.encoder`'s column checks: the
    columns of the stream's first record."""
    first = next(iter(records.take(1)), None)
    if first is None:
        raise DataError(f"{key}.path: {src.path} holds no records")
    return SimpleNamespace(column_names=list(first))


def record_samples(records: Any, src: Any, key: str, data_cfg: Any, tokenizer: Any,
                   counts: dict) -> Callable[[], Iterator[dict]]:
    """A function giving, at each call, a fresh iterator over the source's samples in file order:
    records encoded as the map-style reader encodes them (:func:`~llmtrain.data.formats.encoder`,
    :func:`~llmtrain.data.formats.fit_to_length`); dropped records are counted in ``counts``."""
    where = f"{key}.path: {src.path}"
    cap = src.max_records
    if canonical_format(src.format) == "text":
        return _text_samples(records, src, key, data_cfg, tokenizer, where, cap)
    encode = encoder(_first_columns(records, src, key), src, data_cfg, tokenizer, key, where)
    seq_len, drop_long = data_cfg.seq_len, data_cfg.truncation == "drop"

    def samples() -> Iterator[dict]:
        for i, rec in enumerate(itertools.islice(records, cap)):
            ids, labels, outcome = fit_to_length(encode(rec, i), seq_len, drop_long)
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome in ("kept", "truncated"):
                yield {"input_ids": ids, "labels": labels}
    return samples


def _text_samples(records: Any, src: Any, key: str, data_cfg: Any, tokenizer: Any, where: str,
                  cap: int | None) -> Callable[[], Iterator[dict]]:
    """Documents tokenized, each followed by EOS, joined and cut into blocks of ``seq_len`` (the
    last partial block of an epoch is dropped): the blocks of the map-style token cache, in order."""
    name = column(_first_columns(records, src, key), src, "text", key, "text", where)
    eos, seq_len = tokenizer.eos_token_id, data_cfg.seq_len

    def samples() -> Iterator[dict]:
        pending: list[int] = []
        for i, rec in enumerate(itertools.islice(records, cap)):
            text = rec[name]
            if not isinstance(text, str):
                raise DataError(f"{where} record {i}: field {name!r} must be a string")
            if not text.strip():
                continue
            pending += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            while len(pending) >= seq_len:
                block = np.asarray(pending[:seq_len], dtype=np.int64)
                del pending[:seq_len]
                yield TokenBlocks(block, seq_len, [0], eos, data_cfg.document_masking)[0]
    return samples


class SourceStream:
    """One streamed source's samples: the first ``held_out`` for validation (:attr:`val`), the rest
    its training samples, addressed by ``j`` over epochs (:meth:`__getitem__`, forward only)."""

    def __init__(self, samples: Callable[[], Iterator[dict]], held_out: int, seed: int, shuffle: bool,
                 buffer: int, where: str):
        self.samples, self.held_out, self.where = samples, held_out, where
        self.seed, self.shuffle, self.buffer = seed, shuffle, buffer
        self.val = list(itertools.islice(samples(), held_out))
        if len(self.val) < held_out:
            raise DataError(f"{where}: the stream gives {len(self.val)} sample(s), fewer than data.val_samples="
                            f"{held_out} to hold out and at least one to train on; lower data.val_samples")
        self.epoch, self.given, self._iter, self._epoch_start = -1, 0, None, 0
        self.epoch_size: int | None = None

    def _open(self, epoch: int) -> None:
        train = itertools.islice(self.samples(), self.held_out, None)
        if self.shuffle:
            train = buffered_shuffle(train, self.buffer, np.random.default_rng([self.seed, epoch]))
        self.epoch, self._iter, self._epoch_start = epoch, train, self.given

    def __getitem__(self, j: int) -> dict:
        """Training sample ``j`` (``j`` >= every index asked before: the stream reads forward,
        passing over the samples between)."""
        if j < self.given:
            raise IndexError(f"{self.where}: training sample {j} was passed already (the stream reads forward)")
        if self._iter is None:
            if j > 0:  # a resume: the samples before it are read again, not trained on
                log.info("%s: resuming the stream at training sample %d (reading past the %d before it)",
                         self.where, j, j)
            self._open(0)
        while True:
            sample = next(self._iter, None)
            if sample is None:
                if self.given == self._epoch_start:
                    raise DataError(f"{self.where}: the stream holds no training sample after the {self.held_out} "
                                    "held out (data.val_samples); lower data.val_samples or add data")
                self.epoch_size = self.given - self._epoch_start
                self._open(self.epoch + 1)
                continue
            self.given += 1
            if self.given - 1 == j:
                return sample


class StreamOrder:
    """The global sample order of a stream: ``g`` maps to itself (the stream itself is the order);
    a mixture's :meth:`source_of` is :class:`~llmtrain.data.order.MixtureOrder`'s."""

    def __init__(self, mixture: MixtureOrder | None):
        self.mixture = mixture

    def __getitem__(self, g: int) -> int:
        return g

    def source_of(self, g: int) -> int:
        return 0 if self.mixture is None else self.mixture.source_of(g)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, that source's training sample index) of global sample ``g``."""
        return (0, g) if self.mixture is None else self.mixture._locate(g)


class StreamedTrain(torch.utils.data.Dataset):
    """The training samples of streamed sources by global sample index, read forward (the
    :class:`~llmtrain.data.order.StepBatchSampler` asks a rank's indices in increasing order)."""

    def __init__(self, streams: list[SourceStream], order: StreamOrder):
        self.streams, self.order = streams, order

    def __getitem__(self, g: int) -> dict:
        k, j = self.order.locate(g)
        return self.streams[k][j]


def load_streams(data_cfg: Any, tokenizer: Any, seed: int) -> tuple[StreamedTrain, list[list[dict]], dict]:
    """Open every configured source as a stream: (training samples, each source's held-out
    samples, stats per source name).

    Raises:
        DataError: a source that cannot be read or gives too few samples.
    """
    sources = list(data_cfg.datasets) or [data_cfg]
    keys = [f"data.datasets.{i}" for i in range(len(sources))] if data_cfg.datasets else ["data"]
    mixture = len(sources) > 1
    streams, stats = [], {}
    for k, (src, key) in enumerate(zip(sources, keys)):
        counts: dict = {}
        samples = record_samples(open_records(src, key), src, key, data_cfg, tokenizer, counts)
        # A mixture's sources are shuffled as MixtureOrder seeds their map-style orders.
        stream = SourceStream(samples, data_cfg.val_samples, seed + 7919 * (k + 1) if mixture else seed,
                              data_cfg.shuffle, data_cfg.shuffle_buffer, f"{key}.path: {src.path}")
        streams.append(stream)
        stats[src.name] = {"streamed": str(src.path), "held_out": len(stream.val), "counts": counts}
    order = StreamOrder(MixtureOrder([0] * len(sources), list(data_cfg.weights), seed, data_cfg.shuffle)
                        if mixture else None)
    return StreamedTrain(streams, order), [s.val for s in streams], stats


def describe_stream(name: str, s: dict, data_cfg: Any) -> str:
    """The start-up line of a streamed source."""
    how = (f"shuffled by a buffer of {data_cfg.shuffle_buffer} samples" if data_cfg.shuffle else "in file order")
    return (f"data {name}: streamed from {s['streamed']} ({s['held_out']} samples held out for validation; training "
            f"samples read as the run goes, {how})")
