"""Where the shipped configs live: next to the package when installed, at the repo root in a checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _locate(folder: str) -> str:
    # A wheel installs conf/ and recipes/ inside the package (see pyproject's package-dir);
    # a checkout or editable install keeps them at the repository root.
    for candidate in (_PACKAGE_DIR / folder, _PACKAGE_DIR.parent / folder):
        if candidate.is_dir():
            return str(candidate)
    raise FileNotFoundError(f"llmtrain's {folder}/ folder is missing next to {_PACKAGE_DIR}; reinstall llmtrain")


CONF_DIR = _locate("conf")
RECIPES_DIR = _locate("recipes")
CACHE_DIR = Path(os.environ.get("LLMTRAIN_CACHE", Path.home() / ".cache" / "llmtrain"))
