"""Beyond one GPU: each GPU's engine is a Ray Serve replica behind a gateway (the `[cluster]` extra).

- `placement`: pure logic, no Ray: what a replica reports (`ReplicaStats`) and where a new stream goes
  (`rank_replicas`: the replicas with room first, most free KV first; the engine's admission decides).
- `replica`: the Serve deployment, one engine per GPU (`num_gpus=1`). It runs the same `streamsvc.viewers.server.Server`
  as `streamsvc serve`, without a socket: each session arrives as one streaming call from the gateway (its
  lease), the viewer's messages as calls pinned to that replica, and everything the server would send
  comes back as the call's items. WebRTC media goes directly between the replica and the browser.
- `router`: the Serve request router: new streams by `rank_replicas`, a session's messages to its replica.
- `gateway`: the HTTP/WebSocket front (player, /ws, /healthz, /metrics) as a Ray driver, relaying each
  viewer's WebSocket to its replica; a lost replica's viewers get a retryable `worker_lost` error.
- `whip_relay`: WHIP through the gateway: a publisher's POST goes to the replica that runs its stream.
- `launch`: Ray's start-up with loopback defaults, the Serve application, and `streamsvc serve --cluster`.

Only `streamsvc serve --cluster` imports this package (and Ray); `streamsvc serve` never does.
Dependencies: cluster -> server, engine, session, protocol; nothing of ours imports cluster but the CLI.
"""
