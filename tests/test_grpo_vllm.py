"""``rollout.engine=vllm`` (:mod:`llmtrain.rollout.vllm_server`).

What runs everywhere: the config refusals, the server's command line, the start-up checks of the
vLLM environment and of a user's server, and the folder :func:`write_policy` writes for a server
(untied head, equal logits). What needs vLLM's own environment (``~/.cache/llmtrain/vllm-venv`` or
``$LLMTRAIN_VLLM_PYTHON``; the set-up in docs/online-rl.md; skipped without it, as in CI): the engine against a
real server, checked against the policy itself (transformers): its greedy completions equal the
``hf`` engine's, the log-probs it reports for sampled tokens equal the policy's recomputed ones
(fp32, 1e-3) before and after weights change and are synced; and training runs (LoRA on 2 ranks,
full fine-tuning on 1) whose every step reports ``rollout/logp_diff_max`` within 1e-3, and whose
server is gone at the end and after SIGTERM; a server SIGKILLed mid-run is restarted and the run
keeps the undisturbed full fine-tuning run's losses (that run is shared: a module fixture); and
SIGKILL of the API server or of the trainer mid-run leaves no process of the server's session (its
engine core and workers) and no ``/dev/shm`` file.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import FAST, assert_ok, cores_for, live_processes_in, read_metrics, run_cli, train_rows
from llmtrain.common.errors import ConfigError
from llmtrain.config.compose import compose
from llmtrain.rollout.vllm_server import vllm_python

PYTHON = vllm_python(SimpleNamespace(rollout=SimpleNamespace(vllm_python="")))
needs_vllm = pytest.mark.skipif(not PYTHON.is_file(), reason=f"no vLLM environment at {PYTHON} (docs/online-rl.md, vLLM)")
FIXTURES = "tests.grpo_fixtures"


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("vllm-q") / "questions.jsonl"
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(64)]
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in pairs), encoding="utf-8")
    return path


def overrides(questions: Path, *extra: str) -> list[str]:
    """The tests' vLLM GRPO job on ``questions``, then ``extra``. The server runs eager
    (``--enforce-eager``): vLLM's start-up compilation of a full fine-tune's model took 20-80 s
    of each server start on 2 cores, where a tiny model's few tokens gain nothing from it."""
    eager = [] if any(e.startswith("rollout.vllm_args=") for e in extra) else ["rollout.vllm_args=[--enforce-eager]"]
    return [o for o in FAST if not o.startswith(("data.max_bytes", "data.seq_len", "trainer.eval"))] + [
        "objective=grpo", "data=prompts", f"data.path={questions}", "data.columns.prompt=question", "data.seq_len=64",
        f"reward.functions=[{FIXTURES}:odd_tokens,{FIXTURES}:answer_seen]", "rollout.engine=vllm",
        "rollout.max_completion_length=10", "objective.num_generations=4", "trainer.max_steps=5",
        "data.val_fraction=0.1", "trainer.eval_samples=4", "trainer.eval_every=0", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2", "trainer.lr=3e-3", "trainer.warmup_steps=1", "trainer.precision=fp32",
        "trainer.export_hf=false", *eager, *extra]


# ---- everywhere --------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["rollout.sync_every=0"], "rollout.sync_every=0"),
    (["+peft=lora", "peft.modules_to_save=[lm_head]"], "peft.modules_to_save"),
])
def test_vllm_configs_that_cannot_work_are_refused_naming_the_field(questions, extra, message):
    from llmtrain.config.validate import validate

    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        validate(compose(overrides(questions, *extra)), 1)


