"""Where records come from: local files and folders, ``save_to_disk`` folders and Hub datasets,
all read through ``datasets`` (cached under ``~/.cache/llmtrain/datasets``), with column mapping.

Every error names the source (``data.path`` or ``data.datasets.N.path``), the file and the fix.
"""

from __future__ import annotations

import bz2
import contextlib
import difflib
import gzip
import json
import logging
import lzma
import os
import re
import socket
import sysconfig
import zlib
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from llmtrain.common.errors import DataError, LlmtrainError
from llmtrain.common.paths import CACHE_DIR, DOWNLOADS_DOC, PRESET_DOWNLOADS

# File suffix -> the `datasets` packaged builder that reads it.
RECORD_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".parquet": "parquet",
                   ".csv": "csv", ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz")
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
# How each compressed format starts, and its name in messages.
MAGIC = {".gz": (b"\x1f\x8b", "gzip"), ".bz2": (b"BZh", "bzip2"), ".xz": (b"\xfd7zXZ\x00", "xz")}
DATASETS_CACHE = CACHE_DIR / "datasets"
DOWNLOADED_FILES = {*PRESET_DOWNLOADS.values(), "gsm8k_test.jsonl"}


def file_kind(path: Path) -> str:
    """The format suffix of ``path`` ignoring a compression suffix (``a.jsonl.gz`` -> ``.jsonl``)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def walk_sorted(root: Path, pattern: str, skip_dir: str | None = None) -> Iterator[Path]:
    """Files under ``root`` whose relative path matches ``pattern`` (``**/`` also matches the top
    level), in a deterministic depth-first order, lazily: a byte cap stops the walk early."""
    import fnmatch

    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != skip_dir)
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(folder, name), root)
            if fnmatch.fnmatch(rel, pattern) or (pattern.startswith("**/") and fnmatch.fnmatch(rel, pattern[3:])):
                yield Path(folder) / name


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` was written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def source_files(src: Any, key: str) -> list[Path]:
    """The local files of a source, in a deterministic order: with ``max_bytes``, the files up to
    the one in which that many bytes are reached (which :func:`capped_text` cuts for plain text;
    record files are read whole).

    A folder contributes the files matching ``glob`` for ``format=text``; for record formats, the
    files with a record suffix (.json, .jsonl, .parquet, .csv, .arrow). ``path=null`` (text
    only) reads the Python standard library's own files.

    Raises:
        DataError: nothing matches, a path does not exist, or a file is empty.
    """
    if src.path is None:
        # Only the standard library itself: installed third-party packages differ per machine.
        root = Path(sysconfig.get_paths()["stdlib"])
        candidates: Iterator[Path] = walk_sorted(root, src.glob, skip_dir="site-packages")
    else:
        root = Path(src.path).expanduser()
        if root.is_dir():
            if src.format == "text":
                candidates = walk_sorted(root, src.glob)
            else:
                candidates = (f for f in walk_sorted(root, "**/*") if file_kind(f) in RECORD_BUILDERS)
        elif root.is_file():
            candidates = iter([root])
        else:
            raise DataError(f"{key}.path: {root} does not exist (data={src.name}); {missing_file_fix(src, key)}")
    files, total = [], 0
    for f in candidates:
        if src.max_bytes is not None and total >= src.max_bytes:
            break
        files.append(f)
        total += f.stat().st_size
    if not files:
        wanted = repr(src.glob) if src.format == "text" else "*.json, *.jsonl, *.parquet, *.csv or *.arrow"
        raise DataError(f"{key}.path: no files match {wanted} under {root}")
    return files


def missing_file_fix(src: Any, key: str) -> str:
    """The fix for a source whose path does not exist: the download of its preset's example file
    (or of the file it names, when that is one of the examples), else a path of the user's own."""
    own = f"set {key}.path=/path/to/your/file"
    name = Path(str(src.path)).name
    bare = next((name[:-len(c)] for c in COMPRESSIONS if name.endswith(c)), name)  # a compressed copy of one
    example = next((n for n in (name, bare) if n in DOWNLOADED_FILES), PRESET_DOWNLOADS.get(str(src.name)))
    if example is None:
        return own
    return f"download the example file {example} (see {DOWNLOADS_DOC}) or {own}"


