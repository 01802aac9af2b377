"""WebRTC conventions both ends share: the control channel's name, the H.264 codec preferences,
ICE configuration (no STUN/TURN by default) and the choice of candidate addresses.

Like ``streamsvc.wire.protocol`` this imports nothing else of ours, so the client and the server's
transport (``streamsvc.transport.webrtc``) can both use it. aioice gathers host candidates on
every interface except 127.0.0.1; ``gather_on(addresses)`` picks the addresses instead, for the
code inside it only, so tests and load tests keep all ICE traffic on loopback. ``"*"`` among them
stands for aioice's own pick, so a server listening on loopback offers loopback as well
(``server_ice_addresses``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ipaddress
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import aioice.ice
from aiortc import (
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpCodecCapability,
    RTCRtpSender,
    RTCSessionDescription,
)

CONTROL_CHANNEL = "control"
"""Label of the data channel that carries the protocol's JSON messages."""
H264_PROFILE_LEVEL_ID = "42e01f"
"""Constrained baseline, level 3.1: what the stream encoder makes (128x128 up to 832x480 at 30 fps fit 3.1)."""
H264_PACKETIZATION_MODE = "1"
MAX_REMOTE_CANDIDATES = 16
"""Remote ICE candidates the server keeps of an offer by default (``streamsvc serve --max-remote-candidates``):
a browser names 2 to 8 (host or mDNS, server-reflexive, relay; IPv4 and IPv6)."""


class SignalingError(ValueError):
    """An offer the server cannot answer; the message says why and what to change."""


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class IceServer:
    """A STUN or TURN server, as in the browser's ``RTCIceServer``."""

    url: str  # stun:host:port, stuns:, turn:host:port?transport=udp or turns:
    username: str | None = None  # TURN only
    credential: str | None = None  # TURN only

    def __post_init__(self) -> None:
        if not self.url.startswith(("stun:", "stuns:", "turn:", "turns:")):
            raise ValueError(f"ICE server {self.url!r}: the URL must start with stun:, stuns:, turn: or turns:")
        if self.url.startswith("turn") and (self.username is None or self.credential is None):
            raise ValueError(f"TURN server {self.url!r} needs a username and a credential: URL,USERNAME,CREDENTIAL")

    @classmethod
    def parse(cls, text: str) -> IceServer:
        """``URL`` or ``URL,USERNAME,CREDENTIAL`` (the command line's ``--ice-server``)."""
        parts = text.split(",")
        if len(parts) not in (1, 3):
            raise ValueError(f"ICE server {text!r}: expected URL or URL,USERNAME,CREDENTIAL")
        return cls(*parts) if len(parts) == 3 else cls(parts[0])


