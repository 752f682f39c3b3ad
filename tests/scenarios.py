"""Run several training runs one after another in one launch (one process group), so the suite
pays process start-up once per world size instead of once per run:

    torchrun --standalone --nproc_per_node N tests/scenarios.py SPEC.json

SPEC.json: a list of ``[run_dir, [override, ...]]`` or ``[run_dir, [override, ...], {VAR: value}]``;
each run is exactly ``VAR=value python -m llmtrain OVERRIDES run_dir=RUN_DIR`` (same composition,
same ``train``; the variables are set for that run only).

With ``LLMTRAIN_SCENARIO_LOGS=1`` each rank writes llmtrain's log records of each run (INFO up, as
``python -m llmtrain``'s job logging prints them) to ``RUN_DIR.rank<R>.log`` beside the run's folder,
for tests that check what a run said (a resume's decision) while sharing the launch.

With ``LLMTRAIN_SCENARIO_TIMES=1`` rank 0 appends each run's wall seconds (``train()`` and the
composition) to ``SPEC.times.jsonl`` beside the spec, to find which runs a module's launch spends on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from llmtrain.config.compose import compose
from llmtrain.parallel.distributed import shutdown
from llmtrain.trainer import train


@contextlib.contextmanager
def _run_log(run_dir: str):
    """llmtrain's records of one run, INFO up, to ``RUN_DIR.rank<R>.log`` (with
    ``LLMTRAIN_SCENARIO_LOGS=1``; nothing otherwise); warnings still reach the launch's stderr."""
    if os.environ.get("LLMTRAIN_SCENARIO_LOGS") != "1":
        yield
        return
    logger = logging.getLogger("llmtrain")
    to_file = logging.FileHandler(f"{run_dir}.rank{os.environ.get('RANK', '0')}.log", encoding="utf-8")
    # Hydra's job_logging format (conf/config.yaml: hydra/job_logging=stdout)
    to_file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    # A handler on llmtrain's logger turns off logging's last resort (warnings to stderr) for its records.
    added = [to_file]
    if not logging.getLogger().handlers:
        added.append(logging.StreamHandler(sys.stderr))
        added[-1].setLevel(logging.WARNING)
    level = logger.level
    logger.setLevel(logging.INFO)
    for handler in added:
        logger.addHandler(handler)
    try:
        yield
    finally:
        for handler in added:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(level)


def main(spec_file: str) -> None:
    timed = os.environ.get("LLMTRAIN_SCENARIO_TIMES") == "1" and os.environ.get("RANK", "0") == "0"
    if timed:  # llmtrain's own lines too (its start-up phases), as ``python -m llmtrain`` prints them
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for run_dir, overrides, *env in json.loads(Path(spec_file).read_text()):
        started = time.perf_counter()
        env = env[0] if env else {}
        before = {name: os.environ.get(name) for name in env}
        if "recipe.compile=true" in overrides and "torch._dynamo" in sys.modules:
            # A run of its own process starts with no compiled graphs; without this, a compiled
            # run would reuse the previous run's graphs of the same layer class (runs compiling
            # only torchao's optimizer step keep them: recompiling those is all this would add).
            sys.modules["torch._dynamo"].reset()
        os.environ.update(env)
        try:
            with _run_log(run_dir):
                train(compose(list(overrides) + [f"run_dir={run_dir}"]))
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if timed:
            with open(Path(spec_file).with_suffix(".times.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"run": Path(run_dir).name, "s": round(time.perf_counter() - started, 2)}) + "\n")
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
