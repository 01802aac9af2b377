"""This process's threads as the kernel lists them (/proc/self/task): Python's, and the native ones that libraries
start and `threading.enumerate()` does not show (FFmpeg's swscale keeps a pool of as many threads as the host has
cores for each of its contexts). For the tests that a closed stream leaves no thread behind."""

from __future__ import annotations

import os
import threading

import pytest

HAS_PROC = os.path.isdir("/proc/self/task")
needs_proc = pytest.mark.skipif(not HAS_PROC, reason="reads the process's threads from /proc/self/task (Linux)")


def thread_ids() -> set[int]:
    """The kernel's ids of this process's threads now."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def names(ids: set[int]) -> list[str]:
    """`ids` as a reader wants them: a Python thread by its name, a native one as `native <id>`."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    return sorted(python.get(tid, f"native {tid}") for tid in ids)


def python_names(ids: set[int]) -> dict[int, str]:
    """Of `ids`, the Python threads' names by id (the others are native)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id in ids}
