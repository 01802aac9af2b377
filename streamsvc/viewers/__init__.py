"""The viewers: a stream as the server sees it, and the people who watch and steer it.

- `server`: the server: admission's answer to a start or watch, the engine's chunks out, the WebSocket and WHEP doors.
- `protocol`: one viewer's side of the wire as a state machine (sans-I/O): its messages in, the actions out.
- `driver`: one viewer's protocol carried out against the server, whatever carries it (a WebSocket, a WHEP
  session, a cluster replica's call).
- `streams`: what a viewer may ask of its stream once admitted (prompts, pause, stats, handover, record).
- `session`: a stream's state, prompts and viewers (the steerer and the watchers), and its kept chunks.
- `outbox`: one viewer's queue of messages and chunks, bounded, and what to drop when it does not read.
- `record`: a stream recorded as it is sent (MP4, a chapter per prompt), and the recordings' store.
"""