def compression_problem(path: Path, whole: bool = True) -> str | None:
    """Why a compressed file (``.gz``, ``.bz2``, ``.xz``) cannot be read, naming it and the fix: it
    does not start as its suffix says (a plain file named ``.gz``), or, with ``whole`` (it is read
    through: a file's decompressed size in time), its data end early or are damaged (a download cut
    short). None when it reads, or is not compressed."""
    suffix = path.suffix.lower()
    if suffix not in MAGIC:
        return None
    magic, name = MAGIC[suffix]
    with open(path, "rb") as fh:
        head = fh.read(len(magic))
    if head != magic:
        return (f"{path} is not {name} data (it does not start with {name}'s magic bytes): a plain file named "
                f"{suffix}? rename it without {suffix}, or re-download it (see {DOWNLOADS_DOC})")
    if not whole:
        return None
    try:
        with OPENERS[suffix](path, "rb") as fh:
            while fh.read(1 << 24):
                pass
    except (EOFError, OSError, lzma.LZMAError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        return (f"{path} is truncated or damaged {name} data ({err}); re-download it (see {DOWNLOADS_DOC}) or "
                "compress it again")
    return None


def check_compressed(files: list[Path], key: str, whole: bool = True) -> None:
    """:func:`compression_problem` of each of ``files``, raised.

    Raises:
        DataError: ``{key}.path: FILE is not gzip data ...`` or ``... is truncated or damaged ...``.
    """
    for f in files:
        problem = compression_problem(f, whole)
        if problem is not None:
            raise DataError(f"{key}.path: {problem}")


def capped_text(files: list[Path], max_bytes: int) -> tuple[list[Path], tuple[Path, bytes] | None]:
    """Plain-text ``files`` cut to ``max_bytes`` bytes of text in all (``data.max_bytes``; a
    compressed file counts its decompressed bytes): the files read whole, and the file the cap
    falls inside with its first bytes, ending before an incomplete UTF-8 character (None when the
    cap falls between files). Memory: at most ``max_bytes`` (one file's head at a time)."""
    whole, left = [], max_bytes
    for f in files:
        opener = OPENERS.get(f.suffix.lower())
        if opener is None and f.stat().st_size <= left:
            whole.append(f)
            left -= f.stat().st_size
            continue
        with (opener or open)(f, "rb") as fh:
            head = fh.read(left + 1)
        if len(head) <= left:  # a compressed file that fits
            whole.append(f)
            left -= len(head)
            continue
        head = head[:left]
        for back in range(1, min(4, len(head)) + 1):  # the last character's first byte, and its length
            lead = head[-back]
            if lead & 0xC0 != 0x80:
                length = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
                head = head[:-back] if length > back else head
                break
        return whole, (f, head)
    return whole, None


def looks_like_local_path(value: str) -> bool:
    """A value that names a file system path rather than a Hub id (``owner/name``)."""
    return (value.startswith(("/", ".", "~")) or Path(value).suffix.lower() in RECORD_BUILDERS
            or Path(value).suffix.lower() in (".txt",) + COMPRESSIONS or value.count("/") > 1)


def refuse_records_as_text(path: Path) -> None:
    """``format=text`` reads a plain file as one document: a file of records would be trained on
    as its raw serialisation, braces and field names included. Refused: plain (non-JSON-suffixed)
    files, also compressed or BOM-prefixed, whose first line is a JSON object (JSON lines saved
    as ``.txt``).

    Raises:
        DataError: ``path`` holds records; the message names the fields seen and what reads them.
    """
    opener = OPENERS.get(path.suffix.lower())
    with (opener or open)(path, "rt", encoding="utf-8", errors="replace") as f:
        head = f.readline(1 << 20).lstrip("\ufeff \t\r\n")
    if not head.startswith("{"):
        return
    try:
        first, _ = json.JSONDecoder().raw_decode(head)
    except ValueError:
        return
    if isinstance(first, dict):
        raise DataError(f"data.path: {path} holds JSON records with fields {sorted(first)}, but data.format=text "
                        "would train on its raw text (braces and field names included). Save it as .jsonl and "
                        "use data.format=text with data.columns.text=FIELD, or data=alpaca "
                        "(data.format=instruction) for {instruction, input, output} records")


def _check_file(path: Path, builder: str, key: str) -> None:
    if path.stat().st_size == 0:
        raise DataError(f"{key}.path: {path} is empty")
    check_compressed([path], key, whole=False)
    if builder == "parquet":
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PAR1":
            raise DataError(f"{key}.path: {path} is not a Parquet file (it does not start with the Parquet "
                            "magic bytes PAR1); convert it, or give it the suffix of its real format")


def explain_error(err: BaseException) -> str:
    """The innermost message of a ``datasets`` builder failure (which wraps the parser's)."""
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for e in chain:
        if isinstance(e, UnicodeDecodeError):
            return f"it is not UTF-8 text ({e})"
        if "corresponds to no data" in str(e):
            return "it holds no records"
    return str(chain[-1]).splitlines()[0] if str(chain[-1]) else type(chain[-1]).__name__


class _DropErrors(logging.Filter):
    """Drops a logger's ERROR and CRITICAL records (warnings pass)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def quiet_builder_errors(builder: str) -> Iterator[None]:
    """Silence the error lines a ``datasets`` packaged builder logs before raising (the JSON
    builder logs ``Failed to load JSON from file ... in row N`` once per attempt), for the
    duration of the block: the failure still raises, and llmtrain reports it once, with the
    file and line. Warnings from the builder still print."""
    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    drop = _DropErrors()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _at_column(err: json.JSONDecodeError) -> str:
    """``invalid JSON: Expecting value at column 7`` (or ``... starting at column 10``)."""
    return f"invalid JSON: {err.msg}{'' if err.msg.endswith(' at') else ' at'} column {err.colno}"


def _json_problem(value: Any) -> str | None:
    return None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"


def is_json_lines(path: Path) -> bool | None:
    """Whether a JSON file holds JSON lines (one record a line), as :func:`locate_json_error` reads
    it: a ``.jsonl``/``.ndjson`` file not starting with ``[``, or any whose first non-blank line is
    a JSON object on its own; None when that line is not UTF-8."""
    with OPENERS.get(path.suffix.lower(), open)(path, "rb") as fh:
        first = b""
        for first in fh:
            if first.strip():
                break
    try:
        head = first.decode("utf-8-sig").strip()
    except UnicodeDecodeError:
        return None
    if not head.startswith("[") and file_kind(path) in (".jsonl", ".ndjson"):
        return True
    if head.startswith("{"):
        try:
            return isinstance(json.loads(head), dict)
        except ValueError:
            pass
    return False


class Where(str):
    """A source in messages, ``data.path: PATH`` (it is that string), which also names a record of
    it (:meth:`record`) and the first line of its files that is not UTF-8 (:meth:`undecodable`).
    ``files``: the source's local files (none for a Hub dataset or a ``save_to_disk`` folder)."""

    key: str = "data"
    files: tuple[Path, ...] = ()

    @classmethod
    def of(cls, src: Any, key: str) -> "Where":
        """The :class:`Where` of source ``src`` (``key``: ``data`` or ``data.datasets.N``)."""
        where = cls(f"{key}.path: {src.path}")
        where.key = key
        path = Path(str(src.path)).expanduser()
        if src.path is not None and path.exists() and not (path.is_dir() and is_saved_dataset(path)):
            where.files = tuple(source_files(src, key))
        return where

    def record(self, index: int) -> str:
        """Record ``index`` (0-based, as ``datasets`` counts the records) as ``data.path: FILE line
        N`` when every file is JSON lines (N 1-based and counting blank lines, as an editor shows
        them: the reader skips those), else ``data.path: PATH record INDEX``. Reads the files up to
        that line: called when a record is refused."""
        if self.files and all(file_kind(f) in (".json", ".jsonl", ".ndjson") and is_json_lines(f) for f in self.files):
            left = index
            for f in self.files:
                with OPENERS.get(f.suffix.lower(), open)(f, "rb") as fh:
                    for number, raw in enumerate(fh, start=1):
                        if raw.strip():
                            if left == 0:
                                return f"{self.key}.path: {f} line {number}"
                            left -= 1
        return f"{self} record {index}"

    def undecodable(self) -> str | None:
        """``[FILE ]line N column C: byte 0xNN`` for the first byte of the source's text files
        (JSON, JSON lines, CSV) that is not UTF-8 (FILE when there are several), None when there
        is none."""
        for f in self.files:
            if file_kind(f) not in (".json", ".jsonl", ".ndjson", ".csv"):
                continue
            with OPENERS.get(f.suffix.lower(), open)(f, "rb") as fh:
                for number, raw in enumerate(fh, start=1):
                    try:
                        raw.decode("utf-8-sig" if number == 1 else "utf-8")
                    except UnicodeDecodeError as err:
                        named = f"{f} " if len(self.files) > 1 else ""  # one file: the message names it
                        return f"{named}line {number} column {err.start + 1}: byte 0x{raw[err.start]:02x}"
        return None


@contextlib.contextmanager
def record_errors(where: str) -> Iterator[None]:
    """Around a pass over a source's records (an encoding ``map``, whose per-record errors name
    ``WHERE record INDEX``, the index ``datasets`` counts): a refused record is named by its line
    (:meth:`Where.record`), found only then; and a record that is not UTF-8 text is an error naming
    its file, line and byte (Arrow keeps a JSON file's bytes and Python decodes them lazily, in
    that first pass, so the :class:`UnicodeDecodeError` comes from there, with no file or line).

    Raises:
        DataError: ``WHERE: a record is not UTF-8 text ([FILE ]line N column C: byte 0xNN); convert
            the file to UTF-8 (e.g. iconv ...)``; the refused record's error (its own type), named
            by its line.
    """
    try:
        yield
    except UnicodeDecodeError as err:
        found = where.undecodable() if isinstance(where, Where) else None
        raise DataError(f"{where}: a record is not UTF-8 text ({found or err}); convert the file to UTF-8 (e.g. "
                        "iconv -f latin1 -t utf-8)") from err
    except LlmtrainError as err:
        text, prefix = str(err), f"{where} record "
        index = re.match(r"\d+", text[len(prefix):]) if text.startswith(prefix) else None
        if isinstance(where, Where) and index is not None and len(err.args) == 1:
            err.args = (where.record(int(index.group())) + text[len(prefix) + index.end():],)
        raise


def locate_json_error(path: Path) -> str | None:
    """Where a JSON or JSON-lines file (also ``.gz``/``.bz2``/``.xz``) is malformed, read with
    the ``json`` module after ``datasets`` failed on it.

    A ``.jsonl``/``.ndjson`` file not starting with ``[``, or one whose first non-blank line is a
    JSON object on its own, is read as JSON lines: the answer is ``"FILE line N: invalid JSON: <json error> at column C; ..."`` for the first line
    (1-based, blank lines counted) that is not valid JSON or not a JSON object. Any other file is
    one JSON document (an array of records, or an object): ``"FILE line L: invalid JSON: <json
    error> at column C"`` from :class:`json.JSONDecodeError`. Memory: one line at a time for JSON
    lines, the whole text for a document (as ``datasets`` itself reads one).

    Returns:
        The message, or None when the ``json`` module reads the file without error, or the file
        is not UTF-8 (the failure lies elsewhere: the caller reports ``datasets``' own message).
    """
    opener = OPENERS.get(path.suffix.lower(), open)
    json_lines = is_json_lines(path)
    if json_lines is None:
        return None  # reported as not UTF-8 by the caller
    if json_lines:
        with opener(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError:
                    return None
                try:
                    problem = _json_problem(json.loads(text.rstrip("\r\n")))
                except json.JSONDecodeError as err:
                    problem = _at_column(err)
                if problem is not None:
                    return f"{path} line {number}: {problem}; each line must hold one whole JSON object"
        return None
    with opener(path, "rb") as fh:
        raw = fh.read()
    try:
        json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        return None
    except json.JSONDecodeError as err:
        return f"{path} line {err.lineno}: {_at_column(err)}"
    return None


def load_records(src: Any, key: str):
    """The raw records of one source as a ``datasets.Dataset`` (columns renamed per ``columns``
    happen later, in :mod:`llmtrain.data.formats`).

    Raises:
        DataError: missing/empty/malformed files, an unreachable Hub, a missing split.
    """
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()

    path = Path(str(src.path)).expanduser()
    if path.is_dir() and is_saved_dataset(path):
        try:
            saved = datasets.load_from_disk(str(path))
        except Exception as err:  # noqa: BLE001 - any reader failure is a data error here
            raise DataError(f"{key}.path: {path} could not be read as a save_to_disk folder: {explain_error(err)}") from err
        if isinstance(saved, datasets.DatasetDict):
            if src.split not in saved:
                raise DataError(f"{key}.split={src.split!r} is not a split of {path} (splits: {sorted(saved)})")
            saved = saved[src.split]
        return _cap(saved, src)
    if not path.exists() and not looks_like_local_path(str(src.path)):
        return _cap(load_hub(src, key), src)
    files = source_files(src, key)
    kinds = sorted({file_kind(f) for f in files})
    builders = {RECORD_BUILDERS.get(k) for k in kinds}
    if len(builders) != 1 or None in builders:
        raise DataError(f"{key}.path: {path} mixes or holds unsupported file kinds {kinds}; give files of one "
                        f"kind among {', '.join(RECORD_BUILDERS)}")
    builder = builders.pop()
    for f in files:
        _check_file(f, builder, key)
    try:
        with quiet_builder_errors(builder):
            records = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                            cache_dir=str(DATASETS_CACHE))
    except Exception as err:  # noqa: BLE001
        check_compressed(files, key)  # a download cut short: named before its JSON is looked at
        if builder == "json":
            for f in files:
                where = locate_json_error(f)
                if where is not None:
                    raise DataError(f"{key}.path: {where}") from err
        raise DataError(f"{key}.path: {files[0] if len(files) == 1 else path} could not be read as {builder}: "
                        f"{explain_error(err)}") from err
    if len(records) == 0:
        raise DataError(f"{key}.path: {path} holds no records")
    return _cap(records, src)


def _cap(records: Any, src: Any):
    return records.select(range(min(len(records), src.max_records))) if src.max_records else records


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the Hub endpoint (``HF_ENDPOINT``) opens within ``timeout_s``."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or os.environ.get("HF_DATASETS_OFFLINE", "0") \
            not in ("0", "", "false"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def load_hub(src: Any, key: str):
    """A Hub dataset ``src.path`` (``subset``, ``split``, ``revision``): the cached copy when there
    is one, else a download. Offline, a single error says how to bring the data here."""
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()
    import huggingface_hub.constants

    kwargs = {"name": src.subset, "split": src.split, "revision": src.revision, "cache_dir": str(DATASETS_CACHE)}
    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    try:
        datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
        return datasets.load_dataset(str(src.path), **kwargs)
    except Exception:  # noqa: BLE001 - not cached: try the network below
        pass
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
    call = f"datasets.load_dataset({str(src.path)!r}" + "".join(
        f", {k}={v!r}" for k, v in (("name", src.subset), ("split", src.split), ("revision", src.revision)) if v) + ")"
    if not hub_reachable():
        raise DataError(f"{key}.path={src.path!r} is not a local file or folder, and the Hugging Face Hub cannot be "
                        f"reached from here to download it as a dataset. On a machine with network, run "
                        f"`{call}.save_to_disk('DIR')`, copy DIR here and set {key}.path=DIR")
    try:
        return datasets.load_dataset(str(src.path), **kwargs)
    except Exception as err:  # noqa: BLE001
        raise DataError(f"{key}.path={src.path!r}: {call} failed: {explain_error(err)}") from err


def column(records: Any, src: Any, field: str, key: str, fmt: str, where: str) -> str:
    """The column of ``records`` that holds ``field`` (``src.columns`` maps it).

    Raises:
        DataError: the column is missing; names the columns present, the closest one and the fix.
    """
    from llmtrain.config.schema import mapped_columns

    name = mapped_columns(src.columns).get(field, field)
    present = list(records.column_names)
    if name in present:
        return name
    close = difflib.get_close_matches(name, present, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    mapped = f"{key}.columns.{field}={name} names" if field in mapped_columns(src.columns) else f"format {fmt} reads"
    fits = [f for f, cols in (("instruction", {"instruction", "output"}), ("chat", {"messages"}),
                              ("chat", {"conversations"}), ("prompt_completion", {"prompt", "completion"}),
                              ("text", {"text"})) if cols <= set(present) and not fmt.startswith(f)]
    other = f", or read these records as {key}.format={fits[0]}" if fits else ""
    raise DataError(f"{where}: {mapped} the column {name!r}, which is missing{hint}; its columns are {present}. "
                    f"Map yours with {key}.columns.{field}=YOUR_COLUMN{other}")
