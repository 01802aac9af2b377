"""streamsvc/metrics.py, what the process holds: a process's memory, fds and threads read off /proc (a made-up one
and this one), and the gauges /metrics shows: the process collector's, the server's threads, the encoder children's
sums, CUDA memory."""

import os
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry

from streamsvc.metrics import Metrics, ProcessFigures, ProcessGauges, read_process

LINUX = os.path.exists("/proc/self/status")


def fake_proc(root, pid: int, rss_kb: int, threads: int, fds: int):
    """A /proc with one process `pid` (status and fd entries)."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "status").write_text(f"Name:\tx264\nVmPeak:\t 9 kB\nVmRSS:\t {rss_kb} kB\nThreads:\t{threads}\nPid:\t{pid}\n")
    for i in range(fds):
        (d / "fd" / str(i)).write_text("")


def test_read_process_reads_rss_threads_and_fds_from_proc(tmp_path):
    fake_proc(tmp_path, 41, rss_kb=2048, threads=3, fds=5)
    assert read_process(41, tmp_path) == ProcessFigures(rss_bytes=2048 * 1024, open_fds=5, threads=3)
    assert read_process(42, tmp_path) is None  # gone
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "status").write_text("Name:\tx\n")  # no VmRSS (a zombie): unreadable, not zero
    assert read_process(43, tmp_path) is None


def test_the_gauges_sum_the_encoder_children_and_skip_the_gone(tmp_path):
    fake_proc(tmp_path, os.getpid(), rss_kb=100_000, threads=7, fds=20)
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Threads:\t7\n")
    fake_proc(tmp_path, 11, rss_kb=1000, threads=2, fds=4)
    fake_proc(tmp_path, 12, rss_kb=3000, threads=1, fds=6)
    r = CollectorRegistry()
    gauges = ProcessGauges(r, proc=tmp_path)
    gauges.refresh([11, 12, 13])  # 13 is gone
    value = r.get_sample_value
    assert value("streamsvc_process_threads") == 7
    assert value("streamsvc_encoder_processes") == 2
    assert value("streamsvc_encoder_rss_bytes") == 4000 * 1024
    assert value("streamsvc_encoder_open_fds") == 10 and value("streamsvc_encoder_threads") == 3
    assert value("streamsvc_cuda_memory_allocated_bytes") is None  # no device memory given: none shown
    gauges.refresh([12], device_memory=(5, 9))
    assert value("streamsvc_encoder_processes") == 1 and value("streamsvc_encoder_rss_bytes") == 3000 * 1024
    assert value("streamsvc_cuda_memory_allocated_bytes") == 5 and value("streamsvc_cuda_memory_reserved_bytes") == 9


def test_without_proc_the_children_are_skipped_with_a_log_line(tmp_path, caplog):
    r = CollectorRegistry()
    gauges = ProcessGauges(r, proc=tmp_path / "none")
    with caplog.at_level("INFO", logger="streamsvc.metrics"):
        gauges.refresh([1, 2])
        gauges.refresh([1, 2])
    assert r.get_sample_value("streamsvc_process_threads") == threading.active_count()
    assert r.get_sample_value("streamsvc_encoder_processes") == 0
    assert sum("not measured" in m for m in caplog.messages) == 1  # once, not every scrape


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_a_real_child_and_this_process_are_read():
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # Python is loaded (not the fork's first instants)
        metrics = Metrics()
        metrics.process.refresh([child.pid])
        value = metrics.registry.get_sample_value
        assert value("process_resident_memory_bytes") > 10e6  # the collector, on the server's own registry
        assert value("process_open_fds") >= 3
        assert value("streamsvc_process_threads") >= threading.active_count()
        assert value("streamsvc_encoder_processes") == 1
        assert 1e6 < value("streamsvc_encoder_rss_bytes") < value("process_resident_memory_bytes") * 10
        assert value("streamsvc_encoder_open_fds") >= 3 and value("streamsvc_encoder_threads") >= 1
    finally:
        child.stdin.close()
        child.wait(10)
        child.stdout.close()
    metrics.process.refresh([child.pid])  # it has exited
    assert metrics.registry.get_sample_value("streamsvc_encoder_processes") == 0
