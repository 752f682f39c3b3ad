"""Seeded verifiable prompts from reasoning-gym, as a ``data=prompts`` file for online RL.

    pip install reasoning-gym
    python scripts/tools/reasoning_gym_prompts.py basic_arithmetic arithmetic.jsonl --size 2000 --seed 1 \
        --config min_terms=2 max_terms=2 min_digits=1 max_digits=2

Writes one JSON line per problem: ``{"question": ..., "answer": "#### N", "task": NAME}``, the
answer in GSM8K's ``#### N`` layout so that the built-in ``gsm8k`` reward checks a completion's
final number against it (``objective=grpo data=prompts data.path=arithmetic.jsonl
data.columns.prompt=question reward.functions=[gsm8k]``). Tasks whose answers are not numbers
are refused: their checkers are reasoning-gym's own (call ``dataset.score_answer`` from a reward
function of your own instead).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    p.add_argument("out", type=Path, help="the JSON-lines file to write")
    p.add_argument("--size", type=int, default=1000, help="number of problems")
    p.add_argument("--seed", type=int, default=1, help="reasoning-gym's seed (the same seed, the same problems)")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="the task's generator settings")
    a = p.parse_args(argv)
    try:
        import reasoning_gym
    except ImportError:
        print("reasoning_gym_prompts: needs reasoning-gym: pip install reasoning-gym", file=sys.stderr)
        return 2
    settings = dict(item.split("=", 1) for item in a.config)
    try:
        dataset = reasoning_gym.create_dataset(a.task, size=a.size, seed=a.seed,
                                               **{k: _value(v) for k, v in settings.items()})
    except Exception as err:  # noqa: BLE001  (an unknown task or setting: reasoning-gym's own message)
        print(f"reasoning_gym_prompts: {a.task} {settings}: {err}", file=sys.stderr)
        return 2
    lines = []
    for k, problem in enumerate(dataset):
        answer = str(problem["answer"]).strip()
        try:
            float(answer.replace(",", ""))
        except ValueError:
            print(f"reasoning_gym_prompts: problem {k} of {a.task} has the answer {answer!r}, not a number; the gsm8k "
                  "reward checks numbers only", file=sys.stderr)
            return 2
        lines.append(json.dumps({"question": problem["question"], "answer": f"#### {answer}", "task": a.task}))
    a.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{a.out}: {len(lines)} problems of {a.task} (seed {a.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
