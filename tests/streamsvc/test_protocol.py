import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsvc.wire import protocol as p
from streamsvc.wire.protocol import ErrorCode, ProtocolError

fast = settings(max_examples=150, deadline=None)

# ---------------------------------------------------------------- strategies

prompts = st.text(min_size=1, max_size=50)
counts = st.integers(0, int(p.MAX_STAT))
seconds = st.floats(0.0, p.MAX_STAT, allow_nan=False)
versions = st.integers(0, 2**40)
fps = st.integers(p.FPS_MIN, p.FPS_MAX)
words = st.text(min_size=1, max_size=p.MAX_WORD_CHARS)

client_messages = st.one_of(
    st.builds(
        p.Start,
        prompt=prompts,
        seed=st.none() | st.integers(0, p.MAX_SEED),
        fps=st.none() | fps,
        transport=st.sampled_from([None, "ws", "webrtc"]),
    ),
    st.builds(p.SetPrompt, prompt=prompts),
    st.builds(p.Pause),
    st.builds(p.Resume),
    st.builds(p.Close),
    st.builds(
        p.Stats,
        buffered_s=seconds,
        frames_played=counts,
        stalls=counts,
        stall_s=seconds,
        ttff_s=st.none() | seconds,
        freezes=counts,
        freeze_s=seconds,
        delivered_fps=st.none() | st.floats(0, 1000),
    ),
    st.builds(p.Offer, sdp=st.text(min_size=1, max_size=200)),
)


@st.composite
def chunks(draw):
    units = draw(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8))
    header = p.Chunk.describe(
        units,
        index=draw(st.integers(0, 10**6)),
        pts=draw(st.integers(0, 10**9)),
        prompt_version=draw(versions),
        steps=draw(st.integers(1, p.MAX_STEPS)),
        keyframe=draw(st.booleans()),
    )
    return header, units


server_messages = st.one_of(
    st.builds(
        p.Ready,
        stream_id=st.text(min_size=1, max_size=p.MAX_STREAM_ID_CHARS),
        fps=fps,
        width=st.integers(1, p.MAX_DIMENSION),
        height=st.integers(1, p.MAX_DIMENSION),
        first_chunk_frames=st.integers(1, p.MAX_CHUNK_FRAMES),
        chunk_frames=st.integers(1, p.MAX_CHUNK_FRAMES),
        prompt_version=versions,
        steps=st.integers(1, p.MAX_STEPS),
        vocabulary=st.none() | st.lists(words, max_size=20),
        unknown_words=st.lists(words, max_size=5),
    ),
    chunks().map(lambda hu: hu[0]),
    st.builds(
        p.Ack, request=st.sampled_from(["set_prompt", "pause", "resume", "close"]), prompt_version=st.none() | versions,
        unknown_words=st.lists(words, max_size=5),
    ),
    st.builds(p.Error, code=st.sampled_from(list(ErrorCode)), message=st.text(max_size=100)),
    st.builds(p.Closed, reason=st.text(max_size=100)),
    st.builds(p.Answer, sdp=st.text(min_size=1, max_size=200)),
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(
    ["type", "prompt", "seed", "fps", "transport", "buffered_s", "frames_played", "stalls", "sdp", "extra"]
)
message_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["start", "set_prompt", "pause", "stats", "offer", "close", "nope", ""]) | json_values},
    optional={"prompt": json_values | prompts, "fps": json_values | st.integers(-5, 100)},
).flatmap(lambda base: st.dictionaries(field_names, json_values, max_size=3).map(lambda extra: {**extra, **base}))


