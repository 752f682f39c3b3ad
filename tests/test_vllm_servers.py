"""Several vLLM servers and their restarts (:mod:`llmtrain.rollout.vllm_engine`, issue 59).

On the stand-in server (tests/standin_vllm.py: completions drawn from the request's seed, the
processes shaped like vLLM's), everywhere: each group goes whole to one server named by its
record; the completions of 2 servers are those of 1; a server SIGKILLed is restarted on its port
and the requests it lost are answered with the same seeds; once ``rollout.vllm_restarts`` are used,
or when it cannot start again, one line names its log. CLI runs (``slow``): a run whose server is
killed mid-run finishes with the undisturbed run's losses; one whose server cannot come back ends
in one line (exit status 5) and its rerun continues to the same losses.

With the real vLLM (where its environment exists, as tests/test_grpo_vllm.py): 2 servers give
the completions of 1 for the same seeds (fp32). A real run whose server is SIGKILLed mid-run is in
tests/test_grpo_vllm.py, beside the undisturbed run it is compared with.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import standin_vllm
from conftest import FAST, REPO, cores_for, read_metrics, subprocess_env, train_rows
from test_process_census import Census, census  # noqa: F401  (census: a fixture, the stand-in servers' processes, killed after)

FIXTURES = "tests.grpo_fixtures"


def _engine(tmp_path: Path, servers: int, *extra: str, python: Path | None = None):
    """A VLLMEngine on ``servers`` servers, launched and watched as rank 0 does."""
    import threading

    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.generate import Sampling
    from llmtrain.rollout.vllm_engine import VLLMEngine

    tmp_path.mkdir(parents=True, exist_ok=True)
    python = python or standin_vllm.python_wrapper(tmp_path)
    cfg = compose(["objective=grpo", "data=prompts", "rollout.engine=vllm", f"rollout.vllm_python={python}",
                   f"run_dir={tmp_path / 'run'}", "rollout.vllm_start_timeout_s=60", f"rollout.vllm_servers={servers}",
                   *extra])
    (tmp_path / "run" / "rollout-weights").mkdir(parents=True, exist_ok=True)
    engine = VLLMEngine(cfg, build_tokenizer(cfg.model), Sampling(max_new=4, end_ids=frozenset({256})))
    engine._launch(tmp_path / "run" / "model")
    engine.watcher = threading.Thread(target=engine._watch, daemon=True)
    engine.watcher.start()
    return engine


SAMPLES = [{"prompt_ids": [1, 2, 3 + r], "record": r} for r in range(8)]
SEEDS = [[100 * r + k for k in range(3)] for r in range(8)]


def test_each_group_goes_whole_to_one_server_named_by_its_record():
    from llmtrain.rollout.vllm_engine import server_of

    chosen = [server_of({"record": r}, i, 2) for i, r in enumerate(range(100))]
    assert set(chosen) == {0, 1} and 30 <= sum(chosen) <= 70  # both servers get a share
    assert [server_of({"record": r}, 99 - i, 2) for i, r in enumerate(range(100))] == chosen  # the position is not read
    assert {server_of({"record": r}, 0, 1) for r in range(10)} == {0}
    assert server_of({}, 5, 2) == server_of({}, 5, 2)


def test_rollout_vllm_url_takes_several_servers_and_conflicting_fields_are_refused():
    from types import SimpleNamespace

    from llmtrain.common.errors import ConfigError
    from llmtrain.config.compose import compose
    from llmtrain.config.validate import validate_online
    from llmtrain.rollout.vllm_server import user_urls

    def urls(value):
        return user_urls(SimpleNamespace(rollout=SimpleNamespace(vllm_url=value)))

    assert urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert urls(["http://a:1", "http://b:2"]) == ["http://a:1", "http://b:2"] and urls("") == []
    base = ["objective=grpo", "data=prompts", "rollout.engine=vllm", "reward.functions=[gsm8k]"]
    for extra, field in ((["rollout.vllm_servers=0"], "rollout.vllm_servers=0"),
                         (["rollout.vllm_restarts=-1"], "rollout.vllm_restarts=-1"),
                         (["rollout.vllm_servers=2", "rollout.vllm_url=http://a:1"], "rollout.vllm_servers=2 with")):
        with pytest.raises(ConfigError, match=field):
            validate_online(compose(base + extra), {"prompts"})


def test_two_servers_answer_as_one_and_a_killed_one_comes_back_with_the_same_requests(tmp_path, census):
    import torch
    from safetensors.torch import save_file

    # The stand-in's completions depend on the weights it last loaded (a folder's name), as a model's do.
    step_7 = tmp_path / "step_7"
    step_7.mkdir()
    save_file({"w": torch.ones(3)}, str(step_7 / "model.safetensors"))
    one = _engine(tmp_path / "one", 1)
    try:
        start = one._requests(SAMPLES, SEEDS)
        one._load_all(step_7, 7)
        expected = one._requests(SAMPLES, SEEDS)
    finally:
        one.close()
    assert [[c.ids for c in g] for g in start] != [[c.ids for c in g] for g in expected]
    two = _engine(tmp_path / "two", 2)
    load = two._load

    def slow_load(*args):  # a restarted server answers before its weights are loaded: requests must wait
        time.sleep(3)
        load(*args)

    try:
        two._load_all(step_7, 7)
        assert [[c.ids for c in g] for g in two._requests(SAMPLES, SEEDS)] == [[c.ids for c in g] for g in expected]
        victim = two.servers[1]
        old_pid, port = victim.process.pid, victim.port
        two._load = slow_load
        os.kill(old_pid, signal.SIGKILL)
        again = two._requests(SAMPLES, SEEDS)  # waits for the restart and its weights, then the same seeds
        assert [[c.ids for c in g] for g in again] == [[c.ids for c in g] for g in expected]
        assert two.restarts == 1 and victim.process.pid != old_pid and victim.port == port
        for server in two.servers:  # each server, the restarted one too, serves image prompts' endpoint
            assert "--enable-scale-out" in Path(f"/proc/{server.process.pid}/cmdline").read_text().split("\0")
        assert two.metrics()["rollout/vllm_restarts"] == 1.0
    finally:
        two.close()
    assert census.left(timeout_s=5) == ([], [])


class UserServer:
    """A stand-in server a user started on ``port`` (its own session), which the user's supervisor
    can :meth:`restart` on the same port with the weights it was started on."""

    def __init__(self, port: int):
        self.port, self.process = port, None
        self.restart()

    def restart(self) -> None:
        from llmtrain.rollout.vllm_server import _request

        self.stop()
        self.process = subprocess.Popen([sys.executable, standin_vllm.__file__, "--port", str(self.port)],
                                        start_new_session=True, env=dict(os.environ))
        from llmtrain.common.children import members, shm_files

        deadline = time.monotonic() + 60
        while True:  # answering, and its engine's /dev/shm file made (for stop() to remove)
            try:
                _request(f"http://127.0.0.1:{self.port}", "/v1/models", None, timeout=2)
                if shm_files(members(self.process.pid)):
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            from llmtrain.common.children import members, shm_files, stop_group

            held = shm_files(members(self.process.pid))
            os.killpg(self.process.pid, signal.SIGKILL)  # the OOM killer, say
            stop_group(self.process.pid, self.process)
            for path in held:  # what the user's supervisor cleans after a killed server
                path.unlink(missing_ok=True)
            self.process = None


@pytest.mark.parametrize("when", ["between batches", "during a batch", "during a sync"])
def test_a_users_server_that_restarts_gets_the_runs_weights_before_any_request(tmp_path, census, when):
    """``rollout.vllm_url``: a user's server that comes back as a new process (on the weights it
    was started with) is told apart by its start time (``/metrics``), given the run's weights again
    by rank 0's watcher (counted in ``rollout/vllm_restarts``), and no completion comes from its
    own weights: a restart between batches is caught before the next one, one during a batch after
    it, and that server's requests are sent again with the same seeds; a sync that finds it down
    waits for it and sends it the whole model, then the sync's weights."""
    import threading

    import torch
    from safetensors.torch import save_file

    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.generate import Sampling
    from llmtrain.rollout.vllm_engine import VLLMEngine
    from llmtrain.rollout.vllm_server import _free_port

    step_7 = tmp_path / "step_7"
    step_7.mkdir()
    save_file({"w": torch.ones(3)}, str(step_7 / "model.safetensors"))
    user = UserServer(_free_port())
    cfg = compose(["objective=grpo", "data=prompts", "rollout.engine=vllm", f"rollout.vllm_url=http://127.0.0.1:{user.port}",
                   f"run_dir={tmp_path / 'run'}", "rollout.vllm_start_timeout_s=60"])
    (tmp_path / "run" / "rollout-weights").mkdir(parents=True)
    engine = VLLMEngine(cfg, build_tokenizer(cfg.model), Sampling(max_new=4, end_ids=frozenset({256})))
    try:
        own = [[c.ids for c in g] for g in engine._requests(SAMPLES, SEEDS)]  # nothing held yet: no check
        engine._load_all(step_7, 7)
        engine.watcher = threading.Thread(target=engine._watch_users, daemon=True)
        engine.watcher.start()
        expected = [[c.ids for c in g] for g in engine._requests(SAMPLES, SEEDS)]
        assert expected != own
        first = engine._held(engine.servers[0])
        if when == "during a sync":
            user.stop()
            threading.Timer(1.5, user.restart).start()
            engine._load_all(step_7, 8)  # the same weights as a later step's: the same completions
        elif when == "between batches":
            user.restart()  # back within the watcher's second: only its start time tells
            assert [[c.ids for c in g] for g in user_completions(user.port)] == own  # its own weights
        else:
            complete, restarted = engine._complete, threading.Event()

            def restart_midway(job):
                if job[:2] == (4, 0) and not restarted.is_set():
                    restarted.set()
                    user.restart()
                return complete(job)

            engine._complete = restart_midway
        again = [[c.ids for c in g] for g in engine._requests(SAMPLES, SEEDS)]
        assert again == expected
        assert engine.restarts == 1 and engine._held(engine.servers[0]) not in (None, first)
        assert engine.metrics()["rollout/vllm_restarts"] == 1.0
    finally:
        engine.close()
        user.stop()
    assert census.left(timeout_s=5) == ([], [])


