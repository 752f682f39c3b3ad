"""The checkpoint protocol: the one owner of saving, validating, finding and loading checkpoints.

Layout of ``RUN_DIR/checkpoints/step_<N>/``::

    engine/             engine-native model + optimizer + LR-scheduler state (sharded per rank
                        where the engine shards)
    rank_<r>.pt         RNG states of rank r (python, numpy, torch CPU, CUDA where present), as
                        tensors and plain types (:func:`~llmtrain.checkpoint.state.capture_rng`;
                        read with weights_only)
    <part>_rank_<r>.safetensors
                        a part's per-rank tensors, where a part has some at this step
                        (:attr:`CheckpointManager.rank_state`: an online objective's generation
                        batch still being trained on); safetensors, so no code runs on reading
    trainer_state.json  step, consumed samples and tokens (global, rank-count independent),
                        tracker run id, world size, global batch
    config.yaml         the resolved config
    latest              DeepSpeed engine only: DeepSpeed's tag file (``engine``), so its
    zero_to_fp32.py     ZeRO recovery script (copied by DeepSpeed, ZeRO-1/2/3) runs as documented
    COMPLETE.json       the completion marker: every other file with its size and checksum

Protocol (crash-consistent): every rank writes into ``checkpoints/.tmp-step_<N>/``; after a
barrier, the ranks fsync and checksum the files, each a share of them in parallel; rank 0 merges
the lists, writes ``COMPLETE.json`` last, fsyncs and renames the folder to ``step_<N>``.
Checksums are XXH3-128 (``trainer.checkpoint_hash=xxh3``, the default: detects corruption and
truncation at memory speed) or SHA-256 (``sha256``: cryptographic, about 10x slower); a marker
may carry either, so checkpoints of older versions verify. Only a folder named ``step_<N>`` whose
marker verifies counts as a checkpoint: a crash at any moment leaves the previous checkpoint as
the newest valid one. There are no "latest" pointers between checkpoints (a DeepSpeed
checkpoint's ``latest`` names its own ``engine/`` folder and is listed in its marker like every
other file). The newest ``keep`` complete checkpoints are kept; the only complete one is never
deleted.

Trust: RNG files are read with ``torch.load(weights_only=True)``
(:func:`~llmtrain.checkpoint.state.read_rng`), so they can run no code; DeepSpeed's loaders,
which unpickle, get only folders whose files passed the same check
(:func:`llmtrain.engine.deepspeed_engine.check_checkpoint_files`). Torch's Distributed Checkpoint
still reads its ``.metadata`` with ``pickle``: load only checkpoints you trust.

Whether a checkpoint may resume a config is :mod:`llmtrain.checkpoint.resume`'s; exports (Hugging
Face and PEFT folders, in the run and offline) are :mod:`llmtrain.checkpoint.export`'s."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from llmtrain.checkpoint.state import RNG_FORMAT, STATE_FILE, TrainState, capture_rng, read_rng, read_state
from llmtrain.common import children
from llmtrain.common.errors import ResumeError
from llmtrain.parallel import distributed

log = logging.getLogger("llmtrain")

MARKER = "COMPLETE.json"
ENGINE_DIR = "engine"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step_\d+$")  # a save in progress (or interrupted): see save()
_TRASH = ".deleting-"  # a pruned checkpoint's folder while its files are deleted


def rank_state_file(name: str, rank: int) -> str:
    """The file name of part ``name``'s per-rank tensors of ``rank``."""
    return f"{name}_rank_{rank}.safetensors"


def step_of(checkpoint_dir: Path) -> int:
    """The optimizer step a checkpoint directory (``step_<N>``) holds.

    Raises:
        ValueError: the name is not ``step_<N>``.
    """
    match = _STEP_DIR.match(Path(checkpoint_dir).name)
    if match is None:
        raise ValueError(f"{checkpoint_dir} is not a step_<N> checkpoint directory")
    return int(match.group(1))


HASHES = ("xxh3", "sha256")
_HASH_KEYS = {"xxh3": "xxh3_128", "sha256": "sha256"}  # the marker's key per file


