"""Transports: how a stream's encoded frames reach its viewer.

A stream is encoded once (``streamsvc.encode``); a transport only frames and
sends the packets the stream's encoder made. The WebSocket transport is the
server's own binary chunk messages (``protocol.pack_chunk``); WebRTC lives in
``streamsvc.transport.webrtc`` (aiortc: a paced track that hands aiortc the
stream's own ``av.Packet`` s, and a data channel named ``control``).
"""
