#!/usr/bin/env python
"""Checkpoint throughput against plain ``torch.save`` / ``torch.load`` of the same state.

Builds the configured model with the chosen recipe on one process, or on each of the ranks
``torchrun`` starts, takes one optimizer step (so Adam state exists), then times, alternating,
``--rounds`` times each:

* llmtrain save: engine shards + RNG + marker (checksum of every file, fsync, atomic rename),
  and the deletion of the checkpoint it replaces (keep=1; the manager's background deletion is
  waited for, so that it never runs into the next timed operation);
* plain save: on one process, one ``torch.save`` of the model and optimizer state dicts; on N
  ranks, each rank ``torch.save``-s its own shard state into its own file (FSDP2: the local
  shards of the model and optimizer state dicts; DeepSpeed: ``module.state_dict()`` and the ZeRO
  optimizer's ``state_dict()``, which holds the rank's fp32 partition and Adam moments), fsynced:
  what a DeepSpeed or FSDP2 user does without Distributed Checkpoint. Each round writes a new
  file and then deletes the previous one, as llmtrain's save with keep=1 writes a new checkpoint
  and then prunes the old;
* llmtrain resume: verify the marker (checksums) + engine load;
* plain load: ``torch.load`` and copying the state into the live model and optimizer
  (one process: ``load_state_dict``; N ranks: each rank its own file, copied into its shards);
* plain+xxh3 load, the peer of a verified load: the plain load after a checksum pass over the
  plain file's bytes with the verifier's own function (:func:`llmtrain.checkpoint.protocol._checksum`:
  ``--hash``, XXH3-128 by default, one ``update`` over the memory-mapped file). The two plain
  loads run in alternating order after each plain save;
* with ``--overlap`` (one process, torch engine), two ways to overlap the checksums with the
  load, each refusing a damaged checkpoint before any tensor is modified, in alternating order
  with the resume after each llmtrain save: the overlapped resume (the same verification in a
  thread while the load builds its state dicts, reads DCP's metadata and plans; the first copy
  into the model waits for it) and the staged resume (each DCP data file read once into host
  memory and hashed chunk by chunk as it is read, all verified, then copied in);
* the training stall of a background save (``trainer.async_checkpoint=true``, torch engine):
  the time until ``save`` returns (state copied to host memory), and the write's total time.

On N ranks every timed operation starts and ends with a barrier, so the wall time is the
slowest rank's; CPU time is summed over the ranks. Peak memory of each timed operation is the
resident set's high-water mark (``VmHWM``, reset before it through ``/proc/self/clear_refs``)
above the resident set at its start, largest rank; it counts mapped file pages the operation
touched. Prints the times, bytes/s and the ratios (plain time / llmtrain time, so above 1 is
faster) in wall clock and CPU time, and the time a resume adds before the first step. Examples:

    python scripts/bench/checkpoint.py model.architecture.hidden_size=512 model.architecture.num_hidden_layers=8
    python scripts/bench/checkpoint.py --smollm2                       # the 135 M shape, random init
    torchrun --nproc_per_node 2 scripts/bench/checkpoint.py --smollm2 +recipe=fsdp
    torchrun --nproc_per_node 2 scripts/bench/checkpoint.py --smollm2 +recipe=zero3
    python scripts/bench/checkpoint.py --smollm2 --overlap             # + overlapped and staged resumes
    python scripts/bench/checkpoint.py --smollm2 --profile save        # cProfile of one save
    torchrun --nproc_per_node 2 scripts/bench/checkpoint.py --smollm2 --stock-writer +recipe=fsdp
        # and a third arm: the same save with DCP's own writer (one torch.save per item)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib  # noqa: F401,E402  (the checkout's llmtrain first on the path)

import llmtrain.parallel.distributed as distributed  # noqa: E402  (before deepspeed)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from llmtrain import data  # noqa: E402
from llmtrain.checkpoint.protocol import (CheckpointManager, HASHES, _HASH_KEYS, _checksum, _read_marker,  # noqa: E402
                                         verify, verify_collective)
from llmtrain.common.errors import ResumeError  # noqa: E402
from llmtrain.engine import dcp_state  # noqa: E402
from llmtrain.checkpoint.state import TrainState  # noqa: E402
from llmtrain.common import collection  # noqa: E402
from llmtrain.config.layout import gradient_accumulation_steps  # noqa: E402
from llmtrain.config.compose import register_configs  # noqa: E402
from llmtrain.checkpoint.format import dcp_writer  # noqa: E402
from llmtrain.engine import build_engine  # noqa: E402
from llmtrain.models.build import build_model, byte_tokenizer  # noqa: E402
from llmtrain.objectives import build_objective  # noqa: E402
from llmtrain.parallel.dims import ParallelDims  # noqa: E402
from llmtrain.common.paths import CONF_DIR  # noqa: E402
from llmtrain.trainer import forward_backward  # noqa: E402

# SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied
# embeddings), built from config with random weights: 134.5 M parameters, no download.
SMOLLM2_135M = ["model.architecture.hidden_size=576", "model.architecture.intermediate_size=1536",
                "model.architecture.num_hidden_layers=30", "model.architecture.num_attention_heads=9",
                "model.architecture.num_key_value_heads=3", "model.architecture.vocab_size=49152"]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _local(value):
    """``value`` with every DTensor replaced by this rank's shard (plain tensors: as they are)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def _copy_into(live, saved) -> None:
    """Copy every tensor of ``saved`` into the tensor at the same place of ``live``."""
    if isinstance(live, torch.Tensor):
        with torch.no_grad():
            live.copy_(saved)
    elif isinstance(live, dict):
        for k, v in live.items():
            _copy_into(v, saved[k])
    elif isinstance(live, (list, tuple)):
        for a, b in zip(live, saved):
            _copy_into(a, b)


