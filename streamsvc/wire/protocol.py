"""The wire protocol between a viewer and the service.

This module imports nothing else of ours: the client, the browser player and
the server all speak it, and nothing here knows about sockets, asyncio or
tensors.

Control messages
----------------
Every control and server message is one JSON object with a ``type`` field
that names its pydantic model below. Over WebSocket they travel as text
messages; over WebRTC the same JSON travels on the data channel named
``control``. Signaling (``offer``/``answer``) goes over the WebSocket too.

Client -> server::

    {"type": "start", "prompt": "...", "seed": 7, "fps": 16, "transport": "ws", "token": "...", "input": true,
     "strength": 0.6, "lora": "ink", "lora_scale": 0.8, "image": "data:image/png;base64,..."}
    {"type": "set_strength", "strength": 0.8}  {"type": "set_lora", "lora": "ink", "lora_scale": 1.0}
    {"type": "watch", "stream_id": "s3", "secret": "...", "transport": "ws", "token": "..."}
    {"type": "set_prompt", "prompt": "..."}
    {"type": "handover", "to": "v7"}  {"type": "take", "secret": "..."}  {"type": "record"}
    {"type": "pause"}  {"type": "resume"}  {"type": "close"}
    {"type": "stats", "buffered_s": 1.5, "frames_played": 480, "stalls": 0, ...}
    {"type": "offer", "sdp": "v=0..."}

Server -> client::

    {"type": "ready", "stream_id": "...", "fps": 16, "width": 832, "height": 480, "vocabulary": ["a", ...],
     "first_chunk_frames": 9, "chunk_frames": 12, "prompt_version": 0, "steps": 4, "unknown_words": ["fox"],
     "role": "steer", "viewer_id": "v0", "watch_secret": "...", "steer_secret": "...", "latency": "default",
     "input": true, "strengths": [1.0, 0.83, 0.625, 0.357], "strength": 0.625, "input_latency_s": 0.5,
     "loras": ["ink", "neon"], "lora": "ink", "lora_scale": 0.8, "image": true}
    {"type": "audience", "role": "watch", "watchers": 23, "steered": true}
    {"type": "audience", "role": "steer", "watchers": 1, "steered": true, "steer_secret": "..."}
    {"type": "recording", "url": "/recordings/s3-20250102T030405-SECRET.mp4", "chapters": "...vtt"}
    {"type": "chunk", "index": 3, "pts": 33, "frames": 12, "prompt_version": 1, "steps": 4,
     "keyframe": false, "sizes": [2311, 187, ...], "input": "frames", "capture_ms": [...], "strength": 0.625}
    {"type": "ack", "request": "set_prompt", "prompt_version": 1, "unknown_words": []}
    {"type": "ack", "request": "set_lora", "prompt_version": 2}
    {"type": "error", "code": "invalid_field", "message": "...", "request": "set_prompt"}
    {"type": "closed", "reason": "..."}
    {"type": "answer", "sdp": "v=0..."}

Input video (issue 35): a ``start`` with ``"input": true`` restyles the viewer's video (a camera) under the prompt at
``strength``; streamsvc/wire/framing.py says how (its fields here: ``strengths``, ``input``, ``capture_ms``, ...).

Styles: a ``start`` may name a style of ``ready``'s ``loras`` (a LoRA each; ``GET /loras``) at ``lora_scale``
(default 1, 0: none; the server says its range); ``set_lora`` switches it live (``"lora": null``: none) as a prompt
switch, acked with the version its chunks carry. A style the server cannot give refuses the ``start`` with the
reason, or answers ``set_lora`` with an ``error`` (the stream goes on under its style before).

A start image: ``start``'s ``image`` (a ``data:`` URL, or an upload's id) is the stream's chunk 0, one frame (its
header's ``input`` is "image"), and generation goes on from it; streamsvc/wire/image.py says how and why.

``offer`` and ``answer`` are exactly the JSON of a browser's ``RTCSessionDescription`` (``{"type": "offer", "sdp":
...}``): the message type doubles as the SDP type, so ``JSON.stringify(pc.localDescription)`` is a valid ``offer``
message and an ``answer`` message can be handed to ``setRemoteDescription`` as is.

Steerers and watchers
---------------------
The viewer whose ``start`` opened a stream is its steerer: it holds the
stream's steer token. Links are capabilities, an id alone grants nothing: the
steerer's ``ready`` (no watcher's) carries the stream's ``watch_secret`` and
``steer_secret``, 128 random bits each. A ``watch`` with the watch secret (the
player's watch link is ``/#watch=ID&secret=...``; access checks as for
``start``) gets ``ready`` with role ``watch``, then the steerer's chunks from a
keyframe on; a wrong or missing secret gets ``not_found``, as an unknown id
does. Only the steerer may ``set_prompt``, ``pause``, ``resume``, ``record`` or
``handover``; a watcher that tries gets ``not_steerer`` and its stream goes on.
``handover`` gives the token to the watcher ``to`` (a ``viewer_id`` from its
``ready``); when the steerer leaves, the stream goes on while watchers remain,
and a ``take`` with the steer secret gives one of them the token. Every viewer
gets ``audience`` when its role or the watcher count changes. Capabilities
follow the token: a handover or a take makes the stream a new steer secret,
sent to the new steerer alone in the ``audience`` that tells it it steers; the
one before is revoked (a ``take`` or a WHIP publish with it is refused, and a
WHIP publisher that came with it is ended). ``close`` from a
watcher ends its watching only; from the steerer it ends the stream for everyone.

Unknown fields are refused (``invalid_field``), so a misspelt field is an error
rather than silently ignored. Numbers are strict: ``"16"`` or ``16.0`` is not
an integer. Every limit is a module constant.

Errors
------
``parse_client`` (and ``parse_server``) raise one exception, ``ProtocolError``,
with an ``ErrorCode`` and a message meant for the other side: malformed JSON,
an unknown type, a field out of range (the message names the field and the
allowed values), an oversized message. ``ProtocolError.to_message()`` gives the
``error`` message to send back; the stream goes on.

A server with access tokens starts a stream only with a valid ``token`` (in
``start``, or as ``Authorization: Bearer TOKEN`` on the WebSocket upgrade);
otherwise it answers ``unauthorized`` and closes the socket. A ``start``
refused for any reason gets one of ``START_REFUSALS``. An error that answers a
request names it in ``request``; replies to ``set_prompt`` and ``set_lora``
(``ack`` or ``error``) come in the order of the requests.

Binary chunk framing (WebSocket)
--------------------------------
Each chunk of video is one binary WebSocket message: a prefix, the ``chunk`` header as JSON, then its frames'
H.264 access units (streamsvc/wire/framing.py has the layout; ``pack_chunk`` and ``unpack_chunk`` are here).
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from streamsvc.wire import errors as wire_errors
from streamsvc.wire.errors import RETRYABLE, START_REFUSALS, ErrorCode  # noqa: F401 (the protocol's, kept there)

# ---------------------------------------------------------------- limits

MAX_MESSAGE_BYTES = 64 * 1024
"""Largest control message, in UTF-8 bytes (an SDP offer with all its ICE candidates fits)."""
MAX_PROMPT_CHARS = 2000
"""Longest prompt, in characters."""
FPS_MIN, FPS_MAX = 1, 60
"""Allowed frame rates, integers, inclusive (RTP timestamps are ``frame * 90000 // fps``)."""
MAX_SEED = 2**63 - 1
"""Seeds are integers in [0, MAX_SEED] (they fit an int64 generator seed)."""
MAX_STREAM_ID_CHARS = 64
MAX_TEXT_CHARS = 4000
"""Longest free text a server sends (error messages, close reasons)."""
MAX_DIMENSION = 8192
"""Largest frame width or height."""
MAX_CHUNK_FRAMES = 1024
"""Most frames in one chunk."""
MAX_STEPS = 1000
"""Denoising steps of a chunk are integers in [1, MAX_STEPS]."""
MAX_STAT = 1e9
"""Upper bound of every number in a ``stats`` message (seconds or counts)."""
MAX_TOKEN_CHARS = 256
"""Longest access token; tokens are printable ASCII without spaces."""
MAX_WORD_CHARS, MAX_VOCABULARY, MAX_UNKNOWN_WORDS = 32, 256, 64
"""Longest word, most words of a model's vocabulary and of a prompt's unknown ones (all: a ready that still fits)."""
MAX_LORA_NAME_CHARS, MAX_LORAS = 128, 256  # longest style name (a LoRA file's stem), most styles a ready lists
MAX_SECRET_CHARS = 128  # longest watch or steer secret (the server's: 22 URL-safe base64 characters, 128 bits)
MAX_CHUNK_BYTES = 16 * 1024 * 1024
"""Largest binary chunk message; give it to the WebSocket client as ``max_size``."""

CHUNK_MAGIC = b"SSC1"
_PREFIX = struct.Struct(">4sI")  # magic, header length
CHUNK_PREFIX_BYTES = _PREFIX.size  # 8


# ---------------------------------------------------------------- errors


class ProtocolError(Exception):
    """A message that breaks the protocol. ``code`` says how, ``message`` says what, for the peer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = ErrorCode(code)
        self.message = message

    def to_message(self) -> Error:
        """The ``error`` message that tells the peer about this error."""
        return Error(code=self.code, message=self.message[:MAX_TEXT_CHARS])


# ---------------------------------------------------------------- messages


class BaseMessage(BaseModel):  # every message's model: strict, no unknown fields, immutable
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


Prompt = Annotated[
    str,
    Field(min_length=1, max_length=MAX_PROMPT_CHARS, description=f"a string of 1 to {MAX_PROMPT_CHARS} characters"),
]
Sdp = Annotated[
    str,
    Field(min_length=1, max_length=MAX_MESSAGE_BYTES, description="a non-empty SDP string"),
]
Count = Annotated[int, Field(ge=0, le=int(MAX_STAT), description=f"an integer in [0, {int(MAX_STAT)}]")]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_STAT, description=f"a finite number of seconds in [0, {MAX_STAT:g}]")]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS, description=f"a string of at most {MAX_TEXT_CHARS} characters")]
Token = Annotated[
    str,
    Field(min_length=1, max_length=MAX_TOKEN_CHARS, pattern=r"^[!-~]+$",
          description=f"1 to {MAX_TOKEN_CHARS} printable ASCII characters, no spaces"),
]
Fps = Annotated[int, Field(ge=FPS_MIN, le=FPS_MAX, description=f"an integer in [{FPS_MIN}, {FPS_MAX}]")]
Version = Annotated[int, Field(ge=0, description="an integer >= 0")]
Dimension = Annotated[int, Field(ge=1, le=MAX_DIMENSION, description=f"an integer in [1, {MAX_DIMENSION}]")]
FrameCount = Annotated[int, Field(ge=1, le=MAX_CHUNK_FRAMES, description=f"an integer in [1, {MAX_CHUNK_FRAMES}]")]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS, description=f"an integer in [1, {MAX_STEPS}]")]
Strength = Annotated[float, Field(ge=0.0, le=1.0, description="a number in [0, 1]")]
LoraName = Annotated[str, Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)]  # a style's name (ready's `loras`)
ClientType = Literal["start", "watch", "set_prompt", "handover", "take", "record", "pause", "resume", "stats", "close",
                     "offer", "set_strength", "set_lora"]
StreamId = Annotated[str, Field(min_length=1, max_length=MAX_STREAM_ID_CHARS, pattern=r"^[A-Za-z0-9_.-]+$",
                                description=f"1 to {MAX_STREAM_ID_CHARS} letters, digits, '_', '.' or '-'")]
ViewerId = StreamId
Word = Annotated[str, Field(min_length=1, max_length=MAX_WORD_CHARS)]
UnknownWords = Annotated[list[Word], Field(max_length=MAX_UNKNOWN_WORDS)]
Secret = Annotated[str, Field(min_length=1, max_length=MAX_SECRET_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]


# Client -> server.


class Start(BaseMessage):
    """Open a stream. Answered by ``ready`` (or ``error`` with code ``refused``)."""

    type: Literal["start"] = "start"
    prompt: Prompt
    # Seed of the stream's noise generator; None lets the server pick one.
    seed: Annotated[int, Field(ge=0, le=MAX_SEED, description=f"an integer in [0, {MAX_SEED}]")] | None = None
    # Requested frame rate; None takes the model's.
    fps: Fps | None = None
    # How the viewer wants the frames; None means the socket this arrived on.
    transport: Literal["ws", "webrtc"] | None = Field(None, description="'ws' or 'webrtc'")
    # Access token, for servers that require one (a browser cannot set an Authorization header).
    token: Token | None = None
    input: bool = False  # the viewer sends input video (a camera) to restyle (issue 35)
    strength: Strength | None = None  # with input: how far from the input (1: text-to-video); None: the server's
    lora: LoraName | None = None  # a style of ready's `loras` (None: none)
    lora_scale: float = 1.0  # how much of it (0: none)
    # the picture the stream starts from: a data: URL or an upload's id (streamsvc/wire/image.py); None: from noise
    image: Annotated[str, Field(min_length=1, max_length=MAX_MESSAGE_BYTES)] | None = None

    @model_validator(mode="after")
    def _image_or_input(self) -> Start:
        if self.image is not None and self.input:
            raise ValueError("a stream starts from an image or restyles input video, not both (its first frame would "
                             "be both): leave out 'image' or 'input'")
        return self


class Watch(BaseMessage):
    """Receive an open stream's chunks as a watcher (no generation of one's own). Answered by ``ready`` with role
    ``watch``, or ``error`` (``not_found``, ``refused``, ...)."""

    type: Literal["watch"] = "watch"
    stream_id: StreamId
    secret: Secret | None = None  # the stream's watch secret (its watch link's); refused without the right one
    transport: Literal["ws", "webrtc"] | None = Field(None, description="'ws' or 'webrtc'")
    token: Token | None = None


class SetPrompt(BaseMessage):
    """Steer the stream. Answered at once by ``ack`` carrying the prompt's own version: its frames carry it, unless a
    newer prompt came before its chunk (prompts are coalesced: of those between two chunks the newest shows), so a
    frame of this version or a later one means it took effect."""

    type: Literal["set_prompt"] = "set_prompt"
    prompt: Prompt


class SetStrength(BaseMessage):
    """Steerer only, a stream with input: its strength from the next chunk on; ``ack`` carries the snapped value."""

    type: Literal["set_strength"] = "set_strength"
    strength: Strength


class SetLora(BaseMessage):
    """Steerer only: the stream's style from its next chunk on (a prompt switch to the same prompt); ``ack`` carries
    its version, and an ``error`` says why not (the stream goes on under its style)."""

    type: Literal["set_lora"] = "set_lora"
    lora: LoraName | None  # a style of ready's `loras`; None: none
    lora_scale: float = 1.0


class Handover(BaseMessage):
    """Steerer only: give the steer token to the watcher ``to``; the sender watches from then on."""

    type: Literal["handover"] = "handover"
    to: ViewerId


class Take(BaseMessage):
    """Take the steer token of a stream whose steerer left (refused while someone steers)."""

    type: Literal["take"] = "take"
    secret: Secret | None = None  # the stream's steer secret (its first steerer's ready); refused without it


class Record(BaseMessage):
    """Steerer only: record the stream to MP4 from its next keyframe on; answered by ``recording``."""

    type: Literal["record"] = "record"


class Pause(BaseMessage):
    """Steerer only: stop generating; the stream's cache is parked in host memory until ``resume``."""

    type: Literal["pause"] = "pause"


