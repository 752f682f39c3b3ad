"""Data in object storage (``s3://``, docs/object-storage.md) against a real S3-compatible server:
moto's server mode on 127.0.0.1, started for this module, not a mock of the client. Training
from a token folder or a JSONL file in the bucket equals training from the same files on disk,
``llmtrain.prepare out=s3://`` writes the same bytes as to a folder, and every URL that cannot
be read (another scheme, a missing bucket or key, no credentials, no server) is one line, exit
2, before anything is written."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FAST, REPO, make_cfg, read_metrics, run_scenarios, subprocess_env
from llmtrain.data.prefetch import THREAD_NAME

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "llmtrain-test"
SOURCE = ["data.max_bytes=120000"]  # test_prepare's corpus: the first stdlib files
COMMON = [o for o in FAST if not o.startswith("data.max_bytes")] + ["trainer.max_steps=3", "trainer.export_hf=false"]
# No credentials or config files of this machine's user, and no EC2 metadata lookups (seconds each).
ISOLATED = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(server) -> None:
    server.stop()
    server._server.server_close()  # stop() leaves the socket listening: requests would hang, not fail


@pytest.fixture(scope="module")
def server():
    """moto's S3 server on 127.0.0.1 (its buckets live in this process: a restart keeps them)."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    yield server
    if server._server_ready_event.is_set():
        _stop(server)


@pytest.fixture(scope="module")
def store(server):
    """An empty bucket on :func:`server`; ``AWS_*`` set for this process and the subprocesses it
    starts (``subprocess_env`` copies the environment), restored after."""
    endpoint = f"http://127.0.0.1:{server._port}"
    saved = {name: os.environ.get(name) for name in [*ISOLATED, "AWS_ENDPOINT_URL"]}
    os.environ.update(ISOLATED, AWS_ENDPOINT_URL=endpoint)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    try:
        yield fs
    finally:
        from llmtrain.data import remote

        remote._fs = None  # its client points at this server: no later test of the worker reuses it
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO,
                          env=subprocess_env(), timeout=300)


def _losses(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["train/loss"], r["data/sample_digest"]) for r in read_metrics(run_dir) if "train/loss" in r]


def test_training_from_s3_equals_training_from_disk(store, tmp_path):
    """prepare to a folder and to the bucket (same bytes); pre-training from either, and SFT from
    a JSONL file on disk or in the bucket, read whole or streamed (``data.streaming=true``): the
    same losses, sample for sample. The runs from disk
    read in the step (``data.prefetch=0``), those from the bucket ahead of it (the default): the
    same samples too, the wait logged as ``time/data_wait_s``, and no read-ahead thread left."""
    from llmtrain.prepare import main as prepare

    local = tmp_path / "tokens"
    for out in (str(local), f"s3://{BUCKET}/tokens/a"):  # in this process: 10 s of imports less each
        assert prepare(SOURCE + [f"out={out}"]) == 0
    for name in ("tokens.bin", "manifest.json"):
        assert store.cat_file(f"{BUCKET}/tokens/a/{name}") == (local / name).read_bytes(), name
    records = [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{i} + {i + 3} = {2 * i + 3}."}
               for i in range(48)]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in records))
    store.put_file(str(sft), f"{BUCKET}/sft/sft.jsonl")
    from llmtrain.trainer import train

    tokens = COMMON + ["data=tokens", "data.seq_len=64", "data.val_fraction=0.02"]
    alpaca = COMMON + ["data=alpaca", "data.max_records=48", "data.seq_len=256"]  # prompts of ~150 byte tokens
    runs = {"tokens-local": tokens + [f"data.path={local}", "data.prefetch=0"],
            "tokens-s3": tokens + [f"data.path=s3://{BUCKET}/tokens/a"],
            "sft-local": alpaca + [f"data.path={sft}", "data.prefetch=0"],
            "sft-s3": alpaca + [f"data.path=s3://{BUCKET}/sft/sft.jsonl"],
            # data.streaming=true: the bucket's file read as a stream, never copied whole.
            "stream-local": alpaca + [f"data.path={sft}", "data.streaming=true", "data.shuffle_buffer=8"],
            "stream-s3": alpaca + [f"data.path=s3://{BUCKET}/sft/sft.jsonl", "data.streaming=true",
                                   "data.shuffle_buffer=8"]}
    for name, overrides in runs.items():  # in this process, one after another (as tests/scenarios.py runs them)
        train(make_cfg(overrides + [f"run_dir={tmp_path / name}"]))
    for kind in ("tokens", "sft", "stream"):
        assert len(_losses(tmp_path / f"{kind}-local")) == 3
        assert _losses(tmp_path / f"{kind}-s3") == _losses(tmp_path / f"{kind}-local"), kind
    waits = [r["time/data_wait_s"] for r in read_metrics(tmp_path / "tokens-s3") if "train/loss" in r]
    assert len(waits) == 3 and min(waits) >= 0
    assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.mark.slow
