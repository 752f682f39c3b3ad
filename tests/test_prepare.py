"""``python -m llmtrain.prepare``: token folders equal for any num_proc, training from one equals
training from the raw text, and bad input exits 2 without writing."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import FAST, REPO, assert_ok, read_metrics, run_scenarios, subprocess_env

SOURCE = ["data.max_bytes=120000"]


def prepare(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmtrain.prepare", *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=REPO, timeout=300)


def test_prepared_tokens_train_exactly_like_the_raw_text(tmp_path):
    outs = {}
    for num_proc in (1, 2):
        outs[num_proc] = tmp_path / f"tokens-{num_proc}"
        proc = prepare(SOURCE + [f"data.num_proc={num_proc}", f"out={outs[num_proc]}"])
        assert_ok(proc)
        assert "tokens/s" in proc.stdout and f"data.path={outs[num_proc]}" in proc.stdout
    assert (outs[1] / "tokens.bin").read_bytes() == (outs[2] / "tokens.bin").read_bytes()
    manifest = json.loads((outs[1] / "manifest.json").read_text())
    assert manifest["num_tokens"] * 2 == (outs[1] / "tokens.bin").stat().st_size and manifest["dtype"] == "uint16"
    common = [o for o in FAST if not o.startswith("data.max_bytes")] + ["trainer.max_steps=5", "trainer.export_hf=false"]
    dirs = run_scenarios({"raw": common + SOURCE,
                          "prepared": common + ["data=tokens", f"data.path={outs[2]}", "data.seq_len=64",
                                       "data.val_fraction=0.02"]},  # data=stdlib's own split
                         nproc=1, root=tmp_path)

    def losses(run_dir):
        return [(r["step"], r["train/loss"], r["data/sample_digest"]) for r in read_metrics(run_dir) if "train/loss" in r]
    assert len(losses(dirs["raw"])) == 5
    assert losses(dirs["prepared"]) == losses(dirs["raw"])


def test_prepare_refuses_bad_input_and_writes_nothing(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    cases = {
        "taken": (SOURCE + [f"out={tmp_path / 'taken'}"], "exists and is not empty"),
        "no out": (SOURCE, "give the output folder once, as out=DIR"),
        "chat": (["data=chat", "data.path=x.json", f"out={tmp_path / 'a'}"], "tokenizes one format=text source"),
        "typo": (["data.max_byte=5", f"out={tmp_path / 'b'}"], "max_byte"),
        "a file": (SOURCE + [f"out={tmp_path / 'taken' / 'keep.txt'}"], "keep.txt is a file"),
    }
    for name, (args, needle) in cases.items():
        proc = prepare(args)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_killed_prepares_half_written_folders_are_removed_by_the_next_run(tmp_path):
    """A writer killed while writing (SIGKILL: no cleanup of its own) leaves
    ``.NAME.partial-<pid>@<host>`` beside the folder; the next run there removes those of dead
    processes on this host, and leaves those of live processes and of other hosts."""
    import os
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = [f".tokens.partial-{dead.pid}@{host}", f".tokens.partial-{dead.pid}"]  # and the older name
    kept = [f".tokens.partial-{os.getpid()}@{host}", f".tokens.partial-{dead.pid}@another-host",
            f".other.partial-{dead.pid}@{host}"]
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokens.bin").write_bytes(b"\0" * 10)
    assert_ok(prepare(["data.max_bytes=20000", f"out={tmp_path / 'tokens'}"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["tokens"])
