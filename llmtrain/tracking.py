"""Experiment tracking on rank 0: wandb (online / offline / disabled) and ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
import netrc
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("llmtrain")


def wandb_api_key_configured() -> bool:
    """True when wandb could authenticate: WANDB_API_KEY or a ~/.netrc entry for its host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


def resolve_wandb_mode(mode: str) -> str:
    """``auto`` becomes ``online`` with an API key, ``offline`` without; other modes unchanged."""
    if mode == "auto":
        return "online" if wandb_api_key_configured() else "offline"
    return mode


class Tracker:
    """Logs scalar metrics per optimizer step. Only rank 0 writes; other ranks get a no-op.

    ``metrics.jsonl`` holds one JSON object per logged step (``{"step": int, ...}``), appended
    and flushed line by line so a crash loses at most the line being written.
    """

    def __init__(self, tracker_cfg: Any, run_dir: Path, run_name: str, config: dict, is_main: bool):
        self.is_main = is_main
        self._wandb_run = None
        self._jsonl = None
        if not is_main:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        mode = resolve_wandb_mode(tracker_cfg.wandb_mode)
        if mode != "disabled":
            import wandb

            self._wandb_run = wandb.init(
                project=tracker_cfg.project, entity=tracker_cfg.entity, mode=mode,
                name=tracker_cfg.run_name or run_name, tags=list(tracker_cfg.tags), config=config,
                dir=str(run_dir))
            log.info("wandb %s run %s in %s", mode, self._wandb_run.id, run_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.is_main:
            return
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self._jsonl.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