def test_the_server_command_serves_the_run_as_configured(questions, tmp_path):
    from llmtrain.rollout.vllm_server import server_command

    cfg = compose(overrides(questions, "+peft=lora", "peft.r=4", "trainer.precision=bf16", "rollout.vllm_args=[--enforce-eager]"))
    command = server_command(cfg, tmp_path, 8123)
    text = " ".join(command)
    for part in ("-m vllm.entrypoints.openai.api_server", f"--model {tmp_path}", "--port 8123", "--dtype bfloat16",
                 "--max-model-len 64", "--logprobs-mode processed_logprobs", "--no-enable-prefix-caching",
                 "--enable-lora --max-lora-rank 8", "--seed 1234", "--no-enable-chunked-prefill", "--enforce-eager",
                 "--enable-scale-out"):  # (image prompts' endpoint)
        assert part in text, part
    assert "--enable-lora" not in server_command(compose(overrides(questions)), tmp_path, 1)


def test_a_missing_environment_and_an_unreachable_server_are_refused_before_anything_is_written(questions, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(overrides(questions, f"rollout.vllm_python={tmp_path}/nothing/bin/python", f"run_dir={run_dir}"))
    assert proc.returncode == 2 and "rollout.vllm_python=" in proc.stderr and "does not exist" in proc.stderr
    proc = run_cli(overrides(questions, "rollout.vllm_url=http://127.0.0.1:9", f"run_dir={run_dir}"))
    assert proc.returncode == 2 and "rollout.vllm_url=http://127.0.0.1:9: no vLLM server answers" in proc.stderr
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def stand_in_policy(model, step: list[int]) -> SimpleNamespace:
    """What the vLLM engine reads of the trainer's engine, for ``model`` at optimizer step
    ``step[0]``: its full state dict, the main rank, the step count, and the model itself (the
    weights-only sync looks for frozen blocks there)."""
    return SimpleNamespace(full_state_dict=lambda: model.state_dict(), frozen_in_bf16=False, env=SimpleNamespace(is_main=True),
                           optimizer_step_count=lambda: step[0], model=model)


def _tiny_policy(seed: int = 0):
    from llmtrain.models.build import build_model

    cfg = compose(["model=tiny_llama"])
    return build_model(cfg.model, seed).eval()


def test_the_folder_written_for_a_server_has_an_untied_head_and_the_policys_logits(questions, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmtrain.checkpoint.export import write_policy
    from llmtrain.models.build import build_tokenizer

    cfg = compose(overrides(questions))
    model = _tiny_policy()
    engine = SimpleNamespace(full_state_dict=lambda: model.state_dict(), frozen_in_bf16=False, env=SimpleNamespace(is_main=True))
    folder = write_policy(engine, cfg, build_tokenizer(cfg.model), tmp_path / "w", "model", [256])
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and model.config.tie_word_embeddings
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 9, 3, 7, 100]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 256


def test_a_syncs_weights_are_the_model_folders_tensors_in_the_servers_dtype_without_frozen_blocks(questions, tmp_path):
    """``write_policy(..., "weights")`` (what a full fine-tuning sync sends) holds exactly the
    ``"model"`` folder's tensors, the untied head included, cast to bf16 for a bf16 run; a
    transformer block whose parameters are all frozen is left out, a block with one trainable
    tensor is written whole."""
    from safetensors.torch import load_file

    from llmtrain.checkpoint.export import write_policy
    from llmtrain.models.build import build_tokenizer

    model = _tiny_policy()
    engine = SimpleNamespace(full_state_dict=lambda: model.state_dict(), frozen_in_bf16=False, env=SimpleNamespace(is_main=True), model=model)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cfg = compose(overrides(questions, f"trainer.precision={precision}"))
        tokenizer = build_tokenizer(cfg.model)
        whole = load_file(write_policy(engine, cfg, tokenizer, tmp_path / precision / "m", "model", [256]) / "model.safetensors")
        sent = load_file(write_policy(engine, cfg, tokenizer, tmp_path / precision / "w", "weights") / "model.safetensors")
        assert sorted(sent) == sorted(whole) and "lm_head.weight" in sent
        assert all(sent[k].dtype == dtype and torch.equal(sent[k], whole[k].to(dtype)) for k in whole)
        assert sorted(p.name for p in (tmp_path / precision / "w").iterdir()) == ["model.safetensors"]
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("model.layers.0.") or name.endswith("mlp.up_proj.weight"))
        if name.startswith("model.layers.1."):
            p.requires_grad_(False)
    sent = load_file(write_policy(engine, cfg, tokenizer, tmp_path / "frozen", "weights") / "model.safetensors")
    assert not [k for k in sent if k.startswith("model.layers.1.")]
    assert sorted(k for k in sent if k.startswith("model.layers.0.")) == sorted(k for k in whole if k.startswith("model.layers.0."))
    assert sorted(sent) == sorted(k for k in whole if not k.startswith("model.layers.1."))


