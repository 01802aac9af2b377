"""CPU time the event loop spends on clients without a stream, counted apart (issue 33).

Admission charges the event loop's CPU to the chunks it sends (the SEND stage), and on a CPU
device a forward's wall time to the device. Work done for clients that hold no stream (HTTP
requests such as `GET /metrics`, a connection's messages before `start` or `watch`, refused
starts) is neither: once it was charged to the first chunks sent, and a flood of junk frames on
a fresh server made it refuse every stream. The server meters that work where it enters our
code (a `CpuMeter`); the cost samples leave it out (streamsvc/scheduling/costs.py), and
/metrics shows it (`streamsvc_streamless_cpu_seconds`).

What the meter sees is the CPU of our handlers on the loop's thread (`time.thread_time`): a
synchronous section (`measure`, and the front's hooks through `hook`), or every step of a
coroutine taken while it has no stream (`run`, which leaves out the time it spends suspended,
when other tasks run). What it cannot see is the library's work around our code: accepting
the connections, parsing the frames and the requests, writing the replies. So it also counts
stream-less events (`hook`: each connection and request the front admits or refuses), and the
costs module drops a sample where that work was large in CPU or in events
(scheduling.without_streamless).
"""

from __future__ import annotations

import contextlib
import functools
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
        self._events = 0
        self._depth = 0  # metered sections open on the loop's thread: one nested in another charges nothing

    @property
    def seconds(self) -> float:
        """CPU seconds charged so far."""
        with self._lock:
            return self._seconds

    @property
    def events(self) -> int:
        """Stream-less events counted so far (connections and requests: `hook`; messages before a stream: `event`)."""
        with self._lock:
            return self._events

    def event(self) -> None:
        """Count one stream-less event that no hook counts: a message a connection without a stream sent (most of
        what it costs is the library's framing and parsing, before our handler and out of the meter's sight)."""
        with self._lock:
            self._events += 1

    def reading(self) -> tuple[float, int]:
        """(seconds, events) so far, read together."""
        with self._lock:
            return self._seconds, self._events

    def charge(self, seconds: float) -> None:
        """Add `seconds` of CPU (negative readings of a clock going backwards count as 0)."""
        if seconds > 0:
            with self._lock:
                self._seconds += seconds

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Charge the CPU of the enclosed synchronous code (it must not await); nothing when it runs inside a section
        metered already (`run`'s steps), which charges it."""
        if self._depth:
            yield
            return
        t0 = self.clock()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            self.charge(self.clock() - t0)

    def hook(self, fn: Callable[..., T], event: bool = True) -> Callable[..., T]:
        """`fn` (a synchronous hook the front calls for a client without a stream: a new connection, a request)
        with its CPU charged and, with `event`, one stream-less event counted per call."""
        @functools.wraps(fn)
        def hooked(*args: Any, **kwargs: Any) -> T:
            if event:
                with self._lock:
                    self._events += 1
            with self.measure():
                return fn(*args, **kwargs)
        return hooked

    async def run(self, coro: Coroutine[Any, Any, T], charging: Callable[[], bool]) -> T:
        """Await `coro`, charging the CPU of each of its steps (from one suspension to the next) that begins while
        `charging()` is true; the time it spends suspended, when other tasks run, is not its own and is not
        charged, nor is a step taken inside a section metered already (a run awaited from a run's step).
        Cancellation and errors pass through as if `coro` were awaited directly."""
        return await self._metered(coro, charging)

    @types.coroutine
    def _metered(self, coro: Coroutine[Any, Any, T], charging: Callable[[], bool]) -> Generator[Any, Any, T]:
        """Drive `coro` as `await coro` would (what it yields goes to the task, what the task sends or throws
        goes to it), timing each step."""
        value: Any = None
        error: BaseException | None = None
        while True:
            charge = not self._depth and charging()
            t0 = self.clock()
            self._depth += charge
            try:
                yielded = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                if charge:
                    self._depth -= 1
                    self.charge(self.clock() - t0)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:  # closed while suspended (a task garbage-collected): close it too
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - thrown in by the task (CancelledError, ...): it goes to coro
                value, error = None, e
