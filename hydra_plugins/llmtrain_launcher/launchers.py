"""hydra-submitit-launcher's launchers with llmtrain's checks (:class:`llmtrain.planning.launcher.CheckedLaunch`)."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher as _PluginLocal
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _PluginSlurm

from llmtrain.planning.launcher import CheckedLaunch


class SlurmLauncher(CheckedLaunch, _PluginSlurm):
    """SLURM (``hydra/launcher=slurm``)."""


class LocalLauncher(CheckedLaunch, _PluginLocal):
    """Local processes (``hydra/launcher=slurm_local``)."""