# ---- with vLLM ---------------------------------------------------------------------------------
@needs_vllm
def test_vllm_samples_with_the_policys_weights_before_and_after_a_sync(questions, tmp_path):
    """The engine against the policy itself: greedy completions equal the hf engine's (llmtrain's
    sampling loop on the same weights), sampled tokens' log-probs equal the policy's own, and
    after the weights change (a step) the server samples with the new ones."""
    from llmtrain.checkpoint.export import write_policy
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout import build_sampler
    from llmtrain.rollout.generate import sample_group

    cfg = compose(overrides(questions, f"run_dir={tmp_path / 'run'}", "rollout.max_completion_length=12"))
    tokenizer = build_tokenizer(cfg.model)
    model = _tiny_policy()
    engine = build_sampler(cfg, tokenizer, [256])
    step = [0]
    policy = stand_in_policy(model, step)
    engine.publish = lambda directory, part: write_policy(policy, cfg, tokenizer, directory, part, [256])
    prompts = [{"prompt_ids": list(tokenizer(f"What is {a}+{a}?")["input_ids"])} for a in (3, 17, 42)]
    largest = []
    try:
        engine.check()
        for version in range(2):
            if version:
                torch.manual_seed(5)
                with torch.no_grad():  # an optimizer step's worth of change
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                step[0] = 1
            greedy = engine.sample(policy, prompts, [[None]] * len(prompts))
            for sample, (completion,) in zip(prompts, greedy):
                (ours,) = sample_group(model, sample["prompt_ids"], [None], engine.sampling, torch.device("cpu"))
                assert completion.ids == ours.ids and completion.truncated == ours.truncated
            sampled = engine.sample(policy, prompts, [[11, 12, 13]] * len(prompts))
            for sample, group in zip(prompts, sampled):
                for completion in group:
                    ids = torch.tensor([sample["prompt_ids"] + completion.ids])
                    with torch.no_grad():
                        logits = model(ids).logits[0, len(sample["prompt_ids"]) - 1:-1] / cfg.rollout.temperature
                    ours = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, len(sample["prompt_ids"]):, None])
                    largest.append(float((ours[:, 0] - torch.tensor(completion.logps, dtype=torch.float64)).abs().max()))
            assert {len(set(tuple(c.ids) for c in group)) for group in sampled} != {1}  # seeds differ, completions too
            assert engine.version == step[0]
        print(f"largest |log-prob difference| vLLM vs policy over {len(largest)} completions: {max(largest):.2e}")
        assert max(largest) <= 1e-3
        process = engine.process
    finally:
        engine.close()
    assert process.poll() is not None and not (tmp_path / "run" / "rollout-weights").exists()


def _trained_with_weights_in_sync(run_dir: Path, name: str) -> list[dict]:
    """The 5 train rows of a finished vLLM run, checked: every step's ``rollout/logp_diff_max``
    within 1e-3 (fp32), the reward scored, the server gone and its log kept in the run folder."""
    rows = train_rows(run_dir, 5)
    diffs = [r["rollout/logp_diff_max"] for r in rows]
    print(name, "rollout/logp_diff_max per step:", [f"{d:.1e}" for d in diffs])
    assert len(diffs) == 5 and max(diffs) <= 1e-3, diffs
    assert rows[-1]["train/reward"] == rows[-1]["train/reward"]  # scored
    assert not _servers_of(run_dir), "the vLLM server outlived its run"
    assert (run_dir / "vllm_server.log").stat().st_size > 0  # the server's log stays in the run folder
    # Each step's sampling follows a sync (sync_every=1): its writing is a part of it.
    assert all(0 < r["rollout/sync_write_s"] < r["rollout/sync_s"] for r in rows[1:]), rows
    return rows


