"""The deterministic global sample order shared by all ranks, and batching.

Samples are addressed by a global sample index ``g``; epoch ``g // N`` visits the training set
in a permutation drawn from ``seed + epoch``. A mixture first draws the source of ``g`` from the
weights (blocks of draws seeded by ``(seed, block)``), then takes that source's next sample in
its own epoch-wise order. Optimizer step ``s`` consumes global samples ``[s * B, (s + 1) * B)``
(``B`` = global batch), split into contiguous per-rank and per-micro-batch slices. The order
therefore depends on the seed and the global batch only, never on the number of ranks, and
resuming needs one integer: the number of samples consumed.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from llmtrain.common.labels import IGNORE_INDEX


class GlobalSampleOrder:
    """Maps a global sample index to a training-set index: epoch-wise permutations from the seed.

    ``g -> perm(seed + g // n)[g % n]``; without shuffling, ``g -> g % n``. The permutation is
    kept as one int32 tensor (4 bytes per sample).
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool):
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __getitem__(self, g: int) -> int:
        epoch, pos = divmod(g, self.num_samples)
        if not self.shuffle:
            return pos
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            # int32 halves the memory of a large corpus's permutation; the values equal int64's.
            dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=gen, dtype=dtype)
        return int(self._perm[pos])

    def source_of(self, g: int) -> int:
        return 0


class MixtureOrder:
    """Global sample index -> index into the concatenation of several sources' training sets.

    The source of ``g`` is draw ``g % 4096`` of block ``g // 4096``, drawn from ``weights`` by a
    generator seeded with ``(seed, block)``; if it is the ``j``-th draw of source ``k`` overall,
    the sample is ``offsets[k] + order_k[j]``, where ``order_k`` is source ``k``'s own
    :class:`GlobalSampleOrder` (seed ``seed + 7919 * (k + 1)``). A source with a small weight
    repeats (new epochs) only when its own samples run out.
    """

    BLOCK = 4096

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool):
        self.sizes, self.seed = list(sizes), seed
        total = float(sum(weights))
        self.p = np.asarray([w / total for w in weights], dtype=np.float64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.orders = [GlobalSampleOrder(n, seed + 7919 * (k + 1), shuffle) for k, n in enumerate(self.sizes)]
        self._counts_before = [np.zeros(len(self.sizes), dtype=np.int64)]  # per block: draws of each source before it
        self._cached_block, self._cached = -1, np.empty(0)
        # The prefetch thread maps indices while the step's thread counts sources (source_of): the
        # caches above are updated under this lock.
        self._lock = threading.RLock()

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    def _draws(self, block: int) -> np.ndarray:
        if block != self._cached_block:
            rng = np.random.default_rng([self.seed, block])
            self._cached_block, self._cached = block, rng.choice(len(self.sizes), size=self.BLOCK, p=self.p)
        return self._cached

    def _locate(self, g: int) -> tuple[int, int]:
        with self._lock:
            return self._locate_unlocked(g)

    def _locate_unlocked(self, g: int) -> tuple[int, int]:
        block, pos = divmod(g, self.BLOCK)
        while len(self._counts_before) <= block:
            b = len(self._counts_before) - 1
            self._counts_before.append(self._counts_before[b] + np.bincount(self._draws(b), minlength=len(self.sizes)))
        draws = self._draws(block)
        source = int(draws[pos])
        return source, int(self._counts_before[block][source] + np.count_nonzero(draws[:pos] == source))

    def source_of(self, g: int) -> int:
        """The source (index into the mixture's ``datasets``) of global sample ``g``."""
        return self._locate(g)[0]

    def counts_before(self, g: int) -> list[int]:
        """Samples each source has given to global samples ``[0, g)`` (all ranks, all steps)."""
        with self._lock:
            block, pos = divmod(g, self.BLOCK)
            self._locate_unlocked(g)  # extends the per-block counts up to g's block
            draws = self._draws(block)
            return [int(self._counts_before[block][k] + np.count_nonzero(draws[:pos] == k)) for k in range(len(self.sizes))]

    def __getitem__(self, g: int) -> int:
        source, j = self._locate(g)
        return int(self.offsets[source]) + self.orders[source][j]


class StepBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices), step after step.

    Step ``s`` covers global samples ``[s*B, (s+1)*B)``; rank ``r`` takes the contiguous slice
    ``[s*B + r*m*a, s*B + (r+1)*m*a)`` as ``a`` micro-batches of ``m`` (m = micro-batch,
    a = gradient accumulation, B = m*a*world). Starts at ``start_step`` (resume).
    """

    def __init__(self, order: Any, micro_batch: int, accumulation: int, rank: int,
                 world_size: int, start_step: int, max_steps: int):
        self.order, self.m, self.a = order, micro_batch, accumulation
        self.rank, self.world = rank, world_size
        self.start_step, self.max_steps = start_step, max_steps

    @property
    def global_batch(self) -> int:
        return self.m * self.a * self.world

    def global_indices(self, step: int) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches in optimizer step ``step``."""
        first = step * self.global_batch + self.rank * self.m * self.a
        return [list(range(first + k * self.m, first + (k + 1) * self.m)) for k in range(self.a)]

    def source_counts(self, step: int, num_sources: int) -> list[int]:
        """Samples of each mixture source in the whole global batch of ``step`` (all ranks)."""
        counts = [0] * num_sources
        for g in range(step * self.global_batch, (step + 1) * self.global_batch):
            counts[self.order.source_of(g)] += 1
        return counts

    def source_totals(self, step: int) -> list[int]:
        """Samples each mixture source has given up to the end of ``step`` (all ranks)."""
        mixture = getattr(self.order, "mixture", self.order)  # a stream's order holds its MixtureOrder
        return mixture.counts_before((step + 1) * self.global_batch)

    def source_metrics(self, step: int, names: list[str]) -> dict[str, int]:
        """A mixture's per-source records of ``step``: ``data/source/NAME_samples`` (this step's
        global batch) and ``data/source/NAME_total`` (up to its end); every rank knows the
        global order, so no collective is needed."""
        counts, totals = self.source_counts(step, len(names)), self.source_totals(step)
        return {**{f"data/source/{name}_samples": n for name, n in zip(names, counts)},
                **{f"data/source/{name}_total": n for name, n in zip(names, totals)}}

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            for micro in self.global_indices(step):
                yield [self.order[g] for g in micro]

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.a


