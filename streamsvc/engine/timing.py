"""How the engine times the device's work without waiting for it: a `Timer` records CUDA events around a
forward as it is launched (on CPU the forward ran at launch: its wall time), and the `InFlight` it hands back is
read once its end event has passed. The warm-up waits for each forward instead (`Timer.seconds`).

On CPU a forward's wall time also holds what else the host did meanwhile; given `streamless` (the event loop's
CPU on clients without a stream so far and their events: server.Server.streamless), the timer reads it too, and
the engine leaves that out of the forward's cost sample, or drops the sample (scheduling.without_streamless):
such clients do not make the device look slower to admission."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.work import WorkKind

__all__ = ["InFlight", "Timer"]


@dataclass
class InFlight:
    """A launched plan whose forward the device may still be running."""

    kind: WorkKind
    batch: int  # streams in the forward
    launched_at: float  # engine clock at launch
    start: torch.cuda.Event | None  # recorded before its forward (None on CPU: it ran at launch)
    end: torch.cuda.Event | None
    elapsed_s: float = 0.0  # CPU: the forward's wall time
    streamless_s: float = 0.0  # CPU: the event loop's CPU on clients without a stream while the forward ran
    streamless_events: int = 0  # CPU: their connections and requests meanwhile


class Timer:
    """CUDA events around launched work (read later), or the wall time of work that ran at once."""

    def __init__(self, device: torch.device, clock: Callable[[], float],
                 streamless: Callable[[], tuple[float, int]] | None = None) -> None:
        self.clock = clock
        self.start = None
        self.t0 = clock()
        self.streamless = streamless if device.type != "cuda" else None  # CUDA events see the device's time alone
        self.streamless0 = self.streamless() if self.streamless is not None else (0.0, 0)
        if device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def launched(self, kind: WorkKind, batch: int, now: float) -> InFlight:
        end = None
        if self.start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        seconds, events = self.streamless() if self.streamless is not None else (0.0, 0)
        return InFlight(kind, batch, now, self.start, end, self.clock() - self.t0, seconds - self.streamless0[0],
                        events - self.streamless0[1])

    def seconds(self) -> float:
        """Wait for the work and return its time (warm-up)."""
        if self.start is None:
            return self.clock() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.start.elapsed_time(end) / 1e3
