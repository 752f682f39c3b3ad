"""The checkpoint protocol: the one owner of saving, validating, finding and loading checkpoints.

Layout of ``RUN_DIR/checkpoints/step_<N>/``::

    engine/             engine-native model + optimizer + LR-scheduler state (sharded per rank
                        where the engine shards)
    rank_<r>.pt         RNG states of rank r (python, numpy, torch CPU, CUDA where present), as
                        tensors and plain types (:func:`capture_rng`; read with weights_only)
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
may carry either, so checkpoints of older versions verify. Only a folder named ``step_<N>`` whose marker verifies counts as a checkpoint:
a crash at any moment leaves the previous checkpoint as the newest valid one. There are no
"latest" pointers between checkpoints (a DeepSpeed checkpoint's ``latest`` names its own
``engine/`` folder and is listed in its marker like every other file). The newest ``keep``
complete checkpoints are kept; the only complete one is never deleted.

Trust: RNG files are read with ``torch.load(weights_only=True)`` (:func:`read_rng`), so they can
run no code; DeepSpeed's loaders, which unpickle, get only folders whose files passed the same
check (:func:`llmtrain.engine.deepspeed_engine.check_checkpoint_files`). Torch's Distributed
Checkpoint still reads its ``.metadata`` with ``pickle``: load only checkpoints you trust.

Resuming continues the same run (:func:`check_resumable`). Exports (Hugging Face and PEFT
folders, in the run and offline) are :mod:`llmtrain.export`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from llmtrain import distributed
from llmtrain.errors import ResumeError  # raised here; also importable as checkpoint.ResumeError
from llmtrain.safe_load import load_weights_only, unpickling_reason

log = logging.getLogger("llmtrain")

MARKER = "COMPLETE.json"
STATE_FILE = "trainer_state.json"
ENGINE_DIR = "engine"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_of(checkpoint_dir: Path) -> int:
    """The optimizer step a checkpoint directory (``step_<N>``) holds.

    Raises:
        ValueError: the name is not ``step_<N>``.
    """
    match = _STEP_DIR.match(Path(checkpoint_dir).name)
    if match is None:
        raise ValueError(f"{checkpoint_dir} is not a step_<N> checkpoint directory")
    return int(match.group(1))


@dataclass
class TrainState:
    """Loop position saved with every checkpoint. ``consumed_samples`` is the global sample index
    of the next sample (independent of the number of ranks)."""

    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    tracker_run_id: str | None = None  # wandb's
    mlflow_run_id: str | None = None
    world_size: int = 1
    global_batch_size: int = 0
    # The checkpoint this one continues (``step_4``): the previous save of the same lineage, or
    # the checkpoint the run resumed from. None for the first checkpoint of a fresh run.
    parent: str | None = None
    # Updates dropped by trainer.nonfinite=skip: the optimizer has taken step - skipped_updates.
    skipped_updates: int = 0
    # Running mean of healthy steps' losses and how many fed it (trainer.spike_factor).
    loss_ema: float = 0.0
    loss_ema_steps: int = 0
    # Wall-time accounting since the run's first start (Unix seconds; rank 0's clock), for
    # time/goodput: productive = the steps this checkpoint includes; lost = work a crash made the
    # run redo; restart = gaps between a crash and the next start (queueing included).
    run_started_unix: float = 0.0
    saved_unix: float = 0.0
    productive_s: float = 0.0
    startup_s: float = 0.0
    eval_s: float = 0.0
    checkpoint_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    # Partial training (LoRA, model.freeze): the base weights the checkpoint's trainable
    # parameters belong to (llmtrain.adapters.base_fingerprint); None in full training.
    base_fingerprint: str | None = None
    # Mixture-of-experts models: tokens routed to each expert [layer][expert] over all steps
    # so far (the report's heatmap, exact across resumes); None for dense models.
    expert_load: list[list[float]] | None = None


def read_state(checkpoint_dir: Path) -> TrainState:
    """The loop position saved in ``checkpoint_dir`` (its ``trainer_state.json``); fields that
    an older checkpoint lacks get their defaults, fields this version does not know are dropped."""
    saved = json.loads((Path(checkpoint_dir) / STATE_FILE).read_text())
    known = set(TrainState.__dataclass_fields__)
    return TrainState(**{k: v for k, v in saved.items() if k in known})


HASHES = ("xxh3", "sha256")
_HASH_KEYS = {"xxh3": "xxh3_128", "sha256": "sha256"}  # the marker's key per file


def _checksum(path: Path, kind: str) -> str:
    """Hex checksum of the file at ``path``: ``xxh3`` (XXH3-128, the xxhash library) or ``sha256``."""
    if kind == "sha256":
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
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


# Layout of rank_<r>.pt. Format 2: tensors and plain types only, so torch.load(weights_only=True)
# reads it with torch's default allow-list. Files without "format" are format 1 (before it):
# random.getstate() and np.random.get_state() tuples as they come, numpy's key a pickled array.
RNG_FORMAT = 2
_RNG_KEYS = ("python", "numpy", "torch")


def capture_rng() -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch CPU and, where present, CUDA) as tensors and
    plain types, so that ``torch.load(..., weights_only=True)`` reads them back::

        {"format": 2,
         "python": {"version": int, "state": int64 tensor (625 words), "gauss": float | None},
         "numpy": {"bit_generator": "MT19937", "key": int64 tensor (624 uint32 words), "pos": int,
                   "has_gauss": int, "cached_gaussian": float},
         "torch": uint8 tensor, "cuda": [uint8 tensor per device]}
    """
    version, words, gauss = random.getstate()
    name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
        "numpy": {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this rank's RNG states from :func:`capture_rng`'s dict (or a format-1 dict of older
    checkpoints, whose python and numpy states are the tuples of ``getstate``)."""
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        python = (python["version"], tuple(python["state"].tolist()), python["gauss"])
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["bit_generator"], numpy_state["key"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What a pickled numpy array references (a format-1 RNG file's numpy key): the array
    reconstructor under numpy 2's and numpy 1's module name, the array and dtype classes. They
    rebuild data-only arrays; allow-listed for :func:`read_rng`'s ``weights_only`` load only."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    return [(multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_rng(path: Path) -> dict[str, Any]:
    """One rank's RNG file (``rank_<r>.pt``), loaded with ``torch.load(weights_only=True)``: only
    tensors and plain types are built, so a crafted file cannot run code. A format-1 file (before
    :data:`RNG_FORMAT`; numpy's key a pickled array) loads the same way with numpy's array types
    allow-listed (:func:`_numpy_array_globals`) and is returned as it is (:func:`restore_rng`
    takes both); the caller says so in the log (``"format"`` absent).

    Raises:
        ResumeError: the file holds other pickled objects (refused: none of it runs), is not a
            torch file, or lacks the python, numpy or torch state; the message names the file.
    """
    import pickle

    fix = ("resume from a checkpoint you wrote yourself (trainer.resume=<step or path>) or start a new run_dir; "
           "load only checkpoints you trust")
    try:
        state = load_weights_only(path, _numpy_array_globals())
    except pickle.UnpicklingError as err:
        raise ResumeError(f"refusing RNG file {path}: it holds pickled objects that are not RNG states "
                          f"({unpickling_reason(err)}); it was not loaded and none of it ran; {fix}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise ResumeError(f"RNG file {path} is not a readable torch file ({err}); {fix}") from None
    missing = [k for k in _RNG_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ResumeError(f"RNG file {path} lacks the {', '.join(missing)} state(s) of an llmtrain RNG file; {fix}")
    return state


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


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on ``run_dir`` for the life of this process (rank 0 calls it), so
    a second run in the same folder (or orphaned workers of a killed one) cannot interleave
    checkpoints. The OS drops the lock when the process dies.

    Raises:
        ResumeError: another live process holds the lock.
    """
    import fcntl

    if any(Path(h.name) == run_dir / ".lock" for h in _RUN_LOCKS):
        return
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
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    _RUN_LOCKS.append(handle)


class CheckpointManager:
    """Saves and finds checkpoints of one run directory (all ranks construct it)."""

    def __init__(self, run_dir: Path, env: distributed.DistEnv, keep: int):
        self.root = Path(run_dir) / "checkpoints"
        self.env, self.keep = env, keep
        self._verified: set[Path] = set()  # checkpoints this process wrote or hashed and found whole
        self._background: tuple | None = None  # (future, tmp folder, final folder, hash, step) in flight
        # Steps whose checkpoints pruning keeps beyond ``keep`` (rank 0): a task evaluation still
        # reading them (llmtrain.task_eval).
        self.pinned: set[int] = set()

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Folders named ``step_<N>``, newest first (complete or not)."""
        return step_dirs(self.root)

    # ---------------------------------------------------------------- resume
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from per ``trainer.resume``: rank 0 lists the candidates,
        every rank checksums its share of each (newest first) until one verifies. Collective.

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
                if self.env.is_main:
                    log.info("resume=%s: resuming from %s%s", resume, path,
                             "" if explicit else " (newest complete checkpoint)")
                return path
            if explicit:
                raise ResumeError(f"trainer.resume={resume}: checkpoint {path} is not usable: {problem}")
            if self.env.is_main:
                log.warning("resume=auto: SKIPPING checkpoint %s: %s; trying an older one", path, problem)
        if self.env.is_main and not explicit and str(resume) != "never":
            log.info("resume=auto: no complete checkpoint in %s; starting fresh from the configured weights", self.root)
        return None

    def _candidates(self, resume: str) -> list[str]:
        """Rank 0: the folders ``resume`` may resume from, newest first (not yet verified)."""
        if self.root.parent.is_dir():
            lock_run_dir(self.root.parent)
        if resume == "never":
            existing = self.step_dirs()
            if existing:
                raise ResumeError(f"trainer.resume=never but {self.root} already holds {existing[0][1].name}; "
                                  "use a new run_dir, or trainer.resume=auto to continue it")
            return []
        if resume == "auto":
            for path in sorted(self.root.glob(".tmp-step_*")) if self.root.is_dir() else []:
                log.warning("resume=auto: ignoring unfinished checkpoint %s (a save was interrupted)", path)
            return [str(path) for _, path in self.step_dirs()]
        path = self.root / f"step_{resume}" if resume.isdigit() else Path(resume).expanduser()
        if not path.is_dir():
            what = f"step {resume}" if resume.isdigit() else f"path {resume}"
            raise ResumeError(f"trainer.resume={resume}: checkpoint {what} does not exist ({path})")
        return [str(path)]

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
        log.warning("resuming from %s starts a new branch: the later checkpoints %s were moved to %s (kept; "
                    "resume=auto now continues this branch)", resumed.name, ", ".join(p.name for p in later), dest)
        return dest

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
        if self.env.is_main:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
            (tmp / "config.yaml").write_text(config_yaml)

    def seal(self, tmp: Path, final: Path, hash_kind: str) -> None:
        """Every rank fsyncs and checksums its share of ``tmp``'s files (all written, after a
        barrier); rank 0 writes the marker, renames ``tmp`` to ``final`` and prunes. Collective."""
        listing = sorted(p for p in tmp.rglob("*") if p.is_file())
        mine = {}
        for path in _share(listing, self.env.rank, self.env.world_size):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            mine[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size,
                                                     _HASH_KEYS[hash_kind]: _checksum(path, hash_kind)}
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

    def _prune(self) -> None:
        # Count only checkpoints known to verify (hashing each unknown one once), so a damaged
        # folder never takes the place of a good one; damaged folders are left for inspection.
        complete = []
        for _, path in self.step_dirs():
            if path in self._verified or verify(path) is None:
                self._verified.add(path)
                complete.append(path)
        for path in complete[self.keep:]:
            if step_of(path) in self.pinned:
                continue
            shutil.rmtree(path, ignore_errors=True)
            self._verified.discard(path)
        # Universal-format conversions (world-size changes) of checkpoints that are gone.
        for converted in (self.root / ".universal").glob("step_*"):
            if not (self.root / converted.name.removesuffix(".tmp")).is_dir():
                shutil.rmtree(converted, ignore_errors=True)


# Settings a resumed run may change: cadence, bookkeeping and the length of the run. Everything
# else (model, data, recipe, optimisation, seed) defines the run being continued.
RESUMABLE_CHANGES = ("name", "run_dir", "tracker", "trainer.max_steps", "trainer.eval_every", "trainer.eval_samples",
                     "trainer.log_every", "trainer.save_every", "trainer.save_every_minutes", "trainer.keep_checkpoints",
                     "trainer.checkpoint_hash", "trainer.async_checkpoint", "trainer.resume", "trainer.preempt_signal", "trainer.export_hf", "trainer.progress_bar",
                     "trainer.peak_tflops", "trainer.hang_timeout_s",
                     # Scoring the checkpoints reads them and changes nothing of the training.
                     "trainer.eval_tasks", "trainer.eval_tasks_every", "trainer.eval_tasks_async",
                     "trainer.eval_tasks_limit", "trainer.eval_tasks_batch_size", "trainer.eval_tasks_device",
                     "trainer.eval_tasks_include", "trainer.eval_tasks_bootstrap_iters",
                     # Memory knobs that do not change what is computed (recomputation, the loss in
                     # chunks, where each row's tokens live): what a run that ran out of memory changes.
                     "trainer.activation_checkpointing", "trainer.loss_chunk_tokens", "recipe.cp", "recipe.cp_style",
                     # The same experts' math by another kernel, and experts spread over other ranks.
                     "model.experts_implementation", "recipe.ep")


# With the torch engine on both sides, the checkpoint is a Distributed Checkpoint keyed by
# parameter name, so the parallel layout (the recipe: FSDP2 / TP / PP degrees, ZeRO stage,
# schedule) may change on resume: DCP reshards.
LAYOUT_KEYS = ("recipe", "engine")


def _saved_and_current(checkpoint_dir: Path, current: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's resolved config and ``current``, both flattened to dotted keys."""
    import yaml

    saved = yaml.safe_load((checkpoint_dir / "config.yaml").read_text()) or {}

    def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(tree, dict):
            out: dict[str, Any] = {}
            for key, value in tree.items():
                out.update(flatten(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: tree}

    return flatten(saved), flatten(current)


def _differences(old: dict, new: dict, keep) -> list[str]:
    from llmtrain.config import added_at_default, canonical_format

    def same(k: str) -> bool:
        if k not in old and k in new:
            return added_at_default(k, new[k])  # a field newer than the checkpoint, at its default
        return canonical(k, old.get(k)) == canonical(k, new.get(k))

    def canonical(k: str, value: Any) -> Any:
        # A format renamed since older checkpoints were written: same meaning, new spelling.
        return canonical_format(value) if k == "data.format" and isinstance(value, str) else value

    return [f"{k}: {old.get(k, '<absent>')} -> {new.get(k, '<absent>')}"
            for k in sorted(set(old) | set(new)) if keep(k) and not same(k)]


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in prefixes)


def keys_outside_schema(checkpoint_dir: Path, current: dict) -> list[str]:
    """Keys of the checkpoint's config that the schema has no field for: written by runs from
    before the schema was closed (``+trainer.max_step=10`` was stored and ignored)."""
    return _outside_schema(_saved_and_current(checkpoint_dir, current)[0])


def _outside_schema(old: dict) -> list[str]:
    from llmtrain.config import is_schema_key

    return sorted(k for k in old if not is_schema_key(k))


def config_differences(checkpoint_dir: Path, current: dict) -> list[str]:
    """``key: saved -> current`` for every setting that differs from the checkpoint's resolved
    config, except :data:`RESUMABLE_CHANGES` (and :data:`LAYOUT_KEYS` when both the checkpoint
    and the current run use the torch engine) and :func:`keys_outside_schema`, which no run
    ever read."""
    old, new = _saved_and_current(checkpoint_dir, current)
    free = RESUMABLE_CHANGES + tuple(_outside_schema(old))
    if old.get("recipe.engine") == new.get("recipe.engine") == "torch":
        free = free + LAYOUT_KEYS
    return _differences(old, new, lambda key: not _under(key, free))


def layout_changes(checkpoint_dir: Path, current: dict) -> list[str]:
    """``key: saved -> current`` for the parallel-layout settings (:data:`LAYOUT_KEYS`) that differ."""
    old, new = _saved_and_current(checkpoint_dir, current)
    return _differences(old, new, lambda key: _under(key, LAYOUT_KEYS))


def check_base(checkpoint_dir: Path, saved: TrainState, model_cfg: Any, fingerprint: str | None,
               remedy: str = "resume with the base it was trained on, or start a new run_dir") -> None:
    """Refuse a partial checkpoint (LoRA, ``model.freeze``) whose trainable parameters were
    trained on other base weights than the model's source has now (``fingerprint``,
    :func:`llmtrain.adapters.base_fingerprint`); no check when either fingerprint is unknown.

    Raises:
        ResumeError: naming both fingerprints, the model and ``remedy``.
    """
    if saved.base_fingerprint and fingerprint and saved.base_fingerprint != fingerprint:
        raise ResumeError(
            f"checkpoint {checkpoint_dir} holds adapters/trainable parameters trained on base weights "
            f"{saved.base_fingerprint}, but model {model_cfg.get('name')} (source {model_cfg.get('source')}, path "
            f"{model_cfg.get('path')}) has weights {fingerprint}: {remedy}")


def check_resumable(resume_from: Path, cfg: Any, checkpoints: CheckpointManager, is_main: bool,
                    fingerprint: str | None = None) -> None:
    """Resuming continues the *same* run: refuse a checkpoint whose model, data, recipe or
    optimisation settings differ from the current config (naming each difference), or whose
    trainable parameters (LoRA, ``model.freeze``) were trained on other base weights
    (:func:`check_base`). A torch-engine run may change its parallel layout; that is said in the
    log (rank 0, ``is_main``).

    Raises:
        ResumeError: naming what differs and how to continue or start anew.
    """
    from omegaconf import OmegaConf

    saved = checkpoints.read_state(resume_from)
    check_base(resume_from, saved, cfg.model, fingerprint)
    if saved.global_batch_size != cfg.trainer.global_batch_size:
        raise ResumeError(
            f"checkpoint {resume_from} was trained with trainer.global_batch_size={saved.global_batch_size}; "
            f"resume it with the same value (got {cfg.trainer.global_batch_size}) so steps and samples line up")
    current = OmegaConf.to_container(cfg, resolve=True)
    differences = config_differences(resume_from, current)
    if differences:
        raise ResumeError(
            f"checkpoint {resume_from} belongs to a run with other settings ({'; '.join(differences)}). "
            "To continue it, use its settings; to start a new run, set a new run_dir (or name)")
    if not is_main:
        return
    ignored = keys_outside_schema(resume_from, current)
    if ignored:
        log.warning("checkpoint %s stores settings that are not config fields and were never used (%s); "
                    "ignoring them", resume_from, ", ".join(ignored))
    layout = layout_changes(resume_from, current)
    if layout:
        log.warning("resuming %s with another parallel layout (%s): %s", resume_from, "; ".join(layout),
                    "the Distributed Checkpoint is resharded" if cfg.recipe.engine == "torch" else
                    "each row's tokens are split anew; the ZeRO partitions follow the world size")
    if saved.step >= cfg.trainer.max_steps:
        log.warning("checkpoint %s is at step %d >= trainer.max_steps=%d: nothing to train (raise "
                    "trainer.max_steps to continue); exporting only", resume_from, saved.step,
                    cfg.trainer.max_steps)
