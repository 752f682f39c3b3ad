"""``recipe.compile=true`` against eager for the torch-native recipes (default fsdp and tp) on 2
processes: per-step losses (must agree within 1e-4) and tokens/s after compilation.

Each recipe trains ``--steps`` steps eager and compiled, in one torchrun launch
(``tests/scenarios.py``), in alternating order over ``--rounds``; tokens/s is the median of
steps 3.. (steps 1-2 include compilation), reported per recipe with the ratio compiled / eager.

    python scripts/bench/compile.py
    python scripts/bench/compile.py --recipes fsdp --steps 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import REPO
COMMON = ["model.architecture.hidden_size=256", "model.architecture.intermediate_size=688", "tracker=none",
          "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.eval_samples=4", "trainer.export_hf=false",
          "data.max_bytes=300000", "data.seq_len=128", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="*", default=["fsdp", "tp"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec, names = [], []
        for r in range(args.rounds):
            for compiled in ((False, True) if r % 2 == 0 else (True, False)):
                for recipe in args.recipes:
                    name = f"{recipe}-{'compiled' if compiled else 'eager'}-{r}"
                    names.append(name)
                    spec.append([f"{tmp}/{name}", COMMON + [f"+recipe={recipe}", f"trainer.max_steps={args.steps}",
                                                            f"recipe.compile={str(compiled).lower()}"]])
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(REPO / "tests" / "scenarios.py"), str(Path(tmp) / "spec.json")],
                             capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            print(out.stdout[-3000:], out.stderr[-6000:])
            return 1
        rows = {name: [json.loads(line) for line in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
                for name in names}
    print(f"2 processes, Ψ ≈ 3.0 M, {args.steps} steps, {args.rounds} rounds (alternating order)")
    for recipe in args.recipes:
        losses = {kind: [r["train/loss"] for r in rows[f"{recipe}-{kind}-0"] if "train/loss" in r]
                  for kind in ("eager", "compiled")}
        diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
        speed = {kind: statistics.median(r["train/tokens_per_s"] for n in names if n.startswith(f"{recipe}-{kind}-")
                                         for r in rows[n] if "train/loss" in r and r["step"] >= 3)
                 for kind in ("eager", "compiled")}
        print(f"{recipe:5s} max |loss compiled - eager| over {args.steps} steps: {diff:.2e}   tokens/s eager "
              f"{speed['eager']:.0f}, compiled {speed['compiled']:.0f}, ratio {speed['compiled'] / speed['eager']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
