"""A stand-in for vLLM's OpenAI API server, shaped like it where process endings are concerned
(tests/test_process_census.py): no model, only the processes.

``python tests/standin_vllm.py --port P [vLLM's other flags, ignored]`` is the API server (the
group leader the trainer starts). It starts an ``engine`` process (vLLM's ``EngineCore``), which
starts a ``worker`` (vLLM's ``Worker``); both stay in the leader's process group. The engine maps
a ``/dev/shm`` file (vLLM's shared-memory message queues) that its worker maps too, removed when
the engine is stopped with SIGTERM.
As in vLLM, the API server shuts its engine down on SIGTERM and exits when its engine dies, the
engine stops its worker on SIGTERM and shuts down (cleanly) when its worker dies, and an engine whose API server was killed stays
alive, re-parented to init.

The server answers ``/health``, ``/metrics`` (its start time), ``/v1/models``, ``/v1/completions`` (a few token ids below 256
drawn from the request's seed and the weights it holds: digests of the tensors of its
``--model`` folder, updated by each in-place reload, and the adapter named; no log-probs: the
trainer computes them), ``/collective_rpc`` and the
LoRA adapter calls. Every process writes ``ROLE PID`` to ``$STANDIN_PIDS`` (a file) when set.
While the file ``$STANDIN_FAIL_START`` exists, the server exits with status 1 as it starts.

:func:`python_wrapper` writes the ``python`` to give as ``rollout.vllm_python``: the environment
probe (``-c``) passes, anything else runs this file. The first completion request writes
``served PID`` to ``$STANDIN_PIDS``: the run is sampling.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHM_PREFIX = "llmtrain-standin-"


def python_wrapper(folder: Path) -> Path:
    """A ``python`` for ``rollout.vllm_python`` in ``folder``: ``-c`` probes succeed, ``-m vllm...``
    starts the stand-in server."""
    path = Path(folder) / "python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 0; fi\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    path.chmod(0o755)
    return path


def _note(role: str) -> None:
    if os.environ.get("STANDIN_PIDS"):
        with open(os.environ["STANDIN_PIDS"], "a") as file:
            file.write(f"{role} {os.getpid()}\n")


def _watch(process: subprocess.Popen, then) -> None:
    """Run ``then`` once ``process`` has ended (a daemon thread)."""
    threading.Thread(target=lambda: (process.wait(), then()), daemon=True).start()


def worker(shm: str) -> None:
    _note("worker")
    with open(shm, "rb+") as file:
        mapped = mmap.mmap(file.fileno(), 4096)  # vLLM's workers attach to their engine's message queues
    while mapped:
        time.sleep(60)


def engine() -> None:
    _note("engine")
    path = Path("/dev/shm") / f"{SHM_PREFIX}{os.getpid()}"
    with open(path, "wb+") as file:
        file.write(b"\0" * 4096)
        file.flush()
        mapped = mmap.mmap(file.fileno(), 4096)  # held as vLLM's message queues hold theirs

    child = subprocess.Popen([sys.executable, __file__, "--worker", str(path)])

    def shut_down(*_):  # vLLM's engine core stops its workers and frees its queues on SIGTERM
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    _watch(child, lambda: (path.unlink(missing_ok=True), os._exit(1)))  # vLLM: "Worker died", engine shuts down
    while mapped:
        time.sleep(60)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # the trainer's log has no use for access lines
        pass

    def _answer(self, body) -> None:
        raw = json.dumps(body).encode() if body is not None else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path == "/metrics":  # Prometheus' text format, as vLLM's: the gauge a restart changes
            raw = f"process_start_time_seconds {self.server.started!r}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            return self.wfile.write(raw)
        self._answer({"data": [{"id": "policy", "max_model_len": 4096}]} if self.path == "/v1/models" else None)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        if self.path == "/collective_rpc":  # reload_weights: in place, as many tensors as the folder holds
            self.server.weights.update(_digests(request["kwargs"]["weights_path"]))
        if self.path != "/v1/completions":
            return self._answer(None)
        if not self.server.served:
            self.server.served = True
            _note("served")
        weights = hashlib.sha1(json.dumps(sorted(self.server.weights.items())).encode()).hexdigest()
        rng = random.Random(f"{request.get('seed', 0)} {weights} {request['model']}")
        n = min(int(request["max_tokens"]), 3)
        return self._answer({"choices": [{"token_ids": [rng.randrange(256) for _ in range(n)],
                                          "finish_reason": "length" if n == int(request["max_tokens"]) else "stop"}]})


def _digests(folder: str) -> dict[str, str]:
    """Each tensor's digest (of its fp32 values) in ``folder/model.safetensors`` (none without it)."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        return {k: hashlib.sha1(handle.get_tensor(k).float().numpy().tobytes()).hexdigest() for k in handle.keys()}


def server(port: int, model: str) -> None:
    if os.environ.get("STANDIN_FAIL_START") and Path(os.environ["STANDIN_FAIL_START"]).exists():
        print("standin: told not to start ($STANDIN_FAIL_START exists)", file=sys.stderr)
        sys.exit(1)  # a server that cannot come back (no memory left, a broken environment)
    _note("server")
    child = subprocess.Popen([sys.executable, __file__, "--engine"])

    def shut_down(*_):  # vLLM's API server stops its engine core on SIGTERM
        child.terminate()
        child.wait()
        os._exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    _watch(child, lambda: os._exit(1))  # vLLM: "Engine core died", the API server exits
    ThreadingHTTPServer.request_queue_size = 256  # a rank sends up to 32 requests at once (uvicorn's backlog: 2048)
    http = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    http.served = False
    http.started = time.time()
    http.weights = _digests(model)  # the weights it holds: its completions depend on them, as a model's do
    http.serve_forever()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1])
    elif "--engine" in sys.argv:
        engine()
    else:
        server(int(sys.argv[sys.argv.index("--port") + 1]),
               sys.argv[sys.argv.index("--model") + 1] if "--model" in sys.argv else "")
