"""``python -m llmtrain``: the Hydra application (works under torchrun and accelerate launch)."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import time

# OpenMP threads that sleep while they wait instead of spinning (libgomp reads this when torch
# loads it, so before any torch import; OMP_WAIT_POLICY=ACTIVE restores spinning). A plain process
# runs one intra-op thread per core; with spinning, any other busy process on those cores made
# every parallel region wait out the descheduled thread's time slice: SmolLM2 on 2 cores next to
# one busy process took 35-46 s a step instead of 6.9 s (4.4 s on idle cores, where spinning
# gives 3.3 s). torchrun sets OMP_NUM_THREADS=1 for several ranks, where there is no waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from llmtrain.common.interrupt import hold_sigint, keep_exit_status, was_interrupted, watch_sigint


def _fail(err: Exception, status: int = 2, kind: str = "error") -> None:
    """Report ``err`` as one line and exit with ``status``.

    Under torchrun (torch elastic sets ``TORCHELASTIC_ERROR_FILE`` per rank) the line also goes
    to this rank's error file, which torchrun's failure summary shows as the root cause instead of
    "To enable traceback see ...", and only rank 0 prints it: every rank raises these alike, so
    the screen holds the message once, first. Another rank waits up to
    ``_OTHER_RANKS_WAIT_S`` before it exits, since torchrun stops every rank once one has exited
    and a rank 0 running behind would be stopped before it printed; torchrun's SIGTERM ends the
    wait at once. A rank that fails alone still reaches the screen through the summary. Without
    an error file every rank prints."""
    message = f"llmtrain: {kind}: {err}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as file:
                json.dump({"message": {"message": message, "extraInfo": {
                    "py_callstack": message, "timestamp": str(int(time.time()))}}}, file)
        except OSError:
            error_file = None
    if not error_file or os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a preemption request any more: end now
        time.sleep(_OTHER_RANKS_WAIT_S)
    if status == 130:
        keep_exit_status()
    sys.exit(status)


# Long enough for a rank 0 that is a few seconds behind (a loaded machine, a slower model load)
# to reach the same error; only a rank that fails alone pays it.
_OTHER_RANKS_WAIT_S = 5.0


def _stop_if_interrupted(err: BaseException, phase: str) -> None:
    """One line and exit status 130 where ``err`` ends a start-up the user stopped with Ctrl-C
    (:func:`~llmtrain.common.interrupt.was_interrupted`); otherwise return, for the caller to
    raise ``err`` again."""
    if was_interrupted(err):
        _fail(Exception(f"SIGINT (Ctrl-C) in start-up, {phase}: nothing was trained"), status=130, kind="interrupted")


# Nothing here imports torch at module level: ``--help`` and ``--cfg job`` answer from the
# config alone, in about a second. ``main`` imports llmtrain.parallel.distributed before anything imports
# DeepSpeed (it picks DeepSpeed's accelerator).
try:
    watch_sigint()  # Ctrl-C from here to the first step ends in one line (exit status 130), not a traceback
    import hydra
    from omegaconf import DictConfig

    from llmtrain.common.errors import ChildDied, ConfigError, LlmtrainError, TrainingStopped, require_extra
    from llmtrain.common.paths import CONF_DIR
    from llmtrain.config.compose import check_overrides, keep_typed_strings, register_configs
except BaseException as err:  # (a second Ctrl-C in a half-done import can raise anything)
    _stop_if_interrupted(err, "while importing llmtrain")
    raise

log = logging.getLogger("llmtrain")

# Interpreter exit's last garbage collection would traverse every object the run leaves (torch's,
# transformers', the model's: 0.3 s on the development machine); frozen, they are skipped. The
# process is ending: nothing it holds needs finding.
atexit.register(gc.freeze)


def check_recipe_selection(args: list[str]) -> None:
    """The recipe group is selected once, as ``+recipe=NAME``. Hydra lets a plain ``recipe=B``
    silently override ``+recipe=A`` in either order, so the run would not be the one the
    command line seems to ask for; both spellings together, or either twice, are refused.

    Raises:
        ConfigError: naming every selection given.
    """
    import re

    chosen = [a for a in args if re.match(r"^(\+\+|\+|~)?recipe(@[\w.]*)?(=|$)", a)]
    if len(chosen) > 1:
        raise ConfigError(f"the recipe is selected {len(chosen)} times ({', '.join(chosen)}); select it once, as "
                          "+recipe=NAME (a sweep: +recipe=A,B with -m)")
    if chosen and chosen[0].startswith("recipe"):
        raise ConfigError(f"{chosen[0]}: the recipe group has no default to override; select it with "
                          f"+{chosen[0]}")


def check_launcher_extra(args: list[str]) -> None:
    """``hydra/launcher=slurm`` and ``slurm_local`` are hydra-submitit-launcher's launchers, which
    the ``slurm`` extra installs.

    Raises:
        MissingExtra: a launcher preset of ours is chosen without it.
    """
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "hydra/launcher" and value in ("slurm", "slurm_local"):
            require_extra("hydra_plugins.hydra_submitit_launcher", "slurm", arg,
                          instead="or leave hydra/launcher out to run here")


def _register_launchers() -> None:
    """Make llmtrain's launchers (``hydra/launcher=slurm``, ``slurm_local``) known to Hydra's
    plugin registry. Hydra finds plugins by walking the ``hydra_plugins`` namespace's folders,
    which an editable install (setuptools' import finder) does not list; installed from a wheel
    they are found by the walk as well. Without the ``slurm`` extra there is nothing to add."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.llmtrain_launcher import launchers

    known = Plugins.instance().class_name_to_class
    for launcher in launchers.LAUNCHERS:
        known.setdefault(f"{launcher.__module__}.{launcher.__name__}", launcher)


try:
    register_configs()  # before @hydra.main composes: the recipes are options of the group
    _register_launchers()
    check_launcher_extra(sys.argv[1:])
    check_recipe_selection(sys.argv[1:])
    check_overrides(sys.argv[1:])  # a misspelt field or option: our one line, before Hydra's advice
    # Hydra reads sys.argv when main() runs: string fields keep what was typed (name=1_1_1).
    sys.argv[1:] = keep_typed_strings(sys.argv[1:])
except LlmtrainError as err:
    _fail(err)
except BaseException as err:
    _stop_if_interrupted(err, "while reading the config")
    raise


def _world_size(cfg: DictConfig) -> int:
    """The ranks to lay out: ``trainer.dry_run_world_size`` in a dry run that sets it, else the
    launch's (WORLD_SIZE; a submitit job's tasks; 1 without a launcher)."""
    if cfg.trainer.dry_run and cfg.trainer.dry_run_world_size:
        return cfg.trainer.dry_run_world_size
    from llmtrain.parallel.distributed import adopt_submitit_environment

    adopt_submitit_environment()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _layout(cfg: DictConfig) -> DictConfig:
    """``+recipe=auto``: the config with the recipe, micro-batch and activation checkpointing
    the memory planner chose for this launch's world size (llmtrain.plan); others unchanged.
    Every rank decides alike (same inputs, no communication); rank 0 prints why."""
    if not cfg.recipe.auto:
        return cfg
    import torch

    from llmtrain.planning.auto import resolve_auto
    from llmtrain.planning.memory import describe

    world_size = _world_size(cfg)
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available()
              else torch.device("cpu"))
    chosen, choice = resolve_auto(cfg, world_size, device)
    if int(os.environ.get("RANK", "0")) == 0:
        print("+recipe=auto:\n" + "\n".join(choice.reasons) + "\n" + describe(choice.plan), flush=True)
    return chosen


