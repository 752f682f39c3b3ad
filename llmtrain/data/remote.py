"""Object storage: ``s3://`` paths of the data fields, read and written through fsspec (s3fs).

Any ``scheme://`` value of a data path field is either an ``s3://`` URL (with the ``s3`` extra
installed) or refused in one line naming the field: it is never taken for a local folder named
``s3:``. Credentials and the endpoint come from the AWS SDK's own environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` or ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` for
MinIO-style servers); llmtrain adds no config field for them.

Token folders are read block by block with ranged reads (:class:`RemoteTokenFile`, a bounded
in-memory block cache per process); record and text files are copied once into
``~/.cache/llmtrain/remote/`` (keyed by URL and ETag) and read as local files. Every request is
retried with exponential backoff on transient faults (connection resets, timeouts, 503 SlowDown),
counted by :func:`retries` (``data/retries`` in the metrics); a store that stays down is one
:class:`~llmtrain.common.errors.DataError` naming the URL and the fix.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from llmtrain.common.errors import ConfigError, DataError, require_extra
from llmtrain.common.paths import CACHE_DIR

log = logging.getLogger("llmtrain")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
REMOTE_CACHE = CACHE_DIR / "remote"
CREDENTIALS_FIX = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
ENDPOINT_FIX = ("set AWS_ENDPOINT_URL to the server's address (MinIO: http://HOST:9000), or unset it for AWS S3, "
                "and check that the server is up")
# Transient faults: tries per request and the first wait (doubling, capped at _MAX_WAIT_S): a
# store down for ~30 s is waited out, a longer outage ends the run with one error.
ATTEMPTS, _FIRST_WAIT_S, _MAX_WAIT_S = 8, 0.25, 8.0
# A request's wait for the store's answer (socket inactivity), seconds: a store that hangs (a
# stopped server, a dropped route) is a fault, retried like a reset. ``data.read_timeout_s`` sets it.
_read_timeout_s = 30.0
_retries = 0
_fs: tuple[int, Any] | None = None  # (pid, filesystem): one client per process (forked workers make their own)


def url_scheme(value: Any) -> str | None:
    """The scheme of ``value`` when it is a URL (``s3`` of ``s3://bucket/key``), else None."""
    match = _SCHEME.match(str(value)) if value is not None else None
    return match.group(1).lower() if match else None


def is_url(value: Any) -> bool:
    """Whether ``value`` is a ``scheme://`` URL rather than a local path or a Hub id."""
    return url_scheme(value) is not None


def refuse_unsupported(value: str, field: str) -> None:
    """Refuse a URL llmtrain cannot read: any scheme but ``s3``, or ``s3`` without s3fs.

    Raises:
        ConfigError: ``FIELD=VALUE: gs:// URLs are not read by llmtrain ...``.
        MissingExtra: s3fs is not installed (names ``llmtrain[s3]``).
    """
    scheme = url_scheme(value)
    if scheme is None:
        return
    if scheme != "s3":
        raise ConfigError(f"{field}={value}: {scheme}:// URLs are not read by llmtrain (object storage: s3://, "
                          "also for MinIO and other S3-compatible servers via AWS_ENDPOINT_URL); copy the data to "
                          "a local path and give that path")
    require_extra("s3fs", "s3", f"{field}={value}", instead="or copy the data to a local path")


def retries() -> int:
    """Requests retried after a transient fault in this process so far."""
    return _retries


def set_read_timeout(seconds: float) -> None:
    """How long a request waits for the store's answer before it counts as a fault
    (``data.read_timeout_s``); the client is made anew when it changes."""
    global _read_timeout_s, _fs
    if seconds != _read_timeout_s:
        _read_timeout_s, _fs = float(seconds), None


def filesystem() -> Any:
    """This process's s3fs client, configured from the AWS environment. Its own retries are off
    (one attempt per call, timeouts of ``data.read_timeout_s``): :func:`call` retries and counts them."""
    global _fs
    if _fs is None or _fs[0] != os.getpid():
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={
            "retries": {"max_attempts": 1}, "connect_timeout": min(10.0, _read_timeout_s),
            "read_timeout": _read_timeout_s})
        fs.retries = 1  # s3fs's own loop (a class attribute, not an argument)
        _fs = (os.getpid(), fs)
    return _fs[1]


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"


