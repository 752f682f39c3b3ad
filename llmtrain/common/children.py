"""The processes a run starts, stopped whole on every ending and found again by a rerun.

A run starts a child process in a session of its own (``start_new_session=True``: the vLLM API
server with its engine core and workers, a task evaluation), so the child's process group holds
every process it forks. :func:`stop_group` ends that group on every ending, whether its leader is
still alive or not: ``killpg`` reaches a group whose leader has died as long as one member
remains (a vLLM ``EngineCore`` whose API server the OOM killer took), and the kernel does not
hand out a group's id as a new pid while any member lives, so the signal cannot reach an
unrelated process. Shared-memory files (``/dev/shm``) the group's processes hold are removed
after them: a killed process cannot remove its own.

Rank 0 records each child it starts in ``run_dir/.children.json`` (pid, start time, command
line; :func:`remember`) and drops the record once the child is stopped (:func:`forget`). A
trainer killed with SIGKILL cannot stop anything: its children get their parent-death signal,
and a rerun in the same run folder stops whatever of them still runs (:func:`stop_leftovers`),
after checking that the recorded pid is still the process it started (same boot and start time;
the command line is recorded for the reader), so a pid the system has since given to another
process is never signalled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("llmtrain")

RECORD = ".children.json"  # in the run folder: the children of the process that holds its lock
GRACE_S = 30.0  # how long a group has after SIGTERM before SIGKILL, seconds
KILL_WAIT_S = 10.0  # how long SIGKILLed processes have to leave, seconds
POLL_S = 0.05  # how often a wait looks at /proc, seconds
SHM = Path("/dev/shm")


# ---- /proc ----------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """``(state, process group, session, start time in clock ticks after boot)`` of ``pid``, or
    None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[2]), int(fields[3]), int(fields[19])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def members(group: int) -> list[int]:
    """The live processes (zombies left out: they hold nothing but their exit status) whose process
    group or session is ``group``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] not in ("Z", "X") and group in (stat[1], stat[2]):
                found.append(int(entry.name))
    return found


def shm_files(pids: list[int]) -> set[Path]:
    """The ``/dev/shm`` files that ``pids`` have open or mapped."""
    found: set[Path] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if f" {SHM}/" in line:
                    found.add(Path(line[line.index(f" {SHM}/") + 1:].removesuffix(" (deleted)")))
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(f"{SHM}/"):
                    found.add(Path(target.removesuffix(" (deleted)")))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


# ---- stopping -------------------------------------------------------------------------------------
def _signal(group: int, signum: int) -> None:
    """``signum`` to process group ``group`` and to any process of its session outside it."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass  # no member left in the group itself (session members are signalled below)
    for pid in members(group):
        stat = _stat(pid)
        if stat is not None and stat[1] != group:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def _wait_gone(group: int, timeout_s: float, process: Any = None) -> bool:
    """Wait up to ``timeout_s`` seconds for group ``group`` to have no live process (reaping
    ``process``, our child, as it ends); whether it has none."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None:
            process.poll()
        if not members(group):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def stop_group(group: int, process: Any = None, grace_s: float = GRACE_S) -> list[int]:
    """End every process of process group (and session) ``group``: SIGTERM, up to ``grace_s``
    seconds to leave, then SIGKILL and up to ``KILL_WAIT_S`` seconds more; whether or not its
    leader is alive. ``process``: the leader's ``subprocess.Popen``, reaped. The ``/dev/shm``
    files the group held are removed once it is gone. Returns the pids still alive after all
    that (none, unless a process is stuck in the kernel)."""
    shm = shm_files(members(group))  # now: a process that is gone no longer says what it held
    if members(group):
        _signal(group, signal.SIGTERM)
        if not _wait_gone(group, grace_s, process):
            _signal(group, signal.SIGKILL)
            _wait_gone(group, KILL_WAIT_S, process)
    if process is not None:
        try:
            process.wait(timeout=KILL_WAIT_S)
        except Exception:  # noqa: BLE001  (subprocess.TimeoutExpired: a leader stuck in the kernel, reported below)
            pass
    left = members(group)
    if not left:
        for path in shm:
            path.unlink(missing_ok=True)
    return left


# ---- the run folder's record ------------------------------------------------------------------------
def _identity(pid: int) -> dict | None:
    stat = _stat(pid)
    if stat is None:
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return {"start": stat[3], "boot": boot, "cmdline": _cmdline(pid)}


def _read(run_dir: Path) -> list[dict]:
    try:
        records = json.loads((Path(run_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("pid"), int)] if isinstance(records, list) else []


def _write(run_dir: Path, records: list[dict]) -> None:
    path = Path(run_dir) / RECORD
    if not records:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


def remember(run_dir: Path, kind: str, pid: int, **details: Any) -> None:
    """Record child ``pid`` (a session leader) of ``kind`` (``vLLM server``) in ``run_dir``, with
    ``details`` a rerun names (``port``), so a rerun can stop it if this process cannot."""
    identity = _identity(pid)
    if identity is not None:
        _write(run_dir, [*_read(run_dir), {"kind": kind, "pid": pid, **identity, **details}])


def forget(run_dir: Path, pid: int) -> None:
    """Drop ``pid``'s record (:func:`remember`): it has been stopped."""
    records = _read(run_dir)
    if any(r["pid"] == pid for r in records):
        _write(run_dir, [r for r in records if r["pid"] != pid])


