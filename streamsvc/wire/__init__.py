"""The wire: what a viewer and the server say to each other, and all that `client/` imports of the service.

- `protocol`: the messages (JSON text and binary chunks), their limits and error codes, parsed with pydantic.
- `errors`: how a message pydantic refused is told to its sender (one code, the field, what it allows).
- `framing`: a camera's binary input messages (a header and one H.264 access unit).
- `image`: a start image: its carriers (a data: URL in start, or an upload's id) and caps.
- `rtc`: WebRTC conventions both ends share (the control channel, codec preferences, ICE without STUN).

Nothing here imports anything else of ours.
"""