@pytest.mark.parametrize("why", ["restarts used", "gone"])
def test_a_users_server_that_cannot_get_the_weights_back_is_one_line(tmp_path, census, why):
    """Once ``rollout.vllm_restarts`` are used, a user's server that restarted ends the run in one
    line; so does one that does not answer for ``rollout.vllm_start_timeout_s``."""
    import threading

    import torch
    from safetensors.torch import save_file

    from llmtrain.common.errors import ChildDied
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.generate import Sampling
    from llmtrain.rollout.vllm_engine import VLLMEngine
    from llmtrain.rollout.vllm_server import _free_port

    step_7 = tmp_path / "step_7"
    step_7.mkdir()
    save_file({"w": torch.ones(3)}, str(step_7 / "model.safetensors"))
    user = UserServer(_free_port())
    url = f"http://127.0.0.1:{user.port}"
    cfg = compose(["objective=grpo", "data=prompts", "rollout.engine=vllm", f"rollout.vllm_url={url}",
                   f"run_dir={tmp_path / 'run'}", "rollout.vllm_start_timeout_s=3", "rollout.vllm_restarts=0"])
    (tmp_path / "run" / "rollout-weights").mkdir(parents=True)
    engine = VLLMEngine(cfg, build_tokenizer(cfg.model), Sampling(max_new=4, end_ids=frozenset({256})))
    try:
        engine._load_all(step_7, 7)
        engine.watcher = threading.Thread(target=engine._watch_users, daemon=True)
        engine.watcher.start()
        user.restart() if why == "restarts used" else user.stop()
        with pytest.raises(ChildDied) as err:
            engine._requests(SAMPLES, SEEDS)
    finally:
        engine.close()
        user.stop()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"rollout.engine=vllm: the vLLM server at {url} "), message
    assert ("restarted mid-run on weights not the run's; rollout.vllm_restarts=0 reloads used" if why == "restarts used"
            else "did not come back within rollout.vllm_start_timeout_s=3") in message, message
    assert "Rerun the same command" in message or "rerun the same command" in message
    assert census.left(timeout_s=5) == ([], [])


