"""A group's start-up and its devices (streamsvc/engine/group.py): a rank that dies or stops while the group starts
is noticed within the collective timeout, not after the 300 s rendezvous; ranks die with the process that
started them (a Ray replica's with it); --devices is checked against what the machine has; --cluster with
--parallel K deploys G/K replicas of K GPUs each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from streamsvc.cli import main
from streamsvc.engine.group import Group, GroupConfig, GroupError, group_devices
from tests.streamsvc.test_parallel_cli import RUN, _workers

TIMEOUT = 5  # --parallel-timeout of these tests


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def failing_build(rank, group, device):
    raise RuntimeError("no weights here")


def sleeper(rank, group, device):
    time.sleep(120)


def test_a_worker_whose_build_fails_is_reported_at_once_with_what_it_raised():
    start = time.monotonic()
    group = Group(GroupConfig(2, ("cpu", "cpu"), timeout_s=30.0), failing_build)
    [pid] = group.pids
    with pytest.raises(GroupError) as err:
        group.wait_ready()  # rank 0 would wait here for the worker's generator
    took = time.monotonic() - start
    print(f"\n{took:.1f} s: {err.value}")
    assert f"the group of 2 ranks failed while starting: rank 1 (pid {pid}) exited with 1 (RuntimeError: no weights " \
           "here)" in str(err.value)
    assert took < 20  # not the 30 s collective timeout, nor the 300 s start-up bound
    assert _gone(pid)


def _kill_first_worker(proc: subprocess.Popen, how: signal.Signals, limit_s: float = 90) -> int:
    """Signal the command's worker as soon as it exists (before it can join the group); its pid."""
    deadline = time.monotonic() + limit_s
    while proc.poll() is None and time.monotonic() < deadline:
        found = _workers(proc.pid)
        if found:
            os.kill(found[0], how)
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no worker appeared (exit {proc.poll()})")