class Resume(BaseMessage):
    """Steerer only: bring a paused stream's cache back and generate again, exactly where it stopped."""

    type: Literal["resume"] = "resume"


class Stats(BaseMessage):
    """The viewer's playback state, sent now and then so the server sees the real buffer."""

    type: Literal["stats"] = "stats"
    buffered_s: Seconds  # video in the viewer's buffer, not yet played
    frames_played: Count
    stalls: Count = 0
    stall_s: Seconds = 0.0
    ttff_s: Seconds | None = None  # connect -> first frame; None before it
    freezes: Count = 0  # W3C freezeCount
    freeze_s: Seconds = 0.0  # W3C totalFreezesDuration
    delivered_fps: Annotated[float, Field(ge=0.0, le=1000.0, description="a number in [0, 1000]")] | None = None


class Close(BaseMessage):
    """End the stream; the server frees it and answers ``closed``."""

    type: Literal["close"] = "close"


class Offer(BaseMessage):
    """WebRTC signaling: the viewer's SDP offer with its complete ICE candidate list. Answered by ``answer``."""

    type: Literal["offer"] = "offer"
    sdp: Sdp


# Server -> client.


class Ready(BaseMessage):
    """The stream is admitted: what the viewer will receive."""

    type: Literal["ready"] = "ready"
    stream_id: Annotated[str, Field(min_length=1, max_length=MAX_STREAM_ID_CHARS)]
    fps: Fps
    width: Dimension
    height: Dimension
    first_chunk_frames: FrameCount  # frames in chunk 0 (a causal VAE makes it shorter)
    chunk_frames: FrameCount  # frames in every later chunk
    prompt_version: Version  # the version of the start prompt
    steps: Steps  # denoising steps of a chunk at full quality (a chunk with fewer was degraded)
    role: Literal["steer", "watch"] = "steer"  # this viewer steers the stream, or watches it
    viewer_id: ViewerId | None = None  # this viewer's id on the stream (the ``to`` of a handover)
    vocabulary: Annotated[list[Word], Field(max_length=MAX_VOCABULARY)] | None = None  # the model's words; None: any
    unknown_words: UnknownWords = []  # words of the stream's prompt outside ``vocabulary`` (drawn as noise), each once
    watch_secret: Secret | None = None  # what a ``watch`` of the stream needs: the steerer's ready has it
    steer_secret: Secret | None = None  # what a ``take`` of its steer token needs: the steerer's ready has it
    input: bool = False  # the stream takes the steerer's input video
    strengths: Annotated[list[Strength], Field(max_length=MAX_STEPS)] | None = None  # allowed (the schedule's sigmas)
    strength: Strength | None = None  # the stream's strength, snapped
    input_latency_s: Seconds | None = None  # a chunk is due this long after its last input frame's capture
    latency: Literal["default", "low"] = "default"  # the server's latency mode (its chunk size and buffer targets)
    loras: Annotated[list[LoraName], Field(max_length=MAX_LORAS)] | None = None  # the styles offered; None: none
    lora: LoraName | None = None  # the stream's style (None: none)
    lora_scale: float | None = None  # and its scale
    image: bool | None = None  # it started from its start's image: chunk 0 is its one frame (first_chunk_frames 1)