def plain_state(engine) -> dict:
    """This rank's model and optimizer state as the plain side saves it (see the module doc)."""
    if hasattr(engine, "ds"):
        return {"model": engine.ds.module.state_dict(), "optimizer": engine.ds.optimizer.state_dict()}
    if hasattr(engine, "parts"):  # the native engine (FSDP2, TP, PP): model parts and their optimizers
        return _local({"model": [part.state_dict() for part in engine.parts],
                       "optimizer": [opt.state_dict() for opt in engine.optimizers]})
    return _local({"model": engine.model.state_dict(), "optimizer": engine.optimizer.state_dict()})


def _reset_peak() -> int | None:
    """Reset this process's resident high-water mark; returns the resident set now (bytes), or
    None where the kernel offers no reset (then no peak is reported). Heap memory freed earlier is
    handed back first (glibc's ``malloc_trim``): the allocator keeps it resident, and an operation
    that reuses it would show no growth (a plain load after a plain load showed 3 MiB for 1.5 GiB)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then hide reused heap memory
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset VmHWM to the current resident set (Linux 4.0+)
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def overlapped_resume(manager: CheckpointManager, engine, path: Path) -> float:
    """Load ``path`` with its verification in a thread: the checksums are computed while the load
    builds its state dicts, reads DCP's metadata and plans; the mapped reader's first copy into
    the model waits for them, so a damaged checkpoint is refused before any tensor is modified.
    (One process: :func:`verify_collective`'s gather would run beside DCP's own collectives.)
    Returns the seconds the copies waited for the checksums (the part of them not hidden)."""
    original = dcp_state._MappedReader.read_data
    waited = [0.0]
    with ThreadPoolExecutor(1, thread_name_prefix="verify") as pool:
        checked = pool.submit(verify, path)

        def gated(reader, plan, planner):
            started = time.perf_counter()
            problem = checked.result()
            waited[0] = time.perf_counter() - started
            if problem is not None:
                raise ResumeError(f"checkpoint {path} is not usable: {problem}")
            return original(reader, plan, planner)

        dcp_state._MappedReader.read_data = gated
        try:
            manager.load(engine, path)
        finally:
            dcp_state._MappedReader.read_data = original
        assert checked.result() is None
    return waited[0]


STAGE_CHUNK = 8 << 20  # bytes read and hashed at a time by the staged resume


def staged_resume(manager: CheckpointManager, engine, path: Path) -> None:
    """Load ``path`` reading each DCP data file once: into host memory (an anonymous mapping,
    populated up front), the checksum taken on each chunk just read; every file verified before
    the load starts, then the mapped reader copies from those buffers instead of mapping the files.
    The other files (marker, metadata, RNG, ...) are verified as :func:`verify` does."""
    import mmap

    files, problem = _read_marker(path)
    assert problem is None, problem
    data = [rel for rel in files if rel.endswith(".distcp")]
    for rel, meta in files.items():
        assert (path / rel).stat().st_size == meta["bytes"], rel
        kind = next(k for k, key in _HASH_KEYS.items() if key in meta)
        if rel not in data and _checksum(path / rel, kind) != meta[_HASH_KEYS[kind]]:
            raise ResumeError(f"checksum mismatch in {rel}")
    staged: dict[tuple[int, int], mmap.mmap] = {}
    for rel in data:
        meta = files[rel]
        kind = next(k for k, key in _HASH_KEYS.items() if key in meta)
        digest = dcp_writer.new_digest(kind)
        buffer = mmap.mmap(-1, meta["bytes"], flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        with open(path / rel, "rb", buffering=0) as f, memoryview(buffer) as view:
            at = 0
            while at < len(buffer) and (n := f.readinto(view[at:at + STAGE_CHUNK])):
                digest.update(view[at:at + n])  # the chunk just read, still in the CPU's cache
                at += n
            info = os.fstat(f.fileno())
        staged[(info.st_dev, info.st_ino)] = buffer
        if at != len(buffer) or digest.hexdigest() != meta[_HASH_KEYS[kind]]:
            raise ResumeError(f"checksum mismatch in {rel}")
    real = mmap.mmap

    def from_stage(fileno, length, *args, **kwargs):
        info = os.fstat(fileno) if fileno >= 0 else None
        key = info and (info.st_dev, info.st_ino)
        return staged.pop(key) if key in staged else real(fileno, length, *args, **kwargs)

    mmap.mmap = from_stage  # the mapped reader's ``mmap.mmap(file.fileno(), 0, ...)``
    try:
        manager.load(engine, path)
    finally:
        mmap.mmap = real
        unread = list(staged)
        for buffer in staged.values():
            buffer.close()
    assert not unread, "the reader mapped a file instead of taking its staged copy"


KINDS = ("save", "plain_save", "resume", "plain_load", "plain_xxh3", "plain_hash", "resume_overlap", "resume_staged",
         "async_stall", "async_total", "stock_save")


class Timings:
    """Per kind of operation, each round's wall clock and CPU time (s) and peak memory (bytes
    above the resident set at its start); ``waits``: the overlapped resumes' waits (s)."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {k: [] for k in KINDS}
        self.cpu: dict[str, list[float]] = {k: [] for k in KINDS}
        self.peak: dict[str, list[float]] = {k: [] for k in KINDS}
        self.waits: list[float] = []

    def timed(self, kind: str, fn):
        """``fn()`` timed between barriers (wall: the slowest rank's); returns its result."""
        distributed.barrier()
        resident = _reset_peak()
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        distributed.barrier()
        self.wall[kind].append(time.perf_counter() - w)
        self.cpu[kind].append(time.process_time() - c)
        if resident is not None:
            self.peak[kind].append(_status_kib("VmHWM") * 1024 - resident)
        return result

    def gather(self, plain_bytes: int) -> int:
        """On N ranks: CPU time summed over the ranks, peak memory of the largest rank; returns
        ``plain_bytes`` (this rank's plain file) summed over the ranks. Collective."""
        if distributed.is_initialized():
            total = torch.tensor([plain_bytes], dtype=torch.float64)
            dist.all_reduce(total)
            plain_bytes = int(total.item())
            for kind in KINDS:
                summed = torch.tensor(self.cpu[kind], dtype=torch.float64)
                dist.all_reduce(summed)
                self.cpu[kind] = summed.tolist()
                largest = torch.tensor(self.peak[kind], dtype=torch.float64)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
                self.peak[kind] = largest.tolist()
        return plain_bytes