def test_two_processes_from_s3_equal_two_processes_from_disk_and_continue_exactly_after_kill_9(store, tmp_path):
    """2-process (gloo) pre-training from the token folder in the bucket and on disk: each rank
    reads its own blocks by ranged GETs, ahead of the step; the losses are equal. The run from the
    bucket killed with SIGKILL after step 3 (checkpoint at step 2) and launched again continues
    exactly: the losses and samples of the undisturbed run, bit for bit; the same checkpoint
    resumed on 1 process continues with the same samples."""
    from llmtrain.prepare import main as prepare
    from test_resume import kill_after

    local = tmp_path / "tokens"
    assert prepare(SOURCE + [f"out={local}"]) == 0
    store.put(str(local), f"{BUCKET}/tokens/two", recursive=True)
    tokens = [o for o in COMMON if not o.startswith("trainer.max_steps=")] + [
        "data=tokens", "data.seq_len=64", "data.val_fraction=0.02", "trainer.max_steps=5", "trainer.save_every=2"]
    from_s3 = tokens + [f"data.path=s3://{BUCKET}/tokens/two"]
    dirs = run_scenarios({"local": tokens + [f"data.path={local}"], "s3": from_s3}, nproc=2, root=tmp_path)
    assert len(_losses(dirs["local"])) == 5
    assert _losses(dirs["s3"]) == _losses(dirs["local"])
    killed = tmp_path / "killed"
    kill_after(from_s3 + [f"run_dir={killed}", "trainer.hang_timeout_s=0"], killed, 3, nproc=2)  # a sealed step-2 checkpoint
    import shutil

    shutil.copytree(killed, tmp_path / "on-one")  # the 2-rank step-2 checkpoint, resumed below on 1 process
    run_scenarios({"killed": from_s3}, nproc=2, root=tmp_path)  # the same command again, in the same run folder
    assert [r for r in _losses(killed) if r[0] > 2][-3:] == _losses(dirs["s3"])[2:]
    # On 1 process: the same samples at every step (the order is the global sample index's), and
    # the losses up to the order of the sums (one rank accumulates what two all-reduced).
    run_scenarios({"on-one": from_s3}, nproc=1, root=tmp_path)
    one = [r for r in _losses(tmp_path / "on-one") if r[0] > 2][-3:]
    assert [(r[0], r[2]) for r in one] == [(r[0], r[2]) for r in _losses(dirs["s3"])[2:]]
    assert [r[1] for r in one] == pytest.approx([r[1] for r in _losses(dirs["s3"])[2:]], rel=1e-5)


@pytest.mark.slow
def test_sft_from_s3_killed_mid_run_and_run_again_continues_exactly(store, tmp_path):
    """SFT from a JSONL file in the bucket (copied once into the cache), one process, checkpoint
    every 2 steps: killed with SIGKILL while stalled before step 4 and launched again with the same
    command, it continues exactly: the losses and samples of an undisturbed run, bit for bit."""
    from test_resume import kill_after, launch

    from llmtrain.trainer import train

    records = [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{i} + {i + 3} = {2 * i + 3}."}
               for i in range(40)]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in records))
    store.put_file(str(sft), f"{BUCKET}/sft-kill/sft.jsonl")
    args = [o for o in COMMON if not o.startswith("trainer.max_steps=")] + [
        "data=alpaca", "data.seq_len=256", f"data.path=s3://{BUCKET}/sft-kill/sft.jsonl", "trainer.max_steps=6",
        "trainer.save_every=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2"]
    train(make_cfg(args + [f"run_dir={tmp_path / 'whole'}"]))
    killed = tmp_path / "killed"
    kill_after(args + [f"run_dir={killed}"], killed, 3, nproc=1)  # a sealed step-2 checkpoint
    rerun = launch(args + [f"run_dir={killed}"], nproc=1)
    out = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, out[-3000:]
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 6 and [r for r in _losses(killed) if r[0] > 2][-4:] == whole[2:]


