"""Experiment tracking on rank 0: ``metrics.jsonl`` always, plus the backends named in
``tracker.backends`` (one module each: :mod:`.jsonl`, :mod:`.wandb_backend`, :mod:`.tensorboard`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmtrain.tracking.wandb_backend import resolve_wandb_mode, wandb_api_key_configured  # noqa: F401  (public)

log = logging.getLogger("llmtrain")

BACKENDS = ("wandb", "tensorboard")


class Tracker:
    """Logs scalar metrics per optimizer step to every configured backend. Only rank 0 writes;
    other ranks get a no-op.
    """

    def __init__(self, tracker_cfg: Any, run_dir: Path, run_name: str, config: dict, is_main: bool,
                 resume_step: int | None = None, run_id: str | None = None, config_yaml: str = ""):
        """Open the backends. ``resume_step``: the step a resumed run continues after (None for a
        fresh start); ``run_id``: the wandb run id stored in that checkpoint. Each backend keeps
        exactly one value per step across resumes (see each module)."""
        from llmtrain.tracking.jsonl import JsonlBackend

        self.is_main = is_main
        self.run_id = run_id
        self._backends: list[Any] = []
        if not is_main:
            return
        self._backends.append(JsonlBackend(run_dir, resume_step))
        backends = list(tracker_cfg.backends)
        mode = resolve_wandb_mode(tracker_cfg.wandb_mode)
        if "wandb" in backends and mode != "disabled":
            from llmtrain.tracking.wandb_backend import WandbBackend

            wandb_backend = WandbBackend(tracker_cfg, mode, run_dir, run_name, config, run_id)
            self.run_id = wandb_backend.run_id
            self._backends.append(wandb_backend)
        if "tensorboard" in backends:
            from llmtrain.tracking.tensorboard import TensorBoardBackend

            self._backends.append(TensorBoardBackend(run_dir, config_yaml, resume_step))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for backend in self._backends:
            backend.log(metrics, step)

    def flush(self) -> None:
        """Make every step logged so far durable (called before a checkpoint is written)."""
        for backend in self._backends:
            backend.flush()

    def finish(self) -> None:
        for backend in self._backends:
            backend.finish()
        self._backends = []
