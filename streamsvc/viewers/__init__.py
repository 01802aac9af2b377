"""The viewers: a stream as the server sees it, and the people who watch and steer it.

- `server`: the server's driver: each connection's messages, admission's answer, the engine's chunks out.
- `protocol`: one viewer's side of the wire as a state machine (sans-I/O): its messages in, the actions out.
- `streams`: what a viewer may ask of its stream once admitted (prompts, pause, stats, handover, record).
- `session`: a stream's state, prompts and viewers (the steerer and the watchers), and its kept chunks.
- `outbox`: one viewer's queue of messages and chunks, bounded, and what to drop when it does not read.
- `record`: a stream recorded as it is sent (MP4, a chapter per prompt), and the recordings' store.
"""
