"""The input path: a viewer's camera (or a file, or a synthetic source) into its stream's chunks.

- `frames`: a stream's input timeline (`InputFrames`): frames by capture time, what a chunk takes, when it is due.
- `stage`: the engine's side: a chunk released by its input (or without it, once the camera is quiet), its frames
  handed to the generator.
- `ws`: input over the viewer's WebSocket (H.264 access units, `wire.framing`), decoded off the event loop.
- `rtc`: input over WebRTC (the player's camera, a WHIP publisher): aiortc's track into the timeline.
- `image`: a start image's bytes checked (type, declared size) and decoded into one frame at the model's size.
- `gate`: what every input path checks before a decoder allocates (the pixel cap, the frame rate).
- `bitstream`: an H.264 SPS and VP8 key-frame reader, for the gate's size check.
- `offline`, `synthetic`: `generate --input FILE`, and the load test's moving test pattern.
"""
