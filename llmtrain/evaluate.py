"""``python -m llmtrain.evaluate SOURCE tasks=[NAME,...] [key=value ...]``: lm-evaluation-harness
scores (:mod:`llmtrain.evaluation.harness`) of a run directory (its newest complete checkpoint), a
checkpoint, an export or an adapter.

The result goes to ``RUN/eval/step_N.json`` (``out_dir=`` elsewhere), and, for a source that
belongs to a run that is not training now, to the run's trackers at the checkpoint's step
(``metrics.jsonl``, TensorBoard, MLflow; :func:`llmtrain.monitoring.tracking.log_outside_training`) and its
report. While the run trains, its trainer logs the file instead when it sees it (no record twice).

Arguments after SOURCE are ``key=value`` (OmegaConf's dotlist, as the other entry points take);
:class:`EvalArgs` lists them. Exit status 0; 2 for bad input (one line naming the argument).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as python -m llmtrain (see there)

log = logging.getLogger("llmtrain")

_USAGE = ("usage: python -m llmtrain.evaluate RUN_DIR|CHECKPOINT|EXPORT|ADAPTER tasks=[NAME,...] [limit=N] "
          "[batch_size=8] [device=cpu] [dtype=auto] [num_fewshot=N] [data_dir=DIR] [data_file=PATH] [include=[DIR,...]] "
          "[out_dir=DIR] [step=N] [log=true] [bootstrap_iters=100000]")


@dataclass
class EvalArgs:
    """The entry point's arguments.

    Attributes:
        tasks: lm-eval task names: llmtrain's local ones (``hh_local``, ``alpaca_local``), those in
            ``include`` folders, or the harness's own (network or datasets cache).
        limit: documents per task (all when unset); a fraction below 1 is a share.
        batch_size: documents per forward (the harness's ``--batch_size``; ``auto`` allowed).
        device: ``cpu``, ``cuda``, ``cuda:N``.
        dtype: the weights' dtype for ``HFLM`` (``auto``: the export's, fp32 for llmtrain's).
        num_fewshot: few-shot examples (the task's default when unset).
        data_dir: folder of the local tasks' data files (:mod:`llmtrain.evaluation.local_tasks`).
        data_file: the data file of the one local task given (instead of its name in ``data_dir``).
        include: extra folders of task YAMLs.
        out_dir: where ``step_N.json`` goes (default: the run's ``eval/``, else SOURCE/eval).
        step: the step to file the result under (default: the checkpoint's).
        log: log to the run's trackers when the run is not training.
        bootstrap_iters: the harness's bootstrap resamples for standard errors (0: none).
    """

    tasks: list[str] = field(default_factory=list)
    limit: float | None = None
    batch_size: str = "8"
    device: str = "cpu"
    dtype: str = "auto"
    num_fewshot: int | None = None
    data_dir: str | None = None
    data_file: str | None = None
    include: list[str] = field(default_factory=list)
    out_dir: str | None = None
    step: int | None = None
    log: bool = True
    bootstrap_iters: int = 100000


def parse_args(argv: list[str]) -> tuple[Path, EvalArgs]:
    """SOURCE and the ``key=value`` arguments after it.

    Raises:
        ConfigError: no SOURCE, an unknown key or a value of the wrong type (named), no tasks.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from llmtrain.common.errors import ConfigError

    import difflib
    from dataclasses import fields

    if not argv or argv[0].startswith("-") or ("=" in argv[0] and "/" not in argv[0] and not Path(argv[0]).exists()):
        raise ConfigError(f"give what to evaluate first; {_USAGE}")  # (a sweep job's folder has = in its name)
    names = [f.name for f in fields(EvalArgs)]
    for arg in argv[1:]:
        key = arg.split("=", 1)[0]
        if "=" not in arg or key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise ConfigError(f"{arg}: not a key=value argument of llmtrain.evaluate{hint}; {_USAGE}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(EvalArgs), OmegaConf.from_dotlist(argv[1:]))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or getattr(err, "key", None)
        raise ConfigError(f"{key or 'argument'}: {str(err).splitlines()[0]}; {_USAGE}") from None
    args: EvalArgs = OmegaConf.to_object(merged)  # type: ignore[assignment]
    if not args.tasks:
        raise ConfigError(f"tasks=[NAME,...] is required (e.g. tasks=[hh_local]); {_USAGE}")
    if args.data_file and len(args.tasks) > 1:
        raise ConfigError(f"data_file={args.data_file} is one task's file, but tasks={list(args.tasks)}: evaluate one "
                          "task with it, or give the folder of every task's file as data_dir=DIR")
    if args.limit is not None and (args.limit <= 0 or (args.limit > 1 and args.limit != int(args.limit))):
        raise ConfigError(f"limit={args.limit} must be a whole number of documents per task, or a share in (0, 1]")
    if not (args.batch_size.isdigit() and int(args.batch_size) > 0) and not args.batch_size.startswith("auto"):
        raise ConfigError(f"batch_size={args.batch_size} must be a positive number of documents, or auto")
    for key in ("num_fewshot", "step", "bootstrap_iters"):
        value = getattr(args, key)
        if value is not None and value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    if args.dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise ConfigError(f"dtype={args.dtype} must be auto, float32, float16 or bfloat16")
    from llmtrain.evaluation.harness import check_device

    check_device(args.device, "device")
    return Path(argv[0]), args


def _limit(value: float | None) -> int | float | None:
    return int(value) if value is not None and value >= 1 else value


def _tasks_of(keys: list[str]) -> str:
    return ", ".join(sorted({k.split("/")[1] for k in keys}))


def _log_to_run(source: Any, scores: dict[str, float]) -> str:
    """Log ``scores`` to the run's trackers and refresh its report; returns what was done."""
    from omegaconf import OmegaConf

    from llmtrain.checkpoint.protocol import run_dir_in_use, step_dirs
    from llmtrain.checkpoint.state import STATE_FILE, read_state
    from llmtrain.evaluation.harness import documents_of, logged_keys, unlogged
    from llmtrain.monitoring.report import read_jsonl
    from llmtrain.monitoring.tracking import log_outside_training

    run_dir = source.run_dir
    if run_dir_in_use(run_dir):
        return f"the run is training: its trainer logs {run_dir / 'eval'} results at step {source.step}"
    logged = logged_keys(read_jsonl(run_dir / "metrics.jsonl")).get(source.step, {})
    fresh = unlogged(scores, logged)
    again = [k for k in scores if k not in fresh]
    superseded = [k for k in fresh if k in logged]
    kept = (f"; {_tasks_of(again)} at step {source.step} already logged from as many documents or more (the "
            "trackers and the report keep that)") if again else ""
    if superseded:
        kept += (f"; {_tasks_of(superseded)} logged again at step {source.step}: "
                 f"{max(documents_of(scores, k) for k in superseded)} documents supersede the earlier evaluation's "
                 "(the report shows the larger)")
    scores = fresh
    if not scores:
        return kept.lstrip("; ")
    cfg = OmegaConf.load(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else OmegaConf.create({})
    saved = [p for _, p in step_dirs(run_dir / "checkpoints") if (p / STATE_FILE).is_file()]
    mlflow_run_id = read_state(saved[0]).mlflow_run_id if saved else None  # the newest's
    written = log_outside_training(cfg.get("tracker", {}), run_dir, scores, source.step, mlflow_run_id)
    if (run_dir / "report.png").is_file():
        from llmtrain.monitoring.report import write_report

        write_report(run_dir)
        written.append("report")
    return f"logged at step {source.step} to {', '.join(written)}{kept}"


def run(source_path: Path, args: EvalArgs) -> dict[str, Any]:
    """Evaluate and write the result (see the module); returns ``{"path", "scores", "results"}``.

    Raises:
        ConfigError, DataError, ResumeError, ModelSourceError: bad input, before anything is written.
    """
    from llmtrain.evaluation import harness

    source = harness.resolve_source(source_path)
    if args.step is not None:
        source.step = args.step
    harness.check_source(source)
    include = harness.include_paths(args.include)
    manager = harness.check_tasks(args.tasks, include, args.data_dir, args.data_file)  # before anything loads
    out_dir = Path(args.out_dir) if args.out_dir else (source.run_dir / "eval" if source.run_dir is not None
                                                       else source.path / "eval")
    log.info("evaluating %s on %s", source.describe(), ", ".join(args.tasks))
    batch = int(args.batch_size) if args.batch_size.isdigit() else args.batch_size
    results = harness.evaluate(source, args.tasks, include, args.data_dir, _limit(args.limit), batch, args.device,
                               args.num_fewshot, args.dtype, args.bootstrap_iters, manager=manager)
    path = harness.write_result(out_dir, source, args.tasks, results)
    scores = harness.scores(results)
    note = ""
    if args.log and source.run_dir is not None and source.step is not None and not args.out_dir:
        note = _log_to_run(source, scores)
    return {"path": path, "scores": scores, "results": results, "note": note}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # The trainer stops an evaluation with SIGTERM (its own end or death, a preemption): leave
    # through the finally blocks, which remove the temporary export.
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        from llmtrain.monitoring.console import plain_text

        arguments = EvalArgs.__doc__.split("Attributes:\n", 1)[1].rstrip()
        print(plain_text(__doc__.split("\n\nArguments after SOURCE")[0].strip()) + "\n\narguments (key=value):\n"
              + plain_text(arguments) + "\n\n" + _USAGE)
        return 0
    handler = None
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s][llmtrain] %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        level = log.level
        log.setLevel(logging.INFO)
    try:
        return _main(argv)
    finally:
        # Called in-process (tests, a notebook), the handler must not outlive the stream it writes to.
        if handler is not None:
            log.removeHandler(handler)
            log.setLevel(level)


def _main(argv: list[str]) -> int:
    from llmtrain.common.errors import LlmtrainError, require_extra

    try:
        require_extra("lm_eval", "eval", "python -m llmtrain.evaluate")
        source_path, args = parse_args(argv)
        from llmtrain.monitoring.console import quiet_when_logged

        with quiet_when_logged("evaluate", progress_lines=True):  # a log file gets progress lines, not bars
            done = run(source_path, args)
    except LlmtrainError as err:
        print(f"llmtrain.evaluate: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # The finally blocks on the way out removed the temporary export; no result was written
        # (write_result runs after the harness).
        print("llmtrain.evaluate: interrupted: SIGINT (Ctrl-C): no result written", file=sys.stderr)
        return 130
    from lm_eval.utils import make_table

    print(make_table(done["results"]))
    print(f"results: {done['path']}" + (f"; {done['note']}" if done["note"] else ""))
    return 0


if __name__ == "__main__":
    from llmtrain.common.interrupt import one_line_on_ctrl_c

    # Its imports are inside main(); one cut short by Ctrl-C can end in another exception
    # (lm_eval's import: a RecursionError from a half-initialised numpy), reported as Ctrl-C too.
    with one_line_on_ctrl_c("llmtrain.evaluate", after="no result written"):
        sys.exit(main())
