"""`serve --cluster local --gpus 2 --parallel 2` on the CPU: one Ray Serve replica holding 2 (fake) GPUs serves
a stream through its group of 2 gloo ranks; SIGKILLed, the replica takes its rank with it, and Serve's
replacement forms a group of its own. One Ray instance, in the server's process (marker `cluster`, slow).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.serve")

from client.loadtest import free_port, http_status  # noqa: E402
from tests.streamsvc.test_parallel_start import _gone  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += map(int, open(f"/proc/{pid}/task/{task}/children").read().split())
    except OSError:
        pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for c in _children(todo.pop()):
            found.append(c)
            todo.append(c)
    return found


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def _replicas_and_ranks(server: int) -> dict[int, list[int]]:
    """The engine replicas among the server's descendants (Ray's workers), each with its spawned ranks."""
    return {p: [c for c in _children(p) if "multiprocessing.spawn" in _cmd(c)]
            for p in _descendants(server) if _cmd(p).startswith("ray::ServeReplica")}


def _wait(predicate, limit_s: float):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if (got := predicate()):
            return got
        time.sleep(0.2)
    return predicate()


async def _chunks(port: int, n: int) -> int:
    import websockets

    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "prompt": "a red ball", "seed": 1}))
        got = 0
        while got < n:
            msg = await asyncio.wait_for(ws.recv(), 30)
            if isinstance(msg, bytes):
                got += 1
            else:
                assert json.loads(msg)["type"] not in ("error", "closed"), msg
        return got


def test_a_replica_serves_through_its_group_and_its_ranks_die_with_it():
    port = free_port()
    cmd = [sys.executable, "-m", "streamsvc.cli", "serve", "--cluster", "local", "--gpus", "2", "--parallel", "2",
           "--weights", "random", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: http_status(f"http://127.0.0.1:{port}/healthz", 1) == 200, 120), "no gateway"
        groups = _wait(lambda: {r: k for r, k in _replicas_and_ranks(proc.pid).items() if k}, 60)
        assert len(groups) == 1 and all(len(k) == 1 for k in groups.values()), groups  # 1 replica, its rank 1
        [(replica, [rank])] = groups.items()
        env = open(f"/proc/{rank}/environ").read().split("\0")
        assert {"NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"} <= set(env)
        assert asyncio.run(_chunks(port, 3)) == 3
        os.kill(replica, signal.SIGKILL)
        assert _wait(lambda: _gone(rank), 10), f"rank {rank} outlived its replica"
        # Serve's replacement forms its own group (its GPUs, here its CPU, free)
        again = _wait(lambda: {r: k for r, k in _replicas_and_ranks(proc.pid).items() if k and r != replica}, 90)
        assert len(again) == 1, again
        assert _wait(lambda: http_status(f"http://127.0.0.1:{port}/healthz", 1) == 200, 60)
        assert asyncio.run(_chunks(port, 2)) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
