"""Token folders: a corpus tokenized once into one flat array of token ids on disk, read by block.

Layout of a folder (written by ``python -m llmtrain.prepare``, and by ``format=text`` into its
cache): ``tokens.bin`` (little-endian uint16 when the vocabulary fits, else uint32; documents
concatenated, each followed by EOS) and ``manifest.json`` (tokenizer name and SHA-256, dtype,
token and document counts, EOS id, source). Training reads the blocks it needs with
``os.pread`` (:class:`TokenFile`): resident memory does not hold the corpus. Sample ``i`` is tokens ``[i*L, (i+1)*L)`` for
``L = data.seq_len``; the tail shorter than ``L`` is not used.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmtrain.common.errors import DataError
from llmtrain.common.labels import IGNORE_INDEX

MANIFEST = "manifest.json"
TOKENS = "tokens.bin"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's full definition (vocabulary, merges, normalizer, special
    tokens): two tokenizers with the same fingerprint produce the same ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_token_folder(documents: Any, tokenizer: Any, out: Path, num_proc: int, source: str,
                       text_column: str = "text") -> dict:
    """Tokenize ``documents`` (a ``datasets.Dataset`` with a text column) into ``out``.

    Tokenization runs in ``num_proc`` processes (``datasets.map``); the ids are then written in
    document order, so the result does not depend on ``num_proc``. The folder appears atomically
    (written beside it, then renamed), so a killed run never leaves a half-written one.

    Returns:
        The manifest (dict).
    """
    eos = tokenizer.eos_token_id
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32

    def tokenize(batch: dict) -> dict:
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"ids": [np.asarray(doc + [eos], dtype=dtype) for doc in ids]}

    tokenized = documents.map(tokenize, batched=True, remove_columns=documents.column_names,
                              num_proc=num_proc if num_proc > 1 and len(documents) >= num_proc else None,
                              desc="tokenize")
    out = Path(out)
    remove_stale_partials(out)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}@{socket.gethostname()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    count = 0
    try:
        with open(partial / TOKENS, "wb") as f:
            for batch in tokenized.with_format("numpy").iter(batch_size=1024):
                for doc in batch["ids"]:
                    f.write(np.asarray(doc, dtype=dtype).tobytes())
                    count += len(doc)
        manifest = {"tokenizer": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
                    "tokenizer_sha256": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer),
                    "dtype": np.dtype(dtype).name, "num_tokens": count, "num_documents": len(documents),
                    "eos_token_id": eos, "source": source}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException:  # an error or Ctrl-C: no half-written folder left (SIGKILL: the next run's)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        os.rename(partial, out)
    except OSError:
        if not (out / MANIFEST).is_file():
            raise
        # Another process (a rank of another node sharing the cache) finished the same folder
        # first: keep its copy, which readers may already hold open.
        shutil.rmtree(partial, ignore_errors=True)
    return manifest


def remove_stale_partials(out: Path) -> None:
    """Delete the half-written ``.<out>.partial-<pid>@<host>`` folders beside ``out`` that a
    killed writer on this host left (its pid is no longer running). Writers on other hosts
    sharing the folder, and live ones here, are left alone."""
    host = socket.gethostname()
    for folder in Path(out).parent.glob(f".{glob.escape(Path(out).name)}.partial-*"):
        pid, _, owner = folder.name.rsplit(".partial-", 1)[1].partition("@")
        if not pid.isdigit() or (owner or host) != host or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # no such process: the writer died
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def read_manifest(folder: Path, key: str) -> dict:
    """The manifest of a token folder.

    Raises:
        DataError: ``folder`` is not a token folder (names ``key`` and the command that makes one).
    """
    manifest = Path(folder) / MANIFEST
    if not manifest.is_file() or not (Path(folder) / TOKENS).is_file():
        raise DataError(f"{key}.path: {folder} is not a token folder (no {MANIFEST} and {TOKENS}); make one with "
                        "`python -m llmtrain.prepare <model and data overrides> out=DIR`")
    return checked_manifest(manifest.read_bytes(), (Path(folder) / TOKENS).stat().st_size, str(manifest),
                            str(Path(folder) / TOKENS), key)


def checked_manifest(text: bytes, size: int, manifest: str, tokens: str, key: str) -> dict:
    """A token folder's manifest (``text``, read from ``manifest``), checked against the size in
    bytes of its ``tokens`` file: a folder on disk or in object storage alike.

    Raises:
        DataError: not JSON, an unknown dtype or no token count, or a size that does not match.
    """
    try:
        content = json.loads(text)
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{key}.path: {manifest} is not valid JSON ({err}); prepare the folder again") from err
    dtype, count = content.get("dtype"), content.get("num_tokens")
    if dtype not in ("uint16", "uint32") or not isinstance(count, int):
        raise DataError(f"{key}.path: {manifest} has dtype={dtype!r}, num_tokens={count!r}; expected uint16 or uint32 "
                        "and a token count: prepare the folder again")
    if size != count * np.dtype(dtype).itemsize:
        raise DataError(f"{key}.path: {tokens} holds {size} bytes, but {MANIFEST} says {count} {dtype} "
                        f"tokens ({count * np.dtype(dtype).itemsize} bytes): the folder is damaged or incomplete; "
                        "prepare it again")
    return content


def _remote_tokens(url: str, key: str) -> tuple[Any, dict]:
    """A token folder in object storage: its checked manifest and a :class:`RemoteTokenFile`."""
    import llmtrain.data.remote as remote

    url = url.rstrip("/")
    manifest_url, tokens_url = f"{url}/{MANIFEST}", f"{url}/{TOKENS}"
    try:
        text = remote.read_bytes(manifest_url, f"{key}.path")
        size = remote.size_of(tokens_url, f"{key}.path")
    except DataError as err:
        if not isinstance(err.__cause__, FileNotFoundError):
            raise
        raise DataError(f"{key}.path: {url} is not a token folder (no {MANIFEST} and {TOKENS}); make one with "
                        "`python -m llmtrain.prepare <model and data overrides> out=s3://BUCKET/PREFIX`") from err
    manifest = checked_manifest(text, size, manifest_url, tokens_url, key)
    return remote.RemoteTokenFile(tokens_url, manifest["dtype"], size, f"{key}.path"), manifest


class TokenFile:
    """Read-only random access to ``tokens.bin`` with ``os.pread``: ``file[a:b]`` is a numpy
    array of ids. Unlike a memory map, reads leave no file pages mapped into the process, so
    resident memory does not grow with the corpus or with the steps taken (this machine's
    read-ahead mapped ~0.9 MiB per random 256-byte read of a memory map, ``MADV_RANDOM``
    or not). Opened lazily per process, so it survives ``fork``."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._len = self.path.stat().st_size // self.dtype.itemsize
        self._fd, self._pid = None, None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self._len)
        if step != 1:
            raise ValueError("TokenFile reads contiguous ranges only")
        if self._pid != os.getpid():
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, (stop - start) * size, start * size), dtype=self.dtype)

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _fd=None, _pid=None)


