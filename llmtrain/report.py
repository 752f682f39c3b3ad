"""``python -m llmtrain.report RUN_DIR``: write a run's ``report.png`` and ``report.md``
(:mod:`llmtrain.monitoring.report`) from its ``metrics.jsonl``, ``config.yaml`` and
``timeline.jsonl``, e.g. for a run that was interrupted before it wrote its own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmtrain.monitoring.report import write_report


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the report of RUN_DIR and print the two paths. Returns 0, or 2
    (message on stderr, nothing written) when RUN_DIR is missing or has no metrics.jsonl."""
    parser = argparse.ArgumentParser(prog="python -m llmtrain.report", 
                                     description="Write a run's report.png and report.md from its metrics.jsonl.")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory holding metrics.jsonl")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"llmtrain.report: {args.run_dir}: no such directory; expected a run directory with metrics.jsonl",
              file=sys.stderr)
        return 2
    try:
        paths = write_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"llmtrain.report: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
