"""A group of K processes, one per device, that runs one stream's forwards split K ways (`--parallel K`).

This process is rank 0: it runs the command (writes the file, or serves). It spawns ranks 1..K-1 as
workers, which build the same sharded generator and make the same generator calls in the same order
(models/parallel.py: every forward is a collective). Prompts are encoded on rank 0 only and their
embeddings broadcast; chunks are decoded on rank 0 only.

Failure: the group's collectives time out after `timeout_s` (gloo's default is 30 minutes), so a rank
that dies or hangs (SIGKILL, SIGSTOP) makes rank 0's next collective raise within that; `GroupError`
then says which rank and how (`Group.describe_failure`). Workers die with rank 0 (a parent-death signal).
"""

from __future__ import annotations

import ctypes
import logging
import os
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

START_TIMEOUT_S = 300.0  # the default group's: spawning and loading weights on K ranks takes a while


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
    """Rank r's device for `--device` / `--parallel` / `--devices` (a comma list of GPU indices or devices)."""
    if devices:
        names = [d.strip() for d in devices.split(",") if d.strip()]
        names = [f"cuda:{d}" if d.isdigit() else d for d in names]
        if len(names) != parallel:
            raise ValueError(f"--devices names {len(names)} devices but --parallel is {parallel}: name one per rank")
        return tuple(names)
    kind = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)).type
    if kind == "cpu":
        return ("cpu",) * parallel
    count = torch.cuda.device_count()
    if count < parallel:
        raise ValueError(f"--parallel {parallel} needs {parallel} GPUs, this machine has {count}")
    if count > parallel:
        raise ValueError(f"--parallel {parallel} on a machine with {count} GPUs: say which with --devices "
                         f"(e.g. --devices {','.join(map(str, range(parallel)))}), or serve several groups with --cluster")
    return tuple(f"cuda:{r}" for r in range(parallel))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (rank 0) dies, so a group never outlives its command."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker(index: int, size: int, init: str, cfg: GroupConfig, target: Callable, args: tuple) -> None:
    rank = index + 1
    _die_with_parent()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if cfg.backend == "nccl":
        torch.cuda.set_device(torch.device(cfg.devices[rank]))
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
        self.ctx = mp.start_processes(_worker, args=(cfg.size, init, cfg, target, args), nprocs=cfg.size - 1,
                                      join=False, daemon=True, start_method="spawn") if cfg.size > 1 else None
        try:
            init_rank(0, cfg.size, init, cfg.backend, timeout_s=START_TIMEOUT_S)
            self.group = dist.new_group(list(range(cfg.size)), timeout=timedelta(seconds=cfg.timeout_s))
        except Exception:
            self.close(kill=True)
            raise

    @property
    def pids(self) -> list[int]:
        """The workers' process ids: rank r's is pids[r - 1]."""
        return [p.pid for p in self.ctx.processes] if self.ctx else []

    def describe_failure(self, error: BaseException | None = None) -> str:
        """Which ranks are gone or stopped, and the collective's error."""
        said = []
        for rank, p in enumerate(self.ctx.processes if self.ctx else [], start=1):
            if p.exitcode is not None:
                how = f"killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exited with {p.exitcode}"
                said.append(f"rank {rank} (pid {p.pid}) {how}")
            elif _stopped(p.pid):
                said.append(f"rank {rank} (pid {p.pid}) is stopped")
        what = "; ".join(said) or "no rank is known to be gone: one hung or failed"
        detail = f" ({type(error).__name__}: {str(error).splitlines()[0][:200]})" if error is not None and str(error) else ""
        return (f"the group of {self.cfg.size} ranks failed: {what}; a collective waits {self.cfg.timeout_s:g} s at most "
                f"(--parallel-timeout){detail}")

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