class Audience(BaseMessage):
    """Who is on the stream, as one viewer sees it; sent when its role, the watcher count or the pause changes."""

    type: Literal["audience"] = "audience"
    role: Literal["steer", "watch"]  # this viewer's role now
    watchers: Count  # viewers watching, the steerer not counted
    steered: bool  # someone holds the steer token (false: the steerer left; any watcher may ``take`` it)
    paused: bool = False  # the steerer paused the stream: no chunk comes until it resumes (a watcher's wait, no stall)
    # the stream's new steer secret, to the viewer a handover or a take just gave the token (the one before is
    # revoked); None in every other audience
    steer_secret: Secret | None = None


class Recording(BaseMessage):
    """The stream is being recorded: where the MP4 and its chapters (one per prompt, WebVTT) can be fetched."""

    type: Literal["recording"] = "recording"
    url: Annotated[str, Field(min_length=1, max_length=512)]
    chapters: Annotated[str, Field(min_length=1, max_length=512)] | None = None


class Chunk(BaseMessage):
    """Header of one chunk of video (see streamsvc/wire/framing.py for the binary framing)."""

    type: Literal["chunk"] = "chunk"
    index: Annotated[int, Field(ge=0)]  # chunk number in the stream, from 0
    pts: Annotated[int, Field(ge=0)]  # stream index of the chunk's first frame, in frames
    frames: FrameCount  # number of frames (= access units) in the chunk
    prompt_version: Version  # the prompt version the chunk was generated under
    steps: Steps  # denoising steps it was made with: fewer than the ready message's when degraded instead of a stall
    keyframe: bool  # the first access unit is an IDR with SPS/PPS: decoding can start here
    # "fast": encoded cheaper (higher CRF, point-sampled chroma) because it would otherwise have reached the viewer late
    encode: Literal["normal", "fast"] = "normal"
    sizes: list[Annotated[int, Field(ge=1, le=MAX_CHUNK_BYTES)]]  # byte size of each frame's access unit
    # its input: none asked, input video restyled or missing (t2v), or the start image (chunk 0 of a stream that
    # started from one: its one frame; `steps` is then the stream's full count, it was not degraded)
    input: Literal["none", "frames", "missing", "image"] = "none"
    capture_ms: list[float] | None = None  # per frame: the capture time (sender's clock, ms) of its input frame
    strength: Strength | None = None  # the strength it was made at (a stream with input)
    cut: bool = False  # a new prompt's first chunk: the player drops what it holds and has not shown, and plays this

    @model_validator(mode="after")
    def _one_size_per_frame(self) -> Chunk:
        if len(self.sizes) != self.frames or (self.capture_ms is not None and len(self.capture_ms) != self.frames):
            raise ValueError(f"sizes has {len(self.sizes)} entries (capture_ms: "
                             f"{None if self.capture_ms is None else len(self.capture_ms)}) but frames is "
                             f"{self.frames}; give one size per frame (and one capture time, with capture_ms)")
        return self

    @classmethod
    def describe(cls, access_units: list[bytes], *, index: int, pts: int, prompt_version: int, steps: int,
                 keyframe: bool, fast: bool = False, **extra) -> Chunk:
        """The header of a chunk made of ``access_units`` (sizes and frame count filled in); ``extra``: input,
        capture_ms, strength."""
        return cls(index=index, pts=pts, frames=len(access_units), prompt_version=prompt_version, steps=steps,
                   keyframe=keyframe, encode="fast" if fast else "normal", sizes=[len(au) for au in access_units],
                   **extra)


