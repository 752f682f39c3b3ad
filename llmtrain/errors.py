"""Error types for bad user input, in a leaf module: validation, data and model code raise them
without importing each other (or any parallel code). ``python -m llmtrain`` turns each into one
``llmtrain: error: ...`` line and exit status 2."""


class ConfigError(ValueError):
    """A configuration value (or combination) that cannot work; the message names field and fix."""


class DataError(ValueError):
    """The data files are missing, empty or malformed; the message names the file, the record
    index and the field where one is at fault."""
