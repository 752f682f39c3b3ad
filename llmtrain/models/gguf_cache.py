"""GGUF files converted once into a Hugging Face folder, so later runs skip the GGUF reader.

``transformers`` reads a GGUF file by parsing its tokenizer (tens of thousands of merges, in
Python) and dequantizing every tensor with numpy: 40-50 s for SmolLM2-135M on 2 cores, on every
run. :func:`cached_folder` does that once per file and writes the result as a plain folder
(``model.safetensors`` in fp32, which is what the GGUF path yields, ``config.json`` as
``AutoConfig`` reads the GGUF file, the tokenizer files) that ``from_pretrained(folder)`` loads
in a second or two.

Where: ``$LLMTRAIN_GGUF_CACHE`` if set (``off``, ``0`` or ``false`` turns the cache off: every
load reads the GGUF file), else ``$LLMTRAIN_CACHE/gguf`` (default ``~/.cache/llmtrain/gguf``).
One entry per ``<xxh3-128 of the file>-transformers<version>-gguf<version>``: keyed by content,
so a reinstalled package (new mtime, same bytes) keeps its entry and a changed file of the same
path and size gets a new one; by version, because the conversion's output can change with either
library. Hashing the 98 MB SmolLM2 file costs about 0.1 s, once per process.

Safety: the entry is converted in a child process (so no engine context of the caller, DeepSpeed's
``zero.Init`` or a meta device, can shape what is written) into a temporary folder next to it,
the completion marker (``llmtrain-gguf.json``: the key and every file's size) written last, and
the folder renamed into place. Concurrent ranks or runs take a file lock per entry: one converts,
the others wait, then load. An entry whose marker is missing, names another key or lists a file
whose size differs is never loaded: it is moved aside and converted again.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmtrain.common.errors import ModelSourceError
from llmtrain.common.paths import _process_umask, follow_umask

log = logging.getLogger("llmtrain")

ENV = "LLMTRAIN_GGUF_CACHE"
MARKER = "llmtrain-gguf.json"
_OFF = ("off", "0", "false", "no", "none")
_memo: dict[tuple[str, int, int, str], Path] = {}  # (file, size, mtime_ns, root) -> entry, per process


def cache_root() -> Path | None:
    """The folder holding the converted entries, or None when ``LLMTRAIN_GGUF_CACHE`` turns the
    cache off. Read at each call, so a test or a launcher can point it elsewhere."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    from llmtrain.common import paths

    return Path(paths.CACHE_DIR) / "gguf"


def file_digest(path: Path) -> str:
    """XXH3-128 of the file's bytes, hex (32 characters)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def entry_key(gguf_path: Path) -> str:
    """The entry's folder name: content hash plus the versions of the two libraries that convert."""
    import transformers

    return f"{file_digest(gguf_path)}-transformers{transformers.__version__}-gguf{importlib.metadata.version('gguf')}"


def is_complete(entry: Path, key: str) -> bool:
    """Whether ``entry`` is a finished conversion for ``key``: its marker names the key and every
    file it lists exists with the listed size (a truncated or missing file fails)."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        return marker.get("key") == key and bool(marker.get("files")) and all(
            (entry / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def cached_folder(gguf_path: str | Path, root: Path | None = None) -> Path | None:
    """The Hugging Face folder converted from the GGUF file at ``gguf_path``, converting it first
    when no complete entry exists (see the module docstring). Returns None when the cache is off
    (``root`` None and ``LLMTRAIN_GGUF_CACHE=off``) or its folder cannot be written (a warning
    says why: read-only, full): the caller then reads the GGUF file itself.

    Raises:
        ModelSourceError: the conversion failed (its error output is quoted).
    """
    root = root if root is not None else cache_root()
    if root is None:
        return None
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    memo_key = (str(gguf_path), stat.st_size, stat.st_mtime_ns, str(root))
    entry = _memo.get(memo_key)
    if entry is not None and (entry / MARKER).is_file():
        return entry
    key = entry_key(gguf_path)
    entry = root / key
    if not is_complete(entry, key):
        try:
            root.mkdir(parents=True, exist_ok=True)
            _build(gguf_path, root, key)
        except OSError as err:  # read-only, full or foreign folder: the run goes on without the cache
            log.warning("GGUF cache %s cannot be written (%s): reading %s directly; set %s to a writable folder "
                        "with about 4x the file's size free, or %s=off", root, err, gguf_path.name, ENV, ENV)
            return None
    _memo[memo_key] = entry
    return entry


def _build(gguf_path: Path, root: Path, key: str) -> None:
    """Convert under the entry's file lock unless another process finished it meanwhile."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process converting %s into %s", gguf_path.name, root / key)
        lock.acquire()
    try:
        entry = root / key
        if is_complete(entry, key):
            return
        # Holding the lock, any temporary folder of this key was left by a process that died.
        for leftover in root.glob(f".{key}.*"):
            shutil.rmtree(leftover, ignore_errors=True)
        if entry.exists():
            log.warning("GGUF cache entry %s is incomplete or corrupt: converting %s again", entry, gguf_path.name)
            stale = root / f".{key}.stale-{os.getpid()}"
            os.rename(entry, stale)
            shutil.rmtree(stale, ignore_errors=True)
        pending = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            started = time.perf_counter()
            log.info("converting %s to a Hugging Face folder once (later runs load %s)", gguf_path.name, entry)
            _convert_in_child(gguf_path, pending)
            # Readable by whoever may read the cache, as the process umask allows (safetensors and
            # mkdtemp create their files and folder for the owner alone).
            follow_umask(pending)
            pending.chmod(0o777 & ~_process_umask())
            files = {p.name: p.stat().st_size for p in pending.iterdir() if p.is_file()}
            marker = {"key": key, "source": str(gguf_path), "files": files}
            (pending / MARKER).write_text(json.dumps(marker, indent=1))
            _sync(pending)
            os.rename(pending, entry)
            log.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)
        except BaseException:
            shutil.rmtree(pending, ignore_errors=True)
            raise
    finally:
        lock.release()


def _sync(folder: Path) -> None:
    # The marker must not reach the disk before the files it vouches for (a crash after the
    # rename would otherwise leave a complete-looking entry of empty files).
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _convert_in_child(gguf_path: Path, out: Path) -> None:
    command = [sys.executable, "-m", "llmtrain.models.gguf_cache", str(gguf_path), str(out)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise ModelSourceError(f"converting {gguf_path} to a Hugging Face folder failed (exit {done.returncode}):\n"
                               f"{done.stdout[-4000:]}\nset {ENV}=off to read the GGUF file directly")


def convert(gguf_path: Path, out: Path) -> None:
    """Write the GGUF file's model (fp32 safetensors, the dtype the GGUF path loads), its config
    (as ``AutoConfig`` reads the GGUF file, so both paths give the same config), generation config
    and tokenizer into the existing folder ``out``.

    ``save_pretrained`` refuses a GGUF-loaded model (its quantizer is marked not serializable), so
    the weights go through safetensors directly: a tensor shared by several names (a tied output
    embedding) is written once under its first name, as ``save_pretrained`` writes it, and
    ``from_pretrained`` ties it again from the config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tensors, seen = {}, set()
    for key, tensor in model.state_dict().items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if identity not in seen:
            seen.add(identity)
            tensors[key] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoConfig.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m llmtrain.models.gguf_cache GGUF_FILE OUT_FOLDER")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
