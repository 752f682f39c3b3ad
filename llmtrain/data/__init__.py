"""Training data: sources read through ``datasets``, formats encoded into samples, and the
deterministic global sample order shared by all ranks.

A *sample* is one training sequence: a block of ``seq_len`` tokens (``text``, ``tokens``), one
encoded record (``instruction``, ``chat``, ``prompt_completion``), or a row of several packed
records (``packing``). Modules, one job each:

* :mod:`~llmtrain.data.sources`: files, folders, ``save_to_disk`` folders, Hub ids -> records.
* :mod:`~llmtrain.data.formats`: records -> samples (chat templates, label masks, truncation).
* :mod:`~llmtrain.data.tokens`: token folders read without loading them (``llmtrain.prepare``; text cache).
* :mod:`~llmtrain.data.order`: global sample order, mixtures, packing, batching.
* :mod:`~llmtrain.data.streaming`: ``data.streaming=true``: sources read as streams, by global sample index.
* :mod:`~llmtrain.data.vision`: image-text conversations (TRL's vision layout) and their collator.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from llmtrain.data.formats import (ALPACA_PROMPT, apply_template_setting, end_of_turn,  # noqa: F401
                                   end_token_ids, encode_records, prompt_and_response, uses_chat_template)
from llmtrain.data.order import (Collator, GlobalSampleOrder, MixtureOrder, StepBatches, StepBatchSampler,  # noqa: F401
                                 pack, packed_samples)
from llmtrain.data.prefetch import Feed  # noqa: F401
from llmtrain.data.sources import (RECORD_BUILDERS, capped_text, check_compressed, column, explain_error,  # noqa: F401
                                   file_kind, is_saved_dataset, load_hub, load_records, looks_like_local_path,
                                   record_errors, refuse_records_as_text, source_files, Where)
from llmtrain.data.preference import (PackedPairs, PairCollator, WithReference, encode_examples,  # noqa: F401
                                     encode_pairs, pairs_of)
from llmtrain.data import remote
from llmtrain.data.prompts import PromptCollator, encode_prompts
from llmtrain.data.vision import (ImageCollator, apply_pixel_budget, encode_image_records, images_column,
                                  refuse_image_pairs, refuse_packing)
from llmtrain.data.tokens import MANIFEST, Complement, TokenBlocks, num_blocks, open_tokens, tokenizer_fingerprint, write_token_folder
from llmtrain.common.errors import ConfigError, DataError
from llmtrain.common.images import processor_of
from llmtrain.common.labels import IGNORE_INDEX  # noqa: F401  (public here too)
from llmtrain.common.paths import CACHE_DIR
from llmtrain.config.schema import mapped_columns
from llmtrain.parallel import distributed

log = logging.getLogger("llmtrain")
TOKEN_CACHE = CACHE_DIR / "tokens"


class Concat(torch.utils.data.Dataset):
    """Several datasets indexed as one (a mixture's sources, in ``data.datasets`` order)."""

    def __init__(self, parts: list[Any]):
        self.parts = parts
        self.offsets = [0]
        for part in parts:
            self.offsets.append(self.offsets[-1] + len(part))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> dict:
        k = bisect.bisect_right(self.offsets, i) - 1
        return self.parts[k][i - self.offsets[k]]


@dataclass
class Splits:
    """Training and validation samples. A sample is a dict with ``input_ids`` and ``labels``
    (length <= seq_len, -100 where no loss is taken) and, when packed, ``position_ids``.
    ``names``/``sizes``/``weights`` describe the sources (one entry unless a mixture)."""

    train: Any
    val: Any
    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    streaming: bool = False

    def order(self, seed: int, shuffle: bool):
        """The global sample order over ``train`` (:class:`MixtureOrder` for several sources; a
        stream's own, :class:`~llmtrain.data.streaming.StreamOrder`)."""
        if self.streaming:
            return self.train.order
        if len(self.sizes) > 1:
            return MixtureOrder(self.sizes, self.weights, seed, shuffle)
        return GlobalSampleOrder(len(self.train), seed, shuffle)


def _on_main_first(build: Callable[[], Any]) -> Any:
    """Run ``build()`` on rank 0 first (it fills the caches), then on one rank per other node,
    then on the rest, which find the caches built. A DataError on rank 0 is sent to every rank,
    so all of them fail with the same message."""
    import os

    import torch.distributed as dist

    if not distributed.is_initialized() or dist.get_world_size() == 1:
        return build()
    outcome: list[Any] = [None]
    result = None
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if rank == 0:
        try:
            result = build()
        except (DataError, ConfigError) as err:
            outcome[0] = (type(err), str(err))
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0][0](outcome[0][1])
    if rank != 0 and local_rank == 0:
        result = build()  # node-local caches: one rank per node builds
    dist.barrier()
    return result if (rank == 0 or local_rank == 0) else build()