def _final(err: BaseException) -> bool:
    """Whether ``err`` is an answer rather than a fault: no such object, access refused, no
    credentials, a malformed request, a bug. Anything else (resets, timeouts, 5xx) is retried."""
    names = {cls.__name__ for cls in type(err).__mro__}
    return isinstance(err, (FileNotFoundError, PermissionError, ValueError, NotImplementedError, TypeError,
                            AttributeError, KeyError)) or bool(
        names & {"NoCredentialsError", "PartialCredentialsError", "ParamValidationError", "NoRegionError"})


def explain(err: BaseException, url: str, field: str) -> str:
    """One line for a failed request on ``url``: what is wrong and what to set."""
    names = {cls.__name__ for cls in type(err).__mro__}
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return f"{field}={url}: no credentials for the object store ({text}); {CREDENTIALS_FIX}"
    if isinstance(err, PermissionError):
        return f"{field}={url}: the store refused access ({text}); {CREDENTIALS_FIX} to a key allowed to read it"
    if isinstance(err, FileNotFoundError):
        if "bucket" in text.lower():
            return (f"{field}={url}: the bucket {bucket!r} does not exist at {_endpoint()}; create it, or fix the URL "
                    "or AWS_ENDPOINT_URL")
        return f"{field}={url}: no such object or prefix in bucket {bucket!r} at {_endpoint()}; check the URL"
    if names & {"NoRegionError"}:
        return f"{field}={url}: no region set for the object store; set AWS_DEFAULT_REGION (e.g. us-east-1)"
    return f"{field}={url}: the object store at {_endpoint()} did not answer ({type(err).__name__}: {text}); {ENDPOINT_FIX}"


def call(request: Callable[[], Any], url: str, field: str, attempts: int | None = None) -> Any:
    """``request()`` retried with exponential backoff on transient faults (each retry counted),
    ``attempts`` tries in all (default :data:`ATTEMPTS`).

    Raises:
        DataError: the request's final answer (no such object, no credentials) or the last
            fault after ``attempts`` tries, as one line (:func:`explain`).
    """
    global _retries
    wait, attempts = _FIRST_WAIT_S, attempts or ATTEMPTS
    for attempt in range(attempts):
        try:
            return request()
        except Exception as err:  # noqa: BLE001 - sorted into answers and faults just below
            if _final(err) or attempt == attempts - 1:
                tries = f" (after {attempts} tries)" if not _final(err) and attempts > 1 else ""
                raise DataError(explain(err, url, field) + tries) from err
            if attempt == 0:  # said once per request: a hung or down store is never silent
                log.warning("%s; retrying (%d tries in all, about %.0f s)", explain(err, url, field).split("; ")[0],
                            attempts, _retry_budget_s(attempts))
        _retries += 1
        time.sleep(wait)
        wait = min(2 * wait, _MAX_WAIT_S)
    raise AssertionError("unreachable")


def _retry_budget_s(attempts: int) -> float:
    """The longest the tries of one request take against a store that hangs: each waits
    ``data.read_timeout_s``, and the backoff between them."""
    return attempts * _read_timeout_s + sum(min(_FIRST_WAIT_S * 2 ** k, _MAX_WAIT_S) for k in range(attempts - 1))


