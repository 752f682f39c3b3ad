"""What a run's end says and writes beside its export: the run report (matplotlib, about 0.5 s
to import, is imported only here and only by runs that write one) and the preemption notice."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("llmtrain")


def write_report_at_end(run_dir: Path) -> str | None:
    """``run_dir/report.png`` and ``report.md`` of the finished run (:mod:`.report`); returns
    the PNG's path, or None where plotting failed (a warning: a report never fails a run)."""
    from llmtrain.monitoring.report import write_report_or_warn

    return write_report_or_warn(run_dir)


def log_preempted(requested: str | None, step: int, requeued: bool) -> None:
    """The last line of a preempted run: which signal (``requested``; None: it reached another
    rank first), the step it saved (0: none, the first step's sampling was stopped), and how the
    run goes on (``requeued``: a scheduler's job that submitit requeues)."""
    if step == 0:  # stopped while the first step sampled (llmtrain.rollout.rollout): nothing trained
        log.warning("preempted (%s) in the first step, before it trained: nothing saved; %s",
                    requested or "signal on another rank",
                    "submitit requeues the job, which starts again" if requeued else "rerun the same command to start")
        return
    log.warning("preempted (%s): saved step %d; %s", requested or "signal on another rank", step,
                "submitit requeues the job, which continues from it" if requeued else "rerun the same command to continue")
