"""A serving process's heap over hours: what a closed stream held goes back soon, not at a rare full collection.

Two things kept a closed stream's memory in the server process (a soak of 16 streams with churn: RSS +5.6 % from
minute 5, issue 46):
- Cycles. A closed stream's session, viewers and driver refer to each other, so only the cyclic collector frees them,
  and its full collection is rare. It is also slow: with the model and the libraries loaded it walks 340,000 objects,
  72 ms on a 2-core CPU, the event loop stopped meanwhile.
- The C allocator. glibc gives freed memory back to the system only from the top of its heap; the pages of buffers
  freed in the middle stay resident.

`Heap.freeze()`, once the engine is up, collects once and moves every object alive then (the model, the libraries,
the warm-up's tables) out of the collector's reach for good: a full collection afterwards walks only what was made
since (under 1 ms). `Heap.tidy_soon()`, at a stream's end and a connection's, schedules a collection and a trim on
the event loop `settle_s` later (what the close lets go is let go by then: the viewers' senders end, the peer's
socket closes), at most one a `every_s`: a churn of closes costs one tidy a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def memory_giver() -> Callable[[], None] | None:
    """A call that gives the pages of freed memory back to the system: glibc's `malloc_trim(0)`; None where the C
    library has none (musl, macOS).

    glibc returns freed memory to the system only from the top of its heap; the pages of an x264 context freed in
    the middle stay resident. In the encoder process, where streams' encoders come and go, its RSS crept up under
    churn and stayed up once every stream had closed (issue 46: 77 MB to 110 MB in a 20-minute soak, 107 MB after;
    a 300-stream churn of 16 at a time, 96 MB to 104 MB, 104 MB after all closed and 57 MB after a trim). A trim
    after each encoder closed kept it flat (85-88 MB over the same churn), at 0.1-0.3 ms a close."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # this process's symbols, the C library's among them
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def give_back() -> None:
        trim(0)

    return give_back


class Heap:
    """The serving process's collections and trims (module docstring)."""

    def __init__(self, settle_s: float = 2.0, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 metered: Callable[[Callable[[], None]], Callable[[], None]] | None = None) -> None:
        self.settle_s, self.every_s, self.clock = settle_s, every_s, clock
        # what a tidy's CPU counts as (the server's: stream-less work, not a stream's send cost)
        self._run = metered(self.tidy) if metered is not None else self.tidy
        self.give_back = memory_giver()
        self.tidies = 0  # collections run since start (tests read it)
        self._last = -float("inf")
        self._pending: asyncio.TimerHandle | None = None

    def freeze(self) -> None:
        """Collect once, then keep every object alive now out of later collections (call once the engine is up)."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        log.info("heap: %d objects frozen out of the collector (%.0f ms)", gc.get_freeze_count(),
                 (time.perf_counter() - t0) * 1e3)

    def tidy_soon(self) -> None:
        """A collection and a trim on the running loop, `settle_s` from now and `every_s` or more after the last one;
        one pending at most (a close while one is pending is its)."""
        if self._pending is not None:
            return
        now = self.clock()
        delay = max(self.settle_s, self._last + self.every_s - now)
        self._pending = asyncio.get_running_loop().call_later(delay, self._run)

    def tidy(self) -> None:
        self._pending = None
        self._last = self.clock()
        t0 = time.perf_counter()
        found = gc.collect()
        if self.give_back is not None:
            self.give_back()
        self.tidies += 1
        log.debug("heap: %d unreachable objects collected, pages trimmed (%.1f ms)", found,
                  (time.perf_counter() - t0) * 1e3)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
