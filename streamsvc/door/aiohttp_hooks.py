"""aiohttp's private names: the one module of streamsvc/ that touches them (issue 42, part 4).

aiohttp fixes a WebSocket's message limit (``max_msg_size``) in the frame parser it makes at the upgrade, and has no
public way to change it later. A stream whose ``start`` asked for input video takes larger messages than the front's
control limit (issue 35), so ``raise_message_limit(ws, max_bytes)`` puts a new parser with the new limit in the old
one's place. Only the mechanism is here; who gets a raised limit, and the warning where it cannot be raised, stay in
streamsvc/door/front.py (``WebSocketConnection.allow_messages``).

What this uses of aiohttp is data: ``HOOKED``, (module, class or None for a module attribute, name) for each name. It
was tested against aiohttp ``TESTED_VERSION`` (3.13's parser takes no ``decode_text`` and its ``set_parser`` no
``data_received_cb``: there the limit stays as it is); pyproject.toml pins aiohttp to 3.14, and
tests/streamsvc/test_hooks.py checks every name in the installed aiohttp (and that no other module of streamsvc/ uses
one). An aiohttp whose internals differ raises one of ``MISMATCH`` from ``raise_message_limit``.
"""

from __future__ import annotations

LIBRARY = "aiohttp"
TESTED_VERSION = "3.14.5"

HOOKED = (
    ("aiohttp._websocket.reader", None, "WebSocketReader"),
    ("aiohttp.web_ws", "WebSocketResponse", "_req"),
    ("aiohttp.web_ws", "WebSocketResponse", "_reader"),
    ("aiohttp.web_ws", "WebSocketResponse", "_compress"),
    ("aiohttp.web_ws", "WebSocketResponse", "_decode_text"),
    ("aiohttp.web_ws", "WebSocketResponse", "_parser"),
    ("aiohttp.web_protocol", "RequestHandler", "_data_received_cb"),
    ("aiohttp.web_protocol", "RequestHandler", "_payload_parser"),
    ("aiohttp.web_protocol", "RequestHandler", "set_parser"),
)
"""Every name of aiohttp this module uses: (module, class or None for a module attribute, name)."""
MISMATCH = (AttributeError, ImportError, TypeError, AssertionError)
"""What ``raise_message_limit`` raises where this aiohttp's internals differ from those it was written for."""


def raise_message_limit(ws, max_bytes: int) -> None:
    """Raise an upgraded ``web.WebSocketResponse``'s message limit to `max_bytes` (a message of more is refused, 1009).
    Between two messages: the new parser takes over the connection's bytes from the next one read. Raises one of
    ``MISMATCH`` (the limit then unchanged, unless aiohttp failed halfway) where this aiohttp differs."""
    from aiohttp._websocket.reader import WebSocketReader

    protocol = ws._req.protocol
    # max_bytes + 1: aiohttp refuses a message of max_msg_size bytes itself (the front's own limit is set so too)
    parser = WebSocketReader(ws._reader, max_bytes + 1, compress=bool(ws._compress),
                             decode_text=getattr(ws, "_decode_text", True))
    callback = protocol._data_received_cb
    protocol._payload_parser = None
    ws._parser = parser
    protocol.set_parser(parser, data_received_cb=callback)