class Ack(BaseMessage):
    """A request was applied. For ``set_prompt``, the prompt's version (its frames carry it, or a later one's)."""

    type: Literal["ack"] = "ack"
    request: ClientType
    prompt_version: Version | None = None
    unknown_words: UnknownWords = []  # set_prompt: those of the prompt its version runs (not in ready's vocabulary)
    strength: Strength | None = None  # set_strength: the strength snapped to the model's schedule


class Error(BaseMessage):
    """A request failed; unless the code is in ``START_REFUSALS`` or is ``internal`` the stream goes on."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: Text
    request: ClientType | None = None  # the request this error answers; None when unknown (e.g. unparseable)


class Closed(BaseMessage):
    """The stream has ended; nothing more follows."""

    type: Literal["closed"] = "closed"
    reason: Text


class Answer(BaseMessage):
    """WebRTC signaling: the server's SDP answer with its complete ICE candidate list."""

    type: Literal["answer"] = "answer"
    sdp: Sdp


_CLIENT_MODELS = (Start, Watch, SetPrompt, Handover, Take, Record, Pause, Resume, Stats, Close, Offer, SetStrength,
                  SetLora)
_SERVER_MODELS = (Ready, Audience, Recording, Chunk, Ack, Error, Closed, Answer)
ClientMessage = Annotated[Union[_CLIENT_MODELS], Field(discriminator="type")]
ServerMessage = Annotated[Union[_SERVER_MODELS], Field(discriminator="type")]
Message = Union[_CLIENT_MODELS + _SERVER_MODELS]

