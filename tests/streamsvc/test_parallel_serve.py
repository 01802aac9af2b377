"""`streamsvc serve --parallel 2` on the CPU (streamsvc/engine/lockstep.py): streams play through a group of two gloo
ranks, and a rank killed or stopped mid-stream ends the group's streams with `worker_lost` within the
collective timeout; then /healthz answers 503 and a start is refused with the reason. Nothing hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import websockets

from tests.streamsvc.test_parallel_cli import _workers

TIMEOUT = 5  # --parallel-timeout


def _healthz(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


async def _start(port: int, prompt: str) -> tuple[websockets.ClientConnection, dict]:
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None)
    await ws.send(json.dumps({"type": "start", "prompt": prompt, "seed": 1}))
    while True:
        msg = await asyncio.wait_for(ws.recv(), 30)
        if isinstance(msg, str):
            return ws, json.loads(msg)


async def _until_error(ws, limit_s: float) -> tuple[dict, int]:
    chunks = 0
    async with asyncio.timeout(limit_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                chunks += 1
            elif json.loads(msg)["type"] == "error":
                return json.loads(msg), chunks


def _launch() -> tuple[subprocess.Popen, int, int]:
    """A server with --parallel 2 on the CPU: (its process, its port, its worker's pid)."""
    cmd = [sys.executable, "-m", "streamsvc.cli", "serve", "--device", "cpu", "--weights", "random", "--port", "0",
           "--parallel", "2", "--parallel-timeout", str(TIMEOUT)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port, deadline, lines = None, time.monotonic() + 120, []
    try:
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines[-20:])
            lines.append(line)
            if m := re.search(r"serving on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
        assert port and _healthz(port) == 200
        [worker] = _workers(proc.pid)
    except BaseException:
        _stop(proc, None)
        raise
    return proc, port, worker


def _stop(proc: subprocess.Popen, worker: int | None) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if worker is not None:  # gone with the server, stopped or not
        time.sleep(1)
        assert not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split()[2] == "Z"


async def _chunks(ws, n: int) -> int:
    """The next n chunks' arrival; fails on an error message."""
    got = 0
    while got < n:
        msg = await asyncio.wait_for(ws.recv(), 15)
        if isinstance(msg, bytes):
            got += 1
        else:
            assert json.loads(msg)["type"] not in ("error", "closed"), msg
    return got


async def _reply(ws, kind: str) -> dict:
    """The next text message of type `kind` (chunks and others skipped)."""
    while True:
        msg = await asyncio.wait_for(ws.recv(), 15)
        if isinstance(msg, str):
            msg = json.loads(msg)
            assert msg["type"] != "error", msg
            if msg["type"] == kind:
                return msg


@pytest.mark.slow
def test_a_stream_steers_pauses_and_resumes_through_the_group_and_an_idle_group_notices_a_lost_rank():
    """Pause parks the stream on both ranks, resume restores both (streamsvc/engine/lockstep.py replays park and
    restore); then, with no stream open, a killed rank is noticed by the ping: /healthz 503."""
    proc, port, worker = _launch()
    try:
        async def scenario():
            ws, ready = await _start(port, "a red ball")
            assert ready["type"] == "ready"
            await _chunks(ws, 2)
            await ws.send(json.dumps({"type": "set_prompt", "prompt": "a blue cube"}))
            assert (await _reply(ws, "ack"))["prompt_version"] == 1
            await _chunks(ws, 3)
            await ws.send(json.dumps({"type": "pause"}))
            await _reply(ws, "ack")
            await asyncio.sleep(2)
            await ws.send(json.dumps({"type": "resume"}))
            await _reply(ws, "ack")
            await _chunks(ws, 4)
            await ws.close()

        asyncio.run(scenario())
        time.sleep(1)
        os.kill(worker, signal.SIGKILL)
        hit = time.monotonic()
        while _healthz(port) == 200 and time.monotonic() - hit < TIMEOUT + 10:
            time.sleep(0.2)
        print(f"\nidle group: /healthz 503 {time.monotonic() - hit:.1f} s after the worker was killed")
        assert _healthz(port) == 503
    finally:
        _stop(proc, worker)


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_rank_lost_mid_stream_ends_the_streams_and_the_server_says_so(how):
    proc, port, worker = _launch()
    try:

        async def scenario():
            a, ready_a = await _start(port, "a red ball")
            b, ready_b = await _start(port, "a blue cube")
            assert ready_a["type"] == ready_b["type"] == "ready"
            for _ in range(3):  # both streams play
                while not isinstance(await asyncio.wait_for(a.recv(), 10), bytes):
                    pass
            os.kill(worker, how)
            hit = time.monotonic()
            (err_a, _), (err_b, _) = await asyncio.gather(_until_error(a, TIMEOUT + 20), _until_error(b, TIMEOUT + 20))
            took = time.monotonic() - hit
            c, refused = await _start(port, "a green star")
            for ws in (a, b, c):
                await ws.close()
            return err_a, err_b, took, refused

        err_a, err_b, took, refused = asyncio.run(scenario())
        print(f"\n{how.name}: streams ended after {took:.1f} s: {err_a['code']}: {err_a['message']}\n"
              f"  start after: {refused['code']}: {refused['message']}")
        assert err_a["code"] == err_b["code"] == "worker_lost"
        said = "killed by SIGKILL" if how is signal.SIGKILL else "is stopped"
        assert f"the group of 2 ranks failed: rank 1 (pid {worker}) {said}" in err_a["message"]
        assert took < TIMEOUT + 15
        assert _healthz(port) == 503
        assert refused["type"] == "error" and refused["code"] == "refused"
        assert "this server cannot generate: the group of 2 ranks failed" in refused["message"]
    finally:
        _stop(proc, worker)
