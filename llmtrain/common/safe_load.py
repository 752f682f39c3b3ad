"""Torch files loaded without running code from them: ``torch.load(weights_only=True)`` with an
allow-list of data-only classes, and torch's refusal said in one line. Checkpoint RNG files and
DeepSpeed's checkpoint files are checked with it before anything unpickles them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import torch


def load_weights_only(path: Path, allowed_globals: Sequence[Any] = (), mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU with ``allowed_globals`` (classes, or
    ``(class, "module.name")`` pairs, as ``torch.serialization.safe_globals`` takes them) allowed
    besides tensors and plain types; ``mmap``: map the tensor data instead of reading it.

    Raises:
        pickle.UnpicklingError: the file holds other pickled objects (none of them was built;
            :func:`unpickling_reason` says which).
        RuntimeError, OSError, EOFError, ValueError: not a readable torch file.
    """
    with torch.serialization.safe_globals(list(allowed_globals)):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def unpickling_reason(err: BaseException) -> str:
    """The one line of torch's ``weights_only`` refusal that says what the file holds (``Unsupported
    global: GLOBAL builtins.exec ...``), without its advice to load with ``weights_only=False``."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    match = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    reason = match.group(1) if match else text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return reason.split(" Please use `torch.serialization.add_safe_globals")[0].strip()
