"""WHIP through the cluster's gateway (issue 36): a POST /whip/{stream} goes to the replica that runs the stream (its
id names it, as a watch's does), whose server answers it (streamsvc/door/whip.py, through `EngineReplica.http`); the
media then flows between the encoder and that replica. The gateway keeps the session's Location (its own secret) and
forwards its DELETE to the replica. The gateway holds no steer secret: the replica checks the POST's, and ends the
session when a handover or a take revokes it (streamsvc/door/whip.py). WHEP needs none of this: a WHEP session is a
connection of the gateway's own handler (streamsvc/door/whep.py), placed and relayed as a /ws viewer is.
"""

from __future__ import annotations

import contextlib
import http
import logging

from streamsvc.door.routes import HttpReply, HttpRequest, text_reply
from streamsvc.door.whep import HttpSession

log = logging.getLogger("streamsvc.cluster.gateway")

MAX_RELAYED = 4096  # WHIP sessions the gateway keeps a Location of; past it the oldest is forgotten (one that ended
# on its replica, by ICE, with its stream or by a handover, is only forgotten so: the replica does not tell the gateway)
FORWARDED = ("content-type", "x-forwarded-for", "user-agent")  # the POST's headers the replica sees (no token:
# the gateway checked it)


class RelayedIngest:
    """The gateway's WHIP endpoint (whep.Endpoints calls `publish` once it has checked the token, content type,
    rate and offer)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    async def publish(self, endpoints, request: HttpRequest, stream_id: str, offer: str) -> HttpReply:
        g = self.gateway
        uid = g.replica_of(stream_id)
        if uid is None:  # the replica's answer to a stream it does not run
            return text_reply(http.HTTPStatus.NOT_FOUND,
                              f"no open stream {stream_id[:64]!r} here with this steer secret")
        address = g.guard.client(request)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() in FORWARDED]
        try:
            status, answer_headers, body = await g.call("http", "POST", request.target, headers, request.body,
                                                         address, replica=uid, timeout_s=g.gateway.place_timeout_s)
        except Exception as e:  # noqa: BLE001 - the replica is gone or does not answer
            log.warning("WHIP into %s on %s failed (%s: %s)", stream_id, uid, type(e).__name__, e)
            return text_reply(http.HTTPStatus.SERVICE_UNAVAILABLE, f"the worker of stream {stream_id[:64]} does not "
                              f"answer ({type(e).__name__}); the stream may be gone")
        answer_headers = list(answer_headers)
        if status == http.HTTPStatus.CREATED:
            there = dict(answer_headers)["Location"]

            async def close() -> None:
                endpoints.forget(here)
                with contextlib.suppress(Exception):
                    await g.call("http", "DELETE", there, [], b"", address, replica=uid)

            relayed = [key for key, session in endpoints.sessions.items() if session.kind == "whip"]
            for key in relayed[: max(0, len(relayed) - MAX_RELAYED + 1)]:  # the oldest first (dicts keep order)
                endpoints.sessions.pop(key, None)
            here = endpoints.register(HttpSession("whip", stream_id, False, close))
            answer_headers = [(k, f"/whip/session/{here}" if k == "Location" else v) for k, v in answer_headers]
        return HttpReply(http.HTTPStatus(status), tuple(answer_headers), body)
