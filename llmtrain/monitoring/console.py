"""What a run prints: rank 0's progress, and third-party output kept out of the log.

On a terminal rank 0 shows a tqdm bar (log lines go through ``tqdm.write`` so they never land
on the bar's line). When stderr is not a terminal (a log file, SLURM's ``--output``, a pipe) a
bar would be a stream of carriage returns glued to the next log line, so rank 0 prints one plain
line per logged step instead, greppable with ``grep '^step'``::

    step 10/200: train loss 4.3491, lr 5.50e-04, grad norm 0.532, 8,881 tokens/s, eta 0:00:52

Library progress bars (``datasets`` map/filter, ``transformers`` shard writing and GGUF
dequantization, ``huggingface_hub``) are shown only on rank 0 and only on a terminal. Library
chatter that says nothing about this run (wandb's run summary, peft's guess about a base model
with no Hub config) is off unless llmtrain's debug log is on (``hydra.verbose=llmtrain``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import sys
import threading
import time
from typing import Callable, Iterator

from llmtrain.common import lazy_datasets

log = logging.getLogger("llmtrain")


def plain_text(docstring: str) -> str:
    """A docstring as a command's ``--help`` prints it: reStructuredText's markup dropped
    (````code```` -> ``code``, ``:func:`~a.b.name``` -> ``name``, ``:mod:`a.b``` -> ``a.b``)."""
    import re

    text = re.sub(r":[a-z]+:`~[\w.]*?([\w]+)`", r"\1", docstring)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"\1", text)
    return text.replace("``", "")


def interactive() -> bool:
    """True when stderr (where progress bars draw) is a terminal."""
    return sys.stderr.isatty()


def configure_library_output(is_main: bool, on_terminal: bool) -> None:
    """Disable the progress bars of ``datasets``, ``transformers``, ``huggingface_hub`` and
    MLflow's artifact transfers unless this is rank 0 writing to a terminal (every rank would
    draw the same bar)."""
    if is_main and on_terminal:
        return
    import functools
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # read when MLflow transfers
    lazy_datasets.bars_off()  # without importing datasets (0.5 s) where the run does not need it

    import huggingface_hub.utils
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    # GGUF dequantization draws a plain tqdm bar that ignores transformers' switch above.
    if not isinstance(gguf_loading.tqdm, functools.partial):
        gguf_loading.tqdm = functools.partial(gguf_loading.tqdm, disable=True)


def debug_logging() -> bool:
    """llmtrain's debug mode (``hydra.verbose=llmtrain``: the llmtrain logger at DEBUG): library
    chatter that is off by default (:func:`quiet_library_warnings`, wandb's quiet mode) shows."""
    return log.isEnabledFor(logging.DEBUG)


# Library warnings that llmtrain expects and that change nothing, as (category, message regex).
EXPECTED_LIBRARY_WARNINGS = (
    # peft's save_pretrained looks for the base model's config.json (to see whether the vocabulary
    # was resized) locally or on the Hub; a GGUF-loaded base (its folder holds the .gguf file
    # only) or a Hub id under HF_HUB_OFFLINE has none to find. llmtrain never resizes the
    # vocabulary, so peft's assumption is right.
    (UserWarning, r"Could not find a config file in .* - will assume that the vocabulary was not modified"),
    # The same probe when the Hub cannot be reached.
    (UserWarning, r"(?s)Unable to fetch remote file due to the following error .* - silently ignoring the lookup "
                  r"for the file config\.json"),
    # peft reads transformers' deprecated property when it loads an adapter onto its base (peft's
    # code, not ours; transformers renamed it is_activation_checkpointing).
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)


@contextlib.contextmanager
def quiet_library_warnings() -> Iterator[None]:
    """Silence :data:`EXPECTED_LIBRARY_WARNINGS` raised inside (every other warning shows as
    usual); in llmtrain's debug mode (:func:`debug_logging`) they show too."""
    import warnings

    with warnings.catch_warnings():
        if not debug_logging():
            for category, message in EXPECTED_LIBRARY_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
        yield


@contextlib.contextmanager
def stdout_to_debug_log(what: str) -> Iterator[None]:
    """Capture Python-level ``print`` output of a third-party call (DeepSpeed prints "op built
    successfully" on every launch) and pass it to the debug log instead of the console."""
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        yield
    for line in captured.getvalue().splitlines():
        log.debug("%s: %s", what, line)


@contextlib.contextmanager
def quiet_when_logged(what: str, progress_lines: bool = False) -> Iterator[None]:
    """Third-party output of a command-line tool's work (``python -m llmtrain.export``) kept out
    of a log file, as the trainer keeps it out of its own: when stderr is not a terminal, library
    progress bars are off (:func:`configure_library_output`, plus plain ``tqdm`` bars of modules
    imported inside, such as DeepSpeed's ``zero_to_fp32``); when stdout is not one, Python-level
    prints inside (DeepSpeed's "Processing zero checkpoint ...") go to the debug log. On a
    terminal both show as usual. ``progress_lines``: lm-eval's request bars (``Running ...
    requests``) become plain progress lines (:class:`CountProgress`) instead of nothing, so
    minutes of scoring are not silent in a log."""
    with contextlib.ExitStack() as stack:
        if not interactive():
            configure_library_output(is_main=True, on_terminal=False)
            stack.enter_context(_tqdm_disabled(progress_lines))
        if not sys.stdout.isatty():
            stack.enter_context(stdout_to_debug_log(what))
        yield


@contextlib.contextmanager
def _tqdm_disabled(progress_lines: bool = False) -> Iterator[None]:
    """``tqdm.tqdm`` draws nothing for modules that import it (``from tqdm import tqdm``) inside;
    with ``progress_lines`` a bar of lm-eval's requests logs :class:`CountProgress` lines."""
    import tqdm

    original = tqdm.tqdm

    class Quiet(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            desc, shown = kwargs.get("desc"), not kwargs.get("disable", False)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            # lm-eval's request bars ("Running loglikelihood requests", "Running generate_until
            # requests"); its bars without a name (building a task's requests) are quick.
            lines = progress_lines and shown and str(desc or "").startswith("Running") and self.total
            self._lines = CountProgress(str(desc), int(self.total), "requests") if lines else None

        def __iter__(self):
            for item in super().__iter__():  # disabled: the iterable's own items, uncounted
                yield item
                if self._lines is not None:
                    self._lines.advance(1)

        def update(self, n=1):
            if self._lines is not None:
                self._lines.advance(int(n))
            return super().update(n)

    zero_to_fp32 = sys.modules.get("deepspeed.utils.zero_to_fp32")  # imported by an earlier call
    tqdm.tqdm = Quiet
    if zero_to_fp32 is not None:
        zero_to_fp32.tqdm = Quiet
    try:
        yield
    finally:
        for module in (tqdm, sys.modules.get("deepspeed.utils.zero_to_fp32")):
            if module is not None and getattr(module, "tqdm", None) is Quiet:
                module.tqdm = original


class Progress:
    """Rank 0's per-step progress; a no-op on other ranks or with ``trainer.progress_bar=false``.

    Args:
        enabled: show anything at all (rank 0 and ``trainer.progress_bar``).
        total_steps: ``trainer.max_steps``.
        start_step: the step a resumed run starts from (0 for a fresh run).
        every: plain-line cadence in steps when not on a terminal (``trainer.log_every``; 0 = only
            the last step).
        on_terminal: draw a bar (True) or print plain lines (False); default: stderr is a TTY.
    """

    def __init__(self, enabled: bool, total_steps: int, start_step: int, every: int,
                 on_terminal: bool | None = None):
        self.total, self.start, self.every = total_steps, start_step, every
        self._started = time.perf_counter()
        self._bar = None
        self._redirect = contextlib.ExitStack()
        self.enabled = enabled
        if enabled and (interactive() if on_terminal is None else on_terminal):
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             dynamic_ncols=True, mininterval=1.0)
            # The root logger only: llmtrain's records propagate to it, and a handler on both
            # would print every line twice.
            self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger()]))

    def update(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
               detail: str = "") -> None:
        """Report optimizer step ``step`` (1-based) with its loss, learning rate, gradient norm
        (before clipping) and throughput in tokens per second; ``detail``: more of the step's
        values, already formatted (an online objective's rewards: :func:`reward_detail`)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss={loss:.4f}, lr={lr:.2e}, tok_s={tokens_per_s:,.0f}"
                                      + (f", {detail}" if detail else ""), refresh=False)
            self._bar.update(1)
            return
        if not ((self.every and step % self.every == 0) or step == self.total):
            return
        per_step = (time.perf_counter() - self._started) / max(step - self.start, 1)
        eta = datetime.timedelta(seconds=round(per_step * (self.total - step)))
        log.info("step %d/%d: train loss %.4f, lr %.2e, grad norm %.3f, %s%s tokens/s, eta %s",
                 step, self.total, loss, lr, grad_norm, f"{detail}, " if detail else "", f"{tokens_per_s:,.0f}", eta)

    @property
    def on_bar(self) -> bool:
        """Whether a bar is drawn (a terminal and ``trainer.progress_bar``)."""
        return self._bar is not None

    def note(self, text: str) -> None:
        """Show ``text`` in the bar's postfix until the next step's values replace it (progress
        within a step: an online objective's sampling); nothing without a bar."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()


def reward_detail(metrics: dict[str, float]) -> str:
    """An online objective's step values for its step line: the mean reward, its standard
    deviation over the step's completions and the share of groups whose rewards all agree
    (``frac_reward_zero_std``, as TRL names it: such a group has no advantage and trains
    nothing), e.g. ``reward 0.250 (std 0.433, zero-spread groups 0.50)``; "" on a step that
    sampled nothing (``objective.num_iterations`` reuses a batch)."""
    if "train/reward" not in metrics:
        return ""
    return (f"reward {metrics['train/reward']:.3f} (std {metrics['train/reward_std']:.3f}, zero-spread groups "
            f"{metrics['train/frac_reward_zero_std']:.2f})")


class CountProgress:
    """Rank 0's progress through counted work outside the step loop that can take minutes (an
    online objective's held-out generation, lm-eval's requests): a tqdm bar where ``bar`` (a
    terminal and ``trainer.progress_bar``), else plain lines, one after the first item (its rate
    gives the whole's time early), then one every ``every_s`` seconds and one at the last::

        held-out evaluation: 1/64 prompts, 0.21 prompts/s, eta 0:05:00

    A no-op where not ``enabled`` (other ranks). ``advance(n)`` counts ``n`` more items done.
    ``quiet_s``: no line before the work has taken that long (work that is usually fast, an
    online step's sampling, stays silent); ``say``: where the lines go instead of the log (the
    step bar's postfix, :meth:`Progress.note`)."""

    def __init__(self, what: str, total: int, unit: str, enabled: bool = True, bar: bool = False,
                 every_s: float = 10.0, quiet_s: float = 0.0, say: Callable[[str], None] | None = None):
        self.what, self.total, self.unit, self.every_s, self.quiet_s = what, total, unit, every_s, quiet_s
        self.enabled, self.done = enabled and total > 0, 0
        self._say = say
        self._started = self._said = time.perf_counter()
        self._quiet = True  # nothing said yet
        self._lock = threading.Lock()
        self._bar = None
        if self.enabled and bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit.rstrip("s") or unit, dynamic_ncols=True,
                             mininterval=1.0, leave=False)

    def advance(self, n: int = 1) -> None:
        """``n`` more items done."""
        if not self.enabled:
            return
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        self._maybe_say(self.done >= self.total)

    def tick(self) -> None:
        """Say where the work stands if a line is due, though no item finished since the last
        (called every second by a timer where each item takes long: one prompt of a CPU step)."""
        if self.enabled and self._bar is None:
            self._maybe_say(False)

    def _maybe_say(self, last: bool) -> None:
        with self._lock:  # advance() and a timer's tick() may race
            now = time.perf_counter()
            if now - self._started < self.quiet_s or not (self._quiet or last or now - self._said >= self.every_s):
                return
            self._said, self._quiet = now, False
            line = f"{self.what}: {self.done}/{self.total} {self.unit}"
            if self.done:
                rate = self.done / max(now - self._started, 1e-9)
                eta = datetime.timedelta(seconds=round(max(self.total - self.done, 0) / rate))
                line += f", {rate:.2f} {self.unit}/s, eta {eta}"
            else:  # no rate yet
                line += f", {now - self._started:.0f} s so far"
            if self._say is not None:
                self._say(line)
            else:
                log.info("%s", line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "CountProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