def test_remote_token_file_reads_the_same_ids_across_blocks(store, tmp_path, monkeypatch):
    from llmtrain.data import remote

    ids = np.arange(5000, dtype=np.uint16)
    store.pipe(f"{BUCKET}/ranged/tokens.bin", ids.tobytes())
    monkeypatch.setattr(remote.RemoteTokenFile, "BLOCK", 1000)  # bytes: slices cross blocks
    file = remote.RemoteTokenFile(f"s3://{BUCKET}/ranged/tokens.bin", "uint16", ids.nbytes, "data.path", cache_blocks=3)
    assert len(file) == 5000
    for start, stop in ((0, 64), (450, 1550), (4990, 5000), (7, 7), (0, 5000)):
        assert np.array_equal(file[start:stop], ids[start:stop]), (start, stop)
    assert len(file._cache) == 3
    fetched = remote.RemoteTokenFile(f"s3://{BUCKET}/ranged/tokens.bin", "uint16", ids.nbytes, "data.path",
                                     cache_blocks=3)
    fetched.fetch([(4990, 5000), (0, 64), (450, 510)])  # bytes 0-127, 900-1019, 9980-9999: blocks 0, 1, 9 at once
    assert sorted(fetched._cache) == [0, 1, 9]
    fetched.fetch([(0, 5000)])  # 10 blocks wanted, room for 3: the first 3 missing ones only
    assert list(fetched._cache) == [2, 3, 4]
    assert np.array_equal(fetched[450:510], ids[450:510]) and np.array_equal(fetched[4990:5000], ids[4990:5000])
    # The folder's manifest is checked as on disk: another tokenizer's folder, or no manifest, is refused.
    from llmtrain.common.errors import DataError
    from llmtrain.data.tokens import open_tokens
    from llmtrain.models.build import byte_tokenizer

    manifest = {"tokenizer": "other", "tokenizer_sha256": "0" * 64, "vocab_size": 260, "dtype": "uint16",
                "num_tokens": 5000, "num_documents": 1, "eos_token_id": 0, "source": "test"}
    store.pipe(f"{BUCKET}/ranged/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(DataError, match=rf"^data.path: s3://{BUCKET}/ranged was tokenized with other \(sha256 "
                                        r"000000000000\), but this run's tokenizer is"):
        open_tokens(f"s3://{BUCKET}/ranged", byte_tokenizer(), "data")
    with pytest.raises(DataError, match=rf"^data.path: s3://{BUCKET}/nothing is not a token folder"):
        open_tokens(f"s3://{BUCKET}/nothing", byte_tokenizer(), "data")


def test_transient_faults_are_retried_and_counted_then_one_error(monkeypatch):
    from llmtrain.common.errors import DataError
    from llmtrain.data import remote

    monkeypatch.setattr(remote, "_FIRST_WAIT_S", 0.001)
    faults = [ConnectionResetError(104, "Connection reset by peer"), TimeoutError("read timed out")]

    def flaky():
        if faults:
            raise faults.pop(0)
        return b"ok"
    before = remote.retries()
    assert remote.call(flaky, "s3://b/k", "data.path") == b"ok"
    assert remote.retries() == before + 2

    def down():
        raise ConnectionRefusedError(111, "Connection refused")
    with pytest.raises(DataError) as err:
        remote.call(down, "s3://b/k", "data.path", attempts=3)
    assert str(err.value).startswith("data.path=s3://b/k: the object store at ") and "(after 3 tries)" in str(err.value)
    assert "AWS_ENDPOINT_URL" in str(err.value) and "\n" not in str(err.value)

    def missing():
        raise FileNotFoundError("b/k")
    with pytest.raises(DataError, match="no such object"):  # an answer, not a fault: not retried
        remote.call(missing, "s3://b/k", "data.path")
    assert remote.retries() == before + 4


