"""Weights & Biases (online / offline), rank 0."""

from __future__ import annotations

import logging
import netrc
import os
import secrets
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


class WandbBackend:
    """A wandb run. Resume continues the stored run id; offline, a resumed process writes a new
    offline folder with the same id (``wandb sync`` them in order)."""

    def __init__(self, tracker_cfg: Any, mode: str, run_dir: Path, run_name: str, config: dict, run_id: str | None):
        import wandb

        self.run_id = run_id or secrets.token_hex(4)  # os.urandom: leaves the training RNG alone
        self._run = wandb.init(project=tracker_cfg.project, entity=tracker_cfg.entity, mode=mode, id=self.run_id,
                               resume="allow" if run_id else None, name=tracker_cfg.run_name or run_name,
                               tags=list(tracker_cfg.tags), config=config, dir=str(run_dir))
        if run_id and mode == "offline":
            log.warning("wandb offline: continuing run id %s in a new offline folder; `wandb sync` the run's "
                        "offline folders in order to upload one run", run_id)
        log.info("wandb %s run %s in %s", mode, self._run.id, run_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def flush(self) -> None:
        pass  # wandb's service process owns its files

    def finish(self) -> None:
        self._run.finish()
