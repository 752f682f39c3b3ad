"""A verifiers environment's dataset as a ``data=prompts`` file, for ``rollout.environment=verifiers:...``.

    pip install "llmtrain[verifiers]"
    python scripts/tools/verifiers_prompts.py ENV_ID prompts.jsonl [--size N]
    python scripts/tools/verifiers_prompts.py my_module:load_env prompts.jsonl   # a function returning one

Writes one JSON line per record of the environment's training dataset (``env.get_dataset()``): its
``prompt`` messages (with the environment's system prompt and few-shot turns), ``answer``,
``info`` (as JSON text), ``task`` and ``example_id``, which reach the environment's state as in
verifiers (``objective=grpo data=prompts data.path=prompts.jsonl rollout.environment=verifiers:ENV_ID
reward.functions=[]``; :mod:`llmtrain.rollout.verifiers_env`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("env", help="an installed verifiers environment's id, or module:function returning an environment")
    p.add_argument("out", type=Path, help="the JSON-lines file to write")
    p.add_argument("--size", type=int, default=-1, help="the first N records (default: all)")
    a = p.parse_args(argv)
    from llmtrain.common.errors import ConfigError
    from llmtrain.rollout.verifiers_env import PREFIX, load, write_prompts

    try:
        environment = load(None, PREFIX + a.env)
    except ImportError:
        print('verifiers_prompts: needs verifiers: pip install "llmtrain[verifiers]"', file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"verifiers_prompts: {err}", file=sys.stderr)
        return 2
    written = write_prompts(environment.env, a.out, a.size)
    print(f"{a.out}: {written} prompts of {a.env}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