class StepBatches:
    """The trainer's batch source for objectives that read their batches from the data: each
    optimizer step takes ``accumulation`` micro-batches from ``loader`` (this rank's iterator),
    each passed through ``prepare`` (the objective's). An online objective's source is its rollout
    (:class:`llmtrain.rollout.rollout.Rollout`), with the same :meth:`for_step`."""

    def __init__(self, loader: Iterator[dict], accumulation: int, prepare: Callable[[dict], dict]):
        self.loader, self.accumulation, self.prepare = loader, accumulation, prepare

    def for_step(self, step: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Optimizer step ``step``'s host micro-batches, and no metrics of their own."""
        return [self.prepare(next(self.loader)) for _ in range(self.accumulation)], {}


class Collator:
    """Pads a micro-batch to its longest sample (right padding).

    Returns ``input_ids``, ``labels``, ``attention_mask``: int64 tensors of shape
    ``[micro_batch, longest]``; padded positions get ``pad_id`` / -100 / 0. Packed samples (with
    ``position_ids``) also get ``position_ids``, padding counted as one more sequence from 0, so
    the model's packed-sequence attention keeps every sample to itself.
    """

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        packed = "position_ids" in samples[0]
        positions = torch.zeros((len(samples), longest), dtype=torch.long) if packed else None
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.as_tensor(s["input_ids"])
            labels[i, :n] = torch.as_tensor(s["labels"])
            mask[i, :n] = 1
            if positions is not None:
                positions[i, :n] = torch.as_tensor(s["position_ids"])
                positions[i, n:] = torch.arange(longest - n)
        batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if positions is not None:
            batch["position_ids"] = positions
        return batch


def pack(lengths: Sequence[int], seq_len: int, window: int = 64) -> list[list[int]]:
    """Group samples into rows of at most ``seq_len`` tokens: first fit over the ``window`` most
    recently opened rows, in sample order (deterministic, O(n * window)).

    Returns:
        Rows as lists of sample indices.
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        for r in range(max(0, len(rows) - window), len(rows)):
            if free[r] >= n:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    return rows


def packed_samples(samples: Any, seq_len: int) -> Any:
    """Rows of packed samples (``input_ids``, ``labels``, ``position_ids``) as a
    ``datasets.Dataset``. Positions restart at 0 for each sample, and each sample's first label is
    -100, as it is unpacked (no token predicts across a sample boundary). Image-text samples
    (an ``images`` column of image references) give each row its members' images in row order,
    the order of their image tokens, which is how the model's forward pairs features with tokens."""
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    all_ids, all_labels = samples["input_ids"], samples["labels"]
    all_images = samples["images"] if "images" in samples.column_names else None
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    if all_images is not None:
        out["images"] = []
    for members in pack([len(ids) for ids in all_ids], seq_len):
        ids, labels, positions, images = [], [], [], []
        for i in members:
            ids += all_ids[i]
            labels += [IGNORE_INDEX] + all_labels[i][1:]
            positions += range(len(all_ids[i]))
            images += all_images[i] if all_images is not None else []
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["position_ids"].append(positions)
        if all_images is not None:
            out["images"].append(images)
    return datasets.Dataset.from_dict(out)


def sample_digest(batches: list[dict[str, torch.Tensor]]) -> float:
    """Order-free fingerprint of the samples in ``batches``: sum of CRC32s of their real tokens
    (``input_ids`` where ``attention_mask`` is set), so a step's digest summed over ranks says
    which samples the global batch held, whatever their split. Packed rows that say which
    sequence each token is (``position_ids`` and ``segment``) count each sequence on its own, so
    packing does not change the digest."""
    total = 0
    for b in batches:
        segments = b["segment"] if "position_ids" in b and "segment" in b else None
        for r, (row, mask) in enumerate(zip(b["input_ids"], b["attention_mask"].bool())):
            if segments is None:
                total += zlib.crc32(row[mask].numpy().tobytes())
                continue
            for segment in torch.unique(segments[r][mask]).tolist():
                total += zlib.crc32(row[mask & (segments[r] == segment)].numpy().tobytes())
    return float(total)
