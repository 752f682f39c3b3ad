"""Hugging Face ``datasets``, imported where llmtrain uses it, with the progress-bar setting the
run chose applied on import.

Importing ``datasets`` costs about 0.5 s (pandas, pyarrow); a run on already tokenized data
never needs it. :func:`llmtrain.monitoring.console.configure_library_output` therefore switches
its progress bars off through :func:`bars_off` rather than by importing it, and llmtrain's own
imports of it go through :func:`module`. Setting ``HF_DATASETS_DISABLE_PROGRESS_BARS`` instead
would make the choice permanent for the process (datasets then refuses
``enable_progress_bars()``) and pass it on to every child process.
"""

from __future__ import annotations

import sys
from types import ModuleType

_bars_off = False


def bars_off() -> None:
    """Switch ``datasets``' progress bars off now if it is imported, else when :func:`module`
    first imports it."""
    global _bars_off
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        _bars_off = True


def module() -> ModuleType:
    """The ``datasets`` module, with its progress bars off if :func:`bars_off` asked for it
    (once: a caller may turn them on again afterwards)."""
    global _bars_off
    import datasets

    if _bars_off:
        datasets.disable_progress_bars()
        _bars_off = False
    return datasets