_CLIENT = TypeAdapter(ClientMessage)
_SERVER = TypeAdapter(ServerMessage)
_CLIENT_TYPES = {m.model_fields["type"].default: m for m in _CLIENT_MODELS}
_SERVER_TYPES = {m.model_fields["type"].default: m for m in _SERVER_MODELS}


# ---------------------------------------------------------------- parsing


def parse_client(data: str | bytes) -> (Start | Watch | SetPrompt | Handover | Take | Record | Pause | Resume | Stats
                                        | Close | Offer | SetStrength | SetLora):
    """Parse one control message from a viewer. Raises ``ProtocolError`` and nothing else."""
    return _parse(data, _CLIENT, _CLIENT_TYPES)


def parse_server(data: str | bytes) -> Ready | Audience | Recording | Chunk | Ack | Error | Closed | Answer:
    """Parse one message from the server (text on WebSocket, or the data channel). Raises ``ProtocolError``."""
    return _parse(data, _SERVER, _SERVER_TYPES)


def encode(msg: Message) -> str:
    """The JSON text of a message."""
    return msg.model_dump_json()


def _parse(data: str | bytes, adapter: TypeAdapter, types: dict[str, type[BaseMessage]]) -> Any:
    if isinstance(data, str):
        if len(data) > MAX_MESSAGE_BYTES:  # cheap early exit: a char is at least one byte
            raise _too_large(len(data))
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(ErrorCode.BAD_JSON, "message is not valid Unicode text (lone surrogate)") from None
    elif isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
    else:
        raise ProtocolError(ErrorCode.BAD_JSON, f"expected a text message, got {type(data).__name__}")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise _too_large(len(raw))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"message is not valid UTF-8 (byte {exc.start})") from None
    try:
        return adapter.validate_json(raw)
    except ValidationError as exc:
        raise _from_validation(exc, types) from None