@pytest.fixture(scope="module")
def full_fine_tuning(questions, tmp_path_factory) -> Path:
    """One undisturbed full fine-tuning run (fp32, 1 rank) on vLLM: checked by itself, and the
    losses a run whose server is killed must keep."""
    run_dir = tmp_path_factory.mktemp("vllm-full") / "calm"
    with cores_for(2):  # the trainer and its server (conftest: the ``server`` marker)
        assert_ok(run_cli(overrides(questions, f"run_dir={run_dir}"), timeout=900))
    return run_dir


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
def test_full_fine_tuning_trains_with_weights_in_sync(full_fine_tuning):
    _trained_with_weights_in_sync(full_fine_tuning, "full")


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
def test_lora_on_two_ranks_trains_with_weights_in_sync(questions, tmp_path):
    run_dir = tmp_path / "lora"
    assert_ok(run_cli(overrides(questions, f"run_dir={run_dir}", "+peft=lora", "peft.r=4", "+recipe=ddp"), nproc=2,
                      timeout=900))
    _trained_with_weights_in_sync(run_dir, "lora")


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
def test_a_vllm_server_killed_mid_run_is_restarted_and_the_run_keeps_its_losses(questions, full_fine_tuning, tmp_path):
    """Full fine-tuning, fp32: SIGKILL to the server once step 2 is logged; it is restarted with
    the weights of the step the trainer had reached (2, or later when the trainer ran on before the
    kill landed), and the run's losses equal the undisturbed run's."""
    run_dir, log = tmp_path / "killed", tmp_path / "out.log"
    proc = _launch(questions, run_dir, log)
    try:
        _wait_for_step(proc, run_dir, log, 2, timeout=800)
        os.kill(proc.pid, signal.SIGSTOP)  # the trainer waits while its server is killed: no step passes meanwhile
        records = json.loads((run_dir / ".children.json").read_text())
        os.kill(next(r["pid"] for r in records if r["kind"] == "vLLM server"), signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(timeout=800) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    restart = re.search(r"restarting it on port \d+ with the weights of step (\d+)", out)
    assert restart and 2 <= int(restart.group(1)) <= 4, out[-4000:]
    calm, killed = train_rows(full_fine_tuning, 5), _trained_with_weights_in_sync(run_dir, "killed")
    print("losses", [r["train/loss"] for r in calm], [r["train/loss"] for r in killed])
    assert [r["train/loss"] for r in killed] == pytest.approx([r["train/loss"] for r in calm], abs=1e-6)
    assert killed[-1]["rollout/vllm_restarts"] == 1.0 and calm[-1]["rollout/vllm_restarts"] == 0.0


@needs_vllm
@pytest.mark.slow
@pytest.mark.alone
def test_asynchronous_generation_samples_the_next_batch_while_the_step_trains(questions, tmp_path):
    """LoRA on 2 ranks, ``rollout.async_generation=true``: step k's batch was sampled by the
    server with the weights of step k - 1 (staleness 1 from step 2), in the background while
    step k - 1 trained; the first batch's importance ratio (π_θ0 over vLLM's own log-probs of
    θ0's samples) is 1 within 1e-3 (fp32), later ones move with the weights, and the
    correction's weights are reported every step."""
    run_dir = tmp_path / "async"
    assert_ok(run_cli(overrides(questions, f"run_dir={run_dir}", "+peft=lora", "peft.r=4", "+recipe=ddp",
                                "rollout.async_generation=true"), nproc=2, timeout=900))
    rows = train_rows(run_dir, 5)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert rows[0]["train/importance_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert all(0 < r["train/importance_ratio/mean"] < 10 and "rollout/logp_diff_max" not in r for r in rows)
    assert not _servers_of(run_dir), "the vLLM server outlived its run"


def _servers_of(run_dir: Path) -> list[int]:
    """Pids of processes whose command line names the run's folder (its vLLM server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in command and "vllm" in command:
                found.append(int(entry.name))
    return found


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("ending", ["sigterm", "reward error"])
def test_the_server_stops_with_the_run_on_sigterm_and_on_errors(questions, tmp_path, ending):
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    extra = ["trainer.max_steps=200"] if ending == "sigterm" else [
        f"reward.functions=[{FIXTURES}:raises_at_step_two]"]
    proc = _launch(questions, run_dir, log, *extra)
    if ending == "sigterm":
        _wait_for_step(proc, run_dir, log, 1)
        assert _servers_of(run_dir), "no vLLM server while training"
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == (0 if ending == "sigterm" else 1), log.read_text()[-3000:]
    if ending != "sigterm":
        assert "reward function raises_at_step_two raised ValueError at step" in log.read_text()
    for _ in range(30):
        if not _servers_of(run_dir):
            break
        time.sleep(1)
    assert not _servers_of(run_dir), f"the vLLM server outlived the run ({ending})"


def _launch(questions: Path, run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    """``python -m llmtrain`` on the tests' vLLM job (:func:`overrides`) in ``run_dir``, its output to ``log``."""
    from conftest import subprocess_env

    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "llmtrain", *overrides(questions, f"run_dir={run_dir}", *extra)],
                                env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int, timeout: float = 600) -> None:
    """Until the train row of ``step`` (or a later one) is logged; the run ending or ``timeout``
    seconds passing first fails the test with the end of its ``log``."""
    deadline = time.monotonic() + timeout
    while not ((run_dir / "metrics.jsonl").exists() and
               [r for r in read_metrics(run_dir) if r.get("step", 0) >= step and "train/loss" in r]):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