def parse_or_protocol_error(data):
    """parse_client may return a message or raise ProtocolError with a message; nothing else."""
    try:
        return p.parse_client(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert exc.message and "Traceback" not in exc.message
        return None


# ---------------------------------------------------------------- fuzzing


@fast
@given(st.text(max_size=300))
def test_any_text_parses_or_raises_protocol_error(text):
    parse_or_protocol_error(text)


@fast
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_protocol_error(data):
    parse_or_protocol_error(data)


@fast
@given(json_values)
def test_any_json_parses_or_raises_protocol_error(value):
    parse_or_protocol_error(json.dumps(value))


@fast
@given(message_like)
def test_message_like_objects_parse_or_raise_protocol_error(obj):
    msg = parse_or_protocol_error(json.dumps(obj))
    if msg is not None:
        assert msg.type == obj["type"]


@fast
@given(client_messages)
def test_client_messages_round_trip(msg):
    assert p.parse_client(p.encode(msg)) == msg
    assert p.parse_client(p.encode(msg).encode("utf-8")) == msg


@fast
@given(server_messages)
def test_server_messages_round_trip(msg):
    assert p.parse_server(p.encode(msg)) == msg


def test_client_and_server_messages_do_not_mix():
    with pytest.raises(ProtocolError) as err:
        p.parse_client(p.encode(p.Closed(reason="bye")))
    assert err.value.code is ErrorCode.UNKNOWN_TYPE
    with pytest.raises(ProtocolError):
        p.parse_server(p.encode(p.Pause()))


# ---------------------------------------------------------------- error messages


def error_of(data) -> ProtocolError:
    with pytest.raises(ProtocolError) as err:
        p.parse_client(data)
    return err.value


def test_malformed_json():
    err = error_of('{"type": "start", "prompt": ')
    assert err.code is ErrorCode.BAD_JSON and "malformed JSON" in err.message


@pytest.mark.parametrize("data", ["[1, 2]", "3", '"start"', "null"])
def test_non_object_json(data):
    err = error_of(data)
    assert err.code is ErrorCode.BAD_JSON and "expected a JSON object" in err.message


def test_invalid_utf8():
    err = error_of(b'{"type": "pause", "x": "\xff"}')
    assert err.code is ErrorCode.BAD_JSON and "UTF-8" in err.message


def test_lone_surrogate_text():
    assert error_of('{"type": "set_prompt", "prompt": "\ud800"}').code is ErrorCode.BAD_JSON


def test_deeply_nested_json_is_refused_not_crashed():
    assert error_of("[" * 20_000 + "]" * 20_000).code is ErrorCode.BAD_JSON


def test_unknown_and_missing_type_list_the_known_types():
    err = error_of('{"type": "launch_missiles"}')
    assert err.code is ErrorCode.UNKNOWN_TYPE
    assert "'launch_missiles'" in err.message and "set_prompt" in err.message
    err = error_of('{"prompt": "a cat"}')
    assert err.code is ErrorCode.UNKNOWN_TYPE and "no 'type' field" in err.message


def test_out_of_range_names_the_field_and_the_range():
    err = error_of('{"type": "start", "prompt": "a cat", "fps": 1000}')
    assert err.code is ErrorCode.INVALID_FIELD
    assert "'fps'" in err.message and f"[{p.FPS_MIN}, {p.FPS_MAX}]" in err.message and "1000" in err.message


def test_prompt_too_long_names_the_limit():
    err = error_of(p.encode(p.SetPrompt(prompt="x")).replace('"x"', '"' + "x" * (p.MAX_PROMPT_CHARS + 1) + '"'))
    assert err.code is ErrorCode.INVALID_FIELD
    assert "'prompt'" in err.message and str(p.MAX_PROMPT_CHARS) in err.message
    assert len(err.message) < 500  # the input is not echoed whole


def test_strict_types():
    for bad in ['"16"', "16.0", "true"]:
        err = error_of(f'{{"type": "start", "prompt": "a", "fps": {bad}}}')
        assert err.code is ErrorCode.INVALID_FIELD and "'fps'" in err.message


def test_missing_and_unknown_fields():
    err = error_of('{"type": "start", "promt": "a cat"}')
    assert err.code is ErrorCode.INVALID_FIELD
    assert "missing field 'prompt'" in err.message and "unknown field 'promt'" in err.message


def ready(**kw) -> p.Ready:
    return p.Ready(stream_id="s0", fps=16, width=128, height=128, first_chunk_frames=9, chunk_frames=12,
                   prompt_version=0, steps=4, **kw)


def test_ready_and_ack_carry_the_vocabulary_and_the_unknown_words_within_bounds():
    """What the model understands travels in ready (its vocabulary, the start prompt's unknown words) and in a
    set_prompt's ack (the new prompt's); none of it unbounded (issue 33)."""
    r = p.parse_server(p.encode(ready(vocabulary=["a", "ball", "red"], unknown_words=["fox"])))
    assert (r.vocabulary, r.unknown_words) == (["a", "ball", "red"], ["fox"])
    assert (ready().vocabulary, ready().unknown_words) == (None, [])  # an open vocabulary (umT5): nothing unknown
    ack = p.parse_server('{"type": "ack", "request": "set_prompt", "prompt_version": 2, "unknown_words": ["snow"]}')
    assert ack.unknown_words == ["snow"] and p.Ack(request="pause").unknown_words == []
    biggest = ready(vocabulary=["\U0001F98A" * p.MAX_WORD_CHARS] * p.MAX_VOCABULARY,
                    unknown_words=["\U0001F98A" * p.MAX_WORD_CHARS] * p.MAX_UNKNOWN_WORDS)
    assert len(p.encode(biggest).encode()) < p.MAX_MESSAGE_BYTES  # the largest ready still parses
    assert p.parse_server(p.encode(biggest)) == biggest
    for field, value in [("vocabulary", ["w"] * (p.MAX_VOCABULARY + 1)), ("unknown_words", ["w"] * 65),
                         ("unknown_words", ["x" * (p.MAX_WORD_CHARS + 1)]), ("unknown_words", [""])]:
        text = p.encode(ready()).replace(f'"{field}":' + ("null" if field == "vocabulary" else "[]"),
                                         f'"{field}":' + json.dumps(value))
        with pytest.raises(ProtocolError) as err:
            p.parse_server(text)
        assert err.value.code is ErrorCode.INVALID_FIELD and f"'{field}" in err.value.message, err.value.message


def test_nan_is_refused():
    err = error_of('{"type": "stats", "buffered_s": NaN, "frames_played": 0}')
    assert err.code is ErrorCode.INVALID_FIELD and "'buffered_s'" in err.message


def test_oversized_message():
    data = '{"type": "set_prompt", "prompt": "' + "x" * p.MAX_MESSAGE_BYTES + '"}'
    for form in (data, data.encode()):
        err = error_of(form)
        assert err.code is ErrorCode.TOO_LARGE and str(p.MAX_MESSAGE_BYTES) in err.message
    # Size is counted in UTF-8 bytes: 30000 three-byte characters are too large.
    assert error_of('{"type": "offer", "sdp": "' + "€" * 30_000 + '"}').code is ErrorCode.TOO_LARGE


def test_a_realistic_sdp_offer_fits():
    lines = ["v=0", "o=- 1 2 IN IP4 127.0.0.1", "s=-", "t=0 0"]
    lines += [f"a=candidate:{i} 1 udp 2130706431 127.0.0.1 {50000 + i} typ host" for i in range(40)]
    lines += [f"a=rtpmap:{96 + i} H264/90000" for i in range(30)] * 4
    sdp = "\r\n".join(lines) + "\r\n"
    msg = p.parse_client(json.dumps({"type": "offer", "sdp": sdp}))  # exactly a browser's RTCSessionDescription
    assert msg == p.Offer(sdp=sdp)


def test_protocol_error_becomes_an_error_message():
    err = error_of("{")
    msg = p.parse_server(p.encode(err.to_message()))
    assert msg == p.Error(code=ErrorCode.BAD_JSON, message=err.message)


def test_answer_is_an_rtc_session_description():
    assert json.loads(p.encode(p.Answer(sdp="v=0\r\n"))) == {"type": "answer", "sdp": "v=0\r\n"}


# ---------------------------------------------------------------- binary chunks


@fast
@given(chunks())
def test_pack_unpack_round_trip(header_units):
    header, units = header_units
    data = p.pack_chunk(header, units)
    assert data[:4] == p.CHUNK_MAGIC
    assert p.unpack_chunk(data) == (header, units)


def test_wire_layout():
    units = [b"\x00\x00\x00\x01\x65abc", b"\x00\x00\x00\x01\x41d"]
    header = p.Chunk.describe(units, index=2, pts=21, prompt_version=1, steps=3, keyframe=True, fast=True)
    data = p.pack_chunk(header, units)
    head = p.encode(header).encode()
    assert data == b"SSC1" + len(head).to_bytes(4, "big") + head + units[0] + units[1]
    assert json.loads(head) == {
        "type": "chunk", "index": 2, "pts": 21, "frames": 2, "prompt_version": 1, "steps": 3, "keyframe": True,
        "encode": "fast", "sizes": [8, 6], "input": "none", "capture_ms": None, "strength": None, "cut": False,
    }
    assert p.Chunk.describe(units, index=2, pts=21, prompt_version=1, steps=3, keyframe=True).encode == "normal"


@fast
@given(st.binary(max_size=200))
def test_garbage_chunks_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        p.unpack_chunk(data)


@fast
@given(chunks(), st.data())
def test_truncated_or_extended_chunks_are_refused(header_units, data):
    packed = p.pack_chunk(*header_units)
    cut = data.draw(st.integers(0, len(packed) - 1))
    with pytest.raises(ProtocolError) as err:
        p.unpack_chunk(packed[:cut])
    assert err.value.code is ErrorCode.BAD_CHUNK
    with pytest.raises(ProtocolError):
        p.unpack_chunk(packed + b"\x00")


def frame_with(head: bytes, payload: bytes = b"") -> bytes:
    return b"SSC1" + len(head).to_bytes(4, "big") + head + payload


def raw_header(frames: int, sizes: list[int]) -> bytes:
    """A chunk header written by hand, so that it can be inconsistent."""
    fields = {"type": "chunk", "index": 0, "pts": 0, "frames": frames, "prompt_version": 0, "steps": 4, "keyframe": True}
    return json.dumps({**fields, "sizes": sizes}).encode()


@pytest.mark.parametrize(
    "data, says",
    [
        (b"SSC", "shorter than"),
        (b"XXXX" + bytes(4), "magic"),
        (b"SSC1" + (10**6).to_bytes(4, "big") + b"{}", "does not fit"),
        (frame_with(b"not json"), "malformed JSON"),
        (frame_with(p.encode(p.Closed(reason="x")).encode()), "'closed' message"),
        (frame_with(raw_header(2, [1]), b"a"), "one size per frame"),
        (frame_with(raw_header(1, [3]), b"ab"), "add up to 3"),
        (frame_with(raw_header(1, [0])), "'sizes.0'"),
    ],
)
def test_bad_chunks_say_what_is_wrong(data, says):
    with pytest.raises(ProtocolError) as err:
        p.unpack_chunk(data)
    assert err.value.code is ErrorCode.BAD_CHUNK and says in err.value.message


def test_pack_refuses_a_header_that_does_not_match():
    header = p.Chunk.describe([b"ab"], index=0, pts=0, prompt_version=0, steps=4, keyframe=True)
    with pytest.raises(ValueError, match="do not match"):
        p.pack_chunk(header, [b"abc"])


# ---------------------------------------------------------------- access fields: start's token, error's request

tokens = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=p.MAX_TOKEN_CHARS)


