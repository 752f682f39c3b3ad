"""Datasets from local files, and the deterministic global sample order shared by all ranks.

A *sample* is one training sequence: a packed block of ``seq_len`` tokens (text corpora) or one
instruction/response pair (alpaca). Samples are addressed by a global sample index ``g``; epoch
``g // N`` visits the training set in a permutation drawn from ``seed + epoch``. Optimizer step
``s`` consumes global samples ``[s * B, (s + 1) * B)`` (``B`` = global batch), split into
contiguous per-rank and per-micro-batch slices. The order therefore depends on the seed and the
global batch only, never on the number of ranks, and resuming needs one integer: the number of
samples consumed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from llmtrain.loss import IGNORE_INDEX
from llmtrain.paths import CACHE_DIR

ALPACA_PROMPT = (
    "Below is an instruction that describes a task{with_input}. Write a response that "
    "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}"
    "### Response:\n"
)


class DataError(ValueError):
    """The data files are missing, empty or malformed; the message names the file and field."""


@dataclass
class Splits:
    """Tokenized samples. Each sample is a dict with ``input_ids`` (list[int], length <= seq_len)
    and ``labels`` (same length, -100 where no loss is taken)."""

    train: Any  # datasets.Dataset
    val: Any


def _on_main_first(build):
    """Run ``build()`` on rank 0 first (it fills the datasets cache), then on the other ranks.
    A DataError on rank 0 is sent to every rank, so all of them fail with the same message."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return build()
    outcome: list[Any] = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = build()
        except DataError as err:
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise DataError(outcome[0])
    return result if dist.get_rank() == 0 else build()