def test_a_store_down_for_a_while_is_waited_out_and_counted(store, server, monkeypatch):
    """The server stopped (connections refused) and started again 1 s after the read's first
    retry: the read retries until it is back, and the retries are counted; stopped for good, the
    read ends in one error naming the URL and AWS_ENDPOINT_URL."""
    import threading

    from llmtrain.common.errors import DataError
    from llmtrain.data import remote

    ids = np.arange(3000, dtype=np.uint32)
    store.pipe(f"{BUCKET}/outage/tokens.bin", ids.tobytes())
    monkeypatch.setattr(remote, "_FIRST_WAIT_S", 0.1)
    file = remote.RemoteTokenFile(f"s3://{BUCKET}/outage/tokens.bin", "uint32", ids.nbytes, "data.path")
    before = remote.retries()
    _stop(server)

    def restart_once_refused() -> None:  # not on a clock: a loaded machine could start the read after it
        deadline = time.monotonic() + 120
        while remote.retries() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # and down a while longer
        server.start()

    restart = threading.Thread(target=restart_once_refused)
    restart.start()
    try:
        assert np.array_equal(file[100:200], ids[100:200])
    finally:
        restart.join()
    assert remote.retries() > before
    _stop(server)
    monkeypatch.setattr(remote, "ATTEMPTS", 3)
    try:
        with pytest.raises(DataError) as err:
            remote.RemoteTokenFile(file.url, "uint32", ids.nbytes, "data.path")[0:10]
    finally:
        server.start()
    assert str(err.value).startswith(f"data.path=s3://{BUCKET}/outage/tokens.bin: the object store at http://127.0.0.1:")
    assert "AWS_ENDPOINT_URL" in str(err.value) and "(after 3 tries)" in str(err.value)


class _Gate:
    """Holds every request to the server while closed: the server accepts connections and never
    answers, as a stopped (SIGSTOP) or wedged store does; opened, the held requests go on."""

    def __init__(self, server):
        self.open, self.wsgi = threading.Event(), server._server
        self.open.set()
        self.app = self.wsgi.app
        self.wsgi.app = self

    def __call__(self, environ, start_response):
        self.open.wait()
        return self.app(environ, start_response)

    def restore(self) -> None:
        self.open.set()
        self.wsgi.app = self.app


def _when_step(run_dir: Path, step: int, action, after_s: float = 0.0) -> threading.Thread:
    """A thread that runs ``action()`` ``after_s`` seconds after ``run_dir`` logs step ``step``."""
    import time

    def watch():
        while not any(r[0] >= step for r in (_losses(run_dir) if (run_dir / "metrics.jsonl").exists() else [])):
            time.sleep(0.05)
        time.sleep(after_s)
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # about 65 s of held requests and timeouts: a long run, out of the fast tier
def test_a_store_that_hangs_mid_run_is_retried_then_one_error_and_ctrl_c_stops_the_wait(store, server, tmp_path,
                                                                                         monkeypatch):
    """Pre-training from a token folder in the bucket (small blocks and cache: reads all along),
    while the server holds every request (it accepts and never answers, as a SIGSTOPped store):
    for 10 s mid-run (the issue's outage), the reads time out (``data.read_timeout_s=1``), are retried and counted, and
    the run goes on with the losses of an undisturbed run; held for good, the run ends in one
    error naming the step and the last checkpoint, and the command continues from it once the
    server answers (with a longer timeout and more read-ahead), to the undisturbed run's losses; Ctrl-C while the step waits for its data ends
    the run at once (a KeyboardInterrupt, exit 130), though the loop's handler only sets a flag."""
    from llmtrain.common.errors import DataError
    from llmtrain.data import remote
    from llmtrain.data.prefetch import DataWaitInterrupted
    from llmtrain.prepare import main as prepare
    from llmtrain.trainer import train

    local = tmp_path / "tokens"
    assert prepare(SOURCE + [f"out={local}"]) == 0
    store.put(str(local), f"{BUCKET}/tokens/hang", recursive=True)
    monkeypatch.setattr(remote.RemoteTokenFile, "BLOCK", 256)  # a 16 KiB cache of a 240 KB folder
    monkeypatch.setattr(remote, "_FIRST_WAIT_S", 0.1)
    args = [o for o in COMMON if not o.startswith("trainer.max_steps=")] + [
        "data=tokens", "data.seq_len=64", "data.val_fraction=0.02", f"data.path=s3://{BUCKET}/tokens/hang",
        "data.read_timeout_s=1", "data.prefetch=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=6", "trainer.save_every=2"]
    train(make_cfg(args + [f"run_dir={tmp_path / 'whole'}"]))
    whole = _losses(tmp_path / "whole")
    gate = _Gate(server)
    try:
        before = remote.retries()
        hang = _when_step(tmp_path / "hang", 2, gate.open.clear)
        reopen = _when_step(tmp_path / "hang", 2, gate.open.set, after_s=10)
        train(make_cfg(args + [f"run_dir={tmp_path / 'hang'}"]))
        hang.join(), reopen.join()
        assert remote.retries() > before
        assert _losses(tmp_path / "hang") == whole
        monkeypatch.setattr(remote, "ATTEMPTS", 3)  # held for good: 3 tries, ~3 s
        down = tmp_path / "down"
        _when_step(down, 3, gate.open.clear)
        with pytest.raises(DataError) as err:
            train(make_cfg(args + [f"run_dir={down}"]))
        text = str(err.value)
        assert "\n" not in text and "did not answer" in text and "(after 3 tries)" in text
        import re

        # Reads ahead may carry the run past a checkpoint after the server stopped answering.
        stopped, saved = re.search(r"; stopped in step (\d+), the last checkpoint \S+/step_(\d+) stands: the same "
                                   "command continues from it", text).groups()
        assert int(saved) in (2, 4) and int(stopped) > int(saved) and (down / "checkpoints" / f"step_{saved}").is_dir()
        gate.open.set()
        # Rerun with a longer timeout and more read-ahead: how the data are read may change on resume.
        patient = [o for o in args if not o.startswith(("data.read_timeout_s=", "data.prefetch="))]
        train(make_cfg(patient + ["data.read_timeout_s=5", "data.prefetch=3", f"run_dir={down}"]))
        assert [r for r in _losses(down) if r[0] > int(saved)][-(6 - int(saved)):] == whole[int(saved):]
        monkeypatch.setattr(remote, "ATTEMPTS", 8)  # ~30 s of tries: Ctrl-C comes long before the error
        _when_step(tmp_path / "ctrl-c", 2, gate.open.clear)
        _when_step(tmp_path / "ctrl-c", 2, lambda: os.kill(os.getpid(), signal.SIGINT), after_s=3)
        with pytest.raises(DataWaitInterrupted, match="^SIGINT while the step waited for its data"):
            train(make_cfg(args + [f"run_dir={tmp_path / 'ctrl-c'}"]))
    finally:
        gate.restore()