@fast
@given(st.builds(p.Start, prompt=prompts, token=st.none() | tokens),
       st.builds(p.Error, code=st.sampled_from(ErrorCode), message=st.text(max_size=50),
                 request=st.none() | st.sampled_from(["start", "set_prompt", "pause", "resume", "stats", "close", "offer"])))
def test_token_and_request_fields_round_trip(start, error):
    assert p.parse_client(p.encode(start)) == start
    assert p.parse_server(p.encode(error)) == error


@fast
@given(json_values | st.text(max_size=300))
def test_any_token_value_parses_or_is_an_invalid_field_naming_it(token):
    data = json.dumps({"type": "start", "prompt": "a cat", "token": token})
    try:
        msg = p.parse_client(data)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.INVALID_FIELD and "token" in exc.message
    else:
        assert msg.token == token
        assert token is None or (1 <= len(token) <= p.MAX_TOKEN_CHARS and all("!" <= c <= "~" for c in token))


@pytest.mark.parametrize("token", ["", "has space", "tab\there", "caf\u00e9", "x" * (p.MAX_TOKEN_CHARS + 1), 7, None])
def test_bad_tokens_are_refused_with_what_a_token_is(token):
    if token is None:  # null is "no token"
        assert p.parse_client(json.dumps({"type": "start", "prompt": "a", "token": None})).token is None
        return
    with pytest.raises(ProtocolError) as err:
        p.parse_client(json.dumps({"type": "start", "prompt": "a", "token": token}))
    assert err.value.code is ErrorCode.INVALID_FIELD and "'token'" in err.value.message


