"""The input messages of streamsvc/wire/framing.py and the protocol's input fields (issue 35)."""

from __future__ import annotations

import json

import pytest

from streamsvc.wire import protocol as P
from streamsvc.wire.framing import MAX_INPUT_BYTES, InputHeader, pack_input, unpack_input


def test_input_round_trip_and_layout():
    units = [b"\x00\x00\x00\x01\x65abc", b"\x00\x00\x00\x01\x41d"]
    header = InputHeader.describe(units, [1.7e12, 1.7e12 + 62.5], index=3, pts=36, keyframe=True)
    data = pack_input(header, units)
    head = header.model_dump_json().encode()
    assert data == b"SSC1" + len(head).to_bytes(4, "big") + head + units[0] + units[1]
    assert json.loads(head) == {"type": "input", "index": 3, "pts": 36, "frames": 2, "keyframe": True,
                                "capture_ms": [1.7e12, 1.7e12 + 62.5], "sizes": [8, 6]}
    assert unpack_input(data) == (header, units)


@pytest.mark.parametrize("data, words", [
    (b"SSC", "shorter than its 8-byte prefix"),
    (b"XXXX\x00\x00\x00\x00", "expected magic"),
    (b"SSC1\x00\x00\x00\x02{}", "missing field 'index' in 'input' message"),
    (b"SSC1\x00\x00\x00\x04\xff\xfe{}", "input header"),
    (b"SSC1\x00\x00\x10\x00{}", "does not fit"),
])
def test_garbage_input_says_what_is_wrong(data, words):
    with pytest.raises(P.ProtocolError) as e:
        unpack_input(data)
    assert e.value.code is P.ErrorCode.BAD_CHUNK and words in e.value.message


def test_input_fields_are_checked():
    units = [b"ab"]
    good = InputHeader.describe(units, [5.0], index=0, pts=0, keyframe=False)
    with pytest.raises(ValueError, match="do not match"):
        pack_input(good, [b"abc"])
    short = pack_input(good, units)[:-1]
    with pytest.raises(P.ProtocolError, match="payload is 1 bytes"):
        unpack_input(short)
    head = json.dumps({"type": "input", "index": 0, "pts": 0, "frames": 1, "keyframe": False, "capture_ms": [1, 2],
                       "sizes": [2]}).encode()
    with pytest.raises(P.ProtocolError, match="one of each per frame"):
        unpack_input(b"SSC1" + len(head).to_bytes(4, "big") + head + b"ab")
    with pytest.raises(P.ProtocolError, match="limit"):
        unpack_input(b"SSC1" + bytes(MAX_INPUT_BYTES))


def test_start_and_set_strength_and_the_chunks_input_fields():
    start = P.parse_client('{"type": "start", "prompt": "a ball", "input": true, "strength": 0.6}')
    assert start.input is True and start.strength == 0.6
    assert P.parse_client('{"type": "start", "prompt": "a"}').input is False
    with pytest.raises(P.ProtocolError, match="strength"):
        P.parse_client('{"type": "start", "prompt": "a", "input": true, "strength": 1.5}')
    assert P.parse_client('{"type": "set_strength", "strength": 0.25}') == P.SetStrength(strength=0.25)
    units = [b"a", b"b"]
    chunk = P.Chunk.describe(units, index=1, pts=9, prompt_version=0, steps=4, keyframe=False, input="frames",
                             capture_ms=[10.0, 72.5], strength=0.625)
    assert P.unpack_chunk(P.pack_chunk(chunk, units))[0] == chunk
    with pytest.raises(ValueError, match="one capture time"):
        P.Chunk.describe(units, index=1, pts=9, prompt_version=0, steps=4, keyframe=False, capture_ms=[1.0])