def _too_large(size: int) -> ProtocolError:
    return ProtocolError(ErrorCode.TOO_LARGE, f"message is {size} bytes; the limit is {MAX_MESSAGE_BYTES} bytes")


def _from_validation(exc: ValidationError, types: dict[str, type[BaseMessage]]) -> ProtocolError:
    """Turn pydantic's errors into one ProtocolError with a message a person can act on (streamsvc/wire/errors.py)."""
    return ProtocolError(*wire_errors.describe(exc, types))


# ---------------------------------------------------------------- binary chunks


def pack_chunk(header: Chunk, access_units: list[bytes]) -> bytes:
    """One binary WebSocket message: prefix, JSON header, access units. The header must describe them."""
    return pack_framed(encode(header).encode("utf-8"), header.sizes, access_units)


def unpack_chunk(data: bytes) -> tuple[Chunk, list[bytes]]:
    """Split a binary chunk message into its header and access units. Raises ``ProtocolError`` on garbage."""
    data = bytes(data)
    head = framed_header(data, "chunk", MAX_CHUNK_BYTES)
    try:
        header = parse_server(head)
    except ProtocolError as exc:
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk header: {exc.message}") from None
    if not isinstance(header, Chunk):
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"chunk header is a '{header.type}' message, expected 'chunk'")
    return header, framed_units(data, CHUNK_PREFIX_BYTES + len(head), header.sizes, "chunk")


