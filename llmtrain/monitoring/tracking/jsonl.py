"""``metrics.jsonl``: one JSON object per logged step, always written (rank 0)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class JsonlBackend:
    """Appends ``{"step": int, ...}`` lines, flushed one by one so a crash loses at most the line
    being written. On resume the records of steps <= ``resume_step`` are kept (later ones are
    re-run); on a fresh start an existing file is moved aside to ``metrics.jsonl.<n>.old``."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        path = run_dir / "metrics.jsonl"
        self.dropped: list[dict] = []  # records after resume_step: steps a crash made the run redo
        self.kept: list[dict] = []  # records up to resume_step, in step order
        if resume_step is None:
            move_aside(path)
        else:
            self.kept, self.dropped = _truncate_after(path, resume_step)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # "time": when the record was written (Unix seconds); a resume measures the restart gap by it.
        self._file.write(json.dumps({"step": step, **metrics, "time": time.time()}) + "\n")
        self._file.flush()

    def flush(self) -> None:
        os.fsync(self._file.fileno())

    def finish(self) -> None:
        self._file.close()


def append_record(run_dir: Path, metrics: dict[str, float], step: int) -> None:
    """Append one record to ``run_dir/metrics.jsonl`` outside a training process (a task
    evaluation of a run that is not training), durable before it returns."""
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps({"step": step, **metrics, "time": time.time()}) + "\n")
        file.flush()
        os.fsync(file.fileno())


def move_aside(path: Path) -> None:
    """Rename an existing ``path`` to ``<name>.<n>.old`` (the first free n): never overwritten."""
    if path.exists():
        n = 1
        while path.with_name(f"{path.name}.{n}.old").exists():
            n += 1
        path.rename(path.with_name(f"{path.name}.{n}.old"))


def _truncate_after(path: Path, step: int) -> tuple[list[dict], list[dict]]:
    """Keep the records of steps <= ``step``, atomically (write, then rename); returns the
    records kept and the records dropped."""
    if not path.exists():
        return [], []
    lines, kept, dropped = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            if record["step"] <= step:
                lines.append(line)
                kept.append(record)
            else:
                dropped.append(record)
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by the crash
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
    return kept, dropped
