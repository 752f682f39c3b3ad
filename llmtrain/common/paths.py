"""Where llmtrain's files live, and the file mode they get.

The shipped configs: next to the package when installed, at the repo root in a checkout. The
cache: ``LLMTRAIN_CACHE`` (default ``~/.cache/llmtrain``). :func:`follow_umask`: written files
readable as the process umask allows.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # llmtrain/


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
# The table of the example data files with a download command each, and the file each data
# preset (or a mixture's source of that name) is shown with there: missing-data errors point to them.
DOWNLOADS_DOC = "docs/data.md#downloads"
PRESET_DOWNLOADS = {"tinyshakespeare": "input.txt", "alpaca": "alpaca_data.json", "chat": "sharegpt.json",
                    "sharegpt": "sharegpt.json", "prompts": "gsm8k_train.jsonl",
                    "preference": "hh_rlhf_harmless_test.jsonl.gz"}


def follow_umask(folder: Path, only: str | None = None) -> None:
    """Give the files in ``folder`` (or its file named ``only``) the mode every other file of the
    run gets (0o666 minus the process umask). safetensors creates ``model.safetensors`` with mode
    0600, which teammates on a shared file system cannot read."""
    umask = _process_umask()
    for path in folder.iterdir():
        if path.is_file() and (only is None or path.name == only):
            path.chmod(0o666 & ~umask)


def _process_umask() -> int:
    # Linux reports the umask without changing it; os.umask() must set it to read it, which
    # would briefly apply to files other threads (wandb's) create meanwhile.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
