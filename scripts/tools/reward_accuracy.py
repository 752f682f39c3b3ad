"""Held-out accuracy of a reward model's export, through transformers alone.

    python scripts/tools/reward_accuracy.py RUN_DIR [--export DIR] [--limit N]

Loads ``RUN_DIR/hf`` (or ``--export``) with ``AutoModelForSequenceClassification`` and scores
the chosen and the rejected sequence of every held-out pair of the run (its ``config.yaml``
rebuilds the same validation split), then prints the share of pairs scored in order with its
binomial standard error sqrt(p (1 - p) / n), the z-score against chance, and the mean score
margin. An independent check of the run's own ``val/rewards/accuracies``: the export, its head
and its pooling are what a user loads.

Exit status 1 with a one-line message when the folder is no reward model (no classification
head) or the run directory has no config.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout, first on the path
sys.path.insert(0, str(REPO))


def load_reward_model(folder: Path):
    """(model, tokenizer) of a reward-model export.

    Raises:
        SystemExit: the folder is missing or holds no sequence-classification model (names the
            architectures it has and the fix).
    """
    import json

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = folder / "config.json"
    if not config.is_file():
        raise SystemExit(f"reward_accuracy: {folder} holds no config.json; give a Hugging Face export folder")
    architectures = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise SystemExit(f"reward_accuracy: {folder} is not a reward model: its architectures are {architectures}, "
                         "without a classification head; export a run trained with objective=reward")
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    import torch
    from omegaconf import OmegaConf

    from llmtrain import data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--export", type=Path, default=None, help="the export folder (default RUN_DIR/hf)")
    p.add_argument("--limit", type=int, default=0, help="score the first N held-out pairs only (0: all)")
    a = p.parse_args(argv)
    config = a.run_dir / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"reward_accuracy: {config} does not exist; give the run directory of a reward run")
    cfg = OmegaConf.load(config)
    model, tokenizer = load_reward_model(a.export or a.run_dir / "hf")
    splits = data.load_splits(cfg.data, tokenizer, cfg.trainer.seed)
    n = min(len(splits.val), a.limit) if a.limit else len(splits.val)
    pad = data.pad_id_of(tokenizer)
    wins, margins = 0, []
    with torch.no_grad():
        for k in range(0, n, 8):
            pairs = [splits.val[i] for i in range(k, min(k + 8, n))]
            rows = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
            longest = max(len(r) for r in rows)
            ids = torch.tensor([r + [pad] * (longest - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
            scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
            chosen, rejected = scores[:len(pairs)], scores[len(pairs):]
            wins += int((chosen > rejected).sum())
            margins += (chosen - rejected).tolist()
    acc = wins / n
    se = math.sqrt(acc * (1 - acc) / n)
    print(f"{a.run_dir}: {n} held-out pairs, chosen scored above rejected in {wins} = {acc:.3f} +- {se:.3f} "
          f"(z vs 0.5 = {(acc - 0.5) / math.sqrt(0.25 / n):+.1f}); mean margin {sum(margins) / n:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
