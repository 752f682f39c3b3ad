"""Experiment tracking on rank 0: ``metrics.jsonl`` always, plus the backends named in
``tracker.backends`` (one module each: :mod:`.jsonl`, :mod:`.wandb_backend`, :mod:`.tensorboard`,
:mod:`.mlflow_backend`). A backend that fails mid-run is dropped with a warning: losing a tracker
never stops training, and ``metrics.jsonl`` is never lost.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmtrain.config.schema import TRACKER_BACKENDS as BACKENDS  # noqa: F401  (public; validate() checks the names)
from llmtrain.monitoring.tracking.wandb_backend import resolve_wandb_mode, wandb_api_key_configured  # noqa: F401  (public)

log = logging.getLogger("llmtrain")


class Tracker:
    """Logs scalar metrics per optimizer step to every configured backend. Only rank 0 writes;
    other ranks get a no-op.
    """

    def __init__(self, tracker_cfg: Any, run_dir: Path, run_name: str, config: dict, is_main: bool,
                 resume_step: int | None = None, run_id: str | None = None, config_yaml: str = "",
                 mlflow_run_id: str | None = None, log_every: int = 1):
        """Open the backends. ``log_every``: the step cadence of :meth:`should_log`
        (``trainer.log_every``; 0 = only records the loop must log anyway). ``resume_step``: the step a resumed run continues after (None for a
        fresh start); ``run_id`` / ``mlflow_run_id``: the wandb / MLflow run ids stored in that
        checkpoint. Each backend keeps exactly one value per step across resumes (see each
        module).

        Raises:
            RuntimeError: a backend cannot start and ``tracker.on_error=raise`` (the default);
                with ``warn`` the run trains without it.
        """
        from llmtrain.monitoring.tracking.jsonl import JsonlBackend

        self.is_main, self.log_every = is_main, log_every
        self.run_id, self.mlflow_run_id = run_id, mlflow_run_id
        self._backends: list[Any] = []
        self.redone_records: list[dict] = []
        self.kept_records: list[dict] = []  # metrics.jsonl's records up to resume_step (rank 0)
        if not is_main:
            return
        jsonl = JsonlBackend(run_dir, resume_step)
        self.redone_records = jsonl.dropped  # logged by a crashed process after its last checkpoint
        self.kept_records = jsonl.kept
        self._backends.append(jsonl)
        backends = list(tracker_cfg.backends)
        mode = resolve_wandb_mode(tracker_cfg.wandb_mode)
        if "wandb" in backends and mode != "disabled":
            from llmtrain.monitoring.tracking.wandb_backend import WandbBackend

            wandb_backend = WandbBackend(tracker_cfg, mode, run_dir, run_name, config, run_id, resume_step, jsonl.kept)
            self.run_id = wandb_backend.run_id
            self._backends.append(wandb_backend)
        if "tensorboard" in backends:
            from llmtrain.monitoring.tracking.tensorboard import TensorBoardBackend

            self._backends.append(TensorBoardBackend(run_dir, config_yaml, resume_step))
        if "mlflow" in backends:
            from llmtrain.monitoring.tracking.mlflow_backend import MlflowBackend

            try:
                mlflow_backend = MlflowBackend(tracker_cfg, run_dir, run_name, config, config_yaml, resume_step,
                                               mlflow_run_id)
            except Exception as err:  # noqa: BLE001  (any client or server failure)
                if tracker_cfg.on_error != "warn":
                    raise RuntimeError(f"tracker.backends has mlflow but it could not start ({err}); fix "
                                       "tracker.mlflow_uri or set tracker.on_error=warn to train without it") from err
                log.warning("mlflow could not start (%s); training without it (tracker.on_error=warn)", err)
            else:
                self.mlflow_run_id = mlflow_backend.run_id
                self._backends.append(mlflow_backend)

    def should_log(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is on the logging cadence."""
        return bool(self.log_every and step % self.log_every == 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._each("log", metrics, step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """A table of ``rows`` (dicts with the same keys: the columns) at ``step``, in the backends
        that keep tables (wandb); ``metrics.jsonl`` holds scalars only (online RL's completions
        are in their own files)."""
        if rows:
            self._each("log_table", name, rows, step)

    def flush(self) -> None:
        """Make every step logged so far durable (called before a checkpoint is written)."""
        self._each("flush")

    def log_files(self, paths: list[Path]) -> None:
        """Attach files (the run report) to the run, in the backends that keep files."""
        self._each("log_files", paths)

    def commit(self, step: int) -> None:
        """The checkpoint of ``step`` counts (sealed): backends that hold steps back until then
        (wandb offline) may now write them."""
        self._each("commit", step)

    def finish(self, complete: bool = True) -> None:
        """End every backend. ``complete=False``: the run stopped after its last checkpoint
        (non-finite loss); steps held back for a checkpoint stay out (a resume logs them)."""
        if not complete:
            self._each("drop_uncommitted")
        self._each("finish")
        self._backends = []

    def _each(self, method: str, *args: Any) -> None:
        for backend in list(self._backends):
            if hasattr(backend, method):
                self._call(backend, method, *args)

    def _call(self, backend: Any, method: str, *args: Any) -> None:
        from llmtrain.monitoring.tracking.jsonl import JsonlBackend

        try:
            getattr(backend, method)(*args)
        except Exception as err:  # noqa: BLE001
            if isinstance(backend, JsonlBackend):
                raise  # the run's own record: a failure here (disk full) must be seen
            log.warning("tracker %s failed in %s (%s): dropped for the rest of this run; metrics.jsonl "
                        "keeps every step", type(backend).__name__, method, err)
            if backend in self._backends:
                self._backends.remove(backend)


def log_outside_training(tracker_cfg: Any, run_dir: Path, metrics: dict[str, float], step: int,
                         mlflow_run_id: str | None) -> list[str]:
    """Log one record at ``step`` to a run that is not training (``python -m llmtrain.evaluate``
    on one of its checkpoints): ``metrics.jsonl``, TensorBoard (a new event file in the run's
    folder) and the run's MLflow run, per ``tracker.backends``. wandb is left out: its history
    only grows, and the run's offline folders are closed; an in-loop evaluation
    (``trainer.eval_tasks``) reaches it. Returns the backends written.
    """
    from llmtrain.monitoring.tracking.jsonl import append_record

    append_record(run_dir, metrics, step)
    written = ["metrics.jsonl"]
    backends = list(tracker_cfg.get("backends", []))
    if "tensorboard" in backends:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        for key, value in metrics.items():
            writer.add_scalar(key, value, global_step=step)
        writer.close()
        written.append("tensorboard")
    if "mlflow" in backends and mlflow_run_id:
        from mlflow.tracking import MlflowClient

        from llmtrain.monitoring.tracking.mlflow_backend import default_uri, log_metrics

        log_metrics(MlflowClient(tracking_uri=tracker_cfg.get("mlflow_uri") or default_uri(run_dir)), mlflow_run_id,
                    metrics, step)
        written.append("mlflow")
    return written
