"""`streamsvc generate --parallel K` (streamsvc/offline.py generate_parallel, streamsvc/engine/group.py): K gloo ranks
on the CPU give one process's frames, and a rank that dies or hangs ends the command with a clear error.

The group runs in this process (rank 0, through the CLI's main()) with K-1 spawned workers. 10 chunks of
the tiny model with a small window (sink 3 + window 6: the ring turns from the fourth chunk on) and a
prompt switch at 3 s (chunk 5, a recache over the turned ring); --dump saves every chunk's latents and
decoded frames, compared with one process's from the same seed and prompt schedule.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from streamsvc.cli import main

RUN = ["generate", "--prompt", "a red ball moving right", "--prompt-at", "3:a blue cube on sand", "--seconds", "7.3",
       "--sink-frames", "3", "--window-frames", "6", "--device", "cpu", "--quiet", "--seed", "5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process's dump for each weights kind (builtin: 4 heads; random tiny: 2), with rank 0's threads (the
    tests' one: the decoder's convolutions round a few pixels differently with another count)."""
    torch.set_num_threads(1)
    out, refs = tmp_path_factory.mktemp("one"), {}
    for weights in ("builtin", "random"):
        assert main(RUN + ["--weights", weights, "-o", str(out / f"{weights}.mp4"),
                           "--dump", str(out / f"{weights}.pt")]) == 0
        refs[weights] = torch.load(out / f"{weights}.pt")
    return refs


@pytest.mark.parametrize("weights, k", [("builtin", 2), ("builtin", 4), ("random", 2)])
def test_k_ranks_give_one_process_frames(tmp_path, capsys, reference, weights, k):
    start = time.monotonic()
    args = RUN + ["--weights", weights, "--parallel", str(k), "--parallel-timeout", "60"]
    assert main(args + ["-o", str(tmp_path / "k.mp4"), "--dump", str(tmp_path / "k.pt")]) == 0
    assert (f"wrote 117 frames (128x128, 16 fps, H.264) to {tmp_path / 'k.mp4'} with {k} ranks"
            in capsys.readouterr().out)
    ref, got = reference[weights], torch.load(tmp_path / "k.pt")
    assert got["latents"].shape == ref["latents"].shape == (10, 16, 3, 16, 16)  # 10 chunks
    lat = (got["latents"] - ref["latents"]).abs().max().item()
    off = (got["frames"] != ref["frames"]).sum().item()
    print(f"\n{weights} k={k}: latents max|diff| {lat:.2e}, frames {off} pixels off ({time.monotonic() - start:.1f} s)")
    assert lat == 0.0 and off == 0


def test_a_degree_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(capsys):
    assert main(RUN + ["--weights", "random", "--parallel", "4", "-o", "/nonexistent/x.mp4"]) == 2
    err = capsys.readouterr().err
    assert "cannot be split over 4 ranks" in err and "use one of 1, 2" in err and "Traceback" not in err
    assert main(RUN + ["--parallel", "3", "-o", "/nonexistent/x.mp4"]) == 2  # the built-in model: 4 heads
    assert "use one of 1, 2, 4" in capsys.readouterr().err
    assert main(RUN + ["--parallel", "2", "--devices", "0,1,2", "-o", "/nonexistent/x.mp4"]) == 2
    assert "--devices 0,1,2: on the CPU every rank runs on the CPU; give the count 2, or 2 different ids from 0, 1" \
        in capsys.readouterr().err


def _workers(pid: int) -> list[int]:
    """The spawned ranks among `pid`'s children (not multiprocessing's resource tracker)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                cmd = open(f"/proc/{child}/cmdline").read()
            except OSError:
                continue
            if "multiprocessing" in cmd and "resource_tracker" not in cmd:
                found.append(child)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how, said", [(signal.SIGKILL, "rank 1 (pid {pid}) killed by SIGKILL"),
                                       (signal.SIGSTOP, "rank 1 (pid {pid}) is stopped")])
def test_a_rank_killed_or_stopped_mid_run_ends_the_command_with_a_clear_error(tmp_path, how, said):
    timeout = 5
    out = tmp_path / "x.mp4"
    run = [a if a != "7.3" else "600" for a in RUN]  # 600 s of video: minutes
    cmd = [sys.executable, "-m", "streamsvc.cli"] + run + ["--weights", "random", "--parallel", "2",
                                                           "--parallel-timeout", str(timeout), "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:  # the group has formed
            time.sleep(0.2)
        assert out.exists(), proc.stderr.read() if proc.poll() is not None else "no output file in 90 s"
        time.sleep(2)  # mid-run
        workers = _workers(proc.pid)
        assert len(workers) == 1
        os.kill(workers[0], how)
        hit = time.monotonic()
        _, err = proc.communicate(timeout=timeout + 30)
        took = time.monotonic() - hit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"\n{how.name}: exit {proc.returncode} after {took:.1f} s: {err.strip().splitlines()[-1]}")
    assert proc.returncode == 1
    assert "streamsvc generate: the group of 2 ranks failed: " + said.format(pid=workers[0]) in err
    assert "Traceback" not in err
    assert took < timeout + 20
    assert not os.path.exists(f"/proc/{workers[0]}") or open(f"/proc/{workers[0]}/stat").read().split()[2] == "Z"
