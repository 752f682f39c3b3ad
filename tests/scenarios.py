"""Run several training runs one after another in one launch (one process group), so the suite
pays process start-up once per world size instead of once per run:

    torchrun --standalone --nproc_per_node N tests/scenarios.py SPEC.json

SPEC.json: a list of ``[run_dir, [override, ...]]``; each run is exactly
``python -m llmtrain OVERRIDES run_dir=RUN_DIR`` (same composition, same ``train``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmtrain.config.compose import compose
from llmtrain.parallel.distributed import shutdown
from llmtrain.trainer import train


def main(spec_file: str) -> None:
    for run_dir, overrides in json.loads(Path(spec_file).read_text()):
        train(compose(list(overrides) + [f"run_dir={run_dir}"]))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
