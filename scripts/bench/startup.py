"""Start-up share of the README's SmolLM2-135M fine-tune (one process): the GGUF file read directly
(``LLMTRAIN_GGUF_CACHE=off``, the path before the cache), the first run with the cache (``cold``:
it converts the file once) and a later run (``warm``: it loads the converted folder).

Start-up is from launching ``python -m llmtrain`` to the trainer's ``start-up: ready`` line (the
first training step starts right after it); it includes the step-0 evaluation, also printed apart.
Each run's start-up phases come from that line; CPU seconds are the process's user + system time
(the conversion's child process included) when the line appears, and for the whole run.

    python scripts/bench/startup.py DATA.json [--steps 30] [--rounds 1] [--modes off,cold,warm] [--out DIR]

Rounds alternate the order of ``off`` against ``cold, warm`` (``warm`` always follows its ``cold``).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"start-up: ready in ([\d.]+) s \((.*)\)")
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system seconds of ``pid`` and its waited-for children, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICK  # utime stime cutime cstime


def run(mode: str, args, out: Path, index: int) -> dict:
    cache = out / "gguf"
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true",
               LLMTRAIN_GGUF_CACHE="off" if mode == "off" else str(cache))
    run_dir = out / f"{index}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "llmtrain", f"name=startup-{mode}", "model=smollm2_135m", "data=alpaca",
               f"data.path={args.data}", "trainer=finetune", f"trainer.max_steps={args.steps}", f"run_dir={run_dir}",
               "trainer.resume=never", *args.overrides]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {"mode": mode}
    log = []
    for line in proc.stdout:
        log.append(line)
        match = READY.search(line)
        if match and "ready_s" not in result:
            result["ready_s"] = time.perf_counter() - started
            result["ready_cpu_s"] = _cpu_s(proc.pid)
            result["phases"] = {name.strip(): float(s) for name, s in
                                (part.rsplit(" ", 2)[:2] for part in match.group(2).split(", "))}
        if "step 1/" in line and "step1_s" not in result:
            result["step1_s"] = time.perf_counter() - started
    _, status, usage = os.wait4(proc.pid, 0)
    (out / f"{index}-{mode}.log").write_text("".join(log))
    result["total_s"] = time.perf_counter() - started
    result["total_cpu_s"] = usage.ru_utime + usage.ru_stime
    if status != 0 or "ready_s" not in result:
        sys.exit(f"{mode} run failed (status {status}):\n{''.join(log[-40:])}")
    return result


def report(r: dict) -> str:
    startup, evaluation = r["ready_s"], r["phases"].get("first evaluation", 0.0)
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items() if v >= 0.5)
    before_init = startup - sum(r["phases"].values())
    return (f"| {r['mode']} | {startup:.1f} | {evaluation:.1f} | {startup - evaluation:.1f} | {r['total_s']:.1f} | "
            f"{100 * startup / r['total_s']:.1f} % | {100 * (startup - evaluation) / r['total_s']:.1f} % | "
            f"{r['ready_cpu_s']:.1f} / {r['total_cpu_s']:.1f} | imports {before_init:.1f}, {phases} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="Alpaca-format JSON file (the README's alpaca_data.json)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default="off,cold,warm")
    parser.add_argument("--out", default="/tmp/llmtrain-startup")
    parser.add_argument("overrides", nargs="*", help="more llmtrain overrides, e.g. tracker=none")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    cached = [m for m in modes if m != "off"]
    rows, index = [], 0
    for round_ in range(args.rounds):
        off = ["off"] if "off" in modes else []
        order = off + cached if round_ % 2 == 0 else cached + off
        for mode in order:
            index += 1
            rows.append(run(mode, args, out, index))
            print(report(rows[-1]), flush=True)
    print(f"\n{args.steps} steps, start-up = launch to 'start-up: ready' (the first step starts after it); "
          f"machine load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"this process's children used {resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} CPU s")
    print("| mode | start-up s | of which step-0 eval s | start-up without eval s | run s | share | share without "
          "eval | CPU s start-up / run | phases s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
