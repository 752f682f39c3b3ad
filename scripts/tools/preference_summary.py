"""Held-out preference accuracy and margins of preference runs, before and after training.

    python scripts/tools/preference_summary.py RUN_DIR [RUN_DIR ...]

Reads each run's ``metrics.jsonl``: the first and the last evaluation (``val/rewards/accuracies``,
``val/rewards/margins``, ``val/loss`` and ``val/pairs``, the number of held-out pairs), and prints
the accuracy with its binomial standard error sqrt(p (1 - p) / n) and the z-score of p against
chance (0.5). For DPO the step-0 rewards are 0 by construction (policy = reference): every pair
ties (with precomputed reference log-probs, up to rounding: the accuracy there is noise); a reward
model's step-0 figures are its untrained head; KTO runs show their desirable and undesirable
rewards and z0.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def evaluations(run_dir: Path) -> list[dict]:
    """The run's evaluation records (``val/loss`` present), in step order.

    Raises:
        SystemExit: no metrics.jsonl, or no evaluation of a preference objective in it.
    """
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"preference_summary: {path} does not exist; give a run directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "val/rewards/chosen" in r]
    if not evals:
        raise SystemExit(f"preference_summary: {path} has no val/rewards/*: not a preference run")
    return evals


def describe(record: dict) -> str:
    if "val/rewards/accuracies" not in record:  # KTO: unpaired, no accuracy
        return (f"step {record['step']:>4}: rewards desirable {record['val/rewards/chosen']:+.4f}, undesirable "
                f"{record['val/rewards/rejected']:+.4f}, kl {record['val/kl']:.4f} (n={record.get('val/examples', '?')}), "
                f"loss {record['val/loss']:.4f}")
    p, n = record["val/rewards/accuracies"], int(record.get("val/pairs", 0))
    if p == 0 and record["val/rewards/margins"] == 0:
        return f"step {record['step']:>4}: every pair tied (policy = reference: rewards 0), loss {record['val/loss']:.4f}"
    se = math.sqrt(p * (1 - p) / n) if n else float("nan")
    z = (p - 0.5) / math.sqrt(0.25 / n) if n else float("nan")
    return (f"step {record['step']:>4}: accuracy {p:.3f} +- {se:.3f} (n={n}, z vs 0.5 = {z:+.1f}), "
            f"margin {record['val/rewards/margins']:+.4f}, loss {record['val/loss']:.4f}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    for arg in argv:
        evals = evaluations(Path(arg))
        print(arg)
        for record in (evals[0], evals[-1]) if len(evals) > 1 else evals:
            print("  " + describe(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
