"""TensorBoard event files in ``run_dir/tensorboard`` (``torch.utils.tensorboard``), rank 0."""

from __future__ import annotations

from pathlib import Path

from llmtrain.monitoring.tracking.jsonl import move_aside


class TensorBoardBackend:
    """Scalars per step, and the resolved config as text at step 0.

    Resume keeps one value per step: the writer is opened with ``purge_step`` = the resumed
    step + 1, so TensorBoard's readers drop the events a crashed run wrote after its last
    checkpoint (those steps are trained again). The trainer flushes the writer at every save,
    so every step up to a checkpoint is on disk before the checkpoint counts.
    """

    def __init__(self, run_dir: Path, config_yaml: str, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        folder = run_dir / "tensorboard"
        if resume_step is None:
            move_aside(folder)
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=None if resume_step is None else resume_step + 1)
        if resume_step is None:
            self._writer.add_text("config", "```yaml\n" + config_yaml + "\n```", global_step=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self) -> None:
        self._writer.close()