def user_completions(port: int):
    """What the user's server at ``port`` answers SAMPLES with SEEDS on its own, with no run's watcher."""
    from llmtrain.config.compose import compose
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout.generate import Sampling
    from llmtrain.rollout.vllm_engine import VLLMEngine

    cfg = compose(["objective=grpo", "data=prompts", "rollout.engine=vllm", f"rollout.vllm_url=http://127.0.0.1:{port}"])
    return VLLMEngine(cfg, build_tokenizer(cfg.model), Sampling(max_new=4, end_ids=frozenset({256})))._requests(
        SAMPLES, SEEDS)


@pytest.mark.parametrize("why", ["restarts used", "cannot start"])
def test_a_server_that_cannot_come_back_is_one_line_naming_its_log(tmp_path, census, monkeypatch, why):
    from llmtrain.common.errors import ChildDied

    flag = tmp_path / "fail"
    monkeypatch.setenv("STANDIN_FAIL_START", str(flag))
    engine = _engine(tmp_path, 2, "rollout.vllm_restarts=0" if why == "restarts used" else "rollout.vllm_restarts=3")
    try:
        flag.touch()
        victim = engine.servers[1]
        pid = victim.process.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ChildDied) as err:
            engine._requests(SAMPLES, SEEDS)
        message = str(err.value)
        assert "\n" not in message and f"the vLLM server 1 (pid {pid}) was killed by SIGKILL" in message
        assert f"its log: {tmp_path / 'run' / 'vllm_server_1.log'}" in message and "Rerun the same command" in message
        assert ("rollout.vllm_restarts=0 restarts used" if why == "restarts used" else
                "did not come back after a restart (the vLLM server exited with status 1 while starting") in message
    finally:
        engine.close()
    assert census.left(timeout_s=5) == ([], [])


