"""Third-party libraries' log lines, gated like the server's own (issue 41, item 6).

A client decides how many lines the libraries under the server write, as it decides how many of ours (those go
through access.LogGate): aiortc's decoder thread logs a WARNING for every frame it cannot decode, and 1,152
undecodable frames from one WHIP publisher wrote 1,151 lines (214 KiB in 5 s). aioice logs a line per ICE check
and per peer-reflexive candidate, PyAV's bridge one per libav message, aiohttp one per request in its access log.

`LibraryLogGate` is a `logging.Filter` that `install()` puts on the root logger's handlers (`streamsvc serve` at
start-up, streamsvc/cli.py, the cluster's gateway with it; each cluster replica, streamsvc/cluster/replica.py). Of
each library in GATED it lets through at most `per_template` lines of one (logger, message template) and
`per_source` lines in all, in any `period_s` (sliding): 10 lines a minute from each library by default. The next
line of a library that passes says how many of its lines were held back. Our own lines, and other libraries',
pass untouched. The decision is `LineGate`'s, a plain class fed the time.

libav, under PyAV: PyAV drops libav's own messages in C unless its bridge is on (``av.logging.set_level``): then
none reaches stderr or Python's logging, and no libav thread takes the GIL to log (PyAV's docs warn that the bridge
can deadlock threaded codecs). `install` keeps it that way, lowers a bridge someone turned on to ERROR, and sets
libav's own level to ERROR for a restored stderr callback. What the bridge would log ("libav.<component>") is
gated here with PyAV's own loggers, as one source: av. Our code counts a publisher's undecodable frames
(streamsvc/inputs/rtc.py) and logs them when its session ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

# logger name prefix -> the source it counts against
GATED = {"aiortc": "aiortc", "aioice": "aioice", "av": "av", "libav": "av", "aiohttp": "aiohttp"}
PER_TEMPLATE = 3  # lines of one (logger, message template) a period, by default
PER_SOURCE = 10  # lines of one library a period, by default
PERIOD_S = 60.0
MAX_KEYS = 256  # (logger, template) pairs tracked at most, the idlest forgotten first (templates may carry input)
MAX_TEMPLATE_CHARS = 200  # of a template, in its key


class LineGate:
    """Whether a line passes: at most `per_key` lines of a key and `per_source` of a source in any `period_s`. Pure:
    the caller passes the time."""

    def __init__(self, per_key: int = PER_TEMPLATE, per_source: int = PER_SOURCE, period_s: float = PERIOD_S,
                 max_keys: int = MAX_KEYS) -> None:
        if per_key < 1 or per_source < 1 or not period_s > 0 or max_keys < 1:
            raise ValueError(f"per_key={per_key}, per_source={per_source}, period_s={period_s}, max_keys={max_keys}: "
                             "give at least 1 line, a period > 0 and at least 1 key")
        self.per_key, self.per_source, self.period_s, self.max_keys = per_key, per_source, period_s, max_keys
        self._keys: OrderedDict[tuple, deque[float]] = OrderedDict()  # key -> times of its lines that passed
        self._sources: dict[str, deque[float]] = {}  # source -> times of its lines that passed
        self._held: dict[str, int] = {}  # source -> lines held back since its last one that passed
        self.held_total: dict[str, int] = {}  # source -> lines held back in all

    def allow(self, source: str, key: tuple, now: float) -> int | None:
        """None: hold this line back (counted). Else let it pass: the number of its source's lines held back since
        the last one that passed."""
        since = now - self.period_s
        passed = self._sources.setdefault(source, deque())
        _expire(passed, since)
        times = self._keys.get(key)
        if times is None:
            times = self._keys[key] = deque()
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        _expire(times, since)
        if len(passed) >= self.per_source or len(times) >= self.per_key:
            self._held[source] = self._held.get(source, 0) + 1
            self.held_total[source] = self.held_total.get(source, 0) + 1
            return None
        passed.append(now)
        times.append(now)
        return self._held.pop(source, 0)


def _expire(times: deque[float], since: float) -> None:
    while times and times[0] <= since:
        times.popleft()


class LibraryLogGate(logging.Filter):
    """The filter `install` puts on the root logger's handlers (see the module's docstring). Thread-safe (aiortc
    logs from its decoder threads); a record filtered by several handlers is decided once."""

    def __init__(self, gate: LineGate | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.gate = gate or LineGate()
        self.clock = clock
        self._lock = threading.Lock()
        self._verdict = f"_library_gate_{id(self)}"  # this gate's decision on a record (another gate decides its own)

    def filter(self, record: logging.LogRecord) -> bool:
        verdict = record.__dict__.get(self._verdict)
        if verdict is not None:
            return verdict
        source = source_of(record.name)
        if source is None:
            return True
        template = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        with self._lock:
            held = self.gate.allow(source, (record.name, template[:MAX_TEMPLATE_CHARS]), self.clock())
        if held:
            period = self.gate.period_s
            record.msg = (f"{record.getMessage()} [{held} more lines from {source} held back since its last line; "
                          f"at most {self.gate.per_source} a {period:g} s]")
            record.args = ()
        record.__dict__[self._verdict] = held is not None
        return held is not None


def source_of(name: str) -> str | None:
    """The gated library a logger belongs to ("aiortc.rtcrtpreceiver" -> "aiortc"), or None: not gated."""
    top = name.partition(".")[0]
    return GATED.get(top)


def install(gate: LibraryLogGate | None = None) -> LibraryLogGate:
    """Gate the libraries' lines on every handler the root logger has now (and logging.lastResort, which writes
    them when it has none); keep libav's messages off. Once per process: a later call returns the gate installed.
    Call it after the logging set-up (basicConfig)."""
    root = logging.getLogger()
    handlers = [h for h in (*root.handlers, logging.lastResort) if h is not None]
    installed = next((f for h in handlers for f in h.filters if isinstance(f, LibraryLogGate)), None)
    gate = installed or gate or LibraryLogGate()
    for handler in handlers:
        if gate not in handler.filters:
            handler.addFilter(gate)
    quiet_libav()
    return gate


def quiet_libav() -> None:
    """libav's own messages: dropped in C (PyAV's default), or at most ERROR where PyAV's bridge was turned on;
    ERROR on stderr should its default callback be restored."""
    import av.logging

    level = av.logging.get_level()
    if level is not None and level > av.logging.ERROR:
        av.logging.set_level(av.logging.ERROR)
    av.logging.set_libav_level(av.logging.ERROR)
