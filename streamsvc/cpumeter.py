"""CPU time the event loop spends on clients without a stream, counted apart (issue 33).

Admission charges the event loop's CPU to the chunks it sends (the SEND stage), and on a CPU
device a forward's wall time to the device. Work done for clients that hold no stream (HTTP
requests such as `GET /metrics`, a connection's messages before `start` or `watch`, refused
starts) is neither: once it was charged to the first chunks sent, and a flood of junk frames on
a fresh server made it refuse every stream. The server meters that work where it enters our
code (a `CpuMeter`); the cost samples leave it out (streamsvc/scheduling/costs.py), and
/metrics shows it (`streamsvc_streamless_cpu_seconds`).

What the meter sees is the CPU of our handlers on the loop's thread (`time.thread_time`): a
synchronous section (`measure`), or every step of a coroutine taken while it has no stream
(`run`, which leaves out the time it spends suspended, when other tasks run). What it cannot
see is the library's work before our code is called: parsing the frames and the requests, the
handshake. The costs module treats a sample where the metered work was large as unusable for
that reason.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

__all__ = ["CpuMeter"]

T = TypeVar("T")


class CpuMeter:
    """Cumulative CPU seconds charged to one kind of work. Thread-safe: the event loop charges, the engine thread
    reads (a CPU forward's sample leaves out what ran meanwhile)."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock  # the CPU clock of the calling thread (tests inject one)
        self._lock = threading.Lock()
        self._seconds = 0.0

    @property
    def seconds(self) -> float:
        """CPU seconds charged so far."""
        with self._lock:
            return self._seconds

    def charge(self, seconds: float) -> None:
        """Add `seconds` of CPU (negative readings of a clock going backwards count as 0)."""
        if seconds > 0:
            with self._lock:
                self._seconds += seconds

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Charge the CPU of the enclosed synchronous code (it must not await)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.charge(self.clock() - t0)

    async def run(self, coro: Coroutine[Any, Any, T], charging: Callable[[], bool]) -> T:
        """Await `coro`, charging the CPU of each of its steps (from one suspension to the next) that begins while
        `charging()` is true; the time it spends suspended, when other tasks run, is not its own and is not
        charged. Cancellation and errors pass through as if `coro` were awaited directly."""
        return await _metered(coro, self, charging)


@types.coroutine
def _metered(coro: Coroutine[Any, Any, T], meter: CpuMeter, charging: Callable[[], bool]) -> Generator[Any, Any, T]:
    """Drive `coro` as `await coro` would (what it yields goes to the task, what the task sends or throws goes to
    it), timing each step."""
    value: Any = None
    error: BaseException | None = None
    while True:
        charge = charging()
        t0 = meter.clock()
        try:
            yielded = coro.send(value) if error is None else coro.throw(error)
        except StopIteration as stop:
            return stop.value
        finally:
            if charge:
                meter.charge(meter.clock() - t0)
        try:
            value, error = (yield yielded), None
        except GeneratorExit:  # closed while suspended (a task garbage-collected): close it too
            coro.close()
            raise
        except BaseException as e:  # noqa: BLE001 - thrown in by the task (CancelledError, ...): it goes to coro
            value, error = None, e