def _checksum(path: Path, kind: str) -> str:
    """Hex checksum of the file at ``path``: ``xxh3`` (XXH3-128, the xxhash library) or ``sha256``."""
    if kind == "sha256":
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    import xxhash

    import mmap

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # an empty file cannot be mapped
            # Hashed straight from the page cache, mapped: no copy into a buffer first (25% less
            # CPU time than reading 16 MiB chunks, measured on a 500 MB file).
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                digest.update(mapped)
    return digest.hexdigest()


def _share(files: list[Path], rank: int, world_size: int) -> list[Path]:
    """The files rank ``rank`` checksums: largest first, each to the least loaded rank (by
    bytes), so the ranks finish together. Every rank computes the same split from the listing."""
    load = [0] * world_size
    mine = []
    for path in sorted(files, key=lambda p: (-p.stat().st_size, str(p))):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    return mine


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _maybe_inject_fault(point: str, step: int) -> None:
    # Test hook: LLMTRAIN_FAULT=<point>:<step> kills this process at that point of the save.
    if os.environ.get("LLMTRAIN_FAULT") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _read_marker(directory: Path) -> tuple[dict | None, str | None]:
    """(the marker's file list, None) or (None, why it does not describe a checkpoint)."""
    marker = directory / MARKER
    if not marker.is_file():
        return None, f"no completion marker {MARKER}"
    try:
        files = json.loads(marker.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"'files' is a {type(files).__name__}, not a mapping")
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return None, f"unreadable completion marker: {err}"
    required = [STATE_FILE, "config.yaml"]
    if not any(rel.startswith(ENGINE_DIR + "/") for rel in files) or any(r not in files for r in required):
        return None, f"completion marker lists no {ENGINE_DIR}/ files or lacks {', '.join(required)}"
    return files, None


def verify(directory: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None when its marker verifies: marker
    present and parseable, every listed file present with its size, and (for this rank's share
    of the files, see :func:`_share`; all of them with the defaults) its checksum."""
    files, problem = _read_marker(directory)
    if problem:
        return problem
    for rel, meta in files.items():
        path = directory / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != meta["bytes"]:
            return f"truncated file {rel}: {path.stat().st_size} bytes, marker says {meta['bytes']}"
    for path in _share([directory / rel for rel in files], rank, world_size):
        meta = files[path.relative_to(directory).as_posix()]
        kind = next((k for k, key in _HASH_KEYS.items() if key in meta), None)
        if kind is None:
            return f"completion marker gives no checksum for {path.relative_to(directory)}"
        if _checksum(path, kind) != meta[_HASH_KEYS[kind]]:
            return f"checksum mismatch in {path.relative_to(directory).as_posix()}"
    return None


def verify_collective(directory: Path, env: distributed.DistEnv) -> str | None:
    """:func:`verify` with the checksums split over the ranks (each reads its share once);
    every rank gets the same answer. Collective call."""
    problem = verify(directory, env.rank, env.world_size)
    if distributed.is_initialized():
        problems: list[Any] = [None] * env.world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    return problem


_RUN_LOCKS: list[Any] = []  # open lock files, held until the process exits


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the folders named ``step_<N>`` in ``root`` (a run's ``checkpoints``),
    newest first, complete or not."""
    if not root.is_dir():
        return []
    return sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()),
                  reverse=True)


def run_dir_in_use(run_dir: Path) -> bool:
    """Whether a live process holds ``run_dir``'s lock (:func:`lock_run_dir`): a run training."""
    import fcntl

    if not (run_dir / ".lock").is_file():
        return False
    with open(run_dir / ".lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def lock_run_dir(run_dir: Path) -> bool:
    """Hold an exclusive lock on ``run_dir`` for the life of this process (rank 0 calls it), so
    a second run in the same folder (or orphaned workers of a killed one) cannot interleave
    checkpoints. The OS drops the lock when the process dies. Taking it, it stops the children
    the folder's last process recorded and left running (:func:`llmtrain.common.children.stop_leftovers`).
    Returns True when this call took
    the lock (no other live process held it), False when this process already held it.

    Raises:
        ResumeError: another live process holds the lock.
    """
    import fcntl

    if any(Path(h.name) == run_dir / ".lock" for h in _RUN_LOCKS):
        return False
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / ".lock", "a+")
    except OSError as err:
        raise ResumeError(f"run_dir={run_dir} cannot be created or written ({err.strerror}); choose a folder "
                          "you can write, e.g. run_dir=runs/NAME") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise ResumeError(f"run_dir={run_dir} is in use by another llmtrain process ({handle.read().strip() or 'pid unknown'}); "
                          "wait for it to end (or kill it), or use another run_dir") from None
    handle.truncate(0)
    import socket

    # What the refusal of a second run names: a run of another host (a shared file system) by its host.
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}")
    handle.flush()
    _RUN_LOCKS.append(handle)
    # The last process in this folder is gone: what it started and could not stop (it was killed)
    # goes before this one starts anything (a vLLM server holding the GPU memory and the port).
    children.stop_leftovers(run_dir)
    return True


