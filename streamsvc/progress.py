"""A small progress bar for long CLI work (stderr; one line per update when not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, unit: str, stream=None, min_interval_s: float = 0.2) -> None:
        self.total, self.unit = total, unit
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.done = 0
        self.min_interval_s = min_interval_s if self.tty else 2.0

    def update(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        now = time.monotonic()
        if now - self.last >= self.min_interval_s or self.done == self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        rate = self.done / max(now - self.start, 1e-9)
        bar = "#" * int(frac * 30)
        line = f"[{bar:<30}] {self.done}/{self.total} {self.unit} {rate:.1f} {self.unit}/s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
