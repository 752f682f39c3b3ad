"""MLflow: a tracking server (``tracker.mlflow_uri=http://...``) or a local store, rank 0."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("llmtrain")


def default_uri(run_dir: Path) -> str:
    """The local store used when ``tracker.mlflow_uri`` is unset: a SQLite file in the run."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def check_reachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why the MLflow server at ``uri`` cannot be used, or None (local stores always can)."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            return None if response.status == 200 else f"GET /health answered {response.status}"
    except (urllib.error.URLError, OSError) as err:
        return f"{err}"


def log_metrics(client: Any, run_id: str, metrics: dict[str, float], step: int) -> None:
    """Log ``metrics`` at ``step`` to MLflow run ``run_id`` in one request (timestamped now)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def _flatten(config: dict, prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = str(value)[:6000]  # MLflow's limit on a parameter value
    return flat


class MlflowBackend:
    """One MLflow run per training run: the flattened resolved config as parameters, the config
    (and, at the end, the run report if there is one) as artifacts, metrics per step.

    Exact across resumes: MLflow cannot delete logged values, so when the stored run holds steps
    after the checkpoint being resumed (a crash after the save), the run continues as a new
    MLflow run that carries the history up to the checkpoint; the old run is tagged
    ``llmtrain.superseded_by`` and marked FAILED. Otherwise the stored run itself continues.
    """

    def __init__(self, tracker_cfg: Any, run_dir: Path, run_name: str, config: dict, config_yaml: str,
                 resume_step: int | None, run_id: str | None):
        from mlflow.tracking import MlflowClient

        uri = tracker_cfg.mlflow_uri or default_uri(run_dir)
        problem = check_reachable(uri)  # fail in seconds, not after MLflow's minutes of HTTP retries
        if problem:
            raise RuntimeError(f"tracker.mlflow_uri={uri} is unreachable: {problem}")
        self._client = MlflowClient(tracking_uri=uri)
        experiment_name = tracker_cfg.mlflow_experiment or tracker_cfg.project
        experiment = self._client.get_experiment_by_name(experiment_name)
        # A store without a server (SQLite, files) would put artifacts in ./mlruns of whatever
        # directory the run was launched from: keep them in the run directory instead.
        artifacts = None if uri.startswith(("http://", "https://")) else (run_dir / "mlartifacts").resolve().as_uri()
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(
            experiment_name, artifact_location=artifacts)
        tags = {"llmtrain.run_dir": str(run_dir), **{f"llmtrain.tag.{t}": "true" for t in tracker_cfg.tags}}
        name = tracker_cfg.run_name or run_name
        if run_id is not None and resume_step is not None:
            self.run_id = self._continue(run_id, resume_step, experiment_id, name, tags)
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
            self._log_params(_flatten(config))
            self._client.log_text(self.run_id, config_yaml, "config.yaml")
        log.info("mlflow run %s (experiment %s) at %s", self.run_id, experiment_name, uri)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
            self._client.log_batch(self.run_id, params=items[start:start + 100])

    def _continue(self, run_id: str, resume_step: int, experiment_id: str, name: str, tags: dict) -> str:
        from mlflow.entities import Metric

        old = self._client.get_run(run_id)
        history = {key: self._client.get_metric_history(run_id, key) for key in old.data.metrics}
        if not any(m.step > resume_step for values in history.values() for m in values):
            self._client.update_run(run_id, status="RUNNING")
            return run_id
        new_id = self._client.create_run(experiment_id, run_name=name,
                                         tags={**tags, "llmtrain.continues": run_id}).info.run_id
        self.run_id = new_id
        self._log_params(dict(old.data.params))
        kept = [Metric(m.key, m.value, m.timestamp, m.step) for values in history.values() for m in values
                if m.step <= resume_step]
        for start in range(0, len(kept), 1000):
            self._client.log_batch(new_id, metrics=kept[start:start + 1000])
        for artifact in ("config.yaml",):
            try:
                local = self._client.download_artifacts(run_id, artifact)
                self._client.log_artifact(new_id, local)
            except Exception:  # noqa: BLE001  (an artifact store we cannot read: the run still continues)
                pass
        self._client.set_tag(run_id, "llmtrain.superseded_by", new_id)
        self._client.set_terminated(run_id, status="FAILED")
        log.warning("mlflow: run %s logged steps after checkpoint step %d (a crash after that save); continuing "
                    "as run %s with its history up to step %d", run_id, resume_step, new_id, resume_step)
        return new_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        log_metrics(self._client, self.run_id, metrics, step)

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))

    def flush(self) -> None:
        pass  # every log call is a synchronous request

    def finish(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")
