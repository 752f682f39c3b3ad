"""GSM8K problems (or any ``question``/``answer`` JSON lines with ``#### N`` answers, such as
``reasoning_gym_prompts.py``'s) as chat prompts that offer the calculator tool, for multi-turn
online RL with ``rollout.environment=calculator``.

    python scripts/tools/gsm8k_calculator_prompts.py ../shared/data/gsm8k_train.jsonl.gz gsm8k_calc.jsonl --size 2000

Writes one JSON line per problem: ``{"messages": [...], "answer": "... #### N"}``. The
instructions explain the tool (``<calc>EXPRESSION</calc>`` is answered with
``<result>VALUE</result>``) with one worked example and ask for the final answer as ``#### N``,
which the built-in ``gsm8k`` reward checks. They go before the question in the user message
(``--system``: in a system message; SmolLM2-135M-Instruct ignored them there: 0 tool calls in
24 greedy completions, against 3 in 32 sampled ones with them in the user message)::

    python -m llmtrain objective=grpo data=prompts data.path=gsm8k_calc.jsonl data.columns.prompt=messages \\
        rollout.environment=calculator reward.functions=[gsm8k]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

SYSTEM = (
    "You solve math word problems. You have a calculator: write <calc>EXPRESSION</calc> and stop; you will get "
    "<result>VALUE</result>. Use it for every computation. End with the final answer as #### NUMBER.\n\n"
    "Example:\nQuestion: Tom has 3 boxes of 12 apples and eats 5. How many apples are left?\n"
    "Answer: Tom has <calc>3*12</calc><result>36</result>\n36 apples. After eating 5: <calc>36-5</calc>"
    "<result>31</result>\n#### 31")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="GSM8K JSON lines (question, answer), .gz or plain")
    parser.add_argument("out", type=Path, help="the prompts file to write")
    parser.add_argument("--size", type=int, default=0, help="the first SIZE problems (0: all)")
    parser.add_argument("--system", action="store_true", help="the instructions in a system message")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        print(f"error: {args.source} is not a file (GSM8K's train or test JSON lines)", file=sys.stderr)
        return 2
    opener = gzip.open if args.source.suffix == ".gz" else open
    written = 0
    with opener(args.source, "rt", encoding="utf-8") as source, args.out.open("w", encoding="utf-8") as out:
        for number, line in enumerate(source, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question, answer = record["question"], record["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                print(f"error: {args.source} line {number} is not a GSM8K record with question and answer",
                      file=sys.stderr)
                return 2
            messages = ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}] if args.system
                        else [{"role": "user", "content": f"{SYSTEM}\n\nQuestion: {question}"}])
            out.write(json.dumps({"messages": messages, "answer": answer}) + "\n")
            written += 1
            if args.size and written >= args.size:
                break
    print(f"wrote {written} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