def text_documents(src: Any, key: str):
    """The documents of a text source as a ``datasets.Dataset`` with one ``text`` column: one per
    plain file, or one per record's text column (record files, ``save_to_disk``, Hub)."""
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    path = Path(str(src.path)).expanduser() if src.path is not None else None
    files = source_files(src, key) if path is None or (path.exists() and not (
        path.is_dir() and is_saved_dataset(path))) else None
    if files is not None and all(file_kind(f) not in RECORD_BUILDERS for f in files):
        check_compressed(files, key, whole=False)
        for f in files:
            refuse_records_as_text(f)
        where = str(files[0] if len(files) == 1 else src.path)
        # The standard library (path null) has a few files in other encodings: replaced, as they
        # are only a default corpus. A user's file that is not UTF-8 is an error naming it.
        errors = "replace" if src.path is None else "strict"
        try:
            # data.max_bytes: the files that fit whole, then the head of the one the cap falls in.
            whole, cut = capped_text(files, src.max_bytes) if src.max_bytes is not None else (files, None)
            parts = [datasets.load_dataset("text", data_files=[str(f) for f in whole], sample_by="document",
                                           split="train", cache_dir=str(CACHE_DIR / "datasets"),
                                           encoding_errors=errors)] if whole else []
            if cut is not None or not parts:  # decoded as open() reads the whole files (universal newlines)
                head = [io.TextIOWrapper(io.BytesIO(cut[1]), encoding="utf-8", errors=errors).read()] if cut else []
                parts.append(datasets.Dataset.from_dict({"text": head},
                                                        features=datasets.Features({"text": datasets.Value("string")})))
            docs = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except Exception as err:  # noqa: BLE001 - the builder wraps the decoder's error
            check_compressed(files, key)  # a download cut short: not an encoding to convert
            bad = next((f for f in files if not _is_utf8(f)), None)
            raise DataError(f"{key}.path: {bad or where} could not be read as text: {explain_error(err)}; convert it to "
                            "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from err
    else:
        records = load_records(src, key)
        where = str(src.path)
        name = column(records, src, "text", key, "text", f"{key}.path: {where}")
        if name != "text":
            records = records.rename_column(name, "text")
        docs = records.select_columns(["text"])
        with record_errors(Where.of(src, key)):
            bad = next((i for i, t in enumerate(docs["text"]) if not isinstance(t, str)), None)
        if bad is not None:
            raise DataError(f"{Where.of(src, key).record(bad)}: field {name!r} must be a string")
    docs = docs.filter(lambda ex: len(ex["text"].strip()) > 0)
    if len(docs) == 0:
        raise DataError(f"{key}.path: {where} holds no text")
    return docs


def _is_utf8(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            while f.read(1 << 20):
                pass
        return True
    except UnicodeDecodeError:
        return False


def _cache_key(src: Any, tokenizer: Any, key: str) -> str:
    """Cache folder name of a text source's tokens: tokenizer, source files (path, size, mtime),
    and every setting that changes the ids."""
    desc: dict[str, Any] = {"tokenizer": tokenizer_fingerprint(tokenizer), "format": src.format,
                            "columns": mapped_columns(src.columns), "max_bytes": src.max_bytes, "max_records": src.max_records}
    if src.max_bytes is not None:
        desc["max_bytes_cuts_text"] = True  # earlier folders read the last file whole
    path = Path(str(src.path)).expanduser() if src.path is not None else None
    if path is None or path.exists():
        if path is not None and path.is_dir() and is_saved_dataset(path):
            files = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            files = source_files(src, key)
        desc["files"] = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    else:
        desc["hub"] = [src.path, src.subset, src.split, src.revision]
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]


def token_source(src: Any, key: str, tokenizer: Any, num_proc: int):
    """The ids of a ``text`` or ``tokens`` source (a :class:`TokenFile` and its manifest); text
    is tokenized once into the cache (``~/.cache/llmtrain/tokens/<key>``, keyed by tokenizer, files and settings)."""
    if src.format == "tokens":
        return open_tokens(src.path if remote.is_url(src.path) else Path(src.path).expanduser(), tokenizer, key)
    folder = TOKEN_CACHE / _cache_key(src, tokenizer, key)
    if not (folder / MANIFEST).is_file():
        source = str(src.path) if src.path is not None else "python stdlib"
        write_token_folder(text_documents(src, key), tokenizer, folder, num_proc, source)
    return open_tokens(folder, tokenizer, key)


def _split(n: int, val_fraction: float, seed: int) -> tuple[Complement, np.ndarray]:
    """(train, val) sample indices: ``max(1, round(n * val_fraction))`` validation samples drawn
    without replacement with ``seed`` (sorted), the rest for training, in order. Memory grows with
    the validation set only, so a token corpus of billions of tokens splits in kilobytes."""
    n_val = max(1, round(n * val_fraction))
    val = np.sort(np.random.default_rng(seed).choice(n, size=n_val, replace=False))
    return Complement(n, val), val


def _load_source(src: Any, key: str, data_cfg: Any, tokenizer: Any, seed: int, unpair: bool = False,
                 prompt_budget: int | None = None) -> tuple[Any, Any, dict]:
    """(train, val, stats) of one source. An ``s3://`` source other than a token folder is copied
    into the cache first (rank 0 first, then one rank per node) and read as local files."""
    if src.format != "tokens" and remote.is_url(src.path):
        src = _on_main_first(lambda: remote.localized(src, key))
    if src.format in ("text", "tokens"):
        tokens, manifest = _on_main_first(lambda: token_source(src, key, tokenizer, data_cfg.num_proc))
        n = num_blocks(tokens, data_cfg.seq_len)
        if n < 2:
            raise DataError(f"{key}: {src.name} yields {n} block(s) of data.seq_len={data_cfg.seq_len} tokens; need at "
                            "least 2 (one to train, one to validate)")
        train_idx, val_idx = _split(n, data_cfg.val_fraction, seed)
        eos, masking = manifest["eos_token_id"], data_cfg.document_masking
        return (TokenBlocks(tokens, data_cfg.seq_len, train_idx, eos, masking),
                TokenBlocks(tokens, data_cfg.seq_len, val_idx, eos, masking), {"tokens": manifest["num_tokens"], "samples": n})

    def encode():
        records = load_records(src, key)
        where = Where.of(src, key)  # "data.path: PATH", naming a refused record by its line
        if src.format == "prompts":
            return encode_prompts(records, src, data_cfg, tokenizer, key, where,
                                  prompt_budget if prompt_budget is not None else data_cfg.seq_len)
        if src.format in ("kto", "preference") and images_column(records, src) is not None:
            refuse_image_pairs(data_cfg, src.format == "kto" or unpair)
        if src.format == "kto" or (src.format == "preference" and unpair):
            return encode_examples(records, src, data_cfg, tokenizer, key, where, unpair=src.format == "preference")
        if src.format == "preference":
            return encode_pairs(records, src, data_cfg, tokenizer, key, where)
        if src.format == "chat" and images_column(records, src) is not None:  # TRL's vision layout
            refuse_packing(data_cfg, tokenizer)
            return encode_image_records(records, src, data_cfg, tokenizer, key, where,
                                        column(records, src, "images", key, "chat (with images)", where))
        return encode_records(records, src, data_cfg, tokenizer, key, where)

    samples, counts = _on_main_first(encode)
    if "group" in samples.column_names:  # KTO examples: split by the record (pair) they come from
        groups = samples["group"]
        _, val_groups = _split(max(groups) + 1, data_cfg.val_fraction, seed)
        held = set(val_groups.tolist())
        train = samples.select([k for k, g in enumerate(groups) if g not in held])
        val = samples.select([k for k, g in enumerate(groups) if g in held])
        if len(train) == 0 or len(val) == 0:
            raise DataError(f"{key}.path: {src.path}: {len(samples)} examples from {len(set(groups))} records leave "
                            f"{len(train)} to train and {len(val)} to validate; add records or change data.val_fraction")
    else:
        train_idx, val_idx = _split(len(samples), data_cfg.val_fraction, seed)
        train, val = samples.select([train_idx[k] for k in range(len(train_idx))]), samples.select(val_idx.tolist())
    kind = ("examples" if src.format == "kto" or unpair else "pairs" if src.format == "preference" else
            "prompts" if src.format == "prompts" else None)
    stats = dict(counts, samples=len(samples), **({kind: len(samples)} if kind else {}))
    if data_cfg.packing and src.format == "preference":
        unpacked = len(train)
        train = PackedPairs(train, data_cfg.seq_len)
        stats["packed_rows"], stats["packed_samples"] = len(train), unpacked
    elif data_cfg.packing:
        unpacked = len(train)
        train = packed_samples(train, data_cfg.seq_len)
        stats["packed_rows"], stats["packed_samples"] = len(train), unpacked
    return train, val, stats


def load_splits(data_cfg: Any, tokenizer: Any, seed: int, unpair: bool = False, prompt_budget: int | None = None
                ) -> Splits:
    """Read, tokenize and encode the configured data (one source or a mixture) and hold out
    ``val_fraction`` of each source's samples (at least 1), chosen by ``seed``. ``unpair``
    (``objective=kto``): preference pairs become unpaired examples (see
    :func:`~llmtrain.data.preference.encode_examples`). ``prompt_budget``: the tokens a prompt of
    ``data.format=prompts`` may have (default ``data.seq_len``).

    Raises:
        DataError: missing, empty or malformed data (the message names the file, record and field).
        ConfigError: the format needs a chat template the tokenizer lacks (names ``data.template``).
    """
    apply_template_setting(data_cfg, tokenizer)
    apply_pixel_budget(data_cfg, tokenizer)
    remote.set_read_timeout(data_cfg.read_timeout_s)
    sources = list(data_cfg.datasets) or [data_cfg]
    if data_cfg.get("streaming"):
        from llmtrain.data.streaming import load_streams

        train, vals, stats = load_streams(data_cfg, tokenizer, seed)
        return Splits(train=train, val=vals[0] if len(vals) == 1 else Concat(vals), names=[s.name for s in sources],
                      sizes=[0] * len(sources), weights=list(data_cfg.weights) if data_cfg.datasets else [1.0],
                      stats=stats, streaming=True)
    keys = [f"data.datasets.{i}" for i in range(len(sources))] if data_cfg.datasets else ["data"]
    trains, vals, stats = [], [], {}
    for src, key in zip(sources, keys):
        train, val, source_stats = _load_source(src, key, data_cfg, tokenizer, seed, unpair, prompt_budget)
        trains.append(train)
        vals.append(val)
        stats[src.name] = source_stats
    weights = list(data_cfg.weights) if data_cfg.datasets else [1.0]
    return Splits(train=trains[0] if len(trains) == 1 else Concat(trains),
                  val=vals[0] if len(vals) == 1 else Concat(vals),
                  names=[s.name for s in sources], sizes=[len(t) for t in trains], weights=weights, stats=stats)


def describe(splits: Splits, data_cfg: Any = None) -> str:
    """One log line per source: records, samples, truncated and dropped counts, packing (a
    stream's: where from, the samples held out, the order)."""
    lines = []
    for name, s in splits.stats.items():
        if "streamed" in s:
            from llmtrain.data.streaming import describe_stream

            lines.append(describe_stream(name, s, data_cfg))
            continue
        if "prompts" in s:
            lines.append(f"data {name}: {s['records']} records -> {s['prompts']} prompts (dropped {s['dropped_too_long']} "
                         "too long)")
            continue
        if "records" in s and ("pairs" in s or "examples" in s):
            kind = "preference pairs" if "pairs" in s else "unpaired examples"
            of = f"of {s['examples_read']} examples: " if "examples_read" in s else ""
            line = (f"data {name}: {s['records']} records -> {s.get('pairs', s.get('examples'))} {kind} ({of}truncated "
                    f"{s['truncated']}, dropped {s['dropped_too_long']} too long and {s['dropped_truncated_away']} left "
                    "without a completion token)")
        elif "records" in s:
            line = (f"data {name}: {s['records']} records -> {s['samples']} samples (truncated {s['truncated']}, "
                    f"dropped {s['dropped_too_long']} too long, {s['dropped_truncated_away']} cut before their first "
                    f"target token and {s['dropped_no_target']} without a target token)")
        else:
            line = f"data {name}: {s['tokens']} tokens -> {s['samples']} blocks"
        if "records" in s and s["truncated"] + s["dropped_too_long"] + s["dropped_truncated_away"] > s["records"] // 10:
            line += " - over 10% of the records exceed data.seq_len: consider a larger data.seq_len"
        if "packed_rows" in s:
            line += f"; {s['packed_samples']} training samples packed into {s['packed_rows']} rows"
        lines.append(line)
    return "\n".join(lines)


def pad_id_of(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def is_prompts(data_cfg: Any) -> bool:
    """Whether the data are prompts for online RL (every source has ``format`` prompts)."""
    sources = list(data_cfg.datasets) or [data_cfg]
    return all(src.format == "prompts" for src in sources)


def is_preference(data_cfg: Any) -> bool:
    """Whether the data are preference data (every source has ``format`` preference or kto)."""
    sources = list(data_cfg.datasets) or [data_cfg]
    return all(src.format in ("preference", "kto") for src in sources)


def collator_for(data_cfg: Any, tokenizer: Any):
    """The micro-batch layout of the data: :class:`PairCollator` for preference data, else
    :class:`Collator`."""
    if is_preference(data_cfg):
        return PairCollator(pad_id_of(tokenizer), data_cfg.seq_len, processor_of(tokenizer))
    if is_prompts(data_cfg):
        return PromptCollator()
    if processor_of(tokenizer) is not None:  # a vision-language model: the samples' images too
        return ImageCollator(pad_id_of(tokenizer), processor_of(tokenizer))
    return Collator(pad_id_of(tokenizer))


def train_loader(splits: Splits, tokenizer: Any, data_cfg: Any, seed: int, micro_batch: int,
                 accumulation: int, dp_rank: int, dp_size: int, start_step: int, max_steps: int):
    """A DataLoader over data-parallel rank ``dp_rank``'s micro-batches (of ``dp_size``) from
    ``start_step`` to ``max_steps``, and its sampler. Tensor- and pipeline-parallel peers share a
    ``dp_rank``."""
    sampler = StepBatchSampler(splits.order(seed, data_cfg.shuffle), micro_batch, accumulation, dp_rank, dp_size,
                               start_step, max_steps)
    # Its own generator: creating the iterator must not draw from the global RNG (dropout), or a
    # resumed run would diverge from an uninterrupted one.
    loader = torch.utils.data.DataLoader(splits.train, batch_sampler=sampler, collate_fn=collator_for(data_cfg, tokenizer),
                                         generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def val_batches(splits: Splits, tokenizer: Any, micro_batch: int, max_samples: int,
                dp_rank: int, dp_size: int, collate: Any = None) -> list[dict[str, torch.Tensor]]:
    """Data-parallel rank ``dp_rank``'s share (``dp_rank::dp_size``) of the first
    ``max_samples`` validation samples, collated by ``collate`` (default :class:`Collator`)."""
    n = min(len(splits.val), max_samples) if max_samples else len(splits.val)
    mine = list(range(dp_rank, n, dp_size))
    collate = collate or Collator(pad_id_of(tokenizer))
    return [collate([splits.val[i] for i in mine[j:j + micro_batch]]) for j in range(0, len(mine), micro_batch)]


def encode_instruction(rec: dict, tokenizer: Any, seq_len: int, use_chat: bool) -> dict | None:
    """Tokenize one {instruction, input, output} record (see :mod:`~llmtrain.data.formats`).

    Returns ``{"input_ids", "labels"}`` truncated to ``seq_len`` tokens, or None when truncation
    leaves no response token.
    """
    from types import SimpleNamespace

    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    cfg = SimpleNamespace(template="chat" if use_chat else "alpaca", datasets=[], seq_len=seq_len,
                          truncation="right", num_proc=1)
    src = SimpleNamespace(format="instruction", columns={}, name="record")
    records = datasets.Dataset.from_list([{"instruction": rec["instruction"], "input": rec.get("input") or "",
                                           "output": rec["output"]}])
    from llmtrain.data.formats import encoder, fit_to_length

    ids, labels, outcome = fit_to_length(encoder(records, src, cfg, tokenizer, "data", "record")(records[0], 0),
                                         seq_len, drop_long=False)
    return {"input_ids": ids, "labels": labels} if outcome in ("kept", "truncated") else None