def _in_sweep() -> bool:
    """Whether this job is one of a Hydra sweep (``-m``) in this process."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


_shutdown_registered = False


def _shutdown_at_exit() -> None:
    global _shutdown_registered
    if not _shutdown_registered:
        from llmtrain.parallel.distributed import shutdown

        atexit.register(shutdown)
        _shutdown_registered = True


def _record(task):
    """torch elastic's ``record``: an unexpected exception's traceback goes to this rank's error
    file, so torchrun's summary shows it as the root cause (Hydra then prints it and exits 1)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(task)


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        watch_sigint()  # raises a Ctrl-C held back while Hydra composed (hold_sigint)
    except BaseException as err:
        _stop_if_interrupted(err, "while reading the config")
        raise
    try:
        import llmtrain.parallel.distributed  # noqa: F401  (before anything imports DeepSpeed: picks its accelerator)
    except BaseException as err:  # torch's import: seconds in which Ctrl-C is likely too
        _stop_if_interrupted(err, "while importing torch")
        raise
    _record(_main)(cfg)


def _main(cfg: DictConfig) -> None:
    from llmtrain.parallel.distributed import shutdown

    try:
        try:
            from llmtrain.trainer import train  # seconds of imports (transformers): Ctrl-C is likely here too
        except BaseException as err:
            _stop_if_interrupted(err, "while importing transformers")
            raise

        cfg = _layout(cfg)
        if cfg.trainer.dry_run:
            from llmtrain.planning.dry_run import dry_run

            if int(os.environ.get("RANK", "0")) == 0:
                print(dry_run(cfg, _world_size(cfg)))
            return
        summary = train(cfg)
        if "preempted_at" in summary and os.environ.get("SUBMITIT_EXECUTOR"):
            from llmtrain.monitoring.preemption import hand_over_to_submitit

            shutdown()  # the group goes before submitit's requeue exits the first task
            hand_over_to_submitit()
            return
        if _in_sweep():
            # Every job of a sweep (-m) trains on this launch's one process group: DeepSpeed
            # keeps module-level handles to the groups it first saw (deepspeed.comm,
            # deepspeed.utils.groups), so a group destroyed after job 0 and made anew for job 1
            # is "not registered" or hangs its first collective. The group goes once, after
            # the last job and still before interpreter exit.
            _shutdown_at_exit()
            return
    except KeyboardInterrupt as err:
        # Ctrl-C before the loop's handler is in place (imports, start-up: StartupInterrupted says
        # where; the loop saves at its step's end instead) or after it is gone (export): one line.
        shutdown()
        _fail(Exception(str(err) or "SIGINT (Ctrl-C): stopped"), status=130, kind="interrupted")
    except TrainingStopped as err:  # an LlmtrainError too: caught first, for its own status
        shutdown()
        _fail(err, status=3, kind="stopped")
    except ChildDied as err:  # a helper process (the vLLM server) died mid-run: its remains are stopped
        shutdown()
        _fail(err, status=5)
    except LlmtrainError as err:
        # Bad input (ConfigError, DataError, ModelSourceError, LaunchError, ResumeError), reported
        # as one line naming the field or file; exit status 2, nothing trained.
        shutdown()  # every rank raises these alike, before or outside any collective
        _fail(err)
    except Exception as err:
        if not was_interrupted(err):
            raise
        # An import that Ctrl-C cut short can fail in other ways later on: still the user's Ctrl-C.
        shutdown()
        _stop_if_interrupted(err, "before the first step")
    # A finished run exits 0: the process group goes before interpreter exit, not during it.
    shutdown()


def _exit_without_finalizing() -> None:
    """End a finished rank of a multi-process launch after its orderly teardown, skipping the
    interpreter's finalization. A 2-rank ZeRO-3 run once aborted there, after its work was saved,
    with "terminate called without an active exception" (exit 1 from torchrun; once, not
    reproduced in 26 repeats since): the sign of a C++ thread object of a native library (gloo, DeepSpeed) that
    is destroyed while still joinable during static destruction. What finalization would run
    first runs here, in its order: thread pools stop, non-daemon threads are joined, atexit handlers run (the
    process group's shutdown of a sweep, the tracker's, ``gc.freeze``), logs and streams are
    flushed; then ``os._exit(0)``. One process exits the ordinary way."""
    import threading

    # What Py_FinalizeEx calls first: thread pools told to stop (their workers wait on a queue
    # otherwise), then every non-daemon thread joined.
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it
    os._exit(0)


if __name__ == "__main__":
    hold_sigint()  # until main's body starts: Hydra would report a Ctrl-C in its compose as its own error
    try:
        main()  # Hydra composes the config here, before it calls main's body
    except BaseException as err:
        _stop_if_interrupted(err, "while reading the config")
        raise
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit_without_finalizing()