@pytest.mark.parametrize("killed", ["api server", "trainer"])
def test_no_vllm_process_outlives_a_run_whose_server_or_trainer_was_killed(questions, tmp_path, killed):
    """Issue 61: SIGKILL of the API server mid-run (the OOM killer) left its ``VLLM::EngineCore``
    and ``VLLM::Worker`` running; now the run ends in one line (exit status 5) and nothing of the
    server's session, nor a ``/dev/shm`` file it made, remains. SIGKILL of the trainer: the
    server's guard ends its whole group (vLLM's own shutdown could wait on a request left in flight)."""
    from llmtrain.common.children import members, shm_files

    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    proc = _launch(questions, run_dir, log, "trainer.max_steps=200", "rollout.vllm_restarts=0")
    _wait_for_step(proc, run_dir, log, 1)
    server = json.loads((run_dir / ".children.json").read_text())[0]["pid"]
    assert len(live_processes_in({server})) > 1, "no engine process beside the API server"
    # This run's /dev/shm files only (tests beside it make their own): what the server's processes
    # hold now, and the trainer's weights folder (vllm_server.MemoryFolder names it by the trainer's pid).
    held = shm_files(members(server))
    assert held, "the vLLM server's processes hold no /dev/shm file"
    os.kill(server if killed == "api server" else proc.pid, signal.SIGKILL)
    status = proc.wait(timeout=600)
    if killed == "api server":
        text = log.read_text()
        assert status == 5 and "Traceback" not in text, text[-3000:]
        assert f"llmtrain: error: rollout.engine=vllm: the vLLM server (pid {server}) was killed by SIGKILL" in text
    def new_shm() -> list[Path]:
        return [p for p in held | set(Path("/dev/shm").glob(f"llmtrain-weights-{proc.pid}-*")) if p.exists()]

    # Both guards (the server's group, the weights folder) act on the trainer's death within a
    # second, and the server's group goes within its 30 s grace: wait as the census does.
    for _ in range(60):
        if not live_processes_in({server}) and not new_shm():
            break
        time.sleep(1)
    assert not live_processes_in({server}), f"vLLM processes outlived the run ({killed})"
    assert not new_shm(), f"/dev/shm files left: {new_shm()}"
