"""A run ends with llmtrain's own closing lines: library chatter (wandb's run summary, its
"Symlinked 1 file" warnings) is off by default and the trackers finish before llmtrain says what
it wrote."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from conftest import FAST, REPO, make_cfg, sigint_as_in_a_terminal, subprocess_env


def test_a_wandb_offline_run_ends_with_llmtrains_closing_lines(tmp_path):
    env = subprocess_env()
    for key in ("WANDB_SILENT", "WANDB_QUIET", "WANDB_API_KEY"):  # wandb's defaults, as a user has them
        env.pop(key, None)
    env.update(NETRC=str(tmp_path / "no-netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    run_dir = tmp_path / "run"
    overrides = [o for o in FAST if not o.startswith("tracker")] + [
        "tracker.wandb_mode=offline", "trainer.max_steps=2", f"run_dir={run_dir}"]
    # One stream, as a terminal or a log file shows it (llmtrain logs to stdout, wandb to stderr).
    proc = subprocess.run([sys.executable, "-m", "llmtrain", *overrides], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, env=env, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-2] == f"exported: {run_dir / 'hf'} (export)", out[-3000:]
    assert lines[-1] == f"run report: {run_dir / 'report.png'} and {run_dir / 'report.md'}", out[-3000:]
    # Before: 33 lines of wandb's run summary and sync hints after them, and one "wandb: WARNING
    # Symlinked 1 file into the W&B run directory" per report file.
    assert "Symlinked" not in out and "Run summary" not in out and "wandb sync" not in out, out[-3000:]
    # Nor its three notices at the start (offline mode, the folder, a viewer): llmtrain's one line says where.
    assert not any(line.startswith("wandb:") for line in lines), out[-3000:]
    assert sum(line.startswith("wandb offline run ") for line in lines) == 1, out[-3000:]
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    for name in ("report.png", "report.md"):  # wandb still has the report, as a copy
        copy = folder / "files" / name
        assert not copy.is_symlink() and copy.read_bytes() == (run_dir / name).read_bytes()


@pytest.mark.parametrize("environ,debug,quiet", [({}, False, True), ({"WANDB_QUIET": "false"}, False, None),
                                                 ({"WANDB_SILENT": "true"}, False, None), ({}, True, None)])
def test_wandb_is_quiet_unless_the_user_or_debug_mode_says_otherwise(environ, debug, quiet, monkeypatch):
    from llmtrain.monitoring.tracking.wandb_backend import wandb_settings

    for key in ("WANDB_QUIET", "WANDB_SILENT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    logger = logging.getLogger("llmtrain")
    level = logger.level
    logger.setLevel(logging.DEBUG if debug else logging.INFO)  # debug: hydra.verbose=llmtrain
    try:
        settings = wandb_settings()
    finally:
        logger.setLevel(level)
    assert (None if settings is None else settings.quiet) == quiet


def _interrupt_when(args: list[str], marker: str, tmp_path, module: str = "llmtrain") -> subprocess.Popen:
    """``python -m MODULE ARGS`` sent SIGINT (Ctrl-C) once a line of its output contains ``marker``;
    returns the ended process with its stderr read."""
    import signal

    out = open(tmp_path / "out.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=out, text=True,
                            env=subprocess_env(), cwd=REPO, preexec_fn=sigint_as_in_a_terminal)
    seen = []
    for line in proc.stdout:  # llmtrain logs to stdout
        seen.append(line)
        if marker in line:
            proc.send_signal(signal.SIGINT)
            break
    seen += proc.stdout.read().splitlines(keepends=True)
    proc.wait(timeout=120)
    out.seek(0)
    proc.stderr_text, proc.stdout_text = out.read(), "".join(seen)
    assert any(marker in line for line in seen), proc.stdout_text[-3000:] + proc.stderr_text[-3000:]
    return proc


def test_ctrl_c_in_start_up_ends_in_one_line(tmp_path):
    """Ctrl-C during the step-0 held-out evaluation (GRPO's greedy completions of 60 prompts): one
    line naming the phase, exit status 130, the timeline closed and no checkpoint (before: an
    84-line KeyboardInterrupt traceback)."""
    import json

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i}+{i}?"}) + "\n" for i in range(120)))
    run_dir = tmp_path / "run"
    args = FAST[:5] + ["objective=grpo", "data=prompts", f"data.path={data}", "data.columns.prompt=question",
                       "data.val_fraction=0.5", "reward.functions=[tests.grpo_fixtures:odd_tokens]",
                       "rollout.max_completion_length=32", "objective.num_generations=2", "trainer.global_batch_size=2",
                       "trainer.micro_batch_size=1", "trainer.max_steps=2", "trainer.eval_every=1",
                       "trainer.eval_samples=60", "trainer.precision=fp32", f"run_dir={run_dir}"]
    proc = _interrupt_when(args, "start-up: first evaluation", tmp_path)
    assert proc.returncode == 130, proc.stdout_text[-3000:] + proc.stderr_text[-3000:]
    assert proc.stderr_text.strip().splitlines() == [
        "llmtrain: interrupted: SIGINT (Ctrl-C) in start-up, during first evaluation: nothing was trained; "
        f"{run_dir} holds config.yaml and logs, no checkpoint"], proc.stderr_text[-3000:]
    assert "Traceback" not in proc.stdout_text and "eval at step 0" not in proc.stdout_text
    events = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("reason")) for e in events if e["event"] in ("start", "end")] == [
        ("start", None), ("end", "interrupted")]  # a rerun does not report a crash
    assert not any((run_dir / "checkpoints").glob("*")) and not (run_dir / "hf").exists()


@pytest.mark.parametrize("module,args,line", [
    ("llmtrain", [*FAST, "trainer.max_steps=2", "run_dir=run"],
     r"llmtrain: interrupted: SIGINT \(Ctrl-C\) in start-up, [\w ,()-]+: nothing was trained(; .*)?"),
    # A Hugging Face folder (made below): evaluate imports lm_eval and torch and loads it.
    ("llmtrain.evaluate", ["hf", "tasks=[hh_local]", "limit=2", "out_dir=eval"],
     r"llmtrain\.evaluate: interrupted: SIGINT \(Ctrl-C\): no result written"),
    ("llmtrain.plan", ["model=smollm2_135m", "world_size=2"], r"llmtrain\.plan: interrupted: SIGINT \(Ctrl-C\): stopped"),
    ("llmtrain.export", ["no-such-checkpoint", "out"], r"llmtrain\.export: interrupted: SIGINT \(Ctrl-C\): stopped"),
    ("llmtrain.prepare", ["out=tokens"], r"llmtrain\.prepare: interrupted: SIGINT \(Ctrl-C\): stopped"),
], ids=["llmtrain", "evaluate", "plan", "export", "prepare"])
def test_ctrl_c_at_any_moment_of_the_first_seconds_ends_in_one_line(module, args, line, tmp_path):
    """SIGINT 0.1, 0.5, 1 and 2 s after the command starts (imports, reading the config, importing
    torch or lm_eval, the trainer's start-up: whichever phase each lands in) ends in one line and
    exit status 130 (before: 12 to 117 lines of traceback from the schema's import, Hydra's parser
    or its compose). No moment is asserted to land in a given phase; a command that already ended
    on its own (the short ones, on a fast machine) is not signalled."""
    import re
    import signal
    import time

    if module == "llmtrain.evaluate":
        from llmtrain.models.build import build_model, build_tokenizer

        cfg = make_cfg([])
        build_model(cfg.model, seed=0).save_pretrained(tmp_path / "hf")
        build_tokenizer(cfg.model).save_pretrained(tmp_path / "hf")
    signalled = []
    for moment in (0.1, 0.5, 1.0, 2.0):
        proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=subprocess_env(), cwd=tmp_path, preexec_fn=sigint_as_in_a_terminal)
        time.sleep(moment)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            signalled.append(moment)
        out, err = proc.communicate(timeout=300)
        if signalled[-1:] != [moment] or re.match(r"\S+: error: ", err):
            continue  # ended on its own (the last: just as the signal came)
        assert proc.returncode == 130, (moment, out[-2000:], err[-3000:])
        said = [s for s in err.splitlines() if s.strip() and not re.match(r"\[[\d:]+\]\[llmtrain\] ", s)]  # (logs)
        assert len(said) == 1 and re.fullmatch(line, said[0]), (moment, err[-3000:])
        assert "Traceback" not in out, (moment, out[-2000:])
    assert signalled[:2] == [0.1, 0.5], signalled


def test_torchs_start_up_runs_with_ctrl_c_held():
    """A SIGINT that lands inside torch's C++ start-up (torch.distributed's ``_c10d_init`` calls
    back into Python through pybind11) cannot unwind there: the process aborted, SIGABRT, in about
    1 of 50 Ctrl-Cs half a second into ``python -m llmtrain.evaluate`` (CI, 2026-12-06). So the
    package, read by runpy for a command, imports torch while Ctrl-C is held: a SIGINT as torch's
    import begins is recorded, not raised, and the import completes."""
    code = """if True:
        import importlib.abc, signal, sys
        class Ring(importlib.abc.MetaPathFinder):  # Ctrl-C as torch's C++ start-up begins
            def find_spec(self, name, path, target=None):
                if name == "torch._C":
                    signal.raise_signal(signal.SIGINT)
        sys.meta_path.insert(0, Ring())
        sys.argv[:1] = ["-m"]  # as runpy sets it while it imports the package of python -m llmtrain.plan
        sys.orig_argv[:] = [sys.executable, "-m", "llmtrain.plan"]
        import llmtrain
        from llmtrain.common import interrupt
        print("torch" in sys.modules and sys.modules["torch"].__spec__._initializing is False, interrupt._seen)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          preexec_fn=sigint_as_in_a_terminal,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], (done.stdout, done.stderr[-2000:])
