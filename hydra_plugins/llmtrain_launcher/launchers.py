"""hydra-submitit-launcher's launchers with llmtrain's checks (:class:`llmtrain.planning.launcher.CheckedLaunch`).

Hydra imports every module of the ``hydra_plugins`` namespace at start-up, so this one imports
cleanly without the ``slurm`` extra: it then defines no launcher (:data:`LAUNCHERS` is empty), and
``python -m llmtrain`` refuses ``hydra/launcher=slurm`` with the extra to install.
"""

from llmtrain.planning.launcher import CheckedLaunch

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as _PluginLocal
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _PluginSlurm
except ImportError:  # no slurm extra
    LAUNCHERS: tuple = ()
else:
    class SlurmLauncher(CheckedLaunch, _PluginSlurm):
        """SLURM (``hydra/launcher=slurm``)."""

    class LocalLauncher(CheckedLaunch, _PluginLocal):
        """Local processes (``hydra/launcher=slurm_local``)."""

    LAUNCHERS = (SlurmLauncher, LocalLauncher)
