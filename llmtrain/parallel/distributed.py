"""Launch environment: rank and world size from torchrun / accelerate / SLURM, backend and device.

Import this module before DeepSpeed: without CUDA it sets ``DS_ACCELERATOR=cpu`` so DeepSpeed
selects its CPU accelerator (gloo) instead of failing to find a GPU.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import sys
import warnings
from dataclasses import dataclass

import torch

from llmtrain.config.schema import PROCESS_GROUP_TIMEOUT_S
from llmtrain.common.errors import LaunchError  # raised here; also importable as distributed.LaunchError


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


if not _cuda_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _ops_cache_per_version() -> None:
    """Keep DeepSpeed's JIT-compiled ops (cpu_adam, shm_comm, ...) in a folder of their own per
    Python, torch and DeepSpeed version and venv (a hash of ``sys.prefix``) under llmtrain's cache, unless ``TORCH_EXTENSIONS_DIR`` is
    set. torch's default, ``~/.cache/torch_extensions/py311_cpu``, is shared by every venv of the
    machine: a venv with another torch or DeepSpeed found the others' ops stale and rebuilt them
    under the folder's lock, minutes of silence at every start-up."""
    from importlib.metadata import PackageNotFoundError, version

    from llmtrain.common.paths import CACHE_DIR

    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    try:
        deepspeed_version = version("deepspeed")
    except PackageNotFoundError:
        return
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    # The build files name the venv's include paths: two venvs of the same versions sharing a folder
    # still rebuilt each other's ops at every switch, so the folder is per venv too.
    venv = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:8]
    os.environ["TORCH_EXTENSIONS_DIR"] = str(
        CACHE_DIR / "torch_extensions" / f"{python}-torch{torch.__version__}-deepspeed{deepspeed_version}-{venv}")


_ops_cache_per_version()

import torch.distributed as dist  # noqa: E402

# DeepSpeed calls collectives that torch 2.13 renamed; the warning repeats every step.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).* is deprecated",
                        category=FutureWarning)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: ``rank`` of ``world_size`` processes, ``local_rank`` on its node."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as err:
        raise LaunchError(f"environment variable {name}={value!r} must be an integer") from err


def adopt_submitit_environment() -> bool:
    """Inside a submitit job (``SUBMITIT_EXECUTOR`` set, as hydra-submitit-launcher's tasks are)
    of several tasks and without a launcher's ``RANK``: export RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR (the job's first host) and MASTER_PORT (drawn from the job id,
    the same in every task and after a requeue) from submitit's job environment, as
    ``submitit.helpers.TorchDistributedEnvironment`` does, so the tasks are torch.distributed
    ranks. Returns whether it did."""
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    job = JobEnvironment()
    if job.num_tasks <= 1:
        return False
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)  # each rank picks cuda:LOCAL_RANK
    if job.global_rank != 0:
        # Until the trainer's preemption handler takes the signal over: submitit's handler
        # requeues from the first task only and returns elsewhere, which would leave this task
        # waiting for a first task that has gone (the local executor restarts once all exited).
        signal.signal(getattr(signal, scheduler_signal() or "SIGUSR2"), signal.SIG_DFL)
    return True


def scheduler_signal() -> str | None:
    """The signal submitit's job environment forwards before a time limit or on preemption
    (``SUBMITIT_PREEMPT_SIGNAL``, default ``SIGUSR2``) inside a submitit job, else None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return name if name.startswith("SIG") else f"SIG{name}"


def init_distributed(timeout_s: float = PROCESS_GROUP_TIMEOUT_S, need_group: bool = False) -> DistEnv:
    """Initialise torch.distributed from the launcher's environment (idempotent).

    torchrun and ``accelerate launch`` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT. Without them the run is a single process; it gets a one-rank process group
    (in-memory store, no port) only when ``need_group`` (DeepSpeed needs one).
    Backend: nccl with CUDA, gloo otherwise.

    Inside a submitit job the same variables come from its job environment
    (:func:`adopt_submitit_environment`).

    Raises:
        LaunchError: RANK is set without WORLD_SIZE (or the reverse), or RANK >= WORLD_SIZE.
    """
    adopt_submitit_environment()
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    if (rank is None) != (world_size is None):
        raise LaunchError("set both RANK and WORLD_SIZE (torchrun does), or neither for one process")
    rank, world_size = rank or 0, world_size or 1
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGKILL)
    if not 0 <= rank < world_size:
        raise LaunchError(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    local_rank = _int_env("LOCAL_RANK") or 0
    use_cuda = _cuda_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif need_group and not dist.is_initialized():
        # DeepSpeed reads these even for one process.
        for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def die_with_parent(signum: int, leave_if_orphaned: bool = True) -> None:
    """Ask Linux to send ``signum`` to this process when its parent dies (``PR_SET_PDEATHSIG``;
    kept across ``exec``), and leave at once if the parent died before the request took effect
    (unless ``leave_if_orphaned`` is False: a guard that must act on that death sees it itself).
    torchrun starts workers in their own session, so killing the launcher's process group leaves
    them running (and racing a restarted run): workers ask for SIGKILL, which the checkpoint
    protocol makes a clean crash. A task evaluation (``preexec_fn`` of its process) asks for
    SIGTERM, which lets it remove its temporary export."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if leave_if_orphaned and os.getppid() != launcher:  # the launcher died before the request took effect
        os._exit(1)


def is_initialized() -> bool:
    """Whether a torch.distributed process group is up (False also where torch was built
    without distributed support): collectives are no-ops for one process without a group."""
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in place (no-op for one process); returns it."""
    if is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of a tensor over all ranks, in place (no-op for one process)."""
    if is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_gather_objects(value: object) -> list[object]:
    """Every rank's ``value`` (picklable, written by this program itself), in rank order; ``[value]``
    for one process."""
    if not is_initialized():
        return [value]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_objects(value: object) -> list[object] | None:
    """Every rank's ``value`` (picklable, written by this program itself) on rank 0, in rank order;
    None on the other ranks; ``[value]`` for one process. Collective call."""
    if not is_initialized():
        return [value]
    out: list[object] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def derived_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts`` (e.g. the run's seed and a rank's coordinates):
    SHA-256 of their ``/``-joined text, so distinct coordinates get unrelated streams."""
    import hashlib

    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def shutdown() -> None:
    if is_initialized():
        dist.destroy_process_group()
