"""llmtrain's Hydra launchers (``hydra/launcher=slurm``, ``slurm_local``), in the ``hydra_plugins``
namespace where Hydra looks for launchers: hydra-submitit-launcher's, with :mod:`llmtrain.planning.launcher`'s
checks and sbatch rendering."""