def plain_save(engine, rank: int, path: Path) -> None:
    """``torch.save`` of this rank's plain state into ``path``, fsynced; then the rank's previous file goes."""
    # A new file beside the previous one, which goes once this one is written: what llmtrain's
    # save with keep=1 does (and any save that survives a crash mid-write). Overwriting one
    # file in place instead reuses the page-cache pages its truncation just freed, which on a
    # machine short of free pages made the same 768 MB torch.save 1.45 s into new pages and
    # 0.33 s into reused ones.
    with open(path, "wb") as f:
        torch.save(plain_state(engine), f)
        f.flush()
        os.fsync(f.fileno())
    for older in path.parent.glob(f"plain_rank{rank}_*.pt"):
        if older != path:
            older.unlink()


def plain_load(engine, world: int, path: Path) -> None:
    """``torch.load`` of ``path`` copied into the live model and optimizer (see the module doc)."""
    if world == 1 and hasattr(engine, "optimizer") and not hasattr(engine, "ds"):
        blob = torch.load(path, weights_only=False)
        engine.model.load_state_dict(blob["model"])
        engine.optimizer.load_state_dict(blob["optimizer"])
    else:
        _copy_into(plain_state(engine), torch.load(path, weights_only=False))


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hash", choices=HASHES, default="xxh3")
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's shape (random init)")
    parser.add_argument("--profile", choices=("save", "resume", "async"),
                        help="instead of timing: cProfile one save / resume / background save (rank 0), top 25")
    parser.add_argument("--stock-writer", action="store_true",
                        help="also time llmtrain's save with DCP's own archive writer (a torch.save per item)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time the overlapped and the staged resume (one process, torch engine)")
    parser.add_argument("overrides", nargs="*")
    return parser, parser.parse_args()


