"""The viewer protocol (streamsvc/viewers/protocol.py) without I/O: exact action lists for each path."""

import json

from streamsvc.viewers.protocol import (MAX_HELD, Admit, Control, Input, Send, State, Violation, ViewerProtocol,
                                        Watch)
from streamsvc.wire import protocol as P

START = json.dumps({"type": "start", "prompt": "a red ball moving right"})
WATCH = json.dumps({"type": "watch", "stream_id": "s3", "secret": "w" * 22})


def msg(type_: str, **fields) -> str:
    return json.dumps({"type": type_, **fields})


def steering(takes_input: bool = False) -> ViewerProtocol:
    v = ViewerProtocol()
    assert v.receive(START) == [Admit(P.parse_client(START))]
    assert v.admitted("s0", steers=True, takes_input=takes_input) == []
    return v


def test_start_is_admitted_and_its_requests_go_to_its_stream():
    v = ViewerProtocol()
    assert v.receive(START) == [Admit(P.Start(prompt="a red ball moving right"))] and v.state is State.ADMITTING
    assert v.admitted("s0", steers=True) == [] and v.state is State.STEERING
    for text in (msg("set_prompt", prompt="a blue square"), msg("pause"), msg("resume"), msg("record"),
                 msg("stats", buffered_s=0.5, frames_played=8, stalls=0), msg("close")):
        assert v.receive(text) == [Control(P.parse_client(text))]


def test_watch_is_admitted_as_a_watcher_whose_requests_go_to_its_stream_too():
    """Whose requests a stream carries out (a watcher's set_prompt is refused there) is the stream's to decide."""
    v = ViewerProtocol()
    assert v.receive(WATCH) == [Watch(P.parse_client(WATCH))]
    assert v.admitted("s3", steers=False) == [] and v.state is State.WATCHING
    assert v.receive(msg("set_prompt", prompt="x")) == [Control(P.SetPrompt(prompt="x"))]


def test_take_and_handover_go_to_the_stream_and_the_role_follows_the_token():
    v = ViewerProtocol()
    v.receive(WATCH)
    v.admitted("s3", steers=False)
    take = msg("take", secret="s" * 22)
    assert v.receive(take) == [Control(P.parse_client(take))]
    v.role(steers=True)  # the stream gave it the token
    assert v.state is State.STEERING
    assert v.receive(msg("handover", to="v7")) == [Control(P.Handover(to="v7"))]
    v.role(steers=False)
    assert v.state is State.WATCHING
    error = v.receive(START)[0].message  # the text says what it does now
    assert error.code is P.ErrorCode.ALREADY_STARTED and "already watches stream s3" in error.message


def test_a_second_start_or_watch_is_answered_and_counted():
    v = steering()
    for text in (START, WATCH):
        actions = v.receive(text)
        assert [type(a) for a in actions] == [Send, Violation]
        assert actions[0].message.code is P.ErrorCode.ALREADY_STARTED
        assert "already steers stream s0" in actions[0].message.message
    assert v.state is State.STEERING


def test_requests_before_start_and_bad_messages_are_answered_and_counted():
    v = ViewerProtocol()
    actions = v.receive(msg("set_prompt", prompt="x"))
    not_started = P.Error(code=P.ErrorCode.NOT_STARTED, message="send 'start' or 'watch' before 'set_prompt'")
    assert actions == [Send(not_started), Violation()]
    for bad in ("not json", msg("warp_drive"), b"\x00\x01"):
        actions = v.receive(bad)
        assert [type(a) for a in actions] == [Send, Violation] and actions[0].message.type == "error"
    assert v.state is State.NEW


def test_input_is_the_binary_messages_of_a_viewer_whose_stream_takes_its_camera():
    assert steering(takes_input=True).receive(b"frame") == [Input(b"frame")]
    actions = steering(takes_input=False).receive(b"frame")  # no camera: binary is a bad message
    assert [type(a) for a in actions] == [Send, Violation]
    v = ViewerProtocol()
    v.receive(WATCH)
    v.admitted("s3", steers=False, takes_input=True)  # only a steerer's camera is taken
    assert [type(a) for a in v.receive(b"frame")] == [Send, Violation]


def test_an_offer_goes_to_the_stream_which_answers_it():
    v = steering()
    offer = msg("offer", sdp="v=0\r\n")
    assert v.receive(offer) == [Control(P.Offer(sdp="v=0\r\n"))]


def test_a_refused_start_may_be_asked_again_and_what_came_meanwhile_follows_in_order():
    v = ViewerProtocol()
    assert v.receive(START) == [Admit(P.parse_client(START))]
    assert v.receive(msg("pause")) == [] and v.receive(START) == []  # held while admitting
    actions = v.refused()
    assert [type(a) for a in actions] == [Send, Violation, Admit]  # pause before start; then the start again
    assert actions[0].message.code is P.ErrorCode.NOT_STARTED and v.state is State.ADMITTING
    assert v.admitted("s1", steers=True) == [] and v.state is State.STEERING


def test_what_came_while_admitting_comes_out_with_the_admission_and_is_bounded():
    v = ViewerProtocol()
    v.receive(START)
    for k in range(MAX_HELD):
        assert v.receive(msg("set_prompt", prompt=f"p{k}")) == []
    over = v.receive(msg("set_prompt", prompt="one too many"))
    assert [type(a) for a in over] == [Send, Violation]
    assert v.admitted("s0", steers=True) == [Control(P.SetPrompt(prompt=f"p{k}")) for k in range(MAX_HELD)]


def test_once_closed_nothing_more_is_read():
    v = steering()
    v.closed()
    assert v.state is State.CLOSED
    assert v.receive(msg("set_prompt", prompt="x")) == [] and v.receive(b"frame") == [] and v.receive(START) == []


def test_a_data_channel_carries_a_stream_s_requests_only():
    """A WebRTC viewer's data channel (transport/webrtc.py): its stream's requests; a start, a watch or an offer
    belongs on the WebSocket that signals the peer connection."""
    v = ViewerProtocol.on_channel("s2")
    assert v.receive_on_channel(msg("set_prompt", prompt="x")) == [Control(P.SetPrompt(prompt="x"))]
    for text in (START, WATCH, msg("offer", sdp="v=0\r\n")):
        actions = v.receive_on_channel(text)
        assert [type(a) for a in actions] == [Send, Violation]
        assert actions[0].message.code is P.ErrorCode.INVALID_FIELD and "on the WebSocket" in actions[0].message.message
    assert [type(a) for a in v.receive_on_channel("{")] == [Send, Violation]
    v.closed()
    assert v.receive_on_channel(msg("pause")) == []
