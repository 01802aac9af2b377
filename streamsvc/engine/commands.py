"""The engine's commands: what other threads ask of the engine thread, applied by it between two launches.

Any thread `submit`s a function and gets a concurrent Future of its result; the engine thread takes them in order
(`drain` between plans, `next` while it has nothing to launch) and `apply`s each. `post` queues one nobody awaits (an
output worker's hand-over), `wake` makes the loop turn with nothing to run, and `close` stops it: a command submitted
after that fails at once ("engine is stopping").
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from streamsvc.engine.errors import EngineError


@dataclass
class Command:
    fn: Callable  # run in the engine thread
    args: tuple
    future: Future = field(default_factory=Future)
    later: bool = False  # fn(future, *args) resolves the future itself, maybe later (fn's errors still do)


_WAKE = object()  # what `wake` queues: the loop turns, nothing runs (None: it stops)


class Commands:
    """The engine thread's queue of commands (module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command | object | None] = queue.SimpleQueue()
        self.closed = False

    def submit(self, fn: Callable, *args, later: bool = False) -> Future:
        """Run fn(*args) on the engine thread (with `later`, fn(future, *args), which resolves it); its Future."""
        cmd = Command(fn, args, later=later)
        if self.closed:
            cmd.future.set_exception(EngineError("engine is stopping"))
        else:
            self._queue.put(cmd)
        return cmd.future

    def post(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the engine thread; nobody waits for it."""
        self._queue.put(Command(fn, args))

    def wake(self) -> None:
        self._queue.put(_WAKE)

    def close(self) -> None:
        """No command is taken any more; the loop's wait ends."""
        self.closed = True
        self._queue.put(None)

    def drain(self) -> list[Command]:
        """Every command queued now (the engine thread)."""
        out = []
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return out
            if isinstance(cmd, Command):
                out.append(cmd)

    def next(self, timeout: float) -> Command | None:
        """The next command within `timeout` seconds (the engine thread); None at a wake, a close or the timeout."""
        try:
            cmd = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        return cmd if isinstance(cmd, Command) else None

    @staticmethod
    def apply(cmd: Command) -> None:
        """Run `cmd` (the engine thread); its result or its error goes to its future."""
        try:
            if cmd.later:
                cmd.fn(cmd.future, *cmd.args)
            else:
                cmd.future.set_result(cmd.fn(*cmd.args))
        except Exception as e:  # noqa: BLE001 - the caller gets the error through the future
            if not cmd.future.done():
                cmd.future.set_exception(e)
