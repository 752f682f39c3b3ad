"""``llmtrain.prepare`` throughput and the memory of training from token folders of two sizes.

    OMP_NUM_THREADS=1 python scripts/bench/prepare.py --text ../shared/data/tinyshakespeare.txt

1. Throughput: a JSONL corpus of ~50 MB (``--text`` cut into ~4 KB documents, repeated) is
   prepared with ``data.num_proc`` 1 and 2, alternating over ``--rounds``; tokens/s (wall) and
   the CPU seconds of the whole process tree are printed.
2. Memory: two token folders of synthetic ids (``--small-mb`` and ``--big-mb`` of uint16
   tokens, made for the byte tokenizer) are trained on for ``--steps`` steps each (tiny Llama,
   one process); the peak RSS each run reports (``memory/peak_bytes``) is compared.

Everything is written under ``~/.cache/llmtrain/bench`` (never the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchlib import REPO, children_cpu_s

WORK = Path.home() / ".cache" / "llmtrain" / "bench"


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=WORK)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def make_corpus(text_file: Path, megabytes: int) -> Path:
    corpus = WORK / f"corpus-{megabytes}mb.jsonl"
    if corpus.is_file():
        return corpus
    text = text_file.read_text()
    docs = [text[i:i + 4096] for i in range(0, len(text), 4096)]
    with open(corpus, "w") as f:
        written, k = 0, 0
        while written < megabytes * 1_000_000:
            line = json.dumps({"text": f"[{k}] " + docs[k % len(docs)]}) + "\n"
            f.write(line)
            written += len(line)
            k += 1
    return corpus


def synthetic_token_folder(megabytes: int) -> Path:
    from llmtrain.data.tokens import MANIFEST, TOKENS, tokenizer_fingerprint
    from llmtrain.models.build import byte_tokenizer

    folder = WORK / f"tokens-{megabytes}mb"
    if (folder / MANIFEST).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    count = megabytes * 1_000_000 // 2
    with open(folder / TOKENS, "wb") as f:
        for start in range(0, count, 1 << 24):
            n = min(1 << 24, count - start)
            f.write(rng.integers(0, 256, size=n, dtype=np.uint16).tobytes())
    tok = byte_tokenizer()
    (folder / MANIFEST).write_text(json.dumps({
        "tokenizer": "byte", "tokenizer_sha256": tokenizer_fingerprint(tok), "vocab_size": len(tok),
        "dtype": "uint16", "num_tokens": count, "num_documents": 1, "eos_token_id": tok.eos_token_id,
        "source": "synthetic"}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="a plain-text file to build the corpus from")
    parser.add_argument("--corpus-mb", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2_135m", help="model group whose tokenizer prepares")
    parser.add_argument("--small-mb", type=int, default=10)
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-prepare", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)

    if not args.skip_prepare:
        corpus = make_corpus(Path(args.text).resolve(), args.corpus_mb)
        print(f"corpus {corpus} ({corpus.stat().st_size / 1e6:.1f} MB)")
        print("| num_proc | tokens | wall s | tokens/s (wall) | CPU s (all processes) |")
        print("|---|---|---|---|---|")
        for r in range(args.rounds):
            for num_proc in ((1, 2) if r % 2 == 0 else (2, 1)):
                out = WORK / f"prepared-{num_proc}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(Path.home() / ".cache" / "llmtrain" / "datasets", ignore_errors=True)  # no cache hits
                cpu, wall = children_cpu_s(), time.perf_counter()
                run([sys.executable, "-m", "llmtrain.prepare", f"model={args.model}", "data=tinyshakespeare",
                     f"data.path={corpus}", f"data.num_proc={num_proc}", f"out={out}"])
                wall, cpu = time.perf_counter() - wall, children_cpu_s() - cpu
                tokens = json.loads((out / "manifest.json").read_text())["num_tokens"]
                print(f"| {num_proc} | {tokens:,} | {wall:.1f} | {tokens / wall:,.0f} | {cpu:.1f} |")
        same = (WORK / "prepared-1" / "tokens.bin").read_bytes() == (WORK / "prepared-2" / "tokens.bin").read_bytes()
        print(f"num_proc 1 and 2 give identical tokens.bin: {same}")

    print("| token folder | tokens | peak RSS (MiB) |")
    print("|---|---|---|")
    peaks = {}
    for mb in (args.small_mb, args.big_mb):
        folder = synthetic_token_folder(mb)
        run_dir = WORK / f"run-{mb}mb"
        shutil.rmtree(run_dir, ignore_errors=True)
        run([sys.executable, "-m", "llmtrain", f"run_dir={run_dir}", "data=tokens", f"data.path={folder}",
             "data.seq_len=128", f"trainer.max_steps={args.steps}", "trainer.eval_every=0", "trainer.eval_samples=16",
             "tracker=none", "trainer.progress_bar=false", "trainer.export_hf=false"])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        peaks[mb] = max(r.get("memory/peak_bytes", 0) for r in rows)
        tokens = json.loads((folder / "manifest.json").read_text())["num_tokens"]
        print(f"| {mb} MB | {tokens:,} | {peaks[mb] / 2**20:,.0f} |")
    diff = (peaks[args.big_mb] - peaks[args.small_mb]) / 2**20
    print(f"peak RSS difference ({args.big_mb} MB vs {args.small_mb} MB folder): {diff:+.0f} MiB")


if __name__ == "__main__":
    main()