@pytest.mark.parametrize("path, env, needle", [
    (f"s3://{BUCKET}/nothing-here", {}, "no such object or prefix in bucket 'llmtrain-test'"),
    ("s3://no-such-bucket/tokens", {}, "the bucket 'no-such-bucket' does not exist at http://127.0.0.1:"),
    (f"s3://{BUCKET}/tokens", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
     "no credentials for the object store (Unable to locate credentials); set AWS_ACCESS_KEY_ID and "
     "AWS_SECRET_ACCESS_KEY"),
    (f"s3://{BUCKET}/tokens", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "did not answer"),
    ("gs://bucket/tokens", {}, "gs:// URLs are not read by llmtrain"),
])
def test_a_url_that_cannot_be_read_is_one_line_naming_the_fix(store, monkeypatch, path, env, needle):
    from llmtrain.common.errors import LlmtrainError
    from llmtrain.data import remote
    from llmtrain.planning.preflight import preflight_data

    for name, value in env.items():
        monkeypatch.delenv(name) if value is None else monkeypatch.setenv(name, value)
    monkeypatch.setattr(remote, "_fs", None)  # a client of this environment
    monkeypatch.setattr(remote, "_FIRST_WAIT_S", 0.001)
    with pytest.raises(LlmtrainError) as err:
        preflight_data(make_cfg(["data=tokens", f"data.path={path}"]).data)
    assert str(err.value).startswith(f"data.path={path}: ") and needle in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(remote, "_fs", None)


def test_refused_urls_exit_2_in_one_line_and_write_nothing(store, tmp_path, monkeypatch, capsys):
    from llmtrain.prepare import main as prepare

    run_dir = tmp_path / "run"
    proc = _run("llmtrain", [*COMMON, "data=tokens", "data.path=s3://no-such-bucket/tokens", f"run_dir={run_dir}"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("llmtrain: error: data.path=s3://no-such-bucket/tokens: the bucket 'no-such-bucket' "
                               "does not exist at http://127.0.0.1:"), lines[0]
    assert not run_dir.exists()
    monkeypatch.chdir(tmp_path)  # where a URL taken for a path would make a folder "s3:" or "gs:"
    store.pipe(f"{BUCKET}/taken/manifest.json", b"{}")
    for out, needle in (("s3://no-such-bucket/tokens", "the bucket 'no-such-bucket' does not exist"),
                        ("gs://bucket/tokens", "gs:// URLs are not read by llmtrain"),
                        (f"s3://{BUCKET}/taken", "exists and is not empty; choose a new prefix")):
        assert prepare(SOURCE + [f"out={out}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"llmtrain.prepare: error: out={out}: ") and needle in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert store.find(f"{BUCKET}/taken") == [f"{BUCKET}/taken/manifest.json"]

