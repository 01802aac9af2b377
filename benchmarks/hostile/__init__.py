"""Hostile clients against `streamsvc serve`: each case a client that misbehaves on purpose, beside the viewers it
must not hurt, bounded in count and time, with what must hold. Run them with

    python -m benchmarks.hostile                 # every case at full size
    python -m benchmarks.hostile --case NAME     # one (repeatable); --list names them

(from the repository root, on Linux: the cases read /proc for the server's RSS and file descriptors).

Each module holds a round of cases and registers them in `CASES` (`__main__.py`): `round1` (issue 33: idle sockets,
poisoned admission, slow readers) and the modules beside it. Each case prints its figures as they come; the run
ends with one JSON line holding all of them and `ok`.
"""
