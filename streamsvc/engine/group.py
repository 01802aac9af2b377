"""A group of K processes, one per device, that runs one stream's forwards split K ways (`--parallel K`).

This process is rank 0: it runs the command (writes the file, or serves). It spawns ranks 1..K-1 as
workers, which build the same sharded generator and make the same generator calls in the same order
(models/parallel.py: every forward is a collective). Prompts are encoded on rank 0 only and their
embeddings broadcast; chunks are decoded on rank 0 only.

Start-up: rank 0 never waits in a rendezvous or a barrier for a rank that is gone. Each worker marks in
the group's directory that it is joining, and later that it has built its generator (`worker_ready`); rank
0 polls for the marks (`Group.__init__`, `Group.wait_ready`) and, meanwhile, for a worker that exited or
stayed stopped (SIGSTOP) past `timeout_s`: then `GroupError` says which and how, within about `timeout_s`,
however long a healthy rank takes to load its weights (at most START_TIMEOUT_S).

Failure: the group's collectives time out after `timeout_s` (gloo's default is 30 minutes), so a rank
that dies or hangs (SIGKILL, SIGSTOP) makes rank 0's next collective raise within that; `GroupError`
then says which rank and how (`Group.describe_failure`). Workers die with rank 0: a parent-death signal
(PR_SET_PDEATHSIG, SIGKILL) armed before anything else, so a Ray replica's ranks die with it and its
replacement finds their devices free.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from models.parallel import init_rank, parallel_env

log = logging.getLogger("streamsvc.group")

START_TIMEOUT_S = 300.0  # at most this for a live rank to join and to build its generator (loading weights)
POLL_S = 0.05  # how often rank 0 looks at its starting workers
DEATH_GRACE_S = 2.0  # a failed collective: how long the dead rank may take to be seen gone (a loaded host)


class GroupError(RuntimeError):
    """The group cannot go on: a rank died, hung or failed. The text says which and how."""


@dataclass(frozen=True)
class GroupConfig:
    size: int  # K ranks, this process being rank 0
    devices: tuple[str, ...]  # rank r's device: devices[r] ("cpu" for every rank on the CPU)
    timeout_s: float = 15.0  # a collective waiting longer fails: a rank died or hung
    backend: str = field(init=False, default="gloo")  # gloo on CPU, nccl on GPUs

    def __post_init__(self) -> None:
        if self.size < 1 or len(self.devices) != self.size:
            raise ValueError(f"a group of {self.size} ranks needs {self.size} devices, got {list(self.devices)}")
        if self.timeout_s <= 0:
            raise ValueError(f"--parallel-timeout must be positive, got {self.timeout_s:g}")
        kinds = {torch.device(d).type for d in self.devices}
        if len(kinds) != 1:
            raise ValueError(f"a group's devices must all be CPUs or all GPUs, got {list(self.devices)}")
        if kinds == {"cuda"} and len(set(self.devices)) != self.size:
            raise ValueError(f"a group's GPUs must differ, got {list(self.devices)}")
        object.__setattr__(self, "backend", "nccl" if kinds == {"cuda"} else "gloo")


def group_devices(device: str, parallel: int, devices: str | None) -> tuple[str, ...]:
    """Rank r's device for `--device` / `--parallel` / `--devices`. On GPUs --devices lists K distinct GPU
    indices (or cuda:N) of this machine; without it the machine must have exactly K GPUs (more: a hint).
    On the CPU every rank runs on the CPU: --devices may give the count K, or K distinct ids from 0..K-1
    (or 'cpu' each). A bad value is a ValueError naming the allowed ones."""
    kind = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)).type
    names = [d.strip() for d in devices.split(",") if d.strip()] if devices else []
    if kind == "cpu":
        if names:
            _cpu_devices(parallel, names, devices)
        return ("cpu",) * parallel
    count = torch.cuda.device_count()
    if names:
        return _gpu_devices(parallel, names, devices, count)
    if count < parallel:
        raise ValueError(f"--parallel {parallel} needs {parallel} GPUs, this machine has {count}")
    if count > parallel:
        groups = f"--cluster local --gpus {count} to serve {count // parallel} groups of {parallel}" \
            if count % parallel == 0 else f"--cluster local --gpus {count - count % parallel} to serve " \
            f"{count // parallel} groups of {parallel}"
        raise ValueError(f"--parallel {parallel} on a machine with {count} GPUs: use {groups}, or --devices to pick "
                         f"{parallel} (e.g. --devices {','.join(map(str, range(parallel)))})")
    return tuple(f"cuda:{r}" for r in range(parallel))


def _cpu_devices(parallel: int, names: list[str], given: str) -> None:
    """Check --devices on the CPU: the count, or one id (0..K-1, or 'cpu') per rank."""
    ids = [n.removeprefix("cpu:") for n in names]
    if len(names) == 1 and names[0] == str(parallel):
        return
    if len(names) == parallel and (all(n == "cpu" for n in names) or (
            all(i.isdigit() and int(i) < parallel for i in ids) and len(set(map(int, ids))) == parallel)):
        return
    raise ValueError(f"--devices {given}: on the CPU every rank runs on the CPU; give the count {parallel}, or "
                     f"{parallel} different ids from {', '.join(map(str, range(parallel)))} (one per rank of "
                     f"--parallel {parallel}), or leave it out")


def _gpu_devices(parallel: int, names: list[str], given: str, count: int) -> tuple[str, ...]:
    """Check --devices on GPUs: one GPU of this machine (an index, or cuda:N) per rank, all different."""
    allowed = f"this machine's GPUs are {', '.join(map(str, range(count)))}" if count else "this machine has no GPU"
    ids = [n.removeprefix("cuda:") for n in names]
    if len(names) != parallel:
        raise ValueError(f"--devices names {len(names)} devices but --parallel is {parallel}: name one per rank "
                         f"({allowed})")
    if not all(i.isdigit() and int(i) < count for i in ids):
        raise ValueError(f"--devices {given}: {allowed}; name {parallel} of them (e.g. --devices "
                         f"{','.join(map(str, range(min(parallel, max(count, 1)))))})")
    if len(set(map(int, ids))) != parallel:
        raise ValueError(f"--devices {given}: a group's GPUs must differ ({allowed})")
    return tuple(f"cuda:{int(i)}" for i in ids)


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so a group never outlives its
    command or its Ray replica. `parent` is the pid it was started by: if that one is already gone (it died
    before the signal was armed), exit now."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


_start_dir: str | None = None  # a worker's: its group's directory (where it marks its start-up)


def _mark(directory: str, what: str, rank: int) -> None:
    with open(os.path.join(directory, f"{what}.{rank}"), "w"):
        pass


def worker_ready(group: dist.ProcessGroup) -> None:
    """A worker has built its generator: mark it for rank 0 (`Group.wait_ready`), then meet the group."""
    if _start_dir is not None:
        _mark(_start_dir, "ready", dist.get_rank())
    dist.barrier(group=group)


def _worker(index: int, size: int, init: str, cfg: GroupConfig, target: Callable, args: tuple, parent: int) -> None:
    global _start_dir
    rank = index + 1
    die_with_parent(parent)
    parallel_env()  # (inherited from rank 0 already: a worker's own collectives must not depend on that)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if cfg.backend == "nccl":
        torch.cuda.set_device(torch.device(cfg.devices[rank]))
    _start_dir = os.path.dirname(init.removeprefix("file://"))
    _mark(_start_dir, "joining", rank)
    init_rank(rank, size, init, cfg.backend, timeout_s=START_TIMEOUT_S)
    try:
        group = dist.new_group(list(range(size)), timeout=timedelta(seconds=cfg.timeout_s))
        target(rank, group, cfg.devices[rank], *args)
    finally:
        dist.destroy_process_group()


class Group:
    """Rank 0's handle on a running group: its process group (short timeout) and the worker processes."""

    def __init__(self, cfg: GroupConfig, target: Callable, args: tuple = ()) -> None:
        """Spawn ranks 1..K-1, each running target(rank, group, device, *args), and join as rank 0."""
        import torch.multiprocessing as mp

        self.cfg = cfg
        self._dir = tempfile.TemporaryDirectory(prefix="streamsvc-group-")
        init = f"file://{self._dir.name}/init"
        parallel_env()  # inherited by the workers
        self.ctx = mp.start_processes(_worker, args=(cfg.size, init, cfg, target, args, os.getpid()),
                                      nprocs=cfg.size - 1, join=False, daemon=True,
                                      start_method="spawn") if cfg.size > 1 else None
        try:
            self._await("joining", "join the group")  # every worker is alive and about to join: no long wait
            init_rank(0, cfg.size, init, cfg.backend, timeout_s=cfg.timeout_s)
            self.group = dist.new_group(list(range(cfg.size)), timeout=timedelta(seconds=cfg.timeout_s))
        except GroupError:
            self.close(kill=True)
            raise
        except Exception as e:
            failure = self.describe_failure(e, "while starting")
            self.close(kill=True)
            raise GroupError(failure) from e

    def wait_ready(self) -> None:
        """Wait until every worker has built its generator (`worker_ready`) and meet them. Raises GroupError,
        the workers killed, as soon as one has exited, once one stayed stopped past the collective timeout,
        or when one has not finished within START_TIMEOUT_S."""
        try:
            self._await("ready", "build its generator")
            dist.barrier(group=self.group)
        except GroupError:
            self.close(kill=True)
            raise
        except RuntimeError as e:  # the barrier failed: a rank died between its mark and the barrier
            failure = self.describe_failure(e, "while starting")
            self.close(kill=True)
            raise GroupError(failure) from e

    def _await(self, what: str, doing: str) -> None:
        """Poll until every worker has marked `what`; GroupError when one is gone, stopped or too slow."""
        deadline = time.monotonic() + START_TIMEOUT_S
        stopped_since: dict[int, float] = {}
        for rank, p in enumerate(self.ctx.processes if self.ctx else [], start=1):
            while not os.path.exists(os.path.join(self._dir.name, f"{what}.{rank}")):
                now = time.monotonic()
                if any(q.exitcode is not None for q in self.ctx.processes):
                    raise GroupError(self.describe_failure(None, "while starting"))
                for r, q in enumerate(self.ctx.processes, start=1):
                    if _stopped(q.pid):
                        if now - stopped_since.setdefault(r, now) > self.cfg.timeout_s:
                            raise GroupError(self.describe_failure(None, "while starting"))
                    else:
                        stopped_since.pop(r, None)
                if now > deadline:
                    raise GroupError(self.describe_failure(None, "while starting") + f"; rank {rank} (pid {p.pid}) "
                                     f"did not {doing} within {START_TIMEOUT_S:g} s")
                time.sleep(POLL_S)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids: rank r's is pids[r - 1]."""
        return [p.pid for p in self.ctx.processes] if self.ctx else []

    def describe_failure(self, error: BaseException | None = None, when: str = "") -> str:
        """Which ranks are gone or stopped, and the collective's error. A collective that failed (`error`) may have
        failed on the dead rank's socket before the kernel had it reaped: then the ranks are looked at again for up
        to DEATH_GRACE_S before "no rank is known to be gone" is said."""
        said = self._gone()
        deadline = time.monotonic() + DEATH_GRACE_S
        while not said and error is not None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            said = self._gone()
        what = "; ".join(said) or "no rank is known to be gone: one hung or failed"
        detail = f" ({type(error).__name__}: {str(error).splitlines()[0][:200]})" if error is not None and str(error) else ""
        when = f" {when}" if when else ""
        return (f"the group of {self.cfg.size} ranks failed{when}: {what}; a collective waits {self.cfg.timeout_s:g} s at most "
                f"(--parallel-timeout){detail}")

    def _gone(self) -> list[str]:
        """Each rank that exited, was killed or is stopped, said."""
        said = []
        for rank, p in enumerate(self.ctx.processes if self.ctx else [], start=1):
            if p.exitcode is not None:
                how = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exited with {p.exitcode}"
                how += self._raised(rank)
                said.append(f"rank {rank} (pid {p.pid}) {how}")
            elif _stopped(p.pid):
                said.append(f"rank {rank} (pid {p.pid}) is stopped")
        return said

    def _raised(self, rank: int) -> str:
        """': Error: text', what rank `rank`'s target raised (torch's spawn writes its traceback), or ''."""
        try:
            with open(self.ctx.error_files[rank - 1], "rb") as f:
                lines = [ln for ln in pickle.load(f).splitlines() if ln.strip()]
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, IndexError, TypeError):
            return ""
        return f" ({lines[-1].strip()[:200]})" if lines else ""

    def close(self, kill: bool = False, timeout_s: float = 30.0) -> None:
        """Leave the group; wait for the workers to finish (at most `timeout_s`), then kill any left."""
        if dist.is_initialized():
            if kill:
                self._kill()  # first: a dead group's teardown must not wait on them
            dist.destroy_process_group()
        deadline = time.monotonic() + (0 if kill else timeout_s)
        for p in self.ctx.processes if self.ctx else []:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self._dir.cleanup()

    def _kill(self) -> None:
        for p in self.ctx.processes if self.ctx else []:
            if p.is_alive():
                p.kill()
                p.join()


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