def _walk_sorted(root: Path, pattern: str, skip_dir: str | None = None) -> Iterator[Path]:
    """Files under ``root`` whose relative path matches ``pattern`` (``**/`` also matches the top
    level), in a deterministic depth-first order, lazily: a byte cap stops the walk early."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != skip_dir)
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), root)
            if fnmatch.fnmatch(rel, pattern) or (pattern.startswith("**/") and fnmatch.fnmatch(rel, pattern[3:])):
                yield Path(folder) / name


def _text_files(data_cfg: Any) -> list[Path]:
    if data_cfg.path is None:
        # Only the standard library itself: installed third-party packages differ per machine.
        root = Path(sysconfig.get_paths()["stdlib"])
        candidates = _walk_sorted(root, data_cfg.glob, skip_dir="site-packages")
    else:
        root = Path(data_cfg.path).expanduser()
        if root.is_dir():
            candidates = _walk_sorted(root, data_cfg.glob)
        elif root.is_file():
            candidates = iter([root])
        else:
            raise DataError(f"data.path: {root} does not exist (data={data_cfg.name}); "
                            f"set data.path=/path/to/your/file")
    files, total = [], 0
    for f in candidates:
        if data_cfg.max_bytes is not None and total >= data_cfg.max_bytes:
            break
        _refuse_records_as_text(f)
        files.append(f)
        total += f.stat().st_size
    if not files:
        raise DataError(f"data.path: no files match {data_cfg.glob!r} under {root}")
    return files


JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow")


def _refuse_records_as_text(path: Path) -> None:
    """data.format=text reads files as plain text: a file of records would be trained on as its
    raw serialisation, braces and field names included. Refused: ``.json``/``.jsonl``/``.ndjson``
    files (also gzip/bz2/xz-compressed, also with a byte-order mark) that hold JSON objects,
    Parquet and Arrow files, and any other file whose first line is a JSON object (JSON lines
    saved as ``.txt``).

    Raises:
        DataError: ``path`` holds records; the message names the fields seen and what reads them.
    """
    import bz2
    import gzip
    import lzma

    suffixes = [s.lower() for s in path.suffixes]
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(suffixes[-1] if suffixes else "")
    kind = (suffixes[-2] if opener and len(suffixes) >= 2 else suffixes[-1]) if suffixes else ""
    if kind in TABLE_SUFFIXES:
        fields = ""
        if kind == ".parquet" and not opener:
            import pyarrow.parquet

            fields = f" with fields {sorted(pyarrow.parquet.read_schema(path).names)}"
        raise DataError(f"data.path: {path} is a {kind[1:]} table{fields}; data.format=text reads plain text and "
                        "data=alpaca reads JSON/JSONL records. Convert it first, e.g. "
                        f"datasets.Dataset.from_{kind[1:]}('{path}').to_json('records.jsonl'), then use "
                        "data=alpaca data.path=records.jsonl")
    with (opener or open)(path, "rt", encoding="utf-8", errors="replace") as f:
        # A JSON file is sniffed from its start; any other file by its first line only.
        head = f.read(1 << 20) if kind in JSON_SUFFIXES else f.readline(1 << 20)
    head = head.lstrip("\ufeff \t\r\n")
    first = None
    if head.startswith("{") or (kind in JSON_SUFFIXES and head.startswith("[") and head[1:].lstrip().startswith("{")):
        try:
            first, _ = json.JSONDecoder().raw_decode(head, head.index("{"))
        except ValueError:
            first = {} if kind in JSON_SUFFIXES else None  # a record longer than the head: no names
    if not isinstance(first, dict):
        return  # plain text (or JSON that holds no objects: text, if odd)
    seen = f" with fields {sorted(first)}" if first else ""
    raise DataError(f"data.path: {path} holds JSON records{seen}, but data.format=text would train on its raw "
                    "text (braces and field names included). For {instruction, input, output} records use "
                    "data=alpaca (data.format=alpaca); for plain text, point data.path at text files (or a folder "
                    "with data.glob matching them)")


def _read_records(path: Path, data_cfg: Any) -> list[dict]:
    if path.is_dir():
        raise DataError(f"data.path: {path} is a folder; data.format=alpaca needs a JSON or JSONL file")
    if not path.is_file():
        raise DataError(f"data.path: {path} does not exist (data={data_cfg.name}); "
                        f"set data.path=/path/to/alpaca.json")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data.path: {path} is not UTF-8 text ({err})") from err
    if not text.strip():
        raise DataError(f"data.path: {path} is empty; it must hold alpaca records "
                        "{instruction, input, output}")
    try:
        if text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise DataError(f"data.path: {path} is not JSON or JSON lines: {err}") from err
    if not isinstance(records, list):
        raise DataError(f"data.path: {path} must hold a JSON list of records (or JSON lines), not a {type(records).__name__}")
    for i, rec in enumerate(records):
        if not (isinstance(rec, dict) and isinstance(rec.get("instruction"), str) and isinstance(rec.get("output"), str)
                and isinstance(rec.get("input") or "", str)):
            raise DataError(f"data.path: {path} record {i} lacks string 'instruction'/'output' "
                            "(alpaca format: {instruction, input, output})")
    return records[: data_cfg.max_records] if data_cfg.max_records else records


def _pack_text(files: Sequence[Path], tokenizer: Any, data_cfg: Any):
    import datasets

    cache = str(CACHE_DIR / "datasets")
    raw = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document",
                                split="train", cache_dir=cache)
    raw = raw.filter(lambda ex: len(ex["text"].strip()) > 0)
    if len(raw) == 0:
        raise DataError(f"data.path: {files[0] if len(files) == 1 else data_cfg.path} holds no text")
    eos, block = tokenizer.eos_token_id, data_cfg.seq_len

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [doc + [eos] for doc in ids]}

    def pack(batch):
        # One stream per map batch, cut into full blocks; the tail of each batch is dropped.
        stream = [t for doc in batch["ids"] for t in doc]
        blocks = [stream[i:i + block] for i in range(0, len(stream) - block + 1, block)]
        return {"input_ids": blocks, "labels": blocks}

    tokenized = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
    packed = tokenized.map(pack, batched=True, batch_size=2000, remove_columns=["ids"], desc="pack")
    if len(packed) < 2:
        raise DataError(f"data: {data_cfg.name} yields {len(packed)} block(s) of data.seq_len="
                        f"{block} tokens; need at least 2 (one to train, one to validate)")
    return packed


def _alpaca_prompt(rec: dict, tokenizer: Any, use_chat: bool) -> str:
    instruction, context = rec["instruction"].strip(), (rec.get("input") or "").strip()
    if use_chat:
        content = instruction + (f"\n\n{context}" if context else "")
        return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             add_generation_prompt=True, tokenize=False)
    return ALPACA_PROMPT.format(
        with_input=", paired with an input that provides further context" if context else "",
        instruction=instruction, input_block=f"### Input:\n{context}\n\n" if context else "")


def use_chat_template(tokenizer: Any, template: str) -> bool:
    """Whether prompts go through the tokenizer's chat template (``data.template``)."""
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("data.template=chat but the tokenizer has no chat template; use data.template=alpaca")
    return template == "chat" or (template == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def encode_instruction(rec: dict, tokenizer: Any, seq_len: int, use_chat: bool) -> dict | None:
    """Tokenize one alpaca record: prompt labelled -100, response + EOS trained.

    Returns ``{"input_ids": list[int], "labels": list[int]}`` truncated to ``seq_len`` tokens, or
    None when truncation leaves no response token. EOS is appended as a token id, so its label
    survives even when the tokenizer's pad token is EOS.
    """
    prompt_ids = tokenizer(_alpaca_prompt(rec, tokenizer, use_chat), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(rec["output"].strip(), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt_ids + response_ids)[:seq_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:seq_len]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return None
    return {"input_ids": ids, "labels": labels}


def _encode_alpaca(data_cfg: Any, tokenizer: Any):
    import datasets

    records = _read_records(Path(data_cfg.path).expanduser(), data_cfg)
    use_chat = use_chat_template(tokenizer, data_cfg.template)
    encoded = [e for e in (encode_instruction(r, tokenizer, data_cfg.seq_len, use_chat) for r in records) if e]
    if len(encoded) < 2:
        raise DataError(f"data.path: {data_cfg.path} gives {len(encoded)} usable record(s) at "
                        f"data.seq_len={data_cfg.seq_len}; need at least 2")
    return datasets.Dataset.from_list(encoded)


def load_splits(data_cfg: Any, tokenizer: Any, seed: int) -> Splits:
    """Tokenize the configured data and hold out ``val_fraction`` of the samples (at least 1).

    Raises:
        DataError: missing, empty or malformed files (message names ``data.path``).
    """
    if data_cfg.format == "text":
        samples = _on_main_first(lambda: _pack_text(_text_files(data_cfg), tokenizer, data_cfg))
    else:
        samples = _on_main_first(lambda: _encode_alpaca(data_cfg, tokenizer))
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(len(samples) * data_cfg.val_fraction))
    return Splits(train=samples.select(sorted(order[n_val:])), val=samples.select(sorted(order[:n_val])))


class GlobalSampleOrder:
    """Maps a global sample index to a training-set index: epoch-wise permutations from the seed.

    ``g -> perm(seed + g // n)[g % n]``; without shuffling, ``g -> g % n``.
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
            self._epoch, self._perm = epoch, torch.randperm(self.num_samples, generator=gen).tolist()
        return self._perm[pos]


class StepBatchSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches (lists of dataset indices), step after step.

    Step ``s`` covers global samples ``[s*B, (s+1)*B)``; rank ``r`` takes the contiguous slice
    ``[s*B + r*m*a, s*B + (r+1)*m*a)`` as ``a`` micro-batches of ``m`` (m = micro-batch,
    a = gradient accumulation, B = m*a*world). Starts at ``start_step`` (resume).
    """

    def __init__(self, order: GlobalSampleOrder, micro_batch: int, accumulation: int, rank: int,
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

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.max_steps):
            for micro in self.global_indices(step):
                yield [self.order[g] for g in micro]

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.a


class Collator:
    """Pads a micro-batch to its longest sample (right padding).

    Returns ``input_ids``, ``labels``, ``attention_mask``: int64 tensors of shape
    ``[micro_batch, longest]``; padded positions get ``pad_id`` / -100 / 0.
    """

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.as_tensor(s["input_ids"])
            labels[i, :n] = torch.as_tensor(s["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pad_id_of(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def train_loader(splits: Splits, tokenizer: Any, data_cfg: Any, seed: int, micro_batch: int,
                 accumulation: int, dp_rank: int, dp_size: int, start_step: int, max_steps: int):
    """A DataLoader over data-parallel rank ``dp_rank``'s micro-batches (of ``dp_size``) from
    ``start_step`` to ``max_steps``. Tensor- and pipeline-parallel peers share a ``dp_rank``."""
    order = GlobalSampleOrder(len(splits.train), seed, data_cfg.shuffle)
    sampler = StepBatchSampler(order, micro_batch, accumulation, dp_rank, dp_size,
                               start_step, max_steps)
    # Its own generator: creating the iterator must not draw from the global RNG (dropout), or a
    # resumed run would diverge from an uninterrupted one.
    loader = torch.utils.data.DataLoader(splits.train, batch_sampler=sampler, collate_fn=Collator(pad_id_of(tokenizer)),
                                         generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def val_batches(splits: Splits, tokenizer: Any, micro_batch: int, max_samples: int,
                dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """Data-parallel rank ``dp_rank``'s share (``dp_rank::dp_size``) of the first
    ``max_samples`` validation samples."""
    n = min(len(splits.val), max_samples) if max_samples else len(splits.val)
    mine = list(range(dp_rank, n, dp_size))
    collate = Collator(pad_id_of(tokenizer))
    return [collate([splits.val[i] for i in mine[j:j + micro_batch]]) for j in range(0, len(mine), micro_batch)]
