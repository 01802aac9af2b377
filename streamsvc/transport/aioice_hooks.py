"""aioice's private names: the one module of streamsvc/ that touches them (issue 42, part 4).

streamsvc/transport/ice.py caps the peer-reflexive candidates an aioice ``Connection`` (one peer connection's ICE
agent) learns from a peer's STUN checks; aioice has no public way to, so the cap wraps the connection's
``check_incoming`` (``wrap_check_incoming``) and reads its remote candidates (``remote_candidates``) and their
addresses (``candidate_address``) here. Only the mechanism is here; the cap and its verdict stay in ice.py.
streamsvc/wire/rtc.py (``gather_on``) also replaces aioice's public ``aioice.ice.get_host_addresses``, process wide:
it stays in the wire (the client imports it, and the wire imports nothing else of ours), but is listed here too.

What this uses of aioice is data: ``HOOKED``, (module, class or None, name) for each name, and ``CONNECTION_HOOKS``,
what ice.py checks a connection against before hooking it (missing: its ``install`` returns False and logs a warning,
as before). It was tested against aioice ``TESTED_VERSION`` (aiortc 1.16's); pyproject.toml pins aioice below the
next minor version, and tests/streamsvc/test_hooks.py checks every name in the installed aioice (and that no other
module of streamsvc/ uses one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

LIBRARY = "aioice"
TESTED_VERSION = "0.13.0"

CONNECTION_HOOKS = ("check_incoming", "_remote_candidates")
"""What the peer-reflexive cap uses of an ``aioice.Connection``."""
HOOKED = (
    *(("aioice.ice", "Connection", name) for name in CONNECTION_HOOKS),
    ("aioice.candidate", "Candidate", "_network_host"),
    ("aioice.candidate", "Candidate", "host"),
    ("aioice.candidate", "Candidate", "port"),
    ("aioice.candidate", "Candidate", "type"),
    ("aioice.ice", None, "get_host_addresses"),  # replaced by streamsvc/wire/rtc.py's gather_on (see above)
)
"""Every name of aioice streamsvc uses below its API: (module, class or None for a module attribute, name)."""


def aioice_version() -> str:
    """The installed aioice's version (for warnings)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(LIBRARY)
    except PackageNotFoundError:
        return "(unknown version)"


def missing(connection, names: Iterable[str] = CONNECTION_HOOKS) -> list[str]:
    """Those of `names` that `connection` (an ``aioice.Connection``) lacks: what this aioice moved or renamed."""
    return [name for name in names if not hasattr(connection, name)]


def wrap_check_incoming(connection, wrap: Callable[[Callable], Callable]) -> None:
    """This connection's ``check_incoming(message, addr, protocol)`` (called for each authenticated STUN check, after
    aioice has answered it) becomes ``wrap(check_incoming)``'s answer; other connections keep aioice's own."""
    connection.check_incoming = wrap(connection.check_incoming)


def remote_candidates(connection) -> list:
    """The connection's remote candidates, signalled and learned (aioice's own list, live: read it, change nothing)."""
    return connection._remote_candidates


def candidate_address(candidate) -> tuple[str, int]:
    """The (host, port) a candidate's checks come from (its host as aioice compares it, where aioice keeps one)."""
    return getattr(candidate, "_network_host", candidate.host), candidate.port