def test_an_error_names_an_unknown_request_type_as_invalid():
    with pytest.raises(ProtocolError) as err:
        p.parse_server(json.dumps({"type": "error", "code": "rate_limited", "message": "m", "request": "teleport"}))
    assert err.value.code is ErrorCode.INVALID_FIELD and "'request'" in err.value.message


def test_start_refusals_are_the_codes_that_end_a_start():
    assert p.START_REFUSALS == {ErrorCode.REFUSED, ErrorCode.UNAUTHORIZED, ErrorCode.TOO_MANY_STREAMS,
                                ErrorCode.NOT_FOUND, ErrorCode.BAD_IMAGE}


def test_watch_names_a_stream_and_steering_messages_parse():
    watch = p.parse_client(json.dumps({"type": "watch", "stream_id": "s3", "transport": "webrtc"}))
    assert isinstance(watch, p.Watch) and watch.stream_id == "s3" and watch.transport == "webrtc"
    assert p.parse_client(json.dumps({"type": "handover", "to": "v7"})) == p.Handover(to="v7")
    assert isinstance(p.parse_client('{"type": "take"}'), p.Take)
    assert isinstance(p.parse_client('{"type": "record"}'), p.Record)
    with pytest.raises(ProtocolError) as err:
        p.parse_client(json.dumps({"type": "watch", "stream_id": "../s3"}))
    assert err.value.code is ErrorCode.INVALID_FIELD and "'stream_id'" in err.value.message


