"""Transports: how a stream's encoded frames reach its viewer.

A stream is encoded once (``streamsvc.engine.encode``); a transport only frames and
sends the packets the stream's encoder made. The WebSocket transport is the
server's own binary chunk messages (``protocol.pack_chunk``); WebRTC lives in
``streamsvc.transport.webrtc`` (aiortc: a paced track that hands aiortc the
stream's own ``av.Packet`` s, and a data channel named ``control``).

- `ws`: what a viewer's messages go out on (an `Outlet`: its WebSocket, or what takes its place), and its outbox
  sent on it, in order.
- `webrtc`: delivery through aiortc: one paced track and one data channel per stream.
- `track`: the paced track: a stream's own packets, at its fps, its queue the viewer's buffer.
- `sdp`: what a viewer's SDP offer may ask of the server, checked before aiortc sees it.
- `ice`, `datachannel`: bounds on what a WebRTC peer's ICE and data channels make the server hold.
- `aiortc_hooks`, `aioice_hooks`: the only modules of streamsvc/ that touch aiortc's and aioice's private names
  (each lists them in `HOOKED`, with the version it was tested against; tests/streamsvc/test_hooks.py checks them).
"""
