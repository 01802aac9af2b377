"""What a viewer's SDP offer may ask of the server, checked before aiortc sees it.

aiortc takes an offer as it comes: an m-line is a transceiver, and a candidate an address that aioice
probes. So an offer of 890 recvonly m-lines made 890 transceivers (and an answer too large for our own
``answer`` message), and one of 1,000 candidates had the server send connectivity checks to every address
it named, link-local ones (169.254.169.254 is a cloud's metadata service) included. ``check_offer`` is the
gate, plain text in and out, no aiortc and no I/O:

- the offer's size, its lines (each ``x=value``, at most ``MAX_LINE_CHARS``, no control characters) and its
  m-lines: at most ``MAX_MEDIA`` of them, of the kinds ``MEDIA_LIMITS`` names (video for the stream and the
  viewer's own camera to come, audio, which the answer rejects, and one application: the data channel);
- the first video m-line carries the stream: it must let the server send (recvonly or sendrecv) and offer
  H.264, the only codec the server sends; every video m-line must offer H.264 or VP8 (what the server will
  take as input);
- its ICE candidates: each one is kept only if aioice may probe it (UDP, a port, an IP address, and never a
  link-local, multicast, unspecified, broadcast or reserved address, nor loopback unless the server gathers
  on loopback itself), at most ``max_candidates`` distinct ones; the others are dropped from the text aiortc
  gets, and counted by reason. An mDNS name (``<uuid>.local``, a browser's hidden host address) is dropped
  too: aioice would resolve it with a multicast query on the server's network, to an address no one checks.
  A browser that names only those still connects: it sends its checks to the server's candidates, and the
  server learns its address from them (a peer-reflexive candidate, RFC 8445 section 7.3.1.3).

A bad offer raises ``SignalingError`` with a message that says what to change. ``reject_media`` turns the
answer's sections of the given mids into rejected ones (port 0, inactive, no candidates, out of BUNDLE).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from dataclasses import dataclass, field

from streamsvc.wire.protocol import MAX_MESSAGE_BYTES
from streamsvc.wire.rtc import H264_PACKETIZATION_MODE, H264_PROFILE_LEVEL_ID, MAX_REMOTE_CANDIDATES, SignalingError

MAX_OFFER_BYTES = MAX_MESSAGE_BYTES
"""The protocol's bound on the message that carries it (a browser's offer with video, audio, a data channel and a
dozen candidates is 5 to 10 KiB); what takes room beyond that is candidates, which the cap thins out."""
MAX_LINE_CHARS = 1024
"""A browser's longest lines (a video m-line's payload types, an fmtp) are 200 to 300 characters."""
MAX_MEDIA = 4
"""m-lines in an offer, all kinds together."""
MEDIA_LIMITS = {"video": 2, "audio": 1, "application": 1}
"""m-lines of each kind an offer may have: the stream's video and the viewer's camera, a microphone (rejected
in the answer), the data channel. Any other kind is refused."""
INPUT_VIDEO_CODECS = ("H264", "VP8")
"""Video codecs the server takes as input (the coming camera input); its output is H.264 only."""

_LINE = re.compile(r"[a-z]=")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but tab (and the line ends split on)
_CANDIDATE_TYPES = frozenset({"host", "srflx", "prflx", "relay"})
_DIRECTIONS = frozenset({"sendrecv", "sendonly", "recvonly", "inactive"})


@dataclass(frozen=True)
class CheckedOffer:
    """An offer that passed ``check_offer``: the text for aiortc, and what was dropped from it."""

    sdp: str  # the offer with CRLF line ends and only the kept candidates
    kinds: tuple[str, ...]  # the kind of each m-line, in order
    mids: tuple[str | None, ...]  # the a=mid of each m-line, in order (None: none given)
    bundle: tuple[str, ...]  # the mids of its BUNDLE group, the offerer-tagged one first (empty: none)
    candidates: int  # distinct remote candidates kept
    dropped: Counter[str] = field(default_factory=Counter)  # candidate lines dropped, by reason


def check_offer(sdp: str, *, max_candidates: int = MAX_REMOTE_CANDIDATES, allow_loopback: bool = False,
                publish: bool = False) -> CheckedOffer:
    """The offer aiortc may be given, or ``SignalingError`` saying why not. ``allow_loopback``: keep candidates on
    loopback addresses (only when the server itself gathers there; else a remote peer could aim our checks at
    this host's own services). ``publish``: a WHIP publisher's offer (streamsvc/door/whip.py), whose first video m-line
    sends (sendonly or sendrecv) H.264 or VP8, rather than a viewer's, which receives the stream's H.264."""
    media = sdp.count("\nm=") + sdp.startswith("m=")  # first, and cheap: the flood the issue saw says so
    if media > MAX_MEDIA:
        raise SignalingError(
            f"the offer has {media} m-lines; this server takes at most {MAX_MEDIA} (one recvonly video for the "
            "stream, a data channel, and optionally a camera video and a microphone): add one transceiver per "
            "kind before createOffer()")
    size = len(sdp.encode("utf-8", "surrogatepass"))
    if size > MAX_OFFER_BYTES:
        raise SignalingError(f"the offer is {size} bytes; this server takes at most {MAX_OFFER_BYTES}")
    lines = sdp.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not lines or lines[0] != "v=0":
        raise SignalingError("the offer is not SDP: it must start with the line v=0")
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE_CHARS:
            raise SignalingError(f"line {number} of the offer has {len(line)} characters; at most {MAX_LINE_CHARS}")
        if not _LINE.match(line):
            raise SignalingError(f"line {number} of the offer is not type=value (e.g. a=mid:0): {line[:40]!r}")
        if _CONTROL.search(line):
            raise SignalingError(f"line {number} of the offer holds a control character")
    sections = _sections(lines)
    _check_media(sections, publish)
    kept, dropped, candidates = _filter_candidates(sections, max_candidates, allow_loopback)
    return CheckedOffer(
        sdp="\r\n".join(kept) + "\r\n",
        kinds=tuple(s.kind for s in sections[1:]),
        mids=tuple(s.mid for s in sections[1:]),
        bundle=next((tuple(line.split()[1:]) for line in sections[0].lines if line.startswith("a=group:BUNDLE")), ()),
        candidates=candidates,
        dropped=dropped,
    )


# ---------------------------------------------------------------- m-lines


@dataclass
class _Section:
    """The session part (kind "") or one m-line and its attribute lines."""

    kind: str
    lines: list[str]
    number: int  # the line number of its m-line (1-based; 0: the session part)

    @property
    def mid(self) -> str | None:
        return next((line[6:].strip() for line in self.lines if line.startswith("a=mid:")), None)

    @property
    def direction(self) -> str:
        found = [line[2:] for line in self.lines if line[2:] in _DIRECTIONS]
        return found[-1] if found else "sendrecv"  # RFC 4566: sendrecv unless said otherwise

    def codecs(self) -> set[str]:
        """The encoding names of its a=rtpmap lines, upper case (H264, VP8, OPUS, RTX, ...)."""
        names = set()
        for line in self.lines:
            if line.startswith("a=rtpmap:"):
                parts = line[9:].split(None, 1)
                if len(parts) == 2:
                    names.add(parts[1].split("/", 1)[0].strip().upper())
        return names


def _sections(lines: list[str]) -> list[_Section]:
    sections = [_Section("", [], 0)]
    for number, line in enumerate(lines, 1):
        if line.startswith("m="):
            fields = line[2:].split()
            if len(fields) < 4 or not fields[1].split("/", 1)[0].isdigit():
                raise SignalingError(f"line {number} of the offer is not an m-line (m=<kind> <port> <proto> <fmt>...)")
            sections.append(_Section(fields[0], [line], number))
        else:
            sections[-1].lines.append(line)
    return sections


def _check_media(sections: list[_Section], publish: bool = False) -> None:
    media = sections[1:]
    kinds = Counter(s.kind for s in media)
    for kind, count in kinds.items():
        limit = MEDIA_LIMITS.get(kind)
        if limit is None:
            raise SignalingError(f"the offer has a {kind!r} m-line; this server takes only "
                                 f"{', '.join(MEDIA_LIMITS)} m-lines")
        if count > limit:
            raise SignalingError(f"the offer has {count} {kind} m-lines; this server takes at most {limit}")
    video = [s for s in media if s.kind == "video"]
    if not video:
        raise SignalingError("the offer has no video m-line: add a recvonly video transceiver before createOffer()")
    for s in video:
        codecs = s.codecs()
        if not codecs.intersection(INPUT_VIDEO_CODECS):
            raise SignalingError(
                f"the video m-line on line {s.number} offers {_names(codecs)} but no usable video codec: this server "
                f"sends H.264 only (packetization-mode {H264_PACKETIZATION_MODE}, profile-level-id "
                f"{H264_PROFILE_LEVEL_ID}) and takes {' or '.join(INPUT_VIDEO_CODECS)}")
    stream = video[0]
    if publish:
        if stream.direction not in ("sendonly", "sendrecv"):
            raise SignalingError(f"the first video m-line (line {stream.number}) is {stream.direction}: a WHIP offer "
                                 "sends its video, so it must be sendonly (or sendrecv)")
        return
    if stream.direction not in ("recvonly", "sendrecv"):
        raise SignalingError(f"the first video m-line (line {stream.number}) is {stream.direction}: it carries the "
                             "stream, so it must be recvonly (or sendrecv)")
    if "H264" not in stream.codecs():
        raise SignalingError(
            f"the offer has no usable video codec: its first video m-line (line {stream.number}) offers "
            f"{_names(stream.codecs())}, and this server sends H.264 only, packetization-mode "
            f"{H264_PACKETIZATION_MODE}, profile-level-id {H264_PROFILE_LEVEL_ID}")


def _names(codecs: set[str]) -> str:
    return ", ".join(sorted(codecs)) or "no codec"


# ---------------------------------------------------------------- ICE candidates


def candidate_refusal(line: str, allow_loopback: bool = False) -> str | None:
    """Why aioice must not probe the candidate of an ``a=candidate:`` line (a reason, for the counts), or None.

    RFC 8839: ``a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <type> ...``.
    """
    fields = line[len("a=candidate:"):].split()
    if len(fields) < 8 or fields[6] != "typ":
        return "malformed"
    _, component, transport, priority, address, port, _, kind = fields[:8]
    if not (component.isdigit() and priority.isdigit() and port.isdigit()) or kind not in _CANDIDATE_TYPES:
        return "malformed"
    if transport.lower() != "udp":
        return "transport"  # aioice does ICE over UDP only: a TCP candidate is never used
    if not 0 < int(port) < 65536:
        return "port"
    if address.lower().endswith(".local"):
        return "mdns"  # aioice would resolve it by a multicast query, to an address no one checks
    return address_refusal(address, allow_loopback)


def address_refusal(address: str, allow_loopback: bool = False) -> str | None:
    """Why an address must not be probed, or None: link-local (169.254.0.0/16 with the cloud metadata service,
    fe80::/10), multicast, unspecified (0.0.0.0, ::, and 0.0.0.0/8), the broadcast address and 240.0.0.0/4,
    loopback unless allowed, and anything that is not an IP address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return "hostname"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:169.254.169.254 is 169.254.169.254
    if ip.is_unspecified or (ip.version == 4 and ip in _THIS_NETWORK):
        return "unspecified"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip.version == 4 and ip.is_reserved:  # 240.0.0.0/4, which holds the broadcast address 255.255.255.255
        return "broadcast"
    if ip.is_loopback and not allow_loopback:
        return "loopback"
    return None


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def _filter_candidates(sections: list[_Section], cap: int, allow_loopback: bool) -> tuple[list[str], Counter[str], int]:
    """Every line but the candidates to drop; the drops by reason; the distinct candidates kept."""
    kept: list[str] = []
    dropped: Counter[str] = Counter()
    chosen: set[tuple[str, ...]] = set()  # (component, transport, address, port): repeated in each bundled m-line
    for section in sections:
        for line in section.lines:
            if not line.startswith("a=candidate:"):
                kept.append(line)
                continue
            reason = "session-level" if not section.kind else candidate_refusal(line, allow_loopback)
            if reason is None:
                fields = line.split()
                key = (fields[1], fields[2].lower(), fields[4].lower(), fields[5])
                if key not in chosen and len(chosen) >= cap:
                    reason = "over the cap"
                else:
                    chosen.add(key)
            if reason is None:
                kept.append(line)
            else:
                dropped[reason] += 1
    return kept, dropped, len(chosen)


# ---------------------------------------------------------------- the answer


def reject_media(answer: str, mids: set[str]) -> str:
    """The answer with the m-lines of ``mids`` rejected (RFC 3264 section 6, RFC 8843 section 7.3.3): port 0,
    ``a=inactive``, no candidates, and their mids out of the BUNDLE group."""
    if not mids:
        return answer
    sections = [[]]
    for line in answer.splitlines():
        if line.startswith("m="):
            sections.append([])
        sections[-1].append(line)
    out: list[str] = []
    for section in sections:
        rejected = bool(section) and section[0].startswith("m=") and any(
            line.startswith("a=mid:") and line[6:].strip() in mids for line in section)
        for line in section:
            if line.startswith("a=group:BUNDLE"):
                line = " ".join(["a=group:BUNDLE", *(tag for tag in line.split()[1:] if tag not in mids)])
            elif rejected and line.startswith("m="):
                kind, _port, rest = line.split(" ", 2)
                line = f"{kind} 0 {rest}"
            elif rejected and line[2:] in _DIRECTIONS:
                line = "a=inactive"
            elif rejected and line.startswith(("a=candidate:", "a=end-of-candidates")):
                continue
            out.append(line)
    return "\r\n".join(out) + "\r\n"