class CheckpointManager:
    """Saves and finds checkpoints of one run directory (all ranks construct it)."""

    def __init__(self, run_dir: Path, env: distributed.DistEnv, keep: int):
        self.root = Path(run_dir) / "checkpoints"
        self.env, self.keep = env, keep
        self._verified: set[Path] = set()  # checkpoints this process wrote or hashed and found whole
        self.decision = ""  # resolve()'s outcome, logged by announce()
        # More of what the resume decision says, (level, message), logged by announce() after it:
        # what a crash cost, a new branch. Warnings about damaged checkpoints are logged at once.
        self.notes: list[tuple[int, str]] = []
        self._background: tuple | None = None  # (future, tmp folder, final folder, hash, step) in flight
        # Steps whose checkpoints pruning keeps beyond ``keep`` (rank 0): a task evaluation still
        # reading them (llmtrain.evaluation.in_loop).
        self.pinned: set[int] = set()
        # Parts with per-rank tensors to save: name -> (step -> tensors; empty: nothing to save).
        self.rank_state: dict[str, Callable[[int], dict[str, torch.Tensor]]] = {}
        self._deleting: threading.Thread | None = None  # pruned checkpoints being deleted

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Folders named ``step_<N>``, newest first (complete or not)."""
        return step_dirs(self.root)

    # ---------------------------------------------------------------- resume
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from per ``trainer.resume``: rank 0 lists the candidates,
        every rank checksums its share of each (newest first) until one verifies. Collective.
        The decision is logged by :meth:`announce`, not here.

        Raises:
            ResumeError: an explicit path or step that does not exist or does not verify; or
                ``never`` with a run directory that already holds checkpoints.
        """
        plan: list[Any] = [None, None]  # candidates (newest first), or the error
        if self.env.is_main:
            try:
                plan[0] = self._candidates(str(resume))
            except ResumeError as err:
                plan[1] = str(err)
        if distributed.is_initialized():
            dist.broadcast_object_list(plan, src=0)
        if plan[1] is not None:
            raise ResumeError(plan[1])
        explicit = str(resume) != "auto"
        for candidate in plan[0]:
            path = Path(candidate)
            problem = verify_collective(path, self.env)
            if problem is None:
                self._verified.add(path)
                self.decision = f"resume={resume}: resuming from {path}" + (
                    "" if explicit else " (newest complete checkpoint)")
                return path
            if explicit:
                raise ResumeError(f"trainer.resume={resume}: checkpoint {path} is not usable: {problem}")
            if self.env.is_main:
                log.warning("resume=auto: SKIPPING checkpoint %s: %s; trying an older one", path, problem)
        if not explicit and str(resume) != "never":
            self.decision = (f"resume=auto: no complete checkpoint in {self.root}; starting fresh from the configured "
                             "weights")
        return None

    def announce(self) -> None:
        """Rank 0 logs what :meth:`resolve` decided (resuming from a checkpoint, or starting
        fresh), once. The trainer calls it after the config's start-up checks have passed: an
        error found by them would otherwise follow a line that reads as if the run had begun.
        Then :attr:`notes` (what a crash cost, a new branch), in the order they were noted."""
        if self.env.is_main:
            if self.decision:
                log.info("%s", self.decision)
            for level, message in self.notes:
                log.log(level, "%s", message)
        self.decision, self.notes = "", []

    def _candidates(self, resume: str) -> list[str]:
        """Rank 0: the folders ``resume`` may resume from, newest first (not yet verified)."""
        if self.root.parent.is_dir() and lock_run_dir(self.root.parent):
            self._remove_unfinished()  # just locked: the process that wrote them is gone
        if resume == "never":
            existing = self.step_dirs()
            if existing:
                raise ResumeError(f"trainer.resume=never but {self.root} already holds {existing[0][1].name}; "
                                  "use a new run_dir, or trainer.resume=auto to continue it")
            return []
        if resume == "auto":
            return [str(path) for _, path in self.step_dirs()]
        path = self.root / f"step_{resume}" if resume.isdigit() else Path(resume).expanduser()
        if not path.is_dir():
            what = f"step {resume}" if resume.isdigit() else f"path {resume}"
            raise ResumeError(f"trainer.resume={resume}: checkpoint {what} does not exist ({path})")
        return [str(path)]

    def _remove_unfinished(self) -> None:
        """Rank 0, having just taken the run's lock (:func:`lock_run_dir`; its holder is the only
        writer of ``checkpoints/``, so whoever wrote them is gone): delete the ``.tmp-step_<N>``
        folders of saves a killed process left unsealed (never a checkpoint: they were never
        renamed to ``step_<N>``), except this manager's own background write, and say which."""
        own = self._background[1] if self._background is not None else None
        stale = sorted(p for p in self.root.glob(".tmp-step_*") if _TMP_DIR.match(p.name) and p.is_dir()
                       and p != own) if self.root.is_dir() else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            log.warning("removed %s in %s: unfinished checkpoint%s of a save that was interrupted (never complete, "
                        "never resumed)", ", ".join(p.name for p in stale), self.root, "s" if len(stale) > 1 else "")

    @staticmethod
    def read_state(path: Path) -> TrainState:
        return read_state(path)

    def start_branch(self, resumed: Path) -> Path | None:
        """Make ``resumed`` the head of the lineage this run continues: checkpoints of this run
        with a later step (the future a resume from an older step abandons, or damaged newer
        folders that ``auto`` skipped) are moved, never deleted, into
        ``checkpoints/abandoned-<UTC time>/``. Then ``resume=auto`` continues the branch that ran
        last, and ``keep_checkpoints`` counts this branch only. Rank 0; returns the folder the
        checkpoints went to, or None."""
        match = _STEP_DIR.match(resumed.name)
        if not self.env.is_main or resumed.parent.resolve() != self.root.resolve() or not match:
            return None
        later = [p for step, p in self.step_dirs() if step > int(match.group(1))]
        if not later:
            return None
        import time

        dest = self.root / f"abandoned-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        dest.mkdir(exist_ok=True)
        for path in later:
            os.rename(path, dest / path.name)
            self._verified.discard(path)
        _fsync_dir(self.root)
        self.notes.append((logging.WARNING, f"resuming from {resumed.name} starts a new branch: the later checkpoints "
                                            f"{', '.join(p.name for p in later)} were moved to {dest} (kept; "
                                            "resume=auto now continues this branch)"))
        return dest

    def read_rank_state(self, path: Path, name: str) -> dict[str, torch.Tensor]:
        """Part ``name``'s tensors of this rank in checkpoint ``path`` (empty when it saved none).

        Raises:
            ResumeError: the checkpoint holds them but was written by another number of ranks
                (they are one rank's share of a batch: they do not split anew).
        """
        saved = self.read_state(path).world_size
        if not (path / rank_state_file(name, 0)).is_file():
            return {}
        if saved != self.env.world_size:
            raise ResumeError(f"checkpoint {path} holds per-rank {name} state of {saved} rank(s) (a generation batch "
                              f"still being trained on), and this launch has {self.env.world_size}; resume it on "
                              f"{saved} rank(s), or from a checkpoint at a step that starts a generation batch "
                              "(trainer.resume=PATH)")
        from safetensors.torch import load_file

        return load_file(str(path / rank_state_file(name, self.env.rank)))

    def prepare(self, engine, path: Path) -> None:
        """Before ``engine.setup``: let the engine convert a checkpoint of another world size."""
        engine.prepare_resume(path / ENGINE_DIR, saved_world_size=self.read_state(path).world_size)

    def load(self, engine, path: Path) -> tuple[TrainState, dict[str, Any] | None]:
        """Load engine state; returns the loop position and this rank's RNG states (None when
        the checkpoint came from a different world size: RNG streams are per rank). The RNG
        files are read first (:func:`read_rng`, ``weights_only``), and every rank learns whether
        any was refused before the engine loads. Collective call.

        Raises:
            ResumeError: a rank's RNG file is refused (on every rank, naming that file).
        """
        state = self.read_state(path)
        rng_file = path / f"rank_{self.env.rank}.pt"
        rng, problem = None, None
        if state.world_size == self.env.world_size and rng_file.is_file():
            try:
                rng = read_rng(rng_file)
            except ResumeError as err:
                problem = str(err)
        if distributed.is_initialized():
            problems: list[Any] = [None] * self.env.world_size
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), None)
        if problem:
            raise ResumeError(problem)
        if rng is not None and rng.get("format") != RNG_FORMAT and self.env.is_main:
            log.warning("checkpoint %s stores RNG states in llmtrain's older format (numpy's state as a pickled "
                        "array): loaded with weights_only=True and numpy's array types allow-listed; the next "
                        "save writes the current format", path)
        engine.load_checkpoint(path / ENGINE_DIR, saved_world_size=state.world_size)
        if state.world_size != self.env.world_size and self.env.is_main:
            log.warning("checkpoint %s was written by %d rank(s), resuming on %d: model, optimizer and data "
                        "position carry over; per-rank RNG streams (dropout) start anew",
                        path, state.world_size, self.env.world_size)
        return state, rng

    # ---------------------------------------------------------------- save
    def save(self, engine, state: TrainState, config_yaml: str, hash_kind: str = "xxh3",
             background: bool = False) -> Path | None:
        """Write checkpoint ``step_<state.step>`` by the protocol above; returns its folder.
        Collective call.

        ``background``: the engine copies its state to host memory and writes it in a thread;
        the small files (RNG, loop state, config) are written now. Returns None: the checkpoint
        is sealed later, by :meth:`finish_background` once every rank's write is done (a kill before
        that leaves the previous checkpoint the newest). A save while one is in flight first
        finishes that one."""
        self.finish_background()
        final = self.root / f"step_{state.step}"
        tmp = self.root / f".tmp-step_{state.step}"
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an earlier interrupted save
            tmp.mkdir(parents=True)
        distributed.barrier()
        from llmtrain.checkpoint.format.dcp_writer import hash_writes

        hash_writes(tmp, hash_kind)  # the engine's big files are checksummed as they are written
        future = engine.save_checkpoint(tmp / ENGINE_DIR, background=background)
        self._write_small_files(tmp, state, config_yaml)
        if future is not None:
            self._background = (future, tmp, final, hash_kind, state.step)
            return None
        distributed.barrier()
        _maybe_inject_fault("save_before_marker", state.step)
        self.seal(tmp, final, hash_kind)
        return final

    def background_written(self) -> float:
        """1.0 when this rank's background write has finished (summed over ranks by the loop:
        the world size means every rank's is), else 0.0."""
        return float(self._background is not None and self._background[0].done())

    def finish_background(self) -> Path | None:
        """Wait for the background write in flight (if any) and seal it; returns its folder.
        Collective call.

        Raises:
            whatever the writer thread raised (disk full, permissions): the checkpoint is not
            sealed and stays a ``.tmp-step_<N>`` folder.
        """
        if self._background is None:
            return None
        future, tmp, final, hash_kind, step = self._background
        self._background = None
        future.result()
        distributed.barrier()
        _maybe_inject_fault("save_before_marker", step)
        self.seal(tmp, final, hash_kind)
        return final

    def _write_small_files(self, tmp: Path, state: TrainState, config_yaml: str) -> None:
        torch.save(capture_rng(), tmp / f"rank_{self.env.rank}.pt")
        for name, tensors_at in self.rank_state.items():
            if tensors := tensors_at(state.step):
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / rank_state_file(name, self.env.rank)))
        if self.env.is_main:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
            (tmp / "config.yaml").write_text(config_yaml)

    def seal(self, tmp: Path, final: Path, hash_kind: str) -> None:
        """Every rank fsyncs and checksums its share of ``tmp``'s files (all written, after a
        barrier); rank 0 writes the marker, renames ``tmp`` to ``final`` and prunes. Collective.

        A file the engine wrote through :func:`llmtrain.checkpoint.format.dcp_writer.hashed_open` was
        checksummed from its bytes as they were written: its writer takes its checksum from
        there (after checking the size on disk), with no second read. The other files are split
        over the ranks and read (:func:`_share`)."""
        from llmtrain.checkpoint.format.dcp_writer import take_written

        listing = sorted(p for p in tmp.rglob("*") if p.is_file())
        hashed = take_written(tmp)
        names: list[Any] = [sorted(hashed)]
        if distributed.is_initialized():
            names = [None] * self.env.world_size
            dist.all_gather_object(names, sorted(hashed))
        known = {rel for share in names for rel in share}
        mine = {}
        for path in [tmp / rel for rel in sorted(hashed)] + _share([p for p in listing if p.relative_to(tmp).as_posix()
                                                                     not in known], self.env.rank, self.env.world_size):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            rel, size = path.relative_to(tmp).as_posix(), path.stat().st_size
            written = hashed.get(rel)
            digest = written[1] if written is not None and written[0] == size else _checksum(path, hash_kind)
            mine[rel] = {"bytes": size, _HASH_KEYS[hash_kind]: digest}
        shares: list[Any] = [mine]
        if distributed.is_initialized():
            shares = [None] * self.env.world_size
            dist.gather_object(mine, shares if self.env.is_main else None, dst=0)
        if self.env.is_main:
            files = {rel: meta for share in shares for rel, meta in share.items()}
            self._write_marker_and_rename(tmp, final, dict(sorted(files.items())))
            self._prune()
        distributed.barrier()

    def _write_marker_and_rename(self, tmp: Path, final: Path, files: dict[str, Any]) -> None:
        marker_tmp = tmp / (MARKER + ".partial")
        with open(marker_tmp, "w") as f:
            json.dump({"files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker_tmp, tmp / MARKER)
        _fsync_dir(tmp)
        if final.exists():  # resumed from an older step (resume=<step>), or a damaged folder
            log.warning("replacing existing checkpoint %s with the one just written", final)
            shutil.rmtree(final)
        # A universal-format conversion of the old folder would no longer match it.
        shutil.rmtree(self.root / ".universal" / final.name, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._verified.add(final)

    def prune(self) -> None:
        """Rank 0: remove complete checkpoints beyond the newest ``keep`` (``pinned`` ones stay)."""
        self._prune()

    def finish_pruning(self) -> None:
        """Wait until the checkpoints pruning removed are deleted from disk (rank 0; a process
        that exits waits for it too: the thread is not a daemon)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def _prune(self) -> None:
        self.finish_pruning()
        # Count only checkpoints known to verify (hashing each unknown one once), so a damaged
        # folder never takes the place of a good one; damaged folders are left for inspection.
        complete = []
        for _, path in self.step_dirs():
            if path in self._verified or verify(path) is None:
                self._verified.add(path)
                complete.append(path)
        doomed = []
        for path in complete[self.keep:]:
            if step_of(path) in self.pinned:
                continue
            # Renamed at once (no longer a checkpoint), its files deleted in a thread: unlinking
            # a checkpoint's GiBs takes as long as writing a good part of them (1.1 s of a profiled 12.3 s
            # save of SmolLM2-135M), time the training loop need not wait.
            trash = self.root / f"{_TRASH}{path.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(path, trash)
            doomed.append(trash)
            self._verified.discard(path)
        doomed += [p for p in self.root.glob(_TRASH + "*") if p not in doomed]  # left by a killed process
        if doomed:
            self._deleting = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in doomed],
                                              name="llmtrain-prune")
            self._deleting.start()
        # Universal-format conversions (world-size changes) of checkpoints that are gone.
        for converted in (self.root / ".universal").glob("step_*"):
            if not (self.root / converted.name.removesuffix(".tmp")).is_dir():
                shutil.rmtree(converted, ignore_errors=True)
