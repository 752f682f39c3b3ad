"""Weights & Biases (online / offline), rank 0.

Exactness across crashes. wandb's offline writer buffers its transaction log (``run-<id>.wandb``)
and a SIGKILL loses whatever it had not yet written, while a resumed process that re-trains steps
a crashed one had logged would log them a second time. So, offline, a step reaches wandb only once
a checkpoint that includes it counts (:meth:`WandbBackend.commit`): no offline folder ever holds a
step that a resume trains again. At a resume, the earlier folders of the run are read back and
every step up to the checkpoint that none of them holds is logged again from ``metrics.jsonl``
(which is exact), so ``wandb sync`` of the run's folders in name order uploads steps 1..N once
each. Online, steps are logged as they happen (a dashboard is live); the server ignores a step
lower than the run's current one, so steps a crash made the run redo keep their first values,
and the steps the server never received are filled from ``metrics.jsonl`` in the same way.

Output. wandb runs in its own quiet mode with its informational lines off (:func:`wandb_settings`):
no offline-mode notice, folder and viewer hints at start (llmtrain's one line says where the run
is), no run summary panel and sync hints after llmtrain's closing lines; its warnings and errors
still show. A user's own
``WANDB_QUIET`` / ``WANDB_SILENT`` is kept as set, and llmtrain's debug mode
(``hydra.verbose=llmtrain``) shows wandb's full output.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Iterator

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


def wandb_settings() -> Any:
    """The ``wandb.Settings`` llmtrain starts a run with: ``quiet=True`` (wandb's own switch,
    as ``WANDB_QUIET=true``) and ``silent=True`` (the run's printer: the offline notice, folder and
    viewer hints; wandb's warnings and errors go through its terminal functions and still print),
    or None (wandb's defaults) when the user set ``WANDB_QUIET`` or
    ``WANDB_SILENT`` (settings passed to ``wandb.init`` would override them) or llmtrain's
    debug log is on."""
    import wandb

    from llmtrain.monitoring.console import debug_logging

    if "WANDB_QUIET" in os.environ or "WANDB_SILENT" in os.environ or debug_logging():
        return None
    return wandb.Settings(quiet=True, silent=True)


def offline_folders(run_dir: Path, run_id: str) -> list[Path]:
    """The offline folders of wandb run ``run_id`` in ``run_dir/wandb``, oldest first (their names
    start ``offline-run-YYYYMMDD_HHMMSS``): the order to ``wandb sync`` them in."""
    return sorted(p for p in (run_dir / "wandb").glob(f"offline-run-*-{run_id}") if p.is_dir())


def offline_history(folder: Path) -> dict[int, dict[str, Any]]:
    """The history rows an offline wandb folder holds on disk: ``{step: {key: value}}``.

    Reads the transaction log ``run-<id>.wandb`` that ``wandb sync`` uploads: a 7-byte header
    (``:W&B``, magic 0xBEE1, version) and then LevelDB's log format (32 KiB blocks of records, each
    a 7-byte header: CRC, length, type = full / first / middle / last) carrying ``Record`` protocol
    buffers. A record cut short by a crash ends the scan, as it ends ``wandb sync``'s.
    """
    import json

    from wandb.proto import wandb_internal_pb2

    rows: dict[int, dict[str, Any]] = {}
    for path in folder.glob("run-*.wandb"):
        for raw in _log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(raw)
            except Exception:  # noqa: BLE001  (protobuf's DecodeError: bytes the crash left half-written)
                break
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                rows[int(items.get("_step", record.history.step.num))] = items
    return rows


def _log_records(data: bytes, block: int = 32768) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        return
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(payload) < length:
            return  # zero fill or a record the crash cut short
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload


class WandbBackend:
    """A wandb run that holds each step once across crashes and resumes (see the module).

    ``kept_records``: the ``metrics.jsonl`` records of steps up to ``resume_step`` (the
    checkpoint resumed from), the source for steps earlier processes did not get to wandb.
    """

    def __init__(self, tracker_cfg: Any, mode: str, run_dir: Path, run_name: str, config: dict, run_id: str | None,
                 resume_step: int | None = None, kept_records: list[dict] | None = None):
        import wandb

        self.run_id = run_id or secrets.token_hex(4)  # os.urandom: leaves the training RNG alone
        self._deferred = mode == "offline"
        self._pending: list[tuple[int, dict]] = []  # offline: steps logged, not yet in a counted checkpoint
        held: dict[int, set[str]] = {}  # step -> the keys the earlier offline folders hold for it
        if run_id and resume_step is not None and self._deferred:
            for folder in offline_folders(run_dir, run_id):  # before init: it adds this process's folder
                for step, row in offline_history(folder).items():
                    held.setdefault(step, set()).update(row)
            if duplicated := sorted(s for s in held if s > resume_step):
                log.warning("wandb: the run's offline folders already hold steps %d-%d beyond checkpoint step %d "
                            "(a resume from an older checkpoint); `wandb sync` will upload those steps twice",
                            duplicated[0], duplicated[-1], resume_step)
        self._run = wandb.init(project=tracker_cfg.project, entity=tracker_cfg.entity, mode=mode, id=self.run_id,
                               resume="allow" if run_id else None, name=tracker_cfg.run_name or run_name,
                               tags=list(tracker_cfg.tags), config=config, dir=str(run_dir),
                               settings=wandb_settings())
        # wandb's history only grows. The lowest step it still takes: the server's next step
        # online, the step after the earlier offline folders' last one offline. Task scores of an
        # earlier checkpoint, which arrive after later steps, go in at or above it with eval/step,
        # the x-axis of every eval/* chart (_log_now).
        self._floor = max(held, default=-1) + 1 if self._deferred else self._run.step
        self._eval_row = -1  # the row that holds the last task score
        self._run.define_metric("eval/step")
        self._run.define_metric("eval/*", step_metric="eval/step")
        if run_id and resume_step is not None:
            # Online, the server's next step says what it already has; offline, the folders read above.
            first_missing = 0 if self._deferred else self._run.step
            # A task score of a held step that the folders lack (it arrived after that step was
            # written) goes in too, after the held steps (with eval/step).
            refill = [r for r in kept_records or [] if r["step"] >= first_missing and (
                r["step"] not in held or not set(r) - {"step", "time"} <= held[r["step"]])]
            for record in refill:
                self._log_now({k: v for k, v in record.items() if k not in ("step", "time")}, record["step"])
            if refill:
                log.info("wandb: logged %d step(s) up to %d again from metrics.jsonl (the crashed process had not "
                         "written them)", len(refill), refill[-1]["step"])
        if run_id and mode == "offline":
            log.warning("wandb offline: continuing run id %s in a new offline folder; `wandb sync` the run's "
                        "offline folders in name order (`wandb sync %s`) to upload one run", run_id,
                        run_dir / "wandb" / f"offline-run-*-{run_id}")
        log.info("wandb %s run %s in %s", mode, self._run.id, run_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._deferred:
            self._pending.append((step, dict(metrics)))
        else:
            self._log_now(metrics, step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """``rows`` as a ``wandb.Table`` under ``name`` at ``step`` (held back offline like the
        step's metrics); nested values (per-function rewards, message lists) as JSON text."""
        import json

        import wandb

        columns = list(rows[0])
        data = [[json.dumps(row.get(c), default=str) if isinstance(row.get(c), (dict, list)) else row.get(c)
                 for c in columns] for row in rows]
        self.log({name: wandb.Table(columns=columns, data=data)}, step)

    def _log_now(self, metrics: dict[str, float], step: int) -> None:
        if any(k.startswith("eval/") for k in metrics):
            # A task score of an earlier checkpoint: in the newest row, with its own step as
            # eval/step; one score per row (a second one the same step goes in the next).
            metrics, step = {**metrics, "eval/step": step}, max(step, self._floor)
            if step == self._eval_row:
                step += 1
            self._eval_row = step
        self._floor = max(self._floor, step)
        self._run.log(metrics, step=step)

    def commit(self, step: int) -> None:
        """The checkpoint of ``step`` counts: hand wandb every step up to it."""
        while self._pending and self._pending[0][0] <= step:
            logged_step, metrics = self._pending.pop(0)
            self._log_now(metrics, logged_step)

    def log_files(self, paths: list[Path]) -> None:
        """Upload copies of ``paths`` (the run report: small, written once at the end) placed in
        the run's files folder: ``save`` of a file outside it would symlink it there and warn
        "Symlinked 1 file into the W&B run directory" once per file."""
        import shutil

        files_dir = Path(self._run.dir)
        for path in paths:
            (files_dir / path.name).unlink(missing_ok=True)  # a link there would be written through
            shutil.copyfile(path, files_dir / path.name)
            self._run.save(str(files_dir / path.name), base_path=str(files_dir), policy="now", glob=False)

    def flush(self) -> None:
        pass  # wandb's service process owns its files; commit() decides what it gets

    def drop_uncommitted(self) -> None:
        """Leave out the steps after the last counted checkpoint (a run stopped by a non-finite
        loss): a resume trains them again; they stay in ``metrics.jsonl`` until then."""
        if self._pending:
            log.info("wandb: steps %d-%d after the last checkpoint are in metrics.jsonl only; a resume logs "
                     "them once", self._pending[0][0], self._pending[-1][0])
            self._pending = []

    def finish(self) -> None:
        """Hand wandb every step still held back, and end the run."""
        self.commit(self._pending[-1][0] if self._pending else 0)
        self._run.finish()