def test_watch_and_take_carry_a_secret_of_bounded_length_and_ready_gives_both():
    watch = p.parse_client(json.dumps({"type": "watch", "stream_id": "s3", "secret": "Ab_-9" * 4}))
    assert watch.secret == "Ab_-9" * 4 and p.Watch(stream_id="s3").secret is None  # missing: the server refuses
    assert p.parse_client('{"type": "take", "secret": "x_Y-z"}') == p.Take(secret="x_Y-z")
    for secret in ("a" * (p.MAX_SECRET_CHARS + 1), "", "a b", "a/b", 7):
        with pytest.raises(ProtocolError) as err:
            p.parse_client(json.dumps({"type": "watch", "stream_id": "s3", "secret": secret}))
        assert err.value.code is ErrorCode.INVALID_FIELD and "'secret'" in err.value.message, secret
    ready = p.Ready(stream_id="s1", fps=16, width=64, height=64, first_chunk_frames=9, chunk_frames=12,
                    prompt_version=0, steps=4, watch_secret="w" * 22, steer_secret="s" * 22)
    assert p.parse_server(p.encode(ready)) == ready


def test_ready_says_the_role_and_audience_round_trips():
    ready = p.parse_server(json.dumps({"type": "ready", "stream_id": "s1", "fps": 16, "width": 64, "height": 64,
                                       "first_chunk_frames": 9, "chunk_frames": 12, "prompt_version": 0, "steps": 4}))
    assert ready.role == "steer" and ready.viewer_id is None  # a server that predates watchers
    audience = p.Audience(role="watch", watchers=23, steered=False)
    assert p.parse_server(p.encode(audience)) == audience
    rec = p.Recording(url="/recordings/s1.mp4", chapters="/recordings/s1.vtt")
    assert p.parse_server(p.encode(rec)) == rec
