"""``rollout.engine=vllm``: the engine that samples from one or several vLLM servers
(:mod:`llmtrain.rollout.vllm_server` starts, checks and stops each).

* **Several servers** (``rollout.vllm_servers=N``, or several URLs in ``rollout.vllm_url``):
  rank 0 starts them all at once, each on its share of this host's CPUs
  (:func:`~llmtrain.rollout.vllm_server.server_cores`); ``rollout.vllm_args`` reach every one
  (tensor parallel inside a server). A prompt's group goes whole to one server, chosen from the
  prompt's record number (:func:`server_of`): which server samples a completion never depends on
  timing, and a seeded request's completion does not depend on its server.
* **Weights** reach every server at each sync (written once, loaded by each in parallel). Full
  fine-tuning writes only the weights' tensors (``write_policy``'s ``"weights"``: no model
  rebuilt, no config or tokenizer, the server's dtype, frozen blocks left out), to a folder in
  memory (``/dev/shm``) when the servers run on this host.
* **Restarts**: rank 0 watches the servers it started; one that dies is restarted on the same
  port with the weights the others hold (at most ``rollout.vllm_restarts`` times in a run, each
  logged and counted in ``rollout/vllm_restarts``), and the requests it lost are sent again with
  the same seeds, from every rank. One that cannot come back ends the run with one line naming
  its log (:class:`~llmtrain.common.errors.ChildDied`, exit status 5): the last checkpoint stays
  the run's, and a rerun continues from it.
* **A user's server** (``rollout.vllm_url``) is not llmtrain's to restart, but one that comes
  back (its own supervisor restarted it) serves its own weights, not the run's. Its process is
  known by its start time (vLLM's ``/metrics``: :func:`~llmtrain.rollout.vllm_server.start_time`),
  which rank 0 records after every weights load (``server-K.held``, read by every rank). Rank 0
  watches it: a new process gets the run's weights again (counted against
  ``rollout.vllm_restarts``), and no request goes to it before it holds them. Each rank reads the
  start time before and after a batch of requests and sends again, with the same seeds, the
  requests of a server that restarted in between: no completion comes from the wrong weights.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmtrain.common import children
from llmtrain.common.errors import ChildDied
from llmtrain.parallel import distributed
from llmtrain.rollout.engines import RolloutEngine
from llmtrain.rollout.generate import Completion, Sampling
from llmtrain.rollout.vllm_images import ImagePrompts, check_architecture
from llmtrain.rollout.vllm_server import (SERVED_NAME, MemoryFolder, Server, VLLMServerError, _free_port, _request,
                                          check_environment, refused, server_cores, start_time, user_urls,
                                          vllm_python)

log = logging.getLogger("llmtrain")

WATCH_S = 1.0  # how often rank 0 looks at its servers' processes, seconds


def server_of(sample: dict, index: int, count: int) -> int:
    """The server (of ``count``) that samples ``sample``'s whole group: from its record number
    (CRC32-mixed, so that consecutive records spread), else from its ``index`` in the request.
    A function of the prompt only: the same on every layout and in every run."""
    key = sample.get("record", index)
    return zlib.crc32(str(int(key)).encode()) % count if count > 1 else 0


class VLLMEngine(RolloutEngine):
    """``rollout.engine=vllm``: see the module and :mod:`llmtrain.rollout.vllm_server`.
    ``publish(directory, part)`` (set by the trainer: :func:`llmtrain.checkpoint.export.write_policy`)
    writes the policy's weights for the servers."""

    overlaps = True

    def __init__(self, cfg: Any, tokenizer: Any, sampling: Sampling):
        super().__init__(cfg, tokenizer, sampling)
        urls = user_urls(cfg)
        self.own_server = not urls
        self.run_dir = Path(str(cfg.run_dir))
        count = len(urls) or int(cfg.rollout.vllm_servers)
        self.servers = [Server(k, count, self.run_dir, urls[k] if urls else "") for k in range(count)]
        self.sync_every = int(cfg.rollout.sync_every)
        self.lora = cfg.get("peft") is not None
        self.work = self.run_dir / "rollout-weights"
        self.version: int | None = None  # the optimizer step whose weights the servers hold
        self.model_name = SERVED_NAME
        self.loaded: tuple[Path, int] | None = None  # the weights loaded on top of the start folder's
        self.user_model: tuple[Path, int] | None = None  # a user's server's first, whole-model folder (kept)
        self.background: ThreadPoolExecutor | None = None  # the thread that waits on this rank's requests
        self.lock = threading.Lock()  # one restart or weight load at a time
        self.restarts = 0
        self.sync_s = 0.0
        self.sync_write_s = 0.0
        self.watcher: threading.Thread | None = None
        self.closing = threading.Event()
        self.memory = MemoryFolder(self.run_dir)
        self.images = ImagePrompts(tokenizer)

    def check(self) -> None:
        check_environment(self.cfg)
        check_architecture(self.cfg, self.tokenizer, vllm_python(self.cfg))

    @property
    def process(self):  # the first server's process (tests, and the one-server case's log lines)
        return self.servers[0].process

    def metrics(self) -> dict[str, float]:
        """``rollout/vllm_restarts`` (servers restarted so far, rank 0's count),
        ``rollout/sync_s`` (seconds the last weight sync took: writing and loading) and
        ``rollout/sync_write_s`` (of those, writing the weights; the rest is the servers' loads)."""
        return {"rollout/vllm_restarts": float(self.restarts), "rollout/sync_s": self.sync_s,
                "rollout/sync_write_s": self.sync_write_s}

    # ---- the servers' lives --------------------------------------------------------------------
    def _start(self, policy: Any) -> None:
        """Write the policy (collective), start the servers on rank 0 and wait for them, share
        their URLs."""
        model_dir = self.work / "model"
        if self.own_server:
            self.publish(model_dir, "model")
        error = ""
        if policy.env.is_main:
            for server in self.servers:  # a killed run's word on its servers is not this run's
                for what in ("failed", "held", "restarting"):
                    self._failed_file(server, what).unlink(missing_ok=True)
        if policy.env.is_main and self.own_server:
            try:
                self._launch(model_dir)
            except VLLMServerError as err:
                error = str(err)
        urls, error = distributed.all_gather_objects(([s.url for s in self.servers], error))[0]  # rank 0's
        for server, url in zip(self.servers, urls):
            server.url = url
        if error:
            self.close()
            raise VLLMServerError(error)
        if policy.env.is_main:
            self.watcher = threading.Thread(target=self._watch if self.own_server else self._watch_users,
                                             name="vllm-watch", daemon=True)
            self.watcher.start()

    def _ports(self) -> list[int]:
        base = int(self.cfg.rollout.vllm_port)
        return [base + k if base else _free_port() for k in range(len(self.servers))]

    def _launch(self, model_dir: Path) -> None:
        """Rank 0: start every server (together: each takes its own time to load) and wait for each."""
        ports = self._ports()
        for port in ports if int(self.cfg.rollout.vllm_port) else []:
            if holder := children.port_holder(port):  # a killed run's leftovers were stopped when its lock was taken
                raise VLLMServerError(f"rollout.vllm_port={port} is held by {holder}, not by a server of this run "
                                      "folder: stop it, or set rollout.vllm_port=0 (a free port)")
        for server, port in zip(self.servers, ports):
            server.spawn(self.cfg, model_dir, port, server_cores(server.index, len(self.servers)))
        for server in self.servers:
            took = server.wait_up(float(self.cfg.rollout.vllm_start_timeout_s))
            log.info("rollout: %s up in %.0f s at %s", server.name(), took, server.url)

    def _watch(self) -> None:
        """Rank 0's thread: restart a server of this run that died (:meth:`_revive`)."""
        while not self.closing.wait(WATCH_S):
            for server in self.servers:
                if server.process is not None and server.process.poll() is not None and not self._failed(server):
                    with self.lock:
                        if server.process is not None and server.process.poll() is not None:
                            self._revive(server)

    def _failed_file(self, server: Server, what: str = "failed") -> Path:
        return self.work / f"server-{server.index}.{what}"

    def _restarting(self, server: Server) -> bool:
        """Whether rank 0 is restarting ``server`` (a file every rank sees): it answers before its
        weights are loaded, and a request must not reach it until then."""
        return self._failed_file(server, "restarting").exists()

    def _failed(self, server: Server) -> str:
        """The one line rank 0 wrote for a server that cannot come back ("" if none): every rank
        reads it (the run folder is shared, as the weights' folder is)."""
        try:
            return self._failed_file(server).read_text()
        except OSError:
            return ""

    def _revive(self, server: Server) -> None:
        """Rank 0, holding the lock: restart ``server`` (dead) on its port with the weights the
        others hold, or write the one line that ends the run (:meth:`_failed`); requests wait
        meanwhile (:meth:`_restarting`)."""
        marker = self._failed_file(server, "restarting")
        marker.touch()
        try:
            self._restart(server)
        finally:
            marker.unlink(missing_ok=True)

    def _restart(self, server: Server) -> None:
        how, limit = server.ended(), int(self.cfg.rollout.vllm_restarts)
        pid = server.process.pid if server.process is not None else None
        server.stop()
        if self.restarts >= limit:
            message = (f"rollout.engine=vllm: the vLLM server{f' {server.index}' if len(self.servers) > 1 else ''} "
                       f"(pid {pid}) {how}; its engine processes are stopped; rollout.vllm_restarts={limit} "
                       f"restarts used; its log: {server.logfile}. Rerun the same command: the run continues from "
                       "its last checkpoint")
            self._failed_file(server).write_text(message)
            return
        self.restarts += 1
        log.warning("rollout: vLLM server %d (pid %s) %s; restarting it on port %d with the weights of step %s "
                    "(restart %d of rollout.vllm_restarts=%d)", server.index, pid, how, server.port,
                    self.loaded[1] if self.loaded else "0", self.restarts, limit)
        try:
            server.spawn(self.cfg, self.work / "model", server.port, server_cores(server.index, len(self.servers)))
            took = server.wait_up(float(self.cfg.rollout.vllm_start_timeout_s))
            if self.loaded is not None:
                self._load(server, *self.loaded)
        except (OSError, VLLMServerError) as err:
            first = str(err).splitlines()[0] if str(err) else repr(err)
            server.stop()
            self._failed_file(server).write_text(
                f"rollout.engine=vllm: the vLLM server{f' {server.index}' if len(self.servers) > 1 else ''} (pid "
                f"{pid}) {how} and did not come back after a restart ({first}); its log: {server.logfile}. Rerun "
                "the same command: the run continues from its last checkpoint")
            return
        log.warning("rollout: vLLM server %d is back in %.0f s at %s", server.index, took, server.url)

    # ---- a user's servers: known by their process's start time ---------------------------------
    def _held(self, server: Server) -> float | None:
        """The start time of the user's server process that holds the run's weights (rank 0's
        record; None before the first load, or where the server's ``/metrics`` gives none)."""
        try:
            return float(self._failed_file(server, "held").read_text())
        except (OSError, ValueError):
            return None

    def _hold(self, server: Server, folders: list[tuple[Path, int]]) -> None:
        """Rank 0: load ``folders`` in order into the user's ``server`` and record its process as
        holding them; OSError if it restarted meanwhile (the next look loads them again)."""
        before = start_time(server.url)
        for folder, step in folders:
            self._load(server, folder, step)
        if before is not None and start_time(server.url) != before:
            raise OSError(f"{server.url} restarted while loading the weights")
        self._failed_file(server, "held").write_text(repr(before) if before is not None else "")

    def _replaced(self, server: Server, down: bool = True) -> bool:
        """Whether the user's ``server`` is another process than the one holding the run's
        weights; ``down``: the answer when it does not answer."""
        try:
            return start_time(server.url, timeout=5) != self._held(server)
        except (OSError, VLLMServerError):
            return down

    def _watch_users(self) -> None:
        """Rank 0's thread: give a user's server that came back (a new process) the run's weights
        again (:meth:`_revive_user`); one silent for ``rollout.vllm_start_timeout_s`` ends the run."""
        down: dict[int, float] = {}
        timeout = float(self.cfg.rollout.vllm_start_timeout_s)
        while not self.closing.wait(WATCH_S):
            for server in self.servers:
                held = self._held(server)
                if held is None or self._failed(server):
                    continue  # nothing loaded yet, or no start time to tell processes apart
                try:
                    now = start_time(server.url, timeout=5)
                except (OSError, VLLMServerError):
                    if time.monotonic() - down.setdefault(server.index, time.monotonic()) > timeout:
                        self._give_up_silent(server)
                    continue
                down.pop(server.index, None)
                if now != held:
                    with self.lock:
                        if not self._failed(server) and self._replaced(server, down=False):  # a sync may have first
                            self._revive_user(server)

    def _give_up_silent(self, server: Server) -> None:
        timeout = float(self.cfg.rollout.vllm_start_timeout_s)
        self._failed_file(server).write_text(
            f"rollout.engine=vllm: the vLLM server at {server.url} stopped answering mid-run and did not come back "
            f"within rollout.vllm_start_timeout_s={timeout:g}; restart it, then rerun the same command: the run "
            "continues from its last checkpoint")

    def _revive_user(self, server: Server, weights: tuple[Path, int] | None = None) -> bool:
        """Rank 0, holding the lock: send the user's restarted ``server`` the run's weights again
        (its first whole-model folder, then ``weights``, default the last loaded), or write the
        run's last line once ``rollout.vllm_restarts`` are used. Requests wait meanwhile
        (:meth:`_restarting`). Whether it holds them now."""
        limit = int(self.cfg.rollout.vllm_restarts)
        if self.restarts >= limit:
            self._failed_file(server).write_text(
                f"rollout.engine=vllm: the vLLM server at {server.url} restarted mid-run on weights not the run's; "
                f"rollout.vllm_restarts={limit} reloads used. Rerun the same command: the run continues from its "
                "last checkpoint")
            return False
        weights = weights or self.loaded
        self.restarts += 1
        log.warning("rollout: the vLLM server at %s restarted mid-run; sending it the weights of step %s again "
                    "(restart %d of rollout.vllm_restarts=%d)", server.url, weights[1] if weights else "0",
                    self.restarts, limit)
        marker = self._failed_file(server, "restarting")
        marker.touch()
        try:
            self._hold(server, list(dict.fromkeys(f for f in (self.user_model, weights) if f)))
            return True
        except (OSError, VLLMServerError) as err:  # gone again: the next look counts it
            log.warning("rollout: the vLLM server at %s: %s", server.url, err)
            return False
        finally:
            marker.unlink(missing_ok=True)

    def _reload_user(self, server: Server, folder: Path, step: int) -> None:
        """Rank 0, holding the lock, in a sync: the user's ``server`` failed to load ``folder``
        because it is down or a new process: wait for it to answer, then :meth:`_revive_user` it
        with these weights; ChildDied with the run's last line when it cannot be."""
        deadline = time.monotonic() + float(self.cfg.rollout.vllm_start_timeout_s)
        while not (failed := self._failed(server)):
            try:
                start_time(server.url, timeout=5)
            except (OSError, VLLMServerError):
                if time.monotonic() > deadline:
                    self._give_up_silent(server)
                time.sleep(1.0)
                continue
            if self._revive_user(server, (folder, step)):
                return
        raise ChildDied(failed)

    def _wait_held(self, server: Server, deadline: float) -> float | None:
        """Every rank, before and after a batch of requests: wait until a user's ``server`` is the
        process that holds the run's weights; its start time (None: not known, no check)."""
        while True:
            if failed := self._failed(server):
                raise ChildDied(failed)
            held = self._held(server)
            if held is None:
                return None
            try:
                if start_time(server.url, timeout=5) == held and not self._restarting(server):
                    return held
            except (OSError, VLLMServerError):
                pass
            if time.monotonic() > deadline:
                raise ChildDied(f"rollout.engine=vllm: the vLLM server at {server.url} did not get the run's weights "
                                f"back within rollout.vllm_start_timeout_s; its last answer was from another process")
            time.sleep(0.5)

    def close(self) -> None:
        """Stop the servers this run started (:meth:`Server.stop`) and remove the weights written
        for them."""
        self.closing.set()
        background, self.background = self.background, None
        if background is not None:  # requests in flight fail once the server is gone; nobody reads them
            background.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            for server in self.servers:
                server.stop()
        self.memory.close()
        if self.own_server and self.work.is_dir():
            shutil.rmtree(self.work, ignore_errors=True)

    # ---- weights -------------------------------------------------------------------------------
    def _sync(self, policy: Any, greedy: bool) -> None:
        """Bring every server to the policy's weights when due (see the module). Collective call."""
        step = int(policy.optimizer_step_count())
        if self.version is None:
            self._start(policy)
            # Servers this run started on the full weights hold them; an adapter, or a user's server, is
            # still to be sent.
            self.version = step if self.own_server and not self.lora else -1
        due = self.version != step and (greedy or self.version < 0 or step - self.version >= self.sync_every)
        if not due:
            return
        # Every rank's requests on the old weights are done (asynchronous generation leaves them in
        # flight across the step) before rank 0 swaps the weights: not every layout's publish is collective.
        distributed.barrier()
        started = time.perf_counter()
        folder = self._steps_folder(policy) / f"step_{step}"
        # A user's server gets the whole folder first: frozen blocks are sent once, and only where
        # llmtrain did not start the server on them.
        self.publish(folder, "adapter" if self.lora else "model" if self.version < 0 else "weights")
        written = time.perf_counter()
        error, died = "", False
        if policy.env.is_main:
            try:
                self._load_all(folder, step)
            except (OSError, VLLMServerError, ChildDied) as err:
                died = isinstance(err, ChildDied)
                error = str(err) if died else (f"rollout.engine=vllm: sending the weights of step {step} failed: "
                                               f"{err}")
        errors = [e for e in distributed.all_gather_objects((died, error) if error else None) if e]
        if errors:
            raise (ChildDied if errors[0][0] else VLLMServerError)(errors[0][1])
        previous, self.version = self.version, step
        self.model_name = f"policy-step{step}" if self.lora else SERVED_NAME
        self.sync_s = time.perf_counter() - started
        self.sync_write_s = written - started
        if not (self.own_server or self.lora) and previous is not None and previous < 0:
            self.user_model = (folder, step)  # a user's server that restarts gets it again (frozen blocks)
        if (policy.env.is_main and previous is not None and previous >= 0
                and (self.user_model is None or self.user_model[1] != previous)):
            shutil.rmtree(folder.parent / f"step_{previous}", ignore_errors=True)

    def _steps_folder(self, policy: Any) -> Path:
        """Where a sync writes (rank 0): in memory (:class:`~llmtrain.rollout.vllm_server.MemoryFolder`)
        for full weights sent to servers this run started on this host, with room for two steps'
        (the one loaded, kept for a restart, and the next); else the run folder."""
        if policy.env.is_main and self.own_server and not self.lora:
            start = self.work / "model" / "model.safetensors"
            need = 2 * start.stat().st_size if start.is_file() else 0
            if need and (path := self.memory.open(need)) is not None:
                return path
        return self.work

    def _load_all(self, folder: Path, step: int) -> None:
        """Rank 0: every server loads what :meth:`_sync` wrote (in parallel); one found dead is
        restarted (which loads it too)."""
        with self.lock:
            with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
                for server, result in zip(self.servers, pool.map(lambda s: self._try_load(s, folder, step),
                                                                 self.servers)):
                    if result is None:
                        continue
                    if failed := self._failed(server):  # the watcher found it dead first, and could not revive it
                        raise ChildDied(failed)
                    if not self.own_server and self._held(server) is not None and self._replaced(server):
                        self._reload_user(server, folder, step)  # down, or back on its own weights
                        continue
                    if not (self.own_server and server.ended()):
                        raise server.gone(result)
                    self._revive_with(server, folder, step)  # it comes back with these weights
            self.loaded = (folder, step)

    def _revive_with(self, server: Server, folder: Path, step: int) -> None:
        """Rank 0, holding the lock: :meth:`_revive` ``server`` with the weights in ``folder``."""
        loaded, self.loaded = self.loaded, (folder, step)
        try:
            self._revive(server)
        finally:
            self.loaded = loaded
        if failed := self._failed(server):
            raise ChildDied(failed)

    def _try_load(self, server: Server, folder: Path, step: int) -> Exception | None:
        try:
            if self.own_server:
                self._load(server, folder, step)
            elif self._held(server) is not None and self._replaced(server):
                return OSError(f"{server.url} is down or a new process")  # _load_all revives it (_reload_user)
            else:
                self._hold(server, [(folder, step)])
        except (OSError, VLLMServerError) as err:
            return err
        return None

    def _load(self, server: Server, folder: Path, step: int) -> None:
        """Have ``server`` load the weights in ``folder`` (step ``step``'s): the adapter by name
        (the one before it unloaded), or the whole model in place."""
        if self.lora:
            name = f"policy-step{step}"
            _request(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder.resolve())})
            if self.model_name not in (SERVED_NAME, name):
                try:
                    _request(server.url, "/v1/unload_lora_adapter", {"lora_name": self.model_name})
                except VLLMServerError:  # a restarted server never had the one before
                    pass
            return
        _request(server.url, "/collective_rpc", {"method": "reload_weights",
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
        """This rank's completions; a user's server's are sent again (same seeds) when its process
        changed during the batch (:meth:`_wait_held` before and after)."""
        count = len(self.servers)
        jobs = [(i, j, list(sample["prompt_ids"]), seed, server_of(sample, i, count), sample.get("images") or [])
                for i, (sample, row) in enumerate(zip(samples, seeds)) for j, seed in enumerate(row)]
        groups: list[list[Completion | None]] = [[None] * len(row) for row in seeds]
        deadline = time.monotonic() + float(self.cfg.rollout.vllm_start_timeout_s) + 60
        while jobs:
            used = sorted({job[4] for job in jobs})
            before = {k: None if self.own_server else self._wait_held(self.servers[k], deadline) for k in used}
            with ThreadPoolExecutor(max_workers=min(32 * count, len(jobs))) as pool:
                for (i, j, *_), completion in zip(jobs, pool.map(self._complete, jobs)):
                    groups[i][j] = completion
            changed = {k for k in used if before[k] is not None and self._wait_held(self.servers[k], deadline) != before[k]}
            jobs = [job for job in jobs if job[4] in changed]
        return groups  # type: ignore[return-value]

    def _complete(self, job: tuple[int, int, list[int], int | None, int, list[str]]) -> Completion:
        """One completion from its server; a server that stopped answering is waited for (rank 0
        restarts one it started: :meth:`_watch`) and asked again, with the same seed."""
        _, _, prompt_ids, seed, index, images = job
        server = self.servers[index]
        body = self._body(prompt_ids, seed)
        deadline = None
        while True:
            try:
                if images:  # (the weights' version keys vLLM's encoder cache: vllm_images.image_part)
                    choice = self.images.choice(lambda path, b: _request(server.url, path, b), body, prompt_ids,
                                                images, self.version)
                else:
                    choice = _request(server.url, "/v1/completions", body)["choices"][0]
                break
            except (OSError, VLLMServerError) as err:
                if failed := self._failed(server):
                    raise ChildDied(failed) from None
                if (not self.own_server and not self.closing.is_set() and self._held(server) is not None
                        and self._replaced(server)):
                    deadline = deadline or time.monotonic() + float(self.cfg.rollout.vllm_start_timeout_s) + 60
                    self._wait_held(server, deadline)  # rank 0 gives it the weights once it is back
                    continue
                # Rank 0 restarts the servers it started (its watcher); the other ranks wait for it.
                restarting = self.watcher is not None or server.process is None
                if not (self.own_server and restarting and (refused(err) or server.ended())) or self.closing.is_set():
                    raise server.gone(err) from None
                deadline = deadline or time.monotonic() + float(self.cfg.rollout.vllm_start_timeout_s) + 60
                time.sleep(1.0)  # the server is being restarted (rank 0 notices within WATCH_S)
                while self._restarting(server) and time.monotonic() < deadline:
                    time.sleep(1.0)
                if time.monotonic() > deadline:
                    raise server.gone(err) from None
            except (KeyError, IndexError) as err:
                raise VLLMServerError(f"rollout.engine=vllm: a completion request to {server.url} failed: "
                                      f"{err!r}") from None
        ids = [int(t) for t in choice["token_ids"]]
        logps = (choice.get("logprobs") or {}).get("token_logprobs")
        return Completion(ids, truncated=choice.get("finish_reason") == "length",
                          logps=[float(v) for v in logps] if logps and seed is not None else None)

    def _body(self, prompt_ids: list[int], seed: int | None) -> dict:
        """The ``/v1/completions`` request of one completion."""
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
        return body