@dataclass(frozen=True)
class WebRtcConfig:
    """How the server's peer connections find their viewers."""

    ice_servers: tuple[IceServer, ...] = ()  # STUN/TURN servers; () = none, host candidates only
    # host candidates on exactly these IPs ("*": every interface but loopback, aioice's pick); None = "*" alone
    ice_addresses: tuple[str, ...] | None = None
    gather_timeout_s: float = 10.0  # ICE gathering before the answer, at most
    connect_timeout_s: float = 20.0  # answer sent -> connected, else the stream ends
    channel_wait_s: float = 2.0  # the track holds its first frame this long at most for the control channel
    max_frame_wait_s: float = 3600.0  # a track waiting this long for a frame (stalled or paused) ends
    # What a viewer's jitter buffer holds beyond the track's queue: a track that runs dry for less than this
    # (past the frame on the wire) is not counted as a stall (browsers hold 50-200 ms; a W3C freeze is a gap of
    # 150 ms over the frame interval). The scheduler still plans on the queue alone.
    viewer_jitter_s: float = 0.1
    # distinct ICE candidates of an offer kept (the rest, and every one aioice must never probe, are dropped)
    max_remote_candidates: int = MAX_REMOTE_CANDIDATES

    def __post_init__(self) -> None:
        if self.max_remote_candidates < 1:
            raise ValueError(f"max_remote_candidates={self.max_remote_candidates}: give at least 1")
        if self.ice_addresses is not None:
            if not self.ice_addresses:
                raise ValueError("ice_addresses is empty: give at least one IP (e.g. 127.0.0.1) or None for every interface")
            for address in self.ice_addresses:
                if address == ANY_INTERFACE:
                    continue
                try:
                    ipaddress.ip_address(address)
                except ValueError:
                    raise ValueError(f"ICE address {address!r} is not an IP address (e.g. 127.0.0.1 or ::1)") from None
        for name in ("gather_timeout_s", "connect_timeout_s", "channel_wait_s", "max_frame_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        if not (self.viewer_jitter_s >= 0 and math.isfinite(self.viewer_jitter_s)):
            raise ValueError(f"viewer_jitter_s={self.viewer_jitter_s}: must be a finite number of seconds >= 0")


def rtc_configuration(ice_servers: Sequence[IceServer] = ()) -> RTCConfiguration:
    """aiortc's configuration: exactly these ICE servers (an empty list, not None: no public STUN)."""
    return RTCConfiguration(
        iceServers=[RTCIceServer(urls=s.url, username=s.username, credential=s.credential) for s in ice_servers]
    )


def h264_preferences() -> list[RTCRtpCodecCapability]:
    """Codec preferences for a video transceiver: H.264 mode 1 constrained baseline, with its RTX."""
    codecs = RTCRtpSender.getCapabilities("video").codecs
    h264 = [
        c for c in codecs
        if c.mimeType.lower() == "video/h264"
        and c.parameters.get("packetization-mode") == H264_PACKETIZATION_MODE
        and c.parameters.get("profile-level-id") == H264_PROFILE_LEVEL_ID
    ]
    if not h264:  # aiortc changed its codec table; nothing would negotiate
        raise RuntimeError(f"aiortc offers no H.264 {H264_PROFILE_LEVEL_ID} packetization-mode 1 codec")
    return h264 + [c for c in codecs if c.mimeType.lower() == "video/rtx"]


# ---------------------------------------------------------------- ICE host addresses

ANY_INTERFACE = "*"  # among ICE addresses: every interface but loopback (aioice's own pick)


def server_ice_addresses(listen_host: str, configured: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The host candidates of a server listening on `listen_host`: what was configured, else, on a
    loopback address, loopback besides every other interface (a browser on the same host, or a
    host with loopback only, can then connect), else aioice's pick (None)."""
    if configured is not None:
        return configured
    if listen_host == "localhost":
        return (ANY_INTERFACE, "127.0.0.1")
    try:
        ip = ipaddress.ip_address(listen_host)
    except ValueError:
        return None
    if ip.is_loopback:
        return (ANY_INTERFACE, "::1" if ip.version == 6 else "127.0.0.1")
    return None

_host_addresses: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "streamsvc_ice_host_addresses", default=None
)


def _install_address_hook() -> None:
    """Route aioice's host-address lookup through ``_host_addresses`` (once; without a choice it is aioice's own)."""
    current = aioice.ice.get_host_addresses
    if getattr(current, "streamsvc_hook", False):
        return

    def get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        chosen = _host_addresses.get()
        if chosen is None:
            return current(use_ipv4, use_ipv6)
        out: list[str] = []
        for a in chosen:
            if a == ANY_INTERFACE:
                out += current(use_ipv4, use_ipv6)
            elif use_ipv6 if ":" in a else use_ipv4:
                out.append(a)
        return list(dict.fromkeys(out))  # in order, once each

    get_host_addresses.streamsvc_hook = True  # type: ignore[attr-defined]
    aioice.ice.get_host_addresses = get_host_addresses


@contextlib.contextmanager
def gather_on(addresses: Sequence[str] | None) -> Iterator[None]:
    """ICE gathering started inside this block uses exactly ``addresses`` as host candidates
    (``"*"``: aioice's own pick, every interface but loopback).

    aioice looks its host addresses up with ``aioice.ice.get_host_addresses``
    (every interface but 127.0.0.1). This wraps that function once, process
    wide, with one that answers from a context variable, so the choice holds
    for the current task and the tasks it starts (aiortc gathers in
    ``setLocalDescription``), and for nothing else: other connections in the
    process keep their own choice. ``None`` keeps aioice's default. Use it as
    ``with gather_on(["127.0.0.1"]): await pc.setLocalDescription(...)``.
    """
    if addresses is None:
        yield
        return
    _install_address_hook()
    token = _host_addresses.set(tuple(addresses))
    try:
        yield
    finally:
        _host_addresses.reset(token)


async def complete_local_description(
    pc: RTCPeerConnection, description: RTCSessionDescription, addresses: Sequence[str] | None, timeout_s: float
) -> str:
    """Set the local description, gathering every candidate first; the SDP with its full candidate list."""
    with gather_on(addresses):
        async with asyncio.timeout(timeout_s):
            await pc.setLocalDescription(description)
    return pc.localDescription.sdp
