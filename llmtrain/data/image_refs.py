"""A record's images as files: what an ``images`` column may hold, turned into the paths that
encoded samples keep (tokens and image references, never pixels).

An image is any of what the ecosystem's datasets hold (LLaMA-Factory's ``ImageInput``, the
``datasets.Image`` feature): a path (relative to the data file's folder, or absolute); a
``{"bytes": ..., "path": ...}`` dict (``datasets.Image(decode=False)``'s storage: the bytes when
not null, else the path); raw bytes; a PIL image. The column may hold one image instead of a list.
An image without a usable path (bytes, or a PIL image) is written once to a content-addressed
file, ``~/.cache/llmtrain/images/<sha256 of its bytes>`` (``LLMTRAIN_CACHE``), and that path is
kept: the collator reads it again for each micro-batch as it reads any path, the encoded data stay
small and a rerun (or another rank) finds the same file. Bytes are stored as they are (a JPEG stays
a JPEG); a PIL image is stored as PNG, lossless.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

from llmtrain.common.errors import DataError
from llmtrain.common.paths import CACHE_DIR

IMAGE_CACHE = CACHE_DIR / "images"


def undecoded(records: Any, column: str) -> Any:
    """``records`` with an image column of ``datasets.Image`` features (one image, or a list)
    read as ``{"bytes", "path"}`` dicts rather than decoded PIL images, so the original bytes
    (or path) are kept as they are; other columns and records without such a feature unchanged."""
    from llmtrain.common import lazy_datasets

    datasets = lazy_datasets.module()
    feature = (records.features or {}).get(column)
    if isinstance(feature, datasets.Image) and feature.decode:
        return records.cast_column(column, datasets.Image(decode=False))
    inner = getattr(feature, "feature", None)
    if isinstance(feature, (datasets.Sequence, getattr(datasets, "List", datasets.Sequence))) and \
            isinstance(inner, datasets.Image) and inner.decode:
        return records.cast_column(column, datasets.List(datasets.Image(decode=False)))
    return records


def _cached(data: bytes) -> Path:
    """The content-addressed cache file of ``data`` (written once, atomically)."""
    path = IMAGE_CACHE / hashlib.sha256(data).hexdigest()
    if not path.is_file():
        IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, path)  # concurrent writers write the same bytes
    return path


def _checked_bytes(data: bytes, where: str) -> Path:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Image.DecompressionBombError as err:
        raise DataError(f"{where}: an image too large: {err}; resize it") from None
    except UnidentifiedImageError:
        raise DataError(f"{where}: {len(data)} bytes that are not an image PIL reads (no known image format)") from None
    except (OSError, SyntaxError) as err:
        raise DataError(f"{where}: {len(data)} bytes that are not an image PIL reads: {err}") from None
    return _cached(data)


def _pil_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image_path(value: Any, base: Path, where: str) -> Path:
    """The file of one image ``value`` (a path, a ``{"bytes", "path"}`` dict, bytes or a PIL image;
    relative paths under ``base``), bytes and PIL images through the cache.

    Raises:
        DataError: bytes that are not an image, a dict with neither, another type (naming ``where``).
    """
    from PIL import Image

    if isinstance(value, dict) and value.keys() <= {"bytes", "path"}:
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise DataError(f"{where}: an image dict with neither 'bytes' nor 'path'")
    if isinstance(value, str):
        path = Path(value).expanduser()
        return path if path.is_absolute() else base / value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _checked_bytes(bytes(value), where)
    if isinstance(value, Image.Image):
        return _cached(_pil_bytes(value))
    raise DataError(f"{where}: an image is a path, a {{'bytes': ..., 'path': ...}} dict, bytes or a PIL image, got "
                    f"{type(value).__name__} {value!r:.60}")


def image_paths(value: Any, base: Path, where: str, field: str) -> list[Path]:
    """A record's image files: ``value`` is a list of images (:func:`image_path`), one image, or
    None (none).

    Raises:
        DataError: an image that is none of those kinds, or bytes that are not an image (naming
            ``where``, ``field`` and the image's index).
    """
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        value = [value]
    return [image_path(v, base, f"{where}: field {field!r} image {k}") for k, v in enumerate(value)]
