"""The engine: the device's loop that turns the scheduler's plans into chunks.

- `engine`: the `Engine` thread: streams in, forwards run by plan, chunks out to the event loop.
- `commands`: what other threads ask of the engine thread, queued and applied between launches.
- `config`: its configuration (`EngineConfig`), `errors`: its exception.
- `reports`: what the event loop reads of it: frozen descriptions (a stream's, its figures), never the model.
- `warmup`: the start-up run that measures each forward's cost before the first stream is admitted.
- `output`: the output stage (decode, encode) beside the device's work; `encode`: the H.264 encoders (x264 in
  a child process: `python -m streamsvc.engine.encode`).
- `parking`: a paused stream's KV cache moved off the device and back.
- `styles`: the style LoRAs a stream may run under (`serve --lora-dir`): loaded once, shared, evicted under a budget.
- `images`: streams that start from an image: its frame encoded and committed as the stream's chunk 0.
- `timing`: forwards timed without waiting for them (CUDA events; wall time on a CPU).
- `group`, `lockstep`: `--parallel K`, one stream's forwards split over K devices.
- `heap`: the serving process's memory over hours: closed streams' cycles collected soon, freed pages trimmed.
"""
