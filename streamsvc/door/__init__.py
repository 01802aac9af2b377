"""The door: how a client gets in, before it is a viewer.

- `front`: the one port: HTTP and WebSocket through aiohttp, TCP or TLS, every request handed to its handlers.
- `routes`: the plain HTTP answers (player, /healthz, /metrics, recordings) and their checks.
- `guard`: per-address limits on connections and requests, and the refusals that say when to try again.
- `access`: tokens, secrets, origins, rates and the caps on what a client may open.
- `entry`: who may open or watch a stream (the token, the server's cap, the caps per token and address) and each
  refusal's code: one room for the server and the cluster's gateway.
- `port`: a server's listening port (and --metrics-port's) with the guard's hooks, and running until a signal.
- `whep`, `whip`: WebRTC's standard players (WHEP, to watch) and publishers (WHIP, a camera in).
- `images`: start images uploaded over HTTP (POST /images), decoded once and kept a while for a start to name.
- `cpumeter`: the event loop's CPU on clients that hold no stream, counted apart from the streams'.
- `aiohttp_hooks`: the only module of streamsvc/ that touches aiohttp's private names (a WebSocket's message limit
  raised), listed in its `HOOKED` with the version it was tested against.
"""