def test_the_memory_folder_of_synced_weights_goes_with_its_trainer_even_on_sigkill(tmp_path):
    """The /dev/shm folder a full fine-tuning sync writes to: removed by close(), and by its guard
    when the trainer is SIGKILLed (nothing else would free that memory); a rerun finds no record."""
    from llmtrain.common import children
    from llmtrain.rollout.vllm_server import MemoryFolder

    folder = MemoryFolder(tmp_path)
    path = folder.open(1)
    (path / "model.safetensors").write_bytes(b"x" * 1024)
    folder.close()
    assert not path.exists() and not (tmp_path / children.RECORD).exists()
    code = ("import sys, time; from pathlib import Path; from llmtrain.rollout.vllm_server import MemoryFolder; "
            f"p = MemoryFolder(Path({str(tmp_path)!r})).open(1); (p / 'w').write_bytes(b'x'); print(p, flush=True); "
            "time.sleep(600)")
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    path = Path(trainer.stdout.readline().strip())
    assert (path / "w").is_file()
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not path.exists(), "the weights' memory folder outlived its SIGKILLed trainer"


# ---- the CLI on the stand-in ---------------------------------------------------------------------------
def _questions(folder: Path) -> Path:
    rng = random.Random(0)
    path = folder / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a}+{b}?", "answer": f"#### {a + b}"}) + "\n"
                            for a, b in ((rng.randint(0, 50), rng.randint(0, 50)) for _ in range(32))))
    return path


def _overrides(tmp_path: Path, run: str, steps: int, *extra: str) -> list[str]:
    python = standin_vllm.python_wrapper(tmp_path)
    return [o for o in FAST if not o.startswith(("data.max_bytes", "trainer.eval"))] + [
        "objective=grpo", "data=prompts", f"data.path={_questions(tmp_path)}", "data.columns.prompt=question",
        f"reward.functions=[{FIXTURES}:odd_tokens]", "rollout.engine=vllm", f"rollout.vllm_python={python}",
        "rollout.max_completion_length=4", "objective.num_generations=2", f"trainer.max_steps={steps}",
        "data.val_fraction=0.1", "trainer.eval_samples=2", "trainer.eval_every=0", "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2", "trainer.export_hf=false", "trainer.save_every=1", "rollout.vllm_servers=2",
        f"run_dir={tmp_path / run}", *extra]