def _key(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def probe(url: str, field: str) -> dict:
    """Check that ``url`` exists and can be read with this environment's credentials and endpoint
    (one request, one retry: a start-up check, before the run folder is written).

    Returns:
        fsspec's ``info`` of the object or prefix (``type``: ``file`` or ``directory``).

    Raises:
        DataError: naming what to set (credentials, endpoint) or that the bucket or key is missing.
    """
    fs = filesystem()
    check_bucket(url, field)
    return call(lambda: fs.info(_key(url)), url, field, attempts=2)


def check_bucket(url: str, field: str) -> None:
    """Check that the bucket of ``url`` exists and answers these credentials (a HEAD request:
    s3fs's ``exists`` answers False for any error, a missing credential included).

    Raises:
        DataError: the bucket does not exist, or :func:`explain`'s answer.
    """
    fs, bucket = filesystem(), _key(url).split("/", 1)[0]
    try:
        call(lambda: fs.call_s3("head_bucket", Bucket=bucket), url, field, attempts=2)
    except DataError as err:
        if isinstance(err.__cause__, FileNotFoundError):
            raise DataError(explain(FileNotFoundError("The specified bucket does not exist"), url, field)) from err
        raise


def check_data_urls(d: Any) -> None:
    """Every URL among the ``data`` node's path fields (``data.path``, ``data.datasets.N.path``,
    ``data.template``): readable here, checked before anything is built or written.

    Raises:
        ConfigError, MissingExtra: an unsupported scheme, s3fs missing, a URL where only a local
            file is read (``data.template``). DataError: the object store's answer (:func:`probe`).
    """
    if is_url(d.get("template")):
        raise ConfigError(f"data.template={d.template}: templates are read from local files only; copy it here and "
                          "give its path")
    fields = [("data.path", d.get("path"))] + [(f"data.datasets.{i}.path", s.get("path"))
                                                for i, s in enumerate(d.get("datasets") or [])]
    for field, value in fields:
        if is_url(value):
            refuse_unsupported(str(value), field)
            probe(str(value), field)


def read_bytes(url: str, field: str) -> bytes:
    """The whole object at ``url`` (a manifest: small)."""
    fs = filesystem()
    return call(lambda: fs.cat_file(_key(url)), url, field)


def size_of(url: str, field: str) -> int:
    """The size in bytes of the object at ``url``."""
    fs = filesystem()
    return int(call(lambda: fs.info(_key(url)), url, field)["size"])


def local_copy(url: str, field: str) -> Path:
    """A local copy of the file or folder at ``url`` under ``~/.cache/llmtrain/remote/<hash>/``,
    keyed by the URL and every object's ETag (a changed object is fetched again). Downloaded
    beside the cache entry and renamed into place, so concurrent ranks and a killed download
    never leave a half-written copy.

    Returns:
        The local path standing for ``url`` (a file or a folder with the same relative layout).
    """
    fs = filesystem()
    info = probe(url, field)
    key = _key(url)
    if info["type"] == "directory":
        found = call(lambda: fs.find(key, detail=True), url, field)
        objects = {name[len(key):].lstrip("/"): meta for name, meta in sorted(found.items())
                   if not name.endswith("/") and name != key}  # folder markers some tools write hold nothing
        unsafe = next((rel for rel in objects if ".." in rel.split("/") or rel.startswith("/")), None)
        if unsafe is not None:  # a key would be written outside the cache entry
            raise DataError(f"{field}={url}: the object {unsafe!r} has a '..' or '/' path part; rename it")
    else:
        objects = {key.rsplit("/", 1)[-1]: info}
    digest = hashlib.sha256(repr((url, sorted((k, v.get("ETag"), v.get("size")) for k, v in objects.items()))).encode())
    entry = REMOTE_CACHE / digest.hexdigest()[:24]
    target = entry / key.rsplit("/", 1)[-1] if info["type"] != "directory" else entry / "folder"
    if entry.is_dir():
        return target
    partial = entry.with_name(f".{entry.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        for rel, meta in objects.items():
            local = (partial / "folder" / rel) if info["type"] == "directory" else partial / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            name = f"{key}/{rel}" if info["type"] == "directory" else key
            call(lambda: fs.get_file(name, str(local)), f"s3://{name}", field)
        try:
            os.rename(partial, entry)
        except OSError:  # another rank finished the same copy first: keep its
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def localized(src: Any, key: str) -> Any:
    """``src`` (a data source node) with an ``s3://`` path replaced by its local copy
    (:func:`local_copy`); ``src`` itself when its path is local."""
    import copy

    from omegaconf import OmegaConf

    if not is_url(src.get("path")):
        return src
    refuse_unsupported(str(src.path), f"{key}.path")
    local = local_copy(str(src.path), f"{key}.path")
    copied = copy.deepcopy(src)
    OmegaConf.set_readonly(copied, False)
    copied.path = str(local)
    return copied


def check_empty_prefix(url: str, field: str) -> None:
    """Refuse to write under ``url`` unless its bucket exists and nothing is stored there yet.

    Raises:
        DataError: missing bucket, credentials or endpoint (:func:`explain`); ConfigError: the
            prefix already holds objects (nothing is overwritten).
    """
    fs = filesystem()
    if "/" not in _key(url):
        raise ConfigError(f"{field}={url}: give a prefix inside the bucket, e.g. {field}={url.rstrip('/')}/tokens")
    check_bucket(url, field)
    if call(lambda: fs.exists(_key(url)), url, field, attempts=2):
        raise ConfigError(f"{field}={url}: the prefix exists and is not empty; choose a new prefix (nothing is "
                          "overwritten)")


def upload_folder(local: Path, url: str, field: str, last: str) -> None:
    """Upload the files of ``local`` under ``url``, the file named ``last`` after all others:
    readers look for it first, so a folder cut short by a kill is never taken for a whole one."""
    fs = filesystem()
    names = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: (p.name == last, str(p)))
    for path in names:
        name = f"{_key(url)}/{path.relative_to(local).as_posix()}"
        call(lambda: fs.put_file(str(path), name), f"s3://{name}", field)


class RemoteTokenFile:
    """Read-only random access to a token folder's ``tokens.bin`` in object storage: ``file[a:b]``
    is a numpy array of ids, fetched with ranged GETs of ``BLOCK`` bytes and kept in an LRU cache
    of ``cache_blocks`` blocks per process (64 MiB by default). Picklable: each DataLoader worker
    opens its own client and cache."""

    BLOCK = 1 << 20

    def __init__(self, url: str, dtype: str, size: int, field: str, cache_blocks: int = 64):
        self.url, self.dtype, self.size, self.field = url, np.dtype(dtype), size, field
        self.cache_blocks = cache_blocks
        self._len = size // self.dtype.itemsize
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        # The prefetch thread reads training samples while the step's thread may read held-out ones.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def _block(self, index: int) -> bytes:
        with self._lock:
            return self._block_unlocked(index)

    def _block_unlocked(self, index: int) -> bytes:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        fs, start = filesystem(), index * self.BLOCK
        end = min(self.size, start + self.BLOCK)
        data = call(lambda: fs.cat_file(_key(self.url), start=start, end=end), self.url, self.field)
        self._keep(index, start, end, data)
        return data

    def _keep(self, index: int, start: int, end: int, data: bytes) -> None:
        """Cache block ``index`` (bytes ``[start, end)`` of the object, as read), the least
        recently used blocks out past ``cache_blocks``; the caller holds the lock.

        Raises:
            DataError: ``data`` is not ``end - start`` bytes long (the object changed).
        """
        if len(data) != end - start:
            raise DataError(f"{self.field}: {self.url} returned {len(data)} bytes for bytes {start}-{end}: the object "
                            "changed while training; prepare the folder again under a new prefix")
        self._cache[index] = data
        self._cache.move_to_end(index)
        while len(self._cache) > self.cache_blocks:
            self._cache.popitem(last=False)

    def fetch(self, ranges: list[tuple[int, int]]) -> None:
        """Bring the blocks that the token ranges ``[start, stop)`` need into the cache with
        concurrent ranged GETs (one round trip for a micro-batch's samples instead of one per
        sample); at most ``cache_blocks`` of them, so they do not evict each other."""
        size = self.dtype.itemsize
        wanted = sorted({b for start, stop in ranges if stop > start
                         for b in range(start * size // self.BLOCK, (stop * size - 1) // self.BLOCK + 1)})
        with self._lock:
            missing = [b for b in wanted if b not in self._cache][:self.cache_blocks]
        if len(missing) < 2:  # nothing to overlap: __getitem__ reads it
            return
        fs, key = filesystem(), _key(self.url)
        starts = [b * self.BLOCK for b in missing]
        ends = [min(self.size, s + self.BLOCK) for s in starts]
        blocks = call(lambda: fs.cat_ranges([key] * len(missing), starts, ends, on_error="raise"), self.url,
                      self.field)
        with self._lock:
            for b, start, end, data in zip(missing, starts, ends, blocks):
                self._keep(b, start, end, data)

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self._len)
        if step != 1:
            raise ValueError("RemoteTokenFile reads contiguous ranges only")
        size = self.dtype.itemsize
        first, last = start * size, max(stop * size, start * size)
        chunks = [self._block(b)[max(first - b * self.BLOCK, 0):last - b * self.BLOCK]
                  for b in range(first // self.BLOCK, (last - 1) // self.BLOCK + 1)] if last > first else []
        return np.frombuffer(b"".join(chunks), dtype=self.dtype)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _cache=OrderedDict(), _lock=threading.Lock())
