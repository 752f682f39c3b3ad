"""A user's own vLLM server (``rollout.vllm_url``) restarted mid-run by its supervisor: the same
GRPO job (a tiny Llama built from its config, full fine-tuning, fp32, 5 steps, a real vLLM
server; the reward is whether a completion holds a letter a-m, which a random model's bytes
sometimes do, so that the losses are not all 0) run twice against it, undisturbed and with the server SIGKILLed once step 2 is logged and
started again on the same port with the weights it was first started on. Prints both runs' losses
(they must be equal: the run sends the restarted server its weights again before any request),
``rollout/vllm_restarts`` and ``rollout/logp_diff_max`` per step.

    python scripts/bench/vllm_user_restart.py

Needs the vLLM environment (docs/online-rl.md, vLLM). A few minutes on 2 CPU cores (three server
starts). The CI-sized checks of the same logic run on a stand-in server
(tests/test_vllm_servers.py, ``test_a_users_server_that_restarts...``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import benchlib


def _overrides(questions: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["tracker=none", "trainer.progress_bar=false", "model=tiny_llama", "objective=grpo", "data=prompts",
            f"data.path={questions}", "data.columns.prompt=question", "data.seq_len=64", "reward.functions=['format:[a-m]']",
            "rollout.engine=vllm", "rollout.max_completion_length=10", "objective.num_generations=4",
            "trainer.max_steps=5", "trainer.eval_every=0", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.lr=3e-3", "trainer.warmup_steps=1", "trainer.precision=fp32", "trainer.export_hf=false",
            "trainer.save_every=0", "rollout.vllm_args=[--enforce-eager]", f"run_dir={run_dir}", *extra]


def main() -> None:
    from llmtrain.checkpoint.export import write_policy
    from llmtrain.common.children import members, shm_files
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_model, build_tokenizer
    from llmtrain.rollout.vllm_server import _free_port, _request, server_command

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        questions = benchlib.sum_questions(root / "q.jsonl")
        cfg = compose(_overrides(questions, root / "x"))
        model = build_model(cfg.model, 0)
        policy = SimpleNamespace(full_state_dict=model.state_dict, frozen_in_bf16=False, env=SimpleNamespace(is_main=True),
                                 model=model)
        start_folder = write_policy(policy, cfg, build_tokenizer(cfg.model), root / "start", "model", [256])
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = server_command(cfg, start_folder, port)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))

        def start() -> subprocess.Popen:  # the user's supervisor
            process = subprocess.Popen(command, stdout=open(root / "server.log", "ab"), stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
            began = time.monotonic()
            while True:
                try:
                    _request(url, "/health", None, timeout=2)
                    print(f"the user's server is up in {time.monotonic() - began:.0f} s", flush=True)
                    return process
                except OSError:
                    assert process.poll() is None, (root / "server.log").read_text()[-3000:]
                    time.sleep(1)

        def kill(process: subprocess.Popen) -> None:  # and clean up after it, as a supervisor would
            held = shm_files(members(process.pid))
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            for path in held:
                path.unlink(missing_ok=True)

        server = start()
        try:
            rows = {}
            for name in ("undisturbed", "restarted"):
                run = root / name
                trainer = subprocess.Popen([sys.executable, "-m", "llmtrain", *_overrides(questions, run, f"rollout.vllm_url={url}")],
                                           stdout=open(root / f"{name}.log", "w"), stderr=subprocess.STDOUT)
                if name == "restarted":
                    metrics = run / "metrics.jsonl"
                    while not (metrics.exists() and any(json.loads(line).get("step", 0) >= 2 and "train/loss" in line
                                                        for line in metrics.read_text().splitlines())):
                        assert trainer.poll() is None, (root / f"{name}.log").read_text()[-3000:]
                        time.sleep(0.2)
                    kill(server)
                    print("SIGKILLed the user's server after step 2; its supervisor starts it again", flush=True)
                    server = start()
                assert trainer.wait() == 0, (root / f"{name}.log").read_text()[-3000:]
                rows[name] = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
            for name, rs in rows.items():
                diffs = ", ".join(f"{r['rollout/logp_diff_max']:.1e}" for r in rs)
                print(f"{name}: losses {[r['train/loss'] for r in rs]}, rollout/vllm_restarts "
                      f"{rs[-1]['rollout/vllm_restarts']:g}, rollout/logp_diff_max per step {diffs}")
            print("largest loss difference:", max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(*rows.values())))
        finally:
            kill(server)


if __name__ == "__main__":
    main()
