"""Clusters through Hydra's submitit launcher (``pip install 'llmtrain[slurm]'``):
``python -m llmtrain -m hydra/launcher=slurm hydra.launcher.nodes=4 ...`` submits one SLURM job per
sweep point whose tasks become the run's torch.distributed ranks; ``hydra/launcher=slurm_local``
runs the same job as local processes (submitit's local executor), for a try on one machine.

The presets (``conf/hydra/launcher/slurm.yaml``, ``slurm_local.yaml``) name launchers in
``hydra_plugins.llmtrain_launcher`` (Hydra loads launchers from that namespace only):
hydra-submitit-launcher's own, which with :class:`CheckedLaunch` first check every sweep job's composed config against the
job's world size (``nodes x tasks_per_node``) with :func:`llmtrain.config.validate.validate`, so a layout
that cannot run is one line before anything is submitted or written, and can print the sbatch
script instead of submitting it (``hydra.launcher.render_only=true``).

Inside a job, each task initialises torch.distributed from submitit's job environment
(:func:`llmtrain.parallel.distributed.init_distributed`); a preemption or time-limit signal saves through
llmtrain's preemption path and is then handed to submitit, which requeues the job (its
``checkpoint`` resubmits the same sweep job), and the requeued job resumes from that checkpoint
(``trainer.resume=auto`` in the same run directory). The plugin's own presets
(``hydra/launcher=submitit_slurm`` / ``submitit_local``) run the same way, without the check.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from omegaconf import OmegaConf, open_dict

# Keys of our presets that are ours, not submitit's (they never reach the executor).
OWN_KEYS = ("render_only",)


def world_size_of(params: dict[str, Any]) -> int:
    """The ranks a job of these launcher parameters starts: ``nodes x tasks_per_node``."""
    return int(params.get("nodes", 1)) * int(params.get("tasks_per_node", 1))


def check_jobs(launcher: Any, job_overrides: Sequence[Sequence[str]], world_size: int) -> None:
    """Validate each sweep job's composed config on ``world_size`` ranks; a bad one ends the
    launch with llmtrain's one-line error (exit status 2) before anything is submitted."""
    from llmtrain.config.validate import validate
    from llmtrain.common.errors import LlmtrainError
    from llmtrain.models.build import language_config
    from llmtrain.parallel.dims import ParallelDims

    params = launcher.params
    for key in ("nodes", "tasks_per_node"):
        if not isinstance(params.get(key), int) or params[key] < 1:
            print(f"llmtrain: error: hydra.launcher.{key}={params.get(key)} must be a whole number >= 1",
                  file=sys.stderr, flush=True)
            sys.exit(2)
    for number, overrides in enumerate(job_overrides):
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(cfg):
            cfg.pop("hydra", None)
        try:
            if cfg.trainer.eval_tasks:
                from llmtrain.evaluation.in_loop import check

                check(cfg.trainer)
            layout = validate(cfg, world_size)
            # The degrees against the model's heads and layers (its config only, no weights).
            ParallelDims.from_layout(layout).check_model_config(language_config(cfg.model), cfg.recipe.pp_stages_per_rank)
        except LlmtrainError as err:
            where = " ".join(overrides) or "(no overrides)"
            print(f"llmtrain: error: sweep job {number} ({where}) on hydra.launcher.nodes x tasks_per_node = "
                  f"{world_size} ranks: {err}", file=sys.stderr, flush=True)
            sys.exit(2)


def render_sbatch(params: dict[str, Any], folder: str = "submitit") -> str:
    """The sbatch script submitit would submit for a job of these (SLURM preset) parameters,
    mapped onto submitit's executor exactly as hydra-submitit-launcher maps them. Works off a
    cluster too: submitit's check for ``srun`` is answered for it (nothing is submitted)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from submitit.slurm import slurm

    folder = params.get("submitit_folder", folder)
    params = {k: v for k, v in params.items() if k not in OWN_KEYS and k != "submitit_folder"}
    affinity = slurm.SlurmExecutor.affinity
    slurm.SlurmExecutor.affinity = classmethod(lambda cls: 1)  # type: ignore[method-assign]
    try:
        executor = submitit.AutoExecutor(cluster="slurm", folder=folder,
                                         slurm_max_num_timeout=params.pop("max_num_timeout", 0))
    finally:
        slurm.SlurmExecutor.affinity = affinity  # type: ignore[method-assign]
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    inner = executor._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "UID")


class CheckedLaunch:
    """What llmtrain's launchers add to the plugin's (see the module); mixed in before them."""

    def __init__(self, **params: Any) -> None:
        self.own = {k: params.pop(k) for k in OWN_KEYS if k in params}
        super().__init__(**params)  # type: ignore[call-arg]

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        try:
            check_jobs(self, job_overrides, world_size_of(self.params))  # type: ignore[attr-defined]
            if self.own.get("render_only"):
                print(render_sbatch(dict(self.params)))  # type: ignore[attr-defined]
                sys.exit(0)
        except SystemExit:
            _remove_untouched_sweep_dir(str(self.config.hydra.sweep.dir))  # type: ignore[attr-defined]
            raise
        folder = str(self.params["submitit_folder"]).replace("%j", "<job id>")  # type: ignore[attr-defined]
        print(f"llmtrain: {len(job_overrides)} job(s) of {world_size_of(self.params)} ranks each; their output: "  # type: ignore[attr-defined]
              f"{folder}/<job id>_<rank>_log.out (and .err); each trains in its own folder of "
              f"{self.config.hydra.sweep.dir}", flush=True)  # type: ignore[attr-defined]
        return super().launch(job_overrides, initial_job_idx)  # type: ignore[misc]


def _remove_untouched_sweep_dir(sweep_dir: str) -> None:
    """Hydra's sweeper writes ``multirun.yaml`` into the sweep folder before it launches: when
    the launch stops before submitting, a folder holding only that file goes again."""
    from pathlib import Path

    folder = Path(sweep_dir).absolute()
    if folder.is_dir() and [p.name for p in folder.iterdir()] == ["multirun.yaml"]:
        (folder / "multirun.yaml").unlink()
        while folder != Path.cwd() and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # and the parents it made (multirun/)
            folder = folder.parent
