#!/usr/bin/env python
"""The step's wait for data from a token folder in object storage, with and without reading ahead
(``data.prefetch=0`` against the default), side by side, rounds alternating the order.

A moto S3 server on 127.0.0.1 (as tests/test_object_storage.py starts it) holds a token folder
prepared from the embedded corpus. Each run is a fresh ``python -m llmtrain`` process in which
every request to the store first sleeps ``--latency-ms`` (s3fs's ``_cat_file`` wrapped: a GET's
round trip to a far store), and token blocks are 4 KiB with a 256 KiB cache, standing for a
folder far larger than the 64 MiB cache: most samples of the shuffled order miss it. Per mode:
``time/data_wait_s`` summed over the steps after the first ``--warmup``, as a share of their
``train/step_time_s``, and the mean step time; medians over rounds.

    python scripts/bench/data_wait.py [--rounds 3] [--steps 40] [--latency-ms 20] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib

BUCKET = "llmtrain-bench"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
       "AWS_EC2_METADATA_DISABLED": "true"}
JOB = ["tracker=none", "tracker.report=false", "trainer.progress_bar=false", "trainer.precision=fp32",
       "trainer.eval_every=0", "trainer.export_hf=false", "trainer.log_every=1", "data=tokens", "data.seq_len=64",
       "data.val_fraction=0.01", "trainer.global_batch_size=32", "trainer.micro_batch_size=8"]


def child(latency_s: float, overrides: list[str]) -> None:
    """One training run with ``latency_s`` added to every request to the store."""
    import asyncio
    import runpy

    import s3fs

    from llmtrain.data import remote

    read = s3fs.S3FileSystem._cat_file

    async def slow(self, *args, **kwargs):
        await asyncio.sleep(latency_s)
        return await read(self, *args, **kwargs)

    s3fs.S3FileSystem._cat_file = slow
    remote.RemoteTokenFile.BLOCK = 4096  # 64 blocks: a 256 KiB cache
    sys.argv = ["llmtrain", *overrides]
    runpy.run_module("llmtrain", run_name="__main__", alter_sys=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def figures(run_dir: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/step_time_s" in r][warmup:]
    wait, total = sum(r["time/data_wait_s"] for r in steps), sum(r["train/step_time_s"] for r in steps)
    return {"share": wait / total, "wait_ms": 1000 * wait / len(steps), "step_ms": 1000 * total / len(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.child:
        return child(args.latency_ms / 1000, overrides)
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    os.environ.update(ENV, AWS_ENDPOINT_URL=f"http://127.0.0.1:{server._port}")
    modes = {"prefetch=0": ["data.prefetch=0"], "prefetch=4": ["data.prefetch=4"]}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        url = f"s3://{BUCKET}/tokens"
        with tempfile.TemporaryDirectory() as tmp:
            prepared = subprocess.run([sys.executable, "-m", "llmtrain.prepare", f"out={url}", *overrides],
                                      cwd=benchlib.REPO, capture_output=True, text=True,
                                      env=dict(os.environ, PYTHONPATH=str(benchlib.REPO)))
            if prepared.returncode != 0:
                raise SystemExit(f"prepare failed: {prepared.stderr[-2000:]}")
            for r in range(args.rounds):
                for mode in benchlib.alternating(list(modes), r):
                    run_dir = Path(tmp) / f"{mode.replace('=', '')}-{r}"  # no '=' in an override's value
                    command = [sys.executable, __file__, "--child", f"--latency-ms={args.latency_ms}", *JOB,
                               f"data.path={url}", f"trainer.max_steps={args.steps}", *modes[mode], *overrides,
                               f"run_dir={run_dir}"]
                    proc = subprocess.run(command, cwd=benchlib.REPO, capture_output=True, text=True,
                                          env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                                                   PYTHONPATH=str(benchlib.REPO)))
                    if proc.returncode != 0:
                        raise SystemExit(f"{mode} failed: {proc.stderr[-3000:]}")
                    results[mode].append(figures(run_dir, args.warmup))
                    print(f"round {r} {mode}: " + json.dumps({k: round(v, 4) for k, v in results[mode][-1].items()}),
                          flush=True)
    finally:
        server.stop()
    print(f"\n{args.latency_ms:g} ms per request, {args.steps} steps ({args.warmup} warm-up left out), "
          f"{args.rounds} rounds, medians:")
    print("| mode | data wait per step (ms) | step time (ms) | data wait share of step time |")
    print("|---|---|---|---|")
    for mode, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        print(f"| `data.{mode}` | {med['wait_ms']:.1f} | {med['step_ms']:.1f} | {100 * med['share']:.1f} % |")


if __name__ == "__main__":
    main()