def open_tokens(folder: Path | str, tokenizer: Any, key: str) -> tuple[Any, dict]:
    """Open a token folder's ids for random reads (a :class:`TokenFile`, or a
    :class:`~llmtrain.data.remote.RemoteTokenFile` for an ``s3://`` URL), checking they were
    made with ``tokenizer``.

    Raises:
        DataError: another tokenizer made the folder (names both), or it is not a token folder.
    """
    import llmtrain.data.remote as remote

    if remote.is_url(folder):
        file, manifest = _remote_tokens(str(folder), key)
    else:
        manifest = read_manifest(folder, key)
        file = TokenFile(Path(folder) / TOKENS, manifest["dtype"])
    mine = tokenizer_fingerprint(tokenizer)
    if manifest["tokenizer_sha256"] != mine:
        raise DataError(f"{key}.path: {folder} was tokenized with {manifest['tokenizer']} (sha256 "
                        f"{manifest['tokenizer_sha256'][:12]}), but this run's tokenizer is "
                        f"{getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__} (sha256 {mine[:12]}); "
                        "prepare the folder again with this model's tokenizer, or train with the model it was made for")
    if manifest.get("eos_token_id") != tokenizer.eos_token_id or manifest.get("vocab_size") != len(tokenizer):
        raise DataError(f"{key}.path: {folder}/{MANIFEST} says eos_token_id={manifest.get('eos_token_id')}, "
                        f"vocab_size={manifest.get('vocab_size')}, but the tokenizer it names has "
                        f"{tokenizer.eos_token_id} and {len(tokenizer)}: the manifest was edited; prepare the folder again")
    return file, manifest


class Complement:
    """The indices ``0..n-1`` except the sorted ``excluded`` ones, in order, without
    materialising them: memory is 8 bytes per excluded index, not per index. Item ``k`` is
    ``k + #{excluded j : excluded_j - j <= k}`` (one binary search)."""

    def __init__(self, n: int, excluded: np.ndarray):
        self.n = n
        self._shift = np.asarray(excluded, dtype=np.int64) - np.arange(len(excluded))

    def __len__(self) -> int:
        return self.n - len(self._shift)

    def __getitem__(self, k: int) -> int:
        if not 0 <= k < len(self):
            raise IndexError(k)
        return k + int(np.searchsorted(self._shift, k, side="right"))


class TokenBlocks(torch.utils.data.Dataset):
    """Samples of ``seq_len`` tokens cut from a token array on disk (:class:`TokenFile`) or in memory.

    Item ``k`` is block ``indices[k]`` (``indices``: an integer array or a :class:`Complement`):
    ``input_ids`` and ``labels`` (int64 arrays ``[seq_len]``). With ``document_masking`` it also
    has ``position_ids`` restarting after each EOS, and the first token of each document after
    the first gets label -100 (it is not predicted across a document boundary), so attention and
    loss stay inside documents.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, indices: Any, eos_id: int, document_masking: bool):
        self.tokens, self.seq_len, self.indices = tokens, seq_len, indices
        self.eos_id, self.document_masking = eos_id, document_masking

    def __len__(self) -> int:
        return len(self.indices)

    def __getitems__(self, ks: list[int]) -> list[dict]:
        """Items ``ks`` (a micro-batch; the DataLoader asks for them together): a token array in
        object storage first fetches the blocks they need concurrently
        (:meth:`~llmtrain.data.remote.RemoteTokenFile.fetch`)."""
        fetch = getattr(self.tokens, "fetch", None)
        if fetch is not None:
            fetch([(int(self.indices[k]) * self.seq_len, (int(self.indices[k]) + 1) * self.seq_len) for k in ks])
        return [self[k] for k in ks]

    def __getitem__(self, k: int) -> dict:
        start = int(self.indices[k]) * self.seq_len
        ids = np.asarray(self.tokens[start:start + self.seq_len], dtype=np.int64)
        sample = {"input_ids": ids, "labels": ids.copy()}
        if self.document_masking:
            starts = np.zeros(len(ids), dtype=bool)
            starts[1:] = ids[:-1] == self.eos_id
            segment = np.cumsum(starts)
            first = np.flatnonzero(np.r_[True, starts[1:]])
            sample["position_ids"] = np.arange(len(ids)) - first[segment]
            sample["labels"][starts] = IGNORE_INDEX
        return sample


def num_blocks(tokens: np.ndarray, seq_len: int) -> int:
    return len(tokens) // seq_len
