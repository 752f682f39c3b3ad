"""Write the digits folder of docs/vision.md without a download: scikit-learn's bundled copy of
the UCI handwritten digits (``sklearn.datasets.load_digits``: 1,797 8x8 images, values 0-16) as
32x32 grayscale PNGs (each pixel 4x4, value x 255 / 16) and two JSON lines files in TRL's
conversational vision layout, one image and one question per record, the digit as the answer:

    python scripts/make_digits.py --out digits     # digits/images/0000.png ..., train.jsonl, test.jsonl

The first 1,497 images go to ``train.jsonl``, the last 300 to ``test.jsonl``; image paths are
relative to the folder. ``train_pairs.jsonl`` holds the training images as preference pairs in
TRL's VLM DPO layout (``prompt`` with the image, the digit chosen, another digit rejected, drawn
by a generator seeded with the image's index). Needs scikit-learn, numpy and Pillow (not
torchvision).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

QUESTION = "Which digit (0-9) is written in this image? Answer with the digit only."
TEST_RECORDS = 300


def record(index: int, digit: int) -> dict:
    """The record of image ``index`` showing ``digit``."""
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": [{"type": "text", "text": str(digit)}]}],
            "images": [f"images/{index:04d}.png"], "answer": str(digit)}


def pair(index: int, digit: int) -> dict:
    """Image ``index`` as a preference pair: ``digit`` chosen, another digit rejected."""
    import random

    wrong = random.Random(index).choice([d for d in range(10) if d != digit])
    return {"prompt": record(index, digit)["messages"][:1],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": str(digit)}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": str(wrong)}]}],
            "images": [f"images/{index:04d}.png"]}


def write_digits(out: Path, limit: int | None = None) -> int:
    """Write the folder (the first ``limit`` images only, when given); returns the records written."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    n = len(digits.target) if limit is None else min(limit, len(digits.target))
    (out / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        # 0-16 intensities to 0-255, each pixel 4x4 so image processors get more than 8x8.
        pixels = np.rint(digits.images[i] * 255 / 16).astype(np.uint8).repeat(4, 0).repeat(4, 1)
        Image.fromarray(pixels).save(out / "images" / f"{i:04d}.png")
        records.append(record(i, int(digits.target[i])))
    split = max(0, len(digits.target) - TEST_RECORDS)
    pairs = [pair(i, int(digits.target[i])) for i in range(min(n, split))]
    for name, part in (("train.jsonl", records[:split]), ("test.jsonl", records[split:]), ("train_pairs.jsonl", pairs)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="digits", help="folder to write (default: digits)")
    parser.add_argument("--limit", type=int, default=None, help="write only the first N images")
    args = parser.parse_args()
    print(f"wrote {write_digits(Path(args.out), args.limit)} images and their records to {args.out}")


if __name__ == "__main__":
    main()