def build(args):
    """(config, process env, engine, model): the configured model on its engine, one optimizer
    step taken so that Adam's state exists."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["tracker=none"] + (SMOLLM2_135M if args.smollm2 else []) + args.overrides)
    # Python's garbage collector as the trainer sets it up before a resume (imports frozen out of
    # its full collections; llmtrain.common.collection), for both arms alike.
    collection.CollectionSchedule(cfg.trainer.gc_every).set_up()
    env = distributed.init_distributed(need_group=cfg.recipe.engine == "deepspeed")
    dims = ParallelDims.from_recipe(cfg.recipe, env.world_size)
    engine = build_engine(cfg, env, gradient_accumulation_steps(cfg.trainer, dims.dp), dims,
                          build_objective(cfg.objective))
    with engine.model_init_context():
        model = build_model(cfg.model, cfg.trainer.seed)
    engine.setup(model)
    tok = byte_tokenizer()
    batch = data.Collator(tok.pad_token_id)([{"input_ids": list(range(64)), "labels": list(range(64))}] * 2)
    forward_backward(engine, [batch])
    engine.step()
    return cfg, env, engine, model


def profile_one(what: str, manager: CheckpointManager, engine, state: TrainState, hash_kind: str, resume) -> None:
    """cProfile of one save / resume / background save; rank 0 prints the top functions."""
    saved = manager.save(engine, state, "", hash_kind)
    state.step = 2
    profiler = cProfile.Profile()
    distributed.barrier()
    profiler.enable()
    if what == "save":
        manager.save(engine, state, "", hash_kind)
    elif what == "resume":
        resume(saved)
    else:
        manager.save(engine, state, "", hash_kind, background=True)
        manager.finish_background()
    profiler.disable()
    if manager.env.is_main:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


def main() -> None:
    parser, args = parse_args()
    cfg, env, engine, model = build(args)
    world = env.world_size
    can_async = cfg.recipe.engine == "torch"
    if args.overlap and (world != 1 or not can_async):
        parser.error("--overlap times one process on the torch engine (DCP's reader)")
    t = Timings()
    timed, wall = t.timed, t.wall

    def plain_xxh3(path: Path) -> None:
        # The verifier's own checksum function over the plain file's bytes, then the plain load:
        # what verifying a plain checkpoint would cost (the expected digest is not stored).
        w, c = time.perf_counter(), time.process_time()
        _checksum(path, args.hash)
        wall["plain_hash"].append(time.perf_counter() - w)
        t.cpu["plain_hash"].append(time.process_time() - c)
        plain_load(engine, world, path)

    def save_and_prune() -> Path:
        # The save and the deletion of the checkpoint it replaces (keep=1), which the manager
        # runs in a thread: waited for here, as the plain save unlinks its previous file, so
        # that no deletion runs into the next timed operation (a resume never overlaps one).
        saved = manager.save(engine, state, "", args.hash)
        manager.finish_pruning()
        return saved

    def resume(path: Path) -> None:
        assert verify_collective(path, env) is None
        manager.load(engine, path)

    base = Path(os.environ.get("BENCH_DIR", tempfile.gettempdir())) / f"bench-checkpoint-{os.environ.get('MASTER_PORT', os.getpid())}"
    if env.is_main:
        base.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    manager = CheckpointManager(base / "run", env, keep=1)
    state = TrainState(step=1, consumed_samples=2, world_size=world, global_batch_size=2)
    plain_files = [base / f"plain_rank{env.rank}_{i}.pt" for i in (0, 1)]
    plain_file = plain_files[0]
    try:
        if args.profile:
            profile_one(args.profile, manager, engine, state, args.hash, resume)
            return
        step = 0
        arms = ("ours", "plain") + (("stock",) if args.stock_writer else ())
        for r in range(args.rounds):
            # Alternate which of ours / plain runs first, so drifts of the shared box cancel.
            for who in benchlib.alternating(arms, r):
                if who == "stock":
                    step += 1
                    state.step = step
                    dcp_writer.FRAMED_ARCHIVES = False
                    try:
                        timed("stock_save", lambda: save_and_prune())
                    finally:
                        dcp_writer.FRAMED_ARCHIVES = True
                    continue
                if who == "plain":
                    plain_file = plain_files[r % 2]
                    timed("plain_save", lambda: plain_save(engine, env.rank, plain_file))
                    for load in benchlib.alternating(("plain_load", "plain_xxh3"), r):
                        timed(load, lambda: plain_load(engine, world, plain_file) if load == "plain_load"
                              else plain_xxh3(plain_file))
                    continue
                step += 1
                state.step = step
                saved = timed("save", lambda: save_and_prune())
                ours_bytes = folder_bytes(saved)
                loads = ("resume", "resume_overlap", "resume_staged") if args.overlap else ("resume",)
                for load in benchlib.alternating(loads, r):
                    waited = timed(load, lambda: resume(saved) if load == "resume" else
                                   staged_resume(manager, engine, saved) if load == "resume_staged" else
                                   overlapped_resume(manager, engine, saved))
                    if load == "resume_overlap":
                        t.waits.append(waited)
                if can_async:
                    step += 1
                    state.step = step
                    w = time.perf_counter()
                    timed("async_stall", lambda: manager.save(engine, state, "", args.hash, background=True))
                    manager.finish_background()
                    distributed.barrier()
                    wall["async_total"].append(time.perf_counter() - w)
                    manager.finish_pruning()
        plain_bytes = plain_file.stat().st_size
    finally:
        distributed.barrier()
        if env.is_main:
            shutil.rmtree(base, ignore_errors=True)

    plain_bytes = t.gather(plain_bytes)
    if env.is_main:
        # Full counts: ZeRO-3 partitions its parameters (ds_numel), FSDP2 shards them (DTensor numel).
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        print(f"recipe {cfg.recipe.name} x {world} process(es), model {params / 1e6:.1f} M parameters, "
              f"checkpoint {ours_bytes / 2**20:.1f} MiB (plain files {plain_bytes / 2**20:.1f} MiB), checksum "
              f"{args.hash}, median of {args.rounds} alternating rounds")
        report(args, can_async, ours_bytes, plain_bytes, t)


def report(args, can_async: bool, ours_bytes: int, plain_bytes: int, t: Timings) -> None:
    """Print the medians: times (s), byte rates (MiB/s), ratios (plain time / llmtrain time, wall
    clock and CPU time: above 1, llmtrain is faster) and peak memory (MiB above the start)."""
    wall, cpu, peak, waits = t.wall, t.cpu, t.peak, t.waits
    med = {k: statistics.median(v) for k, v in wall.items() if v}
    cmed = {k: statistics.median(v) for k, v in cpu.items() if v}
    pmed = {k: statistics.median(v) / 2**20 for k, v in peak.items() if v}

    def mib(kind: str) -> str:
        return f"{pmed[kind]:.0f} MiB" if kind in pmed else "n/a"

    # The ratio is speed on the same state: plain time / llmtrain time (above 1: llmtrain is faster).
    # Byte rates are shown too; the files differ in size (DCP writes a tied weight under both names).
    for ours, plain, label in (("save", "plain_save", "save"), ("resume", "plain_load", "load")):
        print(f"{label:5s} llmtrain {med[ours]:7.3f} s ({ours_bytes / med[ours] / 2**20:7.1f} MiB/s)   plain "
              f"{med[plain]:7.3f} s ({plain_bytes / med[plain] / 2**20:7.1f} MiB/s)   ratio wall {med[plain] / med[ours]:.2f}"
              f"   ratio CPU time {cmed[plain] / cmed[ours]:.2f} (CPU {cmed[ours]:.2f} s vs {cmed[plain]:.2f} s)"
              f"   peak memory {mib(ours)} vs {mib(plain)}")
    # The verified load's peer: the same checksum pass over the plain file, then the plain load.
    print(f"verified load: llmtrain {med['resume']:.3f} s (CPU {cmed['resume']:.2f} s), plain+{args.hash} "
          f"{med['plain_xxh3']:.3f} s (CPU {cmed['plain_xxh3']:.2f} s; its checksum pass {med['plain_hash']:.3f} s, "
          f"CPU {cmed['plain_hash']:.2f} s)   ratio wall {med['plain_xxh3'] / med['resume']:.2f}   ratio CPU time "
          f"{cmed['plain_xxh3'] / cmed['resume']:.2f}   peak memory {mib('resume')} vs {mib('plain_xxh3')}")
    # Each round's loads, in the order they ran (rounds alternate it), to judge a median by its spread.
    print("each round, wall (CPU) s: " + "; ".join(
        f"{kind} " + " ".join(f"{w:.2f} ({c:.2f})" for w, c in zip(wall[kind], cpu[kind]))
        for kind in ("resume", "resume_overlap", "resume_staged", "plain_load", "plain_xxh3") if wall[kind]))
    if args.overlap:
        print(f"overlapped resume (verification in a thread, copies wait for it): {med['resume_overlap']:.3f} s "
              f"(CPU {cmed['resume_overlap']:.2f} s, peak {mib('resume_overlap')}); sequential / overlapped: wall "
              f"{med['resume'] / med['resume_overlap']:.2f}, CPU time {cmed['resume'] / cmed['resume_overlap']:.2f}; "
              f"against plain+{args.hash}: wall {med['plain_xxh3'] / med['resume_overlap']:.2f}, CPU time "
              f"{cmed['plain_xxh3'] / cmed['resume_overlap']:.2f}; its copies waited {statistics.median(waits):.3f} s "
              f"for the checksums")
        print(f"staged resume (each data file read once into host memory, hashed per {STAGE_CHUNK >> 20} MiB chunk, "
              f"verified, then copied in): {med['resume_staged']:.3f} s (CPU {cmed['resume_staged']:.2f} s, peak "
              f"{mib('resume_staged')}); sequential / staged: wall {med['resume'] / med['resume_staged']:.2f}, CPU time "
              f"{cmed['resume'] / cmed['resume_staged']:.2f}; against plain+{args.hash}: wall "
              f"{med['plain_xxh3'] / med['resume_staged']:.2f}, CPU time {cmed['plain_xxh3'] / cmed['resume_staged']:.2f}")
    if args.stock_writer:
        print(f"save with DCP's own archive writer {med['stock_save']:.3f} s (CPU {cmed['stock_save']:.2f} s): framed "
              f"archives are {med['stock_save'] / med['save']:.2f}x its speed in wall clock, "
              f"{cmed['stock_save'] / cmed['save']:.2f}x in CPU time")
    print(f"a resume adds {med['resume']:.3f} s before the first step (marker verification + load); plain load "
          f"{med['plain_load']:.3f} s")
    if can_async:
        print(f"training stall per save: synchronous {med['save']:.3f} s, trainer.async_checkpoint=true "
              f"{med['async_stall']:.3f} s (the write then takes {med['async_total'] - med['async_stall']:.3f} s "
              f"in the background); stall ratio against plain save {med['plain_save'] / med['async_stall']:.2f} "
              f"(CPU time {cmed['plain_save'] / cmed['async_stall']:.2f})")
    else:
        print(f"training stall per save: synchronous {med['save']:.3f} s (background saves need engine=torch)")

if __name__ == "__main__":
    main()