def stop(run_dir: Path, process: Any) -> list[int]:
    """Stop the child ``process`` (a ``subprocess.Popen`` that :func:`remember` recorded in
    ``run_dir``) with its whole group (:func:`stop_group`), and drop its record once nothing of it
    is left. Returns the pids still alive (the record stays for a rerun to stop them)."""
    left = stop_group(process.pid, process)
    if not left:
        forget(run_dir, process.pid)
    return left


def _describe(record: dict) -> str:
    details = ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("kind", "pid", "start", "boot", "cmdline"))
    return f"{record.get('kind', 'process')} (pid {record['pid']}{', ' + details if details else ''})"


def stop_leftovers(run_dir: Path, grace_s: float = GRACE_S) -> list[str]:
    """Stop the children a previous process in ``run_dir`` recorded and left running (it was
    killed before it could stop them), each only while its pid is still the process recorded
    (same boot and start time); the caller holds the run folder's lock, so that
    process is gone. A recorded leader that has died is stopped through the members of its group
left alive. Returns one line per child stopped (also logged)."""
    lines = []
    for record in _read(run_dir):
        now = _identity(record["pid"])
        # Boot and start time identify a process (the command line does not: vLLM retitles its processes).
        if now is not None and any(now[k] != record.get(k) for k in ("start", "boot")):
            continue  # the pid is another process's now (and so is any group of that id)
        if record.get("folder"):  # a guard killed with the job (an OOM kill of all) left its folder
            shutil.rmtree(record["folder"], ignore_errors=True)
        if now is None and not members(record["pid"]):
            continue  # ended with all of its group
        # A leader that died leaves its group's id to its members: no new process gets that pid meanwhile.
        left = stop_group(record["pid"], grace_s=grace_s)
        lines.append(f"stopped the {_describe(record)} that the last run in {run_dir} left running"
                     + (f"; pids {left} did not end" if left else ""))
        log.warning("%s", lines[-1])
    _write(run_dir, [])
    return lines


# ---- ports ----------------------------------------------------------------------------------------
def port_holder(port: int) -> str:
    """Who listens on TCP ``port`` of this host, for an error line: ``pid N (COMMAND)``, ``a
    process this user cannot see``, or ``""`` when the port is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(port)))
            return ""
        except OSError:
            pass
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == int(port) and fields[3] == "0A":  # LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
        except (OSError, IndexError, ValueError):
            continue
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return f"pid {entry.name} ({' '.join(_cmdline(int(entry.name)))[:200]})"
        except OSError:
            continue
    return "a process this user cannot see"


def _wait_for_end(parent: int) -> None:
    """Return on SIGTERM, SIGINT or SIGHUP (the parent-death signal the caller set, or a stop), or
    once process ``parent`` is no longer this process's parent (it died: the check covers a
    parent-death signal that never came, e.g. a parent that died before it was set)."""
    signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    while os.getppid() == parent and signal.sigtimedwait(signals, 1.0) is None:
        pass


def guard_group(group: int, parent: int) -> None:
    """Once the parent ends (:func:`_wait_for_end`), end process group ``group`` as a closing run
    does (:func:`stop_group`: SIGTERM, grace, SIGKILL, the group's ``/dev/shm`` files removed). Run
    as ``python -m llmtrain.common.children group GROUP PARENT`` in a session of its own."""
    _wait_for_end(parent)
    stop_group(group)


def guard_folder(folder: Path, parent: int) -> None:
    """Once the parent ends (:func:`_wait_for_end`), remove ``folder`` (weights written to
    ``/dev/shm``, which nothing else would free). Run as ``python -m llmtrain.common.children
    folder PATH PARENT`` in a session of its own."""
    _wait_for_end(parent)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    import sys

    kind, what, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kind == "group":
        guard_group(int(what), parent)
    else:
        guard_folder(Path(what), parent)
