"""Error types for bad user input, in a leaf module: validation, data and model code raise them
without importing each other (or any parallel code). ``python -m llmtrain`` turns each into one
``llmtrain: error: ...`` line and exit status 2."""


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot work; the message names field and fix."""


class DataError(ValueError):
    """The data files are missing, empty or malformed; the message names the file, the record
    index and the field where one is at fault."""


class TrainingStopped(RuntimeError):
    """Training stopped itself to protect the run (a non-finite loss or gradient norm): nothing
    was saved or exported from the bad state; the message names the step, the value and the
    last healthy checkpoint. ``python -m llmtrain`` exits with status 3."""
