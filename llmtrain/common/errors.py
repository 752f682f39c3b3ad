"""Every error type llmtrain reports to its user, in a leaf module: validation, data, model,
launch and checkpoint code raise them without importing each other (or any parallel code).

All derive from :class:`LlmtrainError`; :func:`require_extra` refuses a feature whose optional
package is missing with a :class:`MissingExtra` naming the extra that installs it, and
:func:`import_object` loads a user's ``module:name`` or refuses it naming the config field. ``python -m llmtrain`` turns each into one
``llmtrain: error: ...`` line and exit status 2, except :class:`TrainingStopped` (status 3) and
:class:`ChildDied` (status 5).
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


class ChildDied(LlmtrainError, RuntimeError):
    """A process the run started and depends on (the vLLM server of ``rollout.engine=vllm``)
    died mid-run; the message names it, how it ended, its log and the fix. What was left of it
    has been stopped. ``python -m llmtrain`` exits with status 5."""


class MissingExtra(LlmtrainError, ImportError):
    """An optional feature's package is not installed; the message names the feature, the
    package and the extra of llmtrain that installs it (``pip install "llmtrain[EXTRA]"``, or
    ``pip install ".[EXTRA]"`` in a clone)."""


# The optional extras of pyproject.toml and what each installs.
EXTRAS = {"eval": "lm-eval", "lowbit": "torchao", "tracking": "tensorboard and mlflow", "slurm": "hydra-submitit-launcher and submitit",
          "s3": "s3fs", "verifiers": "verifiers"}


def require_extra(module: str, extra: str, feature: str, instead: str = "") -> None:
    """Refuse ``feature`` when ``module`` (of the ``extra`` named) cannot be imported here;
    ``instead``: what to do without it (``"or drop trainer.eval_tasks"``), said last.

    Raises:
        MissingExtra: ``FEATURE needs MODULE, which is not installed (llmtrain's EXTRA extra: ...):
            pip install "llmtrain[EXTRA]" (in a clone: pip install ".[EXTRA]")``.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        found = False
    if not found:
        raise MissingExtra(f"{feature} needs {module}, which is not installed (llmtrain's {extra} extra: "
                           f"{EXTRAS[extra]}): pip install \"llmtrain[{extra}]\" (in a clone: pip install \".[{extra}]\")"
                           + (f", {instead}" if instead else ""))


def did_you_mean(word: str, options: "list[str] | set[str]") -> str:
    """``"did you mean CLOSEST? "`` for the option closest to a misspelt ``word`` (difflib's
    ratio >= 0.5, as for unknown keys and group options), or ``""`` when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), sorted(options), n=1, cutoff=0.5)
    return f"did you mean {close[0]}? " if close else ""


def import_object(spec: str, field: str, usage: str) -> object:
    """The object a config field names as ``module:name`` (a user's objective, rollout engine or
    reward function), imported. ``field``: the field as the user wrote it (``reward.functions[0]``);
    ``usage``: what to give instead (``importable.module:function``).

    Raises:
        ConfigError: no ``:name`` part, the module cannot be found or fails as it loads (a
            syntax error, with its file and line), or it has no such name; each naming the field.
    """
    import importlib

    module_name, _, name = str(spec).partition(":")
    if not name:
        raise ConfigError(f"{field}={spec!r} is not {usage}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field}={spec!r} cannot be imported ({err}); give {usage}") from None
    except Exception as err:  # noqa: BLE001  (a user's module failing as it loads: a syntax error, its own raise)
        where = f" ({err.filename}:{err.lineno})" if isinstance(err, SyntaxError) else ""
        raise ConfigError(f"{field}={spec!r}: importing {module_name} failed with {type(err).__name__}{where}: "
                          f"{err}") from err
    try:
        return getattr(module, name)
    except AttributeError:
        hint = did_you_mean(name, [n for n in dir(module) if not n.startswith("_")])
        raise ConfigError(f"{field}={spec!r} cannot be imported (module {module_name!r} has no {name!r}); "
                          f"{hint}give {usage}") from None
