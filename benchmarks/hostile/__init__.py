"""Hostile clients against `streamsvc serve`: each case a client that misbehaves on purpose, beside the viewers it
must not hurt, bounded in count and time, with what must hold. Run them with

    python -m benchmarks.hostile                 # every case at full size
    python -m benchmarks.hostile --case NAME     # one (repeatable); --list names them

(from the repository root, on Linux: the cases read /proc for the server's RSS and file descriptors).

Each module holds a kind of attack and its cases, registered in `CASES` (`__main__.py`):
- `round1` (issue 33): idle sockets, poisoned admission, slow readers;
- `admission` (issue 41): a quiet camera, a viewer's lying buffer reports: only the server's own measurements may
  close admission;
- `decoders` (issue 41): a resolution bomb over WebSocket and WHIP: the pixel cap before any decoder allocates;
- `backlog` (issue 41): a client that sends but never reads: bounded queues, disconnected;
- `capabilities` (issue 41): the old steerer's WHIP after a handover, and a flood of third-party log lines.
Each case prints its figures as they come; the run ends with one JSON line holding all of them and `ok`.
"""