# The framing both directions' binary messages share (chunks down, input video up: streamsvc/wire/framing.py).


def pack_framed(head: bytes, sizes: list[int], access_units: list[bytes]) -> bytes:
    """Prefix (magic, header length), the JSON header `head`, the access units, whose sizes must be `sizes`."""
    got = [len(au) for au in access_units]
    if got != sizes:
        raise ValueError(f"header sizes {sizes} do not match the access units' sizes {got}")
    return b"".join([_PREFIX.pack(CHUNK_MAGIC, len(head)), head, *access_units])


def framed_header(data: bytes, what: str, max_bytes: int) -> bytes:
    """The JSON header's bytes of a binary message (`what` names it in the errors: chunk, input), its size and
    prefix checked. Raises ``ProtocolError``."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{what} is {len(data)} bytes; the limit is {max_bytes} bytes")
    if len(data) < CHUNK_PREFIX_BYTES:
        raise ProtocolError(ErrorCode.BAD_CHUNK,
                            f"{what} is {len(data)} bytes, shorter than its {CHUNK_PREFIX_BYTES}-byte prefix")
    magic, head_len = _PREFIX.unpack_from(data)
    if magic != CHUNK_MAGIC:
        raise ProtocolError(ErrorCode.BAD_CHUNK, f"{what} starts with {magic!r}, expected magic {CHUNK_MAGIC!r}")
    head_end = CHUNK_PREFIX_BYTES + head_len
    if head_len > MAX_MESSAGE_BYTES or head_end > len(data):
        raise ProtocolError(ErrorCode.BAD_CHUNK,
                            f"{what} header length {head_len} does not fit the {len(data)}-byte message")
    return data[CHUNK_PREFIX_BYTES:head_end]


def framed_units(data: bytes, start: int, sizes: list[int], what: str) -> list[bytes]:
    """The access units of a binary message from byte `start` on, whose header gave their `sizes`."""
    payload = len(data) - start
    if payload != sum(sizes):
        raise ProtocolError(ErrorCode.BAD_CHUNK,
                            f"{what} payload is {payload} bytes but its header's sizes add up to {sum(sizes)}")
    units, offset = [], start
    for size in sizes:
        units.append(data[offset : offset + size])
        offset += size
    return units
