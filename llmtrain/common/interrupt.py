"""Ctrl-C in a command's first seconds (imports, reading the config), reported as one line.

An entry point calls :func:`watch_sigint` first, before its heavy imports, and its outermost
frame catches every exception and asks :func:`was_interrupted`. A KeyboardInterrupt raised in
the middle of an import can leave a module half-initialised (numpy, imported by lm_eval), so
what reaches the outermost frame may be another exception that followed it (a RecursionError,
an ImportError); the recorded SIGINT still says the user stopped the command.
"""

from __future__ import annotations

import signal
import sys

TYPE_CHECKING = False  # (not typing's: this module runs before the command does, importing little)
if TYPE_CHECKING:
    from types import FrameType
    from typing import Optional

_seen = False


def _record_sigint(signum: int, frame: Optional[FrameType]) -> None:
    """Python's own SIGINT behaviour (raise KeyboardInterrupt), remembering that it happened."""
    global _seen
    _seen = True
    raise KeyboardInterrupt


def _defer_sigint(signum: int, frame: Optional[FrameType]) -> None:
    """Remember SIGINT for :func:`watch_sigint` to raise once the command's module runs."""
    global _seen
    _seen = True


# Flags whose answer reads the config only (tests/test_cli.py: no torch import for them).
ANSWERS_WITHOUT_TORCH = {"-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion"}

# The commands whose outermost frame reports Ctrl-C (they call watch_sigint first).
COMMANDS = ("llmtrain", "llmtrain.evaluate", "llmtrain.plan", "llmtrain.export", "llmtrain.prepare")


def defer_sigint(argv: list[str]) -> None:
    """Hold SIGINT back while Python reads ``python -m COMMAND``'s module (``argv``: the
    interpreter's own, ``sys.orig_argv``), when COMMAND is one of :data:`COMMANDS`: without
    bytecode files (``PYTHONDONTWRITEBYTECODE``) it compiles ``llmtrain/__main__.py`` before a
    line of it runs, a Ctrl-C there would be runpy's traceback; torch is imported meanwhile
    (below). :func:`watch_sigint`, the command's first act, raises it."""
    command = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    if command in COMMANDS and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _defer_sigint)
        # torch's C++ start-up (torch.distributed's _c10d_init) calls back into Python through
        # pybind11, where a KeyboardInterrupt cannot unwind: the process aborts (SIGABRT, "terminate
        # called after throwing pybind11::error_already_set"). Every command that works imports
        # torch, so it is imported here, while Ctrl-C is held; the answers that read the config
        # only (--help, Hydra's --cfg/--info) stay without it.
        if not set(argv[argv.index("-m") + 2:]) & ANSWERS_WITHOUT_TORCH:
            import torch  # noqa: F401


def watch_sigint() -> None:
    """Record SIGINT (Ctrl-C) from now on; it still raises KeyboardInterrupt. A handler someone
    else installed (a parent that ignores SIGINT: ``nohup``, a background job) is kept.

    Raises:
        KeyboardInterrupt: SIGINT came while Python read the command's module (:func:`defer_sigint`).
    """
    if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _defer_sigint):
        signal.signal(signal.SIGINT, _record_sigint)
    if _seen:
        raise KeyboardInterrupt


def hold_sigint() -> None:
    """Hold SIGINT back (recorded, not raised) until the next :func:`watch_sigint`: Hydra turns
    any exception raised while it composes, a KeyboardInterrupt that OmegaConf wrapped included,
    into its own report and exit status 1."""
    if signal.getsignal(signal.SIGINT) is _record_sigint:
        signal.signal(signal.SIGINT, _defer_sigint)


def was_interrupted(err: BaseException) -> bool:
    """Whether ``err``, caught by an entry point's outermost frame, ends a command the user
    stopped with Ctrl-C: a KeyboardInterrupt, or any exception once SIGINT was recorded
    (SystemExit excepted: the command already said why it exits)."""
    if isinstance(err, SystemExit):
        return False
    return isinstance(err, KeyboardInterrupt) or _seen


def keep_exit_status() -> None:
    """Let the exit status asked for (130) stand. CPython remembers a KeyboardInterrupt that
    escaped an ``exec`` of a string (dataclasses and namedtuples build their methods so, inside
    the imports Ctrl-C interrupts) and, at exit, kills the process with SIGINT instead: a parent
    then sees "killed by SIGINT", not 130. An ``exec`` of a string that succeeds clears that
    record."""
    exec("pass")  # noqa: S102  (a constant string: resets CPython's record, runs nothing)


class one_line_on_ctrl_c:  # noqa: N801  (used as a function: ``with one_line_on_ctrl_c(...)``)
    """The outermost frame of ``python -m PROG``: Ctrl-C inside (imports included, and whatever
    exception an interrupted import leads to) ends in one line, ``PROG: interrupted: SIGINT
    (Ctrl-C): AFTER``, exit status 130. Entering starts :func:`watch_sigint`. ``active=False``
    (the module imported, not run) leaves everything as it is.

    Raises:
        SystemExit: 130, after the line.
    """

    def __init__(self, prog: str, after: str = "stopped", active: bool = True):
        self.prog, self.after, self.active = prog, after, active

    def __enter__(self) -> None:
        if self.active:
            try:
                watch_sigint()
            except KeyboardInterrupt as err:
                self.__exit__(type(err), err, None)

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> bool:
        if not self.active or err is None:
            return False
        if not was_interrupted(err):
            if _seen:  # the command said why it ends itself (its own "interrupted" line and status)
                keep_exit_status()
            return False
        print(f"{self.prog}: interrupted: SIGINT (Ctrl-C): {self.after}", file=sys.stderr, flush=True)
        keep_exit_status()
        raise SystemExit(130) from None
