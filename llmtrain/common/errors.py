"""Every error type llmtrain reports to its user, in a leaf module: validation, data, model,
launch and checkpoint code raise them without importing each other (or any parallel code).

All derive from :class:`LlmtrainError`. ``python -m llmtrain`` turns each into one
``llmtrain: error: ...`` line and exit status 2, except :class:`TrainingStopped` (status 3).
Each also keeps the built-in base it had before the common base existed (``ValueError``,
``RuntimeError``), so ``except ValueError`` and the like still catch it.
"""


class LlmtrainError(Exception):
    """Base of every error llmtrain reports to its user: the message says what is wrong and how
    to fix it, so the command line prints it as one line instead of a traceback."""


class ConfigError(LlmtrainError, ValueError):
    """A configuration value (or combination) that cannot work; the message names field and fix."""


class DataError(LlmtrainError, ValueError):
    """The data files are missing, empty or malformed; the message names the file, the record
    index and the field where one is at fault."""


class ModelSourceError(LlmtrainError, RuntimeError):
    """The configured weights or tokenizer cannot be found; the message says how to get them."""


class LaunchError(LlmtrainError, RuntimeError):
    """The launch environment is inconsistent (e.g. RANK without WORLD_SIZE)."""


class ResumeError(LlmtrainError, RuntimeError):
    """An explicitly requested checkpoint is missing or invalid, or resuming cannot work (the run
    directory is locked, or the checkpoint belongs to other settings or other base weights)."""


class TrainingStopped(LlmtrainError, RuntimeError):
    """Training stopped itself to protect the run (a non-finite loss or gradient norm): nothing
    was saved or exported from the bad state; the message names the step, the value and the
    last healthy checkpoint. ``python -m llmtrain`` exits with status 3."""
