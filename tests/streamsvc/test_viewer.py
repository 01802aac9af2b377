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


def test_a_whep_post_s_start_and_offer_come_parsed_and_follow_the_same_paths():
    """A door of another protocol (a WHEP POST) hands its start and offer over as messages: the same actions, and one
    that comes while admitting is held as a text would be."""
    v = ViewerProtocol()
    start, offer = P.Start(prompt="a red ball", transport="webrtc"), P.Offer(sdp="v=0\r\n")
    assert v.receive_message(start) == [Admit(start)]
    assert v.receive_message(offer) == []  # held until the start is answered
    assert v.admitted("s0", steers=True) == [Control(offer)]
    assert v.receive_message(P.Close()) == [Control(P.Close())]
    assert v.receive_message(start) == [Send(P.Error(code=P.ErrorCode.ALREADY_STARTED, message=(
        "this connection already steers stream s0; open another connection for another stream"))), Violation()]


class _Outlet:
    def __init__(self) -> None:
        self.sent, self.closed = [], None

    async def send(self, message) -> None:
        self.sent.append(message)

    async def close(self, code: int = 1000, reason: str = "", linger: bool = True) -> None:
        self.closed = (code, reason)

    def buffered(self) -> int:
        return 0


async def test_the_driver_sends_a_refusal_closes_after_an_unauthorized_one_and_lets_a_refused_viewer_ask_again():
    """ViewerDriver (streamsvc/viewers/driver.py) carries out the actions: the host's refusal goes out on the outlet
    (an unauthorized one closes it, 1008), the protocol is told, and the next start is asked of the host again."""
    from types import SimpleNamespace

    from streamsvc.door.entry import Client, Refused
    from streamsvc.viewers.driver import ViewerDriver

    asked, errors = [], []
    refusals = [Refused(P.Error(code=P.ErrorCode.REFUSED, message="no room", request="start")),
                Refused(P.Error(code=P.ErrorCode.UNAUTHORIZED, message="no token", request="start"), close=True)]

    async def admit(client, msg, outlet):
        asked.append((client.address, msg.prompt))
        return refusals.pop(0)

    host = SimpleNamespace(admit=admit, metrics=SimpleNamespace(errors=SimpleNamespace(inc=lambda: errors.append(1))),
                           streamless=SimpleNamespace(event=lambda: None))
    outlet = _Outlet()
    driver = ViewerDriver(host, Client("10.0.0.7"), outlet)
    assert await driver.receive(START) and driver.viewer is None
    assert [m.code for m in outlet.sent] == [P.ErrorCode.REFUSED] and outlet.closed is None
    assert driver.protocol.state is State.NEW and driver.refusal.message == "no room"
    assert await driver.receive(msg("pause")) and outlet.sent[-1].code is P.ErrorCode.NOT_STARTED and errors == [1]
    await driver.receive(START)
    assert outlet.sent[-1].code is P.ErrorCode.UNAUTHORIZED and outlet.closed == (1008, "unauthorized")
    assert asked == [("10.0.0.7", "a red ball moving right")] * 2
    await driver.close()
