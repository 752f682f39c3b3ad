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

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from llmtrain.config import register_configs
from llmtrain.distributed import shutdown
from llmtrain.paths import CONF_DIR
from llmtrain.trainer import train


def main(spec_file: str) -> None:
    register_configs()
    for run_dir, overrides in json.loads(Path(spec_file).read_text()):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides) + [f"run_dir={run_dir}"])
        train(cfg)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