def _run(overrides: list[str], env: dict, kill=None) -> tuple[int, str]:
    """``python -m llmtrain``; ``kill(process)`` is called once a server has answered."""
    process = subprocess.Popen([sys.executable, "-m", "llmtrain", *overrides], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        if kill is not None:
            kill(process)
        out, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, out


def _kill_server_once_sampling(census: Census, after_step: int, run_dir: Path, flag: Path | None = None):
    def kill(process):
        deadline = time.monotonic() + 300
        while not [r for r in read_metrics(run_dir) if r.get("step", 0) >= after_step and "train/loss" in r] \
                if (run_dir / "metrics.jsonl").exists() else True:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        if flag is not None:
            flag.touch()
        os.kill(census.roles()["server"][-1], signal.SIGKILL)
    return kill


@pytest.mark.slow
def test_a_run_whose_server_is_killed_finishes_with_the_undisturbed_losses(tmp_path, census):
    env = {**subprocess_env(), **census.env}
    with cores_for(1):
        code, out = _run(_overrides(tmp_path, "calm", 6), env)
        assert code == 0, out[-3000:]
        code, out = _run(_overrides(tmp_path, "killed", 6), env,
                         _kill_server_once_sampling(census, 2, tmp_path / "killed"))
    assert code == 0, out[-3000:]
    assert "restarting it on port" in out and "(restart 1 of rollout.vllm_restarts=2)" in out, out[-3000:]
    calm, killed = train_rows(tmp_path / "calm", 6), train_rows(tmp_path / "killed", 6)
    assert [r["train/loss"] for r in killed] == [r["train/loss"] for r in calm]
    assert killed[-1]["rollout/vllm_restarts"] == 1.0 and calm[-1]["rollout/vllm_restarts"] == 0.0
    assert census.left(timeout_s=10) == ([], []), out[-3000:]


@pytest.mark.slow
def test_a_server_that_cannot_come_back_ends_the_run_in_one_line_and_the_rerun_continues(tmp_path, census):
    flag = tmp_path / "fail"
    env = {**subprocess_env(), **census.env, "STANDIN_FAIL_START": str(flag)}
    with cores_for(1):
        code, out = _run(_overrides(tmp_path, "calm", 6), env)
        assert code == 0, out[-3000:]
        code, out = _run(_overrides(tmp_path, "broken", 6), env,
                         _kill_server_once_sampling(census, 2, tmp_path / "broken", flag))
        assert code == 5 and "Traceback" not in out and out.count("llmtrain: error:") == 1, out[-3000:]
        line = next(x for x in out.splitlines() if "llmtrain: error:" in x)
        assert "did not come back after a restart" in line and "vllm_server" in line and ".log" in line, line
        flag.unlink()
        code, again = _run(_overrides(tmp_path, "broken", 6), env)
    assert code == 0, again[-3000:]
    calm = [r["train/loss"] for r in train_rows(tmp_path / "calm", 6)]
    assert [r["train/loss"] for r in train_rows(tmp_path / "broken", 6)] == calm
    assert census.left(timeout_s=10) == ([], []), again[-3000:]


# ---- with vLLM ---------------------------------------------------------------------------------------
from test_grpo_vllm import needs_vllm, overrides, questions, stand_in_policy  # noqa: E402,F401  (questions: a fixture)


def _real_engine(cfg, policy_model, step):
    from llmtrain.checkpoint.export import write_policy
    from llmtrain.models.build import build_tokenizer
    from llmtrain.rollout import build_sampler

    tokenizer = build_tokenizer(cfg.model)
    engine = build_sampler(cfg, tokenizer, [256])
    policy = stand_in_policy(policy_model, step)
    engine.publish = lambda directory, part: write_policy(policy, cfg, tokenizer, directory, part, [256])
    prompts = [{"prompt_ids": list(tokenizer(f"What is {a}+{a}?")["input_ids"]), "record": a} for a in range(8)]
    return engine, policy, prompts


@needs_vllm
@pytest.mark.slow
@pytest.mark.server
def test_two_vllm_servers_give_the_completions_of_one(questions, tmp_path):
    """fp32, the same seeds: the completions (and their log-probs) of 2 servers, each on one CPU
    and sampling its share of the groups, are those of 1 server sampling all, before and after a
    weight sync (every server gets the weights)."""
    import torch

    from llmtrain.config.compose import compose
    from test_grpo_vllm import _tiny_policy

    results = {}
    for servers in (1, 2):
        cfg = compose(overrides(questions, f"run_dir={tmp_path / str(servers)}", "rollout.max_completion_length=12",
                                f"rollout.vllm_servers={servers}"))
        model, step = _tiny_policy(), [0]
        engine, policy, prompts = _real_engine(cfg, model, step)
        seeds = [[11 + r, 12 + r, 13 + r] for r in range(len(prompts))]
        try:
            before = engine.sample(policy, prompts, seeds)
            torch.manual_seed(5)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            step[0] = 1
            after = engine.sample(policy, prompts, seeds)
            assert engine.version == 1
        finally:
            engine.close()
        results[servers] = [[(c.ids, c.logps) for c in g] for g in before + after]
    ids = {n: [[c[0] for c in g] for g in r] for n, r in results.items()}
    assert ids[2] == ids[1]
    worst = max(abs(a - b) for g1, g2 in zip(results[1], results[2]) for (_, l1), (_, l2) in zip(g1, g2)
                for a, b in zip(l1, l2))
    print(f"largest |log-prob difference| 2 servers vs 1: {worst:.2e}")
    assert worst <= 1e-5
