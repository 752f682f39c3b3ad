"""Experiment tracking on rank 0: wandb (online / offline / disabled) and ``metrics.jsonl``."""

from __future__ import annotations

import json
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


class Tracker:
    """Logs scalar metrics per optimizer step. Only rank 0 writes; other ranks get a no-op.

    ``metrics.jsonl`` holds one JSON object per logged step (``{"step": int, ...}``), appended
    and flushed line by line so a crash loses at most the line being written.
    """

    def __init__(self, tracker_cfg: Any, run_dir: Path, run_name: str, config: dict, is_main: bool,
                 resume_step: int | None = None, run_id: str | None = None):
        """Open the tracker. ``resume_step``: the step a resumed run continues after (None for a
        fresh start); ``run_id``: the tracker run id stored in that checkpoint.

        ``metrics.jsonl`` on resume keeps exactly the records of steps <= ``resume_step`` (the
        steps logged after that checkpoint are re-run); on a fresh start an existing file is
        moved aside to ``metrics.jsonl.<n>.old``, never overwritten. wandb resumes the stored run
        id; offline, it writes a new offline folder with the same id (``wandb sync`` both).
        """
        self.is_main = is_main
        self._wandb_run = None
        self._jsonl = None
        self.run_id = run_id
        if not is_main:
            return
        path = run_dir / "metrics.jsonl"
        if resume_step is None:
            _move_aside(path)
        else:
            _truncate_after(path, resume_step)
        self._jsonl = open(path, "a", encoding="utf-8")
        mode = resolve_wandb_mode(tracker_cfg.wandb_mode)
        if mode != "disabled":
            import wandb

            self.run_id = run_id or secrets.token_hex(4)  # os.urandom: leaves the training RNG alone
            self._wandb_run = wandb.init(
                project=tracker_cfg.project, entity=tracker_cfg.entity, mode=mode, id=self.run_id,
                resume="allow" if run_id else None, name=tracker_cfg.run_name or run_name,
                tags=list(tracker_cfg.tags), config=config, dir=str(run_dir))
            if run_id and mode == "offline":
                log.warning("wandb offline: continuing run id %s in a new offline folder; `wandb sync` the run's "
                            "offline folders in order to upload one run", run_id)
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


def _move_aside(path: Path) -> None:
    if path.exists():
        n = 1
        while path.with_name(f"{path.name}.{n}.old").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.{n}.old"))


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step``; atomically (write, then rename)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by the crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