@pytest.mark.slow
@pytest.mark.parametrize("command, how", [("generate", signal.SIGKILL), ("serve", signal.SIGSTOP)])
def test_a_rank_that_dies_or_stops_at_start_up_ends_the_command_within_the_timeout(tmp_path, command, how):
    if command == "generate":
        args = RUN + ["--weights", "random", "-o", str(tmp_path / "x.mp4")]
    else:
        args = ["serve", "--device", "cpu", "--weights", "random", "--port", "0"]
    cmd = [sys.executable, "-m", "streamsvc.cli", *args, "--parallel", "2", "--parallel-timeout", str(TIMEOUT)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        worker = _kill_first_worker(proc, how)
        hit = time.monotonic()
        _, err = proc.communicate(timeout=TIMEOUT + 40)  # before: the 300 s rendezvous
        took = time.monotonic() - hit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = err.strip().splitlines()[-1]
    print(f"\n{command}, worker {how.name} at start: exit {proc.returncode} after {took:.1f} s: {last}")
    said = "killed by SIGKILL" if how is signal.SIGKILL else "is stopped"
    assert proc.returncode == 1
    assert last.startswith(f"streamsvc {command}: the group of 2 ranks failed while starting: rank 1 (pid {worker}) {said}")
    assert took < TIMEOUT + 20
    time.sleep(0.5)
    assert _gone(worker)


PARENT = """
import sys, threading, time
sys.path.insert(0, {root!r})
from streamsvc.engine.group import Group, GroupConfig
from tests.streamsvc.test_parallel_start import sleeper

def start():  # from another thread, as the engine's (or a Ray replica's engine's) thread does
    group = Group(GroupConfig(2, ("cpu", "cpu"), timeout_s=30.0), sleeper)
    print(group.pids[0], flush=True)
    time.sleep(120)

threading.Thread(target=start).start()
"""


@pytest.mark.slow
def test_a_group_s_ranks_die_with_the_process_that_started_them():
    """What frees a Ray replica's GPUs when Ray kills it: its ranks get SIGKILL when it dies (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARENT).format(root=os.getcwd())],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert not _gone(worker)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_rank_whose_parent_is_already_gone_exits_at_once():
    """The parent-death signal is armed in the child: a parent that died before that leaves no orphan."""
    code = "from streamsvc.engine.group import die_with_parent; die_with_parent({}); print('armed')"
    here = subprocess.run([sys.executable, "-c", code.format("__import__('os').getppid()")], capture_output=True,
                          text=True, timeout=60)
    assert here.returncode == 0 and here.stdout.strip() == "armed"
    gone = subprocess.run([sys.executable, "-c", code.format(os.getpid() + 10**6)], capture_output=True, text=True,
                          timeout=60)
    assert gone.returncode == 1 and gone.stdout == ""


# ---------------------------------------------------------------------------------------------- devices


@pytest.fixture
def gpus(monkeypatch):
    """A machine with n GPUs, as torch sees it (nothing is run on them)."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return have


def test_parallel_4_on_8_gpus_without_devices_or_cluster_refuses_with_a_hint(gpus, capsys):
    gpus(8)
    with pytest.raises(ValueError) as err:
        group_devices("auto", 4, None)
    assert str(err.value) == ("--parallel 4 on a machine with 8 GPUs: use --cluster local --gpus 8 to serve 2 groups "
                              "of 4, or --devices to pick 4 (e.g. --devices 0,1,2,3)")
    assert main(RUN + ["--device", "cuda", "--parallel", "4", "-o", "/nonexistent/x.mp4"]) == 2
    assert "--parallel 4 on a machine with 8 GPUs: use --cluster local --gpus 8" in capsys.readouterr().err
    assert main(["serve", "--device", "cuda", "--parallel", "4", "--port", "0"]) == 2  # before any engine starts
    assert "--parallel 4 on a machine with 8 GPUs: use --cluster local --gpus 8" in capsys.readouterr().err
    gpus(6)
    with pytest.raises(ValueError, match="use --cluster local --gpus 4 to serve 1 groups of 4, or --devices"):
        group_devices("cuda", 4, None)


def test_devices_picks_the_group_s_gpus_and_names_the_allowed_ones(gpus):
    gpus(8)
    assert group_devices("auto", 4, "4,5,6,7") == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    assert group_devices("cuda", 2, "cuda:3, 1") == ("cuda:3", "cuda:1")
    with pytest.raises(ValueError, match=r"^--devices 0,8: this machine's GPUs are 0, 1, 2, 3, 4, 5, 6, 7; name 2 of "
                                         r"them \(e\.g\. --devices 0,1\)$"):
        group_devices("cuda", 2, "0,8")
    with pytest.raises(ValueError, match=r"^--devices 1,1: a group's GPUs must differ"):
        group_devices("cuda", 2, "1,1")
    with pytest.raises(ValueError, match=r"^--devices names 3 devices but --parallel is 2: name one per rank "
                                         r"\(this machine's GPUs are 0, 1, 2, 3, 4, 5, 6, 7\)$"):
        group_devices("cuda", 2, "0,1,2")
    with pytest.raises(ValueError, match="^--parallel 4 needs 4 GPUs, this machine has 2$"):
        gpus(2)
        group_devices("cuda", 4, None)


def test_on_the_cpu_devices_takes_the_count_or_one_id_per_rank(gpus):
    gpus(0)
    for given in ("2", "0,1", "1,0", "cpu,cpu", None):
        assert group_devices("auto", 2, given) == ("cpu", "cpu")
    assert group_devices("cpu", 4, "4") == ("cpu",) * 4
    for bad in ("3", "0,2", "0,0", "0,1,2", "gpu,0"):
        with pytest.raises(ValueError, match=rf"^--devices {bad}: on the CPU every rank runs on the CPU; give the "
                                             r"count 2, or 2 different ids from 0, 1 \(one per rank of --parallel 2\), "
                                             r"or leave it out$"):
            group_devices("cpu", 2, bad)


# ---------------------------------------------------------------------------------------------- cluster


def test_a_cluster_of_groups_deploys_g_over_k_replicas_of_k_gpus(capsys):
    from models.parallel import PARALLEL_ENV
    from streamsvc.cluster.launch import DeployConfig, actor_options, group_replicas

    assert group_replicas(8, 4) == (2, 4.0)
    assert actor_options(DeployConfig(replicas=2, num_gpus=4.0)) == {
        "num_gpus": 4.0, "num_cpus": 1.0, "runtime_env": {"env_vars": PARALLEL_ENV}}  # multicast off, any cluster
    assert actor_options(DeployConfig(replicas=2)) == {"num_gpus": 1.0, "num_cpus": 1.0}
    assert group_replicas(2, 1) == (2, 1.0)
    assert group_replicas(0, 4) == (0, 4.0)  # --gpus 0: attach to the running replicas
    with pytest.raises(ValueError, match=r"^--gpus 6 does not split into groups of --parallel 4: each replica holds 4 "
                                         r"GPUs, so --gpus must be a multiple of 4 \(4, 8, 12, \.\.\.\)$"):
        group_replicas(6, 4)
    with pytest.raises(ValueError, match="^--devices 0,1 with --cluster: Ray gives each replica its GPUs"):
        group_replicas(4, 2, "0,1")
    # refused before Ray starts (exit 2, one line)
    assert main(["serve", "--cluster", "local", "--gpus", "6", "--parallel", "4", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("streamsvc serve: --gpus 6 does not split into groups of --parallel 4: each replica holds 4 "
                           "GPUs, so --gpus must be a multiple of 4 (4, 8, 12, ...)")
